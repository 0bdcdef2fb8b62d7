"""core/logits.py without a Trainer: the explanations of a batch without the named tensor, the argument checks, and
the next-token targets of token rows. The capture itself runs in tests/callbacks/test_loss_at_init*.py."""

import dataclasses

import pytest
import torch

from lightning_tfdebug.core.logits import check_capture_args, missing_field, row_targets
from lightning_tfdebug.primitives.batch import BatchKeys, StepBatch


def test_a_missing_field_is_explained_in_the_words_of_the_batch():
    assert missing_field({"ids": torch.zeros(1), "y": [1]}, "y") == "batch['y'] is a list, not a tensor"
    assert (
        missing_field({"ids": torch.zeros(1)}, "labels") == "the batch is a mapping with keys ['ids'], without 'labels'"
    )
    assert missing_field((torch.zeros(1),), 1) == "the batch is a tuple of 1 items, which has no tensor at 1"

    @dataclasses.dataclass
    class Batch:
        ids: torch.Tensor

    assert missing_field(Batch(torch.zeros(1)), "y") == "the batch is a Batch with fields ['ids'], without a tensor 'y'"
    assert missing_field(torch.zeros(1), "y") == "the batch is a Tensor without 'y'"


def test_the_capture_arguments_are_checked_at_construction():
    check_capture_args("inputs.labels", 0, "model.lm_head")
    check_capture_args(None, None, None)
    with pytest.raises(TypeError, match="`labels_key` must be a batch key"):
        check_capture_args("", None, None)
    with pytest.raises(TypeError, match="`input_key` must be a batch key"):
        check_capture_args(None, -1, None)
    with pytest.raises(TypeError, match="`logits_module` must be a submodule name"):
        check_capture_args(None, None, 3)


def test_token_rows_give_every_token_after_the_first_as_a_target_padding_left_out():
    rows = torch.tensor([[5, 6, 7, 0], [8, 9, 0, 0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    view = StepBatch({"input_ids": rows, "attention_mask": mask}, BatchKeys())
    assert row_targets(view, -100).tolist() == [[6, 7, -100], [9, -100, -100]]
    assert row_targets(StepBatch({"input_ids": rows}, BatchKeys()), -100).tolist() == rows[:, 1:].tolist()
    assert row_targets(StepBatch({"x": torch.randn(2, 3)}, BatchKeys()), -100) is None
    assert row_targets(None, -100) is None
