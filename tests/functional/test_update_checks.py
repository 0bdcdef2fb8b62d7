import math

import pytest

from lightning_tfdebug.functional.update_checks import loss_fall_per_step, loss_still_falling, trained


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


def test_a_loss_that_varies_from_batch_to_batch_is_a_trained_model_s():
    assert trained([0.03, 0.05, 0.04])  # a trained model: its loss depends on each batch's content
    assert not trained([0.001, 0.0012, 0.0008])  # an untrained one scores every batch alike (about ln(V))
    assert not trained([math.nan, math.nan])  # unknown
    assert trained([math.nan, 0.02, 0.03])
    assert trained([0.013, 0.02, 0.035]) and not trained([0.0007, 0.0013, 0.02])  # the median of the streak decides
