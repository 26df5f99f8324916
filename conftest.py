"""Shared fixtures of tests/ and studies/tests/: tiny deterministic targets and drafters, the real SmolLM2 target.

At the repository root so that pytest gives both test folders the same fixtures; a test imports the helpers
with `from conftest import ...`."""

from __future__ import annotations

import importlib.util
import json
import logging
import random
import sys
import traceback
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from mmvsd.decoding.decode import DecodeConfig, vanilla_generate
from mmvsd.drafters.eagle3 import Eagle3Drafter
from mmvsd.target import Target
from mmvsd.training.unroll import shifted, unroll_draft_steps

TINY_VOCAB = 128


SHARED_CACHE = ("gguf", "targets")  # the real targets' joined GGUF files and converted weights: slow to make


@pytest.fixture(autouse=True, scope="session")
def cache_in_a_temporary_folder(tmp_path_factory):
    """mmvsd's cache (cost and engine profiles, greedy continuations, regenerations) is a temporary folder for the
    session and the commands its tests start (MMVSD_CACHE), never the user's; only the real targets' converted
    weights (SHARED_CACHE) are the user's, linked, so that no session converts SmolLM2 or Qwen again. A test that
    sets MMVSD_CACHE itself keeps everything under its own folder."""
    from mmvsd.files import cache_root

    users, folder = cache_root(), tmp_path_factory.mktemp("mmvsd-cache")
    for name in SHARED_CACHE:
        (users / name).mkdir(parents=True, exist_ok=True)
        (folder / name).symlink_to(users / name, target_is_directory=True)
    patch = pytest.MonkeyPatch()
    patch.setenv("MMVSD_CACHE", str(folder))
    yield folder
    patch.undo()


@pytest.fixture(autouse=True, scope="session")
def cpu_precision_stays_fp32():
    """`--dtype auto` on the CPU measures fp32 against bf16 and keeps the faster; in tests it keeps fp32 on every
    machine, so no test's outcome depends on this CPU (tests/test_cpu_kernels.py injects timings to test the choice)."""
    from mmvsd.decoding import cpu_kernels

    patch = pytest.MonkeyPatch()
    stock_fp32 = cpu_kernels.EngineChoice("float32", 1, (1.0, 1.0), None)
    patch.setattr(cpu_kernels, "_measure_choice", lambda target: stock_fp32)
    yield
    patch.undo()


# Deprecations a library logs while calling itself, not for a call of ours: (words of the message, a file of the
# library that is on the stack exactly when the library made the call).
LIBRARY_INTERNAL_DEPRECATIONS = [
    # transformers' assisted generation calls the assistant's `generate` with a generation config plus
    # min/max_new_tokens (transformers 5.24, generation/candidate_generator.py); we pass no generation config
    ("Passing `generation_config` together with generation-related arguments", "generation/candidate_generator.py"),
]


class DeprecationLog(logging.Handler):
    """Collects the deprecations libraries log (transformers announces some through its logger, once per process,
    not through `warnings`), except the library-internal ones above, decided from the stack at the time."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.found: dict[int, str] = {}  # id of the record: what it said (a record may reach two loggers)

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if "deprecat" not in message.lower() or record.name.startswith("mmvsd"):
            return
        stack = [frame.filename for frame in traceback.extract_stack()]
        if not any(words in message and any(f.endswith(file) for f in stack)
                   for words, file in LIBRARY_INTERNAL_DEPRECATIONS):
            self.found[id(record)] = f"{record.name}: {message}"


@pytest.fixture(autouse=True)
def no_deprecation_is_logged():
    """Fail a test during which a library logged a deprecation for a call of ours (pyproject's `filterwarnings`
    turns the deprecations warned through `warnings` into errors)."""
    handler = DeprecationLog()
    loggers = [logging.getLogger(), logging.getLogger("transformers")]  # transformers' does not propagate
    for logger in loggers:
        logger.addHandler(handler)
    yield
    for logger in loggers:
        logger.removeHandler(handler)
    assert not handler.found, "a library logged a deprecation:\n" + "\n".join(handler.found.values())


def load_benchmark_script(name: str):
    """benchmarks/NAME.py (a tool users run as a script) as a module (registered under NAME: dataclasses look their
    module up while it runs), with benchmarks/ on sys.path as `python benchmarks/NAME.py` has it (scripts import
    their siblings). The studies are a package (mmvsd_studies): their tests import them."""
    folder = str(Path(__file__).resolve().parent / "benchmarks")
    spec = importlib.util.spec_from_file_location(name, Path(folder) / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    added = folder not in sys.path
    if added:
        sys.path.insert(0, folder)
    try:
        spec.loader.exec_module(module)
    finally:
        if added:
            sys.path.remove(folder)
    return module


def make_tiny_llama(seed: int = 0, vocab: int = TINY_VOCAB, attn: str = "sdpa") -> LlamaForCausalLM:
    """A 4-layer random Llama with peaked enough logits that greedy ties are rare."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        initializer_range=0.25,
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=None,
        attn_implementation=attn,
    )
    return LlamaForCausalLM(config).eval()


def random_prompts(num: int, seed: int, min_len: int = 3, max_len: int = 12,
                   vocab: int = TINY_VOCAB) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(min_len, max_len + 1, (num,), generator=gen).tolist()
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lengths]


CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}<|assistant|> {% endif %}"
)


def save_tiny_target(folder: Path, vocab: int = 128, seed: int = 0) -> Path:
    """A tiny random Llama plus a word-level tokenizer with a chat template, as a target folder."""
    words = ["<unk>", "<|user|>", "<|assistant|>", "<eos>"] + [f"w{i}" for i in range(vocab - 4)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<eos>")
    tokenizer.chat_template = CHAT_TEMPLATE
    model = make_tiny_llama(seed=seed, vocab=vocab)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


# the smallest settings `mmvsd train` runs a tiny target with (tests of training and of the studies that train)
TINY = ["draft_vocab_size=64", "batch_size=2", "loss.num_samples=4", "loss.num_anchors=2", "loss.path_length=3",
        "loss.ttt_steps=3", "progress=false", "validation_fraction=0"]


def write_sharegpt(path: Path, num: int = 10, seed: int = 0) -> Path:
    """`num` random two-turn ShareGPT conversations over the tiny target's words, as a JSON file."""
    rng = random.Random(seed)
    words = lambda n: " ".join(f"w{rng.randrange(4, 120)}" for _ in range(n))
    records = [{"id": str(i),
                "conversations": [{"from": "human", "value": words(4)}, {"from": "gpt", "value": words(10)},
                                  {"from": "human", "value": words(3)}, {"from": "gpt", "value": words(8)}]}
               for i in range(num)]
    path.write_text(json.dumps(records))
    return path


@pytest.fixture(scope="session")
def tiny_target() -> Target:
    return Target(make_tiny_llama(), None, "tiny-llama")


PROMPT_POOL = random_prompts(8, seed=100)


@pytest.fixture(scope="session")
def chat_target() -> Target:
    """A tiny random Llama with a word-level tokenizer (w0 w1 ...) that has a chat template."""
    words = ["<unk>", "<|user|>", "<|assistant|>", "<eos>", "<|system|>"] + [f"w{i}" for i in range(123)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<eos>")
    tokenizer.chat_template = CHAT_TEMPLATE
    return Target(make_tiny_llama(), tokenizer, "tiny-chat")


def fit_drafter_to_target(
    target: Target, prompts: list[list[int]], steps: int = 150, num_steps: int = 4, seed: int = 0, num_layers: int = 1
) -> Eagle3Drafter:
    """Overfit an EAGLE-3 drafter to the target's greedy continuations of `prompts`.

    A test helper (cross-entropy over unrolled draft steps) that gives the tree decoder real
    multi-token acceptances to exercise on those prompts.
    """
    drafter = Eagle3Drafter.from_target(target, seed=seed, num_layers=num_layers)
    results = vanilla_generate(target, prompts, DecodeConfig(max_new_tokens=64))
    seqs = [r.prompt_ids + r.output_ids for r in results]
    width = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    labels = torch.full((len(seqs), width), -100)
    for row, seq in enumerate(seqs):
        ids[row, : len(seq)] = torch.tensor(seq)
        labels[row, : len(seq)] = torch.tensor(seq)
    with torch.no_grad():
        out = target.model(ids, output_hidden_states=True)
    features = torch.cat([out.hidden_states[i] for i in target.aux_layer_ids], -1)
    next_ids = shifted(ids, 1)
    optim = torch.optim.Adam(drafter.parameters(), lr=1e-2)
    for _ in range(steps):
        hiddens = unroll_draft_steps(drafter, features, next_ids, num_steps)
        loss = sum(
            torch.nn.functional.cross_entropy(drafter.draft_logits(h).flatten(0, 1),
                                              shifted(labels, i + 2, -100).flatten())
            for i, h in enumerate(hiddens)
        )
        optim.zero_grad()
        loss.backward()
        optim.step()
    return drafter.eval()


@pytest.fixture(scope="session")
def fitted_drafter(tiny_target) -> Eagle3Drafter:
    return fit_drafter_to_target(tiny_target, PROMPT_POOL)


@pytest.fixture(scope="session")
def random_drafter(tiny_target) -> Eagle3Drafter:
    return Eagle3Drafter.from_target(tiny_target, seed=3).eval()


@pytest.fixture(scope="session")
def smollm2_target() -> Target:
    from mmvsd.target_loader import load_target

    return load_target("smollm2-135m")


__all__ = ["PROMPT_POOL", "fit_drafter_to_target", "make_tiny_llama", "random_prompts"]


TINY_LLAVA_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|> "
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for part in m['content'] %}"
    "{% if part['type'] == 'image' %}<image> {% else %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %} "
    "{% endfor %}{% if add_generation_prompt %}<|assistant|> {% endif %}"
)


def save_tiny_llava(folder: Path, vocab: int = 128, seed: int = 0, projector_scale: float = 8.0) -> Path:
    """A tiny random LLaVA (32x32 CLIP tower, 16 image tokens, 4-layer Llama) with its processor, as a folder."""
    from transformers import (
        CLIPImageProcessor,
        CLIPVisionConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
        LlavaProcessor,
    )

    words = ["<unk>", "<|user|>", "<|assistant|>", "<eos>", "<image>"] + [f"w{i}" for i in range(vocab - 5)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<eos>")
    tokenizer.add_special_tokens({"additional_special_tokens": ["<image>"]})  # split runs of placeholders
    tokenizer.chat_template = CHAT_TEMPLATE
    text_config = make_tiny_llama(seed=seed, vocab=vocab).config
    vision_config = CLIPVisionConfig(image_size=32, patch_size=8, hidden_size=32, intermediate_size=64,
                                     num_hidden_layers=2, num_attention_heads=2, projection_dim=32)
    config = LlavaConfig(vision_config=vision_config, text_config=text_config, image_token_id=4,
                         image_seq_length=16, vision_feature_layer=-2, vision_feature_select_strategy="default")
    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration(config).eval()
    with torch.no_grad():  # peaked projector outputs so the image changes the greedy continuation
        model.model.multi_modal_projector.linear_2.weight.mul_(projector_scale)
    image_processor = CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    processor = LlavaProcessor(image_processor=image_processor, tokenizer=tokenizer, patch_size=8,
                               vision_feature_select_strategy="default", image_token="<image>",
                               num_additional_image_tokens=1, chat_template=TINY_LLAVA_TEMPLATE)
    model.save_pretrained(folder)
    processor.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def llava_dir(tmp_path_factory) -> Path:
    """A tiny LLaVA folder plus images of different sizes (a.png, b.png, c.jpg) and a broken one."""
    import numpy as np
    from PIL import Image

    folder = save_tiny_llava(tmp_path_factory.mktemp("tiny-llava"))
    rng = np.random.default_rng(0)
    for name, (h, w) in {"a.png": (40, 60), "b.png": (32, 32), "c.jpg": (75, 50)}.items():
        Image.fromarray((rng.random((h, w, 3)) * 255).astype("uint8")).save(folder / name)
    (folder / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\nnot really")
    return folder


@pytest.fixture(scope="session")
def llava_target(llava_dir) -> Target:
    from mmvsd.target_loader import load_target

    return load_target(str(llava_dir))


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    """`mmvsd ARGV...` in-process: (exit code, stdout, stderr)."""
    from mmvsd.cli import main

    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err
