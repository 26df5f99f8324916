"""EAGLE-3 drafter: fc over low/mid/high target features, one decoder layer, reduced draft vocab.

Layout (matches the EAGLE-3 checkpoints that vLLM and SGLang load, minus their config keys):
    fc            [H, 3H]   target features -> hidden
    midlayer.*    one Llama decoder layer whose q/k/v read [input_layernorm(emb) ; hidden_norm(h)] (2H)
    norm          final RMSNorm
    lm_head       [Vd, H]   logits over the draft vocabulary
    d2t           [Vd] long draft id i is target id i + d2t[i];  t2d [V] bool: target id in draft vocab
Token embeddings are borrowed from the target and never saved.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mmvsd.decoding.kv import RaggedCache
from mmvsd.drafter_base import (
    Drafter,
    PairMedia,
    check_fits_target,
    load_drafter_weights,
    read_drafter_config,
    save_drafter_folder,
)


@dataclass
class Eagle3Config:
    """Sizes of an EAGLE-3 drafter and the target it was made for."""

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int  # target vocabulary
    draft_vocab_size: int
    target_hidden_size: int
    aux_layer_ids: list[int] = field(default_factory=list)
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 2048
    target_name: str = ""

    @classmethod
    def from_target(cls, target, draft_vocab_size: int | None = None) -> Eagle3Config:
        """A drafter config sized like `target`'s decoder layers."""
        return cls(
            **layer_sizes(target),
            draft_vocab_size=min(draft_vocab_size or target.vocab_size, target.vocab_size),
            target_hidden_size=target.hidden_size,
            aux_layer_ids=list(target.aux_layer_ids),
        )


def layer_sizes(target) -> dict:
    """The sizes of `target`'s decoder layers that a one-layer drafter copies, plus its vocabulary and name."""
    text = target.model.config.get_text_config(decoder=True)
    heads = text.num_attention_heads
    return {
        "hidden_size": text.hidden_size,
        "intermediate_size": text.intermediate_size,
        "num_attention_heads": heads,
        "num_key_value_heads": getattr(text, "num_key_value_heads", heads) or heads,
        "head_dim": getattr(text, "head_dim", None) or text.hidden_size // heads,
        "vocab_size": target.vocab_size,
        "rms_norm_eps": getattr(text, "rms_norm_eps", 1e-6),
        "rope_theta": _rope_theta(text),
        "max_position_embeddings": target.max_positions,
        "target_name": target.name,
    }


def _rope_theta(text_config) -> float:
    params = getattr(text_config, "rope_parameters", None) or {}
    return float(params.get("rope_theta", getattr(text_config, "rope_theta", 10000.0)))


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


def apply_rope(x: Tensor, positions: Tensor, theta: float) -> Tensor:
    """Rotary embedding (Llama's rotate-half form). x [B, heads, Q, hd]; positions [B, Q]."""
    head_dim = x.shape[-1]
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=x.device, dtype=torch.float32) / head_dim))
    angles = positions[:, None, :, None].float() * inv_freq  # [B, 1, Q, hd/2]
    cos, sin = angles.cos().repeat(1, 1, 1, 2), angles.sin().repeat(1, 1, 1, 2)
    x1, x2 = x[..., : head_dim // 2], x[..., head_dim // 2 :]
    rotated = torch.cat([-x2, x1], dim=-1)
    return (x.float() * cos + rotated.float() * sin).to(x.dtype)


class Attention(nn.Module):
    """Grouped-query attention over an input of `in_size` features, with an external ragged cache."""

    def __init__(self, config: Eagle3Config, in_size: int) -> None:
        super().__init__()
        self.config = config
        heads, kv_heads, hd = config.num_attention_heads, config.num_key_value_heads, config.head_dim
        self.q_proj = nn.Linear(in_size, heads * hd, bias=False)
        self.k_proj = nn.Linear(in_size, kv_heads * hd, bias=False)
        self.v_proj = nn.Linear(in_size, kv_heads * hd, bias=False)
        self.o_proj = nn.Linear(heads * hd, config.hidden_size, bias=False)

    def forward(self, x: Tensor, positions: Tensor, attention_mask: Tensor, cache: RaggedCache | None) -> Tensor:
        batch, num_q, _ = x.shape
        cfg = self.config
        q = self.q_proj(x).view(batch, num_q, cfg.num_attention_heads, cfg.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(batch, num_q, cfg.num_key_value_heads, cfg.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(batch, num_q, cfg.num_key_value_heads, cfg.head_dim).transpose(1, 2)
        q, k = apply_rope(q, positions, cfg.rope_theta), apply_rope(k, positions, cfg.rope_theta)
        if cache is not None:
            k, v = cache.kv.update(k, v, 0)  # [B, kv_heads, T, hd]
        groups = cfg.num_attention_heads // cfg.num_key_value_heads
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask.to(q.dtype))
        return self.o_proj(out.transpose(1, 2).reshape(batch, num_q, -1))


class MLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MidLayer(nn.Module):
    """EAGLE-3's decoder layer: attention reads [normed embedding ; normed hidden]."""

    def __init__(self, config: Eagle3Config) -> None:
        super().__init__()
        size, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = RMSNorm(size, eps)
        self.hidden_norm = RMSNorm(size, eps)
        self.post_attention_layernorm = RMSNorm(size, eps)
        self.self_attn = Attention(config, 2 * size)
        self.mlp = MLP(size, config.intermediate_size)

    def forward(
        self, embeds: Tensor, hidden: Tensor, positions: Tensor, attention_mask: Tensor, cache: RaggedCache | None
    ) -> Tensor:
        x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)
        hidden = hidden + self.self_attn(x, positions, attention_mask, cache)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class Eagle3Drafter(Drafter):
    """The EAGLE-3 draft model."""

    drafter_type = "eagle3"

    def __init__(self, config: Eagle3Config, embed_tokens: nn.Embedding) -> None:
        super().__init__()
        self.config = config
        self.__dict__["embed_tokens"] = embed_tokens  # borrowed from the target, not a parameter
        self.fc = nn.Linear(len(config.aux_layer_ids) * config.target_hidden_size, config.hidden_size, bias=False)
        self.midlayer = MidLayer(config)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(config.vocab_size, dtype=torch.bool))
        self.set_draft_vocab(torch.arange(config.draft_vocab_size))

    @classmethod
    def from_target(cls, target, draft_vocab_size: int | None = 32000, seed: int = 0) -> Eagle3Drafter:
        """A freshly initialised drafter sized for `target` (draft vocab: its first ids until trained)."""
        with torch.random.fork_rng(devices=[]):  # a local stream: the caller's global RNG is left as it was
            torch.manual_seed(seed)
            drafter = cls(Eagle3Config.from_target(target, draft_vocab_size), target.input_embeddings)
            drafter.apply(_init_weights)
        return drafter.to(device=target.device, dtype=target.dtype)

    def set_draft_vocab(self, target_ids: Tensor) -> None:
        """Use `target_ids` ([Vd], e.g. the most frequent tokens) as the draft vocabulary."""
        target_ids = torch.sort(target_ids.to(torch.long)).values
        if target_ids.numel() != self.config.draft_vocab_size:
            raise ValueError(f"need {self.config.draft_vocab_size} draft tokens, got {target_ids.numel()}")
        self.d2t.copy_(target_ids - torch.arange(target_ids.numel()))
        self.t2d.zero_()
        self.t2d[target_ids] = True

    @torch.no_grad()
    def init_from_target(self, target) -> None:
        """Draft LM head = the target's LM-head rows of the draft vocabulary, final norm = the target's:
        the drafter's output space starts as the target's own, so training spends no steps finding it."""
        head = target.model.get_output_embeddings().weight
        self.lm_head.weight.copy_(head[self.draft_vocab_target_ids().to(head.device)].to(self.lm_head.weight))
        final_norm = getattr(target.model.get_decoder(), "norm", None)
        weight = getattr(final_norm, "weight", None)
        if weight is not None and weight.shape == self.norm.weight.shape:
            self.norm.weight.copy_(weight.to(self.norm.weight))

    def read_target(
        self, features: Tensor, token_ids: Tensor, positions: Tensor, attention_mask: Tensor,
        cache: RaggedCache | None, media: PairMedia | None = None,
    ) -> Tensor:
        """EAGLE-3 reads media spans as their placeholder tokens' embeddings (`media` is unused)."""
        return self.read_draft(self.fc(features), token_ids, positions, attention_mask, cache)

    def read_draft(
        self, hidden: Tensor, token_ids: Tensor, positions: Tensor, attention_mask: Tensor, cache: RaggedCache | None,
    ) -> Tensor:
        embeds = self.embed_tokens(token_ids).to(hidden.dtype)
        return self.midlayer(embeds, hidden, positions, attention_mask, cache)

    def draft_logits(self, hidden: Tensor) -> Tensor:
        return self.lm_head(self.norm(hidden))

    def draft_logprobs(self, hidden: Tensor) -> Tensor:
        return torch.log_softmax(self.draft_logits(hidden).float(), dim=-1)

    def draft_to_target(self, draft_ids: Tensor) -> Tensor:
        return draft_ids + self.d2t[draft_ids]

    def draft_vocab_target_ids(self) -> Tensor:
        return self.draft_to_target(torch.arange(self.config.draft_vocab_size, device=self.d2t.device))

    def check_target(self, target) -> None:
        cfg = self.config
        extra = []
        if max(cfg.aux_layer_ids, default=0) > target.num_layers:
            extra.append(f"feature layers {cfg.aux_layer_ids} beyond the target's {target.num_layers} layers")
        check_fits_target(target, cfg.target_hidden_size, cfg.vocab_size, cfg.target_name, extra)

    def save_pretrained(self, out_dir: str | Path) -> None:
        """Write config.json + model.safetensors atomically (a temporary folder, then rename)."""
        save_drafter_folder(self, asdict(self.config), out_dir)

    @classmethod
    def from_pretrained(cls, path: str | Path, target) -> Eagle3Drafter:
        drafter = cls(read_drafter_config(path, Eagle3Config, "an EAGLE-3"), target.input_embeddings)
        drafter.check_target(target)
        load_drafter_weights(drafter, path, "EAGLE-3")
        return drafter.to(device=target.device, dtype=target.dtype).eval()


def _init_weights(module: nn.Module) -> None:
    if isinstance(module, nn.Linear):
        nn.init.normal_(module.weight, std=1.0 / math.sqrt(module.in_features))

