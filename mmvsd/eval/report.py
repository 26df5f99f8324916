"""Bench reports: per (temperature, method, benchmark) numbers, the paper's table, JSON, CSV and plots.

Definitions (one place; also printed under the table):
    tau         kept new tokens (after EOS and max-length truncation) / target forwards, the bonus token
                counted and the prefill counted as one forward (own loops only: HF methods do not expose
                their forwards). `SequenceResult.tau`, the acceptance histograms (kept tokens per forward)
                and the lmms-eval plugin's records use the same definition.
    throughput  total new tokens / total wall time of the batches that produced them (each method's whole
                batch is timed once, so rows of one batch are never summed as if they ran one after another)
    SR          throughput / the own vanilla loop's at the same batch size (HF baselines run at batch 1, so
                with --batch-size > 1 their denominator is `vanilla@b1`); "SR vs HF" / "SR vs prompt lookup":
                / HF generate's / HF prompt lookup's (shown only where both ran at the same batch size)
    lossless    at T=0 every method's output is compared with vanilla's, per prompt; a method with any
                mismatch is flagged and its ratios are not shown as speed-ups ("≠" marks the raw ratio)
    Average     mean over benchmarks of each benchmark's value; labelled when it mixes synthetic stand-ins
                (mmvsd's offline mini tasks) with real tasks
"""

from __future__ import annotations

import csv
import json
import os
import platform
from collections import Counter
from dataclasses import asdict, dataclass, field
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

AVERAGE = "average"
VANILLA_METHODS = ("vanilla", "vanilla@b1")


@dataclass
class Row:
    """One method on one benchmark at one temperature."""

    temperature: float
    method: str
    benchmark: str
    num_prompts: int = 0
    batch_size: int = 1
    new_tokens: int = 0
    wall_seconds: float = 0.0  # total batch wall time
    tokens_per_second: float = 0.0
    tau: float | None = None
    sr: float | None = None  # vs own vanilla at the same batch size; None when flagged
    sr_vs_hf: float | None = None
    sr_vs_pld: float | None = None
    unverified_sr: float | None = None  # the raw ratio of a flagged method (not a speed-up of the same output)
    accuracy: float | None = None
    lossless_mismatches: int | None = None  # T=0, every method but vanilla
    refused: str = ""  # why the method did not run here
    synthetic: bool = False  # an offline stand-in (average: some benchmark in it is)
    mixes_synthetic: bool = False  # average only: synthetic and real benchmarks together
    draft_acceptance: float | None = None  # accepted / drafted tokens, for engines that count them (llama.cpp)
    accept_histogram: dict[int, int] = field(default_factory=dict)  # kept tokens per target forward
    tree_size_histogram: dict[int, int] = field(default_factory=dict)  # nodes verified per step

    @property
    def flagged(self) -> bool:
        return bool(self.lossless_mismatches)


def batch_wall_seconds(group: list) -> float:
    """Total wall time of the batches behind `group`'s records (each batch counted once)."""
    batches: dict[str, float] = {}
    for index, record in enumerate(group):
        key = record.batch_id or f"record-{index}"
        batches[key] = record.batch_wall_seconds if record.batch_id else record.wall_seconds
    return sum(batches.values())


def throughput(new_tokens: int, wall_seconds: float) -> float:
    """Tokens per second of a whole run: total tokens / total batch wall time."""
    return new_tokens / wall_seconds if wall_seconds > 0 else 0.0


def aggregate(records: list, methods: list[str]) -> list[Row]:
    """Rows per (temperature, method, benchmark), then per (temperature, method) averages."""
    groups: dict[tuple[float, str, str], list] = {}
    for record in records:
        groups.setdefault((record.temperature, record.method, record.benchmark), []).append(record)
    rows = {key: _row(key, group) for key, group in groups.items()}
    for (temperature, _, benchmark), row in rows.items():
        _set_ratios(row, {m: rows.get((temperature, m, benchmark)) for m in (*VANILLA_METHODS, "hf", "pld")})
    ordered = sorted(rows.values(), key=lambda r: (r.temperature, _order(methods, r.method), r.benchmark))
    return ordered + _averages(ordered, methods)


def _order(methods: list[str], method: str) -> int:
    return methods.index(method) if method in methods else len(methods)


def _ratio(row: Row, base: Row | None) -> float | None:
    """row / base throughput where base is a usable reference at the same batch size."""
    if base is None or base.refused or base.flagged or base.tokens_per_second <= 0 or row.refused:
        return None
    if base.batch_size != row.batch_size:
        return None
    return row.tokens_per_second / base.tokens_per_second


def _set_ratios(row: Row, bases: dict[str, Row | None]) -> None:
    vanilla = next((bases[m] for m in VANILLA_METHODS if bases[m] is not None
                    and bases[m].batch_size == row.batch_size), None)
    sr = _ratio(row, vanilla)
    if row.flagged:
        row.unverified_sr = sr
        return
    row.sr = sr
    row.sr_vs_hf = _ratio(row, bases["hf"])
    row.sr_vs_pld = _ratio(row, bases["pld"])


def _row(key: tuple[float, str, str], group: list) -> Row:
    temperature, method, benchmark = key
    row = Row(temperature, method, benchmark, num_prompts=len(group))
    row.refused = next((r.refused for r in group if getattr(r, "refused", "")), "")
    row.synthetic = any(getattr(r, "synthetic", False) for r in group)
    row.batch_size = max(getattr(r, "batch_size", 1) for r in group)
    ran = [r for r in group if not getattr(r, "refused", "")]
    row.new_tokens = sum(r.new_tokens for r in ran)
    row.wall_seconds = batch_wall_seconds(ran)
    row.tokens_per_second = throughput(row.new_tokens, row.wall_seconds)
    forwards = sum(r.target_forwards for r in ran)
    if forwards > 0:
        row.tau = row.new_tokens / forwards
    drafted = sum(getattr(r, "drafted", 0) for r in ran)
    if drafted > 0:
        row.draft_acceptance = sum(getattr(r, "draft_accepted", 0) for r in ran) / drafted
    scored = [r.correct for r in ran if r.correct is not None]
    if scored:
        row.accuracy = sum(scored) / len(scored)
    if temperature == 0 and method != "vanilla" and ran:
        row.lossless_mismatches = sum(r.mismatch is not None for r in ran)
    row.accept_histogram = dict(sorted(Counter(n for r in ran for n in r.accept_lengths).items()))
    row.tree_size_histogram = dict(sorted(Counter(n for r in ran for n in getattr(r, "tree_sizes", [])).items()))
    return row


def _mean(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def _averages(rows: list[Row], methods: list[str]) -> list[Row]:
    out = []
    for temperature in sorted({r.temperature for r in rows}):
        for method in sorted({r.method for r in rows if r.temperature == temperature},
                             key=lambda m: _order(methods, m)):
            group = [r for r in rows if r.method == method and r.temperature == temperature]
            row = Row(temperature, method, AVERAGE, num_prompts=sum(r.num_prompts for r in group),
                      batch_size=max(r.batch_size for r in group))
            row.synthetic = any(r.synthetic for r in group)
            row.mixes_synthetic = row.synthetic and not all(r.synthetic for r in group)
            row.refused = "; ".join(sorted({r.refused for r in group if r.refused}))
            row.new_tokens = sum(r.new_tokens for r in group)
            row.wall_seconds = sum(r.wall_seconds for r in group)
            row.tokens_per_second = _mean([r.tokens_per_second for r in group if not r.refused]) or 0.0
            counts = [r.lossless_mismatches for r in group if r.lossless_mismatches is not None]
            row.lossless_mismatches = sum(counts) if counts else None
            complete = not any(r.refused for r in group)  # an average over fewer benchmarks is not the average
            for key in ("tau", "sr", "sr_vs_hf", "sr_vs_pld", "unverified_sr"):
                values = [getattr(r, key) for r in group]
                setattr(row, key, _mean(values) if complete and None not in values else None)
            if row.flagged and row.unverified_sr is None:
                row.unverified_sr = _mean([r.sr if r.sr is not None else r.unverified_sr for r in group])
            row.accuracy = _mean([r.accuracy for r in group])
            row.draft_acceptance = _mean([r.draft_acceptance for r in group])
            row.accept_histogram = _sum_histograms(r.accept_histogram for r in group)
            row.tree_size_histogram = _sum_histograms(r.tree_size_histogram for r in group)
            out.append(row)
    return out


def _sum_histograms(histograms) -> dict[int, int]:
    total: Counter = Counter()
    for histogram in histograms:
        total.update(histogram)
    return dict(sorted(total.items()))


def _fmt(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _sr_cell(row: Row) -> str:
    if row.refused:
        return "refused"
    if row.flagged:
        return f"≠ ({_fmt(row.unverified_sr)})"
    return _fmt(row.sr)


def benchmark_label(rows: list[Row], benchmark: str) -> str:
    """A column name that says when a benchmark is synthetic or an average mixes synthetic and real."""
    row = next(r for r in rows if r.benchmark == benchmark)
    if benchmark == AVERAGE and row.mixes_synthetic:
        return f"{AVERAGE} (mixes synthetic and real)"
    return f"{benchmark} (synthetic)" if row.synthetic else benchmark


def engine_note(name: str) -> str:
    """What the rows and ratios of engine `name` mean (its `report_note`); a generic line for an engine that is
    not installed here (a results folder from another machine)."""
    from mmvsd.decoding.engines import ENGINES  # loaded when a report is written
    from mmvsd.plugins import load_plugins  # likewise

    load_plugins()  # the plugins' engines too
    engine = ENGINES.get(name)
    return (engine.report_note if engine is not None and engine.report_note else
            f"Engine: {name}. SR: throughput ratio to its own vanilla row.")


def markdown_table(rows: list[Row], methods: list[str], engine: str = "mmvsd") -> str:
    """The paper's layout: methods as rows, benchmarks x {SR, tau} as columns, one block per temperature."""
    benchmarks = [b for b in dict.fromkeys(r.benchmark for r in rows) if b != AVERAGE] + [AVERAGE]
    shown = sorted({r.method for r in rows}, key=lambda m: _order(methods, m))
    lines = []
    for temperature in sorted({r.temperature for r in rows}):
        block = [r for r in rows if r.temperature == temperature]
        cell = {(r.method, r.benchmark): r for r in block}
        labels = [benchmark_label(block, b) for b in benchmarks]
        lines += [f"**Temperature = {temperature:g}**", "",
                  "| Method | " + " | ".join(f"{b} SR | {b} tau" for b in labels) + " |",
                  "|---|" + "---|---|" * len(benchmarks)]
        for method in [m for m in shown if any(k[0] == m for k in cell)]:
            values = [(_sr_cell(cell[(method, b)]), _fmt(cell[(method, b)].tau)) if (method, b) in cell else ("-", "-")
                      for b in benchmarks]
            lines.append(f"| {method} | " + " | ".join(f"{sr} | {tau}" for sr, tau in values) + " |")
        lines.append("")
        lines += [("| Method | benchmark | batch | tokens/s | SR vs HF | SR vs prompt lookup | drafts accepted "
                   "| accuracy | T=0 mismatches | note |"), "|---|---|---|---|---|---|---|---|---|---|"]
        for r in block:
            lines.append(f"| {r.method} | {benchmark_label(block, r.benchmark)} | {r.batch_size} | "
                         f"{r.tokens_per_second:.1f} | {_fmt(r.sr_vs_hf)} | {_fmt(r.sr_vs_pld)} | "
                         f"{_fmt(r.draft_acceptance)} | {_fmt(r.accuracy, 3)} "
                         f"| {'-' if r.lossless_mismatches is None else r.lossless_mismatches} | {_note(r)} |")
        lines.append("")
    lines.append(engine_note(engine))
    lines.append("Throughput: total new tokens / total batch wall time. ≠: the output differs "
                 "from vanilla at T=0, so the ratio in brackets is not a speed-up of the same output. refused: the "
                 "method cannot run there (see note). synthetic: mmvsd's offline stand-in for a real task. "
                 "Average: mean over benchmarks.")
    return "\n".join(lines) + "\n"


def _note(row: Row) -> str:
    notes = []
    if row.refused:
        notes.append(row.refused)
    if row.flagged:
        notes.append(f"output differs from vanilla on {row.lossless_mismatches} prompt(s): not lossless here")
    return "; ".join(notes) or "-"


def environment() -> dict:
    """Package versions and the machine, saved with every result."""
    import torch  # heavy (~2 s): only for the GPU's name; the reports themselves need no torch

    versions = {"python": platform.python_version()}
    for package in ("mmvsd", "torch", "transformers", "accelerate", "lmms_eval"):
        try:
            versions[package] = version(package)
        except PackageNotFoundError:
            versions[package] = None
    machine = {"platform": platform.platform(), "processor": platform.processor(), "cpu_count": _cpu_count(),
               "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}
    return {"versions": versions, "machine": machine}


def _cpu_count() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def write_reports(out_dir: Path, config: dict, records: list, methods: list[str]) -> list[Row]:
    """results.json, results.csv, table.md, mismatches.json and the PNG plots in `out_dir`."""
    rows = aggregate(records, methods)
    mismatches = [{"benchmark": r.benchmark, "item_id": r.item_id, "method": r.method, **r.mismatch}
                  for r in records if r.mismatch is not None]
    rows_json = [{**asdict(r), "flagged": r.flagged} for r in rows]
    (out_dir / "results.json").write_text(json.dumps(
        {"config": config, **environment(), "rows": rows_json, "mismatches": mismatches},
        indent=2) + "\n")
    with open(out_dir / "results.csv", "w", newline="") as handle:
        names = [k for k in asdict(rows[0]) if not k.endswith("histogram")] if rows else []
        writer = csv.DictWriter(handle, fieldnames=names, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(asdict(r) for r in rows)
    (out_dir / "table.md").write_text(markdown_table(rows, methods, config.get("engine", "mmvsd")))
    plot_results(rows, methods, out_dir)
    return rows


def plot_results(rows: list[Row], methods: list[str], out_dir: Path) -> None:
    """tau.png (per benchmark per method), sr.png (SR bars), acceptance.png (accept-length histograms)."""
    import matplotlib  # plotting only, and slow to import (~0.3 s): the table and JSON do without it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # likewise; after use("Agg"), which picks a headless backend first

    for temperature in sorted({r.temperature for r in rows}):
        block = [r for r in rows if r.temperature == temperature]
        suffix = f"_t{temperature:g}"
        for metric, label in (("tau", "tau (tokens per target forward)"), ("sr", "speed-up vs own vanilla")):
            _grouped_bars(plt, block, methods, metric, label, out_dir / f"{metric}{suffix}.png")
        figure, axis = plt.subplots(figsize=(7, 4))
        for row in (r for r in block if r.benchmark == AVERAGE and r.accept_histogram and r.method != "vanilla"):
            total = sum(row.accept_histogram.values())
            lengths = sorted(row.accept_histogram)
            axis.plot(lengths, [row.accept_histogram[n] / total for n in lengths], marker="o", label=row.method)
        axis.set(xlabel="tokens accepted per target forward (bonus counted)", ylabel="share of forwards",
                 title=f"Acceptance lengths, T={temperature:g}")
        axis.legend() if axis.lines else None
        figure.tight_layout()
        figure.savefig(out_dir / f"acceptance{suffix}.png", dpi=100)
        plt.close(figure)


def _grouped_bars(plt, rows: list[Row], methods: list[str], metric: str, label: str, path: Path) -> None:
    benchmarks = list(dict.fromkeys(r.benchmark for r in rows))
    shown = [m for m in methods if any(r.method == m and getattr(r, metric) is not None for r in rows)]
    figure, axis = plt.subplots(figsize=(max(7, 1.6 * len(benchmarks) + 2), 4))
    width = 0.8 / max(1, len(shown))
    cell = {(r.method, r.benchmark): getattr(r, metric) for r in rows}
    for index, method in enumerate(shown):
        values = [cell.get((method, b)) or 0.0 for b in benchmarks]
        axis.bar([i + index * width for i in range(len(benchmarks))], values, width, label=method)
    axis.set_xticks([i + width * (len(shown) - 1) / 2 for i in range(len(benchmarks))], benchmarks)
    axis.set(ylabel=label)
    if shown:
        axis.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0))
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
