"""The `llava` adapter: images into any transformers `LlavaForConditionalGeneration` (LLaVA-1.5,
smol-llava), through the target's own processor, vision tower and projector.

Each image becomes a span of image tokens; its patch embeddings are the tower's hidden states at
``vision_feature_layer`` (CLS dropped under the "default" strategy), its projected embeddings the
projector's outputs: exactly what ``LlavaModel.get_image_features`` feeds the language model.
"""

from __future__ import annotations

from pathlib import Path

import torch
from PIL import Image, UnidentifiedImageError
from torch import Tensor

from mmvsd.adapter_base import Expansion, MediaSpan, ModalityAdapter, Prompt
from mmvsd.errors import UserError


def load_image(path: str | Path) -> Image.Image:
    """An RGB image from a file; missing or unreadable files are user errors."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"image file not found: {path}")
    try:
        with Image.open(path) as image:
            return image.convert("RGB")
    except (UnidentifiedImageError, OSError, ValueError) as err:
        raise UserError(f"cannot read image {path}: {err}") from None


def user_turn_text(processor, text: str, num_images: int) -> str:
    """The prompt text with one image placeholder per image, through the processor's chat template."""
    content = [{"type": "image"}] * num_images + [{"type": "text", "text": text}]
    if getattr(processor, "chat_template", None):
        return processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True)
    return processor.image_token * num_images + "\n" + text


@torch.no_grad()
def patch_embeddings(model, pixel_values: Tensor) -> Tensor:
    """[N, 3, h, w] pixels -> [N, S, C] the vision tower's features the projector reads."""
    config = model.config
    out = model.model.vision_tower(pixel_values, output_hidden_states=True, return_dict=True)
    layer = config.vision_feature_layer
    if isinstance(layer, int):
        features = out.hidden_states[layer]
        return features[:, 1:] if config.vision_feature_select_strategy == "default" else features
    chosen = [out.hidden_states[i] for i in layer]
    if config.vision_feature_select_strategy == "default":
        chosen = [h[:, 1:] for h in chosen]
    return torch.cat(chosen, dim=-1)


def image_spans(token_ids: Tensor, image_token_id: int, span_length: int) -> list[tuple[int, int]] | None:
    """(start, length) of every image's span in [T] ids: runs of image tokens, cut into images of
    `span_length` tokens (adjacent images form one run); None if a run is not a whole number of images."""
    spans, start = [], None
    flags = (token_ids == image_token_id).tolist() + [False]
    for index, flag in enumerate(flags):
        if flag and start is None:
            start = index
        elif not flag and start is not None:
            if (index - start) % span_length:
                return None
            spans += [(first, span_length) for first in range(start, index, span_length)]
            start = None
    return spans


class LlavaAdapter(ModalityAdapter):
    """Images for LlavaForConditionalGeneration targets that come with a processor."""

    name = "llava"
    modality = "image"

    def accepts(self, target) -> bool:
        return getattr(target, "processor", None) is not None and hasattr(target.model.config, "image_token_id") \
            and hasattr(target.model.model, "multi_modal_projector")

    def load(self, path: str | Path) -> Image.Image:
        """One image file as the target's processor receives it (subclasses change how images are read)."""
        return load_image(path)

    def encode(self, target, text: str, media: list[Path]) -> Prompt:
        images = [self.load(path) for path in media]
        processor = target.processor
        inputs = processor(images=images or None, text=user_turn_text(processor, text, len(images)),
                           return_tensors="pt")
        return self.embed_images(target, inputs["input_ids"][0].tolist(), images, inputs.get("pixel_values"))

    def placeholder(self, target) -> str:
        return target.processor.image_token

    def expand(self, target, token_ids: list[int]) -> Expansion:
        image_id = target.model.config.image_token_id
        length = span_length(target)
        ids, source, is_media = [], [], []
        for index, token in enumerate(token_ids):
            copies = length if token == image_id else 1
            ids += [token] * copies
            source += [index] * copies
            is_media += [token == image_id] * copies
        return Expansion(ids, source, is_media)

    def embed(self, target, token_ids: list[int], media: list[Path]) -> Prompt:
        return self.embed_images(target, token_ids, [self.load(path) for path in media])

    @torch.no_grad()
    def embed_images(self, target, token_ids: list[int], images: list[Image.Image],
                     pixel_values: Tensor | None = None) -> Prompt:
        """The prompt of expanded ids whose image spans hold `images`, in order (`pixel_values`: the
        processor's output for them when the caller already has it, so images are preprocessed once)."""
        ids = torch.tensor(token_ids, dtype=torch.long, device=target.device)
        if not images:
            return Prompt(list(token_ids), None)
        model = target.model
        if pixel_values is None:
            pixel_values = target.processor.image_processor(images, return_tensors="pt")["pixel_values"]
        patches = patch_embeddings(model, pixel_values.to(target.device, target.dtype))  # [N, S, C]
        projected = model.model.multi_modal_projector(patches)  # [N, S, H]
        found = image_spans(ids, model.config.image_token_id, projected.shape[1])
        if found is None or len(found) != len(images):
            raise UserError(f"the prompt holds image token runs {found} but {len(images)} image(s) of "
                            f"{projected.shape[1]} tokens were given (is the image placeholder in the text?)")
        embeds = target.input_embeddings(ids)  # [T, H]
        spans = []
        for (start, length), image_patches, image_projected in zip(found, patches, projected):
            embeds[start:start + length] = image_projected.to(embeds.dtype)
            spans.append(MediaSpan(start, image_patches, image_projected))
        return Prompt(list(token_ids), embeds, tuple(spans))


def span_length(target) -> int:
    """Image tokens the target's processor puts in the prompt for one image."""
    processor = target.processor
    probe = processor(images=[Image.new("RGB", (64, 64))], text=processor.image_token, return_tensors="pt")
    return int((probe["input_ids"][0] == target.model.config.image_token_id).sum())
