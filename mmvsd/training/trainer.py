"""The drafter trainer: accelerate (one CPU process, or `accelerate launch` + DeepSpeed ZeRO-2).

Output folder layout:
    OUT/config.json, OUT/model.safetensors   the trained drafter (`mmvsd generate --drafter OUT`)
    OUT/train_config.yaml                    the resolved TrainConfig
    OUT/checkpoints/step-NNNNNNN/            accelerate state + trainer_state.json + train_config.yaml
    OUT/logs/                                TensorBoard
A checkpoint folder appears by one rename when complete, so an interrupted write leaves the previous
checkpoint the latest valid one. Data order and every E-step sample derive from (seed, step, process), so
`--resume` continues exactly where the interrupted run would have been. Under `accelerate launch` with N
processes the global batch is split across them (mmvsd.training.distributed): N x batch_size trains as one
process with N x batch_size does, and a run with `global_batch_size` may resume with another N.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import shutil
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import torch
import yaml
from tqdm import tqdm

from mmvsd.data.conversations import missing_images_message, parse_dataset_spec, read_conversations
from mmvsd.decoding.cpu_kernels import decoding_kernels
from mmvsd.drafter_base import Drafter, drafter_class
from mmvsd.errors import UserError
from mmvsd.files import atomic_file
from mmvsd.target import Target
from mmvsd.target_loader import load_target
from mmvsd.training.budget import Budget
from mmvsd.training.config import TrainConfig
from mmvsd.training.dataset import data_specs, draft_vocab_from_counts, token_frequencies
from mmvsd.training.distributed import (
    BatchSplit,
    Mean,
    TrainingStep,
    mean_for,
    rank_seed,
    reduce_count,
    reduce_metrics,
)
from mmvsd.training.drafter_init import InitSource, resolve_init
from mmvsd.training.shard_stream import check_stream_resume
from mmvsd.training.sources import (
    follow_stream,
    micro_batch_indices,
    stream_reaches,
    training_source,
    uses_curriculum,
)
from mmvsd.training.terms import make_objective, progress_labels
from mmvsd.training.training_data import resolve_training_data, text_only_warning

logger = logging.getLogger(__name__)

# What the recipe takes to log validation tau every `eval_every` steps: given the run's config and its placed target,
# an evaluator that scores the drafter (`monitor(drafter)`, a report with tau, mean_tau, acceptance_by_depth,
# prompts, ties and seconds; its latest in `monitor.last_report`). Evaluation supplies it
# (`mmvsd.eval.acceptance.tau_monitor`, which `mmvsd train` passes): training sits below evaluation.
ValidationFactory = Callable[[TrainConfig, Target], object]

CHECKPOINTS = "checkpoints"
STATE_FILE = "trainer_state.json"
# settings that may change between an interrupted run and its resumption
RESUMABLE_CHANGES = {"progress", "log_every", "save_every", "keep_checkpoints", "max_bad_steps", "eval_every",
                     "eval_prompts", "eval_limit", "eval_max_new_tokens", "eval_tree",
                     "max_minutes", "stop_at_step",  # this process's budget: the schedule follows max_steps
                     "wait_for_shards",  # whether this process waits for more shards at the finished ones' end
                     "output",  # the run's folder, which may have moved or be named by another path
                     "target_engine"}  # the target's kernels, not what it computes (features differ in the last bits)
BATCH_KEYS = {"batch_size", "global_batch_size"}  # compared as the global batch they give (`check_resume_split`)
VAL_LOG = "val_tau.jsonl"  # one line per validation-tau evaluation (also in TensorBoard as val/*)
# one line per optimizer step: its metrics (each batch's before the update: read once, as data_order=shards
# streams, a held-out measure), tokens_seen, lr, seconds; a resume first drops the lines past its checkpoint
TRAIN_LOG = "train_log.jsonl"


@dataclass
class TrainState:
    """Counters saved with every checkpoint."""

    step: int = 0  # optimizer steps done
    num_bad_steps: int = 0  # skipped because the loss was not finite
    tokens_seen: int = 0  # sequence tokens (padding excluded) in the micro-batches of the steps done, all processes
    num_processes: int = 1  # of the run that wrote the checkpoint
    global_batch: int = 0  # examples per micro-batch over all processes (0: a checkpoint older than this field)
    data_key: str = ""  # data_order=shards: the regeneration read (shard_stream.stream_key)
    data_blocks: list[int] = field(default_factory=list)  # data_order=shards: train examples per shard read
    planned_steps: int = 0  # data_order=shards: the schedule's length, fixed when the run starts


def lr_lambda(config: TrainConfig, total_steps: int):
    """Linear warm-up over warmup_steps (when > 0, else warmup_ratio of the steps), then cosine to min_lr_ratio x
    peak (or linear to 0)."""
    warmup = max(1, math.ceil(config.warmup_ratio * total_steps)) if config.warmup_ratio > 0 else 0
    if config.warmup_steps > 0:
        warmup = config.warmup_steps

    def factor(step: int) -> float:
        if step < warmup:
            return step / warmup
        progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
        if config.schedule == "linear":
            return 1.0 - progress
        return config.min_lr_ratio + (1.0 - config.min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return factor


def total_steps(config: TrainConfig, num_examples: int, global_batch: int) -> int:
    if config.max_steps > 0:
        return config.max_steps
    micro = math.ceil(config.epochs * math.ceil(num_examples / global_batch))
    return max(1, micro // config.grad_accum)


TARGET_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def load_training_target(config: TrainConfig, device: str) -> Target:
    """The target as `mmvsd train` and `mmvsd prepare` load it: in `target_dtype`, on `device`, with decoding's exact
    engine or torch's kernels (`target_engine`)."""
    target = load_target(config.target, dtype=TARGET_DTYPES[config.target_dtype], device=device)
    return decoding_kernels(target) if config.target_engine == "exact" else target


def build_drafter(config: TrainConfig, target: Target, train_examples: list) -> Drafter:
    """A fresh drafter with a frequency-based draft vocabulary, or the `--init` one (see `resolve_init`),
    its trainable weights in fp32 (the master weights; `precision=bf16` computes in bf16 under autocast)."""
    source = check_init(config)
    if source is not None:
        drafter = source.load(target)
        if drafter.drafter_type != config.drafter:
            raise UserError(f"--init {config.init} holds a {drafter.drafter_type!r} drafter, not {config.drafter!r}")
        return fp32_master_weights(drafter).train()
    drafter = fresh_drafter(config, target, config.draft_vocab_size)
    counts = token_frequencies(train_examples, target.vocab_size)
    drafter.set_draft_vocab(draft_vocab_from_counts(counts, drafter.draft_vocab_size))
    if config.init_from_target:
        drafter.init_from_target(target)
    if config.init_layers_from_target:
        drafter.init_layers_from_target(target)
    return fp32_master_weights(drafter).train()


def fresh_drafter(config: TrainConfig, target: Target, draft_vocab_size: int) -> Drafter:
    """A freshly initialised drafter of the config's kind and layers (num_layers passed only when asked for: a
    plugin's kind of one layer may predate the argument)."""
    layers = {"num_layers": config.draft_layers} if config.draft_layers != 1 else {}
    return drafter_class(config.drafter).from_target(target, draft_vocab_size=draft_vocab_size, seed=config.seed,
                                                     **layers)


def fp32_master_weights(drafter: Drafter) -> Drafter:
    """Trainable parameters in fp32: a drafter loaded for a bf16 target comes in bf16, and AdamW updates
    of bf16 weights lose most of their precision (frozen parameters, e.g. shared target embeddings, stay)."""
    for param in drafter.parameters():
        if param.requires_grad and param.dtype != torch.float32:
            param.data = param.data.float()
    return drafter


def check_init(config: TrainConfig) -> InitSource | None:
    """Where `--init` points (None for none); fails on a bad one before any target is loaded."""
    source = resolve_init(config.init, config.target)
    if source is not None and source.layout.drafter_type not in ("", config.drafter):
        raise UserError(f"--init {config.init} holds a {source.layout.drafter_type!r} drafter, not {config.drafter!r}")
    return source


def check_layers(config: TrainConfig) -> None:
    """draft_layers and init_layers_from_target shape a fresh drafter of a kind that stacks layers (EAGLE-3's);
    checked before anything reads the target (data=auto asks whether it takes images)."""
    if config.draft_layers == 1 and not config.init_layers_from_target:
        return
    if config.init != "none":  # resolve_init's "no --init"
        raise UserError(f"--init {config.init} starts from a trained drafter: draft_layers and "
                        f"init_layers_from_target shape a fresh one")
    if not drafter_class(config.drafter).stacks_layers:
        raise UserError(f"a {config.drafter} drafter has one decoder layer of its own: draft_layers and "
                        f"init_layers_from_target are EAGLE-3's")


def latest_checkpoint(out_dir: Path) -> Path | None:
    """The newest complete checkpoint folder (incomplete ones never carry the final name)."""
    folder = out_dir / CHECKPOINTS
    done = sorted(p for p in folder.glob("step-*") if (p / STATE_FILE).is_file()) if folder.is_dir() else []
    return done[-1] if done else None


def check_resume_config(checkpoint: Path, config: TrainConfig) -> None:
    """Refuse to resume a checkpoint made with different training settings (compared key by key, `loss.*` too).
    A setting the checkpoint's version of mmvsd did not have yet reads as its default, so a new setting's default
    must be what mmvsd did before it existed; a saved setting this version no longer has is not compared."""
    written = yaml.safe_load((checkpoint / "train_config.yaml").read_text())
    saved = {**dotted(TrainConfig().to_dict()), **dotted(written)}
    current = dotted(config.to_dict())
    changed = [k for k in current if k not in RESUMABLE_CHANGES | BATCH_KEYS and saved.get(k) != current[k]]
    if changed:
        details = ", ".join(f"{k}: {saved.get(k)!r} -> {current[k]!r}" for k in changed)
        raise UserError(f"cannot resume {checkpoint}: settings differ ({details})")


def dotted(settings: dict, prefix: str = "") -> dict:
    """A nested settings dict flattened to dotted keys (`loss.num_samples`)."""
    flat = {}
    for key, value in settings.items():
        if isinstance(value, dict):
            flat.update(dotted(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def check_resume_split(checkpoint: Path, saved: TrainState, split: BatchSplit, sharded: bool) -> None:
    """A run resumes with the global batch it was trained with (any number of processes, unless the optimizer
    state is sharded per process, as DeepSpeed's is)."""
    if saved.global_batch and saved.global_batch != split.global_size:
        raise UserError(f"cannot resume {checkpoint}: it was trained with a global batch of {saved.global_batch} "
                        f"({saved.num_processes} process(es) x {saved.global_batch // saved.num_processes}), this "
                        f"run's is {split.global_size} ({split.num_processes} x {split.per_process}): resume with "
                        f"the same batch_size and {saved.num_processes} process(es), or set "
                        f"global_batch_size={saved.global_batch}")
    if sharded and saved.num_processes != split.num_processes:
        raise UserError(f"cannot resume {checkpoint} with {split.num_processes} processes: DeepSpeed saved its "
                        f"optimizer state in {saved.num_processes} shards; resume with {saved.num_processes}")


def check_output(out_dir: Path, resume: bool) -> Path | None:
    """The checkpoint to resume from (None for a fresh run); never overwrite an earlier run."""
    latest = latest_checkpoint(out_dir)
    if resume and latest is None:
        raise UserError(f"--resume: no complete checkpoint in {out_dir / CHECKPOINTS}")
    if not resume and latest is not None:
        raise UserError(f"{out_dir} already holds checkpoints of a run (latest {latest.name}); "
                        f"pass --resume to continue it or choose another --output")
    return latest


def save_checkpoint(accelerator, out_dir: Path, config: TrainConfig, state: TrainState) -> None:
    """Write accelerate state + counters + config under a temporary name, then rename."""
    folder = out_dir / CHECKPOINTS
    final = folder / f"step-{state.step:07d}"
    tmp = folder / f".step-{state.step:07d}.tmp"
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
        folder.mkdir(parents=True, exist_ok=True)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(tmp))
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        config.save(tmp / "train_config.yaml")
        (tmp / STATE_FILE).write_text(json.dumps(state.__dict__) + "\n")
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        complete = sorted(p for p in folder.glob("step-*") if (p / STATE_FILE).is_file())
        for old in complete[: -config.keep_checkpoints]:
            shutil.rmtree(old, ignore_errors=True)


def publish_drafter(drafter: Drafter, out_dir: Path) -> None:
    """Put the drafter's files into OUT, each by one rename, config.json last; checkpoints stay."""
    staging = out_dir / ".drafter.tmp"
    drafter.save_pretrained(staging)
    for item in sorted(staging.iterdir(), key=lambda p: p.name == "config.json"):
        os.replace(item, out_dir / item.name)
    shutil.rmtree(staging, ignore_errors=True)


def _accelerator(config: TrainConfig, out_dir: Path):
    """One Accelerator and the split of the global batch across its processes; under `accelerate launch` with
    DeepSpeed, our batch settings fill its config."""
    from accelerate import Accelerator  # heavy (~0.4 s even after torch): only a training run needs it
    from accelerate.state import AcceleratorState  # likewise
    from accelerate.utils import DistributedDataParallelKwargs  # likewise

    # one process may train several times (notebooks, tests) with other precisions: AcceleratorState
    # is a process-wide singleton, so forget its settings (the distributed PartialState is kept)
    AcceleratorState._reset_state()
    # a drafter may leave parameters out of a step (an image adaptor on a text batch)
    unused = DistributedDataParallelKwargs(find_unused_parameters=True)
    # the schedule counts optimizer steps over the global batch: one scheduler step per optimizer step (accelerate
    # would otherwise take N, as if each process's data loader were N times shorter)
    accelerator = Accelerator(mixed_precision="bf16" if config.precision == "bf16" else "no",
                              log_with="tensorboard", project_dir=str(out_dir / "logs"), kwargs_handlers=[unused],
                              step_scheduler_with_optimizer=False)
    launched = int(os.environ.get("WORLD_SIZE", "1"))
    if launched > accelerator.num_processes:  # e.g. `accelerate launch --multi_gpu` on a machine with no GPU
        raise UserError(f"{launched} processes were launched but accelerate joined none of them into one run (each "
                        f"would train alone); on CPUs set ACCELERATE_USE_CPU=1 (docs/training.md, 'Several processes')")
    split = BatchSplit.of(config.batch_size, config.global_batch_size, accelerator.num_processes,
                          accelerator.process_index)
    plugin = accelerator.state.deepspeed_plugin
    if plugin is not None:
        fill_deepspeed_config(plugin.deepspeed_config, config, split)
    return accelerator, split


def fill_deepspeed_config(deepspeed_config: dict, config: TrainConfig, split: BatchSplit) -> None:
    """Our batch and clipping settings in DeepSpeed's config (its engine steps on every backward under
    accelerate, so we accumulate nothing ourselves)."""
    if config.grad_accum != 1:
        raise UserError("with DeepSpeed use grad_accum=1 (scale the batch with batch_size and GPUs)")
    deepspeed_config["train_micro_batch_size_per_gpu"] = split.per_process
    deepspeed_config["train_batch_size"] = split.global_size
    deepspeed_config["gradient_accumulation_steps"] = 1
    deepspeed_config["gradient_clipping"] = config.max_grad_norm


def _scalar_config(config: TrainConfig) -> dict:
    """Flat scalar view of the config for TensorBoard's hparams."""
    flat = {k: v for k, v in config.to_dict().items() if not isinstance(v, dict)}
    flat.update({f"loss.{k}": v for k, v in config.to_dict()["loss"].items()})
    return flat


def train(config: TrainConfig, target: Target | None = None, resume: bool = False,
          validation: ValidationFactory | None = None) -> Path:
    """Run (or resume) a training run; returns the output folder, which holds the drafter. `validation` makes the
    validation-tau evaluator that `eval_every` > 0 needs (the train command passes evaluation's)."""
    if config.eval_every and validation is None:
        raise ValueError("eval_every > 0 needs a validation evaluator: train(..., validation=tau_monitor), "
                         "tau_monitor from mmvsd.eval.acceptance")
    check_layers(config)
    config = resolve_training_data(config, target)  # data=auto: ShareGPT, or the LLaVA mixture for images
    out_dir = Path(config.output)
    resume_from = check_output(out_dir, resume)
    if resume_from is not None:
        check_resume_config(resume_from, config)
    read = None  # the dataset files, read once: checked here, rendered after the target loads
    if config.features == "online" and config.data_order == "shuffle":
        read = check_dataset_exists(config.data, config.image_root, config.num_conversations)
    check_init(config)
    accelerator, split = _accelerator(config, out_dir)
    state = _start_state(resume_from, split, accelerator)
    target = _placed_target(config, target, accelerator)
    monitor = validation(config, target) if validation and config.eval_every and accelerator.is_main_process else None
    budget = Budget(config.max_minutes)
    source = training_source(config, target, read)
    if source.stream is not None and not _stream_ready(config, target, source, split, state, budget, resume_from):
        return out_dir
    if warning := text_only_warning(config, target, sum(source.is_media)):
        logger.warning(warning)
    split.check_fits(len(source))
    run = _prepare_run(config, target, source, split, state, accelerator, resume_from)
    if accelerator.is_main_process:
        out_dir.mkdir(parents=True, exist_ok=True)
        config.save(out_dir / "train_config.yaml")
        _trim_train_log(out_dir / TRAIN_LOG, state.step)
    accelerator.init_trackers("train", config=_scalar_config(config))
    with budget.listening():  # SIGTERM or a first Ctrl-C: stop after the step, as max_minutes does
        _train_steps(run, state, budget, monitor, target, out_dir)
    accelerator.end_training()
    if accelerator.is_main_process:
        publish_drafter(run.drafter, out_dir)
    return out_dir


def _start_state(resume_from: Path | None, split: BatchSplit, accelerator) -> TrainState:
    """A fresh run's state, or the checkpoint's (its batch split checked against this launch's)."""
    state = TrainState(num_processes=split.num_processes, global_batch=split.global_size)
    if resume_from is None:
        return state
    saved = TrainState(**json.loads((resume_from / STATE_FILE).read_text()))
    check_resume_split(resume_from, saved, split, sharded=accelerator.state.deepspeed_plugin is not None)
    return dataclasses.replace(saved, num_processes=split.num_processes, global_batch=split.global_size)


def _placed_target(config: TrainConfig, target: Target | None, accelerator) -> Target:
    """The target on the run's device (loaded there when not given: a CPU-only engine must not reach a GPU)."""
    if target is None:
        target = load_training_target(config, str(accelerator.device))
    elif accelerator.device.type != "cpu" and target.engine.startswith("exact"):
        raise UserError(f"target {target.name} carries the CPU's exact kernels and cannot train on "
                        f"{accelerator.device}: load it there (load_target(..., device=...))")
    target.model.to(accelerator.device)
    return target


def _reaches(config: TrainConfig, target: Target, source, split: BatchSplit, step: int, budget: Budget) -> bool:
    """Whether the finished shards hold the step after `step` (waiting for more with wait_for_shards)."""
    return stream_reaches(config, source, split.global_size, step) or (
        config.wait_for_shards and follow_stream(config, target, source, split.global_size, step, budget))


def _stream_ready(config: TrainConfig, target: Target, source, split: BatchSplit, state: TrainState, budget: Budget,
                  resume_from: Path | None) -> bool:
    """Record the finished shards a data_order=shards run reads (checked against its checkpoint); False when they
    hold no step past the checkpoint (an error for a fresh run)."""
    if resume_from is not None:
        check_stream_resume(state.data_key, state.data_blocks, source.stream, resume_from)
    state.data_key, state.data_blocks = source.stream.key, source.stream.blocks
    if _reaches(config, target, source, split, state.step, budget):
        return True
    if resume_from is None:
        raise UserError(f"the finished shards of {config.data} hold fewer examples than one step takes "
                        f"({split.global_size * config.grad_accum}): train when more are finished")
    logger.warning("no finished shard past step %d yet: nothing to train; run again with --resume when "
                   "`mmvsd regenerate` has finished more", state.step)
    return False


def _prepare_run(config: TrainConfig, target: Target, source, split: BatchSplit, state: TrainState, accelerator,
                 resume_from: Path | None) -> Run:
    """The drafter, optimizer, schedule and objective, prepared by accelerate (restored from a checkpoint)."""
    drafter = build_drafter(config, target, source.examples)
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=config.learning_rate, betas=(0.9, 0.95), weight_decay=0.0)
    steps = state.planned_steps or total_steps(config, source.stream.planned if source.stream else len(source),
                                               split.global_size)
    state.planned_steps = steps if source.stream is not None else 0  # more shards later must not stretch it
    if source.stream is not None and uses_curriculum(config, drafter, source):
        raise UserError("the media curriculum draws from all the data at once; with data_order=shards set "
                        "media_curriculum=off")
    if config.max_minutes > 0 and uses_curriculum(config, drafter, source):
        logger.warning("the media curriculum shows no media before step %d of %d; max_minutes=%g may end the run "
                       "first (media_curriculum=off mixes them in from the start)", steps // 2, steps,
                       config.max_minutes)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(config, steps))
    objective = make_objective(config.objective, config.loss)
    model, optimizer, scheduler = accelerator.prepare(TrainingStep(drafter, target, objective), optimizer, scheduler)
    if resume_from is not None:
        accelerator.load_state(str(resume_from))
    return Run(config, accelerator, model, optimizer, scheduler, source, split, mean_for(accelerator), steps)


def _train_steps(run: Run, state: TrainState, budget: Budget, monitor, target: Target, out_dir: Path) -> None:
    """Optimizer steps until the schedule, the budget or the finished shards end: logs, validation tau and
    checkpoints along the way (the last step is always logged and saved)."""
    config, accelerator, source = run.config, run.accelerator, run.source
    end = run.steps
    bar = tqdm(total=end, initial=state.step, desc=f"train {config.objective}", dynamic_ncols=True,
               disable=not (config.progress and accelerator.is_main_process))
    while state.step < end:
        started = time.monotonic()
        metrics = _optimizer_step(run, state)
        seconds = time.monotonic() - started
        state.step += 1
        bar.update(1)
        if reduce_count(accelerator, int(budget.spent())) or state.step == config.stop_at_step:  # as if the end
            end = state.step
        elif state.step < end and not _reaches(config, target, source, run.split, state.step, budget):
            logger.warning("trained through the %d finished shards at step %d of %d; run again with --resume "
                           "when `mmvsd regenerate` has finished more", len(source.stream.blocks), state.step, end)
            end = state.step
        if monitor is not None and not budget.stopped() and (state.step % config.eval_every == 0 or state.step == end):
            _log_tau(monitor, run.drafter, accelerator, out_dir, state)
        bar.set_postfix(_postfix(metrics, monitor), refresh=False)
        if state.step % config.log_every == 0 or state.step == end:
            accelerator.log({f"train/{k}": v for k, v in metrics.items()}, step=state.step)
        if accelerator.is_main_process:
            with open(out_dir / TRAIN_LOG, "a", encoding="utf-8") as handle:
                handle.write(json.dumps({"step": state.step, "seconds": round(seconds, 3), **metrics}) + "\n")
        if source.stream is not None:
            state.data_blocks = source.stream.blocks  # the shards it may read now (wait_for_shards adds)
        if state.step % config.save_every == 0 or state.step == end:
            save_checkpoint(accelerator, out_dir, config, state)
    bar.close()


def check_dataset_exists(data: str, image_root: str = "", num_conversations: int = 0) -> dict[str, tuple]:
    """Fail before loading a target when a dataset file, the image root or an image a record names is not there.
    Returns what it read of each dataset file: {spec: (conversations, LoadStats)} (the bundled ShareGPT is not read).
    """
    if image_root and not Path(image_root).expanduser().is_dir():
        raise UserError(f"image_root {image_root} is not a folder")
    read = {}
    for spec in data_specs(data):
        _, path = parse_dataset_spec(spec)
        if path is None:
            continue
        if not path.exists():
            raise UserError(f"dataset file not found: {path}")
        root = dataset_image_root(image_root, path)
        read[spec] = read_conversations(spec, limit=num_conversations or None, image_root=root)
        if read[spec][1].num_missing_images:
            raise UserError(missing_images_message(path, read[spec][1], root))
    return read


def dataset_image_root(image_root: str, path: Path) -> Path:
    """Where the relative image paths of the dataset file `path` are read: `image_root`, else the file's folder."""
    return Path(image_root).expanduser() if image_root else path.parent


def _postfix(metrics: dict[str, float], monitor=None) -> dict[str, str]:
    shown = {short: f"{metrics[key]:.3f}" for key, short in progress_labels().items() if key in metrics}
    if monitor is not None and monitor.last_report is not None:
        shown["tau"] = f"{monitor.last_report.tau:.2f}"
    return shown


def _log_tau(monitor, drafter: Drafter, accelerator, out_dir: Path, state: TrainState) -> None:
    """Evaluate validation tau now: TensorBoard val/*, a line in OUT/val_tau.jsonl, the progress bar."""
    report = monitor(drafter)
    by_depth = {f"val/accepted_ge_{d}": rate for d, rate in enumerate(report.acceptance_by_depth, start=1)}
    accelerator.log({"val/tau": report.tau, "val/mean_tau": report.mean_tau, **by_depth}, step=state.step)
    line = {"step": state.step, "tokens_seen": state.tokens_seen, "tau": report.tau, "mean_tau": report.mean_tau,
            "acceptance_by_depth": report.acceptance_by_depth, "num_prompts": len(report.prompts),
            "num_ties": len(report.ties), "seconds": round(report.seconds, 2)}
    with open(out_dir / VAL_LOG, "a", encoding="utf-8") as handle:
        handle.write(json.dumps(line) + "\n")


@dataclass
class Run:
    """What every optimizer step of a run uses."""

    config: TrainConfig
    accelerator: object
    model: TrainingStep  # prepared: wrapped for data parallelism where there is more than one process
    optimizer: torch.optim.Optimizer
    scheduler: object
    source: object  # OnlineSource | OfflineSource
    split: BatchSplit
    mean: Mean
    steps: int  # the schedule's optimizer steps
    drafter: Drafter = field(init=False)

    def __post_init__(self) -> None:
        self.drafter = self.accelerator.unwrap_model(self.model).drafter


def _trim_train_log(path: Path, step: int) -> None:
    """Keep the lines of steps up to `step` (a resumed run's checkpoint): the steps an interrupted run made past
    it are made again."""
    if path.is_file():
        kept = [line for line in path.read_text().splitlines(keepends=True) if json.loads(line)["step"] <= step]
        with atomic_file(path) as handle:
            handle.writelines(kept)


def _optimizer_step(run: Run, state: TrainState) -> dict:
    """grad_accum micro-batches, one AdamW update (skipped, and counted, if a loss is not finite on any process)."""
    config, accelerator, model = run.config, run.accelerator, run.model
    totals: dict[str, float] = {}
    tokens = 0  # this process's, summed over the processes once per step
    first, last = state.step * config.grad_accum, (state.step + 1) * config.grad_accum - 1
    for micro in range(first, last + 1):
        rows = run.split.rows(micro_batch_indices(config, run.drafter, run.source, micro, run.steps,
                                                  run.split.global_size))
        batch = run.source.batch(rows)
        generator = torch.Generator().manual_seed(rank_seed(config.seed, micro, run.split.rank))
        # gradients are exchanged once per optimizer step, on its last micro-batch
        with nullcontext() if micro == last else accelerator.no_sync(model):
            with accelerator.autocast():
                loss, metrics = model(batch, generator, run.mean)
            finite = accelerator.reduce(torch.isfinite(loss.detach()).float().reshape(1), "min")
            if not bool(finite.item()):
                return _skip_step(config, run.optimizer, run.scheduler, state)
            accelerator.backward(loss / config.grad_accum)
        tokens += int(batch.tokens.lengths.sum())
        for key, value in {"loss": float(loss.detach()), **metrics}.items():
            totals[key] = totals.get(key, 0.0) + value / config.grad_accum
    totals = reduce_metrics(accelerator, totals)
    state.tokens_seen += reduce_count(accelerator, tokens)
    grad_norm = accelerator.clip_grad_norm_(model.parameters(), config.max_grad_norm)
    run.optimizer.step()
    run.scheduler.step()
    run.optimizer.zero_grad(set_to_none=True)
    if grad_norm is not None:
        totals["grad_norm"] = float(grad_norm)
    totals["lr"] = run.scheduler.get_last_lr()[0]
    totals["bad_steps"] = float(state.num_bad_steps)
    totals["tokens_seen"] = float(state.tokens_seen)
    if accelerator.device.type == "cuda":  # this process's peak so far: what a memory plan must hold
        totals["gpu_peak_gib"] = torch.cuda.max_memory_allocated(accelerator.device) / 2**30
    return totals


def _skip_step(config: TrainConfig, optimizer, scheduler, state: TrainState) -> dict:
    """Drop a step whose loss is NaN/inf; stop the run after `max_bad_steps` of them."""
    optimizer.zero_grad(set_to_none=True)
    scheduler.step()
    state.num_bad_steps += 1
    logger.warning("step %d: non-finite loss, step skipped (%d so far)", state.step + 1, state.num_bad_steps)
    if state.num_bad_steps > config.max_bad_steps:
        raise UserError(f"{state.num_bad_steps} steps with a non-finite loss (limit max_bad_steps="
                        f"{config.max_bad_steps}); the last checkpoint is intact. "
                        "Lower learning_rate or use precision=fp32")
    return {"bad_steps": float(state.num_bad_steps)}
