"""One reading of batches and outputs: the same fields found in every batch shape users write, once per step."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from lightning_tfdebug.core.batch import step_batch, step_rng_state
from lightning_tfdebug.primitives.batch import BatchKeys, StepBatch, flatten_batch, logits_of, loss_of, read_batch

try:
    from transformers import BatchEncoding
except ImportError:  # pragma: no cover - transformers is a test dependency
    BatchEncoding = None


def lm_batch(rows: int = 2, width: int = 5):
    ids = torch.arange(rows * width).reshape(rows, width) % 7 + 1
    mask = torch.ones(rows, width, dtype=torch.long)
    mask[0, -2:] = 0  # two padding positions in row 0
    labels = ids.clone()
    labels[mask == 0] = -100
    return ids, mask, labels


@dataclass
class DataclassBatch:
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    labels: torch.Tensor
    sample_ids: list


def shapes():
    ids, mask, labels = lm_batch()
    out = {
        "dict": {"input_ids": ids, "attention_mask": mask, "labels": labels},
        "nested dict": {"inputs": {"input_ids": ids, "attention_mask": mask}, "labels": labels},
        "dataclass": DataclassBatch(ids, mask, labels, ["a", "b"]),
    }
    if BatchEncoding is not None:
        out["BatchEncoding"] = BatchEncoding({"input_ids": ids, "attention_mask": mask, "labels": labels})
    return out


@pytest.mark.parametrize("name", list(shapes()))
def test_ids_mask_and_labels_are_found_in_every_batch_shape(name):
    batch = shapes()[name]
    ids, mask, labels = lm_batch()
    fields = read_batch(batch)
    assert torch.equal(fields.input_ids, ids)
    assert torch.equal(fields.attention_mask, mask)
    assert torch.equal(fields.labels, labels)
    assert fields.position_ids is None
    assert fields.paths["input_ids"].endswith("input_ids")


def test_a_tuple_batch_gives_ids_and_labels_by_position_also_flattened():
    ids, _, labels = lm_batch()
    fields = read_batch((ids, labels))
    assert fields.ids_by_position and fields.paths == {
        "input_ids": "0",
        "attention_mask": None,
        "labels": "1",
        "position_ids": None,
    }
    flat = read_batch((ids, labels.reshape(-1)))  # targets flattened to (N*T,) still pair with the ids
    assert flat.paths["labels"] == "1"
    other = read_batch((ids, torch.zeros(3, dtype=torch.long)))  # a class label per row is not token labels
    assert other.labels is None


def test_given_keys_win_and_name_a_dotted_path_a_leaf_or_a_tuple_position():
    ids, mask, labels = lm_batch()
    batch = {"src": {"tok": ids, "pad": mask}, "tgt": labels, "pos": torch.arange(5).expand(2, 5)}
    fields = read_batch(batch, BatchKeys(input_key="src.tok", mask_key="pad", labels_key="tgt"))
    assert fields.paths == {
        "input_ids": "src.tok",
        "attention_mask": "src.pad",
        "labels": "tgt",
        "position_ids": "pos",
    }
    assert read_batch((ids, labels, mask), BatchKeys(mask_key=2)).paths["attention_mask"] == "2"
    assert read_batch(batch, BatchKeys(input_key="missing")).input_ids is None


def test_names_are_matched_in_priority_then_batch_order_and_a_given_name_must_be_unique():
    ids, mask, labels = lm_batch()
    # `ids` and `tokens` both name ids: `tokens` comes first in the names' priority, not in the batch's order
    batch = {"ids": ids + 1, "text": ["a", "b"], "enc": {"tokens": ids}, "dec": {"tokens": ids + 2}, "mask": mask}
    fields = read_batch(batch)
    assert fields.paths["input_ids"] == "enc.tokens" and torch.equal(fields.input_ids, ids)  # the first of two
    assert fields.paths["attention_mask"] == "mask"
    assert read_batch(batch, BatchKeys(input_key="tokens")).input_ids is None  # two leaves end in `tokens`
    assert read_batch(batch, BatchKeys(input_key="dec.tokens")).paths["input_ids"] == "dec.tokens"
    # a leaf that is not a tensor is never a field, whatever its name
    assert read_batch({"input_ids": ids, "labels": [1, 2], "targets": labels}).paths["labels"] == "targets"
    assert flatten_batch({"a": {"b": [ids, "t"]}, "c": ()}) == {"a.b.0": ids, "a.b.1": "t", "c": ()}


def test_each_new_batch_is_read_anew_when_its_structure_changes_mid_run():
    """step_batch keeps nothing from one batch to the next: a batch whose keys move is read as it is."""

    class Trainer:
        pass

    trainer, (ids, mask, labels) = Trainer(), lm_batch()
    batches = [
        {"input_ids": ids, "attention_mask": mask, "labels": labels},
        {"input_ids": ids, "attention_mask": mask, "labels": labels},
        {"inputs": {"input_ids": ids}, "labels": labels.int()},  # nested, no mask
        (ids, labels),  # by position
        {"input_ids": ids.float(), "labels": torch.tensor([0, 1])},  # float features, a class per row
        {"input_ids": ids, "attention_mask": mask, "labels": labels},
    ]
    expected = [
        ("input_ids", "attention_mask", "labels"),
        ("input_ids", "attention_mask", "labels"),
        ("inputs.input_ids", None, "labels"),
        ("0", None, "1"),
        (None, None, "labels"),
        ("input_ids", "attention_mask", "labels"),
    ]
    for batch, paths in zip(batches, expected):
        view = step_batch(trainer, batch)
        assert step_batch(trainer, batch) is view  # shared within the step
        assert (view.fields.paths["input_ids"], view.fields.paths["attention_mask"], view.fields.paths["labels"]) == (
            paths
        )
        if paths[0] is not None:
            assert view.input_ids is not None and view.input_ids.data_ptr() == ids.data_ptr()


def test_float_features_are_not_token_ids():
    fields = read_batch({"x": torch.randn(2, 4), "y": torch.tensor([0, 1])})
    assert fields.input_ids is None and fields.paths["labels"] == "y"  # class labels by name are still labels


def test_bad_keys_are_refused_with_the_argument_named():
    with pytest.raises(TypeError, match="`mask_key` must be a non-empty string"):
        BatchKeys(mask_key="")
    with pytest.raises(TypeError, match="`ignore_index` must be an integer"):
        BatchKeys(ignore_index=1.5)


def test_counts_come_from_the_mask_and_the_labels_once_per_step():
    ids, mask, labels = lm_batch()

    class Trainer:  # step_batch keeps its cache on the trainer object; any object with a __dict__ serves
        pass

    trainer = Trainer()
    batch = {"input_ids": ids, "attention_mask": mask, "labels": labels}
    view = step_batch(trainer, batch)
    assert isinstance(view, StepBatch)
    assert view.samples == 2 and view.positions == 10
    assert int(view.tokens()) == 8 and int(view.supervised()) == 8
    assert step_batch(trainer, batch) is view  # the second callback on the same step reuses the reading
    assert view.tokens() is view.tokens()  # computed once
    assert step_batch(trainer, batch, BatchKeys(ignore_index=0)) is not view  # other settings, own reading
    assert step_batch(trainer, dict(batch)) is not view  # the next batch gets a fresh reading
    no_mask = step_batch(trainer, (ids, labels))
    assert no_mask.tokens() == 10 and no_mask.attention_mask is None


def test_flatten_batch_keeps_lists_of_plain_values_as_one_leaf():
    ids, mask, labels = lm_batch()
    leaves = flatten_batch(DataclassBatch(ids, mask, labels, ["a", "b"]))
    assert list(leaves) == ["input_ids", "attention_mask", "labels", "sample_ids"]


def test_logits_and_loss_are_found_in_what_models_and_steps_return():
    logits = torch.randn(2, 3, 7)
    loss = torch.tensor(1.5)
    assert logits_of(logits) is logits
    assert logits_of({"logits": logits, "loss": loss}) is logits
    assert logits_of((loss, logits)) is logits  # the 0-d loss is skipped
    assert logits_of((logits, loss)) is logits
    assert logits_of((logits,), structured_only=True) is None
    assert logits_of(torch.arange(4).reshape(2, 2)) is None  # integer outputs are not logits
    assert loss_of(loss) is loss and loss_of({"loss": loss}) is loss
    assert loss_of(torch.randn(3)) is None and loss_of({"log": 1}) is None

    class Output:
        def __init__(self):
            self.logits, self.loss = logits, loss

    assert logits_of(Output()) is logits and loss_of(Output()) is loss


def test_step_rng_state_is_one_copy_per_batch_and_never_an_earlier_batchs():
    class Trainer:  # what the helper reads of a Trainer: the step
        global_step = 3

    trainer, batch = Trainer(), {"input_ids": torch.zeros(2, 3, dtype=torch.long)}
    first = step_rng_state(trainer, batch, 0)
    assert torch.equal(first, torch.get_rng_state())
    torch.rand(5)  # the step draws: the batch's state stays the one taken at its start
    assert step_rng_state(trainer, batch, 0) is first
    assert not torch.equal(step_rng_state(trainer, dict(batch), 0), first)  # another batch object: a new copy
    later = step_rng_state(trainer, batch, 1)  # the same object at another index (a dataloader that reuses it)
    assert later is not first and torch.equal(later, torch.get_rng_state())
    trainer.global_step = 4
    assert step_rng_state(trainer, batch, 1) is not later
