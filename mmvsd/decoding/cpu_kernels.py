"""The exact CPU kernels of mmvsd's own decoding engine: half-precision targets whose verify steps compute, row for
row, the very bits a one-token step computes, so tree decoding equals vanilla decoding token for token (not up to
near-ties). `decoding_kernels` is the explicit step after loading a target that chooses them.

A bf16 forward over N tokens normally differs from N one-token forwards in the last bits: the GEMM kernels
pick other blockings for other row counts, and attention sums over caches of other lengths and slot orders.
One flipped bf16 rounding anywhere grows into logits 0.5 apart, and half of SmolLM2's answers changed
(measured: 8 of 15 prompts, `mmvsd bench --suite text --dtype bf16` before this engine). The engine removes
both causes:

- **attention accumulated in float64** (`exact_attention`): its rounding error, ~1e-16 relative, does not
  reach the bf16 result, so a query's output does not depend on which other queries, cache slots or masked
  entries share its call;
- **linear layers run in row chunks** no larger than the bound under which this CPU's kernels give every row
  the same bits whatever the row count (`RowChunkedLinear`), with oneDNN's prepacked weights where torch has
  them (bf16 on a CPU with AMX or AVX-512-bf16 streams half the bytes of fp32, and its kernel costs the same
  from 1 to 16 rows).

The bound is measured, never assumed (`measure_exact_rows`): block forwards of 2..32 tokens against
one-token forwards, bit for bit. fp32 targets run the engine only on oneDNN's prepacked fp32 kernel (stock fp32
GEMMs differ between 1 and 2 rows on the CPUs we measured, and MKL's are slow at 2-16 rows on AMD's; oneDNN's gave
the same bits from 1 to 32 rows on an AVX2 EPYC, its verify steps of 2-16 tokens taking 0.7-0.85x the stock time);
stock fp32 decoding stays equal to vanilla up to near-ties of the logits. A lone row goes into a kernel by itself
where that was measured to give the bits it gets among others, and twice (`pad_single`) where it was not.

`choose_cpu_engine` is what `--dtype auto` runs on a CPU: it times a 1- and a 16-token verify step in fp32, in
fp32 with the engine and in bf16 with the engine, and keeps an engine where it is exact and no slower; the choice
is cached per machine and target like the cost profile (`mmvsd.decoding.cost_cache`), and like it spot-checked on
its first use in a process: the timings it rests on are taken again (a few rounds) and the choice is measured
again, and may flip, when they are off by the profiles' rule (`cost_cache.timings_drift`), at most once every
`REMEASURE_HOURS`: on a machine busy with another job every spot check drifts, and measuring again on every command
stalled each of them for minutes; inside that window a drifted choice is kept, with a warning.
"""

from __future__ import annotations

import copy
import functools
import json
import logging
import sys
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

from mmvsd.decoding import cost_cache
from mmvsd.decoding.cost_measure import SPOT_TOKENS, prefilled_cache, verify_step_seconds
from mmvsd.decoding.fingerprints import machine_fingerprint, target_fingerprint
from mmvsd.decoding.kv import sequence_block
from mmvsd.files import atomic_file
from mmvsd.target import Target

EXACT_ATTENTION = "mmvsd_exact"
ROW_CANDIDATES = (2, 3, 4, 5, 6, 8, 12, 16, 24, 32)  # verify-step sizes the bound is checked at
HALF = (torch.bfloat16, torch.float16)
QUERY_CHUNK = 256  # queries per float64 attention product (bounds a long prefill's memory)
ENGINE_VERSION = "5"  # in cached choices and, through `Target.engine`, in cost profiles
SPOT_REPEATS = 3  # timed rounds (after a warm-up) when a cached choice is spot-checked; the choice itself times 7
REMEASURE_HOURS = 24.0  # a drifted choice is measured again only when its last measurement is older than this

logger = logging.getLogger(__name__)


def exact_attention(module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
                    scaling: float | None = None, dropout: float = 0.0, **kwargs) -> tuple[Tensor, None]:
    """Scaled dot-product attention with products and sums in float64, rounded once to the query's dtype.

    query [B, Hq, N, D]; key, value [B, Hkv, T, D] (grouped-query heads read in place); attention_mask: None
    (causal, the N queries being the last N keys), bool [B, 1, N, T] (True = seen) or additive float (its
    minimum = not seen, as mmvsd's and transformers' masks are). Returns [B, N, Hq, D] as transformers'
    attention functions do."""
    if dropout or kwargs.get("softcap") is not None or kwargs.get("s_aux") is not None:
        raise ValueError("exact attention supports no dropout, softcap or attention sinks")
    batch, heads, num_queries, head_dim = query.shape
    kv_heads, length = key.shape[1], key.shape[2]
    groups = heads // kv_heads
    scale = head_dim ** -0.5 if scaling is None else scaling
    keys_t = key.double().transpose(-1, -2)  # [B, Hkv, D, T]
    values = value.double()  # [B, Hkv, T, D]
    mask = _additive_mask(attention_mask, num_queries, length, query.device)  # [B|1, 1, 1, N, T]
    chunks = []
    for start in range(0, num_queries, QUERY_CHUNK):
        stop = min(start + QUERY_CHUNK, num_queries)
        n = stop - start
        # a kv head's G query heads and n queries as the rows of one product (a broadcast one is 10x slower)
        q = (query[:, :, start:stop].double() * scale).reshape(batch, kv_heads, groups * n, head_dim)
        scores = torch.matmul(q, keys_t)  # [B, Hkv, G*n, T]
        scores.view(batch, kv_heads, groups, n, length).add_(mask[..., start:stop, :])
        chunks.append(torch.matmul(torch.softmax(scores, dim=-1), values).view(batch, heads, n, head_dim))
    out = chunks[0] if len(chunks) == 1 else torch.cat(chunks, dim=2)
    return out.transpose(1, 2).to(query.dtype), None


_last_mask: list = [None, None]  # (the mask every layer of one forward shares, its float64 form)


def _additive_mask(mask: Tensor | None, num_queries: int, length: int, device: torch.device) -> Tensor:
    """[B or 1, 1, 1, N, T] float64: 0 where a query sees a key, a large negative value (-inf or the mask
    dtype's minimum, whose exponential is 0 either way) where not. Converted once per forward."""
    if mask is not None and _last_mask[0] is mask:
        return _last_mask[1]
    if mask is None:  # causal: query i is key length - num_queries + i
        query_pos = torch.arange(num_queries, device=device)[:, None] + (length - num_queries)
        seen = torch.arange(length, device=device)[None, :] <= query_pos
        additive = torch.zeros(seen.shape, dtype=torch.float64, device=device).masked_fill_(~seen, float("-inf"))
        return additive[None, None, None]
    if mask.dtype == torch.bool:
        additive = torch.zeros(mask.shape, dtype=torch.float64, device=device).masked_fill_(~mask, float("-inf"))
    else:
        additive = mask.double()
    _last_mask[:] = mask, additive[:, :, None]
    return _last_mask[1]


AttentionInterface.register(EXACT_ATTENTION, exact_attention)
ALL_MASK_ATTENTION_FUNCTIONS.register(EXACT_ATTENTION, sdpa_mask)


@functools.cache
def _packing_available(dtype: torch.dtype = torch.bfloat16) -> bool:
    """Whether oneDNN's prepacked linear runs here in `dtype`: torch has it and, for bf16, this CPU has its bf16
    instructions (AVX-512 BW/VL/DQ or AVX-NE-CONVERT; an AVX2-only CPU has neither, and packing there raises); for
    fp32, a packed 2 x 8 layer computes what the stock one does (tried once)."""
    mkldnn = torch.ops.mkldnn
    if not (torch.backends.mkldnn.is_available() and hasattr(mkldnn, "_linear_pointwise")):
        return False
    if dtype == torch.bfloat16:
        return hasattr(mkldnn, "_is_mkldnn_bf16_supported") and bool(mkldnn._is_mkldnn_bf16_supported())
    if dtype != torch.float32:
        return False
    weight, x = torch.linspace(-1, 1, 16).view(2, 8), torch.linspace(0, 1, 16).view(2, 8)
    try:
        packed = mkldnn._linear_pointwise(x, mkldnn._reorder_linear_weight(weight), None, "none", [], "")
    except (RuntimeError, NotImplementedError):
        return False
    return torch.allclose(packed, F.linear(x, weight), atol=1e-5)


class RowChunkedLinear(nn.Module):
    """A linear layer computed `rows` rows at a time (so every row meets a kernel this CPU gives row-count-
    independent bits), by oneDNN's prepacked kernel when `pack` (the plain weight is then kept only with
    `keep_weight`, for code that reads it: a tied LM head, a drafter's layers). With `pad_single`, a kernel is
    never called with one row: a lone row goes in twice. One-row calls may take another kernel (a
    matrix-vector product) whose bits differ from those of the same row among others: seen for the 8960-wide
    down projection of Qwen2.5-1.5B, where 2..32 rows all agree and 1 row does not."""

    def __init__(self, linear: nn.Linear, rows: int, pack: bool, keep_weight: bool = False,
                 pad_single: bool = True) -> None:
        super().__init__()
        self.in_features, self.out_features, self.rows = linear.in_features, linear.out_features, rows
        self.pad_single = pad_single
        self.bias = linear.bias
        self.packed = None
        if pack:
            self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach())
        if not pack or keep_weight:
            self.weight = linear.weight

    def _rows(self, x: Tensor) -> Tensor:
        if self.packed is None:
            return F.linear(x, self.weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def _chunk(self, part: Tensor) -> Tensor:
        if self.pad_single and part.shape[0] == 1:
            return self._rows(torch.cat([part, part]))[:1]
        return self._rows(part)

    def forward(self, x: Tensor) -> Tensor:
        flat = x.reshape(-1, self.in_features)
        if flat.shape[0] <= self.rows:
            out = self._chunk(flat)
        else:
            out = torch.cat([self._chunk(part) for part in flat.split(self.rows)])
        return out.view(*x.shape[:-1], self.out_features)


@dataclass(frozen=True)
class EngineChoice:
    """What `choose_cpu_engine` decided for one machine and target, and the timings it decided from."""

    dtype: str  # "bfloat16" or "float32"
    exact_rows: int  # the measured bound of the bf16 engine (1: not exact on this CPU)
    fp32_ms: tuple[float, float]  # verify step of 1 and 16 tokens
    bf16_ms: tuple[float, float] | None  # the same with the bf16 engine (None when it is not exact)
    fp32_exact_rows: int = 0  # the bound of the fp32 engine on oneDNN's packed kernel (0: no such kernel here)
    fp32_exact_ms: tuple[float, float] | None = None  # its steps (None when it is not exact here)
    engine: str = "stock"  # what runs the chosen dtype: "stock" kernels or the "exact" engine (bf16: always)
    pad_single: bool = True  # whether the bf16 engine's bound was measured with lone rows padded (`_bound_of`)
    fp32_pad_single: bool = True  # the same for the fp32 engine

    def bound(self, dtype: str) -> tuple[int, bool]:
        """The measured exact bound of the engine in `dtype` ("float32" or "bfloat16"), and whether it pads lone
        rows."""
        if dtype == "float32":
            return self.fp32_exact_rows, self.fp32_pad_single
        return self.exact_rows, self.pad_single

    def describe(self) -> str:
        parts = [f"fp32 {self.fp32_ms[0]:.1f}/{self.fp32_ms[1]:.1f} ms"]
        if self.fp32_exact_ms is not None:
            parts.append(f"exact fp32 {self.fp32_exact_ms[0]:.1f}/{self.fp32_exact_ms[1]:.1f} ms")
        if self.bf16_ms is None:
            parts.append(f"bf16 is not exact here (bound {self.exact_rows})")
        else:
            parts.append(f"exact bf16 {self.bf16_ms[0]:.1f}/{self.bf16_ms[1]:.1f} ms")
        return ", ".join(parts) + " (1/16 tokens verified)"


def install_exact_engine(target: Target, rows: int, pack: bool | None = None, pad_single: bool = True) -> None:
    """Swap the target's linear layers for row-chunked ones (prepacked where `pack`, default: bf16 with oneDNN)
    and its attention for `exact_attention`; on a target that has them, set the chunks' rows (and `pad_single`).
    Half-precision CPU targets, or fp32 ones with `pack` (oneDNN's fp32 kernel); rows >= 1 (1 is exact on any CPU,
    and slow). `pad_single=False` only where `_bound_of` measured lone rows to be exact unpadded."""
    packed_fp32 = target.dtype == torch.float32 and bool(pack)
    if target.device.type != "cpu" or not (target.dtype in HALF or packed_fp32):
        raise ValueError(f"the exact kernels are for half-precision CPU targets, or fp32 ones on oneDNN's packed "
                         f"kernel, not {target.dtype} on {target.device}")
    pack = _packing_available() and target.dtype == torch.bfloat16 if pack is None else pack
    head = target.model.get_output_embeddings()
    for module in list(target.model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, RowChunkedLinear):
                child.rows, child.pad_single = rows, pad_single
            elif isinstance(child, nn.Linear):  # the LM head keeps its (maybe tied) weight beside the packed one
                setattr(module, name, RowChunkedLinear(child, rows, pack, keep_weight=child is head,
                                                       pad_single=pad_single))
    target.model.config.get_text_config(decoder=True)._attn_implementation = EXACT_ATTENTION
    packed = any(isinstance(m, RowChunkedLinear) and m.packed is not None for m in target.model.modules())
    target.engine = f"exact{ENGINE_VERSION}-rows{rows}{'-packed' if packed else ''}{'' if pad_single else '-unpadded'}"


def pack_for_cpu(module: nn.Module, fp32: bool = False) -> bool:
    """Run a bf16 (or, with `fp32`, an fp32) CPU module's linear layers on oneDNN's prepacked kernel (for speed
    alone: a drafter, whose bits do not matter to losslessness), keeping their weights for code that reads them.
    False (nothing done) where the module is in another dtype or off the CPU, or torch has no oneDNN linear for
    it. For inference only (no gradients)."""
    weights = list(module.parameters())
    dtypes = (torch.bfloat16, torch.float32) if fp32 else (torch.bfloat16,)
    if not weights or weights[0].device.type != "cpu" or weights[0].dtype not in dtypes:
        return False
    dtype = weights[0].dtype
    if not _packing_available(dtype):
        return False
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear) and child.weight.dtype == dtype:
                setattr(parent, name, packed_linear(child))
    return True


def packed_linear(linear: nn.Linear) -> RowChunkedLinear:
    """A bf16 or fp32 linear layer on oneDNN's prepacked kernel where this CPU runs it (else the stock one), its
    weight kept (see `pack_for_cpu`)."""
    pack = _packing_available(linear.weight.dtype)
    return RowChunkedLinear(linear, rows=1 << 30, pack=pack, keep_weight=True, pad_single=False)


def _chain_logits(target: Target, cache, ids: Tensor, one_at_a_time: bool) -> Tensor:
    """Logits [1, N, V] of `ids` [1, N] appended to `cache` as one block or one token per forward."""
    lens = cache.lens.clone()
    if not one_at_a_time:
        depths, causal = sequence_block(1, ids.shape[1], target.device)
        logits = target.forward(cache, ids, depths, causal, need_aux=False).logits
    else:
        depths, causal = sequence_block(1, 1, target.device)
        steps = []
        for i in range(ids.shape[1]):
            steps.append(target.forward(cache, ids[:, i : i + 1], depths, causal, need_aux=False).logits)
            cache.keep(torch.zeros(1, 1, dtype=torch.long), torch.ones(1, dtype=torch.long))
        logits = torch.cat(steps, dim=1)
    cache.rewind(lens)
    return logits


@torch.no_grad()
def measure_exact_rows(target: Target, context: int = 64, candidates: tuple[int, ...] = ROW_CANDIDATES) -> int:
    """The largest row count n in `candidates` such that block forwards of every candidate <= n tokens give the
    bits of one-token forwards (logits compared exactly); 1 when even 2 rows differ. The target's linears run
    unchunked up to max(candidates) rows while it measures."""
    chunked = [m for m in target.model.modules() if isinstance(m, RowChunkedLinear)]
    saved = [m.rows for m in chunked]
    for module in chunked:
        module.rows = max(candidates)
    try:
        cache, _, _ = prefilled_cache(target, 1, context, need_aux=False)
        ids = (torch.arange(max(candidates), device=target.device)[None] * 13 + 5) % min(target.vocab_size, 1000)
        reference = _chain_logits(target, cache, ids, one_at_a_time=True)
        bound = 1
        for n in sorted(candidates):
            if not torch.equal(_chain_logits(target, cache, ids[:, :n], one_at_a_time=False), reference[:, :n]):
                break
            bound = n
    finally:
        for module, rows in zip(chunked, saved):
            module.rows = rows
    return bound


def _verify_ms(target: Target, repeats: int = 7) -> tuple[float, ...]:
    """Typical milliseconds of a verify step of 1 and 16 tokens (the cost profile's own step, 256-token cache)."""
    return tuple(1e3 * s for s in verify_step_seconds(target, 1, 256, False, SPOT_TOKENS, repeats).values())


def exact_bound_for(target: Target) -> tuple[int, bool]:
    """The measured exact bound of this half-precision CPU target and whether it pads lone rows (`_bound_of`;
    cached per machine and target)."""
    key = _key(target, "exact_rows")
    cached = _read(key)
    if cached is not None:
        return int(cached["exact_rows"]), bool(cached["pad_single"])
    rows, pad_single = _bound_of(Target(copy.deepcopy(target.model), None, target.name, target.aux_layer_ids))
    _write(key, {"exact_rows": rows, "pad_single": pad_single})
    return rows, pad_single


def _bound_of(probe: Target, pack: bool | None = None) -> tuple[int, bool]:
    """The exact bound measured on `probe`, a throwaway half-precision target or, with `pack`, an fp32 one on
    oneDNN's packed kernel (packing is one-way), and whether lone rows need padding: measured first as they come
    (a one-token step then computes one row, not two), and padded where that does not reach the largest bound
    (a kernel that takes one row apart, `RowChunkedLinear`); the larger bound wins, a tie goes unpadded."""
    install_exact_engine(probe, rows=max(ROW_CANDIDATES), pack=pack, pad_single=False)
    alone = measure_exact_rows(probe)
    if alone == max(ROW_CANDIDATES):
        return alone, False
    install_exact_engine(probe, rows=max(ROW_CANDIDATES), pack=pack, pad_single=True)
    padded = measure_exact_rows(probe)
    return (alone, False) if alone >= padded else (padded, True)


def use_exact_engine(target: Target) -> bool:
    """Install the exact kernels on a half-precision CPU target where this CPU allows it (bound >= 2); False
    (stock kernels, equal to vanilla up to near-ties) where it does not."""
    if target.device.type != "cpu" or target.dtype not in HALF:
        return False
    rows, pad_single = exact_bound_for(target)
    if rows < 2:
        return False
    install_exact_engine(target, rows, pad_single=pad_single)
    return True


def decoding_kernels(target: Target, auto: bool = False) -> Target:
    """The kernels mmvsd's own decoding runs `target` on, chosen in this explicit step after loading: on a CPU, `auto`
    (`--dtype auto`, an fp32 target) chooses fp32 or bf16 with the exact kernels by measurement (`choose_cpu_engine`:
    cached, spot-checked); a half-precision target gets the exact kernels where this CPU allows them. GPU targets,
    and fp32 ones not `auto`, are returned as they are."""
    if target.device.type != "cpu":
        return target
    if auto:
        return choose_cpu_engine(target)
    use_exact_engine(target)
    return target


@torch.no_grad()
def choose_cpu_engine(target: Target, progress: bool = True) -> Target:
    """`--dtype auto` on a CPU: the fp32 `target` itself, or a copy on the exact kernels, in fp32 (oneDNN's packed
    kernel) or bf16, where that is exact (bound >= 4) and measured no slower at 1 token and faster at 16; decided
    once per machine and target, and spot-checked on its first use in a process (measured again, and maybe
    flipped, where its timings are off)."""
    key = _key(target, "cpu_engine")
    path = engine_path(key)
    choice, chosen = _cached_choice(key), None
    if choice is not None and not cost_cache.checked_in_this_process(path):  # once per process, as cost profiles
        chosen, why = _spot_check(target, choice)
        age_hours = (_now() - float((_read(key) or {}).get("measured_at", 0.0))) / 3600
        if why is not None and age_hours < REMEASURE_HOURS:
            logger.warning("mmvsd: the kernel choice %s looks off on this machine now (%s), a busy machine's timings "
                           "perhaps; kept, as it was measured %.1f h ago (again after %g h)", path, why, age_hours,
                           REMEASURE_HOURS)
        elif why is not None:
            logger.warning("mmvsd: the kernel choice %s no longer fits this machine (%s); measuring again",
                           path, why)
            choice, chosen = None, None
    if choice is None:
        choice = _measure_and_cache(target, key, progress)
    cost_cache.mark_checked(path)
    if choice.dtype == "float32" and choice.engine == "stock":
        return target
    return chosen if chosen is not None else _engine_copy(target, choice.dtype, *choice.bound(choice.dtype))


def _cached_choice(key: dict[str, str]) -> EngineChoice | None:
    """The choice cached for `key`, or None."""
    cached = _read(key)
    if cached is None:
        return None
    pair = lambda name: tuple(cached[name]) if cached.get(name) else None  # noqa: E731
    return EngineChoice(cached["dtype"], cached["exact_rows"], tuple(cached["fp32_ms"]), pair("bf16_ms"),
                        cached["fp32_exact_rows"], pair("fp32_exact_ms"), cached["engine"], cached["pad_single"],
                        cached["fp32_pad_single"])


def _measure_and_cache(target: Target, key: dict[str, str], progress: bool) -> EngineChoice:
    """Measure the choice for `key` on this machine and cache it."""
    if progress:
        print(f"mmvsd: choosing the precision and kernels for {target.name} on this machine (once; cached in "
              f"{engine_path(key)})", file=sys.stderr, flush=True)
    choice = _measure_choice(target)
    if progress:
        engine = " on the exact kernels" if choice.engine == "exact" else ""
        print(f"mmvsd: {target.name} runs in {choice.dtype}{engine} here: {choice.describe()}", file=sys.stderr)
    _write(key, {"dtype": choice.dtype, "engine": choice.engine, "exact_rows": choice.exact_rows,
                 "fp32_ms": list(choice.fp32_ms), "bf16_ms": list(choice.bf16_ms) if choice.bf16_ms else None,
                 "fp32_exact_rows": choice.fp32_exact_rows,
                 "fp32_exact_ms": list(choice.fp32_exact_ms) if choice.fp32_exact_ms else None,
                 "pad_single": choice.pad_single, "fp32_pad_single": choice.fp32_pad_single,
                 "measured_at": _now()})
    return choice


def _now() -> float:
    """Seconds since the epoch (a function, so tests can move the clock)."""
    return time.time()


def _spot_check(target: Target, choice: EngineChoice) -> tuple[Target | None, str | None]:
    """Time again (SPOT_REPEATS rounds) what a cached choice rests on: (the chosen engine copy, timed; None when the
    choice is stock fp32; why the timings of some candidate no longer hold here, or None). One copy of the target
    lives at a time: the chosen engine's is made last."""
    reasons = [_drift("an fp32 verify step", _verify_ms(target, SPOT_REPEATS), choice.fp32_ms)]
    chosen = None
    timed = [(dtype, ms) for dtype, ms in (("float32", choice.fp32_exact_ms), ("bfloat16", choice.bf16_ms)) if ms]
    timed.sort(key=lambda candidate: choice.engine == "exact" and choice.dtype == candidate[0])
    for dtype, ms in timed:
        engined = _engine_copy(target, dtype, *choice.bound(dtype))
        reasons.append(_drift(f"an exact {_SHORT[dtype]} verify step", _verify_ms(engined, SPOT_REPEATS), ms))
        if choice.engine == "exact" and choice.dtype == dtype:
            chosen = engined
        del engined
    return chosen, "; ".join(reason for reason in reasons if reason) or None


_SHORT = {"float32": "fp32", "bfloat16": "bf16"}


def _drift(step: str, now_ms: tuple[float, ...], then_ms: tuple[float, ...]) -> str | None:
    """The profiles' drift rule (`cost_cache.timings_drift`) on one candidate's 1- and 16-token steps."""
    now, then = ({n: ms / 1e3 for n, ms in zip(SPOT_TOKENS, values)} for values in (now_ms, then_ms))
    return cost_cache.timings_drift(now, then, step, when="chosen")


def _engine_copy(target: Target, dtype: str, rows: int, pad_single: bool) -> Target:
    """A copy of the fp32 `target` on the exact kernels in `dtype` ("bfloat16", or "float32" on oneDNN's packed
    kernel) with the bound `rows` (lone rows padded where `pad_single`)."""
    engined = _target_copy(target, getattr(torch, dtype))
    install_exact_engine(engined, rows, pack=True if dtype == "float32" else None, pad_single=pad_single)
    return engined


def _target_copy(target: Target, dtype: torch.dtype) -> Target:
    model = copy.deepcopy(target.model).to(dtype)
    return Target(model, target.tokenizer, target.name, target.aux_layer_ids, target.processor)


def _no_slower(candidate: tuple[float, ...], incumbent: tuple[float, ...]) -> bool:
    """Exact kernels replace the incumbent where they are no slower at one token (vanilla would lose) and faster
    at 16."""
    return candidate[0] <= 1.02 * incumbent[0] and candidate[1] < incumbent[1]


def _measure_choice(target: Target) -> EngineChoice:
    """Time stock fp32 and each exact kernel this CPU allows (one copy of the target alive at a time: bf16 first, the
    smaller; stock before and after them, its faster timings kept, so a machine that is slow at first does not
    favour an engine), then decide: stock fp32, replaced by the fp32 engine, then by bf16, each where `_no_slower`
    holds."""
    fp32_ms = _verify_ms(target)
    half = _target_copy(target, torch.bfloat16)
    rows, pad_single = _bound_of(half)
    bf16_ms = None
    if rows >= 4:
        install_exact_engine(half, rows, pad_single=pad_single)
        bf16_ms = _verify_ms(half)
    del half
    fp32_rows, fp32_pad_single, fp32_exact_ms = 0, True, None
    if _packing_available(torch.float32):
        probe = _target_copy(target, torch.float32)
        fp32_rows, fp32_pad_single = _bound_of(probe, pack=True)
        if fp32_rows >= 4:
            install_exact_engine(probe, fp32_rows, pack=True, pad_single=fp32_pad_single)
            fp32_exact_ms = _verify_ms(probe)
        del probe
    if bf16_ms is not None or fp32_exact_ms is not None:  # timed first and last: an engine must beat its better
        fp32_ms = tuple(map(min, fp32_ms, _verify_ms(target)))
    best: tuple[str, str, tuple[float, ...]] = ("float32", "stock", fp32_ms)
    for dtype, ms in (("float32", fp32_exact_ms), ("bfloat16", bf16_ms)):
        if ms is not None and _no_slower(ms, best[2]):
            best = (dtype, "exact", ms)
    return EngineChoice(best[0], rows, fp32_ms, bf16_ms, fp32_rows, fp32_exact_ms, best[1], pad_single,
                        fp32_pad_single)


def _key(target: Target, what: str) -> dict[str, str]:
    return {"what": what, "version": ENGINE_VERSION, **machine_fingerprint(target.device), "target": target.name,
            "target_weights": target_fingerprint(target), "dtype": str(target.dtype).removeprefix("torch.")}


def engine_path(key: dict[str, str]):
    return cost_cache.profiles_dir() / f"engine-{key['what']}-{cost_cache.key_digest(key)}.json"


def _read(key: dict[str, str]) -> dict | None:
    path = engine_path(key)
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and data.get("key") == key else None


def _write(key: dict[str, str], values: dict) -> None:
    with atomic_file(engine_path(key)) as handle:
        json.dump({"key": key, **values}, handle, indent=1)
