"""The EAGLE-1 drafter body that MSD and ViSpec share (each adds its own way of reading media).

Layout (the released MSD / ViSpec checkpoints use these names):
    fc          [H, 2H] (+ bias)  fc([embedding of token t+1 ; hidden of position t]) -> layer input
    layers.0.*  one Llama decoder layer without its input norm (self_attn.{q,k,v,o}_proj, mlp.*,
                post_attention_layernorm)
The feature of position t is the target's final (normed) hidden state; the layer's output is in the
same space and goes through the target's own LM head, so the draft vocabulary is the target's, or a subset
of it: `draft_vocab_size` rows of that head (`restricted`, `mmvsd draft-vocab`: e.g. the tokens most frequent in the
target's answers). The weights are the same either way; on a CPU, where the head's 49k x 576 matrix is most
of a draft step's bytes, drafting over 8k rows costs a fraction (the `draft_ids` buffer is saved, the rows
are sliced from the target's head when first used).
Token embeddings and the LM head are borrowed from the target and never saved.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mmvsd.decoding.cpu_kernels import packed_linear
from mmvsd.decoding.kv import RaggedCache
from mmvsd.drafter_base import (
    Drafter,
    PairMedia,
    check_fits_target,
    load_drafter_weights,
    read_drafter_config,
    save_drafter_folder,
)
from mmvsd.drafters.layers import MLP, Attention, RMSNorm, layer_sizes
from mmvsd.errors import UserError


@dataclass
class Eagle1Config:
    """Sizes of an EAGLE-1-style drafter and the target it was made for."""

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int  # the target's (and the draft) vocabulary
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 2048
    fc_bias: bool = True
    max_images: int | None = None  # media items one sequence may hold (None: any number)
    target_name: str = ""
    draft_vocab_size: int | None = None  # rows of the target's LM head drafted over (None: all of them)

    @classmethod
    def from_target(cls, target, **extra) -> Eagle1Config:
        """A config sized like `target`'s decoder layers."""
        return cls(**layer_sizes(target), **extra)


class HidingCache(RaggedCache):
    """The KV cache of the EAGLE-1-family drafters: entries can be hidden from every later query (ViSpec's
    compressed image tokens are read once, then hidden); the flags follow keep / select_rows / truncation."""

    def __init__(self, batch_size: int, device: torch.device | str = "cpu") -> None:
        super().__init__(batch_size, device)
        self.hidden_slots: Tensor | None = None  # [B, <= committed_len] bool: committed entries no query sees
        self.block_hidden: Tensor | None = None  # [B, <= block_len] bool: the same for block entries

    def hide_new(self, hidden: Tensor) -> None:
        """Hide the last Q entries appended to the block ([B, Q] bool, True: no later query sees it)."""
        prior = self._block_hidden(self.block_len() - hidden.shape[1])
        self.block_hidden = torch.cat([prior, hidden.to(device=self.lens.device, dtype=torch.bool)], dim=1)

    def visible(self, block_mask: Tensor, past_lens: Tensor | None = None) -> Tensor:
        seen = super().visible(block_mask, past_lens)
        if self.hidden_slots is None and self.block_hidden is None:
            return seen
        hidden = torch.cat([self._committed_hidden(), self._block_hidden(block_mask.shape[2])], dim=1)
        return seen & ~hidden[:, None, :]

    def on_keep(self, rows: Tensor, dst: Tensor, block_src: Tensor) -> None:
        """Carry the hidden flags of kept block entries to their committed slots."""
        if self.hidden_slots is None and self.block_hidden is None:
            return
        width = max(self.committed_len, int(dst.max().item()) + 1 if dst.numel() else 0)
        flags = torch.zeros(self.batch_size, width, dtype=torch.bool, device=self.lens.device)
        flags[:, : self.committed_len] = self._committed_hidden()
        flags[rows, dst] = self._block_hidden(self.block_len())[rows, block_src]
        self.hidden_slots = flags

    def on_select_rows(self, rows: Tensor) -> None:
        if self.hidden_slots is not None:
            self.hidden_slots = self.hidden_slots[rows]

    def on_truncate(self, length: int) -> None:
        self.block_hidden = None
        if self.hidden_slots is not None:
            self.hidden_slots = self.hidden_slots[:, :length]

    def _committed_hidden(self) -> Tensor:
        """[B, committed_len] hidden flags of the committed slots (slots never marked: visible)."""
        flags = torch.zeros(self.batch_size, self.committed_len, dtype=torch.bool, device=self.lens.device)
        if self.hidden_slots is not None:
            known = min(self.committed_len, self.hidden_slots.shape[1])
            flags[:, :known] = self.hidden_slots[:, :known]
        return flags

    def _block_hidden(self, width: int) -> Tensor:
        """[B, width] hidden flags of the first `width` block entries (entries never marked: visible)."""
        flags = torch.zeros(self.batch_size, width, dtype=torch.bool, device=self.lens.device)
        if self.block_hidden is not None:
            known = min(width, self.block_hidden.shape[1])
            flags[:, :known] = self.block_hidden[:, :known]
        return flags


@dataclass
class LayerInput:
    """What enters the decoder layer for Q pairs."""

    x: Tensor  # [B, Q, H] layer input
    attention_mask: Tensor  # [B, 1, Q, T] additive
    hide: Tensor | None = None  # [B, Q] bool: new entries no later query may see (kept in the cache)
    extra_state: Tensor | None = None  # [B, Q, E] appended to the outputs: the drafter's state is [H ; E]


class DecoderLayer(nn.Module):
    """EAGLE-1's layer: a Llama decoder layer whose input (fc's output) is not normed first."""

    def __init__(self, config: Eagle1Config) -> None:
        super().__init__()
        self.self_attn = Attention(config, config.hidden_size)
        self.mlp = MLP(config.hidden_size, config.intermediate_size)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x: Tensor, positions: Tensor, attention_mask: Tensor, cache: RaggedCache | None) -> Tensor:
        x = x + self.self_attn(x, positions, attention_mask, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class Eagle1Drafter(Drafter):
    """Base of the EAGLE-1-style drafters; subclasses define how pairs and media enter the decoder layer
    (`target_input` for committed pairs, `draft_input` for draft pairs)."""

    config_class: ClassVar[type[Eagle1Config]] = Eagle1Config
    display_name: ClassVar[str] = "EAGLE-1"
    default_max_images: ClassVar[int | None] = None
    reads_aux = False  # the final hidden states only
    narrowable = True  # its head is the target's: a smaller draft vocabulary is a choice of rows

    def __init__(self, config: Eagle1Config, embed_tokens: nn.Embedding, lm_head: nn.Linear) -> None:
        super().__init__()
        self.config = config
        self.__dict__["embed_tokens"] = embed_tokens  # borrowed from the target, not parameters
        self.__dict__["lm_head"] = lm_head
        self.fc = nn.Linear(2 * config.hidden_size, config.hidden_size, bias=config.fc_bias)
        self.layers = nn.ModuleList([DecoderLayer(config)])
        if config.draft_vocab_size is not None:  # target ids of the draft vocabulary, ascending
            self.register_buffer("draft_ids", torch.arange(config.draft_vocab_size))
        self._head_rows: tuple[tuple, nn.Module] | None = None  # (what they were sliced from, `draft_head`)

    @classmethod
    def from_target(cls, target, draft_vocab_size: int | None = None, seed: int = 0,
                    num_layers: int = 1) -> Eagle1Drafter:
        """A freshly initialised drafter for `target`, drafting over the target's whole vocabulary (training sees
        every token; `restricted` narrows a trained one)."""
        if num_layers != 1:
            raise UserError(f"a {cls.drafter_type} drafter has one decoder layer (draft_layers=1), not {num_layers}")
        with torch.random.fork_rng(devices=[]):  # a local stream: the caller's global RNG is left as it was
            torch.manual_seed(seed)
            config = cls.config_class.from_target(target, max_images=cls.default_max_images)
            drafter = cls(config, target.input_embeddings, target.model.get_output_embeddings())
            drafter.reset_parameters()
        return drafter.to(device=target.device, dtype=target.dtype)

    def reset_parameters(self) -> None:
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=1.0 / math.sqrt(module.in_features))
                if module.bias is not None:
                    nn.init.zeros_(module.bias)

    def embed(self, token_ids: Tensor, dtype: torch.dtype) -> Tensor:
        return F.embedding(token_ids, self.embed_tokens.weight.detach()).to(dtype)

    def target_input(
        self, features: Tensor, token_ids: Tensor, attention_mask: Tensor, cache: RaggedCache | None,
        media: PairMedia | None,
    ) -> LayerInput:
        """How Q committed pairs (the target's features) and their media enter the decoder layer."""
        raise NotImplementedError

    def draft_input(self, hidden: Tensor, token_ids: Tensor, attention_mask: Tensor) -> LayerInput:
        """How Q draft pairs (the drafter's own states) enter the decoder layer."""
        raise NotImplementedError

    def read_target(
        self, features: Tensor, token_ids: Tensor, positions: Tensor, attention_mask: Tensor,
        cache: RaggedCache | None, media: PairMedia | None = None,
    ) -> Tensor:
        return self._layers(self.target_input(features, token_ids, attention_mask, cache, media), positions, cache)

    def read_draft(
        self, hidden: Tensor, token_ids: Tensor, positions: Tensor, attention_mask: Tensor, cache: RaggedCache | None,
    ) -> Tensor:
        return self._layers(self.draft_input(hidden, token_ids, attention_mask), positions, cache)

    def _layers(self, entry: LayerInput, positions: Tensor, cache: RaggedCache | None) -> Tensor:
        x = entry.x
        for layer in self.layers:
            x = layer(x, positions, entry.attention_mask, cache)
        if entry.hide is not None and cache is not None:  # a HidingCache: `new_cache` made it
            cache.hide_new(entry.hide)
        return x if entry.extra_state is None else torch.cat([x, entry.extra_state.to(x.dtype)], dim=-1)

    def target_features(self, aux_hidden: Tensor | None, last_hidden: Tensor) -> Tensor:
        return last_hidden

    def check_media(self, num_spans: int) -> None:
        limit = self.config.max_images
        if limit is not None and num_spans > limit:
            raise UserError(f"{num_spans} images in one prompt, but this {self.display_name} drafter takes at most "
                            f"{limit} (max_images in its config.json)")

    def set_draft_vocab(self, target_ids: Tensor) -> None:
        """Draft over `target_ids` [Vd]: the whole target vocabulary, or, with a `draft_vocab_size`, that many ids."""
        ids = torch.sort(target_ids.to(torch.long).cpu()).values
        size = self.config.draft_vocab_size
        if size is None:
            if not torch.equal(ids, torch.arange(self.config.vocab_size)):
                raise ValueError(f"this {self.display_name} drafter drafts over the whole target vocabulary "
                                 f"({self.config.vocab_size} ids); `restricted` narrows it")
            return
        vocab = self.config.vocab_size
        if ids.numel() != size or ids.unique().numel() != size or int(ids[0]) < 0 or int(ids[-1]) >= vocab:
            raise ValueError(f"need {size} distinct target ids below {vocab}, got {ids.numel()}")
        self.draft_ids.copy_(ids)

    def restricted(self, target_ids: Tensor) -> Eagle1Drafter:
        config = dataclasses.replace(self.config, draft_vocab_size=int(target_ids.numel()))
        drafter = type(self)(config, self.embed_tokens, self.lm_head)
        drafter.load_state_dict({k: v for k, v in self.state_dict().items() if k != "draft_ids"}, strict=False)
        drafter.set_draft_vocab(target_ids)
        return drafter.to(device=self.fc.weight.device, dtype=self.fc.weight.dtype).train(self.training)

    def draft_logits(self, hidden: Tensor) -> Tensor:
        # the target's head (or its draft vocabulary's rows), in its dtype (bf16 targets: bf16 logits)
        head = self.lm_head if self.config.draft_vocab_size is None else self.draft_head()
        hidden = hidden[..., : self.config.hidden_size].to(head.weight.dtype)
        if torch.is_grad_enabled():  # training: gradients reach the drafter's states, never the target's head
            return F.linear(hidden, head.weight.detach())
        return head(hidden)  # decoding: the head as the target runs it (the exact kernels' packed linear)

    def draft_head(self) -> nn.Module:
        """The draft vocabulary's rows of the target's LM head as a linear layer (on oneDNN's packed kernel where the
        target's own head runs on it), sliced again when the ids or the head change."""
        weight = self.lm_head.weight.detach()
        ids = self.draft_ids
        source = (ids.data_ptr(), ids._version, weight.data_ptr(), weight._version, weight.dtype, weight.device)
        if self._head_rows is None or self._head_rows[0] != source:
            rows = nn.Linear(self.config.hidden_size, ids.numel(), bias=False, device="meta")
            rows.weight = nn.Parameter(weight.index_select(0, ids.to(weight.device)).contiguous(), requires_grad=False)
            packed = getattr(self.lm_head, "packed", None) is not None  # the target's head on the exact packed linear
            self._head_rows = source, packed_linear(rows) if packed else rows
        return self._head_rows[1]

    def draft_logprobs(self, hidden: Tensor) -> Tensor:
        return torch.log_softmax(self.draft_logits(hidden).float(), dim=-1)

    def draft_to_target(self, draft_ids: Tensor) -> Tensor:
        return draft_ids if self.config.draft_vocab_size is None else self.draft_ids[draft_ids]

    def draft_vocab_target_ids(self) -> Tensor:
        if self.config.draft_vocab_size is not None:
            return self.draft_ids
        return torch.arange(self.config.vocab_size, device=self.fc.weight.device)

    def check_target(self, target) -> None:
        check_fits_target(target, self.config.hidden_size, self.config.vocab_size, self.config.target_name)

    def save_pretrained(self, out_dir: str | Path) -> None:
        save_drafter_folder(self, asdict(self.config), out_dir)

    def new_cache(self, batch_size: int, device: torch.device | str) -> HidingCache:
        return HidingCache(batch_size, device)

    @classmethod
    def from_pretrained(cls, path: str | Path, target) -> Eagle1Drafter:
        config = read_drafter_config(path, cls.config_class, f"a {cls.display_name}")
        drafter = cls(config, target.input_embeddings, target.model.get_output_embeddings())
        drafter.check_target(target)
        load_drafter_weights(drafter, path, cls.display_name)
        return drafter.to(device=target.device, dtype=target.dtype).eval()
