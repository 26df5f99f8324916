"""The target wrapper: prefill and tree forwards on a ragged KV cache, plus auxiliary hidden states.

Every forward takes explicit token depths and a block mask; the wrapper turns them into position
ids and an additive 4D attention mask over the cache (never a mask set on the model).
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from transformers import AttentionInterface, PreTrainedModel, PreTrainedTokenizerBase
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

from mmvsd.decoding.kv import RaggedCache
from mmvsd.errors import UserError

PLAIN_PREFIXES = {"system": "System: ", "user": "User: ", "assistant": "Assistant: "}  # chat without a template
GQA_SDPA = "mmvsd_sdpa"  # transformers' sdpa, with grouped-query attention read in place on the CPU


def gqa_sdpa_attention(module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
                       **kwargs) -> tuple[Tensor, None]:
    """transformers' sdpa attention, except for several queries with an explicit mask on the CPU.

    There transformers copies every KV head once per query head (`repeat_kv`: 2 copies of the whole
    cache per layer and forward); torch's CPU kernel reads the KV heads in place with `enable_gqa`
    and gives the same numbers. Elsewhere (CUDA falls back to its slow math kernel with a mask and
    GQA; one query is already packed by transformers) the stock function runs.
    query [B, Hq, N, D]; key, value [B, Hkv, T, D]; attention_mask [B, 1, N, T] additive.
    """
    groups = getattr(module, "num_key_value_groups", 1)
    plain = kwargs.get("position_bias") is None and kwargs.get("softcap") is None and not kwargs.get("dropout")
    if query.device.type != "cpu" or attention_mask is None or groups == 1 or query.shape[2] == 1 or not plain:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, scale=kwargs.get("scaling"), enable_gqa=True
    )  # [B, Hq, N, D]
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(GQA_SDPA, gqa_sdpa_attention)
ALL_MASK_ATTENTION_FUNCTIONS.register(GQA_SDPA, sdpa_mask)


def own_precision(device: torch.device) -> AbstractContextManager:
    """Autocast off: inside it the target's arithmetic is its own dtype's (or fp32 where asked), not the autocast
    dtype a training step computes the drafter in."""
    return torch.autocast(device.type, enabled=False) if device.type in ("cpu", "cuda") else nullcontext()


@dataclass(frozen=True)
class TargetOutput:
    """What one target forward returns."""

    logits: Tensor  # [B, M, V] at the requested query positions (all N by default)
    aux_hidden: Tensor | None  # [B, N, 3H] hidden states entering the auxiliary layers, or None
    last_hidden: Tensor  # [B, N, H] final (normed) hidden states; logits = target.logits(last_hidden)


def default_aux_layer_ids(num_layers: int) -> tuple[int, ...]:
    """EAGLE-3's low/mid/high feature layers: the inputs of layers 2, L//2 and L-3."""
    return (min(2, num_layers - 1), num_layers // 2, max(num_layers - 3, 0))


class Target:
    """An HF causal LM (or LLaVA model) seen through the operations speculative decoding needs."""

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase | None,
        name: str,
        aux_layer_ids: tuple[int, ...] | None = None,
        processor=None,
    ) -> None:
        self.model = model.eval().requires_grad_(False)  # never trained: a drafter that reads its embeddings must
        # not make autograd compute their gradient (a dense [V, H] buffer every training step)
        self.tokenizer = tokenizer
        self.processor = processor  # a multimodal processor (images -> pixels, placeholders), or None
        self.name = name
        text_config = model.config.get_text_config(decoder=True)
        self.vocab_size: int = model.get_output_embeddings().weight.shape[0]
        self.hidden_size: int = text_config.hidden_size
        self.num_layers: int = text_config.num_hidden_layers
        self.max_positions: int = getattr(text_config, "max_position_embeddings", 1 << 30)
        self.aux_layer_ids = tuple(aux_layer_ids or default_aux_layer_ids(self.num_layers))
        self.eos_token_ids = _eos_ids(model, tokenizer)
        self.engine = "stock"  # how the forward runs: "stock" kernels or `mmvsd.decoding.cpu_kernels`'s exact one
        if text_config._attn_implementation == "sdpa":
            text_config._attn_implementation = GQA_SDPA

    @property
    def device(self) -> torch.device:
        return self.model.get_output_embeddings().weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.get_output_embeddings().weight.dtype

    @property
    def input_embeddings(self) -> nn.Embedding:
        return self.model.get_input_embeddings()

    def new_cache(self, batch_size: int) -> RaggedCache:
        return RaggedCache(batch_size, self.device)

    @torch.no_grad()
    def forward(
        self,
        cache: RaggedCache,
        token_ids: Tensor,
        depths: Tensor,
        block_mask: Tensor,
        *,
        need_aux: bool = True,
        logit_positions: Tensor | None = None,
        inputs_embeds: Tensor | None = None,
        past_lens: Tensor | None = None,
    ) -> TargetOutput:
        """Run N new tokens per row on top of the cache and append their KV as the cache's block.

        token_ids [B, N]; depths [B, N]: position offsets after each row's committed tokens;
        block_mask [B, N, M]: which of the M block entries (appended since the last commit, these N
            last) each new token attends to (itself included);
        logit_positions [B, M]: query indices whose logits are wanted (default: all N);
        inputs_embeds [B, N, H]: given instead of embedding token_ids (e.g. image features);
        past_lens [B, N]: committed tokens each new token sees (default all: see RaggedCache).
        """
        mask = cache.attention_mask(block_mask, self.dtype, past_lens)
        with own_precision(token_ids.device):  # the target computes in its dtype, also inside a bf16 training step
            out = self.model.model(
                input_ids=None if inputs_embeds is not None else token_ids,
                inputs_embeds=inputs_embeds,
                attention_mask=mask,
                position_ids=cache.positions(depths, past_lens),
                cache=cache.kv,
                use_cache=True,
                output_hidden_states=need_aux,
            )
        last_hidden = out.last_hidden_state  # [B, N, H]
        hidden = last_hidden
        if logit_positions is not None:
            hidden = hidden.gather(1, logit_positions[:, :, None].expand(-1, -1, hidden.shape[-1]))
        aux = None
        if need_aux:
            aux = torch.cat([out.hidden_states[i] for i in self.aux_layer_ids], dim=-1)
        return TargetOutput(self.logits(hidden), aux, last_hidden)

    @torch.no_grad()
    def logits(self, last_hidden: Tensor) -> Tensor:
        """[..., V] target logits from final hidden states [..., H] (the LM head alone)."""
        return self.model.get_output_embeddings()(last_hidden)

    @torch.no_grad()
    def float_logits(self, last_hidden: Tensor) -> Tensor:
        """[..., V] fp32 logits: the LM head computed in fp32 from the (maybe half-precision) hidden states, so a
        bf16 target's log-probabilities are not rounded to bf16 (whose logits carry ~0.1 nats of error at 20); also
        under a training step's bf16 autocast, which would otherwise run this product in bf16."""
        head = self.model.get_output_embeddings()
        with own_precision(last_hidden.device):
            if head.weight.dtype == torch.float32 and last_hidden.dtype == torch.float32:
                return head(last_hidden)
            bias = None if getattr(head, "bias", None) is None else head.bias.float()
            return torch.nn.functional.linear(last_hidden.float(), head.weight.float(), bias)

    def encode_prompt(self, text: str) -> list[int]:
        """Token ids of a user prompt, through the chat template when the tokenizer has one."""
        return self.encode_chat([{"role": "user", "content": text}])

    def encode_chat(self, messages: list[dict[str, str]]) -> list[int]:
        """Token ids asking for the next assistant turn after `messages` ({"role", "content"} dicts): the
        tokenizer's chat template with the generation prompt; without one, a lone user message is its plain
        text and a conversation the plain `User: ...\nAssistant: ` format (`PLAIN_PREFIXES`, as training
        renders it)."""
        if self.tokenizer is None:
            raise UserError(f"target {self.name!r} has no tokenizer; pass token ids instead of text")
        if getattr(self.tokenizer, "chat_template", None):
            ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
            return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
        if len(messages) == 1 and messages[0]["role"] == "user":
            return list(self.tokenizer(messages[0]["content"])["input_ids"])
        text = "".join(f"{PLAIN_PREFIXES[m['role']]}{m['content']}\n" for m in messages)
        return list(self.tokenizer(text + PLAIN_PREFIXES["assistant"])["input_ids"])

    def decode(self, token_ids: list[int]) -> str:
        if self.tokenizer is None:
            return " ".join(map(str, token_ids))
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    def check_length(self, prompt_len: int, max_new_tokens: int, lookahead: int) -> None:
        """Refuse prompts that cannot fit the context window with the requested generation."""
        need = prompt_len + max_new_tokens + lookahead
        if prompt_len < 1:
            raise UserError("empty prompt: nothing to condition on")
        if need > self.max_positions:
            raise UserError(
                f"prompt of {prompt_len} tokens + {max_new_tokens} new tokens (+{lookahead} for the draft "
                f"tree) exceeds the context window of {self.max_positions} tokens of target {self.name!r}"
            )


def _eos_ids(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase | None) -> frozenset[int]:
    ids: set[int] = set()
    gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    for value in (gen_eos, getattr(tokenizer, "eos_token_id", None) if tokenizer else None):
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(int(v) for v in value)
    return frozenset(ids)
