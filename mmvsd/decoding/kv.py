"""Ragged KV caches: one batch cache whose rows hold different numbers of committed tokens.

Row b's committed entries occupy slots [0, lens[b]) of every layer; slots from lens[b] up to the
committed length are stale and always masked out. New entries (a prompt chunk, a draft tree, a
frontier of tree nodes) are appended after the committed length as a "block"; `keep` then copies
the entries a row accepts to its slots lens[b].. and drops the rest. The target (an HF `Cache` of
`SlotLayer`s) and the drafters' own caches share this one mechanism.

Every layer keeps its keys and values in one preallocated buffer written in place: appending a
block, committing it and dropping it never copy the cache (an HF `DynamicCache` concatenates the
whole cache on every forward).
"""

from __future__ import annotations

import torch
from torch import Tensor
from transformers.cache_utils import Cache, DynamicLayer


def sequence_block(batch_size: int, width: int, device: torch.device | str) -> tuple[Tensor, Tensor]:
    """Depths [B, T] and causal block mask [B, T, T] for appending T consecutive tokens to every row."""
    depths = torch.arange(width, device=device).expand(batch_size, width)
    causal = torch.ones(width, width, dtype=torch.bool, device=device).tril().expand(batch_size, -1, -1)
    return depths, causal


class SlotLayer(DynamicLayer):
    """One layer's KV in a buffer [2, B, H, capacity, D] (keys, values) written in place.

    `keys`/`values` are views [B, H, length, D] of the first `length` slots; the capacity doubles
    when an update does not fit, so growing costs one copy per doubling.
    """

    min_capacity = 256

    def lazy_initialization(self, key_states: Tensor, value_states: Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        batch, heads, _, head_dim = key_states.shape
        self.buffer = torch.empty(2, batch, heads, 0, head_dim, dtype=self.dtype, device=self.device)
        self.length = 0
        self.is_initialized = True
        self._refresh_views()

    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs) -> tuple[Tensor, Tensor]:
        """Write key/value states [B, H, N, D] after the current length; return all keys and values."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        end = self.length + key_states.shape[2]
        self._reserve(end)
        self.buffer[0, :, :, self.length : end] = key_states
        self.buffer[1, :, :, self.length : end] = value_states
        self.length = end
        self._refresh_views()
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.length if self.is_initialized else 0

    def reset(self) -> None:
        self.is_initialized = False
        self.keys = self.values = None
        self.length = 0

    def truncate(self, length: int) -> None:
        """Forget every slot from `length` on (no copy: later updates overwrite them)."""
        if self.is_initialized and self.length > length:
            self.length = length
            self._refresh_views()

    def move(self, rows: Tensor, dst: Tensor, src: Tensor) -> None:
        """Copy slot src[i] to slot dst[i] of row rows[i], keys and values in one indexed copy ([K] each)."""
        self.buffer[:, rows, :, dst] = self.buffer[:, rows, :, src]

    def select_rows(self, rows: Tensor) -> None:
        if self.is_initialized:
            self.buffer = self.buffer[:, rows]
            self._refresh_views()

    def _reserve(self, length: int) -> None:
        capacity = self.buffer.shape[3]
        if length <= capacity:
            return
        grown = torch.empty(
            *self.buffer.shape[:3], max(length, 2 * capacity, self.min_capacity), self.buffer.shape[4],
            dtype=self.dtype, device=self.device,
        )
        grown[:, :, :, : self.length] = self.buffer[:, :, :, : self.length]
        self.buffer = grown

    def _refresh_views(self) -> None:
        self.keys = self.buffer[0, :, :, : self.length]
        self.values = self.buffer[1, :, :, : self.length]


class RaggedCache:
    """An HF `Cache` of `SlotLayer`s plus per-row committed lengths."""

    def __init__(self, batch_size: int, device: torch.device | str = "cpu") -> None:
        self.kv = Cache(layer_class_to_replicate=SlotLayer)
        self.lens = torch.zeros(batch_size, dtype=torch.long, device=device)  # [B]
        self.committed_len = 0  # slots before this index are committed-or-stale; after: the block
        self.row_state: dict[str, Tensor] = {}  # per-row values [B, ...] a model keeps beside its KV

    @property
    def batch_size(self) -> int:
        return self.lens.shape[0]

    def block_len(self) -> int:
        """How many entries have been appended since the last `keep`/`drop_block`."""
        return self.kv.get_seq_length() - self.committed_len

    def positions(self, depths: Tensor, past_lens: Tensor | None = None) -> Tensor:
        """[B, N] position ids of new entries at `depths` [B, N] after the committed tokens they see.

        past_lens [B, N]: committed tokens each entry sees (default: all of its row's, lens[b]).
        """
        return (self.lens[:, None] if past_lens is None else past_lens) + depths

    def attention_mask(self, block_mask: Tensor, dtype: torch.dtype, past_lens: Tensor | None = None) -> Tensor:
        """Additive mask [B, 1, N, committed_len + M] for N new queries.

        block_mask [B, N, M] (bool): which of the M block entries (those appended since the last
        commit, the N new ones last) each query sees. Committed slot j is seen iff j < past_lens[b, n]
        (default lens[b]); a shorter past lets drafts branch off any prefix of a committed sequence.
        """
        visible = self.visible(block_mask, past_lens)
        mask = torch.zeros(visible.shape, dtype=dtype, device=self.lens.device)
        return mask.masked_fill_(~visible, torch.finfo(dtype).min)[:, None]

    def visible(self, block_mask: Tensor, past_lens: Tensor | None = None) -> Tensor:
        """[B, N, committed_len + M] bool: which entries each new query sees (see `attention_mask`).
        A subclass that hides entries narrows it."""
        batch, num_queries, _ = block_mask.shape
        limit = self.lens[:, None].expand(batch, num_queries) if past_lens is None else past_lens
        slots = torch.arange(self.committed_len, device=self.lens.device)
        past_visible = slots[None, None, :] < limit.to(self.lens.device)[:, :, None]
        return torch.cat([past_visible, block_mask.to(self.lens.device)], dim=2)

    def keep(self, block_indices: Tensor, num_keep: Tensor) -> None:
        """Commit block entries: row b keeps block_indices[b, :num_keep[b]] ([B, A], [B]).

        Kept entries move to slots lens[b].. in order; everything else in the block is dropped.
        """
        num_keep = num_keep.to(self.lens.device)
        width = block_indices.shape[1]
        take = torch.arange(width, device=self.lens.device)[None, :] < num_keep[:, None]  # [B, A]
        rows, cols = take.nonzero(as_tuple=True)
        src = self.committed_len + block_indices.to(self.lens.device)[rows, cols]
        dst = self.lens[rows] + cols
        if bool((src != dst).any()):
            for layer in self.kv.layers:
                layer.move(rows, dst, src)
        self.on_keep(rows, dst, src - self.committed_len)
        self.lens = self.lens + num_keep
        self._truncate(int(self.lens.max().item()) if self.batch_size else 0)

    def on_keep(self, rows: Tensor, dst: Tensor, block_src: Tensor) -> None:
        """Hook: block entries `block_src` of rows `rows` were committed to slots `dst` (before `lens` grows)."""

    def on_select_rows(self, rows: Tensor) -> None:
        """Hook: only the batch rows `rows` remain."""

    def on_truncate(self, length: int) -> None:
        """Hook: every row was cut to `length` slots, all committed (the block is gone)."""

    def rewind(self, lens: Tensor) -> None:
        """Put every row back to `lens` [B] committed tokens (none more than it has): what later steps
        committed and the block are forgotten."""
        lens = lens.to(self.lens.device)
        if bool((lens > self.lens).any()):
            raise ValueError("rewind only shortens rows")
        self.lens = lens.clone()
        self._truncate(int(self.lens.max().item()) if self.batch_size else 0)

    def drop_block(self) -> None:
        """Forget every entry appended since the last commit (drafter tree rollback)."""
        self._truncate(self.committed_len)

    def select_rows(self, rows: Tensor) -> None:
        """Keep only the batch rows `rows` ([B'] long), e.g. to drop finished sequences."""
        self.lens = self.lens[rows]
        self.on_select_rows(rows)
        self.row_state = {name: value[rows] for name, value in self.row_state.items()}
        for layer in self.kv.layers:
            layer.select_rows(rows)
        self._truncate(int(self.lens.max().item()) if self.batch_size else 0)

    def _truncate(self, length: int) -> None:
        """Cut every layer to `length` slots, which become the committed length."""
        self.committed_len = length
        self.on_truncate(length)
        for layer in self.kv.layers:
            layer.truncate(length)
