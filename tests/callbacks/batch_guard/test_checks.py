import pytest
import torch

from lightning_tfdebug.callbacks.batch_guard import readings
from lightning_tfdebug.callbacks.batch_guard import repeat_checks as repeats
from lightning_tfdebug.callbacks.batch_guard import schema_checks as schema
from lightning_tfdebug.callbacks.batch_guard import special_token_checks as special
from lightning_tfdebug.callbacks.batch_guard import value_checks as values
from lightning_tfdebug.callbacks.batch_guard.readings import STREAM_REPEAT_WINDOW, BatchPaths, ValueRules
from lightning_tfdebug.callbacks.batch_guard.repeat_checks import LengthWindow, RepeatPeriod, RepeatTracker
from lightning_tfdebug.callbacks.batch_guard.schema_checks import drift_verdicts, too_long
from lightning_tfdebug.callbacks.batch_guard.special_token_checks import SpecialTokenTally
from lightning_tfdebug.callbacks.batch_guard.value_checks import batch_metrics, value_verdicts
from lightning_tfdebug.demo.data import ByteTokenizer
from lightning_tfdebug.functional import batches
from lightning_tfdebug.functional.batch_schema import Drift, FieldSpec
from lightning_tfdebug.functional.batches import (
    STAT_NAMES,
    special_token_statistics,
    token_statistics,
    unpack_statistics,
)
from lightning_tfdebug.functional.special_ids import SpecialIds, learn_special_ids
from lightning_tfdebug.rules import rule


def severity(verdict):
    """The severity a verdict's finding takes: its own, else its rule's."""
    return verdict.severity or rule(verdict.code).severity


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
    assert (missing.code, severity(missing), missing.evidence["key"], missing.key) == (
        "TFD101",
        "error",
        "labels",
        "labels",
    )
    assert (extra.code, severity(extra)) == ("TFD102", "warning")
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
    from lightning_tfdebug.callbacks.batch_guard.value_checks import decoded_examples
    from lightning_tfdebug.demo.data import ByteTokenizer

    rows = [[ord(c) for c in "hi!"]]
    lines = decoded_examples(ByteTokenizer(), rows, [[-100, ord("i"), ord("!")]], -100, rank=1)
    assert lines[0] == "First 1 sequences of the first training batch (rank 1):"
    assert lines[2] == "**0** (3 tokens) input: `'hi!'`"
    assert lines[3] == "  labels (2 supervised, · = ignored): `'·i!'`"
    assert len(decoded_examples(ByteTokenizer(), rows, None, -100)) == 4  # no label line


# ------------------------------------------------------------------------------------------------ mask holes (TFD122)
def hole_verdict(ids, mask, position_ids=None, packed_keys=()):
    from lightning_tfdebug.callbacks.batch_guard.value_checks import mask_hole_verdict

    s = unpack_statistics(token_statistics(ids, mask, position_ids=position_ids).tolist())
    return mask_hole_verdict(s, "Batch 0", PATHS, has_mask=True, packed_keys=packed_keys)


def right_padded(rows, pad):
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(r)
        mask[i, : len(r)] = 1
    return ids, mask


EOS = 9  # a pad id that is also a real token: GPT-2 / Llama pad with EOS, which also separates documents


def test_a_mask_built_from_a_pad_id_that_is_also_a_real_token_has_holes():
    docs = [[3, 4, 5, EOS, 6, 7, EOS], [3, 5, EOS, 4, EOS], [6, 7, 8, 3, 4, 5, EOS]]
    ids, tokenizer_mask = right_padded(docs, EOS)
    # the tokenizer marks padding by position: the EOS inside the text is attended, no finding
    assert hole_verdict(ids, tokenizer_mask) is None
    verdict = hole_verdict(ids, (ids != EOS).long())
    assert verdict.code == "TFD122"
    assert verdict.evidence["rows"] == 2 and verdict.evidence["holes"] == 2
    assert verdict.evidence["first_hole"] == [0, 3] and verdict.evidence["first_hole_id"] == EOS
    assert f"input_ids != {EOS}" in verdict.message


def test_holes_in_a_left_padded_batch_and_a_masked_first_token_are_found():
    pad = 0  # id 0 is also a real token (GPT-2's "!")
    ids = torch.tensor([[pad, pad, 3, pad, 4, 5], [3, 4, pad, 5, 6, 7]])
    verdict = hole_verdict(ids, (ids != pad).long())
    assert verdict.evidence["rows"] == 2 and verdict.evidence["holes"] == 2
    # pad id = BOS: a right-padded row masked at both ends hides its first token
    bos = 1
    ids = torch.tensor([[bos, 3, 4, 5, 6], [bos, 3, 4, bos, bos], [bos, 5, bos, bos, bos]])
    verdict = hole_verdict(ids, (ids != bos).long())
    assert verdict.evidence["rows"] == 2 and verdict.evidence["first_hole"] == [1, 0]


def test_a_mask_that_hides_tokens_attended_elsewhere_in_the_row_is_named_as_such():
    ids, mask = right_padded([[3, 4, 5, 3, 4, 5, 6], [5, 6, 7, 5, 6], [3, 3, 4, 4]], 0)
    mask[:, 3] = 0  # a column zeroed by a transform: real tokens hidden
    verdict = hole_verdict(ids, mask)
    assert verdict.evidence["holes"] == 2 and verdict.evidence["holes_attended_in_row"] == 2
    assert "attended elsewhere in the same row" in verdict.message


def test_legitimately_non_contiguous_masks_are_left_alone():
    ids, mask = right_padded([[3, 4, 5, 6], [3, 4], [5]], 0)
    assert hole_verdict(ids, mask) is None  # right padding
    assert hole_verdict(ids.flip(1), mask.flip(1)) is None  # left padding
    assert hole_verdict(ids, torch.ones_like(ids)) is None  # no padding
    # packed: two documents per row separated by padding, positions restarting at each document
    ids = torch.tensor([[3, 4, 5, 0, 6, 7, 0, 0], [3, 4, 0, 5, 6, 7, 8, 0]])
    mask = (ids != 0).long()
    assert hole_verdict(ids, mask) is not None  # without anything saying it is packed, it looks like holes
    positions = torch.tensor([[0, 1, 2, 0, 0, 1, 0, 0], [0, 1, 0, 0, 1, 2, 3, 0]])
    assert hole_verdict(ids, mask, position_ids=positions) is None
    assert hole_verdict(ids, mask, packed_keys=("cu_seqlens",)) is None
    # Hugging Face's position ids for a left-padded batch (1 on padding) are not a packed layout
    left = torch.tensor([[0, 0, 3, 4], [3, 4, 5, 6]])
    left_mask = (left != 0).long()
    hf_positions = (left_mask.cumsum(-1) - 1).masked_fill(left_mask == 0, 1)
    s = unpack_statistics(token_statistics(left, left_mask, position_ids=hf_positions).tolist())
    assert s["position_resets"] == 0 and s["mask_holes"] == 0
    # segment ids (1, 2, 3 per document) are not a binary mask: TFD112's, not this check's
    assert hole_verdict(ids, torch.tensor([[1, 1, 1, 0, 2, 2, 0, 0], [1, 1, 0, 2, 2, 2, 2, 0]])) is None
    # a masked-LM position mask read as the attention mask: most of the text "masked", not holes
    g = torch.Generator().manual_seed(0)
    mlm = (torch.rand(4, 32, generator=g) < 0.15).long()
    assert hole_verdict(torch.randint(3, 9, (4, 32), generator=g), mlm) is None


# ---------------------------------------------------------------- TFD123: batches back sooner than the data allows
def feed(period, prints, length, **kwargs):
    verdicts = [period.add(step, p, length, **kwargs) for step, p in enumerate(prints)]
    return [v for v in verdicts if v is not None]


def test_batches_back_sooner_than_the_loader_length_are_named_with_the_trainer_setting():
    overfit = feed(RepeatPeriod(), [7] * 6, 237, per_epoch=1, setting="Trainer(overfit_batches=1)")
    assert len(overfit) == 3  # read 4, 5, 6: 1 different where 4, 5, 6 were allowed
    assert overfit[0].evidence | {} == {
        "read": 4, "distinct": 1, "repeats_within_epochs": 0, "loader_length": 237, "batches_per_epoch": 1,
        "setting": "Trainer(overfit_batches=1)", "step": 1, "repeats_step": 0,
    }  # fmt: skip
    assert (
        "Trainer(overfit_batches=1) is set" in overfit[0].message
        and "same 1 batch(es) of the 237" in overfit[0].message
    )
    # limit_train_batches=3 on an unshuffled loader: the same three batches every epoch
    limited = feed(RepeatPeriod(), [1, 2, 3] * 3, 100, per_epoch=3, setting="Trainer(limit_train_batches=3)")
    assert limited and limited[0].evidence["read"] == 6 and limited[0].evidence["distinct"] == 3
    # no setting: the data repeats by itself
    [first, *_] = feed(RepeatPeriod(), [5] * 5, 40)
    assert "ignores its index" in first.message


def test_epochs_of_a_small_dataset_repeat_at_their_length_and_stay_silent():
    assert feed(RepeatPeriod(), [1, 2, 3, 4] * 10, 4) == []  # unshuffled, 10 epochs
    g = torch.Generator().manual_seed(0)
    shuffled = [int(i) for _ in range(10) for i in torch.randperm(6, generator=g)]  # one sample per batch, shuffled
    assert feed(RepeatPeriod(), shuffled, 6) == []  # a sample may come back 1 batch later, across an epoch's end
    # a dataset with a few duplicated rows (one per batch): under max_repeated_fraction of the loader's length
    assert feed(RepeatPeriod(), [*range(38), 0, 1] * 3, 40) == []
    assert feed(RepeatPeriod(), [3] * 50, None) == []  # a stream: the length is unknown


def test_repeats_inside_short_epochs_add_up():
    # a Dataset ignoring its index, two batches per epoch: one repeat per epoch, never three in one (TFD121's)
    period, verdicts = RepeatPeriod(), []
    for epoch in range(4):
        verdicts += [period.add(2 * epoch + i, 9, 2, within_epoch=i == 1) for i in range(2)]
    found = [v for v in verdicts if v is not None]
    assert found and found[0].evidence["repeats_within_epochs"] == 3 and found[0].evidence["read"] == 6


# ---------------------------------------------------------------- TFD124: EOS in the inputs, never supervised
SPECIAL = SpecialIds(eos=(8,), pad=(8,), bos=(7,), source="`tokenizer`")


def tally_of(batches, ids=SPECIAL, aligned=True, **kwargs):
    tally = SpecialTokenTally(ids, **kwargs)
    out = []
    for batch in batches:
        fields = special_token_statistics(*batch, ids.ordered(), labels_aligned=aligned)
        host = {k: v.tolist() for k, v in fields.items()}
        out.append(tally.add(host, aligned, "labels", has_mask=True))
    return tally, [v for v in out if v is not None]


def causal(eos_supervised, rows=4, shift=False):
    ids = torch.tensor([[7, 3, 4, 5, 8, 8, 8], [7, 3, 8, 8, 8, 8, 8]] * (rows // 2))
    mask = torch.tensor([[1, 1, 1, 1, 1, 0, 0], [1, 1, 1, 0, 0, 0, 0]] * (rows // 2))
    labels = ids.masked_fill(mask == 0, -100) if eos_supervised else ids.masked_fill(ids == 8, -100)
    if shift:
        labels = torch.cat([labels[:, 1:], torch.full((rows, 1), -100)], 1)
    return ids, mask, labels


def test_an_eos_masked_with_the_padding_is_named_with_the_collator_pattern():
    tally, [verdict] = tally_of([causal(False)] * 4)
    # 4 EOS per batch among the real inputs, 75% of the real tokens supervised: 9 EOS expected after three batches
    assert verdict.code == "TFD124" and tally.done and tally.batches == 3
    assert verdict.evidence["eos_in_inputs"] == 12 and verdict.evidence["eos_supervised"] == 0
    assert verdict.evidence["pad_is_eos"] and verdict.evidence["labels_layout"] == "causal"
    assert "DataCollatorForLanguageModeling" in verdict.message and "attention_mask == 0" in verdict.hint
    _, [shifted] = tally_of([causal(False, shift=True)] * 4)  # labels shifted by the data: the same verdict
    assert shifted.evidence["labels_layout"] == "causal"


def test_eos_supervised_bos_unsupervised_masked_lm_and_few_eos_stay_silent():
    tally, found = tally_of([causal(True)] * 3)
    assert found == [] and tally.done and tally.batches == 1  # done at the first supervised EOS
    # BOS (7) never supervised (labels shifted by the data drop the first position); EOS supervised
    assert tally_of([causal(True, shift=True)] * 3)[1] == []
    # masked LM: 15% of the positions supervised with the original token where the input is the mask token
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(10, 100, (16, 20), generator=g)
    ids[:, -1] = 8  # an EOS-like end token in every row, never chosen for masking
    chosen = (torch.rand(ids.shape, generator=g) < 0.15) & (ids != 8)
    mlm = (ids.masked_fill(chosen, 103), torch.ones_like(ids), ids.masked_fill(~chosen, -100))
    tally, found = tally_of([mlm] * 8)
    assert found == [] and tally.done and tally.batches == 8
    # too few EOS for supervision to be expected: silent after the window
    assert tally_of([causal(False, rows=2)] * 3, max_batches=3, min_expected=20)[1] == []


def test_decoder_targets_without_eos_are_named_and_with_eos_are_not():
    sources = torch.tensor([[3, 4, 5, 8], [6, 8, 0, 0]] * 4)
    mask = (sources != 0).long()
    ids = SpecialIds(eos=(8,), pad=(0,))
    with_eos = torch.tensor([[9, 9, 8, -100], [9, 8, -100, -100]] * 4)
    assert tally_of([(sources, mask, with_eos)] * 2, ids, aligned=False)[1] == []
    [verdict] = tally_of([(sources, mask, with_eos.masked_fill(with_eos == 8, -100))] * 2, ids, aligned=False)[1]
    assert verdict.evidence["labels_layout"] == "targets" and not verdict.evidence["pad_is_eos"]


def test_special_ids_are_learned_from_the_first_source_that_names_them():
    class Tokenizer:
        eos_token_id, pad_token_id, sep_token_id = 2, 2, None

    class Config:
        eos_token_id, pad_token_id, bos_token_id, sep_token_id = [5, 6], 0, 1, 3

    ids = learn_special_ids([("`tokenizer`", Tokenizer()), ("model.config", Config())])
    assert (ids.eos, ids.pad, ids.sep, ids.bos, ids.source) == ((2,), (2,), (3,), (1,), "`tokenizer`")
    assert learn_special_ids([("`tokenizer`", None), ("model.config", Config())]).eos == (5, 6)
    assert learn_special_ids([("model.config", Config())], eos_id=9).eos == (9,)
    assert learn_special_ids([("demo", ByteTokenizer())]).ordered() == (258, 256, 257)  # eos_id / pad_id attributes


# ---------------------------------------------------------------- each rule on plain numbers


def plain(**values):
    """A statistics reading of plain numbers: every statistic 0 (none found) but those given."""
    s = dict.fromkeys(STAT_NAMES, 0.0)
    s.update(sequences=4.0, width=8.0, first_hole_id=-1.0, padding_id_min=-1.0, padding_id_max=-1.0)
    return {**s, **values}


@pytest.mark.parametrize(
    "rule, harmful, code, message",
    [
        (values.ids_outside_vocabulary, dict(ids_out_of_range=2, first_bad_id_value=12, first_bad_id_row=1,
         first_bad_id_col=3, ids_min=0, ids_max=12), "TFD110", "'input_ids' holds 2 token id(s) outside [0, 10); the "
         "first is 12 at row 1, position 3."),
        (values.mask_not_binary, dict(mask_non_binary=1, first_bad_mask_value=0.5), "TFD112",
         "'attention_mask' has 1 value(s) that are neither 0 nor 1 (e.g. 0.5)."),
        (values.labels_outside_vocabulary, dict(labels_out_of_range=3, first_bad_label_value=-1), "TFD113",
         "'labels' holds 3 label(s) outside [0, 10) that are not ignore_index=-100 (e.g. -1)."),
        (values.every_label_ignored, dict(labels_total=32, labels_ignored=32), "TFD114",
         "every label in 'labels' is ignore_index=-100; this batch teaches nothing"),
        (values.padding_supervised, dict(pad_supervised=5, pad_positions=9), "TFD115",
         "'labels' supervises 5 of 9 padding positions ('attention_mask' 0, label not ignore_index=-100)"),
        (values.sequences_without_bos, dict(bos_missing=1), "TFD116", "1 of 4 sequences do not start with BOS (1)."),
        (values.several_eos, dict(eos_multiple=2), "TFD117", "2 of 4 sequences hold more than one EOS (2)."),
        (values.tokens_after_eos, dict(eos_then_tokens=3), "TFD118",
         "3 of 4 sequences have real tokens after their EOS."),
        (values.truncation_rate, dict(truncated=3), "TFD119",
         "3 of 4 sequences fill the maximum length 6 with no EOS: they were truncated."),
    ],
)  # fmt: skip
def test_each_value_rule_on_plain_numbers(rule, harmful, code, message):
    assert rule(plain(), "Batch 3 (step 3, epoch 0, rank 1)", PATHS, RULES) is None  # the healthy side
    verdict = rule(plain(**harmful), "Batch 3 (step 3, epoch 0, rank 1)", PATHS, RULES)
    assert verdict.code == code and verdict.message.startswith("Batch 3 (step 3, epoch 0, rank 1): ")
    assert message in verdict.message
    assert verdict.severity is None  # the rule's own severity


def test_value_rules_at_their_thresholds_and_without_their_settings():
    none = ValueRules(vocab_size=10, context=None, ignore_index=-100)
    assert values.sequences_without_bos(plain(bos_missing=4), "B", PATHS, none) is None  # no bos_id: not judged
    assert values.several_eos(plain(eos_multiple=4), "B", PATHS, none) is None
    assert values.truncation_rate(plain(truncated=4), "B", PATHS, RULES).evidence == {
        "truncated_frac": 1.0,
        "max_length": 6,
    }
    assert values.truncation_rate(plain(truncated=2), "B", PATHS, RULES) is None  # 2 of 4 is not above 0.5
    assert values.truncation_rate(plain(truncated=4, sequences=0), "B", PATHS, RULES) is None
    assert values.every_label_ignored(plain(labels_total=32, labels_ignored=31), "B", PATHS, RULES) is None
    assert values.every_label_ignored(plain(labels_total=0, labels_ignored=0), "B", PATHS, RULES) is None
    kinds = {v.code for v in value_verdicts(plain(mask_non_binary=1, bos_missing=1), "B", PATHS, RULES,
                                            has_mask=False, has_labels=False)}  # fmt: skip
    assert kinds == set()  # the mask rules need a mask, the convention rules labels
    crash = plain(ids_out_of_range=1, mask_non_binary=1, labels_out_of_range=1, bos_missing=1, pad_supervised=1)
    found = value_verdicts(crash, "B", PATHS, RULES, has_mask=True, has_labels=True, crash_only=True)
    assert [v.code for v in found] == ["TFD110", "TFD112", "TFD113"]
    found = value_verdicts(crash, "B", PATHS, RULES, has_mask=True, has_labels=True)
    assert [v.code for v in found] == ["TFD110", "TFD112", "TFD113", "TFD115", "TFD116"]


def test_mask_holes_on_plain_numbers():
    holes = plain(mask_holes=2, mask_hole_rows=2, mask_hole_row_tokens=10, holes_masked_everywhere=2,
                  first_hole_row=0, first_hole_col=3, first_hole_id=9, padding_id_min=9, padding_id_max=9)  # fmt: skip
    verdict = values.mask_hole_verdict(holes, "B", PATHS, has_mask=True)
    assert verdict.code == "TFD122" and verdict.evidence["hole_fraction"] == pytest.approx(2 / 12)
    assert "masks 2 position(s) inside the text of 2 of 4 rows (16.7% of those rows' text" in verdict.message
    assert "(input_ids != 9)" in verdict.message and verdict.hint == values.HOLES_FROM_IDS_HINT
    hidden = values.mask_hole_verdict({**holes, "holes_masked_everywhere": 0, "holes_attended_in_row": 2}, "B", PATHS,
                                  has_mask=True)  # fmt: skip
    assert "2 of the 2 holes hold ids attended elsewhere" in hidden.message and hidden.hint == values.HOLES_IN_TEXT_HINT
    assert values.mask_hole_verdict({**holes, "mask_hole_row_tokens": 1}, "B", PATHS, has_mask=True) is None  # mostly
    assert values.mask_hole_verdict({**holes, "position_resets": 1}, "B", PATHS, has_mask=True) is None  # packed
    assert values.mask_hole_verdict(holes, "B", PATHS, has_mask=True, packed_keys=("cu_seqlens",)) is None
    assert values.packed_keys({"input_ids": 0, "meta.cu_seqlens": 0, "labels": 0}) == ("meta.cu_seqlens",)


def test_every_drift_kind_has_its_rule_and_is_recorded_once_per_key():
    kinds = ["missing", "extra", "dtype", "ndim", "size"]
    verdicts = drift_verdicts([Drift(k, f"k{i}", "e", "f") for i, k in enumerate(kinds)], "B", True)
    assert [v.code for v in verdicts] == ["TFD101", "TFD102", "TFD103", "TFD104", "TFD105"]
    assert [severity(v) for v in verdicts] == ["error", "warning", "error", "error", "error"]
    assert [v.key for v in verdicts] == ["k0", "k1", "k2", "k3", "k4"]
    assert verdicts[2].message == "B: 'k2' has dtype f; expected e (the declared schema)."


def test_the_schema_watch_learns_compares_and_skips_a_clean_structure():
    from lightning_tfdebug.functional.batch_schema import structure_key
    from lightning_tfdebug.primitives.batch import flatten_batch

    def batch(width, dtype=torch.long):
        return {"input_ids": torch.zeros(2, width, dtype=torch.long), "labels": torch.zeros(2, width, dtype=dtype)}

    watch = schema.SchemaWatch(learn_batches=2, context=6)

    def check(b):
        leaves = flatten_batch(b)
        return watch.check(structure_key(leaves), leaves, "input_ids", "B")

    assert check(batch(4)) == [] and check(batch(5)) == [] and watch.clean is None  # learning: never clean
    assert check(batch(5)) == [] and watch.clean == structure_key(flatten_batch(batch(5)))
    [dtype] = check(batch(5, torch.int32))
    assert dtype.code == "TFD103" and watch.clean is None
    [long] = check(batch(7))
    assert long.code == "TFD111" and long.evidence == {"key": "input_ids", "shape": [2, 7], "max_length": 6}
    saved = watch.state()
    assert saved == {"input_ids": {"dtype": "int64", "dims": ["d0:input_ids", "d1:input_ids"]},
                     "labels": {"dtype": "int64", "dims": ["d0:input_ids", "d1:input_ids"]}}  # fmt: skip
    resumed = schema.SchemaWatch(learn_batches=2)
    resumed.load(saved)
    assert resumed.state() == saved
    leaves = flatten_batch(batch(5, torch.int32))
    assert [v.code for v in resumed.check(structure_key(leaves), leaves, "input_ids", "B")] == ["TFD103"]
    assert schema.SchemaWatch(learn_batches=2).state() is None  # nothing learned yet


def test_batch_repeats_read_host_and_device_fingerprints_in_order_and_tfd121_silences_tfd123():
    tracker = repeats.BatchRepeats(max_repeated_fraction=0.1)
    data = batches.EpochData(stream=False, loader_length=100, per_epoch=100)
    for step in range(5):  # the same batch five times: host ints for even steps, "device" values for odd ones
        tracker.pending.append((0, step, data, 7 if step % 2 == 0 else torch.tensor(7.0)))
    prints = tracker.take()
    assert tracker.pending == [] and len(repeats.BatchRepeats.on_device(prints)) == 2
    verdicts = tracker.read(prints, [7.0, 7.0], rank=1)
    assert [(v.code, v.step) for v in verdicts] == [("TFD121", 3), ("TFD121", 4)]  # TFD123 would say the same
    assert tracker.spoken and "(rank 1)" in verdicts[0].message
    tracker.new_fit()
    assert not tracker.spoken and tracker.period.read == 0


def test_eos_count_aside_labels_layout_and_notices():
    ids = SpecialIds(eos=(2,), pad=(2,))
    assert special.eos_count_aside(SpecialIds())[1] == "`eos_id` or `tokenizer`"
    assert special.eos_count_aside(ids, has_labels=False)[1] == "`labels_key`"
    assert special.eos_count_aside(ids, sequences=False) == (
        "the labels are not token sequences (one value per row: a classifier).",
        None,
    )
    assert special.eos_count_aside(ids, has_mask=False)[1] == "`mask_key`"
    assert (
        special.eos_count_aside(ids) is None
        and special.eos_count_aside(SpecialIds(eos=(2,), pad=(0,)), has_mask=False) is None
    )
    two = torch.zeros(4, 6, dtype=torch.long)
    assert special.label_layout(two, two) == (True, True)
    assert special.label_layout(two, two, encoder_decoder=True) == (False, True)
    assert special.label_layout(two, torch.zeros(4, dtype=torch.long)) == (
        False,
        False,
    )  # one class per row
    assert special.label_layout(two, None) == (False, False)
    assert readings.batch_name(3, 2, 0, 1) == "Batch 3 (step 2, epoch 0, rank 1)"
    paths = {"input_ids": "input_ids", "labels": "labels"}
    assert readings.fields_notice(paths, {}, None) is None
    assert "token ids taken from '0'" in readings.fields_notice({"input_ids": "0", "labels": "1"}, {}, None)
    assert "no token ids in the first batch (keys: ['x'])" in readings.fields_notice(
        {"input_ids": None}, {"x": 0}, None
    )
    rows, labels = values.example_rows(torch.arange(6).reshape(3, 2), None, 2)
    assert rows == [[0, 1], [2, 3]] and labels is None
    assert values.example_rows(torch.arange(3), torch.arange(3), 4) == ([[0, 1, 2]], [[0, 1, 2]])


# ---------------------------------------------------------------- TFD125: a mid-epoch resume the loader cannot follow
def test_a_mid_epoch_resume_names_the_batches_that_repeat_and_those_skipped():
    plain = batches.EpochData(loader_length=50, per_epoch=50, in_order=True)
    verdict = repeats.resumed_mid_epoch(40, 40, 0, 1, plain)
    assert verdict.code == "TFD125" and verdict.severity is None  # the rule's warning
    assert verdict.evidence | {} == {"start": 40, "per_epoch": 50, "step": 40, "epoch": 0, "in_order": True,
                                     "repeated": [0, 9], "skipped": [40, 49]}  # fmt: skip
    assert "batches 0-9 of the epoch train a second time and batches 40-49 are never read" in verdict.message
    assert "epoch 0, rank 1)" in verdict.message and "StatefulDataLoader" in rule("TFD125").hint
    early = repeats.resumed_mid_epoch(1, 1, 0, 0, plain)  # one batch read: batch 0 twice, batch 49 never
    assert early.evidence["repeated"] == [0, 0] and "batch 0 of the epoch" in early.message
    shuffled = repeats.resumed_mid_epoch(40, 40, 0, 0, plain._replace(in_order=False))
    assert shuffled.severity == "info" and shuffled.evidence["expected_repeated"] == pytest.approx(8.0)
    # silent: the fit's first batch starts its epoch, a loader Lightning restores, a stream, an unknown length
    assert repeats.resumed_mid_epoch(0, 50, 1, 0, plain) is None
    assert repeats.resumed_mid_epoch(40, 40, 0, 0, plain._replace(stateful=True)) is None
    assert repeats.resumed_mid_epoch(40, 40, 0, 0, plain._replace(stream=True)) is None
    assert repeats.resumed_mid_epoch(40, 40, 0, 0, batches.EpochData()) is None


def test_the_batches_of_a_resumed_epoch_do_not_count_toward_tfd123():
    data = batches.EpochData(loader_length=10, per_epoch=10, in_order=True)
    prints = [*range(4), *range(10)]  # resumed at batch 6: the loader restarts at 0, then a whole epoch
    epochs = [0] * 4 + [1] * 10

    def read(repeats):
        repeats.pending = [(e, step, data, p) for step, (e, p) in enumerate(zip(epochs, prints))]
        return [v.code for v in repeats.read(repeats.take(), [])]

    assert "TFD123" in read(repeats.BatchRepeats())  # without the resume named: "the data repeats"
    named = repeats.BatchRepeats()
    named.resumed_epoch = 0
    assert read(named) == [] and named.period.read == 10
