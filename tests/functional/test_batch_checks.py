import pytest
import torch

from lightning_tfdebug.functional.batch_checks import (
    STREAM_REPEAT_WINDOW,
    BatchPaths,
    LengthWindow,
    RepeatTracker,
    ValueRules,
    batch_metrics,
    drift_verdicts,
    too_long,
    value_verdicts,
)
from lightning_tfdebug.functional.batches import Drift, FieldSpec, token_statistics, unpack_statistics

PATHS = BatchPaths("input_ids", "attention_mask", "labels")
RULES = ValueRules(vocab_size=10, context=6, ignore_index=-100, bos_id=1, eos_id=2, max_truncated_fraction=0.5)


def stats(ids, mask=None, labels=None, rules=RULES):
    vector = token_statistics(
        ids,
        mask,
        labels,
        vocab_size=rules.vocab_size,
        ignore_index=rules.ignore_index,
        bos_id=rules.bos_id,
        eos_id=rules.eos_id,
        max_length=rules.context,
    )
    return unpack_statistics(vector.tolist())


def verdicts(s, **kwargs):
    kwargs.setdefault("has_mask", True)
    kwargs.setdefault("has_labels", True)
    return {v.code: v for v in value_verdicts(s, "Batch 0", PATHS, RULES, **kwargs)}


def test_a_healthy_batch_has_no_verdict_and_its_metrics():
    ids = torch.tensor([[1, 5, 6, 2, 0, 0], [1, 4, 2, 0, 0, 0]])
    mask = (torch.arange(6) < torch.tensor([[4], [3]])).long()
    labels = ids.masked_fill(mask == 0, -100)
    s = stats(ids, mask, labels)
    assert verdicts(s) == {}
    metrics = batch_metrics(s, RULES, has_labels=True)
    assert metrics == pytest.approx(
        {
            "batch_guard/width": 6,
            "batch_guard/length_mean": 3.5,
            "batch_guard/pad_frac": 5 / 12,
            "batch_guard/ignored_frac": 5 / 12,
            "batch_guard/truncated_frac": 0.0,
        }
    )


def test_crash_verdicts_name_the_key_and_the_first_bad_value():
    ids = torch.tensor([[1, 5, 6, 2], [1, 12, 2, 0]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 3, 0]])
    labels = torch.tensor([[5, 6, -1, -100], [1, 2, 3, -100]])
    found = verdicts(stats(ids, mask, labels), crash_only=True)
    assert set(found) == {"TFD110", "TFD112", "TFD113"}
    assert (
        "'input_ids' holds 1 token id(s) outside [0, 10); the first is 12 at row 1, position 1"
        in found["TFD110"].message
    )
    assert found["TFD112"].evidence == {"key": "attention_mask", "count": 1.0, "example": 3.0}
    assert "(e.g. -1)" in found["TFD113"].message


def test_target_and_convention_verdicts():
    ids = torch.tensor([[3, 2, 5, 2, 4, 4], [1, 4, 4, 4, 4, 4]])  # no BOS; two EOS, tokens after; no EOS and full
    mask = torch.tensor([[1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1]])
    labels = ids.clone()  # the padding position is supervised
    found = verdicts(stats(ids, mask, labels))
    assert set(found) == {"TFD115", "TFD116", "TFD117", "TFD118"}
    assert found["TFD115"].hint == "Set labels[attention_mask == 0] = -100 in the collate function."
    truncated = verdicts(stats(torch.tensor([[1, 4, 4, 4, 4, 4], [1, 5, 5, 5, 5, 5]])), has_mask=False)
    assert set(truncated) == {"TFD119"} and truncated["TFD119"].evidence["truncated_frac"] == 1.0
    ignored = verdicts(stats(torch.tensor([[1, 2]]), None, torch.full((1, 2), -100)), has_mask=False)
    assert set(ignored) == {"TFD114"}


def test_drift_and_length_verdicts_from_host_metadata():
    [missing, extra] = drift_verdicts(
        [Drift("missing", "labels", "int64", "absent"), Drift("extra", "ids2", "absent", "int64[2]")], "B", False
    )
    assert (missing.code, missing.severity, missing.evidence["key"]) == ("TFD101", "error", "labels")
    assert (extra.code, extra.severity) == ("TFD102", "warning")
    assert "learned from the first batches" in extra.message
    assert too_long("B", "input_ids", FieldSpec("int64", (2, 6)), 6) is None
    verdict = too_long("B", "input_ids", FieldSpec("int64", (2, 7)), 6)
    assert verdict.code == "TFD111" and verdict.evidence == {"key": "input_ids", "shape": [2, 7], "max_length": 6}
    assert too_long("B", None, None, 6) is None and too_long("B", "x", FieldSpec("int64", (2, 9)), None) is None


def test_repeats_within_an_epoch_and_in_a_stream_only_when_close():
    tracker = RepeatTracker(max_repeated_fraction=0.1)
    out = [tracker.add(0, step, 7 if step else 5, stream=False) for step in range(5)]
    assert out[:4] == [None] * 4 and out[4].code == "TFD121"  # three repeats are needed
    assert out[4].evidence == {"epoch": 0, "checked": 5, "repeated": 3, "step": 2, "repeats_step": 1}
    assert tracker.add(1, 4, 7, stream=False) is None and tracker.checked == 1  # a new epoch starts afresh
    stream = RepeatTracker()
    prints = list(range(STREAM_REPEAT_WINDOW + 2)) * 3  # a stream that cycles, far apart
    assert all(stream.add(0, step, p, stream=True) is None for step, p in enumerate(prints))


def test_length_window_against_the_first_window():
    window = LengthWindow(size=2, tolerance=0.5)
    short = {"sequences": 4.0, "length_sum": 24.0, "length_sq_sum": 144.0}
    long = {"sequences": 4.0, "length_sum": 80.0, "length_sq_sum": 1600.0}
    assert [window.add(short, "B") for _ in range(4)] == [None] * 4  # the reference, then a window like it
    assert window.add(long, "B") is None
    verdict = window.add(long, "B")
    assert verdict.code == "TFD120" and verdict.evidence["window_mean"] == 20.0


def test_decoded_examples_show_the_supervised_positions():
    from lightning_tfdebug.demo.data import ByteTokenizer
    from lightning_tfdebug.functional.batch_checks import decoded_examples

    rows = [[ord(c) for c in "hi!"]]
    lines = decoded_examples(ByteTokenizer(), rows, [[-100, ord("i"), ord("!")]], -100, rank=1)
    assert lines[0] == "First 1 sequences of the first training batch (rank 1):"
    assert lines[2] == "**0** (3 tokens) input: `'hi!'`"
    assert lines[3] == "  labels (2 supervised, · = ignored): `'·i!'`"
    assert len(decoded_examples(ByteTokenizer(), rows, None, -100)) == 4  # no label line
