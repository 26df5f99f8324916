"""The benchmarks' prompt sets, as a plugin (pyproject's `mmvsd.plugins`): importing it brings in the benchmark
registry, mmvsd/eval/suites.py, whose every benchmark is a prompt set too (`register_benchmark` registers it, a plugin's
included), so that `--prompt-file NAME` and `eval_prompts=NAME` read a benchmark's first turns, with its images."""

from __future__ import annotations

from mmvsd.eval import suites  # noqa: F401  registers the built-in benchmarks, each a prompt set
