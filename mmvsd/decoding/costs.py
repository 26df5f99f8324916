"""The hardware cost model: measured seconds of a verify step and of drafting, cached per machine.

Whether a draft tree pays depends on the machine: on a GPU verifying 60 tokens costs about one
step, on a 2-core CPU 3-4 steps. `measure_costs` times the real code paths (`Target.forward` over a
tree-shaped block plus `RaggedCache.keep`, and a drafter's real `DraftSession`) warmed up, interleaved
across shapes and summarised by lower quartiles; `load_cost_table` does it once per (machine, target, dtype,
drafter architecture, batch sizes) and caches the JSON under the mmvsd cache. The shape policy reads
the resulting `CostTable`; nothing here decides shapes.
"""

from __future__ import annotations

import hashlib
import json
import logging
import platform
import re
import sys
import time
import weakref
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor
from tqdm import tqdm

from mmvsd.decoding.kv import RaggedCache, sequence_block
from mmvsd.decoding.tree import DraftTree
from mmvsd.drafter_base import DraftInputs
from mmvsd.files import atomic_file, cache_root
from mmvsd.target import Target

logger = logging.getLogger(__name__)
METHOD_VERSION = "1"  # bump when the measurement changes meaning: older cache files are then ignored
TARGET_TOKENS = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 20, 24, 32, 48, 64)
DRAFT_WIDTHS = (1, 2, 4, 8, 10, 16)
DRAFT_TOPK = 10  # children asked of every expanded node (the cost hardly depends on it)
ACCEPTED_PAIRS = 3  # pairs the drafter is fed per step in the fixed-cost measurement (a typical tau)


@dataclass(frozen=True)
class CostTable:
    """Typical (lower-quartile) seconds of a verify step and of drafting, by shape and batch, on one machine."""

    key: dict[str, str]  # machine / target / dtype / drafter fields it was measured for
    target_tokens: tuple[int, ...]  # verified-token counts measured
    target_seconds: dict[int, tuple[float, ...]]  # batch -> seconds of Target.forward (+ keep) per count
    draft_widths: tuple[int, ...]  # frontier widths measured (empty without drafter)
    draft_seconds: dict[int, tuple[float, ...]]  # batch -> seconds of one expand(...) call per width
    draft_fixed_seconds: dict[int, float]  # batch -> per-step advance + root_candidates (0 without drafter)
    context: int  # cache length the measurements used

    def target_step(self, num_nodes: int, batch: int = 1) -> float:
        """Seconds of one verify step over `num_nodes` tree tokens (piecewise linear in both)."""
        return _interp_batch({b: _interp(self.target_tokens, s, num_nodes) for b, s in self.target_seconds.items()},
                             batch)

    def draft_expand(self, width: int, batch: int = 1) -> float:
        """Seconds of one drafter expansion of a frontier of `width` nodes (0 without drafter)."""
        if not self.draft_widths:
            return 0.0
        return _interp_batch({b: _interp(self.draft_widths, s, width) for b, s in self.draft_seconds.items()}, batch)

    def draft_fixed(self, batch: int = 1) -> float:
        """Seconds per step the drafter costs whatever the shape (feeding accepted pairs, root top-k)."""
        return _interp_batch(self.draft_fixed_seconds, batch)

    def to_json(self) -> dict:
        return {
            "method": METHOD_VERSION, "key": self.key, "context": self.context,
            "target_tokens": list(self.target_tokens),
            "target_seconds": {str(b): list(s) for b, s in self.target_seconds.items()},
            "draft_widths": list(self.draft_widths),
            "draft_seconds": {str(b): list(s) for b, s in self.draft_seconds.items()},
            "draft_fixed_seconds": {str(b): s for b, s in self.draft_fixed_seconds.items()},
        }

    @classmethod
    def from_json(cls, data: dict) -> CostTable:
        """Parse and check a cached table (ValueError/KeyError/TypeError on anything malformed)."""
        tokens = tuple(int(n) for n in data["target_tokens"])
        widths = tuple(int(w) for w in data["draft_widths"])
        table = cls(
            key={str(k): str(v) for k, v in data["key"].items()},
            target_tokens=tokens,
            target_seconds={int(b): tuple(float(x) for x in s) for b, s in data["target_seconds"].items()},
            draft_widths=widths,
            draft_seconds={int(b): tuple(float(x) for x in s) for b, s in data["draft_seconds"].items()},
            draft_fixed_seconds={int(b): float(s) for b, s in data["draft_fixed_seconds"].items()},
            context=int(data["context"]),
        )
        _check_table(table)
        return table


def _check_table(table: CostTable) -> None:
    """ValueError unless every curve has one finite, non-negative value per measured point."""
    if not table.target_tokens or list(table.target_tokens) != sorted(set(table.target_tokens)):
        raise ValueError("target_tokens must be increasing and non-empty")
    if list(table.draft_widths) != sorted(set(table.draft_widths)):
        raise ValueError("draft_widths must be increasing")
    if not table.target_seconds or set(table.draft_fixed_seconds) != set(table.target_seconds):
        raise ValueError("batch sizes differ between the target and drafter entries")
    curves = [(table.target_tokens, s) for s in table.target_seconds.values()]
    curves += [(table.draft_widths, s) for s in table.draft_seconds.values()]
    values = [v for _, s in curves for v in s] + list(table.draft_fixed_seconds.values())
    if any(len(xs) != len(s) for xs, s in curves) or not all(0 <= v < float("inf") for v in values):
        raise ValueError("a curve has the wrong length or a negative / non-finite value")


def _interp(xs: tuple[int, ...], ys: tuple[float, ...], x: float) -> float:
    """Piecewise-linear y(x) through (xs, ys), extrapolated linearly past both ends, never below 0."""
    if len(xs) == 1:
        return ys[0] * x / xs[0]  # one point: proportional
    right = next((i for i in range(1, len(xs)) if x <= xs[i]), len(xs) - 1)
    x0, x1, y0, y1 = xs[right - 1], xs[right], ys[right - 1], ys[right]
    return max(0.0, y0 + (y1 - y0) * (x - x0) / (x1 - x0))


def _interp_batch(value_by_batch: dict[int, float], batch: int) -> float:
    """A value at `batch` from the measured batch sizes: exact, else linear (nearest with one measured)."""
    if batch in value_by_batch:
        return value_by_batch[batch]
    sizes = tuple(sorted(value_by_batch))
    if len(sizes) == 1:
        return value_by_batch[sizes[0]]
    return _interp(sizes, tuple(value_by_batch[b] for b in sizes), batch)


# ---------------------------------------------------------------------------------------------- measuring


def typical(values: list[float]) -> float:
    """The lower quartile of repeated timings: like the median for steady timings, but a process
    preempted in up to 3/4 of the rounds (a shared 2-core machine) still gets its real cost."""
    return sorted(values)[(len(values) - 1) // 4]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(device: torch.device, fn) -> float:
    """Wall seconds of fn(), with the device's queue drained before and after."""
    _sync(device)
    start = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - start


def _rewind(cache: RaggedCache, lens: Tensor) -> None:
    """Put a cache back to `lens` committed tokens per row (drops what later steps committed)."""
    cache.lens = lens.clone()
    cache.select_rows(torch.arange(cache.batch_size, device=lens.device))  # truncates to max(lens)


def _token_ids(count: int, vocab_size: int, device: torch.device) -> Tensor:
    """[count] fixed, varied token ids inside the vocabulary (what they are does not change the cost)."""
    return torch.arange(count, device=device) * 7 % min(vocab_size, 1000)


def _heap_tree(num_nodes: int, batch: int, vocab_size: int, device: torch.device) -> DraftTree:
    """A bushy tree of `num_nodes` nodes (node i's parent is (i-1)//2), the same in every row."""
    parents = torch.tensor([-1] + [(i - 1) // 2 for i in range(1, num_nodes)], device=device)
    depths = torch.zeros(num_nodes, dtype=torch.long, device=device)
    for i in range(1, num_nodes):
        depths[i] = depths[parents[i]] + 1
    ids = _token_ids(num_nodes, vocab_size, device)
    rows = [t[None].expand(batch, -1).contiguous() for t in (ids, parents, depths)]
    return DraftTree(*rows, torch.zeros(batch, num_nodes, device=device))


def _prefill(target: Target, batch: int, context: int, need_aux: bool):
    """A cache of `context` committed tokens per row (fixed pseudo-random ids) and the prefill output."""
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, min(target.vocab_size, 1000), (batch, context), generator=gen).to(target.device)
    cache = target.new_cache(batch)
    depths, causal = sequence_block(batch, context, target.device)
    lens = torch.full((batch,), context, dtype=torch.long, device=target.device)
    out = target.forward(cache, ids, depths, causal, need_aux=need_aux, logit_positions=(lens - 1)[:, None])
    cache.keep(depths, lens)
    return cache, ids, out


def _verify_step(target: Target, cache: RaggedCache, tree: DraftTree, need_aux: bool) -> None:
    """One verify step as decoding runs it: forward over the tree, keep a few accepted nodes."""
    target.forward(cache, tree.token_ids, tree.depths, tree.ancestor_mask(), need_aux=need_aux)
    last = torch.full((tree.token_ids.shape[0],), tree.num_nodes - 1, dtype=torch.long, device=cache.lens.device)
    path = tree.path_to(last)[:, :ACCEPTED_PAIRS + 1]
    num_keep = (path >= 0).sum(1)
    cache.keep(path.clamp(min=0), num_keep)


def _measure_target(target: Target, cache: RaggedCache, need_aux: bool, tokens: tuple[int, ...], repeats: int,
                    tick) -> tuple[float, ...]:
    """Typical seconds of a verify step per token count; rounds interleave the counts against drift."""
    lens = cache.lens.clone()
    trees = {n: _heap_tree(n, cache.batch_size, target.vocab_size, target.device) for n in tokens}
    for tree in trees.values():
        tree.ancestor_mask()  # computed by the tree builder in decoding, not by the verify step
    samples: dict[int, list[float]] = {n: [] for n in tokens}
    for round_index in range(repeats + 1):  # round 0 warms up
        for n in tokens:
            seconds = timed(target.device, lambda n=n: _verify_step(target, cache, trees[n], need_aux))
            _rewind(cache, lens)
            if round_index:
                samples[n].append(seconds)
            tick()
    return tuple(typical(samples[n]) for n in tokens)


def _draft_inputs(drafter, out, ids: Tensor, width: int) -> DraftInputs:
    """The drafter's pairs for the first `width` prefill positions."""
    features = drafter.target_features(out.aux_hidden, out.last_hidden)[:, :width]
    next_ids = torch.cat([ids[:, 1:], ids[:, :1]], dim=1)[:, :width]
    return DraftInputs(features, next_ids, torch.full((ids.shape[0],), width, dtype=torch.long, device=ids.device))


def _measure_drafter(drafter, target: Target, out, ids: Tensor, widths: tuple[int, ...], repeats: int,
                     tick) -> tuple[tuple[float, ...], float]:
    """(typical seconds of one expand per frontier width, typical fixed seconds per step).

    Each round opens a fresh decoding session on the prefill's first context-3 pairs (untimed), times
    one step's fixed work (advance 3 pairs, root candidates), then one first expansion per width."""
    batch, context = ids.shape
    device = target.device
    prompt_inputs = _draft_inputs(drafter, out, ids, context - ACCEPTED_PAIRS)
    step_inputs = _draft_inputs(drafter, out, ids, ACCEPTED_PAIRS)

    def fixed_step(session) -> None:
        session.advance(step_inputs)
        session.root_candidates(DRAFT_TOPK)

    def expand(session, width: int) -> None:  # every frontier node is a child of the root
        frontier = _token_ids(width, target.vocab_size, device).expand(batch, width)
        eye = torch.eye(width, dtype=torch.bool, device=device).expand(batch, width, width)
        session.expand(frontier, torch.zeros_like(frontier), eye, DRAFT_TOPK)

    fixed: list[float] = []
    samples: dict[int, list[float]] = {w: [] for w in widths}
    for round_index in range(repeats + 1):  # round 0 warms up
        session = drafter.new_session(batch)
        session.advance(prompt_inputs)
        seconds = timed(device, lambda s=session: fixed_step(s))
        if round_index:
            fixed.append(seconds)
        for width in widths:
            session.root_candidates(DRAFT_TOPK)  # (re)starts a round at the root
            seconds = timed(device, lambda s=session, w=width: expand(s, w))
            session.end_round()
            if round_index:
                samples[width].append(seconds)
        tick()
    return tuple(typical(samples[w]) for w in widths), typical(fixed)


@torch.no_grad()
def measure_costs(
    target: Target,
    drafter=None,
    batch_sizes: tuple[int, ...] = (1,),
    context: int = 256,
    repeats: int = 7,
    target_tokens: tuple[int, ...] = TARGET_TOKENS,
    draft_widths: tuple[int, ...] = DRAFT_WIDTHS,
    progress: bool = False,
) -> CostTable:
    """Time verify steps and drafting on this machine (warmed up, lower quartiles of `repeats` rounds).

    drafter: None, a neural `Drafter`, or any proposer with `new_session` (n-gram, hybrid)."""
    batch_sizes = tuple(sorted(set(batch_sizes)))
    if not batch_sizes or min(batch_sizes) < 1 or context < ACCEPTED_PAIRS + 1 or repeats < 1:
        raise ValueError(f"need batch sizes >= 1, context > {ACCEPTED_PAIRS} and repeats >= 1")
    widths = tuple(draft_widths) if drafter is not None else ()
    need_aux = drafter is not None and drafter.reads_aux
    bar = tqdm(total=len(batch_sizes) * (repeats + 1) * (len(target_tokens) + (1 if drafter else 0)),
               desc=f"mmvsd: measuring costs of {target.name}", disable=not progress, file=sys.stderr, leave=False)
    target_seconds, draft_seconds, fixed_seconds = {}, {}, {}
    for batch in batch_sizes:
        cache, ids, out = _prefill(target, batch, context, need_aux)
        target_seconds[batch] = _measure_target(target, cache, need_aux, tuple(target_tokens), repeats, bar.update)
        draft_seconds[batch], fixed_seconds[batch] = (), 0.0
        if drafter is not None:
            draft_seconds[batch], fixed_seconds[batch] = _measure_drafter(drafter, target, out, ids, widths,
                                                                          repeats, bar.update)
        del cache, out
    bar.close()
    table = CostTable(cost_key(target, drafter, batch_sizes, context), tuple(target_tokens), target_seconds,
                      widths, draft_seconds, fixed_seconds, context)
    _check_table(table)
    return table


# ---------------------------------------------------------------------------------------------- keying, cache


def machine_fingerprint(device: torch.device) -> dict[str, str]:
    """What makes timings from one machine meaningless on another: CPU, its flags, threads, torch, GPU."""
    model, flags = platform.processor() or platform.machine(), ""
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
        model = re.search(r"^model name\s*:\s*(.*)$", cpuinfo, re.MULTILINE).group(1).strip()
        flags = re.search(r"^flags\s*:\s*(.*)$", cpuinfo, re.MULTILINE).group(1).strip()
    except (OSError, AttributeError):
        pass
    accelerator = device.type
    if device.type == "cuda":
        accelerator = f"cuda:{torch.cuda.get_device_name(device)}"
    return {
        "cpu": model,
        "cpu_flags": hashlib.sha256(" ".join(sorted(flags.split())).encode()).hexdigest()[:16],
        "threads": str(torch.get_num_threads()),
        "torch": torch.__version__,
        "device": accelerator,
    }


_FINGERPRINTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> fingerprint


def target_fingerprint(target: Target) -> str:
    """A hash of the target's config and a few weight sums, computed once per loaded model (summing
    the embedding takes a tenth of a second, which every decode call would otherwise pay)."""
    if target.model not in _FINGERPRINTS:
        _FINGERPRINTS[target.model] = _fingerprint(target)
    return _FINGERPRINTS[target.model]


def _fingerprint(target: Target) -> str:
    config = target.model.config.to_dict()
    for volatile in ("_name_or_path", "transformers_version", "dtype", "torch_dtype"):
        config.pop(volatile, None)
    params = [p for _, p in target.model.named_parameters()]
    picked = [params[0], params[len(params) // 2], params[-1]] if params else []
    sums = [f"{p.detach().sum(dtype=torch.float64).item():.10e}" for p in picked]
    text = json.dumps(config, sort_keys=True, default=str) + "|" + ",".join(sums) + f"|{len(params)}"
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def drafter_fingerprint(drafter) -> dict[str, str]:
    """The drafter fields costs depend on: architecture, hidden size, draft vocabulary ("none" without).

    `drafter`: None, a neural `Drafter`, or a proposer without weights (n-gram) or wrapping one (hybrid)."""
    if drafter is None:
        return {"drafter": "none"}
    fields = {"drafter": drafter.drafter_type or type(drafter).__name__}
    neural = getattr(drafter, "neural", drafter)  # a hybrid's neural part
    if isinstance(neural, torch.nn.Module):
        fields["drafter_hidden"] = str(getattr(getattr(neural, "config", None), "hidden_size", None))
        fields["draft_vocab"] = str(neural.draft_vocab_size)
        fields["drafter_params"] = str(sum(p.numel() for p in neural.parameters()))
    return fields


def cost_key(target: Target, drafter, batch_sizes: tuple[int, ...], context: int) -> dict[str, str]:
    """Everything a cached table must match to be reused."""
    return {
        "method": METHOD_VERSION,
        **machine_fingerprint(target.device),
        "target": target.name,
        "target_weights": target_fingerprint(target),
        "dtype": str(target.dtype).removeprefix("torch."),
        **drafter_fingerprint(drafter),
        "batch_sizes": ",".join(str(b) for b in sorted(set(batch_sizes))),
        "context": str(context),
    }


def profiles_dir() -> Path:
    """Where cost tables are cached."""
    return cache_root() / "profiles"


def cost_table_path(key: dict[str, str]) -> Path:
    """The cache file of a key: a readable prefix plus a hash of the whole key."""
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
    name = re.sub(r"[^A-Za-z0-9._-]+", "_", Path(key["target"]).name)[:40]
    return profiles_dir() / f"{name}-{key['drafter']}-{digest}.json"


def _read_cached(path: Path, key: dict[str, str]) -> CostTable | None:
    """The cached table at `path` if it is whole and made for `key`; warns and returns None if corrupt."""
    if not path.is_file():
        return None
    try:
        table = CostTable.from_json(json.loads(path.read_text()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        logger.warning("mmvsd: cost profile %s is unreadable (%s: %s); measuring again", path,
                        type(err).__name__, err)
        return None
    if table.key != key:
        logger.warning("mmvsd: cost profile %s was measured for another machine, target or drafter; "
                        "measuring again", path)
        return None
    return table


def load_cost_table(
    target: Target,
    drafter=None,
    batch_sizes: tuple[int, ...] = (1,),
    *,
    refresh: bool = False,
    progress: bool = True,
    context: int = 256,
) -> CostTable:
    """The cost table of this machine for (target, drafter, batch sizes): cached, measured on first use."""
    batch_sizes = tuple(sorted(set(batch_sizes)))
    key = cost_key(target, drafter, batch_sizes, context)
    path = cost_table_path(key)
    table = None if refresh else _read_cached(path, key)
    if table is not None:
        return table
    if progress:
        print(f"mmvsd: measuring the costs of {target.name} on this machine (once; cached in {path})",
              file=sys.stderr, flush=True)
    table = measure_costs(target, drafter, batch_sizes, context=context, progress=progress)
    with atomic_file(path) as handle:
        json.dump(table.to_json(), handle, indent=1)
    return table


# ---------------------------------------------------------------------------------------------- reporting


def format_cost_table(table: CostTable) -> str:
    """The table as text: milliseconds per shape and batch size, and the ratio to a 1-token verify step."""
    key, batches = table.key, sorted(table.target_seconds)
    one = {b: table.target_step(1, b) or float("nan") for b in batches}
    lines = [(f"costs of {key['target']} ({key['dtype']}) with drafter {key['drafter']} on {key['cpu']} "
              f"[{key['device']}, {key['threads']} threads, torch {key['torch']}], cache of {table.context} tokens"),
             "verify step (Target.forward over N tree tokens + keep):",
             "  N     " + "".join(f"{f'B={b} ms':>10}{'x N=1':>7}" for b in batches)]
    for i, n in enumerate(table.target_tokens):
        cells = "".join(f"{table.target_seconds[b][i] * 1e3:10.2f}{table.target_seconds[b][i] / one[b]:7.2f}"
                        for b in batches)
        lines.append(f"  {n:<6}{cells}")
    if table.draft_widths:
        lines += ["drafter expand (one depth of a frontier of W nodes); ratio to the 1-token verify step:",
                  "  W     " + "".join(f"{f'B={b} ms':>10}{'x N=1':>7}" for b in batches)]
        for i, w in enumerate(table.draft_widths):
            cells = "".join(f"{table.draft_seconds[b][i] * 1e3:10.2f}{table.draft_seconds[b][i] / one[b]:7.2f}"
                            for b in batches)
            lines.append(f"  {w:<6}{cells}")
        lines.append("drafter fixed per step (advance + root top-k): "
                     + ", ".join(f"B={b} {table.draft_fixed(b) * 1e3:.2f} ms" for b in batches))
    return "\n".join(lines)


def plot_cost_table(table: CostTable, out_path: str | Path) -> None:
    """A PNG: verify-step ms vs tree tokens per batch size, and drafter ms vs frontier width."""
    import matplotlib  # optional plotting: only `--plot` needs it, and it is slow to import (~0.3 s)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # likewise; after use("Agg"), which picks a headless backend first

    fig, axes = plt.subplots(1, 2 if table.draft_widths else 1, figsize=(11 if table.draft_widths else 6, 4.2),
                             squeeze=False)
    left = axes[0][0]
    for batch, seconds in sorted(table.target_seconds.items()):
        left.plot(table.target_tokens, [s * 1e3 for s in seconds], marker="o", label=f"batch {batch}")
    left.set(xlabel="verified tree tokens N", ylabel="ms per verify step", ylim=(0, None),
             title=f"target {table.key['target']} ({table.key['dtype']})")
    left.legend()
    left.grid(alpha=0.3)
    if table.draft_widths:
        right = axes[0][1]
        for batch, seconds in sorted(table.draft_seconds.items()):
            line, = right.plot(table.draft_widths, [s * 1e3 for s in seconds], marker="o", label=f"expand, batch {batch}")
            right.axhline(table.draft_fixed(batch) * 1e3, color=line.get_color(), linestyle="--",
                          label=f"fixed per step, batch {batch}")
        right.set(xlabel="frontier width W", ylabel="ms per call", ylim=(0, None),
                  title=f"drafter {table.key['drafter']} (draft vocab {table.key.get('draft_vocab', '?')})")
        right.legend()
        right.grid(alpha=0.3)
    fig.suptitle(f"{table.key['cpu']} [{table.key['device']}, {table.key['threads']} threads]", fontsize=9)
    fig.tight_layout()
    with atomic_file(out_path, "wb") as handle:
        fig.savefig(handle, format="png", dpi=110)
    plt.close(fig)
