"""The synthetic world of `vsd_control.py`: its settings (`ControlConfig`), the branching order-2 Markov language,
the tiny Llama target trained on it (built once per setting and reused), and the training prompts. What the
control measures in this world, and how, is `vsd_control.py`'s docstring."""

from __future__ import annotations

import ast
import dataclasses
import hashlib
import json
import math
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from torch import Tensor
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

SPECIALS = ["<unk>", "<|user|>", "<|assistant|>", "<eos>"]  # ids 0..3; word w{i} is id 4 + i
USER_ID, ASSISTANT_ID = 1, 2
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}<|assistant|> {% endif %}"
)


@dataclass
class ControlConfig:
    """Every setting of the control (`KEY=VALUE` on the command line); saved with the result."""

    # the language
    num_tokens: int = 64  # words of the chain (the target's vocabulary adds 4 special tokens)
    language_seed: int = 0
    kind_shares: tuple[float, float, float, float] = (0.35, 0.3, 0.2, 0.15)  # near-det., 2, 3 modes, high entropy
    high_entropy_support: int = 8
    prompt_min: int = 8  # words per user prompt
    prompt_max: int = 16
    answer_tokens: int = 64  # words per answer (training and evaluation)
    # the target
    target_hidden: int = 128
    target_intermediate: int = 384
    target_layers: int = 4
    target_heads: int = 4
    target_steps: int = 3000
    target_batch: int = 32
    target_lr: float = 3e-3
    target_seed: int = 0
    # the drafter and its training (one run per arm)
    drafter_intermediate: int = 32
    drafter_head_dim: int = 16
    num_train_conversations: int = 2000
    data_seed: int = 1
    arm_steps: int = 2000
    arm_batch: int = 4
    arm_lr: float = 3e-3
    arm_seed: int = 0
    depth: int = 6  # D: training-time-test steps, VSD path length, chain depth of accept_t1, tree depth
    num_samples: int = 8  # S of the VSD E-step (the paper: 40; CPU scale)
    num_anchors: int = 4
    vsd_alpha: float = 0.1  # ce+vsd = ce + vsd_alpha * vsd
    # evaluation
    tree: str = "32/6/4"  # BUDGET/DEPTH/TOPK of tau_t0 and tau_t1
    num_eval_prompts: int = 100
    eval_seed: int = 2
    bootstrap: int = 2000
    bootstrap_seed: int = 0

    def digest(self, *keys: str) -> str:
        """A short hash of the named settings (what a cached artefact depends on)."""
        values = {k: getattr(self, k) for k in keys}
        return hashlib.sha256(json.dumps(values, sort_keys=True).encode()).hexdigest()[:10]


LANGUAGE_KEYS = ("num_tokens", "language_seed", "kind_shares", "high_entropy_support")
TARGET_KEYS = LANGUAGE_KEYS + ("prompt_min", "prompt_max", "answer_tokens", "target_hidden", "target_intermediate",
                               "target_layers", "target_heads", "target_steps", "target_batch", "target_lr",
                               "target_seed")
DATA_KEYS = TARGET_KEYS + ("num_train_conversations", "data_seed")
DRAFTER_KEYS = TARGET_KEYS + ("drafter_intermediate", "drafter_head_dim", "arm_seed")
ARM_KEYS = DATA_KEYS + DRAFTER_KEYS + ("arm_steps", "arm_batch", "arm_lr", "depth", "num_samples", "num_anchors",
                                      "vsd_alpha")
EVAL_KEYS = TARGET_KEYS + ("depth", "tree", "num_eval_prompts", "eval_seed")


def parse_overrides(config: ControlConfig, pairs: list[str]) -> ControlConfig:
    """`KEY=VALUE` pairs applied to a copy of `config` (values as Python literals or strings; unknown keys fail)."""
    kinds = {f.name: type(getattr(config, f.name)) for f in dataclasses.fields(config)}
    changes = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep or key not in kinds:
            raise SystemExit(f"vsd_control: {pair!r} is not KEY=VALUE with KEY one of {', '.join(kinds)}")
        try:
            value = ast.literal_eval(raw)
        except (ValueError, SyntaxError):
            value = raw
        if kinds[key] is float and isinstance(value, int):
            value = float(value)
        if kinds[key] is tuple and isinstance(value, list):
            value = tuple(value)
        if not isinstance(value, kinds[key]):
            raise SystemExit(f"vsd_control: {key} takes a {kinds[key].__name__}, got {raw!r}")
        changes[key] = value
    return dataclasses.replace(config, **changes)


# ----------------------------------------------------------------------------- the language


@dataclass
class MarkovLanguage:
    """An order-2 chain: next_probs[a, b] is the distribution of the word after words a, b."""

    next_probs: Tensor  # [W, W, W]
    kinds: Tensor  # [W, W] 0 near-deterministic, 1 two modes, 2 three modes, 3 high entropy

    @property
    def num_words(self) -> int:
        return self.next_probs.shape[0]

    def sample(self, num: int, length: int, generator: torch.Generator) -> Tensor:
        """[num, length] word indices: two uniform words, then the chain."""
        words = torch.zeros(num, length, dtype=torch.long)
        words[:, :2] = torch.randint(self.num_words, (num, 2), generator=generator)
        for t in range(2, length):
            probs = self.next_probs[words[:, t - 2], words[:, t - 1]]
            words[:, t] = torch.multinomial(probs, 1, generator=generator)[:, 0]
        return words

    def entropy(self) -> float:
        """Mean next-word entropy in nats over contexts (uniform over contexts)."""
        p = self.next_probs
        return float(-(p * p.clamp_min(1e-30).log()).sum(-1).mean())


def make_language(config: ControlConfig) -> MarkovLanguage:
    """The chain of `config.language_seed`: per context a kind (by `kind_shares`) and its successors at random."""
    size = config.num_tokens
    generator = torch.Generator().manual_seed(config.language_seed)
    shares = torch.tensor(config.kind_shares, dtype=torch.float64)
    kinds = torch.multinomial(shares / shares.sum(), size * size, replacement=True, generator=generator)
    next_probs = torch.zeros(size * size, size, dtype=torch.float64)
    for context, kind in enumerate(kinds.tolist()):
        if kind == 0:
            masses = torch.tensor([0.94, 0.04, 0.02], dtype=torch.float64)
        elif kind == 1:
            top = 0.5 + 0.2 * float(torch.rand((), generator=generator, dtype=torch.float64))
            masses = torch.tensor([top, 1 - top], dtype=torch.float64)
        elif kind == 2:
            masses = torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64)
        else:
            gamma = -torch.rand(config.high_entropy_support, generator=generator, dtype=torch.float64).log()
            masses = gamma / gamma.sum()  # Dirichlet(1)
        words = torch.randperm(size, generator=generator)[: len(masses)]
        next_probs[context, words] = masses
    return MarkovLanguage(next_probs.view(size, size, size).float(), kinds.view(size, size))


def word_text(words: list[int]) -> str:
    return " ".join(f"w{w}" for w in words)


def conversation_ids(prompt_words: Tensor, answer_words: Tensor) -> Tensor:
    """[B, 2 + P + A] the token ids of `<|user|> PROMPT <|assistant|> ANSWER` (words are ids 4..)."""
    batch = prompt_words.shape[0]
    user = torch.full((batch, 1), USER_ID, dtype=torch.long)
    assistant = torch.full((batch, 1), ASSISTANT_ID, dtype=torch.long)
    return torch.cat([user, prompt_words + len(SPECIALS), assistant, answer_words + len(SPECIALS)], dim=1)


def sample_conversations(language: MarkovLanguage, num: int, prompt_len: int, answer_len: int,
                         generator: torch.Generator) -> tuple[Tensor, Tensor]:
    """(prompt words [num, prompt_len], answer words [num, answer_len]): one chain run across both."""
    words = language.sample(num, prompt_len + answer_len, generator)
    return words[:, :prompt_len], words[:, prompt_len:]


# ----------------------------------------------------------------------------- the target


def build_target_folder(config: ControlConfig, folder: Path) -> None:
    """A random Llama of the control's sizes plus its word-level tokenizer with the chat template."""
    words = SPECIALS + [f"w{i}" for i in range(config.num_tokens)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<eos>")
    tokenizer.chat_template = CHAT_TEMPLATE
    torch.manual_seed(config.target_seed)
    llama = LlamaConfig(
        vocab_size=len(words), hidden_size=config.target_hidden, intermediate_size=config.target_intermediate,
        num_hidden_layers=config.target_layers, num_attention_heads=config.target_heads,
        num_key_value_heads=max(1, config.target_heads // 2), max_position_embeddings=256, eos_token_id=3,
        bos_token_id=None, pad_token_id=None, tie_word_embeddings=False,
    )
    LlamaForCausalLM(llama).save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def target_batch(config: ControlConfig, language: MarkovLanguage, generator: torch.Generator,
                 num: int) -> tuple[Tensor, Tensor]:
    """(ids [num, 2 + P + A], next-word mask [num, 2 + P + A]) of fresh conversations with one prompt length."""
    prompt_len = int(torch.randint(config.prompt_min, config.prompt_max + 1, (), generator=generator))
    prompts, answers = sample_conversations(language, num, prompt_len, config.answer_tokens, generator)
    ids = conversation_ids(prompts, answers)
    # position j predicts token j+1: learnt where that token is a word with two words of context before it
    predicts_word = torch.zeros_like(ids, dtype=torch.bool)
    predicts_word[:, 2:prompt_len] = True  # ids[:, 3..prompt_len] are prompt words 3.. (1-based)
    predicts_word[:, prompt_len + 1 : -1] = True  # <|assistant|> (at prompt_len + 1) and the answer's words
    return ids, predicts_word


def true_next_probs(language: MarkovLanguage, ids: Tensor) -> Tensor:
    """[B, T, V] the chain's distribution of the next word at each position (markers skipped), zero-padded
    to the target's vocabulary; positions whose context holds fewer than two words are garbage."""
    words = ids - len(SPECIALS)
    is_word = words >= 0
    last = torch.zeros_like(words)
    before = torch.zeros_like(words)
    prev, prev2 = torch.zeros(ids.shape[0], dtype=torch.long), torch.zeros(ids.shape[0], dtype=torch.long)
    for t in range(ids.shape[1]):
        prev2 = torch.where(is_word[:, t], prev, prev2)
        prev = torch.where(is_word[:, t], words[:, t], prev)
        last[:, t], before[:, t] = prev, prev2
    probs = language.next_probs[before, last]  # [B, T, W]
    return torch.nn.functional.pad(probs, (len(SPECIALS), 0))


def target_kl(model, language: MarkovLanguage, config: ControlConfig, num: int = 256, seed: int = 12345) -> float:
    """Mean per-token KL(true chain || target) in nats over the words of fresh conversations."""
    generator = torch.Generator().manual_seed(seed)
    total, count = 0.0, 0
    with torch.no_grad():
        for _ in range(max(1, num // 64)):
            ids, mask = target_batch(config, language, generator, min(64, num))
            logprobs = torch.log_softmax(model(ids).logits.float(), -1)
            truth = true_next_probs(language, ids)
            kl = (truth * (truth.clamp_min(1e-30).log() - logprobs)).sum(-1)
            total += float(kl[mask].sum())
            count += int(mask.sum())
    return total / count


def train_target(config: ControlConfig, language: MarkovLanguage, folder: Path, log=print) -> dict:
    """Next-word cross-entropy on fresh samples of the chain (AdamW, warm-up then cosine); saves the model."""
    model = LlamaForCausalLM.from_pretrained(folder).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.target_lr, betas=(0.9, 0.98), weight_decay=0.0)
    warmup = max(1, config.target_steps // 20)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min((s + 1) / warmup, 0.5 * (
        1 + math.cos(math.pi * min(1.0, s / max(1, config.target_steps))))))
    generator = torch.Generator().manual_seed(config.target_seed + 1)
    start = time.perf_counter()
    for step in range(config.target_steps):
        ids, mask = target_batch(config, language, generator, config.target_batch)
        logits = model(ids).logits[:, :-1]
        loss = torch.nn.functional.cross_entropy(logits[mask[:, :-1]], ids[:, 1:][mask[:, :-1]])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        if (step + 1) % 250 == 0 or step + 1 == config.target_steps:
            log(f"target step {step + 1}/{config.target_steps}: loss {loss.item():.4f} "
                f"({time.perf_counter() - start:.0f} s)")
    model.eval()
    model.save_pretrained(folder)
    return {"train_seconds": time.perf_counter() - start, "final_loss": loss.item()}


def prepared_target(config: ControlConfig, out: Path, language: MarkovLanguage, log=print) -> Path:
    """OUT/target-<digest>: built and trained once per setting of TARGET_KEYS, then reused."""
    folder = out / f"target-{config.digest(*TARGET_KEYS)}"
    manifest = folder / "control_target.json"
    if manifest.is_file():
        return folder
    staging = out / f".{folder.name}.tmp"
    if staging.exists():
        shutil.rmtree(staging)
    staging.mkdir(parents=True)
    build_target_folder(config, staging)
    record = train_target(config, language, staging, log)

    model = LlamaForCausalLM.from_pretrained(staging).eval()
    record["kl_to_chain"] = target_kl(model, language, config)
    record["chain_entropy"] = language.entropy()
    record["settings"] = {k: getattr(config, k) for k in TARGET_KEYS}
    (staging / "control_target.json").write_text(json.dumps(record, indent=1) + "\n")
    staging.rename(folder)
    log(f"target: KL to the chain {record['kl_to_chain']:.4f} nats/token (chain entropy {record['chain_entropy']:.3f})")
    return folder


# ----------------------------------------------------------------------------- the training prompts


def training_data(config: ControlConfig, language: MarkovLanguage, out: Path) -> Path:
    """OUT/data-<digest>.jsonl: chat records of chain prompts; their answers (the chain's own continuation) are
    placeholders that the trainer's `regenerate` replaces with the target's greedy or T = 1 answers."""
    path = out / f"data-{config.digest(*DATA_KEYS)}.jsonl"
    if path.is_file():
        return path
    generator = torch.Generator().manual_seed(config.data_seed)
    lines = []
    for index in range(config.num_train_conversations):
        prompt_len = int(torch.randint(config.prompt_min, config.prompt_max + 1, (), generator=generator))
        prompt, answer = sample_conversations(language, 1, prompt_len, config.answer_tokens, generator)
        lines.append(json.dumps({"id": f"c{index}", "messages": [
            {"role": "user", "content": word_text(prompt[0].tolist())},
            {"role": "assistant", "content": word_text(answer[0].tolist())}]}))
    tmp = path.with_suffix(".tmp")
    tmp.write_text("\n".join(lines) + "\n")
    tmp.rename(path)
    return path
