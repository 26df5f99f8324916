"""Cost tables cached per key under the mmvsd cache: measured once per machine, target, dtype and drafter, and
spot-checked on their first use in a process (measured again if this host runs the same CPU at another speed).
The spot-check rules (`timings_drift`, once per process) also serve `--dtype auto`'s cached choice (`engine.py`)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import re
import sys
from pathlib import Path

from mmvsd.decoding.cost_measure import measure_costs, spot_check
from mmvsd.decoding.costs import CostTable
from mmvsd.decoding.fingerprints import cost_key
from mmvsd.files import atomic_file, cache_root
from mmvsd.target import Target

logger = logging.getLogger(__name__)

DRIFT_FACTOR = 1.5  # a cached table is measured again when a spot-checked step is this many times off
_CHECKED: set[Path] = set()  # cache files spot-checked (or written) by this process


def checked_in_this_process(path: Path) -> bool:
    """Whether the cache file `path` was spot-checked (or written) by this process already."""
    return path in _CHECKED


def mark_checked(path: Path) -> None:
    """Remember that this process spot-checked (or wrote) `path`: it is not checked again."""
    _CHECKED.add(path)


def profiles_dir() -> Path:
    """Where cost tables are cached."""
    return cache_root() / "profiles"


def key_digest(key: dict[str, str]) -> str:
    """A short hash of a whole cache key (the part of a cache file's name that tells keys apart)."""
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]


def cost_table_path(key: dict[str, str]) -> Path:
    """The cache file of a key: a readable prefix plus a hash of the whole key."""
    digest = key_digest(key)
    name, drafter = (re.sub(r"[^A-Za-z0-9._+-]+", "_", text)[-40:] for text in (Path(key["target"]).name,
                                                                              key["drafter"]))
    return profiles_dir() / f"{name}-{drafter}-{digest}.json"  # a draft model's path is no folder here


def _read_cached(path: Path, key: dict[str, str]) -> CostTable | None:
    """The cached table at `path` if it is whole and made for `key`; warns and returns None if corrupt."""
    if not path.is_file():
        return None
    try:
        table = CostTable.from_json(json.loads(path.read_text()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        logger.warning("mmvsd: cost profile %s is unreadable (%s: %s); measuring again", path,
                        type(err).__name__, err)
        return None
    if table.key != key:
        logger.warning("mmvsd: cost profile %s was measured for another machine, target or drafter; "
                        "measuring again", path)
        return None
    return table


def load_cost_table(
    target: Target,
    drafter=None,
    batch_sizes: tuple[int, ...] = (1,),
    *,
    refresh: bool = False,
    progress: bool = True,
    context: int = 256,
) -> CostTable:
    """The cost table of this machine for (target, drafter, batch sizes): cached, measured on first use, spot-checked
    on its first use in a process (`drift`) and measured again when it no longer fits."""
    batch_sizes = tuple(sorted(set(batch_sizes)))
    key = cost_key(target, drafter, batch_sizes, context)
    path = cost_table_path(key)
    table = None if refresh else _read_cached(path, key)
    if table is not None and not checked_in_this_process(path):  # once per process: decoding loads it every call
        why = drift(table, spot_check(target, drafter, table))
        if why is not None:
            logger.warning("mmvsd: cost profile %s no longer fits this machine (%s); measuring again", path, why)
            table = None
    if table is not None:
        mark_checked(path)
        return table
    if progress:
        print(f"mmvsd: measuring the costs of {target.name} on this machine (cached in {path})", file=sys.stderr,
              flush=True)
    table = measure_costs(target, drafter, batch_sizes, context=context, progress=progress)
    table = dataclasses.replace(table, spot_seconds=spot_check(target, drafter, table))  # what later checks expect
    with atomic_file(path) as handle:
        json.dump(table.to_json(), handle, indent=1)
    mark_checked(path)
    return table


def drift(table: CostTable, seconds_now: dict[int, float]) -> str | None:
    """Why `table` no longer describes this machine, or None (`timings_drift`): verify steps timed now (tokens ->
    seconds, at the table's smallest batch) against its reference (`spot_seconds`, timed the same way when the
    table was measured; the table's own value for a table without)."""
    batch = min(table.target_seconds)
    then = {n: table.spot_seconds.get(n, table.target_step(n, batch)) for n in seconds_now}
    return timings_drift(seconds_now, then)


def timings_drift(seconds_now: dict[int, float], seconds_then: dict[int, float], step: str = "a verify step",
                  when: str = "profiled") -> str | None:
    """Why timings stored `then` (tokens -> seconds) no longer describe this machine, or None: every step timed now
    more than DRIFT_FACTOR times slower, or every one faster, than then. One step off alone is noise; a host of
    another speed, or a machine loaded since, moves them all."""
    if not seconds_now:
        return None
    pairs = [(n, now, seconds_then[n]) for n, now in sorted(seconds_now.items())]
    slower = all(now > then * DRIFT_FACTOR for _, now, then in pairs)
    if not slower and not all(now * DRIFT_FACTOR < then for _, now, then in pairs):
        return None
    return "; ".join(f"{step} over {n} token{'s' * (n != 1)} takes {now * 1e3:.1f} ms now, {then * 1e3:.1f} ms "
                     f"when {when}" for n, now, then in pairs)
