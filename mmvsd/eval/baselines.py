"""HF `generate` baselines on the same target (batch size 1): greedy, prompt lookup, assisted.

They are lossless references for comparison; the speed-up denominator is mmvsd's own vanilla loop.
"""

from __future__ import annotations

import time

import torch

from mmvsd.adapter_base import Prompt
from mmvsd.decoding.decode import DecodeConfig, SequenceResult
from mmvsd.target import Target


@torch.no_grad()
def hf_generate(
    target: Target,
    prompt: list[int] | Prompt,
    config: DecodeConfig,
    prompt_lookup_num_tokens: int | None = None,
    assistant_model=None,
) -> SequenceResult:
    """One prompt through `model.generate` (greedy or sampled per `config`); a `Prompt` with media
    goes in as input ids plus its input embeddings, which transformers reads at the first step."""
    prompt_ids = list(prompt.token_ids) if isinstance(prompt, Prompt) else list(prompt)
    ids = torch.tensor([prompt_ids], device=target.device)
    eos = sorted(target.eos_token_ids) or None
    kwargs = dict(
        max_new_tokens=config.max_new_tokens,
        do_sample=config.temperature > 0,
        eos_token_id=eos,
        pad_token_id=eos[0] if eos else 0,
        attention_mask=torch.ones_like(ids),
    )
    if config.temperature > 0:
        kwargs.update(temperature=config.temperature, top_k=0, top_p=1.0)
        torch.manual_seed(config.seed)
    if prompt_lookup_num_tokens:
        kwargs["prompt_lookup_num_tokens"] = prompt_lookup_num_tokens
    if assistant_model is not None:
        kwargs["assistant_model"] = assistant_model
    if isinstance(prompt, Prompt) and prompt.inputs_embeds is not None:
        kwargs["inputs_embeds"] = prompt.inputs_embeds[None].to(target.device, target.dtype)
    start = time.perf_counter()
    out = target.model.generate(ids, **kwargs)
    wall = time.perf_counter() - start
    new_ids = out[0, len(prompt_ids) :].tolist()
    return SequenceResult(list(prompt_ids), new_ids, num_target_forwards=0, wall_seconds=wall, finished=True)
