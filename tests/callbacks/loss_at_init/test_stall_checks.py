"""The data-aware baselines of functional/loss.py and their decisions in callbacks/loss_at_init/ (stall_checks.py,
init_checks.py), without a Trainer: label counts and their entropy, the bounded-output floor, the rolled-label gap, the
label-input relation."""

import math

import pytest
import torch

from lightning_tfdebug.callbacks.loss_at_init.init_checks import classify_init_loss
from lightning_tfdebug.callbacks.loss_at_init.readings import InitLoss
from lightning_tfdebug.callbacks.loss_at_init.stall_checks import (
    bounded_output_verdict,
    check_verdicts,
    context_verdict,
)
from lightning_tfdebug.functional.loss import (
    bounded_floor_sums,
    init_loss_sums,
    label_counts,
    label_input_match_sums,
    masked_input_sums,
    rolled_label_sums,
    unigram_entropy,
)

V = 50
LN_V = math.log(V)


def test_label_counts_and_their_entropy_against_a_plain_reference():
    labels = torch.tensor([[1, 1, 2, -100], [3, 1, 2, 77]])  # 77 is outside V: not counted
    counts = label_counts(labels, V)
    assert counts[:4].tolist() == [0, 3, 2, 1] and counts.sum() == 6
    freqs = [3 / 6, 2 / 6, 1 / 6]
    plug_in = -sum(p * math.log(p) for p in freqs)
    assert unigram_entropy(counts).item() == pytest.approx(plug_in + (3 - 1) / (2 * 6), rel=1e-6)
    uniform = torch.full((V,), 1000.0)
    assert unigram_entropy(uniform).item() == pytest.approx(LN_V, abs=0.01)
    assert math.isnan(unigram_entropy(torch.zeros(V)).item())


def test_the_floor_bounds_every_cross_entropy_and_is_reached_at_the_extremes():
    torch.manual_seed(0)
    labels = torch.randint(0, V, (4, 9))
    squashed = torch.randn(4, 9, V).sigmoid()  # a range of width < 1 per row
    sums = bounded_floor_sums(squashed, labels)
    ce = init_loss_sums(squashed, labels)
    assert sums["floor_count"] == ce["ce_count"] == 4 * 8
    assert (sums["floor_sum"] / sums["floor_count"]) <= (ce["ce_sum"] / ce["ce_count"])
    # the target at the top of the range, every other class at the bottom: the cross-entropy is the floor
    extreme = torch.zeros(4, 9, V)
    extreme.scatter_(-1, labels.roll(-1, 1)[..., None], 1.0)  # shifted: position t predicts label t + 1
    sums, ce = bounded_floor_sums(extreme, labels), init_loss_sums(extreme, labels)
    floor = math.log1p((V - 1) * math.exp(-1.0))
    assert (sums["floor_sum"] / sums["floor_count"]).item() == pytest.approx(floor, rel=1e-5)
    assert (ce["ce_sum"] / ce["ce_count"]).item() == pytest.approx(floor, rel=1e-5)


def test_the_rolled_label_gap_is_zero_for_predictions_that_ignore_the_sample():
    torch.manual_seed(0)
    labels = torch.randint(0, V, (6, 12))
    knows = torch.zeros(6, 12, V).scatter_(-1, labels.roll(-1, 1)[..., None], 5.0)  # predicts its own next label
    sums = rolled_label_sums(knows, labels)
    assert sums["rolled_count"] == 6 * 11 and sums["rolled_ce_sum"] > 1.5 * sums["own_ce_sum"]
    frequencies = torch.randn(V).expand(6, 12, V)  # the same prediction everywhere
    sums = rolled_label_sums(frequencies, labels)
    assert sums["rolled_ce_sum"].item() == pytest.approx(sums["own_ce_sum"].item(), rel=0.1)
    assert rolled_label_sums(knows[:1], labels[:1])["rolled_count"] == 0  # one sample has no neighbour


def test_labels_are_related_to_their_own_inputs_or_to_a_neighbours():
    torch.manual_seed(0)
    ids = torch.randint(0, V, (4, 16))
    own = label_input_match_sums(ids, ids)  # labels == input_ids (the model shifts)
    assert own["own_match"] == own["match_count"] == 4 * 15 and own["rolled_match"] < 0.2 * own["match_count"]
    shifted = torch.cat([ids[:, 1:], torch.full((4, 1), -100)], 1)  # shifted by the collator
    assert label_input_match_sums(shifted, ids)["own_match"] == 4 * 15
    joined_off_by_one = label_input_match_sums(ids.roll(1, 0), ids)
    assert joined_off_by_one["rolled_match"] == 4 * 15 and joined_off_by_one["own_match"] < 20
    mask = torch.rand(4, 16) < 0.3
    inputs = torch.where(mask, torch.full_like(ids, V - 1), ids)
    mlm = masked_input_sums(inputs, torch.where(mask, ids, torch.full_like(ids, -100)), V)
    assert mlm["mask_share_top"] == mlm["mask_share_count"] == mask.sum()


def test_bounded_output_decision():
    h = 0.5 * LN_V
    floor = math.log1p((V - 1) * math.exp(-1.0))
    [verdict] = [bounded_output_verdict(floor + 0.1, floor, 1.0, LN_V, h, 100, stall_tolerance=0.05)]
    assert verdict.code == "TFD230" and verdict.evidence["floor"] == floor
    assert bounded_output_verdict(LN_V, LN_V - 0.01, 0.01, LN_V, h, 100, stall_tolerance=0.05) is None  # not moved
    assert bounded_output_verdict(floor + 0.1, floor, 1.0, LN_V, floor, 100, stall_tolerance=0.05) is None  # data
    assert bounded_output_verdict(0.8 * LN_V, 0.3, 6.0, LN_V, h, 100, stall_tolerance=0.05) is None  # far above
    # a bound holds every row at the same width (a saturated tanh: 0.009 of the mean); an unbounded model that learned
    # an easy answer early (copying its input at step 25) still has narrow logits near their floor, but rows of unlike
    # widths (0.13)
    pinned = dict(stall_tolerance=0.05)
    assert bounded_output_verdict(floor + 0.1, floor, 1.0, LN_V, h, 25, range_spread=0.009, **pinned).code == "TFD230"
    assert bounded_output_verdict(floor + 0.1, floor, 1.0, LN_V, h, 25, range_spread=0.13, **pinned) is None


def test_context_decision_names_the_side_at_fault():
    h = 2.0
    kwargs = dict(unigram_entropy=h, step=100)
    assert context_verdict(2.0, 2.3, **kwargs) is None  # better on its own labels: it uses its context
    assert context_verdict(1.2, 1.2, **kwargs) is None  # far below the unigram level
    assert context_verdict(2.0, 2.0, own_match=1.0, rolled_match=0.1, **kwargs).code == "TFD232"
    assert context_verdict(2.0, 2.0, own_match=1.0, rolled_match=0.1, flat=False, **kwargs) is None
    assert context_verdict(2.0, 2.0, own_match=1.0, rolled_match=0.1, window_steps=5, **kwargs) is None
    neighbour = context_verdict(2.0, 2.0, own_match=0.1, rolled_match=1.0, **kwargs)
    assert neighbour.code == "TFD231" and "off by one row" in neighbour.message
    neither = context_verdict(2.0, 2.0, own_match=0.1, rolled_match=0.1, **kwargs)
    assert neither.code == "TFD231" and "unless this task's labels never repeat" in neither.message
    unmeasured = context_verdict(2.0, 2.0, **kwargs)
    assert unmeasured.code == "TFD231" and "cannot be told apart" in unmeasured.message
    assert unmeasured.severity == "info"  # a model on the unigram plateau (a healthy BART fine-tune) reads the same
    assert neighbour.severity == "error"  # measured off by one row: the harm is sure
    assert neither.severity is None  # the rule's own severity, a warning: this task's labels may never repeat inputs


def test_one_label_per_sequence_flat_at_chance_is_an_error_once_the_window_is_long_enough():
    """A classifier's labels (one per sequence) never repeat its inputs, so which side is at fault is not measured;
    a loss flat at the labels' entropy over the window, no better on the own rows' labels than on the neighbours',
    means the run learns nothing from its inputs (labels joined to the wrong rows, or what decides them unseen)."""
    kwargs = dict(unigram_entropy=math.log(4), step=100, per_sequence=True)
    chance = context_verdict(1.38, 1.381, window_steps=50, **kwargs)
    assert (chance.code, chance.severity) == ("TFD231", "error") and "one per sequence" in chance.message
    assert context_verdict(1.38, 1.381, window_steps=50, flat=False, **kwargs).severity == "info"  # still falling
    assert context_verdict(1.38, 1.381, window_steps=5, **kwargs).severity == "info"  # too short a window
    assert context_verdict(0.4, 0.9, window_steps=50, **kwargs) is None  # learned: far below chance


def test_masked_lm_labels_belong_to_the_inputs_whose_masks_they_sit_on():
    """Masked-LM labels never repeat their inputs (the input there is the mask); the relation is where the masks are.
    On their own inputs' masks, they are right and the model does not use its context yet: the masked-LM plateau,
    longer at a lower learning rate (the fine-tuned BERT of the healthy matrix at lr 2e-4 still sits there at step
    520), stated as info. On a neighbour's masks, or on none, they belong to other samples."""
    kwargs = dict(unigram_entropy=2.9, step=520, masked=True)
    plateau = context_verdict(3.1, 3.08, own_match=0.84, rolled_match=0.2, window_steps=250, **kwargs)
    assert (plateau.code, plateau.severity) == ("TFD232", "info") and "mask token" in plateau.message
    assert context_verdict(3.1, 3.08, own_match=0.84, rolled_match=0.2, window_steps=250, flat=False, **kwargs) is None
    joined = context_verdict(3.1, 3.08, own_match=0.2, rolled_match=0.84, **kwargs)
    assert joined.code == "TFD231" and joined.severity == "error"  # the neighbour's masks: joined off by one row
    shuffled = context_verdict(3.1, 3.08, own_match=0.15, rolled_match=0.15, **kwargs)
    assert shuffled.code == "TFD231" and shuffled.severity != "info"


def test_a_stall_needs_a_flat_window():
    falling = [(50, 1.2 * LN_V), (75, 1.1 * LN_V)]
    assert check_verdicts(LN_V, LN_V, 100, stall_tolerance=0.05, window=falling) == []
    flat = [(50, LN_V), (75, LN_V)]
    [stall] = check_verdicts(LN_V, LN_V, 100, stall_tolerance=0.05, window=flat, unigram_entropy=0.5 * LN_V)
    assert stall.code == "TFD225" and stall.evidence["window_start"] == 50 and "not even" in stall.message
    [uniform] = check_verdicts(LN_V, LN_V, 100, stall_tolerance=0.05, window=flat, unigram_entropy=0.99 * LN_V)
    assert "near ln(V)" in uniform.message


def _init(**kwargs):
    values = dict(
        observed=0.4 * LN_V,
        expected=LN_V,
        recomputed=0.4 * LN_V,
        logit_std=1.5,
        supervised_frac=1.0,
        copy_rate=0.05,
        probability_rows=0.0,
        log_probability_rows=0.0,
        supervised=128.0,
        positions=128.0,
        label_rows=8.0,
        vocab=V,
        repeat_rate=0.04,
    )
    values.update(kwargs)
    return InitLoss(**values)


@pytest.mark.parametrize(
    "case, severity, pretrained",
    [
        ({}, "info", True),  # the logits give the low loss: trained weights
        ({"copy_rate": 0.9}, None, False),  # ... by predicting the current input token: a leak
        ({"recomputed": LN_V}, None, False),  # the returned loss is not these logits' cross-entropy
    ],
)
def test_a_low_first_loss_is_info_only_when_the_logits_give_it_without_copying(case, severity, pretrained):
    [verdict] = classify_init_loss(_init(**case), init_tolerance=0.25, ignore_index=-100, shifted=True)
    assert verdict.code == "TFD223" and verdict.severity == severity and verdict.evidence["pretrained"] is pretrained
