"""The objectives against explicit loops: `ce`, the top-K KL at every depth, the weight formulas of
`vsd-kl` and `ce+vsd`, and one clear error (exit 2) for loss settings that cannot train."""

from __future__ import annotations

import pytest
import torch

from mmvsd.cli import main
from mmvsd.drafters.eagle3 import Eagle3Drafter
from mmvsd.errors import UserError
from mmvsd.training.features import TokenBatch, capture_features
from mmvsd.training.objectives import ObjectiveConfig, ce_loss, topk_kl_loss, vsd_loss
from mmvsd.training.terms import check_objective, make_objective
from mmvsd.training.unroll import unroll_draft_steps

VOCAB = 128


def setup(target):
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (2, 12), generator=gen)
    lengths = torch.tensor([12, 9])
    loss_mask = (torch.arange(12)[None] >= 3) & (torch.arange(12)[None] < lengths[:, None])
    batch = capture_features(target, TokenBatch(ids, loss_mask, lengths))
    drafter = Eagle3Drafter.from_target(target, draft_vocab_size=100, seed=1)
    drafter.set_draft_vocab(torch.arange(28, 128))  # target ids 0..27 are outside the draft vocabulary
    return batch, drafter


def unrolled(target, batch, drafter, steps: int):
    """The drafter's hidden states at each unrolled step and the target's full logits [B, T, V], computed here."""
    ids = batch.tokens.input_ids
    next_ids = torch.cat([ids[:, 1:], torch.zeros(ids.shape[0], 1, dtype=torch.long)], 1)
    return unroll_draft_steps(drafter, batch.features, next_ids, steps), target.logits(batch.target_hidden)


def test_ce_loss_matches_explicit_loop(tiny_target):
    batch, drafter = setup(tiny_target)
    config = ObjectiveConfig(ttt_steps=3, ttt_decay=0.8)
    loss, metrics = ce_loss(drafter, tiny_target, batch, config)
    hiddens, full_logits = unrolled(tiny_target, batch, drafter, 3)
    expected = 0.0
    for step in range(3):
        terms, hits, labels = [], [], 0
        for b in range(2):
            for t in range(int(batch.tokens.lengths[b])):
                label_pos = t + 2 + step  # the token step `step` at anchor t predicts
                if label_pos >= 12 or not batch.tokens.loss_mask[b, label_pos]:
                    continue
                labels += 1
                target_row = full_logits[b, label_pos - 1]
                if int(target_row.argmax()) < 28:  # target top-1 outside the draft vocabulary: skipped
                    continue
                target_probs = torch.softmax(target_row[28:].float(), -1)
                draft_logprobs = torch.log_softmax(drafter.draft_logits(hiddens[step][b, t]).float(), -1)
                terms.append(-(target_probs * draft_logprobs).sum())
                hits.append(float(draft_logprobs.argmax() == target_probs.argmax()))
        expected = expected + 0.8**step * torch.stack(terms).mean()
        assert metrics[f"acc_{step}"] == sum(hits) / len(hits)
        if step == 0:  # over every label: an out-of-vocabulary top-1 counts as a miss
            assert metrics["acc_0_all"] == pytest.approx(sum(hits) / labels)
    torch.testing.assert_close(loss, expected)


def test_label_rows_reads_the_shifted_rows_in_place():
    from mmvsd.training.objectives import label_rows
    from mmvsd.training.unroll import shifted

    values = torch.randn(3, 10, 5)
    for step in range(4):
        mask = torch.rand(3, 10) > 0.4
        mask[:, 10 - step - 2 :] = False
        assert torch.equal(label_rows(values, step, mask), shifted(values, step + 1)[mask])
    mask[0, -1] = True  # an anchor whose label lies past the sequence
    with pytest.raises(ValueError):
        label_rows(values, 3, mask)
    short = torch.randn(2, 3, 5)  # fewer tokens than step + 2: no labels, as a shifted copy gives
    for step in range(5):
        none = torch.zeros(2, 3, dtype=torch.bool)
        assert label_rows(short, step, none).shape == (0, 5) == shifted(short, step + 1)[none].shape


@pytest.mark.parametrize("objective", ["ce", "ce+accept", "vsd-kl"])
def test_a_batch_shorter_than_the_unroll_trains(tiny_target, objective):
    """Four tokens and six unrolled steps: the later steps have no labels, and the loss stays finite."""
    ids = torch.randint(0, VOCAB, (2, 4), generator=torch.Generator().manual_seed(0))
    batch = capture_features(tiny_target, TokenBatch(ids, torch.ones(2, 4, dtype=torch.bool), torch.tensor([4, 3])))
    drafter = Eagle3Drafter.from_target(tiny_target, draft_vocab_size=100, seed=1)
    loss, _ = make_objective(objective, ObjectiveConfig(ttt_steps=6))(drafter, tiny_target, batch,
                                                                       torch.Generator().manual_seed(0))
    assert torch.isfinite(loss)


def test_training_leaves_the_target_without_gradients(tiny_target):
    """The target is frozen: EAGLE-3 reads its embeddings, and autograd must not fill a [V, H] gradient for them."""
    batch, drafter = setup(tiny_target)
    loss, _ = ce_loss(drafter, tiny_target, batch, ObjectiveConfig(ttt_steps=3))
    loss.backward()
    assert all(p.grad is not None for p in drafter.parameters())
    assert not any(p.requires_grad or p.grad is not None for p in tiny_target.model.parameters())


@pytest.mark.parametrize("kl_depth", ["all", "first"])
def test_topk_kl_matches_explicit_loop_at_every_depth(tiny_target, kl_depth):
    batch, drafter = setup(tiny_target)
    config = ObjectiveConfig(ttt_steps=3, ttt_decay=0.7, kl_topk=5, kl_depth=kl_depth)
    kl, metrics = topk_kl_loss(drafter, tiny_target, batch, config)
    next_ids = torch.roll(batch.tokens.input_ids, -1, 1)
    hiddens = unroll_draft_steps(drafter, batch.features, next_ids, 3)
    full_logits = tiny_target.logits(batch.target_hidden)
    expected = 0.0
    for step in range(3 if kl_depth == "all" else 1):
        values = []
        for b in range(2):
            for t in range(12):
                label_pos = t + 2 + step
                if label_pos >= 12 or not batch.tokens.loss_mask[b, label_pos]:
                    continue
                target_draft_logits = full_logits[b, label_pos - 1, 28:].float()
                top = target_draft_logits.topk(5).indices
                p_hat = torch.softmax(target_draft_logits[top], -1)
                q_hat = torch.softmax(drafter.draft_logits(hiddens[step][b, t]).float()[top], -1)
                values.append((p_hat * (p_hat.log() - q_hat.log())).sum())
        expected = expected + 0.7**step * torch.stack(values).mean()
    torch.testing.assert_close(kl, expected)
    assert metrics["topk_kl"] == pytest.approx(float(expected.detach()), rel=1e-5)
    assert ("topk_kl_2" in metrics) == (kl_depth == "all")


# ---------------------------------------------------------------- weight formulas

SMALL_VSD = {"num_samples": 3, "path_length": 3, "num_anchors": 2, "ttt_steps": 2}


def objective_value(name: str, config: ObjectiveConfig, drafter, target, batch) -> tuple[torch.Tensor, dict]:
    return make_objective(name, config)(drafter, target, batch, torch.Generator().manual_seed(5))


def vsd_value(config: ObjectiveConfig, drafter, target, batch) -> torch.Tensor:
    return vsd_loss(drafter, target, batch, config, torch.Generator().manual_seed(5))[0]


def test_ce_plus_vsd_is_ce_weight_ce_plus_vsd_weight_vsd(tiny_target):
    batch, drafter = setup(tiny_target)
    config = ObjectiveConfig(**SMALL_VSD, ce_weight=0.3, vsd_weight=2.5)
    loss, metrics = objective_value("ce+vsd", config, drafter, tiny_target, batch)
    ce = ce_loss(drafter, tiny_target, batch, config)[0]
    vsd = vsd_value(config, drafter, tiny_target, batch)
    assert abs(float(ce.detach())) > 1e-3 and abs(float(vsd.detach())) > 1e-3
    torch.testing.assert_close(loss, 0.3 * ce + 2.5 * vsd)
    assert {"ce", "vsd", "acc_0", "oracle_pass_rate"} <= set(metrics)
    # the default is the paper's recipe: the original loss plus alpha = 0.1 times the VSD term
    default, _ = objective_value("ce+vsd", ObjectiveConfig(**SMALL_VSD), drafter, tiny_target, batch)
    torch.testing.assert_close(default, ce + 0.1 * vsd)
    # a zero weight drops its term: ce+vsd with ce_weight=0 is the vsd ablation
    no_ce, no_ce_metrics = objective_value("ce+vsd", ObjectiveConfig(**SMALL_VSD, ce_weight=0.0, vsd_weight=1.0),
                                           drafter, tiny_target, batch)
    torch.testing.assert_close(no_ce, vsd)
    assert "ce" not in no_ce_metrics


def test_vsd_kl_is_vsd_plus_kl_alpha_kl_and_vsd_is_vsd_alone(tiny_target):
    batch, drafter = setup(tiny_target)
    config = ObjectiveConfig(**SMALL_VSD, kl_alpha=0.37, kl_topk=5, ce_weight=0.5, vsd_weight=3.0)
    loss, metrics = objective_value("vsd-kl", config, drafter, tiny_target, batch)
    vsd = vsd_value(config, drafter, tiny_target, batch)
    kl = topk_kl_loss(drafter, tiny_target, batch, config)[0]
    assert float(kl.detach()) > 1e-3
    torch.testing.assert_close(loss, vsd + 0.37 * kl)  # ce_weight / vsd_weight concern ce+vsd only
    assert metrics["topk_kl"] == pytest.approx(float(kl.detach()), rel=1e-5)
    alone, _ = objective_value("vsd", config, drafter, tiny_target, batch)
    torch.testing.assert_close(alone, vsd)
    ce_only, _ = objective_value("ce", config, drafter, tiny_target, batch)
    torch.testing.assert_close(ce_only, ce_loss(drafter, tiny_target, batch, config)[0])


# ---------------------------------------------------------------- bad loss settings

BAD_LOSS = {
    "car_normalisation": (["loss.car_normalisation=foo"], "loss.car_normalisation='foo' is not one of sum, mean"),
    "car_scale": (["loss.car_scale=linear"], "loss.car_scale='linear' is not one of prob, log"),
    "kl_depth": (["loss.kl_depth=2"], "loss.kl_depth='2' is not one of all, first"),
    "zbar_vocab": (["loss.zbar_vocab=target"], "loss.zbar_vocab='target' is not one of draft, full"),
    "negative ce_weight": (["loss.ce_weight=-0.1"], "loss.ce_weight must be >= 0, got -0.1"),
    "negative vsd_weight": (["loss.vsd_weight=-1"], "loss.vsd_weight must be >= 0, got -1.0"),
    "negative kl_alpha": (["--objective", "vsd-kl", "loss.kl_alpha=-0.1"], "loss.kl_alpha must be >= 0"),
    "nan weight": (["loss.vsd_weight=.nan"], "loss.vsd_weight must be >= 0, got nan"),
    "zero temperature": (["loss.car_temperature=0"], "loss.car_temperature must be > 0"),
    "all weights zero": (["loss.ce_weight=0", "loss.vsd_weight=0"],
                         "objective=ce+vsd trains nothing with loss.ce_weight=0, loss.vsd_weight=0"),
    "unknown key": (["loss.alpha=0.1"], "unknown config key 'loss.alpha'"),
    "wrong type": (["loss.ce_weight=abc"], "loss.ce_weight: expected float, got 'abc'"),
}


@pytest.mark.parametrize("case", sorted(BAD_LOSS))
def test_bad_loss_settings_are_one_clear_error_exit_2(tmp_path, capsys, case):
    extra, message = BAD_LOSS[case]
    out = tmp_path / "out"
    argv = ["train", "--target", str(tmp_path / "no-target"), "--output", str(out), "--objective", "ce+vsd", *extra]
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("mmvsd: error:") and message in lines[0], err
    assert not out.exists()


def test_validate_rejects_weights_that_train_nothing_only_for_the_terms_used():
    check_objective("vsd", ObjectiveConfig(ce_weight=0.0, vsd_weight=0.0))  # vsd alone does not read them
    check_objective("vsd-kl", ObjectiveConfig(kl_alpha=0.0))  # vsd still trains
    check_objective("ce+vsd", ObjectiveConfig(ce_weight=0.0))  # the vsd ablation through ce+vsd
    with pytest.raises(UserError, match="trains nothing"):
        check_objective("ce+vsd", ObjectiveConfig(ce_weight=0.0, vsd_weight=0.0))
    with pytest.raises(UserError, match="unknown objective"):
        make_objective("vsd+kl", ObjectiveConfig())
    with pytest.raises(UserError, match="car_normalisation"):
        make_objective("vsd", ObjectiveConfig(car_normalisation="foo"))
