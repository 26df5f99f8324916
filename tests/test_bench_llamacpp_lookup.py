"""benchmarks/bench_llamacpp_lookup.py: the rows' server arguments and their summary, without a server."""

import pytest

from conftest import load_benchmark_script
from mmvsd.engines.llamacpp_bench import EngineResult

lookup = load_benchmark_script("bench_llamacpp_lookup")


def test_lookup_goes_ahead_of_the_drafter():
    draft = ["-md", "d.gguf", "--spec-type", "draft-eagle3", "--spec-draft-n-max", "1"]
    assert lookup.with_lookup(draft, "3/8") == [
        "-md", "d.gguf", "--spec-type", "ngram-simple,draft-eagle3", "--spec-draft-n-max", "1",
        "--spec-ngram-simple-size-n", "3", "--spec-ngram-simple-size-m", "8"]
    assert draft[3] == "draft-eagle3"  # the row's own arguments are left alone
    for bad in ("3", "0/4", "a/b", "3/-1"):
        with pytest.raises(SystemExit, match="N/M"):
            lookup.with_lookup(draft, bad)


def test_summary_is_the_median_ratio_to_vanilla_per_domain():
    def record(tokens, seconds, drafted=0, accepted=0):
        return EngineResult([1, 2], list(range(tokens)), wall_seconds=seconds, finished=True, num_drafted=drafted,
                            num_draft_accepted=accepted)

    records = {"vanilla": [record(10, 1.0), record(10, 2.0), record(10, 1.0)],
               "chain": [record(10, 0.5, 8, 4), record(10, 4.0, 8, 2), record(9, 1.0, 4, 1)]}
    out = lookup.summarise(records, ["chat", "math", "chat"])
    assert out["chain"]["all"]["speedup"] == pytest.approx(0.9)  # median of 2.0, 0.5 and 0.9
    assert out["chain"]["chat"]["speedup"] == pytest.approx((2.0 + 0.9) / 2)
    assert out["chain"]["math"] == pytest.approx({"speedup": 0.5, "tokens_per_s": 2.5, "vanilla_tokens_per_s": 5.0,
                                                  "drafted": 8, "accepted": 2, "equal": 1, "prompts": 1})
    assert out["chain"]["all"]["equal"] == 2 and out["vanilla"]["all"]["speedup"] == 1.0
    assert set(lookup.summarise(records, [])["chain"]) == {"all"}  # a prompt file without domains: one scope
