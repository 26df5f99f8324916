"""The `mmvsd` engine: mmvsd's own decode loop in this process (exact tree verification, every drafter kind and
modality), the lossless reference and the default of every command.

Its one step beyond loading the target is explicit here, not inside `load_target`: on a CPU, the kernels
(`mmvsd.decoding.cpu_kernels`): `--dtype auto` chooses fp32 or bf16 with the exact kernels by measurement (cached per
machine and target, spot-checked once per process, re-measured at most once a day), and a half-precision target
gets the exact kernels where this CPU allows them.
"""

from __future__ import annotations

from contextlib import ExitStack
from typing import Any

from mmvsd import target_loader
from mmvsd.decoding.cpu_kernels import decoding_kernels
from mmvsd.decoding.engines import Engine, register_engine
from mmvsd.placement import placement
from mmvsd.target import Target


class MmvsdLoop(Engine):
    name = "mmvsd"
    report_note = ("Engine: mmvsd's own loop. tau: kept new tokens / target forwards, bonus token counted. SR: "
                   "throughput ratio to mmvsd's own vanilla loop at the same batch size (SR vs HF / vs prompt lookup: "
                   "to transformers generate / prompt lookup, batch 1).")

    def load_target(self, spec: str, dtype: str, device: str) -> Target:
        self.check(spec)  # a target that names nothing: one message, before anything loads
        torch_dtype, device = placement(device, dtype)
        target = target_loader.load_target(spec, torch_dtype, device)  # by attribute: tests spy on the loader
        return decoding_kernels(target, auto=torch_dtype is None)

    def bench_methods(self, config, target: Target, stack: ExitStack) -> list:
        from mmvsd.eval.bench import build_methods  # the bench's own rows: loaded when it runs

        return build_methods(config, target)

    def answers(self, target: Target, options: dict[str, Any]) -> None:
        return None  # `mmvsd regenerate` decodes with its own exact loop


MMVSD_LOOP = register_engine(MmvsdLoop())
