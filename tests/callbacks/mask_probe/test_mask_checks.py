"""MaskProbe's rules on plain numbers (functional/mask_checks.py): each rule's verdict beyond its threshold and None on
the healthy side."""

import math

import pytest
import torch

from lightning_tfdebug.callbacks.mask_probe import (
    alignment_checks,
    decisions,
    leak_checks,
    padding_checks,
    position_checks,
    readings,
)
from lightning_tfdebug.callbacks.mask_probe.probes import alignment_rtol
from lightning_tfdebug.functional.probes import alignment_losses, labels_relation
from lightning_tfdebug.primitives.calls import Objective, read_objective


@pytest.mark.parametrize(
    "build, decide, code",
    [
        (lambda c, t: leak_checks.RepeatReading(c, 0, 3, t), leak_checks.decide_repeat, "TFD213"),
        (lambda c, t: leak_checks.CausalReading(c, 0, 3, 4, 8, t), leak_checks.decide_causal, "TFD201"),
        (lambda c, t: padding_checks.PaddingReading(c, 3, c, 3, 2, t), padding_checks.decide_padding, "TFD202"),
        (lambda c, t: padding_checks.PadSideReading(c, 3, "left", 2, t), padding_checks.decide_pad_side, "TFD203"),
        (lambda c, t: position_checks.KvCacheReading(c, 5, t), position_checks.decide_kv_cache, "TFD209"),
        (lambda c, t: leak_checks.LeakReading(c, 1, 2, 3, 4, "ids", 0, True, 1, t), leak_checks.decide_leak, "TFD201"),
        (
            lambda c, t: leak_checks.LeakReading(c, 1, 2, 3, 4, "decoder_input_ids", 0, False, 0, t),
            leak_checks.decide_leak,
            "TFD214",
        ),
        (lambda c, t: leak_checks.CrossSampleReading(c, 1, 2, t), leak_checks.decide_cross_sample, "TFD217"),
    ],
)
def test_tolerance_rules(build, decide, code):
    """Within the tolerance: nothing; beyond it, or NaN: the finding, with the change and the tolerance."""
    assert decide(build(1e-3, 1e-2)) is None
    assert decide(build(1e-2, 1e-2)) is None  # at the tolerance is within it
    verdict = decide(build(0.5, 1e-2))
    assert verdict.code == code and verdict.evidence["max_change"] == 0.5 and "0.5" in verdict.message
    assert decide(build(math.nan, 1e-2)).code == code


def test_messages_keep_their_wording():
    causal = leak_checks.decide_causal(leak_checks.CausalReading(0.5, 1, 3, 4, 8, 1e-2))
    assert causal.message == (
        "Future tokens change past logits: replacing the tokens after position 4 of a 8-token sequence changed the "
        "logits at position 3 (row 1) by 0.5 (tolerance 0.01)."
    )
    leak = leak_checks.decide_leak(leak_checks.LeakReading(0.5, 1, 2, 3, 4, "ids", 0, True, 1, 1e-2))
    assert leak.message.endswith("(tolerance 0.01); outputs up to 3 must not see them.")
    own = leak_checks.decide_leak(leak_checks.LeakReading(0.5, 1, 2, 3, 4, "tgt", 0, False, 0, 1e-2))
    assert "carries the label of its own position (label offset 0)" in own.message
    assert alignment_checks.alignment_not_checked("why").message == "Target alignment not checked: why."
    assert alignment_checks.cannot_call("no ids").message == "MaskProbe cannot call the model: no ids"


def test_padding_follows_the_decoder_when_the_outputs_do():
    reading = padding_checks.PaddingReading(
        max_change=0.0, position=3, every_change=0.5, every_position=1, masked=2, tolerance=0.01
    )
    assert padding_checks.decide_padding(reading) is None  # the real positions did not move
    assert padding_checks.decide_padding(reading, follows_other=True).evidence["position"] == 1
    side = padding_checks.PadSideReading(0.5, 3, "right", 2, 0.01)
    assert (
        padding_checks.decide_pad_side(side).code == "TFD203"
        and padding_checks.decide_pad_side(side, follows_other=True) is None
    )
    assert (
        leak_checks.LeakSummary(None, 0.5, 0.01).follows_other
        and not leak_checks.LeakSummary(0.1, None, 0.01).follows_other
    )


def test_objective():
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    assert alignment_checks.decide_objective(read_objective(ids, ids.clone(), -100)) is None
    assert alignment_checks.decide_objective(read_objective(ids, torch.tensor([[2, 3, 4, 5, -100]]), -100)) is None
    masked_lm = torch.tensor([[-100, 7, -100, 9, -100]])  # BERT-style: other tokens at a few positions
    verdict = alignment_checks.decide_objective(read_objective(ids, masked_lm, -100))
    assert verdict.code == "TFD212" and verdict.evidence["supervised_frac"] == pytest.approx(0.4)
    assert (
        alignment_checks.decide_objective(Objective(0, 0, 0, 0, label_positions=5)) is None
    )  # nothing supervised: a decoder


def _alignment(returned, losses, relation, rtol, last_try=False):
    return alignment_checks.AlignmentReading(
        returned, losses["shifted"], losses["unshifted"], losses["shifted2"], relation, rtol, last_try
    )


def test_alignment_from_real_losses():
    torch.manual_seed(0)
    ids = torch.randint(0, 11, (2, 12))
    logits = torch.randn(2, 12, 11) * 3
    losses = {k: float(v) for k, v in alignment_losses(logits, ids).items()}
    relation = labels_relation(ids, ids)
    rtol = alignment_rtol(logits.dtype, torch.float32)
    assert alignment_checks.decide_alignment(_alignment(losses["shifted"], losses, relation, rtol)) == (True, None)
    decided, verdict = alignment_checks.decide_alignment(_alignment(losses["unshifted"], losses, relation, rtol))
    assert decided and verdict.code == "TFD205"
    decided, verdict = alignment_checks.decide_alignment(_alignment(losses["shifted2"], losses, relation, rtol))
    assert decided and verdict.code == "TFD206" and "shifts them twice" in verdict.message
    mixed = losses["shifted"] * 0.5 + losses["unshifted"] * 0.5  # label smoothing, extra terms
    decided, verdict = alignment_checks.decide_alignment(_alignment(mixed, losses, relation, rtol))
    assert decided and verdict.code == "TFD210" and verdict.hint and "matches neither" in verdict.message
    same = dict.fromkeys(losses, losses["shifted"])  # a model too fresh to tell the alignments apart: try again later
    assert alignment_checks.decide_alignment(_alignment(same["shifted"], same, relation, rtol)) == (False, None)
    assert (
        alignment_checks.decide_alignment(_alignment(same["shifted"], same, relation, rtol, last_try=True))[1].code
        == "TFD210"
    )


def test_order():
    def decide(order, content, step=100, last_try=False):
        return position_checks.decide_order(position_checks.OrderReading(order, content, 7, 0.01, step, last_try))

    assert decide(1.0, 5.0) == (True, None)  # order clearly matters
    decided, verdict = decide(0.0, 5.0)
    assert decided and verdict.code == "TFD215" and verdict.evidence["position"] == 7
    assert decide(0.0, 5.0, step=50) == (False, None)  # too early: attention of a fresh model is nearly uniform
    assert decide(0.05, 5.0) == (False, None) and decide(0.05, 5.0, last_try=True) == (True, None)


def test_context_verdicts():
    assert position_checks.context_failure(64, IndexError("index out of range")).code == "TFD207"
    fine = position_checks.context_limit_runs(64, "hparams['context_length']")
    assert fine.code == "TFD208" and "64 tokens (read from hparams['context_length'])" in fine.message
    assert fine.evidence == {"context_limit": 64, "source": "hparams['context_length']"}
    assert padding_checks.unpadded_mask("attention_mask").evidence == {"mask_key": "attention_mask", "layout": "left"}
    assert alignment_checks.kv_cache_unusable(error=ImportError("x")).code == "TFD211"
    assert "the cache check is skipped" in alignment_checks.kv_cache_unusable(shape=None, expected=(1, 2, 3)).message


@pytest.mark.parametrize(
    "layout, causal, severity",
    [("left", True, "error"), ("right", False, "error"), ("right", True, "info"), ("none", False, "info")],
)
def test_a_mask_ignored_is_an_error_only_where_real_tokens_read_the_padding(layout, causal, severity):
    """Right padding of a causal model, or no padding: harmless for these batches (info, saying so)."""
    held = [leak_checks.CausalReading(0.0, 0, 1, 2, 6, 0.01)] if causal else []
    verdicts, _ = decisions.decide_probe([*held, padding_checks.PaddingReading(0.5, 3, 0.5, 3, 2, 0.01, layout)])
    [verdict] = [v for v in verdicts if v is not None]
    assert verdict.code == "TFD202" and (verdict.severity or padding_checks.TFD202.severity) == severity
    assert ("Harmless for this run's batches" in verdict.message) == (severity == "info")
    unmasked = padding_checks.unpadded_mask("attention_mask", layout, causal)
    assert unmasked.code == "TFD204" and (unmasked.severity or padding_checks.TFD204.severity) == severity
    leaked = decisions.decide_probe(
        [
            leak_checks.CausalReading(0.5, 0, 1, 2, 6, 0.01),
            padding_checks.PaddingReading(0.5, 3, 0.5, 3, 2, 0.01, "right"),
        ]
    )
    assert [v.severity for v in leaked[0] if v is not None and v.code == "TFD202"] == [None]  # not causal: the error


def test_a_repeat_beyond_its_tolerance_is_the_only_verdict():
    readings = [leak_checks.RepeatReading(0.5, 0, 1, 0.01), leak_checks.CausalReading(0.5, 0, 1, 2, 6, 0.01)]
    verdicts, settled = decisions.decide_probe(readings)
    assert [v.code for v in verdicts] == ["TFD213"] and settled == {"alignment"}
    verdicts, _ = decisions.decide_probe([leak_checks.RepeatReading(0.0, 0, 1, 0.01), readings[1]])
    assert [v.code for v in verdicts if v] == ["TFD201"]


def test_every_logged_key_is_declared_once():
    modules = (readings, leak_checks, padding_checks, position_checks, alignment_checks)
    kinds = {c for m in modules for c in vars(m).values() if isinstance(c, type) and issubclass(c, readings.Reading)}
    logged = {key for cls in kinds for key in cls.LOGGED.values()}
    keys = readings.KEYS
    assert logged | {readings.CONTEXT_LIMIT, readings.SECONDS} == set(keys) and len(set(keys)) == len(keys)
    assert all(key.chart == "mask probes" and key.name.startswith("mask_probe/") for key in keys)
