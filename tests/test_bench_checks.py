"""What makes bench numbers trustworthy: every method checked against vanilla at T=0 (a planted
mismatch in a baseline is flagged and its ratio is not a speed-up), batched throughput arithmetic,
one tau, and lmms-eval scoring with the task's filters and dict-valued metrics."""

from __future__ import annotations

from dataclasses import replace

import pytest

from conftest import save_tiny_target
from mmvsd.decoding.decode import DecodeConfig, SequenceResult, vanilla_generate
from mmvsd.decoding.tree import TreeShape
from mmvsd.errors import UserError
from mmvsd.eval import mllm_suite
from mmvsd.eval.baselines import hf_generate
from mmvsd.eval.bench import Method, Record, TreeGenerate, build_methods, drafter_label, kept_lengths, run_batch
from mmvsd.eval.bench_config import BenchConfig
from mmvsd.eval.report import aggregate, markdown_table
from mmvsd.eval.suites import load_items
from mmvsd.target_loader import load_target
from mmvsd.tree_options import tree_shape


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = save_tiny_target(tmp_path_factory.mktemp("tiny"))
    return folder, load_target(str(folder))


def test_a_planted_mismatch_in_an_hf_baseline_is_flagged_and_not_a_speed_up(tiny):
    folder, target = tiny
    config = BenchConfig(target=str(folder), methods=["vanilla", "hf"], max_new_tokens=8)
    vanilla, hf = build_methods(config, target)

    def wrong_hf(prompts, decode):  # what prompt lookup did on image prompts: a different answer
        results = [hf_generate(target, ids, decode) for ids in prompts]
        results[0].output_ids[2] = (results[0].output_ids[2] + 1) % 100
        return results

    items = load_items("gsm8k", 2)
    records = run_batch(target, [vanilla, hf, Method("pld", wrong_hf, False, True)], items, 0.0, config)
    by_method = {m: [r for r in records if r.method == m] for m in ("hf", "pld")}
    assert [r.mismatch for r in by_method["hf"]] == [None, None]  # HF generate is checked too, and agrees
    assert by_method["pld"][0].mismatch["position"] == 2 and by_method["pld"][1].mismatch is None
    rows = {(r.method, r.benchmark): r for r in aggregate(records, ["vanilla", "hf", "pld"])}
    flagged = rows[("pld", "gsm8k")]
    assert flagged.lossless_mismatches == 1 and flagged.sr is None and flagged.unverified_sr > 0
    assert rows[("hf", "gsm8k")].sr_vs_pld is None  # a flagged method is no reference either
    assert rows[("pld", "average")].sr is None
    table = markdown_table(list(rows.values()), ["vanilla", "hf", "pld"])
    assert "≠ (" in table and "not lossless here" in table


def record(method: str, batch: str, tokens: int, row_wall: float, batch_wall: float, batch_size: int = 2, **kw):
    return Record("gsm8k", f"{batch}-{method}-{tokens}", method, 0.0, new_tokens=tokens, wall_seconds=row_wall,
                  batch_id=batch, batch_wall_seconds=batch_wall, batch_size=batch_size, **kw)


def test_batched_throughput_is_total_tokens_over_total_batch_wall_time():
    records = [  # two batches of two rows; a row's own time runs from its batch's start
        record("vanilla", "b0", 10, 1.0, 2.0), record("vanilla", "b0", 30, 2.0, 2.0),
        record("vanilla", "b1", 20, 3.0, 3.0), record("vanilla", "b1", 20, 2.5, 3.0),
        record("tree:x", "b0", 10, 0.5, 1.0, target_forwards=5, accept_lengths=[2] * 5),
        record("tree:x", "b0", 30, 1.0, 1.0, target_forwards=10, accept_lengths=[3] * 10),
        record("tree:x", "b1", 20, 1.5, 1.5, target_forwards=10, accept_lengths=[2] * 10),
        record("tree:x", "b1", 20, 1.0, 1.5, target_forwards=5, accept_lengths=[4] * 5),
    ]
    rows = {r.method: r for r in aggregate(records, ["vanilla", "tree:x"]) if r.benchmark == "gsm8k"}
    assert rows["vanilla"].wall_seconds == pytest.approx(5.0)  # 2 + 3, not the 8.5 of summed rows
    assert rows["vanilla"].tokens_per_second == pytest.approx(80 / 5.0)
    assert rows["tree:x"].tokens_per_second == pytest.approx(80 / 2.5)
    assert rows["tree:x"].sr == pytest.approx((80 / 2.5) / (80 / 5.0))
    assert rows["tree:x"].tau == pytest.approx(80 / 30)  # kept tokens / target forwards
    histogram = rows["tree:x"].accept_histogram
    assert sum(n * k for n, k in histogram.items()) / sum(histogram.values()) == pytest.approx(rows["tree:x"].tau)


def test_hf_rows_at_batch_one_are_compared_with_vanilla_at_batch_one(tiny):
    folder, target = tiny
    methods = build_methods(BenchConfig(target=str(folder), methods=["vanilla", "hf", "tree"], batch_size=2), target)
    assert [m.name for m in methods] == ["vanilla", "hf", "tree:random", "vanilla@b1"]
    assert [m.batch_one for m in methods] == [False, True, False, True]
    records = [record("vanilla", "b0", 40, 1, 1.0), record("vanilla@b1", "b0", 40, 1, 4.0, batch_size=1),
               record("hf", "b0", 40, 1, 5.0, batch_size=1)]
    hf = next(r for r in aggregate(records, ["vanilla", "hf", "vanilla@b1"]) if r.method == "hf")
    assert hf.sr == pytest.approx(4.0 / 5.0)  # vs vanilla@b1, not vs the batch-2 vanilla


def test_one_tau_kept_tokens_per_target_forward():
    result = SequenceResult([1], output_ids=[5, 6, 7, 8, 9], num_target_forwards=3, accept_lengths=[1, 3, 4])
    kept = kept_lengths(result.accept_lengths, len(result.output_ids))  # the last step was cut at max length
    assert kept == [1, 3, 1] and sum(kept) / len(kept) == pytest.approx(result.tau)
    assert kept_lengths(kept, 5) == kept  # a decoder that already clips is left alone


def test_row_labels_name_the_drafter_spec(tmp_path):
    (tmp_path / "my-drafter").mkdir()
    assert drafter_label("random") == "tree:random"
    assert drafter_label("default") == "tree:default"
    assert drafter_label(str(tmp_path / "my-drafter")) == "tree:my-drafter"


class TakeFirst:
    def apply(self, resps, docs):
        return (r[0] for r in resps)


class LetterFilter:  # lmms-eval's MultiChoiceRegexFilter in miniature: a generator of filtered lists
    def apply(self, resps, docs):
        import re

        return ([(re.findall(r"([A-D])\.", r[0]) or [r[0]])[0]] for r in resps)


class FakeTask:
    """A real-task-shaped lmms-eval task: filter ensembles and process_results over filtered answers."""

    def __init__(self, filters, process):
        self._filters = [type("Ensemble", (), {"name": "f", "filters": filters})()]
        self.process = process
        self.seen = []

    def process_results(self, doc, results):
        self.seen.append(results)
        return self.process(doc, results)


@pytest.fixture
def fake_task(monkeypatch):
    def install(task, docs):
        monkeypatch.setattr(mllm_suite, "load_task", lambda name: task)
        monkeypatch.setattr(mllm_suite, "task_docs", lambda name: docs)
        return task
    return install


def test_real_task_scoring_applies_the_filters_first(fake_task):
    def exact(doc, results):
        answer = results[0][0] if isinstance(results[0], list) else results[0]
        return {"exact_match": float(answer == doc["answer"])}

    task = fake_task(FakeTask([LetterFilter(), TakeFirst()], exact), [{"answer": "B"}])
    assert mllm_suite.task_score("ai2d", "The diagram shows B. because the arrow points there", {"doc_index": 0}) == 1.0
    assert task.seen == [["B"]]  # process_results saw the extracted letter, not the raw answer
    assert mllm_suite.task_score("ai2d", "C. is right", {"doc_index": 0}) == 0.0


def test_dict_metrics_are_aggregate_only_and_unknown_shapes_are_errors(fake_task):
    record = lambda doc, results: {k: {**doc, "model_prediction": results[0]} for k in ("aAcc", "qAcc", "fAcc")}
    fake_task(FakeTask([TakeFirst()], record), [{"question": "q", "gt_answer": "1"}])
    assert mllm_suite.task_score("hallusion_bench_image", "yes", {"doc_index": 0}) is None  # never a silent 0.0
    fake_task(FakeTask([TakeFirst()], lambda d, r: {"acc": {"score": 1, "id": 3}}), [{}])
    assert mllm_suite.task_score("x", "yes", {"doc_index": 0}) == 1.0
    fake_task(FakeTask([TakeFirst()], lambda d, r: {"acc": ["1"]}), [{}])
    with pytest.raises(UserError, match="returned metric 'acc' as list"):
        mllm_suite.task_score("x", "yes", {"doc_index": 0})


def test_mixed_synthetic_and_real_average_is_labelled():
    records = [record("vanilla", "a", 10, 1, 1.0, synthetic=True), replace(record("vanilla", "b", 10, 1, 1.0),
                                                                            benchmark="mt_bench")]
    rows = aggregate(records, ["vanilla"])
    average = next(r for r in rows if r.benchmark == "average")
    assert average.mixes_synthetic
    table = markdown_table(rows, ["vanilla"])
    assert "gsm8k (synthetic)" in table and "average (mixes synthetic and real)" in table


def test_one_tree_row_per_drafter_and_shape(tiny):
    folder, target = tiny
    config = BenchConfig(target=str(folder), methods=["vanilla", "tree"], trees=["auto", "paper", "12/3/0"])
    methods = build_methods(config, target)
    assert [m.name for m in methods] == ["vanilla", "tree:random@auto", "tree:random@paper", "tree:random@12/3/0"]
    assert tree_shape("auto", False) == "auto"
    assert tree_shape("paper", False) == TreeShape(60, 7, 10) and tree_shape("paper", True) == TreeShape(60, 5, 8)
    assert tree_shape("12/3/0", True) == TreeShape(12, 3, 8)  # a 0 part takes the paper's value
    only = build_methods(BenchConfig(target=str(folder), methods=["vanilla", "tree"]), target)
    assert [m.name for m in only] == ["vanilla", "tree:random"] and only[1].tree == "auto"  # the default


@pytest.mark.parametrize("trees", [["60/7"], ["big"], ["auto", "auto"], ["-1/2/3"], []])
def test_malformed_tree_lists_are_refused(trees):
    with pytest.raises(UserError, match="--tree"):
        BenchConfig(trees=trees).validate()


def test_auto_rows_learn_acceptance_across_prompts_and_stay_lossless(tiny, fitted_drafter):
    _, target = tiny
    generate = TreeGenerate(target, fitted_drafter)
    prompts = [[1, 5, 9, 4], [2, 7, 7, 3, 8]]
    config = DecodeConfig(12, tree="auto")
    for prompt in prompts:
        [result] = generate([prompt], config)
        assert result.output_ids == vanilla_generate(target, [prompt], config)[0].output_ids
    assert list(generate.stats) == [0.0] and generate.stats[0.0].rank_tried.sum() > 0  # learnt, kept across calls
