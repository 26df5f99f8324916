"""The hardware cost model: the cost table (seconds of a verify step and of drafting) and how it reads.

Whether a draft tree pays depends on the machine: on a GPU verifying 60 tokens costs about one step, on a
2-core CPU 3-4 steps. `mmvsd.decoding.cost_measure` measures a table, `mmvsd.decoding.cost_cache` keeps one
per (machine, target, dtype, drafter architecture, batch sizes: `mmvsd.decoding.fingerprints`). The shape
policy reads the `CostTable`; nothing here decides shapes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

METHOD_VERSION = "1"  # bump when the measurement changes meaning: older cache files are then ignored


@dataclass(frozen=True)
class CostTable:
    """Typical (lower-quartile) seconds of a verify step and of drafting, by shape and batch, on one machine."""

    key: dict[str, str]  # machine / target / dtype / drafter fields it was measured for
    target_tokens: tuple[int, ...]  # verified-token counts measured
    target_seconds: dict[int, tuple[float, ...]]  # batch -> seconds of Target.forward (+ keep) per count
    draft_widths: tuple[int, ...]  # frontier widths measured (empty without drafter)
    draft_seconds: dict[int, tuple[float, ...]]  # batch -> seconds of one expand(...) call per width
    draft_fixed_seconds: dict[int, float]  # batch -> per-step advance + root_candidates (0 without drafter)
    context: int  # cache length the measurements used
    spot_seconds: dict[int, float] = field(default_factory=dict)  # tokens -> `spot_check` right after measuring

    def target_step(self, num_nodes: int, batch: int = 1) -> float:
        """Seconds of one verify step over `num_nodes` tree tokens (piecewise linear in both)."""
        return _interp_batch({b: _interp(self.target_tokens, s, num_nodes) for b, s in self.target_seconds.items()},
                             batch)

    def draft_expand(self, width: int, batch: int = 1) -> float:
        """Seconds of one drafter expansion of a frontier of `width` nodes (0 without drafter)."""
        if not self.draft_widths:
            return 0.0
        return _interp_batch({b: _interp(self.draft_widths, s, width) for b, s in self.draft_seconds.items()}, batch)

    def draft_fixed(self, batch: int = 1) -> float:
        """Seconds per step the drafter costs whatever the shape (feeding accepted pairs, root top-k)."""
        return _interp_batch(self.draft_fixed_seconds, batch)

    def to_json(self) -> dict:
        return {
            "method": METHOD_VERSION, "key": self.key, "context": self.context,
            "target_tokens": list(self.target_tokens),
            "target_seconds": {str(b): list(s) for b, s in self.target_seconds.items()},
            "draft_widths": list(self.draft_widths),
            "draft_seconds": {str(b): list(s) for b, s in self.draft_seconds.items()},
            "draft_fixed_seconds": {str(b): s for b, s in self.draft_fixed_seconds.items()},
            "spot_seconds": {str(n): s for n, s in self.spot_seconds.items()},
        }

    @classmethod
    def from_json(cls, data: dict) -> CostTable:
        """Parse and check a cached table (ValueError/KeyError/TypeError on anything malformed)."""
        tokens = tuple(int(n) for n in data["target_tokens"])
        widths = tuple(int(w) for w in data["draft_widths"])
        table = cls(
            key={str(k): str(v) for k, v in data["key"].items()},
            target_tokens=tokens,
            target_seconds={int(b): tuple(float(x) for x in s) for b, s in data["target_seconds"].items()},
            draft_widths=widths,
            draft_seconds={int(b): tuple(float(x) for x in s) for b, s in data["draft_seconds"].items()},
            draft_fixed_seconds={int(b): float(s) for b, s in data["draft_fixed_seconds"].items()},
            context=int(data["context"]),
            spot_seconds={int(n): float(s) for n, s in data.get("spot_seconds", {}).items()},  # none before 11-27
        )
        check_table(table)
        return table


def check_table(table: CostTable) -> None:
    """ValueError unless every curve has one finite, non-negative value per measured point."""
    if not table.target_tokens or list(table.target_tokens) != sorted(set(table.target_tokens)):
        raise ValueError("target_tokens must be increasing and non-empty")
    if list(table.draft_widths) != sorted(set(table.draft_widths)):
        raise ValueError("draft_widths must be increasing")
    if not table.target_seconds or set(table.draft_fixed_seconds) != set(table.target_seconds):
        raise ValueError("batch sizes differ between the target and drafter entries")
    curves = [(table.target_tokens, s) for s in table.target_seconds.values()]
    curves += [(table.draft_widths, s) for s in table.draft_seconds.values()]
    values = [v for _, s in curves for v in s] + list(table.draft_fixed_seconds.values())
    values += list(table.spot_seconds.values())
    if any(len(xs) != len(s) for xs, s in curves) or not all(0 <= v < float("inf") for v in values):
        raise ValueError("a curve has the wrong length or a negative / non-finite value")


def _interp(xs: tuple[int, ...], ys: tuple[float, ...], x: float) -> float:
    """Piecewise-linear y(x) through (xs, ys), extrapolated linearly past both ends, never below 0."""
    if len(xs) == 1:
        return ys[0] * x / xs[0]  # one point: proportional
    right = next((i for i in range(1, len(xs)) if x <= xs[i]), len(xs) - 1)
    x0, x1, y0, y1 = xs[right - 1], xs[right], ys[right - 1], ys[right]
    return max(0.0, y0 + (y1 - y0) * (x - x0) / (x1 - x0))


def _interp_batch(value_by_batch: dict[int, float], batch: int) -> float:
    """A value at `batch` from the measured batch sizes: exact, else linear (nearest with one measured)."""
    if batch in value_by_batch:
        return value_by_batch[batch]
    sizes = tuple(sorted(value_by_batch))
    if len(sizes) == 1:
        return value_by_batch[sizes[0]]
    return _interp(sizes, tuple(value_by_batch[b] for b in sizes), batch)


def format_cost_table(table: CostTable) -> str:
    """The table as text: milliseconds per shape and batch size, and the ratio to a 1-token verify step."""
    key, batches = table.key, sorted(table.target_seconds)
    one = {b: table.target_step(1, b) or float("nan") for b in batches}
    engine = f", {key['engine']} engine" if key.get("engine", "stock") != "stock" else ""
    lines = [(f"costs of {key['target']} ({key['dtype']}{engine}) with drafter {key['drafter']} on {key['cpu']} "
              f"[{key['device']}, {key['threads']} threads, torch {key['torch']}], cache of {table.context} tokens"),
             "verify step (Target.forward over N tree tokens + keep):",
             "  N     " + "".join(f"{f'B={b} ms':>10}{'x N=1':>7}" for b in batches)]
    for i, n in enumerate(table.target_tokens):
        cells = "".join(f"{table.target_seconds[b][i] * 1e3:10.2f}{table.target_seconds[b][i] / one[b]:7.2f}"
                        for b in batches)
        lines.append(f"  {n:<6}{cells}")
    if table.draft_widths:
        lines += ["drafter expand (one depth of a frontier of W nodes); ratio to the 1-token verify step:",
                  "  W     " + "".join(f"{f'B={b} ms':>10}{'x N=1':>7}" for b in batches)]
        for i, w in enumerate(table.draft_widths):
            cells = "".join(f"{table.draft_seconds[b][i] * 1e3:10.2f}{table.draft_seconds[b][i] / one[b]:7.2f}"
                            for b in batches)
            lines.append(f"  {w:<6}{cells}")
        lines.append("drafter fixed per step (advance + root top-k): "
                     + ", ".join(f"B={b} {table.draft_fixed(b) * 1e3:.2f} ms" for b in batches))
    return "\n".join(lines)
