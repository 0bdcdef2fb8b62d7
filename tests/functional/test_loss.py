import math

import pytest
import torch
import torch.nn.functional as F

from lightning_tfdebug.functional.loss import align, copy_sums, init_loss_sums, sample_rows, uniform_loss


def test_uniform_loss_is_ln_v_and_label_smoothing_does_not_change_it():
    assert uniform_loss(259) == pytest.approx(math.log(259))
    logits = torch.zeros(4, 7)
    target = torch.tensor([0, 3, 6, 2])
    for eps in (0.0, 0.1, 0.5):
        assert F.cross_entropy(logits, target, label_smoothing=eps).item() == pytest.approx(uniform_loss(7))
    with pytest.raises(ValueError, match="vocab_size"):
        uniform_loss(1)


def test_align_shifts_labels_without_copying_the_logits():
    logits = torch.randn(2, 5, 11)
    labels = torch.arange(10).view(2, 5)
    rows, targets = align(logits, labels, shift_labels=True)
    assert rows.data_ptr() == logits.data_ptr() and rows.shape == (10, 11)
    assert targets.tolist() == [1, 2, 3, 4, -100, 6, 7, 8, 9, -100]
    _, same = align(logits, labels, shift_labels=False)
    assert same.tolist() == list(range(10))
    with pytest.raises(ValueError, match="do not match"):
        align(logits, labels[:, :3], shift_labels=True)
    with pytest.raises(ValueError, match="time dimension"):
        align(torch.randn(4, 3), torch.zeros(4, dtype=torch.long), shift_labels=True)


def test_sample_rows_covers_every_position_of_the_sequence():
    idx = sample_rows(64 * 100, 640, torch.device("cpu"), period=64)
    assert len(idx) <= 640 and len(set((idx % 64).tolist())) == 64
    assert sample_rows(10, 100, torch.device("cpu")).tolist() == list(range(10))


@pytest.mark.parametrize("shift", [True, False])
@pytest.mark.parametrize("eps", [0.0, 0.1])
def test_recomputed_cross_entropy_matches_torch(shift, eps):
    torch.manual_seed(0)
    logits = torch.randn(3, 6, 13) * 2
    labels = torch.randint(0, 13, (3, 6))
    labels[0, 2:] = -100
    stats = init_loss_sums(logits, labels, shift_labels=shift, label_smoothing=eps, max_rows=10_000)
    if shift:
        ref = F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), label_smoothing=eps)
        n = (labels[:, 1:] != -100).sum()
    else:
        ref = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), label_smoothing=eps)
        n = (labels != -100).sum()
    assert (stats["ce_sum"] / stats["ce_count"]).item() == pytest.approx(ref.item(), rel=1e-5)
    assert stats["supervised"].item() == n.item() and stats["positions"].item() == labels.numel()
    per_row_var = logits.flatten(0, 1).var(-1, unbiased=False).sum()
    assert stats["var_sum"].item() == pytest.approx(per_row_var.item(), rel=1e-5)
    assert stats["prob_rows"].item() == 0 and stats["logprob_rows"].item() == 0


def test_probabilities_and_log_probabilities_are_recognised():
    logits = torch.randn(2, 8, 50)
    labels = torch.randint(0, 50, (2, 8))
    assert init_loss_sums(logits.softmax(-1), labels)["prob_rows"].item() == 16
    assert init_loss_sums(logits.log_softmax(-1), labels)["logprob_rows"].item() == 16
    # a near-uniform bf16 softmax still counts
    assert init_loss_sums(logits.softmax(-1).bfloat16(), labels)["prob_rows"].item() == 16


def test_no_supervised_labels():
    stats = init_loss_sums(torch.randn(2, 4, 9), torch.full((2, 4), -100))
    assert stats["supervised"].item() == 0 and stats["ce_count"].item() == 0 and stats["ce_sum"].item() == 0


def test_copy_sums_compare_the_argmax_with_the_current_token():
    inputs = torch.tensor([[1, 2, 2, 3], [4, 4, 4, 0]])
    copying = F.one_hot(inputs, 5).float()  # predicts the current token everywhere
    stats = copy_sums(copying, inputs)
    assert stats["count"].item() == 6  # the last position of each row has no next token
    assert stats["copies"].item() == 6
    assert stats["repeats"].item() == 3  # 2->2, 4->4, 4->4
    nxt = F.one_hot(torch.tensor([[2, 2, 3, 0], [4, 4, 0, 0]]), 5).float()  # a perfect next-token predictor
    assert copy_sums(nxt, inputs)["copies"].item() == 3  # copies only where the data repeats
    mask = torch.tensor([[True, True, False, False], [True, True, True, True]])
    assert copy_sums(copying, inputs, mask)["count"].item() == 5
    with pytest.raises(ValueError, match="do not match"):
        copy_sums(copying, inputs[:, :2])


def test_step_sums_take_each_phase_s_sums_and_nothing_else():
    from lightning_tfdebug.functional.loss import OTHER_ALIGNMENT, PHASE_SUMS, init_loss_sums, step_sums

    torch.manual_seed(0)
    logits, tokens = torch.randn(4, 9, 20), torch.randint(0, 20, (4, 9))
    options = dict(shift_labels=True, vocab_size=20)
    init = step_sums("init", logits, tokens, tokens, **options)
    assert set(init) == set(PHASE_SUMS["init"])  # both alignments, the copy rate and the mask share
    assert init["ce_sum"] == init_loss_sums(logits, tokens)["ce_sum"]
    assert init[OTHER_ALIGNMENT + "ce_sum"] == init_loss_sums(logits, tokens, shift_labels=False)["ce_sum"]
    compare = step_sums("compare", logits, tokens, tokens, **options)
    assert set(compare) - {"tx_other"} == set(PHASE_SUMS["compare"])  # which alignment: decided, not reduced
    check = step_sums("check", logits, tokens, tokens, late=True, **options)
    assert set(check) - {"tx_other"} == set(PHASE_SUMS["check"])
    assert set(step_sums("check", logits, tokens, None, **options)).isdisjoint({"copies", "own_match", "late_mask_top"})
    masked = step_sums("check", logits, tokens, tokens, masked_lm=True, **options)  # aligned labels: one alignment
    assert not any(k.startswith(OTHER_ALIGNMENT) for k in masked)
    classifier = step_sums("init", torch.randn(8, 5), torch.randint(0, 5, (8,)), None, shift_labels=False, vocab_size=5)
    assert OTHER_ALIGNMENT + "ce_sum" not in classifier and "copies" not in classifier


def test_label_frequencies_count_the_first_batches_then_keep_only_the_entropy():
    from lightning_tfdebug.functional.loss import LabelFrequencies, unigram_entropy

    frequencies = LabelFrequencies(batches=2)
    frequencies.add(torch.tensor([[1, 2, -100]]), None, torch.device("cpu"), -100)  # V not known yet: not counted
    assert frequencies.payload is None and frequencies.counted == 0
    frequencies.add(torch.tensor([[1, 2, -100]]), 4, torch.device("cpu"), -100)
    frequencies.add(torch.tensor([[1.0, 2.0]]), 4, torch.device("cpu"), -100)  # float targets count as no labels
    frequencies.add(torch.tensor([[3, 3]]), 4, torch.device("cpu"), -100)  # past the first two batches
    assert frequencies.payload.tolist() == [0.0, 1.0, 1.0, 0.0] and not frequencies.done
    frequencies.receive(float(unigram_entropy(frequencies.payload)))
    assert frequencies.done and frequencies.payload is None and frequencies.entropy == pytest.approx(math.log(2) + 0.25)
    frequencies.restore(None)
    assert frequencies.entropy is None and frequencies.counted == 0
