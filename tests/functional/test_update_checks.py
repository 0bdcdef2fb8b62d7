import math

import pytest
import torch

from lightning_tfdebug.functional.update_checks import (
    below_resolution,
    expected_step,
    label_counts,
    loss_fall_per_step,
    loss_still_falling,
    outside_optimizers,
)


def test_the_fall_of_the_loss_per_step_is_a_fraction_of_the_loss():
    assert loss_fall_per_step([(10, 2.0), (20, 1.9), (30, 1.8)]) == pytest.approx(0.2 / 2.0 / 20)
    assert loss_fall_per_step([(10, 2.0), (30, 2.1)]) < 0  # rising
    assert math.isnan(loss_fall_per_step([(10, 2.0)]))
    assert math.isnan(loss_fall_per_step([(10, math.nan), (20, 1.0)]))
    # a fine-tune whose loss keeps falling (0.4% per step, measured) against a run from scratch with the learning rate
    # 100x too low (0.02% per step): the updates of the first move the loss, those of the second barely do
    assert loss_still_falling([(10, 0.96), (20, 0.91), (30, 0.88)])
    assert not loss_still_falling([(10, 5.552), (20, 5.545), (30, 5.537)])
    assert not loss_still_falling([(10, 1.0)])  # unknown: the ratio alone decides


def test_label_counts_skip_ignored_and_out_of_range_labels_without_a_sync():
    labels = torch.tensor([[1, 2, 2, -100], [3, 7, 2, 1]])
    counts = label_counts(labels, 5, -100, torch.device("cpu"))
    assert counts.tolist() == [0.0, 2.0, 3.0, 1.0, 0.0]  # 7 is outside the vocabulary, -100 ignored
    assert label_counts(None, 4, -100, torch.device("cpu")).tolist() == [0.0] * 4
    assert label_counts(torch.rand(2, 3), 4, -100, torch.device("cpu")).sum() == 0  # not class indices


def test_outside_optimizers_compares_parameters_by_identity():
    body, head = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    optimizer = torch.optim.AdamW(body.parameters(), lr=1e-3)
    params = [*body.parameters(), *head.parameters()]
    assert outside_optimizers(params, [optimizer]) == [False, False, True, True]
    # no parameter held by any optimizer (copies, flattened views): cannot be told
    assert outside_optimizers(list(head.parameters()), [optimizer]) is None
    assert outside_optimizers(params, []) is None


def test_adam_at_1e_8_cannot_move_fp32_gains_of_one_but_moves_small_matrices():
    eps32, eps16 = torch.finfo(torch.float32).eps, torch.finfo(torch.bfloat16).eps
    assert expected_step(1e-8, adaptive=True, grad_rms=5.0) == 1e-8
    assert expected_step(1e-2, adaptive=False, grad_rms=1e-3) == pytest.approx(1e-5)
    assert below_resolution(1e-8, weight_rms=1.0, eps=eps32)  # half the spacing at 1.0: 6e-8
    assert not below_resolution(1e-8, weight_rms=0.02, eps=eps32)  # 1.2e-9
    assert below_resolution(1e-3, weight_rms=1.0, eps=eps16)  # bf16 gains: 3.9e-3
    assert not below_resolution(1e-8, weight_rms=0.0, eps=eps32)  # zero weights show any step


def test_the_resolution_is_where_fp32_really_rounds_back():
    ones = torch.ones(4)
    half = torch.finfo(torch.float32).eps / 2
    # a step up from 1.0 by less than half the spacing there rounds back; a little more lands on the next float
    assert torch.equal(ones + 0.9 * half, ones) and not torch.equal(ones + 1.1 * half, ones)
