"""`TrainConfig`: the one source of truth for a training run, loaded from YAML plus overrides.

Resolution order: dataclass defaults < `--config FILE.yaml` < command-line flags < `key=value`
overrides (dotted keys reach the nested objective settings, e.g. `loss.num_samples=8`). Unknown
keys and values of the wrong type are errors. The resolved config is saved as YAML beside every
checkpoint and in the output folder.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

import mmvsd.configs
from mmvsd.errors import UserError
from mmvsd.files import atomic_file
from mmvsd.training.objectives import ObjectiveConfig
from mmvsd.training.terms import DEFAULT_OBJECTIVE, check_objective
from mmvsd.tree_options import tree_parts


@dataclass
class TrainConfig:
    """Everything `mmvsd train` needs; mmvsd/configs/*.yaml mirror these fields."""

    target: str = ""
    drafter: str = "eagle3"  # a registered drafter type
    init: str = "none"  # none | drafter folder | LAYOUT (released for the target) | LAYOUT:PATH
    # TERM or TERM+TERM over the registered terms (mmvsd.training.terms): ce, vsd (ablation: no KL half), vsd-kl,
    # accept, vsd-rloo; ce+vsd is the paper's recipe. ce, the default, is the scale pilot's choice (docs/training.md)
    objective: str = DEFAULT_OBJECTIVE
    # auto (ShareGPT; an image drafter on an image target: ShareGPT + LLaVA-Instruct, training_data.py), sharegpt,
    # sharegpt:PATH, llava-instruct:PATH or a file; SPEC+SPEC mixes them
    data: str = "auto"
    image_root: str = ""  # where the data's relative image paths are ("": each data file's folder); LLaVA-Instruct
    # names bare COCO files (000000033471.jpg): set image_root=/data/coco/train2017
    adapter: str = ""  # modality adapter for conversations with images ("": the first that fits the target)
    media_curriculum: str = "auto"  # auto (the drafter's default) | on | off: text first, then media (MSD)
    output: str = ""
    # data
    num_conversations: int = 0  # 0: all (per dataset of a mixture)
    max_length: int = 2048
    validation_fraction: float = 0.01
    data_order: str = "shuffle"  # shuffle: a seeded permutation per epoch | shards: `data` is a folder that `mmvsd
    # regenerate` is still writing, read shard by shard once; a run stops at its finished shards and resumes past them
    wait_for_shards: bool = False  # data_order=shards: at the finished shards' end wait for the next (the manifest is
    # read every minute) instead of stopping, until the regeneration is complete or max_minutes is spent
    regenerate: str = "none"  # none | greedy | sample: answer with the target first (on-policy)
    regenerate_max_new_tokens: int = 512
    regenerate_batch_size: int = 64  # answers generated together (one batched forward per token)
    regenerate_cache: str = ""  # "": the shared cache of these settings under the mmvsd cache (reused across runs)
    features: str = "online"  # online: target forward in the step | offline: read `feature_cache`
    feature_cache: str = ""
    draft_vocab_size: int = 32000
    # optimisation (paper, App. Implementation Details)
    batch_size: int = 1  # examples per micro-batch on each process
    global_batch_size: int = 0  # > 0: examples per micro-batch over all processes, split evenly across them
    # (instead of batch_size; such a run may resume with another number of processes)
    grad_accum: int = 1
    epochs: float = 1.0
    max_steps: int = 0  # optimizer steps; > 0 overrides epochs (`epochs` given later, e.g. on the command line
    # over a file's `max_steps`, sets it back to 0: the length given last wins)
    max_minutes: float = 0.0  # > 0: also stop (checkpoint and publish) after this much wall-clock time (per
    # process: a resumed run may be given another budget)
    stop_at_step: int = 0  # > 0: stop (checkpoint and publish) at this optimizer step, as max_minutes does; the
    # schedule still follows max_steps, and a resumed run goes on
    learning_rate: float = 1e-4
    warmup_ratio: float = 0.02
    warmup_steps: int = 0  # > 0: a linear warm-up over this many optimizer steps instead (continuing with --init)
    schedule: str = "cosine"  # cosine (to min_lr_ratio x peak) | linear (to 0)
    min_lr_ratio: float = 0.01
    max_grad_norm: float = 0.5
    precision: str = "fp32"  # fp32 | bf16 (the drafter's autocast)
    target_dtype: str = "fp32"  # fp32 | bf16: the dtype the target computes features in (bf16: ~3x faster
    # on CPUs with AMX/AVX-512-bf16; the drafter then decodes against an fp32 target's slightly different features)
    target_engine: str = "stock"  # stock | exact: a bf16 target on a CPU computes features with torch's stock kernels
    # or decoding's exact kernels (mmvsd.decoding.cpu_kernels: the same kernels in 32-row chunks, float64 attention),
    # which training does not need (features 1.3-2x faster with stock on 4 x 512 tokens; they differ in the last bits)
    init_from_target: bool = False  # start the draft LM head and final norm from the target's (draft-vocab rows)
    init_layers_from_target: bool = False  # start the draft decoder layer(s) from the target's last one(s)
    draft_layers: int = 1  # decoder layers of a fresh drafter (EAGLE-3 stacks plain layers after its first)
    seed: int = 0
    max_bad_steps: int = 20  # non-finite losses tolerated (skipped) before the run stops
    # bookkeeping
    save_every: int = 200
    keep_checkpoints: int = 2
    log_every: int = 10
    progress: bool = True
    # validation tau (mmvsd.eval.acceptance: exact T=0 acceptance on held-out prompts, logged as val/tau)
    eval_every: int = 0  # optimizer steps between evaluations (0: off); also after the last step
    eval_prompts: str = "mt_bench"  # a JSONL prompt file, a built-in benchmark (mt_bench, humaneval, gsm8k) or an
    # image task (e.g. vqav2_val_mini_long), as `mmvsd eval-drafter --prompt-file` takes
    eval_limit: int = 20  # first N prompts
    eval_max_new_tokens: int = 128
    eval_tree: str = "60/7/10"  # the --tree grammar: auto, paper or BUDGET/DEPTH/TOPK (mmvsd.tree_options)
    loss: ObjectiveConfig = field(default_factory=ObjectiveConfig)

    def validate(self) -> None:
        """Raise UserError on settings that cannot work together."""
        check_objective(self.objective, self.loss)  # a known objective, with weights that train something
        choices = {"regenerate": ("none", "greedy", "sample"),
                   "features": ("online", "offline"), "schedule": ("cosine", "linear"),
                   "media_curriculum": ("auto", "on", "off"),
                   "data_order": ("shuffle", "shards"),
                   "precision": ("fp32", "bf16"), "target_dtype": ("fp32", "bf16"),
                   "target_engine": ("exact", "stock")}
        for key, allowed in choices.items():
            if getattr(self, key) not in allowed:
                raise UserError(f"{key}={getattr(self, key)!r} is not one of {', '.join(allowed)}")
        if not self.target:
            raise UserError("no target: pass --target NAME")
        if not self.output:
            raise UserError("no output folder: pass --output DIR")
        if self.init_layers_from_target and self.target_engine == "exact":
            raise UserError("init_layers_from_target=true reads the target's layer weights, which decoding's exact "
                            "kernels pack away: use target_engine=stock")
        if self.wait_for_shards and self.data_order != "shards":
            raise UserError("wait_for_shards=true waits for a regeneration's shards: it takes data_order=shards")
        if self.data_order == "shards" and (self.features != "online" or self.regenerate != "none"):
            raise UserError("data_order=shards reads the answers of a `mmvsd regenerate` folder with features captured "
                            f"online: it takes features=online and regenerate=none (got {self.features}, "
                            f"{self.regenerate})")
        if self.features == "offline" and not self.feature_cache:
            raise UserError("features=offline needs feature_cache=DIR (written by `mmvsd prepare`)")
        if self.warmup_steps < 0 or self.stop_at_step < 0:
            raise UserError(f"warmup_steps and stop_at_step must be >= 0, got {self.warmup_steps} and "
                            f"{self.stop_at_step}")
        positive = ("batch_size", "grad_accum", "max_length", "save_every", "log_every", "draft_vocab_size",
                    "draft_layers", "eval_max_new_tokens", "regenerate_batch_size")
        for key in positive:
            if getattr(self, key) < 1:
                raise UserError(f"{key} must be >= 1, got {getattr(self, key)}")
        if self.global_batch_size < 0:
            raise UserError(f"global_batch_size must be >= 0 (0: batch_size per process), got {self.global_batch_size}")
        if self.global_batch_size and self.batch_size != 1:
            raise UserError("set batch_size (per process) or global_batch_size (split across the processes), "
                            f"not both (got {self.batch_size} and {self.global_batch_size})")
        self._validate_eval()
        self.loss.validate()  # loss values (objectives.ObjectiveConfig)

    def _validate_eval(self) -> None:
        """The adapter, and the tau monitor's settings and prompts, name something (before a target loads)."""
        from mmvsd.adapters import check_adapter  # the plugins' adapters count: read when a run validates
        from mmvsd.prompts import check_eval_prompts  # likewise the plugins' prompt sets

        check_adapter(self.adapter)
        if self.eval_every < 0 or self.eval_limit < 0:
            raise UserError(f"eval_every and eval_limit must be >= 0, got {self.eval_every} and {self.eval_limit}")
        tree_parts(self.eval_tree, "eval_tree")  # the one --tree grammar: auto, paper or BUDGET/DEPTH/TOPK
        if self.eval_every:
            check_eval_prompts(self.eval_prompts, self.eval_limit)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def save(self, path: str | Path) -> None:
        """Write the resolved config as YAML (atomically)."""
        with atomic_file(path) as handle:
            yaml.safe_dump(self.to_dict(), handle, sort_keys=False)


def _field_types(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _coerce(key: str, value: Any, kind: Any) -> Any:
    """Check (and mildly convert) one value against its field type."""
    if isinstance(kind, types.UnionType) or typing.get_origin(kind) is typing.Union:
        kind = next(k for k in typing.get_args(kind) if k is not type(None))
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if kind is float and isinstance(value, str):  # YAML 1.1 reads "1e-4" (no dot) as a string
        try:
            return float(value)
        except ValueError:
            pass
    if kind is str and isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    if kind is str and isinstance(value, bool):  # YAML 1.1 reads on/off (media_curriculum=off) as booleans
        return "on" if value else "off"
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise UserError(f"{key}: expected {kind.__name__}, got {value!r}")
    return value


def _apply(obj: Any, values: dict[str, Any], prefix: str = "") -> None:
    """Set fields of a dataclass from a (nested) dict; unknown keys are errors."""
    kinds = _field_types(type(obj))
    for key, value in values.items():
        name = f"{prefix}{key}"
        if key not in kinds:
            raise UserError(f"unknown config key {name!r}; known: {', '.join(sorted(kinds))}")
        current = getattr(obj, key)
        if dataclasses.is_dataclass(current):
            if not isinstance(value, dict):
                raise UserError(f"{name}: expected a mapping of {', '.join(_field_types(type(current)))}")
            updated = dataclasses.replace(current)
            _apply(updated, value, f"{name}.")
            setattr(obj, key, updated)
        else:
            setattr(obj, key, _coerce(name, value, kinds[key]))


def parse_overrides(pairs: list[str]) -> dict[str, Any]:
    """`["a=1", "loss.num_samples=8"]` -> nested dict; values parsed as YAML scalars."""
    result: dict[str, Any] = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep or not key:
            raise UserError(f"override {pair!r} is not of the form key=value")
        node = result
        *parents, leaf = key.strip().split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = yaml.safe_load(raw) if raw.strip() else ""
    return result


def _config_path(name: str) -> Path:
    """A YAML path, or the name of a config shipped in mmvsd/configs/ (e.g. `smollm2_cpu`)."""
    path = Path(name)
    if path.exists():
        return path
    shipped = Path(mmvsd.configs.__file__).parent / f"{path.stem}.yaml"
    return shipped if shipped.exists() else path


def load_train_config(config_file: str | None, flags: dict[str, Any], overrides: list[str]) -> TrainConfig:
    """Resolve a TrainConfig: defaults < YAML file < flags (None = not given) < key=value overrides."""
    config = TrainConfig()
    values: dict[str, Any] = {}
    if config_file:
        path = _config_path(config_file)
        try:
            values = yaml.safe_load(path.read_text()) or {}
        except FileNotFoundError:
            raise UserError(f"config file {path} does not exist") from None
        except yaml.YAMLError as err:
            raise UserError(f"config file {path} is not valid YAML: {err}") from None
        if not isinstance(values, dict):
            raise UserError(f"config file {path} must hold a mapping of keys to values")
        _apply(config, values)
    _apply(config, {k: v for k, v in flags.items() if v is not None})
    overridden = parse_overrides(overrides)
    _apply(config, overridden)
    if all("drafter" not in given or given["drafter"] is None for given in (values, flags, overridden)):
        config.drafter = init_drafter_type(config.init) or config.drafter  # `--init vispec` trains a ViSpec drafter
    length_given = [given for given in (values, flags, overridden) if {"epochs", "max_steps"} & {
        key for key, value in given.items() if value is not None}]
    if length_given and "max_steps" not in length_given[-1]:
        config.max_steps = 0  # `epochs=N` on top of a file's `max_steps`: the run's length given last wins
    if all("path_length" not in (given.get("loss") or {}) for given in (values, overridden)):
        config.loss.path_length = tree_depth(config.eval_tree, config.loss.path_length)  # VSD's paths: tree deep
    config.validate()
    return config


def tree_depth(spec: str, fallback: int) -> int:
    """The depth a `--tree` spec fixes (`fallback` for auto, paper, a 0 depth or a malformed spec, which `validate`
    reports)."""
    try:
        parts = tree_parts(spec, "eval_tree")
    except UserError:
        return fallback
    return parts[1] if parts and parts[1] else fallback


def init_drafter_type(init: str) -> str:
    """The drafter architecture `--init LAYOUT` or `LAYOUT:PATH` implies ("" for none, a folder, or a layout of
    any architecture)."""
    from mmvsd.layouts.registry import LAYOUTS, layout_names  # the plugins' layouts: only when a run resolves

    name = init.partition(":")[0]
    return LAYOUTS[name].drafter_type if name in layout_names() else ""
