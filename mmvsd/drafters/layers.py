"""The layers the EAGLE-family drafters share: Llama's RMSNorm, rotary embedding, grouped-query attention over
an external ragged cache and gated MLP, and the sizes a drafter's layers copy from its target."""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mmvsd.decoding.kv import RaggedCache


class AttentionSizes(Protocol):
    """What `Attention` reads of a drafter's config (EAGLE-3's and EAGLE-1's both have these fields)."""

    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rope_theta: float


def layer_sizes(target) -> dict:
    """The sizes of `target`'s decoder layers that a drafter's layers copy, plus its vocabulary and name."""
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

    def __init__(self, config: AttentionSizes, in_size: int, layer_idx: int = 0) -> None:
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx  # its layer in the drafter's cache
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
            k, v = cache.kv.update(k, v, self.layer_idx)  # [B, kv_heads, T, hd]
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
