"""Drafters shipped inside the package: one folder per (target, drafter name), each with a manifest.

Layout (under `mmvsd/shipped_drafters/`):
    <target>/<name>/config.json, model.safetensors   a drafter folder (`mmvsd generate --drafter DIR`)
    <target>/<name>/manifest.json                    sha256 of every file, how it was trained, what it measured
    <target>/<name>/README.md                        its model card, rendered from the manifest (`model_card`)
`--drafter default` is the drafter of the target whose manifest says `"default": true` (or its only
one); `--drafter NAME` a shipped drafter of that name for the target. Every file is checked against
its manifest before loading. `ship_drafter` puts a trained drafter folder there in fp16/bf16.
"""

from __future__ import annotations

import hashlib
import json
import re
import weakref
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from mmvsd.errors import UserError
from mmvsd.files import atomic_dir, atomic_file, file_sha256

SHIPPED_ROOT = Path(__file__).parent / "shipped_drafters"
MANIFEST = "manifest.json"
MAX_FILE_BYTES = 25 * 10**6  # a shipped weights file holds at most 25 MB
CARD = "README.md"  # the model card beside the weights (`model_card`)
CARD_INFO = ("objective", "data", "tokens_seen", "steps", "hours", "machine", "held_out")  # what a card needs
REQUIRED_INFO = ("target", "target_sha256", "training", "tau", "tau_command", *CARD_INFO)
HALF_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}

_target_checksums: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def weights_sha256(module: torch.nn.Module) -> str:
    """sha256 of a module's weights: names, dtypes, shapes and bytes, tied tensors once."""
    digest = hashlib.sha256()
    seen: set[int] = set()
    for name, tensor in sorted(module.state_dict().items()):
        if tensor.data_ptr() in seen and tensor.numel():
            continue
        seen.add(tensor.data_ptr())
        digest.update(f"{name}:{tensor.dtype}:{tuple(tensor.shape)}\n".encode())
        digest.update(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def target_checksum(target) -> str:
    """`weights_sha256` of a target's model, cached per target object."""
    if target not in _target_checksums:
        _target_checksums[target] = weights_sha256(target.model)
    return _target_checksums[target]


@dataclass(frozen=True)
class ShippedDrafter:
    """One shipped drafter folder."""

    target: str  # built-in target name
    name: str  # drafter name, e.g. eagle3-ce
    folder: Path

    def manifest(self) -> dict:
        """The parsed manifest.json (UserError naming the file if absent or unreadable)."""
        path = self.folder / MANIFEST
        if not path.is_file():
            raise UserError(f"shipped drafter {self.target}/{self.name}: {path} is missing")
        try:
            manifest = json.loads(path.read_text())
        except (OSError, ValueError) as err:
            raise UserError(f"shipped drafter {self.target}/{self.name}: {path} is not valid JSON ({err})") from None
        if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict):
            raise UserError(f"shipped drafter {self.target}/{self.name}: {path} lists no 'files'")
        return manifest

    @property
    def is_default(self) -> bool:
        try:
            return bool(self.manifest().get("default", False))
        except UserError:
            return False

    def verify(self) -> Path:
        """Check every file against the manifest's sha256; the folder, or a UserError naming the bad file."""
        manifest = self.manifest()
        if manifest.get("target") != self.target:
            raise UserError(f"{self.folder / MANIFEST} is for target {manifest.get('target')!r}, "
                            f"but lies in the folder of {self.target!r}")
        for name, entry in sorted(manifest["files"].items()):
            path = self.folder / name
            if not path.is_file():
                raise UserError(f"shipped drafter {self.target}/{self.name} is incomplete: {path} is missing")
            if file_sha256(path) != entry.get("sha256"):
                raise UserError(f"shipped drafter {self.target}/{self.name} is corrupt: sha256 of {path} does not "
                                f"match its manifest (reinstall mmvsd)")
        return self.folder


def list_shipped(root: Path | None = None) -> list[ShippedDrafter]:
    """Every shipped drafter folder, sorted by target and name."""
    root = Path(root) if root is not None else SHIPPED_ROOT
    if not root.is_dir():
        return []
    found = []
    for target_dir in sorted(p for p in root.iterdir() if _is_entry(p)):
        found += [ShippedDrafter(target_dir.name, d.name, d) for d in sorted(target_dir.iterdir()) if _is_entry(d)]
    return found


def _is_entry(path: Path) -> bool:
    return path.is_dir() and not path.name.startswith((".", "_"))


def targets_with_default() -> list[str]:
    """Targets that have a shipped drafter (hence a `default`)."""
    return sorted({d.target for d in list_shipped()})


def default_drafter(target_name: str) -> ShippedDrafter | None:
    """The target's default shipped drafter: the one marked default, else its only one; None if none."""
    mine = [d for d in list_shipped() if d.target == target_name]
    marked = [d for d in mine if d.is_default]
    if len(marked) > 1:
        raise UserError(f"several shipped drafters of {target_name!r} are marked default: "
                        f"{', '.join(d.name for d in marked)}")
    if marked:
        return marked[0]
    return mine[0] if len(mine) == 1 else None


def resolve_drafter(spec: str, target_name: str) -> Path:
    """The verified folder of shipped drafter `spec` (`default` or a name) for target `target_name`."""
    return shipped_drafter(spec, target_name).verify()


def shipped_drafter(spec: str, target_name: str) -> ShippedDrafter:
    """Shipped drafter `spec` (`default` or a name) of target `target_name`, unverified (UserError for none): cheap,
    so commands check a name before a target loads."""
    mine = [d for d in list_shipped() if d.target == target_name]
    if spec == "default":
        found = default_drafter(target_name)
        if found is None:
            raise UserError(_no_default_message(target_name, mine))
        return found
    for drafter in mine:
        if drafter.name == spec:
            return drafter
    names = ", ".join(d.name for d in mine) or "none"
    others = sorted({d.target for d in list_shipped() if d.name == spec})
    elsewhere = f"; {spec!r} ships for {', '.join(others)}" if others else ""
    raise UserError(f"--drafter {spec!r} is neither a drafter folder nor a shipped drafter of target "
                    f"{target_name!r} (shipped for it: {names}{elsewhere})")


def has_default(target_name: str) -> bool:
    """Whether `--drafter default` names something for this target: a shipped drafter, or, for a built-in target, a
    default draft model (Qwen2.5-Coder-1.5B's 0.5B sibling)."""
    from mmvsd.target_loader import builtin_targets  # the registry of named targets, read once a command runs

    builtin = builtin_targets().get(target_name)
    return any(d.target == target_name for d in list_shipped()) or bool(builtin is not None and builtin.default_drafter)


def implicit_drafter_spec(target_name: str) -> str:
    """What a command uses when no --drafter is given: `default` if the target has a shipped drafter (or, for a
    built-in target, a default draft model)."""
    if has_default(target_name):
        return "default"
    having = targets_with_default()
    raise UserError(f"no --drafter given and target {target_name!r} has no shipped drafter (targets with one: "
                    f"{', '.join(having) if having else 'none yet'}); pass --drafter DIR, random, ngram or none")


def _no_default_message(target_name: str, mine: list[ShippedDrafter]) -> str:
    if mine:
        return (f"target {target_name!r} has several shipped drafters and none is marked default: "
                f"{', '.join(d.name for d in mine)}; name one with --drafter")
    having = targets_with_default()
    listed = ", ".join(having) if having else "none yet"
    return (f"target {target_name!r} has no shipped drafter (targets with one: {listed}); "
            f"pass --drafter DIR, random or none")


def write_manifest(folder: str | Path, **info) -> dict:
    """Write `folder`/manifest.json: sha256 and size of every file plus `info` (REQUIRED_INFO keys and
    any others, e.g. name, default, notes), and the model card rendered from it (README.md). Refuses weights over
    25 MB or not in fp16/bf16."""
    folder = Path(folder)
    missing = [key for key in REQUIRED_INFO if key not in CARD_INFO and key not in info] + missing_card_info(info)
    if missing:
        raise UserError(f"manifest for {folder} lacks {', '.join(missing)}")
    files = sorted(p for p in folder.iterdir()
                   if p.is_file() and p.name not in (MANIFEST, CARD) and not p.name.startswith("."))
    if not any(p.name == "model.safetensors" for p in files) or not (folder / "config.json").is_file():
        raise UserError(f"{folder} is not a drafter folder (needs config.json and model.safetensors)")
    for path in files:
        if path.stat().st_size > MAX_FILE_BYTES:
            raise UserError(f"{path} holds {path.stat().st_size / 1e6:.1f} MB; a shipped file may hold at most "
                            f"{MAX_FILE_BYTES / 1e6:.0f} MB (use a smaller draft vocabulary)")
    _check_half_precision(folder / "model.safetensors")
    config = json.loads((folder / "config.json").read_text())
    manifest = {"name": folder.name, "default": False, **info,
                "drafter_type": config.get("mmvsd_drafter_type", ""),
                "files": {p.name: {"sha256": file_sha256(p), "bytes": p.stat().st_size} for p in files}}
    card = model_card(manifest)
    with atomic_file(folder / MANIFEST) as handle:
        json.dump(manifest, handle, indent=2, sort_keys=False)
        handle.write("\n")
    with atomic_file(folder / CARD) as handle:
        handle.write(card)
    return manifest


def _check_half_precision(weights: Path) -> None:
    with safe_open(str(weights), framework="pt") as handle:
        wide = [key for key in handle.keys()  # noqa: SIM118  (a safetensors handle is not iterable)
                if handle.get_slice(key).get_dtype() in ("F32", "F64")]
    if wide:
        raise UserError(f"{weights}: shipped weights must be fp16 or bf16; fp32/fp64 tensors: {', '.join(wide[:5])}")


def ship_drafter(source: str | Path, target: str, name: str, *, dtype: str = "bf16", root: str | Path | None = None,
                 **info) -> Path:
    """Copy a trained drafter folder into the shipped tree as `target`/`name` with its floating
    tensors in `dtype` (fp16|bf16), then write its manifest (`info`: see `write_manifest`)."""
    if dtype not in HALF_DTYPES:
        raise UserError(f"dtype must be one of {', '.join(HALF_DTYPES)}, got {dtype!r}")
    source = Path(source)
    for needed in ("config.json", "model.safetensors"):
        if not (source / needed).is_file():
            raise UserError(f"{source / needed} is missing: not a drafter folder")
    state = load_file(str(source / "model.safetensors"))
    half = {k: v.to(HALF_DTYPES[dtype]) if v.is_floating_point() else v for k, v in state.items()}
    out = Path(root if root is not None else SHIPPED_ROOT) / target / name
    with atomic_dir(out) as tmp:
        (tmp / "config.json").write_bytes((source / "config.json").read_bytes())
        save_file(half, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        write_manifest(tmp, **{"name": name, "dtype": dtype, **info, "target": target})
    return out


def shipped_card(spec: str) -> str:
    """The model card of shipped drafter `spec` (NAME, or TARGET/NAME where several targets have one)."""
    target, _, name = spec.rpartition("/")
    found = [d for d in list_shipped() if d.name == name and target in ("", d.target)]
    if len(found) != 1:
        known = ", ".join(f"{d.target}/{d.name}" for d in list_shipped()) or "none"
        problem = f"{spec!r} names drafters of several targets" if found else f"no shipped drafter {spec!r}"
        raise UserError(f"{problem}; name one of: {known}")
    drafter = found[0]
    manifest = drafter.manifest()
    missing = missing_card_info(manifest)
    if missing:
        raise UserError(f"{drafter.folder / MANIFEST} lacks what a model card needs: {', '.join(missing)}")
    return model_card(manifest)


def format_shipped() -> str:
    """`mmvsd drafters list`: one line per shipped drafter (target, name, default, type, size, tau, check)."""
    rows = list_shipped()
    if not rows:
        return "no shipped drafters in this installation (" + str(SHIPPED_ROOT) + ")"
    lines = [f"{'target':<16} {'name':<16} {'default':<8} {'type':<10} {'MB':>6}  tau / status"]
    for drafter in rows:
        try:
            drafter.verify()
            manifest = drafter.manifest()
            size = sum(entry.get("bytes", 0) for entry in manifest["files"].values()) / 1e6
            status = _tau_text(manifest.get("tau"))
            lines.append(f"{drafter.target:<16} {drafter.name:<16} {'yes' if drafter.is_default else '':<8} "
                         f"{manifest.get('drafter_type', ''):<10} {size:>6.1f}  {status}")
        except UserError as err:
            lines.append(f"{drafter.target:<16} {drafter.name:<16} {'':<8} {'?':<10} {'':>6}  BROKEN: {err}")
    return "\n".join(lines)


# a manifest's tau key: BENCHMARK_COUNT_prompts|first_turns[_TOKENS_tokens_TREE_TEMPERATURE]
TAU_KEY = re.compile(r"(?P<bench>.+?)_(?P<count>\d+)_(?P<unit>prompts|first_turns)"
                     r"(?:_(?P<tokens>\d+)_tokens_(?P<tree>\d+/\d+/\d+)_(?P<temperature>T\d+))?$")


def _tau_text(tau) -> str:
    """A manifest's tau in one short line: per benchmark, with the conditions (tokens, tree, temperature) that
    differ between its entries, then the ones they share, said once."""
    if not isinstance(tau, dict):
        return f"{tau:.2f}" if isinstance(tau, (int, float)) else str(tau or "-")
    entries, counts = [], set()
    for key, value in tau.items():
        match = TAU_KEY.match(key)
        text = f"{value:.2f}" if isinstance(value, (int, float)) else str(value)
        conditions = ((f"{match['tokens']} tokens", f"tree {match['tree']}", match["temperature"])
                      if match and match["tokens"] else ())
        entries.append((match["bench"] if match else key, text, match and match["count"], conditions))
        if match:
            counts.add(f"{match['count']} {match['unit'].replace('_', ' ')}")
    measured = [conditions for *_, conditions in entries if conditions]
    varying = [len(set(column)) > 1 for column in zip(*measured, strict=True)]
    same_count = len(counts) == 1
    parts = []
    for name, text, count, conditions in entries:
        own = [c for c, varies in zip(conditions, varying, strict=False) if varies]
        parts.append(" ".join([name, *own, text]) + (f" ({count})" if count and not same_count else ""))
    shared_conditions = [c for c, varies in zip(measured[0], varying, strict=True) if not varies] if measured else []
    shared = ([f"{counts.pop()} each"] if same_count else []) + ([", ".join(shared_conditions)] if shared_conditions
                                                                  else [])
    return ", ".join(parts) + (f" ({'; '.join(shared)})" if shared else "")


# ----------------------------------------------------------------------------- model cards
# A shipped drafter's model card: what it learned from and what it measures, rendered from its manifest.
# The manifest is the one record (`write_manifest`); the card (`README.md` beside the weights, as on
# a model hub, and `mmvsd drafters card NAME`) is rendered from it, so the two cannot disagree. A card needs the
# manifest's training facts (`CARD_INFO`) and its held-out acceptance (`held_out`): a dict of the measured figures
# (`HELD_OUT_FIGURES`, with the prompts and the command), or a sentence saying why it was not measured.

# held-out acceptance at T = 0: what an engine drafting the drafter's top token gets (first token, a depth-3
# chain), then tau with the paper's tree (`tau_60_7_10`; `tau_60_5_8` on image prompts)
HELD_OUT_FIGURES = {
    "first_token": "first draft token accepted (argmax chain)",
    "chain_3": "accepted tokens per depth-3 argmax chain (0-3)",
}
HELD_OUT_TAU = "tau_"  # + BUDGET_DEPTH_TOPK
# per domain (held_out["by_domain"]: {"chat": {...}, "math": {...}, "code": {...}}), as public heads report them:
# `mmvsd eval-drafter --tree 4/3/1` on a prompt file whose rows name their domain
DOMAIN_FIGURES = {
    "prompts": "prompts",
    "first_token": "first draft token accepted",
    "chain_3": "accepted tokens per depth-3 chain (0-3)",
    "tau_4_3_1": "tau, depth-3 chain",
}


def held_out_tau_key(tree: str) -> str:
    """The held_out key of the tau measured with tree BUDGET/DEPTH/TOPK: tau_60_7_10 for 60/7/10."""
    return HELD_OUT_TAU + tree.replace("/", "_")


def _held_out_labels(held_out: dict) -> dict[str, str]:
    taus = {key: f"tau, tree {key[len(HELD_OUT_TAU):].replace('_', '/')} (tokens per target forward)"
            for key in held_out if key.startswith(HELD_OUT_TAU)}
    return {**HELD_OUT_FIGURES, **taus}


def missing_card_info(manifest: dict) -> list[str]:
    """The card's facts the manifest lacks (a held_out dict without every figure counts as missing)."""
    missing = [key for key in CARD_INFO if key not in manifest]
    held_out = manifest.get("held_out")
    if isinstance(held_out, dict):
        missing += [f"held_out.{key}" for key in (*HELD_OUT_FIGURES, "prompts", "command") if key not in held_out]
        if not any(key.startswith(HELD_OUT_TAU) for key in held_out):
            missing.append(f"held_out.{HELD_OUT_TAU}BUDGET_DEPTH_TOPK")
        by_domain = held_out.get("by_domain")
        if by_domain is not None:
            missing += [f"held_out.by_domain.{key}" for key in ("domains", "command") if key not in by_domain]
            missing += [f"held_out.by_domain.domains.{name}.{key}"
                        for name, figures in by_domain.get("domains", {}).items()
                        for key in DOMAIN_FIGURES if key not in figures]
    return missing


def _figure(value) -> str:
    return f"{value:.3f}" if isinstance(value, float) else str(value)


def _held_out_lines(held_out) -> list[str]:
    if not isinstance(held_out, dict):
        return [str(held_out)]  # why it was not measured
    lines = [f"On {held_out['prompts']}, at T = 0 (`{held_out['command']}`):", "",
             "| measure | value |", "| --- | --- |"]
    lines += [f"| {label} | {_figure(held_out[key])} |" for key, label in _held_out_labels(held_out).items()]
    if held_out.get("machine"):
        lines += ["", f"Measured on: {held_out['machine']}."]
    by_domain = held_out.get("by_domain")
    if by_domain:
        lines += ["", f"Per domain, at T = 0 (`{by_domain['command']}`):", "",
                  "| domain | " + " | ".join(DOMAIN_FIGURES.values()) + " |",
                  "| --- |" + " --- |" * len(DOMAIN_FIGURES)]
        lines += [f"| {name} | " + " | ".join(_figure(figures[key]) for key in DOMAIN_FIGURES) + " |"
                  for name, figures in by_domain["domains"].items()]
        if by_domain.get("machine"):
            lines += ["", f"Measured on: {by_domain['machine']}."]
    return lines


def _tau_lines(tau) -> list[str]:
    if not isinstance(tau, dict):
        return [str(tau)]
    return ["| benchmark | tau |", "| --- | --- |"] + [f"| {key} | {_figure(value)} |" for key, value in tau.items()]


def model_card(manifest: dict) -> str:
    """The markdown card of a shipped drafter's manifest (every CARD_INFO key present: `missing_card_info`)."""
    size = sum(entry.get("bytes", 0) for entry in manifest.get("files", {}).values()) / 1e6
    default = " (the target's default)" if manifest.get("default") else ""
    facts = [("target", f"{manifest['target']} (weights sha256 {manifest['target_sha256'][:16]}...)"),
             ("drafter", f"{manifest.get('drafter_type', '?')}, {size:.1f} MB in {manifest.get('dtype', '?')}"),
             ("objective", manifest["objective"]), ("data", manifest["data"]),
             ("tokens seen", manifest["tokens_seen"]), ("optimizer steps", manifest["steps"]),
             ("hours", manifest["hours"]), ("machine", manifest["machine"])]
    if manifest.get("draft_vocab"):  # a drafter narrowed to part of the target's vocabulary (`mmvsd draft-vocab`)
        facts.insert(2, ("draft vocabulary", manifest["draft_vocab"]))
    lines = [f"# {manifest['target']} / {manifest['name']}{default}", "",
             "A draft model for speculative decoding with mmvsd: "
             f"`mmvsd generate --target {manifest['target']} --drafter {manifest['name']}`. Lossless: the target's "
             "output is unchanged, only faster.", "", "| | |", "| --- | --- |"]
    lines += [f"| {name} | {value} |" for name, value in facts]
    lines += ["", "## Held-out acceptance", "", *_held_out_lines(manifest["held_out"])]
    lines += ["", "## Benchmarks", "", *_tau_lines(manifest.get("tau")), "",
              f"Command: `{manifest.get('tau_command', '?')}`", "", "## Training", "", str(manifest["training"])]
    if manifest.get("notes"):
        lines += ["", "## Notes", "", str(manifest["notes"])]
    lines += ["", "Rendered from `manifest.json` (`mmvsd drafters card`), which lists every file's sha256."]
    return "\n".join(lines) + "\n"
