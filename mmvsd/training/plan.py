"""`mmvsd train --dry-run`: what a run will train, on what, for how long, and what it needs per GPU, offline.

No weights are loaded and nothing is written: the target and the drafter are built on the meta device from
configs (shipped full-size ones for the LLaVA-1.5 names in `mmvsd/configs/targets/`, a folder's config.json, a
GGUF built-in's converted folder), so their parameter counts are exact. The data files are read for their
record counts (`data=auto` resolved as the run resolves it, `training_data.py`, and a warning when an image
drafter would train on text alone). Memory per GPU is a model:

- weights and training state (exact from the counts): the frozen target in `target_dtype`; the drafter's
  trainable parameters with fp32 master weights, fp32 gradients and AdamW's two fp32 moments, plus DDP's
  gradient buckets (20 bytes per parameter); under ZeRO-2 in bf16, bf16 weights and gradients on every GPU
  and the fp32 master weights, moments and gradient partition shared across the N GPUs (4 + 16 / N bytes);
- activations (an upper bound for one micro-batch at `max_length`, as if every position were a loss position): the
  target features and KV cache kept for the step, the target's logits (fp32 with `accept`), and the drafter's
  unrolled steps with their fp32 log-probabilities over the draft vocabulary;
- an E-step objective's paths (vsd, vsd-rloo; an estimate of the packed scoring, the E-step's peak): the drafter's
  pass kept for backward (its layer over the sequence, then L depths of A x (S + S') nodes per row) beside the
  target's scoring block (A x S x (L - 1) trie nodes per row at most: their KV and fp32 log-probabilities). On one
  H200 (docs/gpu-llava.md) it came out 10% under the measured peak of the 13B recipe: not an upper bound.
"""

from __future__ import annotations

import json
import math
import shlex
from dataclasses import dataclass
from pathlib import Path

import torch

import mmvsd.configs
from mmvsd.data.conversations import parse_dataset_spec, read_conversations
from mmvsd.drafters.layers import layer_sizes
from mmvsd.errors import UserError
from mmvsd.target import Target
from mmvsd.training.config import TrainConfig
from mmvsd.training.dataset import data_specs
from mmvsd.training.drafter_init import resolve_init
from mmvsd.training.feature_cache import feature_bytes_per_token
from mmvsd.training.shard_stream import finished_shards
from mmvsd.training.terms import ESTEP_CORRECTIONS, objective_terms
from mmvsd.training.trainer import check_dataset_exists, dataset_image_root, fresh_drafter, total_steps
from mmvsd.training.training_data import resolve_training_data, target_config_path, text_only_warning

ZERO2 = Path(mmvsd.configs.__file__).parent / "accelerate_zero2.yaml"
DEEPSPEED_JSON = Path(mmvsd.configs.__file__).parent / "deepspeed_zero2.json"
GPU_COUNTS = (1, 2, 4, 8)
DDP_BYTES = 4 + 4 + 8 + 4  # fp32 weights, fp32 gradients, AdamW's two moments, DDP's gradient buckets
ZERO2_REPLICATED, ZERO2_SHARDED = 2 + 2, 4 + 8 + 4  # bf16 weights + gradients; fp32 master, moments, gradients
DTYPE_BYTES = {"fp32": 4, "bf16": 2}
CHARS_PER_TOKEN = 4  # English chat text in a LLaMA-family tokenizer, roughly (the tokenizer is not loaded)
GB = 1e9
GPU_BYTES = 80 * GB  # an A100 / H100


def meta_target(spec: str) -> tuple[Target, Path]:
    """The target built on the meta device from its config (no weights), and the config's path."""
    import transformers  # heavy: only a plan needs the model classes

    path = target_config_path(spec)
    raw = {k: v for k, v in json.loads(path.read_text()).items() if not k.startswith("_comment")}
    architecture = (raw.get("architectures") or [""])[0]
    model_class = getattr(transformers, architecture, None)
    if model_class is None:
        raise UserError(f"--dry-run: {path} names no transformers model class ({architecture!r})")
    config = transformers.AutoConfig.for_model(**raw)
    with torch.device("meta"):
        model = model_class(config)
    return Target(model, None, spec), path


def parameter_groups(target: Target) -> dict[str, int]:
    """Parameters of the target by part: language model, vision tower, projector (multimodal targets)."""
    model = target.model
    groups = {"vision tower": getattr(model.model, "vision_tower", None),
              "projector": getattr(model.model, "multi_modal_projector", None)}
    counts = {name: count(module) for name, module in groups.items() if module is not None}
    return {"language model": count(model) - sum(counts.values()), **counts}


def count(module: torch.nn.Module, trainable_only: bool = False) -> int:
    return sum(p.numel() for p in module.parameters() if p.requires_grad or not trainable_only)


@dataclass(frozen=True)
class GpuMemory:
    """Bytes per GPU for N GPUs (see the module docstring)."""

    target: int
    ddp_state: int
    zero2_state: int
    activations: int

    @property
    def ddp(self) -> int:
        return self.target + self.ddp_state + self.activations

    @property
    def zero2(self) -> int:
        return self.target + self.zero2_state + self.activations


def gpu_memory(target_params: int, drafter_params: int, config: TrainConfig, target: Target, draft_vocab: int,
               num_gpus: int) -> GpuMemory:
    weights = target_params * DTYPE_BYTES[config.target_dtype]
    zero2 = ZERO2_REPLICATED * drafter_params + math.ceil(ZERO2_SHARDED * drafter_params / num_gpus)
    return GpuMemory(weights, DDP_BYTES * drafter_params, zero2, activation_bytes(config, target, draft_vocab))


def activation_bytes(config: TrainConfig, target: Target, draft_vocab: int) -> int:
    """An estimate of one micro-batch's activations at max_length (module docstring)."""
    rows, half = config.batch_size * config.max_length, 2
    features = rows * (len(target.aux_layer_ids) + 1) * target.hidden_size * half
    # the target's head over the batch (in fp32 for an objective with `accept`, whose probabilities it keeps too:
    # objectives.Unroll.target_labels) and the labels over the draft vocabulary
    precise = any(term.precise_labels for term in objective_terms(config.objective))
    target_logits = rows * target.vocab_size * (4 if precise else half) + rows * draft_vocab * 4 * (1 + precise)
    per_step = rows * drafted_row_bytes(config, target, draft_vocab)
    return (features + rows * kv_bytes_per_token(target) + target_logits + config.loss.ttt_steps * per_step
            + estep_bytes(config, target, draft_vocab))


def drafted_row_bytes(config: TrainConfig, target: Target, draft_vocab: int) -> int:
    """What one row of an unrolled drafter step keeps for backward: its layer's activations (~12 H + 3 I wide, in the
    training precision) and the fp32 log-probabilities with their softmax over the draft vocabulary."""
    return drafter_layer_bytes(config, target) + draft_vocab * 4 * 2


def drafter_layer_bytes(config: TrainConfig, target: Target) -> int:
    """The drafter layers' activations per row (the decoder layer's widths, read as a drafter copies them)."""
    width = 12 * target.hidden_size + 3 * layer_sizes(target)["intermediate_size"]
    return config.draft_layers * width * DTYPE_BYTES[config.precision]


def kv_bytes_per_token(target: Target) -> int:
    """The target's bf16 keys and values of one token, all layers."""
    sizes = layer_sizes(target)
    return 2 * target.num_layers * sizes["num_key_value_heads"] * sizes["head_dim"] * 2


def estep_bytes(config: TrainConfig, target: Target, draft_vocab: int) -> int:
    """An estimate of what an E-step objective's paths hold at the packed scoring (module docstring); 0 without one."""
    given = [term.estep == ESTEP_CORRECTIONS for term in objective_terms(config.objective) if term.estep]
    if not given:
        return 0
    loss = config.loss
    anchors = config.batch_size * loss.num_anchors
    nodes = anchors * (loss.num_samples + (loss.num_samples + 1 if any(given) else 0)) * loss.path_length
    drafter_pass = (config.batch_size * config.max_length * drafter_layer_bytes(config, target)
                    + nodes * drafted_row_bytes(config, target, draft_vocab))
    trie_nodes = anchors * loss.num_samples * (loss.path_length - 1)
    return drafter_pass + trie_nodes * (kv_bytes_per_token(target) + target.vocab_size * 4 * 2)


@dataclass(frozen=True)
class DataPlan:
    examples: int
    about_tokens: int  # an estimate from characters (and image tokens), each example capped at max_length
    lines: list[str]
    images: int = 0  # conversations with an image


def data_plan(config: TrainConfig, image_tokens: int) -> DataPlan:
    """Record counts of each dataset of the mixture (read, not rendered: the tokenizer is not loaded); a missing
    file, image root or image is one error (`check_dataset_exists`, whose reads are reused)."""
    read = check_dataset_exists(config.data, config.image_root, config.num_conversations)
    examples = tokens = num_images = 0
    lines = []
    for spec in data_specs(config.data):
        _, path = parse_dataset_spec(spec)
        root = None if path is None else dataset_image_root(config.image_root, path)
        conversations, stats = read.get(spec) or read_conversations(spec, limit=config.num_conversations or None)
        chars = [sum(len(turn.text) for turn in conv.turns) for conv in conversations]
        images = sum(1 for conv in conversations if conv.image)
        tokens += sum(min(config.max_length, c // CHARS_PER_TOKEN + (image_tokens if conv.image else 0))
                      for c, conv in zip(chars, conversations, strict=True))
        examples += len(conversations)
        num_images += images
        where = f", images under {root}" if images or stats.num_missing_images else ""
        missing = f" ({stats.num_missing_images} with a missing image)" if stats.num_missing_images else ""
        lines.append(f"{spec}: {len(conversations)} conversations, {images} with an image{missing}{where}")
    if config.data_order == "shards":  # planned for the whole regeneration, as the run's schedule is
        manifest, finished = finished_shards(Path(config.data))
        lines.append(f"{len(finished)} of {manifest['num_shards']} shards finished; planned for all "
                     f"{manifest['num_conversations']} conversations (data_order=shards)")
        tokens = round(tokens * manifest["num_conversations"] / max(1, examples))
        examples = manifest["num_conversations"]
    train = examples - round(examples * config.validation_fraction)
    return DataPlan(train, round(tokens * train / max(1, examples)), lines, num_images)


def launch_command(argv: list[str], num_gpus: int) -> str:
    """The command of this run: `accelerate launch` on `num_gpus` GPUs with ZeRO-2, or (0 GPUs) `mmvsd` itself,
    one process on the CPU."""
    args, skip = [], False
    for arg in argv:
        if not skip and arg != "--dry-run" and not arg.startswith("--gpus"):
            args.append(arg)
        skip = arg == "--gpus"  # its value follows
    if not num_gpus:
        return shlex.join(["mmvsd", *args])
    return shlex.join(["accelerate", "launch", "--config_file", str(ZERO2), "--deepspeed_config_file",
                       str(DEEPSPEED_JSON), "--num_processes", str(num_gpus), "-m", "mmvsd", *args])


def image_tokens_per_image(config) -> int:
    """Prompt tokens one image takes, from a target's config: (image_size / patch_size)^2 for a ViT tower (CLIP's),
    else the config's `image_seq_length` (a convolutional tower, such as smol-llava's timm one, has no patch size);
    0 for a text target."""
    vision = getattr(config, "vision_config", None)
    if vision is None:
        return 0
    size, patch = getattr(vision, "image_size", None), getattr(vision, "patch_size", None)
    if size and patch:
        return (size // patch) ** 2
    return int(getattr(config, "image_seq_length", 0) or 0)


def describe_plan(config: TrainConfig, argv: list[str], num_gpus: int) -> str:
    """The plan `mmvsd train --dry-run` prints, for `num_gpus` GPUs (0: one process on this machine's CPU)."""
    target, config_path = meta_target(config.target)
    given_data, config = config.data, resolve_training_data(config, target)  # data=auto: what it means here
    groups = parameter_groups(target)
    target_params = sum(groups.values())
    init, init_vocab = resolve_init_offline(config)
    drafter = fresh_drafter(config, target, init_vocab or config.draft_vocab_size)
    trainable = count(drafter, trainable_only=True)
    draft_vocab = drafter.draft_vocab_size
    data = data_plan(config, image_tokens_per_image(target.model.config)) if config.features == "online" else None
    lines = [f"mmvsd train --dry-run: nothing loaded, nothing written (config: {config_path})",
             f"target   {config.target}: {target_params / GB:.2f} B parameters ("
             + ", ".join(f"{name} {n / GB:.3f} B" for name, n in groups.items())
             + f"); hidden {target.hidden_size}, {target.num_layers} layers, vocabulary {target.vocab_size}; "
             f"computes in {config.target_dtype}",
             f"drafter  {config.drafter}: {trainable / 1e6:.1f} M trainable parameters (embeddings: the target's), "
             f"draft vocabulary {draft_vocab}; init: {init}",
             f"objective {config.objective}; precision {config.precision}; features {config.features}"]
    processes = max(1, num_gpus)
    where = f"{num_gpus} GPUs" if num_gpus else "1 process on the CPU"
    global_batch = config.global_batch_size or config.batch_size * processes
    if given_data != config.data:
        lines.append(f"data     data={given_data}: {config.data}" + (f", image_root={config.image_root}"
                                                                      if config.image_root else ""))
    if warning := text_only_warning(config, target, data.images if data is not None else 0):
        lines.append(f"warning  {warning}")
    if data is not None:
        lines += [f"data     {line}" for line in data.lines]
        steps = total_steps(config, data.examples, global_batch)
        per_token = feature_bytes_per_token(len(target.aux_layer_ids), target.hidden_size, 2)
        lines += [f"steps    {steps} optimizer steps of {global_batch * config.grad_accum} examples ({where} x "
                  f"{global_batch // processes} x grad_accum {config.grad_accum}) over {data.examples} training "
                  f"examples, {config.epochs:g} epoch(s); about {data.about_tokens / 1e6:.1f} M tokens per epoch",
                  f"disk     offline features (`mmvsd prepare`, bf16): about {data.about_tokens * per_token / GB:.0f} "
                  f"GB; each checkpoint {12 * trainable / GB:.2f} GB (x keep_checkpoints={config.keep_checkpoints})"]
    paths = estep_bytes(config, target, draft_vocab)
    estep = f", of which E-step paths ~{paths / GB:.1f}" if paths else ""
    lines.append("memory   per GPU (weights and optimizer state exact; activations an upper bound for batch_size "
                 f"{config.batch_size} at {config.max_length} tokens{', E-step paths an estimate' if paths else ''}):")
    for gpus in GPU_COUNTS:
        memory = gpu_memory(target_params, trainable, config, target, draft_vocab, gpus)
        lines.append(f"         {gpus} GPU(s): DDP {memory.ddp / GB:.1f} GB, ZeRO-2 {memory.zero2 / GB:.1f} GB "
                     f"(target {memory.target / GB:.1f} + drafter state {memory.ddp_state / GB:.2f} | "
                     f"{memory.zero2_state / GB:.2f} + activations ~{memory.activations / GB:.1f}{estep})")
    memory = gpu_memory(target_params, trainable, config, target, draft_vocab, processes)
    per_example = memory.activations / config.batch_size
    fits = int((GPU_BYTES - memory.target - memory.zero2_state) // per_example) if per_example else config.batch_size
    if num_gpus and memory.zero2 > GPU_BYTES:
        hint = (f"batch_size {fits} fits (or a shorter max_length); DeepSpeed steps on every micro-batch here, so the "
                f"global batch becomes {fits} x {num_gpus}" if fits >= 1 else
                "the target and the drafter's state alone exceed it")
        lines.append(f"note     {num_gpus} x 80 GB GPUs with ZeRO-2 do not hold this plan's upper bound: {hint}")
    lines.append(f"run      {launch_command(argv, num_gpus)}")
    return "\n".join(lines)


def resolve_init_offline(config: TrainConfig) -> tuple[str, int | None]:
    """Where `--init` points, said without failing when a released drafter is not in the HF cache, and the draft
    vocabulary its config.json gives (None: a fresh drafter, or a config without one), which the run keeps."""
    if config.init == "none":
        return "none (a fresh drafter)", None
    try:
        source = resolve_init(config.init, config.target)
    except UserError as err:
        if "not in the local HF cache" not in str(err):
            raise
        return f"{config.init}: NOT READY: {err}", None
    saved = source.path / "config.json"
    vocab = json.loads(saved.read_text()).get("draft_vocab_size") if saved.is_file() else None
    return f"{config.init} -> {source.path} ({source.layout.name} layout)", vocab
