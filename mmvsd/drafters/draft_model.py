"""A draft model: a smaller causal LM with the target's tokenizer proposes the tree (`--drafter model:SPEC`), as
transformers' assisted generation and llama.cpp's draft models do, but with top-k branching at every node.

The draft model keeps its own ragged KV cache of the committed tokens (the prompt's first token included), reads
each step's accepted tokens in one forward, and drafts a tree level by level: every frontier node is one new
token that attends to the committed context and its own ancestors in the tree, exactly as the target verifies
them. It reads nothing of the target but the tokens, so `target_features` is empty; its proposals are the draft
model's top-k log-probabilities, so at T > 0 the verifier treats them as deterministic drafts (lossless in
distribution), and at T = 0 the output is the target's greedy one token for token.
"""

from __future__ import annotations

import torch
from torch import Tensor

from mmvsd.decoding.cpu_kernels import pack_for_cpu, packed_linear
from mmvsd.decoding.draft_session import DraftInputs, concat_pairs, select_pairs
from mmvsd.decoding.kv import sequence_block
from mmvsd.decoding.weight_quant import FORMATS, format_available, format_dtypes, quantize_module
from mmvsd.errors import UserError
from mmvsd.target import Target
from mmvsd.target_loader import check_target_spec, load_target_folder, resolve_target_folder

PREFIX = "model:"


class DraftModel:
    """A causal LM that drafts for a target with the same tokenizer (the `Proposer` interface)."""

    reads_aux = False
    proposes_from_context = False

    def __init__(self, model: Target, name: str) -> None:
        self.model = model
        self.name = name
        self.drafter_type = f"{PREFIX}{name}"  # cost profiles are kept per draft model
        self.config = model.model.config.get_text_config(decoder=True)  # its widths, for fingerprints
        self.draft_vocab_size = model.vocab_size

    @property
    def neural(self) -> DraftModel:
        """The weights it runs (for cost fingerprints): its own."""
        return self

    def parameters(self):
        return self.model.model.parameters()

    def check_media(self, num_spans: int) -> None:
        if num_spans:
            raise UserError(f"the draft model {self.name} drafts for text prompts; a prompt with images needs a "
                            f"drafter that reads them (vispec, msd)")

    def target_features(self, aux_hidden: Tensor | None, last_hidden: Tensor) -> Tensor:
        return last_hidden[..., :0]  # [B, N, 0]: it reads tokens only

    def new_session(self, batch_size: int) -> DraftModelSession:
        return DraftModelSession(self, batch_size)


def check_same_tokenizer(draft: Target, target: Target, name: str) -> None:
    """UserError unless the draft model tokenizes text as the target does (same vocabulary, same ids)."""
    mine, theirs = draft.tokenizer, target.tokenizer
    if mine is None or theirs is None:
        raise UserError(f"--drafter {PREFIX}{name}: the draft model and the target need their tokenizers to be "
                        f"compared (a folder with tokenizer files)")
    if mine.get_vocab() != theirs.get_vocab():
        raise UserError(f"--drafter {PREFIX}{name}: its tokenizer differs from target {target.name!r}'s "
                        f"({len(mine.get_vocab())} vs {len(theirs.get_vocab())} tokens, or other ids); a draft model "
                        f"must share the target's tokenizer")
    if draft.vocab_size < target.vocab_size:
        raise UserError(f"--drafter {PREFIX}{name}: its output vocabulary ({draft.vocab_size}) is smaller than the "
                        f"target's ({target.vocab_size})")


class DraftModelSession:
    """The draft model's KV cache over a batch and its log-probabilities at each row's last committed token."""

    def __init__(self, drafter: DraftModel, batch_size: int) -> None:
        self.drafter = drafter
        self.cache = drafter.model.new_cache(batch_size)
        self.last_logprobs: Tensor | None = None  # [B, V] next-token log-probs after the committed tokens
        self.num_expanded = 0
        self.deferred: list[DraftInputs] = []

    def _logprobs(self, logits: Tensor) -> Tensor:
        return torch.log_softmax(logits[..., : self.drafter.draft_vocab_size].float(), dim=-1)

    @torch.no_grad()
    def advance(self, inputs: DraftInputs) -> None:
        """Read the committed tokens (the prompt's first token too, at prefill) in one forward."""
        if self.deferred:
            inputs = concat_pairs([*self.deferred, inputs])
            self.deferred = []
        tokens, num_new = inputs.next_ids, inputs.num_new
        if inputs.first_ids is not None and self.cache.committed_len == 0:
            tokens = torch.cat([inputs.first_ids[:, None].to(tokens.device), tokens], dim=1)
            num_new = num_new + 1
        device = self.drafter.model.device
        tokens, num_new = tokens.to(device), num_new.to(device)
        depths, causal = sequence_block(tokens.shape[0], tokens.shape[1], device)
        out = self.drafter.model.forward(self.cache, tokens, depths, causal, need_aux=False,
                                         logit_positions=(num_new - 1)[:, None])
        self.cache.keep(depths, num_new)
        self.last_logprobs = self._logprobs(out.logits[:, 0])

    def defer(self, inputs: DraftInputs) -> None:
        self.deferred.append(inputs)

    def light_expander(self) -> None:
        return None

    def root_candidates(self, topk: int) -> tuple[Tensor, Tensor]:
        if self.deferred:
            deferred, self.deferred = self.deferred, []
            self.advance(concat_pairs(deferred))
        self.num_expanded = 0
        top = self.last_logprobs.topk(min(topk, self.last_logprobs.shape[-1]), dim=-1)
        return top.indices, top.values

    @torch.no_grad()
    def expand(self, token_ids: Tensor, parent_slots: Tensor, block_mask: Tensor, topk: int) -> tuple[Tensor, Tensor]:
        """One draft-model forward over a frontier of K nodes (each sees its ancestors through `block_mask`)."""
        depths = torch.full_like(token_ids, self.num_expanded)
        out = self.drafter.model.forward(self.cache, token_ids, depths, block_mask, need_aux=False)
        self.num_expanded += 1
        top = self._logprobs(out.logits).topk(topk, dim=-1)  # [B, K, k]
        return top.indices, top.values

    def end_round(self) -> None:
        self.cache.drop_block()
        self.num_expanded = 0

    def select_rows(self, rows: Tensor) -> None:
        self.cache.select_rows(rows.to(self.cache.lens.device))
        self.last_logprobs = self.last_logprobs[rows.to(self.last_logprobs.device)]
        self.deferred = [select_pairs(i, rows) for i in self.deferred]


QUANT_OPTION = "@"  # model:NAME@int8 (no comma: bench lists drafters with commas)
QUANTS = ("none", *FORMATS)  # "none": the name alone


def parse_draft_spec(spec: str) -> tuple[str, str]:
    """`model:NAME[@int4|@int8]` -> (NAME, quant)."""
    name, sep, quant = spec[len(PREFIX):].partition(QUANT_OPTION)
    quant = quant if sep else "none"
    if not name:
        raise UserError(f"--drafter {spec}: name a draft model (a built-in target, a folder or a .gguf file)")
    if quant not in QUANTS:
        raise UserError(f"--drafter {spec}: {quant!r} is no weight format; model:NAME@int8 (or @int4) quantises "
                        "the draft model")
    return name, quant


def check_draft_spec(spec: str) -> None:
    """UserError for a `model:` spec that names nothing (its options, or a model that is not there): before loading."""
    check_target_spec(parse_draft_spec(spec)[0])


def quant_applies(quant: str, target: Target) -> bool:
    """Whether a draft model next to `target` can run on `quant` weights here (a CPU, a dtype the kernel serves)."""
    return target.device.type == "cpu" and target.dtype in format_dtypes(quant) and format_available(quant)


def runnable_default(spec: str, target: Target) -> str:
    """A built-in target's default `model:NAME@FMT` as it runs next to `target`: the bare `model:NAME` where FMT
    cannot (a GPU, an fp16 target); an explicit `--drafter model:NAME@FMT` keeps its format, or is an error."""
    name, quant = parse_draft_spec(spec)
    return spec if quant == "none" or quant_applies(quant, target) else f"{PREFIX}{name}"


def load_draft_model(spec: str, target: Target) -> DraftModel:
    """The draft model `--drafter model:NAME[@int4|@int8]` names (a built-in target name, a folder or a .gguf
    file), in the target's dtype on its device (never on the exact kernels: its numbers never reach the output;
    bf16 on a CPU runs on oneDNN's packed kernels, and with `@int4`/`@int8` its small forwards on those weights,
    `mmvsd.decoding.weight_quant`), checked to share the target's tokenizer."""
    name, quant = parse_draft_spec(spec)
    if quant != "none" and not quant_applies(quant, target):
        kinds = " or ".join(str(d).removeprefix("torch.") for d in format_dtypes(quant))
        raise UserError(f"--drafter {spec}: {quant} draft weights run on a CPU with a {kinds} target, and torch's "
                        f"{quant} CPU kernel; here the target is {target.dtype} on {target.device}")
    folder = resolve_target_folder(name)
    draft = load_target_folder(folder, name, dtype=target.dtype, device=str(target.device))
    check_same_tokenizer(draft, target, name)
    if quant != "none":
        bf16 = target.dtype == torch.bfloat16  # bf16 runs its larger calls on oneDNN's packed kernel
        quantize_module(draft.model, quant, dense_of=packed_linear if bf16 else (lambda linear: linear))
    else:
        pack_for_cpu(draft.model)  # bf16 on a CPU: oneDNN's prepacked kernels (a quarter faster for Qwen2.5-0.5B)
    return DraftModel(draft, name if quant == "none" else f"{name}{QUANT_OPTION}{quant}")
