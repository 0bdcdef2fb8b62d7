import math

import pytest
import torch

from lightning_tfdebug.functional.update_checks import label_counts, loss_fall_per_step, loss_still_falling


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
