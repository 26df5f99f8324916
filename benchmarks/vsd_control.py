"""A synthetic control for the objectives (issue 33): where CE, VSD and exact acceptance win, by construction.

The language is a branching order-2 Markov chain over `num_tokens` words, fixed by a seed: each context
(a, b) has its own next-word distribution, drawn from four kinds (near-deterministic, two modes, three
modes, high entropy). A tiny Llama target is trained on samples of it until it models it well (its
per-token KL to the true chain is reported), and saved under OUT (reused when present). A conversation is
`<|user|> PROMPT <|assistant|> ANSWER` in the target's word-level chat template; the chain runs on across the
markers.

Every arm starts from the same narrow EAGLE-3 drafter (`drafters/eagle3.py`: the hidden width must equal
the target's, since the drafter borrows the target's embeddings, so it is narrowed where it can be: a
`drafter_intermediate`-wide MLP and one `drafter_head_dim` attention head, against the target's
`target_intermediate` x `target_layers`), written as an `--init` folder, and is trained by mmvsd's own
trainer (`mmvsd.training.trainer.train`, objectives from `mmvsd.training.objectives`) on the same user
prompts, answered by the target (the trainer's `regenerate`):

    ce-greedy  ce on greedy answers (regenerate=greedy, T = 0)
    ce-sample  ce on T = 1 answers (regenerate=sample)
    vsd        vsd alone (the ELBO's E_q[log kappa] half), T = 1 answers
    ce+vsd     ce + 0.1 * vsd (loss.ce_weight=1.0, loss.vsd_weight=0.1: the paper's recipe), T = 1 answers
    accept     accept alone (sum_v min(p, q) along the unroll), T = 1 answers
    ce+accept  ce + accept, T = 1 answers
    vsd-rloo   VSD's proposals scored by kappa against a leave-one-out baseline (no binary oracle), T = 1 answers
    ce+vsd-rloo  ce + vsd-rloo, T = 1 answers
plus `init`, the untrained drafter, as a floor.

Metrics on held-out prompts (prefixes of the chain drawn with another seed), per prompt, then a bootstrap
(95% percentile intervals; differences paired on the same prompt resamples; with several replicates, i.e.
training seeds (`--replicate OUT:SEED`), each arm's value is the mean over its seeds and the bootstrap draws
seeds, then prompts):
    accept_t1  expected accepted length of a depth-D chain sampled from the drafter and verified at T = 1,
               estimated without bias from the target's own T = 1 continuation y of the prompt
               (`mmvsd.training.acceptance.expected_acceptance`, the powered study's primary metric). At each
               anchor t (the drafter has read the pairs up to t, the root is token t+1; every t whose token t+2
               is a continuation token after the first, which the prefill chooses) the drafter is unrolled D
               steps along the continuation (training-time test: step i is fed the continuation's token t+1+i,
               as a decoding session fed those tokens computes), a_i = sum_v min(p_i(v), q_i(v)) with p_i the
               target's distribution of token t+2+i and q_i the drafter's (0 past the continuation's end),
               r_i = min(p_i, q_i)(y_i) / p_i(y_i) at the continuation's token, and E_t = sum_{k=1..D} r_1 ...
               r_{k-1} a_k. accept_t1 = the mean of E_t over every anchor of every prompt. The table also gives
               the mean a_i per step.
    forced_t1  the teacher-forced product sum_k a_1 ... a_k instead (what the control reported as accept_t1
               before 2026-11-27): each later step's context follows p, not the accepted drafts' law, so it is
               biased beyond depth 1, towards what the `accept` objective maximises.
    tau_t0     tau (new tokens / target forwards, the prefill counted) of tree decoding at T = 0 with
               `mmvsd.decoding.decode.speculative_generate` and the tree `tree`; every output is checked
               token for token against `vanilla_generate` (greedy): the run fails if one differs.
    tau_t1     tau of the same tree decoding at T = 1 (sampled, so noisy; a check that accept_t1 ranks the
               arms as decoding does).

    python benchmarks/vsd_control.py                      # everything, resumable
    python benchmarks/vsd_control.py arm_steps=200 num_eval_prompts=40 --arms ce-sample,accept
    python benchmarks/vsd_control.py --replicate /tmp/vsd_control:0 --replicate /tmp/vsd_control:1 \
        --replicate /tmp/vsd_control:2                     # three training seeds, pooled

`KEY=VALUE` overrides any `ControlConfig` field. OUT (default /tmp/vsd_control) holds the target
(target-<digest>/, reused when its settings match), the data, one folder per trained arm (skipped when
trained) and the evaluations (eval/<arm>-<digest>.json, reused); the result goes to
benchmarks/results/vsd_control.json (and .png) and a markdown table to stdout. Run it with one thread
(OMP_NUM_THREADS=1): it sets torch.set_num_threads(1) itself.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import importlib.util
import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

SPECIALS = ["<unk>", "<|user|>", "<|assistant|>", "<eos>"]  # ids 0..3; word w{i} is id 4 + i
USER_ID, ASSISTANT_ID = 1, 2
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}<|assistant|> {% endif %}"
)
RESULTS = Path(__file__).resolve().parent / "results" / "vsd_control.json"


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
    import ast

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
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

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
    from transformers import LlamaForCausalLM

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
        import shutil

        shutil.rmtree(staging)
    staging.mkdir(parents=True)
    build_target_folder(config, staging)
    record = train_target(config, language, staging, log)
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(staging).eval()
    record["kl_to_chain"] = target_kl(model, language, config)
    record["chain_entropy"] = language.entropy()
    record["settings"] = {k: getattr(config, k) for k in TARGET_KEYS}
    (staging / "control_target.json").write_text(json.dumps(record, indent=1) + "\n")
    staging.rename(folder)
    log(f"target: KL to the chain {record['kl_to_chain']:.4f} nats/token (chain entropy {record['chain_entropy']:.3f})")
    return folder


# ----------------------------------------------------------------------------- data and the narrow drafter


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


def narrow_drafter_folder(config: ControlConfig, target, out: Path) -> Path:
    """OUT/drafter-init-<digest>: the fresh EAGLE-3 drafter every arm starts from (`--init`), narrowed where the
    architecture allows (MLP width, one attention head), drafting over the whole vocabulary."""
    from mmvsd.drafters.eagle3 import Eagle3Config, Eagle3Drafter, _init_weights

    folder = out / f"drafter-init-{config.digest(*DRAFTER_KEYS)}"
    if (folder / "config.json").is_file():
        return folder
    sizes = Eagle3Config.from_target(target, draft_vocab_size=target.vocab_size)
    narrow = dataclasses.replace(sizes, intermediate_size=config.drafter_intermediate, num_attention_heads=1,
                                 num_key_value_heads=1, head_dim=config.drafter_head_dim)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(config.arm_seed)
        drafter = Eagle3Drafter(narrow, target.input_embeddings)
        drafter.apply(_init_weights)
    drafter.save_pretrained(folder)
    return folder


# ----------------------------------------------------------------------------- arms


@dataclass(frozen=True)
class Arm:
    name: str
    objective: str
    regenerate: str  # greedy | sample: the answers it trains on
    overrides: tuple[str, ...] = ()


def control_arms(config: ControlConfig) -> list[Arm]:
    return [
        Arm("ce-greedy", "ce", "greedy"),
        Arm("ce-sample", "ce", "sample"),
        Arm("vsd", "vsd", "sample"),
        Arm("ce+vsd", "ce+vsd", "sample", ("loss.ce_weight=1.0", f"loss.vsd_weight={config.vsd_alpha}")),
        Arm("accept", "accept", "sample"),
        Arm("ce+accept", "ce+accept", "sample", ("loss.accept_weight=1.0",)),
        Arm("vsd-rloo", "vsd-rloo", "sample"),
        Arm("ce+vsd-rloo", "ce+vsd-rloo", "sample", ("loss.rloo_weight=1.0",)),
    ]


def arm_train_config(config: ControlConfig, arm: Arm, target_folder: Path, init_folder: Path, data: Path,
                     out: Path, run_dir: Path):
    """The TrainConfig of one arm (as `mmvsd train` resolves it from flags and key=value overrides)."""
    from mmvsd.training.config import load_train_config

    depth = config.depth
    cache = out / "regenerated" / f"{arm.regenerate}-{config.digest(*DATA_KEYS)}-s{config.arm_seed}.jsonl"
    flags = {"target": str(target_folder), "init": str(init_folder), "objective": arm.objective,
             "output": str(run_dir), "data": str(data)}
    overrides = [
        f"regenerate={arm.regenerate}", f"regenerate_max_new_tokens={config.answer_tokens}",
        f"regenerate_cache={cache}", "regenerate_batch_size=64",
        f"max_length={config.prompt_max + config.answer_tokens + 4}",
        "validation_fraction=0", f"max_steps={config.arm_steps}", f"batch_size={config.arm_batch}",
        f"learning_rate={config.arm_lr}", f"seed={config.arm_seed}", f"save_every={max(1, config.arm_steps // 4)}",
        "keep_checkpoints=1", "eval_every=0", "progress=false", f"log_every={max(1, config.arm_steps // 20)}",
        f"loss.ttt_steps={depth}", f"loss.path_length={depth}", f"loss.num_samples={config.num_samples}",
        f"loss.num_anchors={config.num_anchors}", f"eval_tree={config.tree}", *arm.overrides,
    ]
    return load_train_config(None, flags, overrides)


RUN_RECORD = "control_run.json"


def train_arm(config: ControlConfig, arm: Arm, target, target_folder: Path, init_folder: Path, data: Path,
              out: Path, log=print) -> dict:
    """Train one arm with mmvsd's trainer (resuming an interrupted run from its last checkpoint), or reuse its
    finished run (OUT/runs/<arm>-<digest>/)."""
    from mmvsd.training.trainer import latest_checkpoint, train

    run_dir = out / "runs" / f"{arm.name}-{config.digest(*ARM_KEYS)}"
    record_path = run_dir / RUN_RECORD
    if record_path.is_file():
        return json.loads(record_path.read_text())
    train_config = arm_train_config(config, arm, target_folder, init_folder, data, out, run_dir)
    resume = latest_checkpoint(run_dir) is not None
    log(f"training {arm.name}: {arm.objective} on {arm.regenerate} answers, {config.arm_steps} steps"
        + (f" (resumed from {latest_checkpoint(run_dir).name})" if resume else ""))
    start = time.perf_counter()
    train(train_config, target=target, resume=resume)
    record = {"arm": arm.name, "objective": arm.objective, "data": arm.regenerate, "overrides": list(arm.overrides),
              "steps": config.arm_steps, "train_seconds": time.perf_counter() - start, "resumed": resume,
              "folder": str(run_dir)}
    record_path.write_text(json.dumps(record, indent=1) + "\n")
    log(f"trained {arm.name} in {record['train_seconds']:.0f} s")
    return record


# ----------------------------------------------------------------------------- evaluation


@dataclass
class EvalSet:
    """Held-out prompts (chat-rendered ids) with the target's continuations."""

    prompts: list[list[int]]
    greedy: list[list[int]]  # vanilla_generate at T = 0
    sampled: list[list[int]]  # vanilla_generate at T = 1, one seed per prompt


def eval_seed(config: ControlConfig, index: int) -> int:
    """The sampling seed of held-out prompt `index` (the same for every arm: paired comparisons)."""
    return config.eval_seed * 1_000_003 + index


def eval_prompts(config: ControlConfig, language: MarkovLanguage, target) -> list[list[int]]:
    """Held-out chain prefixes as the target's chat prompts (`Target.encode_chat`, as regeneration builds them)."""
    generator = torch.Generator().manual_seed(config.eval_seed)
    prompts = []
    for _ in range(config.num_eval_prompts):
        prompt_len = int(torch.randint(config.prompt_min, config.prompt_max + 1, (), generator=generator))
        words = language.sample(1, prompt_len, generator)[0]
        ids = target.encode_chat([{"role": "user", "content": word_text(words.tolist())}])
        expected = [USER_ID, *(words + len(SPECIALS)).tolist(), ASSISTANT_ID]
        if ids != expected:
            raise RuntimeError(f"the chat template rendered {ids}, not {expected}")
        prompts.append(ids)
    return prompts


def make_eval_set(config: ControlConfig, language: MarkovLanguage, target, out: Path) -> EvalSet:
    """The held-out prompts and the target's greedy and T = 1 continuations (cached in OUT/eval/)."""
    from mmvsd.decoding.decode import DecodeConfig, generate_each, vanilla_generate

    path = out / "eval" / f"prompts-{config.digest(*EVAL_KEYS)}.json"
    if path.is_file():
        return EvalSet(**json.loads(path.read_text()))
    prompts = eval_prompts(config, language, target)
    greedy = [r.output_ids for r in vanilla_generate(target, prompts, DecodeConfig(config.answer_tokens))]
    decode = DecodeConfig(config.answer_tokens, temperature=1.0, seed=eval_seed(config, 0))  # prompt i: + i
    sampled = [r.output_ids for r in generate_each(target, None, prompts, decode)]
    result = EvalSet(prompts, greedy, sampled)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(dataclasses.asdict(result)))
    return result


def chain_acceptance(target, drafter, prompts: list[list[int]], continuations: list[list[int]], depth: int,
                     batch_size: int = 16) -> list[dict]:
    """Per prompt: {"sum": sum of E_t over its anchors (a sampled chain's expected accepted length, unbiased),
    "forced": the teacher-forced product's sum beside it, "roots": their number, "step_rates": the mean a_i of
    each step i over the anchors where token t+2+i lies in the continuation} from mmvsd's evaluator
    (`mmvsd.training.acceptance.expected_acceptance`)."""
    from mmvsd.training.acceptance import expected_acceptance

    return [{"sum": c.total, "forced": c.forced_total, "roots": c.anchors, "step_rates": c.step_rates}
            for c in expected_acceptance(target, drafter, prompts, continuations, depth, batch_size)]


@torch.no_grad()
def tree_decoding(target, drafter, eval_set: EvalSet, config: ControlConfig, temperature: float) -> list[dict]:
    """Per prompt: {"new": new tokens, "forwards": target forwards} of `speculative_generate` with the tree; at
    T = 0 each output must equal the target's greedy continuation (lossless), else RuntimeError."""
    from mmvsd.decoding.decode import DecodeConfig, generate_each, speculative_generate
    from mmvsd.decoding.tree import TreeShape

    shape = TreeShape.parse(config.tree)
    results = []
    if temperature == 0:
        decode = DecodeConfig(config.answer_tokens, temperature=0.0, tree=shape)
        outputs = []
        for first in range(0, len(eval_set.prompts), 16):
            outputs += speculative_generate(target, drafter, eval_set.prompts[first : first + 16], decode)
        for index, (result, greedy) in enumerate(zip(outputs, eval_set.greedy)):
            if result.output_ids != greedy:
                raise RuntimeError(f"prompt {index}: tree decoding at T = 0 differs from vanilla greedy decoding")
            results.append({"new": len(result.output_ids), "forwards": result.num_target_forwards})
        return results
    decode = DecodeConfig(config.answer_tokens, temperature=temperature, tree=shape, seed=eval_seed(config, 0))
    return [{"new": len(r.output_ids), "forwards": r.num_target_forwards}  # prompt i with eval_seed(config, i)
            for r in generate_each(target, drafter, eval_set.prompts, decode)]


def evaluate_drafter(config: ControlConfig, target, folder: Path, eval_set: EvalSet, out: Path, name: str) -> dict:
    """accept_t1, tau_t0 (lossless-checked) and tau_t1 per prompt for the drafter in `folder` (cached by weights)."""
    from mmvsd.drafters.eagle3 import Eagle3Drafter
    from mmvsd.shipped import weights_sha256

    drafter = Eagle3Drafter.from_pretrained(folder, target).eval()
    digest = weights_sha256(drafter)[:12]
    # "chain2": records made before accept_t1 became the unbiased estimate are never reused as it
    path = out / "eval" / f"{name}-{config.digest(*EVAL_KEYS)}-{digest}-chain2.json"
    if path.is_file():
        return json.loads(path.read_text())
    start = time.perf_counter()
    record = {
        "accept_t1": chain_acceptance(target, drafter, eval_set.prompts, eval_set.sampled, config.depth),
        "tau_t0": tree_decoding(target, drafter, eval_set, config, 0.0),
        "tau_t1": tree_decoding(target, drafter, eval_set, config, 1.0),
        "lossless_t0": True,  # tree_decoding raised otherwise
    }
    record["eval_seconds"] = time.perf_counter() - start
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record))
    return record


# ----------------------------------------------------------------------------- summary


def _study_statistics():
    """benchmarks/vsd_study.py's bootstrap (pooled ratio per resample, percentile intervals), loaded by path."""
    name = "vsd_study"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, Path(__file__).resolve().parent / "vsd_study.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses look their module up while the file runs
        spec.loader.exec_module(module)
    return sys.modules[name]


METRICS = {"accept_t1": ("accept_t1", "sum", "roots"), "forced_t1": ("accept_t1", "forced", "roots"),
           "tau_t0": ("tau_t0", "new", "forwards"), "tau_t1": ("tau_t1", "new", "forwards")}  # record, num., den.
BASELINES = ("ce-greedy", "ce-sample")


def metric_counts(records: list[dict], metric: str) -> tuple[np.ndarray, np.ndarray]:
    """([R, P] numerators, [R, P] denominators) of a metric over an arm's R replicates: each replicate's value is
    their pooled ratio (sum / sum)."""
    key, numerator, denominator = METRICS[metric]
    return (np.array([[r[numerator] for r in record[key]] for record in records], dtype=float),
            np.array([[r[denominator] for r in record[key]] for record in records], dtype=float))


def summarise(evaluations: dict[str, list[dict]], num_resamples: int, seed: int) -> dict[str, dict]:
    """{arm: {metric: {value, ci95, replicates, vs_<baseline>: {diff, diff_ci95}}}} from each arm's replicates
    (training seeds): the value is the mean over replicates of the pooled ratio; the interval a percentile
    bootstrap, hierarchical when there are several replicates (each arm draws its own replicates with
    replacement, then the held-out prompts, whose resamples every arm shares: differences are paired)."""
    stats = _study_statistics()
    num_prompts = len(next(iter(evaluations.values()))[0]["tau_t0"])
    resamples = stats.prompt_resamples(num_prompts, num_resamples, seed)
    draws = {arm: stats.seed_resamples(len(records), num_resamples, seed + 1 + index) if len(records) > 1 else None
             for index, (arm, records) in enumerate(evaluations.items())}
    summary = {}
    for arm, records in evaluations.items():
        summary[arm] = {}
        for metric in METRICS:
            counts = metric_counts(records, metric)
            boot = stats.bootstrap_taus(*counts, resamples, draws[arm])
            per_replicate = stats.pooled_tau(*counts)
            row = {"value": float(per_replicate.mean()), "ci95": stats.percentile_interval(boot),
                   "replicates": per_replicate.tolist()}
            for baseline in BASELINES:
                if baseline in evaluations and baseline != arm:
                    base = metric_counts(evaluations[baseline], metric)
                    diff = float(per_replicate.mean() - stats.pooled_tau(*base).mean())
                    row[f"vs_{baseline}"] = {"diff": diff, "diff_ci95": stats.percentile_interval(
                        boot - stats.bootstrap_taus(*base, resamples, draws[baseline]))}
            summary[arm][metric] = row
        summary[arm]["step_rates_t1"] = np.mean([r["step_rates"] for record in records for r in record["accept_t1"]],
                                                axis=0).tolist()
    return summary


def _interval(row: dict) -> str:
    return f"{row['value']:.3f} [{row['ci95'][0]:.3f}, {row['ci95'][1]:.3f}]"


def _difference(row: dict, baseline: str) -> str:
    cmp = row.get(f"vs_{baseline}")
    return f"{cmp['diff']:+.3f} [{cmp['diff_ci95'][0]:+.3f}, {cmp['diff_ci95'][1]:+.3f}]" if cmp else "-"


def markdown_tables(summary: dict[str, dict], runs: dict[str, dict], config: ControlConfig) -> str:
    """The arms x metrics table, then each arm's paired differences from the two CE baselines (`runs`: each arm's
    first replicate's run, with the mean training time over its replicates)."""
    lines = [f"| arm | objective | answers | train min | accept_t1 (D={config.depth}) | forced_t1 | "
             f"tau_t0 ({config.tree}) | tau_t1 ({config.tree}) | a_1..a_{config.depth} at T=1 |",
             "|---|---|---|---|---|---|---|---|---|"]
    for arm, rows in summary.items():
        run = runs.get(arm, {})
        minutes = f"{run['train_seconds'] / 60:.1f}" if run else "-"
        rates = " ".join(f"{r:.2f}" for r in rows["step_rates_t1"])
        lines.append(f"| {arm} | {run.get('objective', '-')} | {run.get('data', '-')} | {minutes} | "
                     f"{_interval(rows['accept_t1'])} | {_interval(rows['forced_t1'])} | {_interval(rows['tau_t0'])} | "
                     f"{_interval(rows['tau_t1'])} | "
                     f"{rates} |")
    lines += ["", "| arm | " + " | ".join(f"{metric} - {baseline}" for metric in METRICS for baseline in BASELINES)
              + " |", "|---|" + "---|" * (len(METRICS) * len(BASELINES))]
    for arm, rows in summary.items():
        lines.append(f"| {arm} | " + " | ".join(_difference(rows[metric], baseline) for metric in METRICS
                                                 for baseline in BASELINES) + " |")
    return "\n".join(lines) + "\n"


def plot(summary: dict[str, dict], config: ControlConfig, path: Path, replicates: int = 1) -> None:
    """Each metric per arm with its 95% interval, one panel per metric (written by a rename)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    titles = {"accept_t1": f"expected accepted length, T=1 chain D={config.depth}",
              "forced_t1": f"teacher-forced product, T=1 chain D={config.depth}",
              "tau_t0": f"tau, T=0 tree {config.tree}", "tau_t1": f"tau, T=1 tree {config.tree}"}
    arms = list(summary)
    fig, axes = plt.subplots(1, len(METRICS), figsize=(5 * len(METRICS), 3.8))
    for ax, metric in zip(axes, METRICS):
        values = [summary[a][metric]["value"] for a in arms]
        lows = [v - summary[a][metric]["ci95"][0] for v, a in zip(values, arms)]
        highs = [summary[a][metric]["ci95"][1] - v for v, a in zip(values, arms)]
        ax.errorbar(range(len(arms)), values, yerr=[lows, highs], fmt="o", capsize=4)
        ax.set_xticks(range(len(arms)), arms, rotation=30, ha="right")
        ax.set_title(titles[metric], fontsize=10)
        ax.grid(axis="y", alpha=0.3)
    over = f"{replicates} training seeds, then prompts" if replicates > 1 else "prompts"
    fig.suptitle(f"synthetic control: order-2 Markov language, narrow EAGLE-3 drafter (95% CI over {over})",
                 fontsize=10)
    fig.tight_layout()
    tmp = path.with_name(f".{path.stem}.tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    tmp.replace(path)


# ----------------------------------------------------------------------------- the whole control


def run_replicate(config: ControlConfig, out: Path, arm_names: list[str] | None = None, log=print,
                  device: str = "cpu") -> dict:
    """One replicate in `out`: the target, data, and every arm's training (seed `config.arm_seed`) and evaluation,
    each reused when done. `device`: where the target (and so the drafters, training and decoding) runs once
    trained (the target's own training, the data and the initial drafter are made on the CPU, so they are the
    same on every device)."""
    from mmvsd.target_loader import load_target

    out.mkdir(parents=True, exist_ok=True)
    arms = [a for a in control_arms(config) if arm_names is None or a.name in arm_names]
    if arm_names is not None and len(arms) != len(arm_names):
        known = ", ".join(a.name for a in control_arms(config))
        raise SystemExit(f"vsd_control: unknown arm in {','.join(arm_names)} (known: {known})")
    language = make_language(config)
    target_folder = prepared_target(config, out, language, log)
    target = load_target(str(target_folder))
    data = training_data(config, language, out)
    init = narrow_drafter_folder(config, target, out)
    if device != "cpu":
        target = load_target(str(target_folder), device=device)
    runs = {arm.name: train_arm(config, arm, target, target_folder, init, data, out, log) for arm in arms}
    eval_set = make_eval_set(config, language, target, out)
    evaluations = {"init": evaluate_drafter(config, target, init, eval_set, out, "init")}
    for name, run in runs.items():
        evaluations[name] = evaluate_drafter(config, target, Path(run["folder"]), eval_set, out, name)
        log(f"evaluated {name} ({evaluations[name]['eval_seconds']:.0f} s)")
    return {"out": str(out), "arm_seed": config.arm_seed, "device": device, "runs": runs, "evaluations": evaluations,
            "target": json.loads((target_folder / "control_target.json").read_text()), "language": language}


def run_control(config: ControlConfig, out: Path, arm_names: list[str] | None = None,
                results: Path | None = RESULTS, log=print, device: str = "cpu",
                replicates: list[tuple[Path, int]] | None = None) -> dict:
    """Every replicate (`replicates`: (OUT, arm seed) pairs, default `out` at `config.arm_seed`) run or reused, then
    the summary over them; returns the result."""
    torch.set_num_threads(1)
    start = time.perf_counter()
    done = [run_replicate(dataclasses.replace(config, arm_seed=seed), Path(folder), arm_names, log, device)
            for folder, seed in (replicates or [(out, config.arm_seed)])]
    evaluations = {arm: [r["evaluations"][arm] for r in done] for arm in done[0]["evaluations"]}
    summary = summarise(evaluations, config.bootstrap, config.bootstrap_seed)
    runs = {arm: {**run, "train_seconds": float(np.mean([r["runs"][arm]["train_seconds"] for r in done]))}
            for arm, run in done[0]["runs"].items()}
    language = done[0]["language"]
    result = {
        "config": dataclasses.asdict(config),
        "target": done[0]["target"],
        "language": {"kind_counts": torch.bincount(language.kinds.flatten(), minlength=4).tolist(),
                     "mean_context_entropy": language.entropy()},
        "metrics": {"accept_t1": chain_acceptance.__doc__, "forced_t1": "the teacher-forced product (biased)",
                    "tau_t0": "tree decoding at T = 0, lossless-checked",
                    "tau_t1": "tree decoding at T = 1, one seed per prompt"},
        "replicates": [{"out": r["out"], "arm_seed": r["arm_seed"], "runs": r["runs"]} for r in done],
        "summary": summary,
        "per_prompt": evaluations,  # {arm: [one record per replicate]}
        "seconds_this_call": time.perf_counter() - start,  # what this call did (cached stages take none)
    }
    if results is not None:
        results.parent.mkdir(parents=True, exist_ok=True)
        tmp = results.with_suffix(".tmp")
        tmp.write_text(json.dumps(result, indent=1) + "\n")
        tmp.rename(results)
        plot(summary, config, results.with_suffix(".png"), len(done))
    result["table"] = markdown_tables(summary, runs, config)
    return result


def parse_replicate(spec: str) -> tuple[Path, int]:
    folder, sep, seed = spec.rpartition(":")
    if not sep or not folder or not seed.isdigit():
        raise SystemExit(f"vsd_control: --replicate {spec!r}: use OUT:SEED (a working folder and an arm seed)")
    return Path(folder), int(seed)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("overrides", nargs="*", help="KEY=VALUE settings of ControlConfig")
    parser.add_argument("--out", default="/tmp/vsd_control", help="working folder (target, data, runs, evaluations)")
    parser.add_argument("--arms", default="", help="comma list of arms to run (default: all)")
    parser.add_argument("--results", default=str(RESULTS), help="where the result JSON goes")
    parser.add_argument("--device", default="cpu", help="cpu (default), cuda or cuda:N: where arms train and are "
                        "evaluated")
    parser.add_argument("--replicate", action="append", default=[], type=parse_replicate, metavar="OUT:SEED",
                        help="a replicate (working folder and arm seed; repeat: the summary pools them); default "
                        "--out at the config's arm_seed")
    args = parser.parse_args(argv)
    config = parse_overrides(ControlConfig(), args.overrides)
    arm_names = [a for a in args.arms.split(",") if a] or None
    result = run_control(config, Path(args.out), arm_names, Path(args.results), device=args.device,
                         replicates=args.replicate or None)
    target = result["target"]
    print(f"target: KL to the chain {target['kl_to_chain']:.4f} nats/token, trained in "
          f"{target['train_seconds'] / 60:.1f} min; this call {result['seconds_this_call'] / 60:.1f} min\n")
    print(result["table"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
