"""LossAtInit's decisions without a Trainer (functional/loss_checks.py)."""

import math

import pytest
import torch

from lightning_tfdebug.functional.loss import copy_sums, init_loss_sums
from lightning_tfdebug.functional.loss_checks import (
    InitLoss,
    batch_counts,
    check_verdicts,
    classify_init_loss,
    scaled_loss_verdict,
    summarize_init,
)

V = 50
LN_V = math.log(V)


def init(observed=LN_V, recomputed=LN_V, **kwargs):
    values = dict(
        observed=observed,
        expected=LN_V,
        recomputed=recomputed,
        logit_std=0.02,
        supervised_frac=1.0,
        copy_rate=None,
        probability_rows=0.0,
        log_probability_rows=0.0,
        supervised=8 * 16.0,
        positions=8 * 16.0,
        label_rows=8.0,
        vocab=V,
    )
    values.update(kwargs)
    return InitLoss(**values)


def classify(summary, **kwargs):
    kwargs = {"init_tolerance": 0.25, "ignore_index": -100, "shifted": True, **kwargs}
    return [v.code for v in classify_init_loss(summary, **kwargs)]


def test_summary_of_real_sums():
    torch.manual_seed(0)
    logits = torch.randn(4, 16, V) * 0.01
    labels = torch.randint(0, V, (4, 16))
    host = {k: float(v) for k, v in init_loss_sums(logits, labels).items()}
    host.update({k: float(v) for k, v in copy_sums(logits, labels).items()})
    host.update(loss_sum=2 * LN_V, loss_n=2.0)  # two ranks returned ln(V)
    summary = summarize_init(host, V)
    assert summary.observed == pytest.approx(LN_V) and summary.recomputed == pytest.approx(LN_V, rel=1e-3)
    assert summary.supervised_frac == pytest.approx(60 / 64) and summary.copy_rate is not None
    assert set(summary.metrics()) >= {"loss_at_init/observed", "loss_at_init/copy_rate", "loss_at_init/logit_std"}
    host["loss_n"] = 0.0  # no rank returned a loss: the recomputed one stands in
    assert summarize_init(host, V).observed == summary.recomputed


def test_the_decision_tree_of_the_first_loss():
    assert classify(init()) == []
    assert classify(init(probability_rows=1.0, observed=LN_V)) == ["TFD220"]
    assert classify(init(log_probability_rows=1.0)) == ["TFD221"]
    assert classify(init(supervised=0.0, observed=math.nan)) == ["TFD224"]
    assert classify(init(observed=math.inf)) == ["TFD227"]
    assert classify(init(observed=3 * LN_V, recomputed=3 * LN_V)) == ["TFD222"]
    assert classify(init(observed=0.1 * LN_V, recomputed=0.1 * LN_V)) == ["TFD223"]
    # near-uniform logits but a returned loss 128x larger: summed over the 128 supervised tokens
    [verdict] = classify_init_loss(init(observed=128 * LN_V), init_tolerance=0.25, ignore_index=-100, shifted=True)
    assert verdict.code == "TFD229" and verdict.evidence["matched_count"] == "supervised tokens per batch"
    assert classify(init(observed=LN_V / 8)) == ["TFD229"]  # divided by the 8 sequences once too often


def test_scaled_loss_only_below_ln_v_when_a_count_explains_it():
    counts = batch_counts(supervised=128, label_rows=8, positions=128, accumulate_grad_batches=1, ranks=1)
    assert counts["label positions per sequence"] == 16
    assert scaled_loss_verdict(LN_V * 0.3, LN_V, LN_V, 0.25, counts) is None  # no count is 1/0.3
    assert scaled_loss_verdict(LN_V * 5.3, LN_V, LN_V, 0.25, counts).evidence["matched_count"] is None
    assert scaled_loss_verdict(LN_V * 16, 3 * LN_V, LN_V, 0.25, counts) is None  # the logits are not uniform


def test_check_step_verdicts():
    assert [v.code for v in check_verdicts(LN_V * 1.01, LN_V, 100, stall_tolerance=0.05)] == ["TFD225"]
    assert check_verdicts(LN_V * 0.5, LN_V, 100, stall_tolerance=0.05) == []
    copying = check_verdicts(1.0, LN_V, 100, stall_tolerance=0.05, copy_rate=0.9, repeat_rate=0.05, init_copy_rate=0.1)
    assert [v.code for v in copying] == ["TFD226"]
    tied = check_verdicts(1.0, LN_V, 100, stall_tolerance=0.05, copy_rate=0.9, repeat_rate=0.05, init_copy_rate=0.85)
    assert tied == []  # an untrained model with tied embeddings copied as much already
    repeats = check_verdicts(1.0, LN_V, 100, stall_tolerance=0.05, copy_rate=0.9, repeat_rate=0.8)
    assert repeats == []  # the data repeats tokens that often


def test_the_returned_loss_picks_the_label_alignment():
    from lightning_tfdebug.functional.loss_checks import follow_returned_loss

    torch.manual_seed(0)
    tokens = torch.randint(0, 50, (4, 17))
    targets = tokens[:, 1:]  # shifted by the data (a tuple batch's targets): scored at their own position
    logits = torch.nn.functional.one_hot(targets, 50).float() * 6.0  # a trained model: predicts the next token
    aligned = init_loss_sums(logits, targets, shift_labels=False)
    shifted = init_loss_sums(logits, targets, shift_labels=True)  # what `shift_labels=True` assumes
    host = {k: float(v) for k, v in shifted.items()}
    host.update({"other_ce_sum": float(aligned["ce_sum"]), "other_ce_count": float(aligned["ce_count"])})
    returned = torch.nn.functional.cross_entropy(logits.reshape(-1, 50), targets.reshape(-1)).item()
    picked, other = follow_returned_loss(host, returned)
    assert other and picked["ce_sum"] / picked["ce_count"] == pytest.approx(returned, rel=1e-5)
    assert not any(k.startswith("other_") for k in picked)
    # the configured alignment stays when it is the one that agrees, when nothing else was measured, or without a loss
    assert not follow_returned_loss(host, host["ce_sum"] / host["ce_count"])[1]
    assert not follow_returned_loss({k: v for k, v in host.items() if not k.startswith("other_")}, returned)[1]
    assert not follow_returned_loss(host, math.nan)[1]
