"""`mmvsd bench`: every method on the same prompts, interleaved per prompt, after a warm-up.

Methods (`--methods`):
    vanilla    mmvsd's own autoregressive loop: the speed-up (SR) denominator
    hf         transformers `generate` (batch 1)
    pld        transformers prompt lookup decoding (`prompt_lookup_num_tokens=10`, batch 1)
    assisted   transformers assisted generation with `--assistant MODEL` (same tokenizer, batch 1)
    tree       mmvsd tree speculative decoding, once per `--drafter` and `--tree` shape (rows `tree:<spec>`:
               `tree:random`, `tree:<folder name>`; with several shapes `tree:<spec>@<shape>`). The default
               shape `auto` plans each step from this machine's measured costs and the acceptance seen so far
               (learnt across the prompts of a row, per temperature); `paper` is 60/7/10 (60/5/8 on images)
Multi-turn items (MT-Bench) ask turn k after each method's OWN answer to turn k-1, as EAGLE's
evaluation does. At T=0 EVERY method's output is checked against the own vanilla loop token for
token, per prompt; the report flags a method with a mismatch and does not show its ratio as a
speed-up. HF prompt lookup is refused on image prompts (transformers re-embeds `input_ids` there
and never sees the image), with a note in the table. HF baselines run one prompt at a time: with
`--batch-size` > 1 a batch-1 vanilla reference (`vanilla@b1`) runs too and is their SR denominator.
Timing: each method's whole batch is timed; throughput = total new tokens / total batch wall time.
Per-prompt records go to OUT/records.jsonl as they complete, so `--resume` continues a run.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from mmvsd.adapter_base import Prompt
from mmvsd.decoding.decode import DecodeConfig, SequenceResult, speculative_generate, vanilla_generate
from mmvsd.decoding.engines import get_engine
from mmvsd.decoding.shape_policy import AcceptanceStats
from mmvsd.drafters.draft_model import PREFIX as DRAFT_MODEL
from mmvsd.drafters.draft_model import load_draft_model
from mmvsd.drafters.spec import drafter_from_spec
from mmvsd.errors import UserError
from mmvsd.eval.baselines import hf_generate
from mmvsd.eval.bench_config import BenchConfig
from mmvsd.eval.bench_item import BenchItem
from mmvsd.eval.bench_method import Method
from mmvsd.eval.media_writer import MediaWriter
from mmvsd.eval.report import write_reports
from mmvsd.eval.suites import (
    benchmark,
    is_multimodal,
    is_synthetic,
    load_items,
    resolve_suite,
    synthetic_note,
)
from mmvsd.files import jsonl_lines
from mmvsd.shipped import has_default
from mmvsd.target import Target
from mmvsd.tree_options import tree_shape

RECORDS = "records.jsonl"
PLD_TOKENS = 10
WARMUP_TOKENS = 16
BATCH_ONE_VANILLA = "vanilla@b1"
PLD_MEDIA_NOTE = ("refused on image prompts: transformers' prompt lookup re-embeds input_ids and drops the "
                  "image embeddings, so it would answer without the image")


def drafter_label(spec: str) -> str:
    """Row label of a drafter: `tree:<spec as given>`, a folder by its name (`tree:random`, `tree:fitted`)."""
    return f"tree:{Path(spec).name}" if Path(spec).expanduser().is_dir() else f"tree:{spec}"


def one_by_one(generate: Callable) -> Callable:
    """A batch generate that decodes its prompts one at a time (batch size 1)."""
    return lambda prompts, config: [generate(prompt, config) for prompt in prompts]


def build_methods(config: BenchConfig, target: Target) -> list[Method]:
    """The methods of `config`, in the order they run on each prompt."""
    methods = []
    for name in config.methods:
        if name == "vanilla":
            methods.append(Method("vanilla", lambda p, c: vanilla_generate(target, p, c), True,
                                  batch_one=config.batch_size == 1))
        elif name == "hf":
            methods.append(Method("hf", one_by_one(lambda ids, c: hf_generate(target, ids, c)), False, True))
        elif name == "pld":
            methods.append(Method("pld", one_by_one(lambda ids, c: hf_generate(target, ids, c, PLD_TOKENS)), False,
                                  True, PLD_MEDIA_NOTE))
        elif name == "assisted":
            assistant = load_assistant(config.assistant, target)
            methods.append(Method("assisted", one_by_one(lambda ids, c, a=assistant: hf_generate(
                target, ids, c, assistant_model=a)), False, True))
        else:
            methods += tree_methods(config, target)
    if config.batch_size > 1 and any(m.batch_one for m in methods):
        methods.append(Method(BATCH_ONE_VANILLA, one_by_one(lambda ids, c: vanilla_generate(target, [ids], c)[0]),
                              True, True))
    labels = [m.name for m in methods]
    if len(set(labels)) != len(labels):
        raise UserError(f"two methods share a row label ({', '.join(labels)}): give drafter folders distinct names")
    return methods


def tree_methods(config: BenchConfig, target: Target) -> list[Method]:
    """One tree-decoding method per `--drafter` and `--tree` shape."""
    methods = []
    for spec in config.drafters or ["default" if has_default(config.target_name()) else "random"]:
        drafter = drafter_from_spec(spec, target, config.seed)
        if drafter is None:
            raise UserError("--drafter none: use --methods vanilla (or hf) for plain decoding")
        for tree in config.trees:
            label = drafter_label(spec) + (f"@{tree}" if len(config.trees) > 1 else "")
            methods.append(Method(label, TreeGenerate(target, drafter), True, tree=tree))
    return methods


class TreeGenerate:
    """Speculative decoding with one drafter; an auto shape keeps learning acceptance across calls (`stats`,
    one per temperature: acceptance at T=1 is not acceptance at T=0)."""

    def __init__(self, target: Target, drafter) -> None:
        self.target, self.drafter = target, drafter
        self.stats: dict[float, AcceptanceStats] = {}

    def __call__(self, prompts: list, config: DecodeConfig) -> list[SequenceResult]:
        learnt = self.stats.setdefault(config.temperature, AcceptanceStats()) if config.tree == "auto" else None
        return speculative_generate(self.target, self.drafter, prompts, config, stats=learnt)


def load_assistant(spec: str, target: Target):
    """The assistant model for transformers' assisted generation: the draft model `--drafter model:SPEC` loads
    (the same dtype, kernels and tokenizer check), so both draft with identical weights."""
    assistant = load_draft_model(f"{DRAFT_MODEL}{spec}", target).model
    if assistant.vocab_size != target.vocab_size:
        raise UserError(f"--assistant {spec!r} has a vocabulary of {assistant.vocab_size}, the target "
                        f"{target.vocab_size}: assisted generation needs the same tokenizer")
    return assistant.model


@dataclass
class Record:
    """One method's answers to one item at one temperature."""

    benchmark: str
    item_id: str
    method: str
    temperature: float
    output_ids: list[list[int]] = field(default_factory=list)  # per turn
    new_tokens: int = 0  # kept tokens (after EOS and max-length truncation)
    wall_seconds: float = 0.0  # this prompt's own decoding time (per row; at batch > 1 rows overlap)
    batch_id: str = ""  # the batch this record was decoded in (same for its batch-mates)
    batch_wall_seconds: float = 0.0  # wall time of that whole batch for this method (all turns)
    batch_size: int = 1  # prompts decoded together
    target_forwards: int = 0  # own loops only (0: not counted)
    accept_lengths: list[int] = field(default_factory=list)  # kept tokens per target forward
    tree_sizes: list[int] = field(default_factory=list)  # nodes verified per step, where the decoder says
    answer: str = ""  # the last turn's text
    correct: float | None = None  # the benchmark's score of the answer (1/0 for exact checks), None: unscored
    mismatch: dict | None = None  # T=0 check against vanilla failed: turn, position, target logit margin
    refused: str = ""  # non-empty: the method did not run on this item, and why
    synthetic: bool = False  # the benchmark is an offline stand-in (synthetic images), not the real task
    drafted: int = 0  # draft tokens the engine proposed (llama.cpp reports them; mmvsd's loop counts forwards)
    draft_accepted: int = 0  # of those, accepted

    def add(self, result: SequenceResult, own_loop: bool) -> None:
        self.output_ids.append(list(result.output_ids))
        self.new_tokens += len(result.output_ids)
        self.wall_seconds += result.wall_seconds
        if own_loop:
            self.target_forwards += result.num_target_forwards
            self.accept_lengths += kept_lengths(result.accept_lengths, len(result.output_ids))
            self.tree_sizes += list(getattr(result, "tree_sizes", None) or [])
        self.drafted += getattr(result, "num_drafted", 0)  # engines that count their drafts (llama.cpp)
        self.draft_accepted += getattr(result, "num_draft_accepted", 0)


def kept_lengths(accept_lengths: list[int], num_kept: int) -> list[int]:
    """Tokens per target forward counting only tokens kept after EOS / max-length truncation, so the
    histogram's mean is tau = kept tokens / target forwards (a no-op when the decoder already clips)."""
    out, left = [], num_kept
    for length in accept_lengths:
        out.append(min(length, left))
        left -= out[-1]
    return out


def decode_config(config: BenchConfig, method: Method, temperature: float, benchmark_name: str = "") -> DecodeConfig:
    """Decoding settings of one method; its tree shape resolved for the benchmark's kind (text or images)."""
    tree = tree_shape(method.tree, is_multimodal([benchmark_name]) if benchmark_name else False)
    return DecodeConfig(config.max_new_tokens, temperature=temperature, seed=config.seed, tree=tree)


@torch.no_grad()
def logit_margin(target: Target, prompt: list[int] | Prompt, prefix_ids: list[int]) -> float:
    """Target's top-1 minus top-2 logit after prompt + prefix: near 0 is a numerical tie, not a bug."""
    prompt = prompt if isinstance(prompt, Prompt) else Prompt(list(prompt))
    ids = torch.tensor([prompt.token_ids + prefix_ids], device=target.device)
    embeds = target.input_embeddings(ids)
    if prompt.inputs_embeds is not None:
        embeds[0, : len(prompt.token_ids)] = prompt.inputs_embeds.to(embeds.device, embeds.dtype)
    top = target.model(inputs_embeds=embeds).logits[0, -1].float().topk(2).values
    return float(top[0] - top[1])


def make_prompt(target: Target, messages: list[dict], item: BenchItem, turn: int, media: MediaWriter):
    """Token ids of the conversation so far, or a `Prompt` with the item's images on its first turn."""
    if item.images and turn == 0:
        adapter, paths = media.files(target, item)
        return adapter.encode(target, item.turns[0], paths)
    return target.encode_chat(messages)


def first_mismatch(target: Target, prompt, expected: list[int], got: list[int], turn: int) -> dict | None:
    """Where a method's output first leaves the vanilla output, with the target's margin there (None: equal)."""
    if expected == got:
        return None
    position = next((i for i, (a, b) in enumerate(zip(expected, got)) if a != b), min(len(expected), len(got)))
    margin = logit_margin(target, prompt, expected[:position])
    return {"turn": turn, "position": position, "expected": expected[position:position + 1],
            "got": got[position:position + 1], "logit_margin": margin}


def has_media(prompt) -> bool:
    return isinstance(prompt, Prompt) and prompt.inputs_embeds is not None


def run_batch(target: Target, methods: list[Method], items: list[BenchItem], temperature: float,
              config: BenchConfig, media: MediaWriter | None = None) -> list[Record]:
    """All methods on a batch of items of one benchmark, turn by turn, each on its own history; at T=0
    every method's output is compared with vanilla's."""
    media = media or MediaWriter(Path(config.out) / "images", config.adapter)
    batch_id = f"{temperature:g}:{items[0].benchmark}:{items[0].item_id}"
    records = {m.name: [Record(it.benchmark, it.item_id, m.name, temperature, batch_id=batch_id,
                               batch_size=1 if m.batch_one else len(items), synthetic=is_synthetic(it.benchmark))
                        for it in items] for m in methods}
    histories = {m.name: [[] for _ in items] for m in methods}
    for turn in range(len(items[0].turns)):
        vanilla_outputs = None
        for method in methods:
            prompts = []
            for row, item in enumerate(items):
                histories[method.name][row].append({"role": "user", "content": item.turns[turn]})
                prompts.append(make_prompt(target, histories[method.name][row], item, turn, media))
            if method.media_refusal and any(has_media(p) for p in prompts):
                for record in records[method.name]:
                    record.refused = method.media_refusal
                continue
            decode = decode_config(config, method, temperature, items[0].benchmark)
            start = time.perf_counter()
            results = method.generate(prompts, decode)
            wall = time.perf_counter() - start
            for row, result in enumerate(results):
                record = records[method.name][row]
                record.add(result, method.own_loop)
                record.batch_wall_seconds += wall
                record.answer = target.decode(result.output_ids)
                histories[method.name][row].append({"role": "assistant", "content": record.answer})
                if temperature == 0 and method.name != "vanilla" and record.mismatch is None:
                    record.mismatch = first_mismatch(target, prompts[row], vanilla_outputs[row],
                                                     list(result.output_ids), turn)
            if method.name == "vanilla":
                vanilla_outputs = [list(r.output_ids) for r in results]
    score = benchmark(items[0].benchmark).score
    all_records = [record for name in records for record in records[name]]
    if score is not None:
        for record, item in zip(all_records, items * len(methods)):
            if not record.refused:
                value = score(record.answer, item.reference)
                record.correct = None if value is None else float(value)
    return all_records


def read_records(out_dir: Path) -> list[Record]:
    """Records written so far (a line cut off by an interruption is ignored)."""
    path = out_dir / RECORDS
    records = []
    if path.is_file():
        for line in jsonl_lines(path.read_text(encoding="utf-8")):
            try:
                records.append(Record(**json.loads(line)))
            except (json.JSONDecodeError, TypeError):
                continue
    return records


def completed_keys(records: list[Record], methods: list[Method]) -> set[tuple[str, str, float]]:
    """(benchmark, item, temperature) keys every method has answered."""
    names: dict[tuple[str, str, float], set[str]] = {}
    for record in records:
        names.setdefault((record.benchmark, record.item_id, record.temperature), set()).add(record.method)
    wanted = {m.name for m in methods}
    return {key for key, done in names.items() if wanted <= done}


def check_out_dir(out_dir: Path, config: BenchConfig, resume: bool) -> None:
    """A fresh run needs an empty folder; --resume needs the same settings (a larger --limit is fine)."""
    saved = out_dir / "bench_config.json"
    if not resume:
        if (out_dir / RECORDS).is_file():
            raise UserError(f"{out_dir} already holds bench records; pass --resume to continue, or another --out")
        return
    if not saved.is_file():
        raise UserError(f"--resume: no bench run in {out_dir}")
    before = {k: v for k, v in json.loads(saved.read_text()).items() if k != "limit"}
    now = {k: v for k, v in json.loads(json.dumps(asdict(config))).items() if k != "limit"}
    defaults = asdict(BenchConfig())  # settings added since that run was saved had their defaults then
    changed = sorted(k for k in now if before.get(k, defaults[k]) != now[k])
    if changed:
        raise UserError(f"--resume: settings differ from the interrupted run ({', '.join(changed)})")


def warm_up(methods: list[Method], target: Target, item: BenchItem, config: BenchConfig, media: MediaWriter) -> None:
    """One short generation per method, so no method pays first-call costs inside the measurement."""
    prompt = make_prompt(target, [{"role": "user", "content": item.turns[0]}], item, 0, media)
    for method in methods:
        if not (method.media_refusal and has_media(prompt)):
            tree = decode_config(config, method, 0.0, item.benchmark).tree
            method.generate([prompt], DecodeConfig(WARMUP_TOKENS, tree=tree))


def run_bench(config: BenchConfig, target: Target | None = None, resume: bool = False,
              progress: bool = True) -> Path:
    """Run (or resume) a benchmark and write its records and reports to `config.out`."""
    config.validate()
    out_dir = Path(config.out)
    check_out_dir(out_dir, config, resume)
    names = resolve_suite(config.suite)
    for note in filter(None, map(synthetic_note, names)):
        print(f"mmvsd: note: {note}", file=sys.stderr)
    engine = get_engine(config.engine)
    if target is None:  # in the precision and kernels that engine needs (another engine's only tokenizes)
        target = engine.load_target(config.target_name(), config.dtype, config.device)
    with ExitStack() as servers:  # an engine's subprocesses stop here, on errors and Ctrl-C too
        methods = sorted(engine.bench_methods(config, target, servers), key=lambda m: m.name != "vanilla")
        run_methods(config, target, methods, out_dir, progress)
    return out_dir


def run_methods(config: BenchConfig, target: Target, methods: list[Method], out_dir: Path, progress: bool) -> None:
    """Decode every benchmark item not yet recorded with every method, then write the reports."""
    names = resolve_suite(config.suite)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "bench_config.json").write_text(json.dumps(asdict(config), indent=2) + "\n")
    done = completed_keys(read_records(out_dir), methods)
    work = [(t, b, [it for it in load_items(b, config.limit) if (b, it.item_id, t) not in done])
            for t in config.temperatures for b in names]
    media = MediaWriter(out_dir / "images", config.adapter)
    first = next((items[0] for _, _, items in work if items), None)
    if first is not None:
        warm_up(methods, target, first, config, media)
    bar = tqdm(total=sum(len(items) for _, _, items in work), desc="bench", dynamic_ncols=True, disable=not progress)
    with open(out_dir / RECORDS, "a") as handle:
        for temperature, _, items in work:
            for start in range(0, len(items), config.batch_size):
                batch = items[start:start + config.batch_size]
                records = run_batch(target, methods, batch, temperature, config, media)
                handle.writelines(json.dumps(asdict(record)) + "\n" for record in records)
                handle.flush()
                bar.update(len(batch))
    bar.close()
    placed = {"target_device": str(target.device), "target_dtype": str(target.dtype).removeprefix("torch.")}
    write_reports(out_dir, {**asdict(config), **placed}, read_records(out_dir), [m.name for m in methods])
