"""The `llama.cpp` engine: `llama-server` subprocesses (the `llamacpp` extra) on the very GGUF file mmvsd reads
the target from, prompts sent as mmvsd's token ids. Text only; llama.cpp drafts chains, not trees.

`mmvsd bench --engine llama.cpp`: its plain decoding, n-gram lookup, draft model and EAGLE-3 drafters exported to
GGUF, one server per row (`llamacpp_bench.py`, `--chain auto`: `llamacpp_plan.py`). `mmvsd regenerate --engine
llama.cpp`: one server with many slots answers a dataset (`llamacpp_answers.py`). mmvsd's own copy of the target
only tokenizes and explains mismatches, so it loads in fp32 with stock kernels and no measurement.
"""

from __future__ import annotations

from contextlib import ExitStack
from typing import Any

import torch

from mmvsd.decoding.engines import Engine, register_engine
from mmvsd.engines.llamacpp_bench import ENGINE, check_llamacpp_config, target_file
from mmvsd.placement import placement
from mmvsd.target import Target
from mmvsd.target_loader import load_target


class LlamaCpp(Engine):
    name = ENGINE
    report_note = ("Engine: llama.cpp (llama-server, batch 1; wall time per request, prompt processing included). "
                   "vanilla: its plain decoding; pld: its n-gram lookup (ngram-simple); assisted: draft-simple with "
                   "the draft model; chain:X: drafter X's chains. SR: throughput ratio to llama.cpp's plain decoding; "
                   "SR vs prompt lookup: to its n-gram lookup. drafts accepted: accepted / drafted tokens, as "
                   "llama.cpp counts them.")
    batch_one = True
    media = False

    def check(self, target: str) -> None:
        super().check(target)
        target_file(target)

    def check_bench(self, config) -> None:
        super().check_bench(config)
        check_llamacpp_config(config)  # its methods, --chain, the draft models' GGUF files

    def load_target(self, spec: str, dtype: str, device: str) -> Target:
        self.check(spec)  # a target that names nothing, or has no GGUF file: before anything loads
        torch_dtype, device = placement(device, dtype)
        return load_target(spec, torch_dtype or torch.float32, device)  # tokenizes: no kernels to choose

    def bench_methods(self, config, target: Target, stack: ExitStack) -> list:
        from mmvsd.engines.llamacpp_bench import llamacpp_methods  # starts servers: loaded when a bench runs

        return llamacpp_methods(config, target, stack)

    def answers(self, target: Target, options: dict[str, Any]):
        from mmvsd.engines.llamacpp_answers import LlamaCppAnswers  # loaded when a regeneration runs

        return LlamaCppAnswers(target_file(target.name), parallel=options.get("parallel", 8),
                               context_per_slot=options.get("context_per_slot", 2048),
                               threads=options.get("threads", 0))


LLAMA_CPP = register_engine(LlamaCpp())
