"""A shipped drafter's model card: what it learned from and what it measures, rendered from its manifest.

The manifest is the one record (`mmvsd.shipped.write_manifest`); the card (`README.md` beside the weights, as on
a model hub, and `mmvsd drafters card NAME`) is rendered from it, so the two cannot disagree. A card needs the
manifest's training facts (`CARD_INFO`) and its held-out acceptance (`held_out`): a dict of the measured figures
(`HELD_OUT_FIGURES`, with the prompts and the command), or a sentence saying why it was not measured.
"""

from __future__ import annotations

CARD = "README.md"
CARD_INFO = ("objective", "data", "tokens_seen", "steps", "hours", "machine", "held_out")
# held-out acceptance at T = 0: what an engine drafting the drafter's top token gets (first token, a depth-3
# chain), then the paper's tree
HELD_OUT_FIGURES = {
    "first_token": "first draft token accepted (argmax chain)",
    "chain_3": "accepted tokens per depth-3 argmax chain (0-3)",
    "tau_60_7_10": "tau, tree 60/7/10 (tokens per target forward)",
}


def missing_card_info(manifest: dict) -> list[str]:
    """The card's facts the manifest lacks (a held_out dict without every figure counts as missing)."""
    missing = [key for key in CARD_INFO if key not in manifest]
    held_out = manifest.get("held_out")
    if isinstance(held_out, dict):
        missing += [f"held_out.{key}" for key in (*HELD_OUT_FIGURES, "prompts", "command") if key not in held_out]
    return missing


def _figure(value) -> str:
    return f"{value:.3f}" if isinstance(value, float) else str(value)


def _held_out_lines(held_out) -> list[str]:
    if not isinstance(held_out, dict):
        return [str(held_out)]  # why it was not measured
    lines = [f"On {held_out['prompts']}, at T = 0 (`{held_out['command']}`):", "",
             "| measure | value |", "| --- | --- |"]
    lines += [f"| {label} | {_figure(held_out[key])} |" for key, label in HELD_OUT_FIGURES.items()]
    if held_out.get("machine"):
        lines += ["", f"Measured on: {held_out['machine']}."]
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
