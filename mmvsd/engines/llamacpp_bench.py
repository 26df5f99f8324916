"""`mmvsd bench --engine llama.cpp`: the bench's methods run inside llama.cpp (`llama-server` subprocesses) on the
very GGUF file mmvsd reads the target from, prompts sent as mmvsd's token ids, so every row sees the same prompt.

Rows (`--methods`):
    vanilla    llama.cpp's plain decoding: the SR denominator and the T=0 reference every row is compared with
    pld        its own n-gram lookup (`--spec-type ngram-simple`)
    assisted   draft-simple with `--assistant MODEL`'s GGUF (a draft model with the target's tokenizer)
    tree       one row per `--drafter`: an EAGLE-3 drafter (a folder, `default` or a shipped name) exported to GGUF
               and run with `--spec-type draft-eagle3`; a draft model (`model:NAME`, or a target whose default is
               one) with draft-simple. llama.cpp drafts chains, so the rows are `chain:<drafter>`; their draft
               length comes from `--chain`: `N/PMIN` (n_max and p_min), `llama` (llama.cpp's defaults) or `auto`
               (planned from llama.cpp's measured costs and the drafter's chains on held-out prompts)
Each server decodes with `-np 1` (batch 1) and `cache_prompt` off; a record's wall time is the request's, prompt
processing included, as a user waits for it; llama.cpp's own draft counts go into the record.
"""

from __future__ import annotations

import time
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

from mmvsd.checkpoints import CONFIG_FILE, read_config
from mmvsd.decoding.decode import DecodeConfig, SequenceResult
from mmvsd.drafters.export_spec import draft_model_name, drafter_folder
from mmvsd.engines.llamacpp_server import LlamaServer
from mmvsd.errors import UserError
from mmvsd.eval.bench_method import Method
from mmvsd.layouts.export import export_drafter
from mmvsd.target import Target
from mmvsd.target_loader import target_gguf_file

ENGINE = "llama.cpp"
METHODS = ("vanilla", "pld", "assisted", "tree")
NGRAM_ARGS = ("--spec-type", "ngram-simple")
MEDIA_NOTE = "llama.cpp runs text prompts here: mmvsd's image adapters have no GGUF counterpart"
DEFAULT_CHAIN = "llama"  # llama.cpp's own n_max / p_min
AUTO = "auto"  # planned per drafter row (`mmvsd.engines.llamacpp_plan`)


def chain_args(chain: str) -> list[str]:
    """`--spec-draft-n-max/-p-min` for a chain setting `N/PMIN` (or `N`); none for `llama` (its defaults)."""
    if chain == DEFAULT_CHAIN:
        return []
    n_max, _, p_min = chain.partition("/")
    try:
        n, p = int(n_max), float(p_min or 0.0)
    except ValueError:
        raise UserError(f"--chain {chain!r}: give N/PMIN (draft up to N tokens, stop below probability PMIN), N, "
                        f"or {DEFAULT_CHAIN}") from None
    if n < 1 or not 0.0 <= p < 1.0:
        raise UserError(f"--chain {chain!r}: N >= 1 and 0 <= PMIN < 1")
    return ["--spec-draft-n-max", str(n), "--spec-draft-p-min", f"{p:g}"]


def llamacpp_methods(config, target: Target, stack: ExitStack) -> list[Method]:
    """Start one llama-server per row (stopped when `stack` closes) and return the rows as bench methods."""
    check_llamacpp_config(config)
    model = target_file(config.target_name())
    rows: list[tuple[str, list[str]]] = []
    for name in config.methods:
        if name == "vanilla":
            rows.append(("vanilla", []))
        elif name == "pld":
            rows.append(("pld", list(NGRAM_ARGS)))
        elif name == "assisted":
            rows.append(("assisted", draft_simple(target_file(config.assistant), config.chain)))
        else:
            rows += [(f"chain:{label}", args) for label, args in drafter_rows(config, target)]
    methods = []
    for label, args in rows:
        server = stack.enter_context(LlamaServer(model, args))
        methods.append(Method(label, ServerGenerate(server), False, batch_one=True, media_refusal=MEDIA_NOTE))
    return methods


def check_llamacpp_config(config) -> None:
    """UserError for rows llama.cpp cannot run (methods, `--chain`, GGUF files, draft models planned by `auto`),
    found before a target loads or a server starts."""
    unknown = [m for m in config.methods if m not in METHODS]
    if unknown:
        raise UserError(f"--engine {ENGINE} runs {', '.join(METHODS)}; not {', '.join(unknown)} (transformers' "
                        "methods run with --engine mmvsd)")
    if config.chain != AUTO:
        chain_args(config.chain)
    target_file(config.target_name())
    if "assisted" in config.methods:
        target_file(config.assistant)
    for spec in config.drafters or []:
        folder = Path(spec).expanduser()
        layers = read_config(folder).get("num_layers", 1) if (folder / CONFIG_FILE).is_file() else 1
        if layers != 1:
            raise UserError(f"--drafter {spec}: llama.cpp's EAGLE-3 holds one decoder layer; this drafter has "
                            f"{layers} (bench it with --engine mmvsd)")
    for spec in (config.drafters or ["default"]) if config.chain == AUTO else []:
        if draft_model_name(spec, config.target_name()) is not None:
            raise UserError(f"--chain auto plans neural drafters' chains (mmvsd's exact replay does not run a draft "
                            f"model); give --drafter {spec} a --chain N/PMIN, or llama")


def target_file(spec: str) -> Path:
    """The GGUF file llama.cpp reads for target (or draft model) `spec`; UserError if it has none."""
    path = target_gguf_file(spec)
    if path is None:
        raise UserError(f"--engine {ENGINE} needs a GGUF file for {spec!r} (a built-in GGUF target or a .gguf path); "
                        "convert a folder with llama.cpp's convert_hf_to_gguf.py first")
    return path


def draft_simple(draft: Path, chain: str) -> list[str]:
    """Arguments of the `assisted` row: draft-simple with the draft model's GGUF `draft` (llama.cpp's defaults for
    `auto`: the plan belongs to the drafter rows)."""
    return ["-md", str(draft), "--spec-type", "draft-simple", *chain_args(DEFAULT_CHAIN if chain == AUTO else chain)]


def drafter_rows(config, target: Target) -> list[tuple[str, list[str]]]:
    """(label, server arguments) per `--drafter`: EAGLE-3 drafters exported to GGUF, draft models as they are."""
    rows = []
    for spec in config.drafters or ["default"]:
        label = Path(spec).name if Path(spec).expanduser().is_dir() else spec
        model = draft_model_name(spec, config.target_name())
        if model is not None:
            draft = ["-md", str(target_file(model)), "--spec-type", "draft-simple"]
        else:
            out = Path(config.out) / "gguf" / f"{label}.gguf"
            if not out.is_file():
                export_drafter(drafter_folder(spec, config.target_name()), "gguf", out, target=target)
            draft = ["-md", str(out), "--spec-type", "draft-eagle3"]
        chain = config.chain
        if chain == AUTO:
            from mmvsd.engines.llamacpp_plan import plan_row  # the planner measures and replays: only for auto

            chain = plan_row(config, target, spec, target_file(config.target_name()), draft).chain()
        rows.append((label, [*draft, *chain_args(chain)]))
    return rows


@dataclass
class EngineResult(SequenceResult):
    """A result with the engine's own draft counts (llama.cpp's `timings.draft_n`, `draft_n_accepted`)."""

    num_drafted: int = 0
    num_draft_accepted: int = 0


class ServerGenerate:
    """A bench method backed by one llama-server: prompts (token ids) -> results, one request each."""

    def __init__(self, server: LlamaServer) -> None:
        self.server = server

    def __call__(self, prompts: list, config: DecodeConfig) -> list[EngineResult]:
        return [self.one(list(prompt), config) for prompt in prompts]

    def one(self, prompt_ids: list[int], config: DecodeConfig) -> EngineResult:
        """One request; the answer's token ids as llama.cpp returns them (it stops at EOS without returning it)."""
        start = time.perf_counter()
        reply = self.server.complete(prompt_ids, config.max_new_tokens, config.temperature, config.seed)
        wall = time.perf_counter() - start
        timings = reply.get("timings", {})
        return EngineResult(prompt_ids, [int(t) for t in reply.get("tokens", [])], wall_seconds=wall, finished=True,
                            num_drafted=int(timings.get("draft_n", 0)),
                            num_draft_accepted=int(timings.get("draft_n_accepted", 0)))
