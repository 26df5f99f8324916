"""studies/mmvsd_studies/vsd_control.py: the metrics against direct computations, the bootstrap summary, and the whole
pipeline (target, mmvsd's trainer for three arms, evaluation, resumption) at toy sizes (its language and target:
test_control_world.py)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import make_tiny_llama
from mmvsd.decoding.decode import as_prompts
from mmvsd.decoding.draft_session import DraftInputs
from mmvsd.drafters.eagle3 import Eagle3Drafter
from mmvsd.eval.acceptance import chain_steps
from mmvsd.target import Target
from mmvsd.training.features import TokenBatch, capture_features
from mmvsd_studies import vsd_control


@pytest.fixture(scope="module")
def control():
    return vsd_control


TOY = ["num_tokens=8", "target_hidden=32", "target_intermediate=64", "target_layers=2", "target_heads=2",
       "target_steps=40", "target_batch=8", "target_lr=0.01", "prompt_min=4", "prompt_max=6", "answer_tokens=12",
       "num_train_conversations=6", "arm_steps=2", "arm_batch=2", "arm_lr=0.01", "depth=3", "num_samples=4",
       "num_anchors=2", "drafter_intermediate=8", "drafter_head_dim=8", "tree='8/3/2'", "num_eval_prompts=4",
       "bootstrap=200"]


class _TargetOracle(Eagle3Drafter):
    """A 'drafter equal to the target': it reads the target's final hidden state one position ahead at every
    unrolled step, so its step i at anchor t predicts exactly the target's distribution of token t+2+i."""

    def target_features(self, aux_hidden, last_hidden):
        return last_hidden

    def read_target(self, features, token_ids, positions, attention_mask, cache, media=None):
        return torch.cat([features[:, 1:], features[:, -1:]], dim=1)

    def read_draft(self, hidden, token_ids, positions, attention_mask, cache):
        return torch.cat([hidden[:, 1:], hidden[:, -1:]], dim=1)

    def draft_logprobs(self, hidden):
        return torch.log_softmax(self.oracle_target.logits(hidden).float(), -1)


@pytest.fixture(scope="module")
def tiny():
    return Target(make_tiny_llama(seed=5), None, "tiny")


def _random_sequences(num: int, vocab: int = 128, seed: int = 0) -> tuple[list[list[int]], list[list[int]]]:
    gen = torch.Generator().manual_seed(seed)
    prompt_lens, cont_lens = torch.randint(3, 7, (num,), generator=gen), torch.randint(6, 11, (num,), generator=gen)
    prompts = [torch.randint(0, vocab, (int(n),), generator=gen).tolist() for n in prompt_lens]
    conts = [torch.randint(0, vocab, (int(n),), generator=gen).tolist() for n in cont_lens]
    return prompts, conts


def test_a_drafter_equal_to_the_target_accepts_the_whole_chain(control, tiny):
    oracle = _TargetOracle.from_target(tiny, draft_vocab_size=None)
    oracle.oracle_target = tiny
    prompts, conts = _random_sequences(3)
    for row, cont in zip(control.chain_acceptance(tiny, oracle, prompts, conts, depth=3, batch_size=2), conts):
        # every anchor whose next-but-one token is in the continuation; a chain accepts up to its end, at most 3
        assert row["roots"] == len(cont) - 1
        assert row["sum"] == pytest.approx(sum(min(3, j) for j in range(1, len(cont))), rel=1e-5)
        assert row["step_rates"] == pytest.approx([1.0, 1.0, 1.0], rel=1e-5)
    random_drafter = Eagle3Drafter.from_target(tiny, draft_vocab_size=None, seed=1).eval()
    rows = control.chain_acceptance(tiny, random_drafter, prompts, conts, depth=3)
    assert all(0 < r["sum"] < 3.0 * r["roots"] for r in rows) and all(max(r["step_rates"]) < 0.9 for r in rows)


def test_acceptance_equals_a_decoding_session_forced_along_the_continuation(control, tiny):
    """a_i at each anchor and the expected accepted length against the decoding-time drafter session (root
    candidates, then `expand` fed the continuation's tokens) and the target's own forward over each prefix."""
    drafter = Eagle3Drafter.from_target(tiny, draft_vocab_size=None, seed=2).eval()
    prompt, cont = [5, 9, 17, 3], [40, 41, 7, 99, 12, 64, 8, 8]
    depth, seq = 3, torch.tensor([[5, 9, 17, 3, 40, 41, 7, 99, 12, 64, 8, 8]])
    steps = chain_steps(tiny, drafter, as_prompts([prompt]), [cont], depth)
    features = drafter.target_features(*_aux_and_last(tiny, seq))
    unbiased, forced = 0.0, 0.0
    with torch.no_grad():
        for anchor in range(len(prompt) - 1, seq.shape[1] - 2):  # token anchor + 2 in the continuation, not its first
            chain = _session_chain(tiny, drafter, seq, features, anchor, depth, steps)
            unbiased, forced = unbiased + chain[0], forced + chain[1]
    assert steps.masks.sum(1)[0].tolist() == [7, 6, 5]  # anchors 3..9, each step one fewer inside the continuation
    [row] = control.chain_acceptance(tiny, drafter, [prompt], [cont], depth)
    assert row["roots"] == 7 and row["sum"] == pytest.approx(unbiased, abs=1e-4)
    assert row["forced"] == pytest.approx(forced, abs=1e-4)


def _session_chain(tiny, drafter, seq, features, anchor, depth, steps) -> tuple[float, float]:
    """(sum_k r_1 .. r_{k-1} a_k, sum_k a_1 .. a_k) at `anchor` from a decoding session forced along `seq`, checking
    each step's rate and ratio against `steps`."""
    session = drafter.new_session(1)
    session.advance(DraftInputs(features[:, : anchor + 1], seq[:, 1 : anchor + 2], torch.tensor([anchor + 1])))
    ids, values = session.root_candidates(tiny.vocab_size)
    reweight, unbiased, survive, total = 1.0, 0.0, 1.0, 0.0
    for step in range(depth):
        if anchor + 2 + step >= seq.shape[1]:  # past the continuation: nothing to accept
            assert not steps.masks[0, anchor, step]
            break
        if step > 0:
            block = torch.ones(1, 1, step, dtype=torch.bool)
            fed = seq[:, anchor + 1 + step][:, None]  # the continuation's token, as the unroll feeds it
            ids, values = session.expand(fed, torch.zeros(1, 1, dtype=torch.long), block, tiny.vocab_size)
            ids, values = ids[:, 0], values[:, 0]
        draft_probs = torch.zeros(tiny.vocab_size).scatter(0, ids[0], values[0].exp())
        target_probs = torch.softmax(tiny.model(seq[:, : anchor + 2 + step]).logits[0, -1], -1)
        rate = float(torch.minimum(target_probs, draft_probs).sum())
        y = int(seq[0, anchor + 2 + step])
        ratio = min(float(target_probs[y]), float(draft_probs[y])) / float(target_probs[y])
        assert steps.masks[0, anchor, step] and float(steps.rates[0, anchor, step]) == pytest.approx(rate, abs=2e-5)
        assert float(steps.ratios[0, anchor, step]) == pytest.approx(ratio, abs=2e-5)
        unbiased += reweight * rate
        reweight *= ratio
        survive *= rate
        total += survive
    session.end_round()
    return unbiased, total


def _aux_and_last(target, seq):
    tokens = TokenBatch(seq, torch.zeros_like(seq, dtype=torch.bool), torch.tensor([seq.shape[1]]))
    batch = capture_features(target, tokens)
    return batch.features, batch.target_hidden


def test_tree_decoding_is_checked_lossless_against_greedy(control, tiny):
    from mmvsd.decoding.decode import DecodeConfig, vanilla_generate

    config = control.ControlConfig(answer_tokens=6, tree="8/3/2")
    prompts, _ = _random_sequences(3, seed=4)
    greedy = [r.output_ids for r in vanilla_generate(tiny, prompts, DecodeConfig(6))]
    drafter = Eagle3Drafter.from_target(tiny, draft_vocab_size=None, seed=1).eval()
    rows = control.tree_decoding(tiny, drafter, control.EvalSet(prompts, greedy, greedy), config, 0.0)
    assert [r["new"] for r in rows] == [6, 6, 6] and all(1 <= r["forwards"] <= 6 for r in rows)
    wrong = [list(g) for g in greedy]
    wrong[1][3] = (wrong[1][3] + 1) % 128
    with pytest.raises(RuntimeError, match="prompt 1: tree decoding at T = 0 differs"):
        control.tree_decoding(tiny, drafter, control.EvalSet(prompts, wrong, greedy), config, 0.0)


def _evaluation(sums, roots, new, forwards):
    rows = [{"sum": s, "forced": 0.9 * s, "roots": r, "step_rates": [0.5]} for s, r in zip(sums, roots)]
    taus = [{"new": n, "forwards": f} for n, f in zip(new, forwards)]
    return {"accept_t1": rows, "tau_t0": taus, "tau_t1": taus}


def _random_counts(seed: int):
    """(sums, roots, new, forwards) of 30 held-out prompts."""
    rng = np.random.default_rng(seed)
    roots = rng.integers(5, 20, size=30)
    return rng.uniform(0.5, 3.0, size=30) * roots, roots, rng.integers(40, 64, size=30), rng.integers(15, 40, size=30)


def test_summary_pools_prompts_and_pairs_the_differences(control):
    sums, roots, new, forwards = _random_counts(0)
    base = _evaluation(sums, roots, new, forwards)
    better = _evaluation(sums + 0.5 * roots, roots, new, forwards)  # +0.5 accepted tokens at every root
    summary = control.summarise({"ce-greedy": [base], "ce-sample": [base], "accept": [better]}, 500, seed=0)
    accept = summary["accept"]["accept_t1"]
    assert accept["value"] == pytest.approx((sums.sum() + 0.5 * roots.sum()) / roots.sum())
    assert accept["vs_ce-greedy"]["diff"] == pytest.approx(0.5)
    assert accept["vs_ce-greedy"]["diff_ci95"] == pytest.approx([0.5, 0.5])  # paired: no prompt-to-prompt noise
    low, high = accept["ci95"]
    assert low < accept["value"] < high and high - low > 0.05  # unpaired: the prompts' spread
    assert summary["ce-sample"]["tau_t0"]["vs_ce-greedy"]["diff_ci95"] == [0.0, 0.0]
    assert "vs_ce-greedy" not in summary["ce-greedy"]["tau_t0"]
    assert summary["accept"]["tau_t0"]["value"] == pytest.approx(new.sum() / forwards.sum())
    assert summary["accept"]["forced_t1"]["value"] == pytest.approx(0.9 * accept["value"])  # its own numerator
    table = control.markdown_tables(summary, {}, control.ControlConfig())
    assert "+0.500 [+0.500, +0.500]" in table and table.count("\n| accept |") == 2


def test_replicates_are_averaged_and_their_spread_widens_the_interval(control):
    sums, roots, new, forwards = _random_counts(1)
    base = _evaluation(sums, roots, new, forwards)
    seeds = [_evaluation(sums + gain * roots, roots, new, forwards) for gain in (0.5, 1.5)]
    summary = control.summarise({"ce-greedy": [base, base], "ce-sample": [base], "accept": seeds}, 2000, seed=0)
    accept = summary["accept"]["accept_t1"]
    one = (sums.sum() + 0.5 * roots.sum()) / roots.sum()
    assert accept["replicates"] == pytest.approx([one, one + 1.0])
    assert accept["value"] == pytest.approx(one + 0.5) and accept["vs_ce-greedy"]["diff"] == pytest.approx(1.0)
    # paired prompts cancel, so the difference's interval is the seeds' spread: both draws of one seed at the ends
    assert accept["vs_ce-greedy"]["diff_ci95"] == pytest.approx([0.5, 1.5])
    assert summary["ce-greedy"]["accept_t1"]["replicates"] == pytest.approx([one - 0.5] * 2)


def test_whole_control_at_toy_size_resumes_an_interrupted_arm_and_reuses_finished_ones(control, tmp_path, monkeypatch):
    from mmvsd.training import trainer

    config = control.parse_overrides(control.ControlConfig(), TOY)
    arms = ["ce-greedy", "ce-sample", "ce+vsd"]
    results = tmp_path / "result.json"
    real_step, real_train = trainer._optimizer_step, trainer.train

    def interrupted(run, state):  # the first arm stops after its first checkpoint (step 1 of 2)
        if state.step == 1:
            raise KeyboardInterrupt
        return real_step(run, state)

    monkeypatch.setattr(trainer, "_optimizer_step", interrupted)
    with pytest.raises(KeyboardInterrupt):
        control.run_control(config, tmp_path / "out", arms, results, log=lambda *a: None)
    monkeypatch.setattr(trainer, "_optimizer_step", real_step)
    result = control.run_control(config, tmp_path / "out", arms, results, log=lambda *a: None)
    assert [result["replicates"][0]["runs"][arm]["resumed"] for arm in arms] == [True, False, False]
    assert result["target"]["kl_to_chain"] >= 0 and result["target"]["settings"]["num_tokens"] == 8
    saved = json.loads(results.read_text())
    assert results.with_suffix(".png").stat().st_size > 0
    assert set(saved["summary"]) == {"init", *arms} and saved["config"]["depth"] == 3
    for arm, [record] in saved["per_prompt"].items():
        assert record["lossless_t0"] and len(record["tau_t0"]) == 4
        assert [r["roots"] for r in record["accept_t1"]] == [12 - 1] * 4
        assert 0 <= saved["summary"][arm]["accept_t1"]["value"] <= 3
        assert saved["summary"][arm]["tau_t0"]["value"] >= 1
    [replicate] = saved["replicates"]
    assert replicate["arm_seed"] == 0 and set(replicate["runs"]) == set(arms)
    recipe = (Path(replicate["runs"]["ce+vsd"]["folder"]) / "train_config.yaml").read_text()
    assert "objective: ce+vsd" in recipe and "ce_weight: 1.0" in recipe and "vsd_weight: 0.1" in recipe
    assert "regenerate: sample" in recipe and "path_length: 3" in recipe
    greedy = (Path(replicate["runs"]["ce-greedy"]["folder"]) / "train_config.yaml").read_text()
    assert "regenerate: greedy" in greedy and "objective: ce" in greedy
    assert "| ce+vsd | ce+vsd | sample |" in result["table"]

    monkeypatch.setattr(control, "train", lambda *a, **k: pytest.fail("a finished arm was trained again"))
    again = control.run_control(config, tmp_path / "out", arms, None, log=lambda *a: None)
    assert again["summary"] == saved["summary"]

    monkeypatch.setattr(control, "train", real_train)  # a second seed: its arms train, the first seed's are reused
    pooled = control.run_control(config, tmp_path / "out", arms[:2], None, log=lambda *a: None,
                                 replicates=[(tmp_path / "out", 0), (tmp_path / "out", 1)])
    assert [r["arm_seed"] for r in pooled["replicates"]] == [0, 1]
    first, second = (r["runs"]["ce-sample"]["folder"] for r in pooled["replicates"])
    assert first == saved["replicates"][0]["runs"]["ce-sample"]["folder"] and second != first
    assert len(pooled["summary"]["ce-sample"]["tau_t0"]["replicates"]) == 2


def test_the_gpu_script_runs_each_seed_and_arm_in_its_own_folder_reusing_the_answers(control, tmp_path):
    """studies/vsd_control_gpu.sh with DEVICE=cpu: the run starts from SRC's target, data, initial drafter and
    regenerated answers (their cache key rewritten to the run's folder, so nothing is regenerated)."""
    import shutil
    import subprocess

    config = control.parse_overrides(control.ControlConfig(), TOY)
    control.run_control(config, tmp_path / "made", ["ce-sample"], None, log=lambda *a: None)
    src = tmp_path / "src"
    src.mkdir()
    for made in (tmp_path / "made").iterdir():
        if made.name.startswith(("target-", "data-", "drafter-init-", "regenerated")):
            (shutil.copytree if made.is_dir() else shutil.copy)(made, src / made.name)
    [cache] = (src / "regenerated").glob("sample-*.jsonl")
    script = Path(__file__).resolve().parents[1] / "vsd_control_gpu.sh"
    env = {**os.environ, "RUNS": "0:ce+vsd", "DEVICE": "cpu", "PYTHON": sys.executable, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(["bash", str(script), str(src), str(tmp_path / "out"), *TOY], env=env,
                          cwd=script.parents[1].parent, capture_output=True, text=True, timeout=600)
    run = tmp_path / "out" / "s0-ce_vsd"  # no "+" in the folder: --data would read "a+b" as two datasets
    assert done.returncode == 0 and "s0-ce_vsd/log.txt:rc=0" in done.stdout, (done.stdout, done.stderr)
    result = json.loads((run / "result.json").read_text())
    assert set(result["summary"]) == {"init", "ce+vsd"}
    reused = (run / "regenerated" / cache.name).read_text()
    assert reused == cache.read_text().replace(str(tmp_path / "made" / "target-"), str(run / "target-"))
