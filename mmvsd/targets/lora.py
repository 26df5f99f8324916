"""Low-rank adapters (LoRA) on the language model's linear layers, for smol-llava's visual-instruction
stage: W x + (alpha / r) B A x with A [r, in] random and B [out, r] zero at the start, so training
starts from the unchanged model. After training the deltas are merged into the weights (the model
stays a stock ``LlavaForConditionalGeneration``) and saved as ``delta = (alpha / r) B A`` per layer.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class LoRALinear(nn.Module):
    """A frozen linear layer plus a trainable low-rank update."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float, generator: torch.Generator) -> None:
        super().__init__()
        self.base = base
        self.scale = alpha / rank
        self.lora_a = nn.Parameter(
            torch.randn(rank, base.in_features, generator=generator) / math.sqrt(base.in_features))
        self.lora_b = nn.Parameter(torch.zeros(base.out_features, rank))

    def forward(self, x: Tensor) -> Tensor:
        return self.base(x) + (x @ self.lora_a.T @ self.lora_b.T) * self.scale

    def delta(self) -> Tensor:
        """[out, in] the update to add to the base weight."""
        return (self.lora_b @ self.lora_a) * self.scale


def add_lora(language_model: nn.Module, rank: int, alpha: float, seed: int) -> list[LoRALinear]:
    """Wrap every target linear layer of the decoder layers in place; return the wrappers."""
    generator = torch.Generator().manual_seed(seed)
    wrapped = []
    for module in list(language_model.modules()):
        for name in TARGET_MODULES:
            child = getattr(module, name, None)
            if isinstance(child, nn.Linear):
                lora = LoRALinear(child, rank, alpha, generator)
                setattr(module, name, lora)
                wrapped.append(lora)
    return wrapped


LORA_PREFIX = "lora."


def lora_state(language_model: nn.Module) -> dict[str, Tensor]:
    """The trained factors, {"lora.<module path>.a": A [r, in], "lora.<module path>.b": (alpha / r) B [out, r]}."""
    state = {}
    for path, module in language_model.named_modules():
        if isinstance(module, LoRALinear):
            state[f"{LORA_PREFIX}{path}.a"] = module.lora_a.detach().clone()
            state[f"{LORA_PREFIX}{path}.b"] = (module.lora_b.detach() * module.scale).contiguous()
    return state


@torch.no_grad()
def merge_lora(language_model: nn.Module) -> None:
    """Fold every LoRALinear back into its plain linear layer (weight += its delta)."""
    for module in list(language_model.modules()):
        for name in TARGET_MODULES:
            child = getattr(module, name, None)
            if isinstance(child, LoRALinear):
                child.base.weight += child.delta()
                setattr(module, name, child.base)


@torch.no_grad()
def apply_lora_state(language_model: nn.Module, state: dict[str, Tensor]) -> int:
    """Add b @ a to the weight of each linear layer named in `state` (keys from `lora_state`); return how many.
    Raises ValueError when a name or shape does not fit the model."""
    paths = sorted({key[len(LORA_PREFIX):].rsplit(".", 1)[0] for key in state if key.startswith(LORA_PREFIX)})
    for path in paths:
        a, b = state.get(f"{LORA_PREFIX}{path}.a"), state.get(f"{LORA_PREFIX}{path}.b")
        try:
            layer = language_model.get_submodule(path)
        except AttributeError:
            layer = None
        if not isinstance(layer, nn.Linear) or a is None or b is None or a.dim() != 2 or b.dim() != 2 \
                or (b.shape[0], a.shape[1]) != tuple(layer.weight.shape) or a.shape[0] != b.shape[1]:
            raise ValueError(f"low-rank adapter {path!r} does not fit the language model")
        layer.weight += (b @ a).to(layer.weight.dtype)
    return len(paths)
