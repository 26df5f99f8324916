"""Bench reports: per (temperature, method, benchmark) numbers, the paper's table, JSON, CSV and plots.

Conventions (also printed under the table):
    tau   new tokens per target forward, bonus token counted, prefill counted as one forward
          (own loops only; HF methods do not expose their forwards)
    SR    throughput (new tokens / wall seconds, summed over the benchmark's prompts) of a method
          divided by that of mmvsd's own vanilla loop ("SR") or of HF generate ("SR vs HF")
    the Average columns are the mean over benchmarks of each benchmark's value
"""

from __future__ import annotations

import csv
import json
import platform
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

AVERAGE = "average"


@dataclass
class Row:
    """One method on one benchmark at one temperature."""

    temperature: float
    method: str
    benchmark: str
    num_prompts: int = 0
    new_tokens: int = 0
    wall_seconds: float = 0.0
    tokens_per_second: float = 0.0
    tau: float | None = None
    sr: float | None = None  # vs own vanilla
    sr_vs_hf: float | None = None
    accuracy: float | None = None
    lossless_mismatches: int | None = None  # T=0 own loops other than vanilla
    accept_histogram: dict[int, int] = field(default_factory=dict)


def aggregate(records: list, methods: list[str]) -> list[Row]:
    """Rows per (temperature, method, benchmark), then per (temperature, method) averages."""
    groups: dict[tuple[float, str, str], list] = {}
    for record in records:
        groups.setdefault((record.temperature, record.method, record.benchmark), []).append(record)
    rows = {key: _row(key, group) for key, group in groups.items()}
    for (temperature, method, benchmark), row in rows.items():
        for name, attr in (("vanilla", "sr"), ("hf", "sr_vs_hf")):
            base = rows.get((temperature, name, benchmark))
            if base is not None and base.tokens_per_second > 0:
                setattr(row, attr, row.tokens_per_second / base.tokens_per_second)
    ordered = sorted(rows.values(), key=lambda r: (r.temperature, methods.index(r.method) if r.method in methods
                                                   else len(methods), r.benchmark))
    return ordered + _averages(ordered, methods)


def _row(key: tuple[float, str, str], group: list) -> Row:
    temperature, method, benchmark = key
    row = Row(temperature, method, benchmark, num_prompts=len(group))
    row.new_tokens = sum(r.new_tokens for r in group)
    row.wall_seconds = sum(r.wall_seconds for r in group)
    row.tokens_per_second = row.new_tokens / row.wall_seconds if row.wall_seconds > 0 else 0.0
    forwards = sum(r.target_forwards for r in group)
    if forwards > 0:
        row.tau = row.new_tokens / forwards
    scored = [r.correct for r in group if r.correct is not None]
    if scored:
        row.accuracy = sum(scored) / len(scored)
    if temperature == 0 and forwards > 0 and method != "vanilla":
        row.lossless_mismatches = sum(r.mismatch is not None for r in group)
    row.accept_histogram = dict(sorted(Counter(n for r in group for n in r.accept_lengths).items()))
    return row


def _mean(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def _averages(rows: list[Row], methods: list[str]) -> list[Row]:
    out = []
    for temperature in sorted({r.temperature for r in rows}):
        for method in [m for m in methods if any(r.method == m and r.temperature == temperature for r in rows)]:
            group = [r for r in rows if r.method == method and r.temperature == temperature]
            row = Row(temperature, method, AVERAGE, num_prompts=sum(r.num_prompts for r in group))
            row.new_tokens = sum(r.new_tokens for r in group)
            row.wall_seconds = sum(r.wall_seconds for r in group)
            row.tokens_per_second = _mean([r.tokens_per_second for r in group]) or 0.0
            row.tau, row.sr, row.sr_vs_hf = (_mean([getattr(r, k) for r in group]) for k in ("tau", "sr", "sr_vs_hf"))
            row.accuracy = _mean([r.accuracy for r in group])
            counts = [r.lossless_mismatches for r in group if r.lossless_mismatches is not None]
            row.lossless_mismatches = sum(counts) if counts else None
            histogram: Counter = Counter()
            for r in group:
                histogram.update(r.accept_histogram)
            row.accept_histogram = dict(sorted(histogram.items()))
            out.append(row)
    return out


def _fmt(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def markdown_table(rows: list[Row], methods: list[str]) -> str:
    """The paper's layout: methods as rows, benchmarks x {SR, tau} as columns, one block per temperature."""
    benchmarks = [b for b in dict.fromkeys(r.benchmark for r in rows) if b != AVERAGE] + [AVERAGE]
    lines = []
    for temperature in sorted({r.temperature for r in rows}):
        cell = {(r.method, r.benchmark): r for r in rows if r.temperature == temperature}
        lines += [f"**Temperature = {temperature:g}**", "",
                  "| Method | " + " | ".join(f"{b} SR | {b} tau" for b in benchmarks) + " |",
                  "|---|" + "---|---|" * len(benchmarks)]
        for method in [m for m in methods if any(k[0] == m for k in cell)]:
            values = [(_fmt(cell[(method, b)].sr), _fmt(cell[(method, b)].tau)) if (method, b) in cell else ("-", "-")
                      for b in benchmarks]
            lines.append(f"| {method} | " + " | ".join(f"{sr} | {tau}" for sr, tau in values) + " |")
        lines.append("")
        lines += ["| Method | benchmark | tokens/s | SR vs HF | accuracy | T=0 mismatches |", "|---|---|---|---|---|---|"]
        for r in (r for r in rows if r.temperature == temperature):
            lines.append(f"| {r.method} | {r.benchmark} | {r.tokens_per_second:.1f} | {_fmt(r.sr_vs_hf)} | "
                         f"{_fmt(r.accuracy, 3)} | {'-' if r.lossless_mismatches is None else r.lossless_mismatches} |")
        lines.append("")
    lines.append("tau: new tokens per target forward, bonus token counted. SR: throughput ratio to mmvsd's own vanilla "
                 "loop on the same prompts (SR vs HF: to transformers generate). Average: mean over benchmarks.")
    return "\n".join(lines) + "\n"


def environment() -> dict:
    """Package versions and the machine, saved with every result."""
    from importlib.metadata import PackageNotFoundError, version

    import torch

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
    import os

    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def write_reports(out_dir: Path, config: dict, records: list, methods: list[str]) -> list[Row]:
    """results.json, results.csv, table.md, mismatches.json and the PNG plots in `out_dir`."""
    rows = aggregate(records, methods)
    mismatches = [{"benchmark": r.benchmark, "item_id": r.item_id, "method": r.method, **r.mismatch}
                  for r in records if r.mismatch is not None]
    (out_dir / "results.json").write_text(json.dumps(
        {"config": config, **environment(), "rows": [asdict(r) for r in rows], "mismatches": mismatches},
        indent=2) + "\n")
    with open(out_dir / "results.csv", "w", newline="") as handle:
        names = [k for k in asdict(rows[0]) if k != "accept_histogram"] if rows else []
        writer = csv.DictWriter(handle, fieldnames=names, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(asdict(r) for r in rows)
    (out_dir / "table.md").write_text(markdown_table(rows, methods))
    plot_results(rows, methods, out_dir)
    return rows


def plot_results(rows: list[Row], methods: list[str], out_dir: Path) -> None:
    """tau.png (per benchmark per method), sr.png (SR bars), acceptance.png (accept-length histograms)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

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
