import pytest
import torch
import torch.nn.functional as F

from lightning_tfdebug.functional.probes import (
    alignment_losses,
    causal_valid_positions,
    classify_alignment,
    labels_relation,
    logit_tolerance,
    max_change,
    padding_side,
    relative_tolerance,
    replace_after,
)


def test_tolerance_grows_with_coarser_dtypes():
    assert relative_tolerance(torch.float32) < relative_tolerance(torch.float16) < relative_tolerance(torch.bfloat16)
    logits = torch.tensor([[[0.5, -2.0]]])
    assert float(logit_tolerance(logits)) == pytest.approx(2.0 * relative_tolerance(torch.float32))
    assert float(logit_tolerance(logits, torch.bfloat16)) == pytest.approx(2.0 * relative_tolerance(torch.bfloat16))


def test_max_change_finds_the_largest_difference_among_valid_positions():
    before = torch.zeros(2, 5, 3)
    after = before.clone()
    after[1, 2, 0] = 0.25
    after[0, 4, 1] = 9.0  # outside the valid positions below
    valid = causal_valid_positions(2, 5, cut=2, device=torch.device("cpu"))
    change, where = max_change(before, after, valid)
    assert float(change) == 0.25
    assert where.tolist() == [1, 2]


def test_replace_after_changes_every_later_token_and_nothing_before():
    ids = torch.tensor([[1, 2, 3, 4, 5, 6], [6, 5, 4, 3, 2, 1]])
    out = replace_after(ids, cut=2, generator=torch.Generator().manual_seed(0))
    assert torch.equal(out[:, :3], ids[:, :3])
    assert bool((out[:, 3:] != ids[:, 3:]).all())
    assert set(out.unique().tolist()) <= set(ids.unique().tolist())


def test_alignment_losses_match_a_hand_computation():
    torch.manual_seed(0)
    logits = torch.randn(2, 4, 7)
    labels = torch.tensor([[1, 2, 3, -100], [4, 5, -100, -100]])
    losses = alignment_losses(logits, labels)
    shifted = F.cross_entropy(logits[:, :-1].reshape(-1, 7), labels[:, 1:].reshape(-1), ignore_index=-100)
    unshifted = F.cross_entropy(logits.reshape(-1, 7), labels.reshape(-1), ignore_index=-100)
    shifted2 = F.cross_entropy(logits[:, :-2].reshape(-1, 7), labels[:, 2:].reshape(-1), ignore_index=-100)
    assert float(losses["shifted"]) == pytest.approx(float(shifted))
    assert float(losses["unshifted"]) == pytest.approx(float(unshifted))
    assert float(losses["shifted2"]) == pytest.approx(float(shifted2))
    assert torch.isnan(alignment_losses(logits[:, :2], labels[:, :2])["shifted2"])  # too short for t+2


def test_labels_relation():
    ids = torch.tensor([[5, 6, 7, 8]])
    assert labels_relation(ids, torch.tensor([[5, 6, 7, -100]])) == "inputs"
    assert labels_relation(ids, torch.tensor([[6, 7, 8, -100]])) == "preshifted"
    assert labels_relation(ids, torch.tensor([[1, 1, 1, 1]])) == "other"
    assert labels_relation(ids, torch.full((1, 4), -100)) == "other"


@pytest.mark.parametrize(
    "returned, relation, expected",
    [
        (2.0, "inputs", "next"),
        (2.5, "inputs", "current"),
        (2.0, "preshifted", "next_next"),
        (2.5, "preshifted", "next"),
        (3.0, "inputs", "unknown"),
    ],
)
def test_classify_alignment(returned, relation, expected):
    alignment, _ = classify_alignment(returned, shifted=2.0, unshifted=2.5, relation=relation, rtol=1e-5)
    assert alignment == expected


def test_classify_alignment_is_unknown_when_the_alignments_cannot_be_told_apart():
    assert classify_alignment(2.0, 2.0, 2.0000001, "inputs", 1e-5)[0] == "unknown"
    # the returned loss matches t+1, but t+2 gives the same value on this batch: undecided
    assert classify_alignment(2.0, 2.0, 2.5, "inputs", 1e-5, shifted2=2.0000001)[0] == "unknown"


@pytest.mark.parametrize(
    "relation, expected",
    [
        ("inputs", ("next_next", "shifted2")),
        ("preshifted", ("unknown", "shifted2")),
        ("other", ("unknown", "shifted2")),
    ],
)
def test_classify_alignment_two_tokens_ahead(relation, expected):
    # labels equal to the inputs, shifted twice by the training step: position t scored against token t+2
    assert classify_alignment(3.0, shifted=2.0, unshifted=2.5, relation=relation, rtol=1e-5, shifted2=3.0) == expected
    # NaN (sequences too short) leaves the third alignment out
    assert classify_alignment(2.0, 2.0, 2.5, relation, 1e-5, shifted2=float("nan"))[1] == "shifted"


def test_padding_side():
    assert padding_side(torch.tensor([[1, 1, 0], [1, 1, 1]])) == "right"
    assert padding_side(torch.tensor([[0, 1, 1], [1, 1, 1]])) == "left"
    assert padding_side(torch.ones(2, 3)) == "none"
