"""smol-llava: a real small LLaVA assembled from shipped weights, loadable as ``--target smol-llava``.

Parts: EfficientNet-Lite0 ImageNet weights as the frozen vision tower (49 multi-scale patch tokens of
2382, one per cell of its 7x7 head map, see ``mmvsd.targets.efficientnet``), SmolLM2-135M-Instruct as the
language model, and a 2-layer MLP projector trained by ``mmvsd lab build-target smol-llava`` together
with rank-8 low-rank adapters on the language model's linear layers (merged into its weights when
loaded). The result is a stock transformers ``LlavaForConditionalGeneration`` with a ``LlavaProcessor``,
so the code path that serves LLaVA-1.5 serves smol-llava.

Image token: SmolLM2's unused special token ``<empty_output>`` (id 16) stands for each image patch,
so the vocabulary stays exactly SmolLM2's (a drafter trained for ``smollm2-135m`` shares it); the
adapters make the weights, and so text-only outputs, differ slightly from ``smollm2-135m``.

Projector files: ``projector.safetensors`` (the projector, plus the adapters' factors under ``lora.``)
and ``projector.json`` (sha256 of the weights, shapes and how they were trained). The trained
projector ships in the package (``mmvsd/targets/smol_llava/``); a projector built locally goes to
``<mmvsd cache>/smol-llava/`` and takes precedence. Loading verifies the checksum and the shapes,
then assembles the full model folder once in the cache, keyed by the projector's checksum.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import Tensor, nn
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    CLIPImageProcessor,
    LlavaForConditionalGeneration,
    LlavaProcessor,
    PreTrainedTokenizerBase,
)

from mmvsd.errors import UserError
from mmvsd.files import atomic_dir, cache_root, file_sha256
from mmvsd.target_loader import resolve_target_folder
from mmvsd.targets.efficientnet import (
    IMAGE_MEAN,
    IMAGE_SIZE,
    IMAGE_STD,
    NUM_FEATURES,
    attach_efficientnet,
    smol_llava_config,
)
from mmvsd.targets.lora import LORA_PREFIX, apply_lora_state

NAME = "smol-llava"
TEXT_TARGET = "smollm2-135m"
IMAGE_TOKEN = "<empty_output>"
PATCH_SIZE = 32  # 224 px / 32 = a 7 x 7 head map
SHIPPED_PROJECTOR_DIR = Path(__file__).resolve().parent / "smol_llava"
PROJECTOR_WEIGHTS = "projector.safetensors"
PROJECTOR_MANIFEST = "projector.json"
PROJECTOR_PREFIX = "model.multi_modal_projector."

# SmolLM2's chat template, with message content that may also be a list of {"type": "image"} and
# {"type": "text", "text": ...} parts (each image becomes one image token, then a newline).
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}{{ '" + IMAGE_TOKEN + "\n' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


# ----------------------------------------------------------------------------- assembling


def text_model_folder() -> Path:
    """The cached SmolLM2-135M-Instruct folder (converted from the shipped GGUF once)."""
    return resolve_target_folder(TEXT_TARGET)


def image_processor() -> CLIPImageProcessor:
    """Plain bicubic resize to 224 x 224 (no crop), then (x*255 - 127) / 128: the tower's ImageNet input."""
    return CLIPImageProcessor(
        do_resize=True, size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}, resample=3, do_center_crop=False,
        do_rescale=True, rescale_factor=1 / 255, do_normalize=True, image_mean=list(IMAGE_MEAN),
        image_std=list(IMAGE_STD), do_convert_rgb=True,
    )


def build_processor(tokenizer: PreTrainedTokenizerBase) -> LlavaProcessor:
    """The LlavaProcessor of smol-llava: each image becomes 49 image tokens in the prompt."""
    return LlavaProcessor(
        image_processor=image_processor(), tokenizer=tokenizer, patch_size=PATCH_SIZE,
        vision_feature_select_strategy="full", image_token=IMAGE_TOKEN, chat_template=CHAT_TEMPLATE,
    )


def new_smol_llava(text_folder: Path | None = None) -> tuple[LlavaForConditionalGeneration, LlavaProcessor]:
    """smol-llava with SmolLM2 and the ImageNet tower loaded and a freshly initialised projector."""
    text_folder = text_folder or text_model_folder()
    tokenizer = AutoTokenizer.from_pretrained(text_folder)
    tokenizer.chat_template = CHAT_TEMPLATE
    image_token_id = tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)
    language_model = AutoModelForCausalLM.from_pretrained(text_folder, dtype=torch.float32)
    config = smol_llava_config(language_model.config, image_token_id)
    config.tie_word_embeddings = language_model.config.tie_word_embeddings
    with torch.random.fork_rng(devices=[]):  # a fixed projector init that leaves the caller's global RNG alone
        torch.manual_seed(0)
        model = LlavaForConditionalGeneration(config)
    model.model.language_model.load_state_dict(language_model.model.state_dict(), strict=True)
    model.lm_head.load_state_dict(language_model.lm_head.state_dict())
    if config.tie_word_embeddings:
        model.tie_weights()
    model.generation_config = language_model.generation_config
    attach_efficientnet(model)
    return model.eval(), build_processor(tokenizer)


def projector(model: LlavaForConditionalGeneration) -> nn.Module:
    """The multimodal projector: [.., 2382] tower features -> [.., H] language-model embeddings."""
    return model.model.multi_modal_projector


# ----------------------------------------------------------------------------- projector files


def save_projector(model: LlavaForConditionalGeneration, folder: Path, training: dict[str, Any],
                   lora: dict[str, Tensor] | None = None) -> None:
    """Write projector.safetensors (the projector, plus the language model's low-rank adapters when trained
    with them) and projector.json (checksum, shapes, training summary) atomically."""
    state = {k: v.detach().contiguous().clone() for k, v in projector(model).state_dict().items()}
    state.update(lora or {})
    with atomic_dir(folder) as tmp:
        save_file(state, str(tmp / PROJECTOR_WEIGHTS))
        manifest = {
            "sha256": file_sha256(tmp / PROJECTOR_WEIGHTS),
            "shapes": {k: list(v.shape) for k, v in state.items()},
            "text_model": TEXT_TARGET,
            "vision_tower": model.config.vision_config.architecture,
            "image_token": IMAGE_TOKEN,
            "training": training,
        }
        (tmp / PROJECTOR_MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")


def built_projector_dir() -> Path:
    """Where `mmvsd lab build-target smol-llava` writes a projector (preferred over the shipped one)."""
    return cache_root() / NAME / "projector"


def projector_dir() -> Path:
    """A locally built projector if there is one, else the one shipped in the package."""
    built = built_projector_dir()
    return built if (built / PROJECTOR_MANIFEST).is_file() else SHIPPED_PROJECTOR_DIR


def read_manifest(folder: Path) -> dict[str, Any]:
    path = folder / PROJECTOR_MANIFEST
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise UserError(f"cannot read the smol-llava projector manifest {path}: {err}") from None


def load_projector(folder: Path, hidden_size: int) -> dict[str, Tensor]:
    """The projector weights in `folder`, after checking their sha256 and shapes against the manifest."""
    manifest = read_manifest(folder)
    weights = folder / PROJECTOR_WEIGHTS
    if not weights.is_file():
        raise UserError(f"smol-llava projector weights {weights} are missing")
    actual = file_sha256(weights)
    if actual != manifest.get("sha256"):
        raise UserError(
            f"smol-llava projector {weights} is corrupt or was replaced: sha256 {actual[:12]}... does not match "
            f"{str(manifest.get('sha256'))[:12]}... in {PROJECTOR_MANIFEST}; rebuild it with "
            "`mmvsd lab build-target smol-llava` or reinstall mmvsd-studies (pip install -e ./studies)"
        )
    try:
        state = load_file(str(weights))
    except (SafetensorError, OSError) as err:
        raise UserError(f"cannot read smol-llava projector {weights}: {err}") from None
    expected = {"linear_1.weight": [hidden_size, NUM_FEATURES], "linear_1.bias": [hidden_size],
                "linear_2.weight": [hidden_size, hidden_size], "linear_2.bias": [hidden_size]}
    shapes = {k: list(v.shape) for k, v in state.items() if not k.startswith(LORA_PREFIX)}
    if shapes != expected:
        raise UserError(f"smol-llava projector {weights} does not fit this model: shapes {shapes}, need {expected}")
    return state


def install_projector(model: LlavaForConditionalGeneration, state: dict[str, Tensor]) -> None:
    """Load a verified projector state (from `load_projector`) into smol-llava: the projector's weights, and
    its low-rank adapters, if any, merged into the language model's weights."""
    projector(model).load_state_dict({k: v for k, v in state.items() if not k.startswith(LORA_PREFIX)}, strict=True)
    try:
        apply_lora_state(model.model.language_model, {k: v for k, v in state.items() if k.startswith(LORA_PREFIX)})
    except ValueError as err:
        raise UserError(f"smol-llava projector file does not fit this model: {err}") from None


def smol_llava_folder() -> Path:
    """The assembled smol-llava model folder in the cache (built once per projector checksum)."""

    source = projector_dir()
    text_folder = text_model_folder()
    hidden_size = json.loads((text_folder / "config.json").read_text())["hidden_size"]
    state = load_projector(source, hidden_size)  # verified on every load, not only when assembling
    folder = cache_root() / "targets" / f"{NAME}-{read_manifest(source)['sha256'][:16]}"
    if (folder / "config.json").is_file():
        return folder
    print(f"mmvsd: assembling {NAME} in {folder} (once)", flush=True)
    model, processor = new_smol_llava(text_folder)
    install_projector(model, state)
    with atomic_dir(folder) as tmp:
        model.save_pretrained(tmp)
        processor.save_pretrained(tmp)
    return folder
