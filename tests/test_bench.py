"""`mmvsd bench` on tiny targets: every text benchmark with --limit 2, result files that hold the
numbers the table shows, the on-the-fly lossless check (a planted mismatch is flagged with its
margin), resume, bad input, and the cheap accuracy checks."""

from __future__ import annotations

import csv
import json
from dataclasses import replace
from pathlib import Path

import pytest

from conftest import save_tiny_target
from mmvsd.cli import main
from mmvsd.decoding.decode import vanilla_generate
from mmvsd.eval.bench import Method, build_methods, run_batch
from mmvsd.eval.bench_config import BenchConfig
from mmvsd.eval.scoring import gsm8k_correct, humaneval_passed
from mmvsd.eval.suites import load_items, resolve_suite
from mmvsd.target_loader import load_target


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return save_tiny_target(tmp_path_factory.mktemp("tiny-target"))


@pytest.fixture(scope="module")
def fitted_dir(tiny_dir, tmp_path_factory, fitted_drafter) -> Path:
    """The session's EAGLE-3 drafter fitted to the tiny target (same weights as tiny_dir's model)."""
    folder = tmp_path_factory.mktemp("fitted") / "fitted"
    fitted_drafter.save_pretrained(folder)
    return folder


def bench(args: list[str]) -> int:
    return main(["bench", "--no-progress", "--max-new-tokens", "8", *args])


@pytest.fixture(scope="module")
def text_run(tiny_dir, fitted_dir, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("bench") / "text"
    code = bench(["--suite", "text", "--limit", "2", "--target", str(tiny_dir), "--drafter", f"random,{fitted_dir}",
                  "--methods", "vanilla,hf,pld,tree", "--temperature", "0,1", "--batch-size", "2", "--out", str(out)])
    assert code == 0
    return out


def test_text_suite_writes_table_json_csv_records_and_plots(text_run):
    results = json.loads((text_run / "results.json").read_text())
    assert results["config"]["suite"] == "text" and results["versions"]["torch"] and results["machine"]["cpu_count"]
    assert results["config"]["target_device"] == "cpu" and results["config"]["target_dtype"] == "float32"
    rows = results["rows"]
    methods = {"vanilla", "vanilla@b1", "hf", "pld", "tree:random", "tree:fitted"}
    assert {r["method"] for r in rows} == methods
    assert {r["benchmark"] for r in rows} == {"mt_bench", "humaneval", "gsm8k", "average"}
    assert {r["temperature"] for r in rows} == {0.0, 1.0}
    records = [json.loads(line) for line in (text_run / "records.jsonl").read_text().splitlines()]
    assert len(records) == 2 * 3 * 2 * len(methods)  # temperatures x benchmarks x items x methods
    assert all(len(r["output_ids"]) == 2 for r in records if r["benchmark"] == "mt_bench")  # both turns
    zero = [r for r in rows if r["temperature"] == 0.0]
    assert all(r["lossless_mismatches"] == 0 for r in zero if r["method"] != "vanilla")  # every method checked
    vanilla = next(r for r in zero if r["method"] == "vanilla" and r["benchmark"] == "gsm8k")
    assert vanilla["sr"] == pytest.approx(1.0) and vanilla["tau"] == pytest.approx(1.0)
    assert vanilla["batch_size"] == 2 and next(r for r in zero if r["method"] == "hf")["batch_size"] == 1
    assert all(r["tau"] is None for r in rows if r["method"] in ("hf", "pld"))
    assert all(r["sr"] is not None for r in zero if r["method"] == "hf")  # vs vanilla@b1, same batch size
    assert all(r["sr_vs_hf"] is None for r in zero if r["method"] == "tree:fitted")  # batch 2 vs batch 1: no ratio
    table = (text_run / "table.md").read_text()
    for row in (r for r in zero if r["benchmark"] != "average" and r["method"] == "tree:fitted"):
        assert f"{row['sr']:.2f} | {row['tau']:.2f}" in table  # the table shows the JSON's numbers
    with open(text_run / "results.csv") as handle:
        assert len(list(csv.DictReader(handle))) == len(rows)
    for name in ("tau_t0.png", "sr_t0.png", "acceptance_t0.png", "tau_t1.png"):
        assert (text_run / name).stat().st_size > 1000


def test_planted_mismatch_is_flagged_with_the_target_margin(tiny_dir):
    target = load_target(str(tiny_dir))
    config = BenchConfig(target=str(tiny_dir), methods=["vanilla", "tree"], max_new_tokens=8)
    vanilla = build_methods(replace(config, methods=["vanilla"]), target)[0]

    def corrupt(prompts, decode):
        results = vanilla_generate(target, prompts, decode)
        results[0].output_ids[3] = (results[0].output_ids[3] + 1) % 100
        return results

    items = load_items("gsm8k", 1)
    records = run_batch(target, [vanilla, Method("tree:broken", corrupt, True)], items, 0.0, config)
    broken = next(r for r in records if r.method == "tree:broken")
    assert broken.batch_wall_seconds > 0 and broken.batch_id
    assert broken.mismatch["position"] == 3 and broken.mismatch["turn"] == 0
    assert isinstance(broken.mismatch["logit_margin"], float) and broken.mismatch["logit_margin"] >= 0
    assert next(r for r in records if r.method == "vanilla").mismatch is None


def test_assisted_generation_with_a_same_tokenizer_model(tiny_dir, tmp_path):
    out = tmp_path / "assisted"
    assert bench(["--suite", "gsm8k", "--limit", "1", "--target", str(tiny_dir), "--methods", "vanilla,assisted",
                  "--assistant", str(tiny_dir), "--out", str(out)]) == 0
    records = {r["method"]: r for r in map(json.loads, (out / "records.jsonl").read_text().splitlines())}
    assert records["assisted"]["output_ids"] == records["vanilla"]["output_ids"]  # greedy assisted is lossless


def test_resume_continues_and_a_fresh_run_refuses_an_old_folder(tiny_dir, tmp_path, capsys):
    common = ["--suite", "gsm8k", "--target", str(tiny_dir), "--methods", "vanilla,tree", "--out", str(tmp_path / "r")]
    assert bench([*common, "--limit", "1"]) == 0
    assert bench([*common, "--limit", "2"]) == 2
    assert "--resume" in capsys.readouterr().err
    assert bench([*common, "--limit", "2", "--resume"]) == 0
    records = [json.loads(line) for line in (tmp_path / "r" / "records.jsonl").read_text().splitlines()]
    assert sorted((r["item_id"], r["method"]) for r in records) == [("0", "tree:random"), ("0", "vanilla"),
                                                                    ("1", "tree:random"), ("1", "vanilla")]
    assert bench([*common, "--limit", "2", "--resume", "--max-new-tokens", "4"]) == 2  # other settings


@pytest.mark.parametrize(("args", "message"), [
    (["--suite", "mmlu"], ("unknown suite or benchmark 'mmlu'; valid: text, mllm, mt_bench, humaneval, gsm8k, "
                           "vqav2_val, ai2d")),
    (["--methods", "vanilla,medusa"], "unknown method(s) medusa"),
    (["--methods", "tree"], "must include vanilla"),
    (["--methods", "vanilla,assisted"], "needs --assistant"),
])
def test_bad_bench_input_is_one_clear_error(tiny_dir, tmp_path, capsys, args, message):
    assert bench(["--target", str(tiny_dir), "--out", str(tmp_path / "x"), *args]) == 2
    assert message in capsys.readouterr().err


def test_drafter_for_another_target_is_refused(fitted_dir, tmp_path, capsys):
    other = save_tiny_target(tmp_path / "other", vocab=96)
    assert bench(["--suite", "gsm8k", "--limit", "1", "--target", str(other), "--drafter", str(fitted_dir),
                  "--out", str(tmp_path / "x")]) == 2
    assert "drafter does not fit target" in capsys.readouterr().err


def test_suites_resolve_and_load_offline():
    assert resolve_suite("text") == ["mt_bench", "humaneval", "gsm8k"]
    assert resolve_suite("gsm8k,mt_bench,gsm8k") == ["gsm8k", "mt_bench"]
    assert [len(load_items(b)) for b in ("mt_bench", "humaneval", "gsm8k")] == [80, 164, 1319]
    assert all(len(item.turns) == 2 for item in load_items("mt_bench"))


def test_accuracy_checks():
    item = load_items("gsm8k", 1)[0]
    assert gsm8k_correct("She makes 9 + 9 = 18 dollars, so the answer is $18.", item.reference)
    assert not gsm8k_correct("The answer is 17.", item.reference)
    problem = load_items("humaneval", 1)[0].reference
    assert humaneval_passed(problem["canonical_solution"], problem)
    assert humaneval_passed(f"```python\n{problem['prompt']}{problem['canonical_solution']}```", problem)
    assert not humaneval_passed("    return None\n", problem)
    assert not humaneval_passed("    while True:\n        pass\n", problem, timeout=1.0)


def test_mllm_suite_runs_the_offline_tasks_through_lmms_eval(llava_dir, tmp_path):
    out = tmp_path / "mllm"
    code = bench(["--suite", "mllm", "--limit", "2", "--target", str(llava_dir), "--methods", "vanilla,hf,pld,tree",
                  "--max-new-tokens", "6", "--out", str(out)])
    assert code == 0
    rows = json.loads((out / "results.json").read_text())["rows"]
    tasks = {r["benchmark"] for r in rows} - {"average"}
    assert tasks == {f"{name}_mini_long" for name in ("vqav2_val", "ai2d", "chartqa", "textvqa_val", "scienceqa_img",
                                                      "hallusion_bench_image")}  # no real dataset here
    assert all(r["lossless_mismatches"] == 0
               for r in rows if r["method"] == "tree:random" and r["benchmark"] != "average")
    assert all(r["synthetic"] for r in rows)
    assert "(synthetic)" in (out / "table.md").read_text()
    assert all(r["accuracy"] is not None for r in rows if r["method"] != "pld")  # lmms-eval's process_results
    pld = [r for r in rows if r["method"] == "pld"]
    assert pld and all(r["refused"] and r["sr"] is None for r in pld)  # no silent number without the image
    assert all(r["lossless_mismatches"] == 0 for r in rows if r["method"] == "hf" and r["benchmark"] != "average")
    assert len(list((out / "images").glob("*.png"))) == 12  # the images the adapter read, kept with the results


def test_a_real_task_without_its_dataset_is_a_clear_error(tmp_path, capsys):
    assert bench(["--suite", "chartqa", "--out", str(tmp_path / "x")]) == 2
    assert "use the offline chartqa_mini" in capsys.readouterr().err
