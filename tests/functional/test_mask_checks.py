"""MaskProbe's rules on plain numbers (functional/mask_checks.py): each rule's verdict beyond its threshold and None on
the healthy side."""

import math

import pytest
import torch

from lightning_tfdebug.functional import mask_checks as mc
from lightning_tfdebug.functional.mask_probes import alignment_rtol
from lightning_tfdebug.functional.probes import alignment_losses, labels_relation
from lightning_tfdebug.primitives.calls import Objective, read_objective


@pytest.mark.parametrize(
    "build, decide, code",
    [
        (lambda c, t: mc.RepeatReading(c, 0, 3, t), mc.decide_repeat, "TFD213"),
        (lambda c, t: mc.CausalReading(c, 0, 3, 4, 8, t), mc.decide_causal, "TFD201"),
        (lambda c, t: mc.PaddingReading(c, 3, c, 3, 2, t), mc.decide_padding, "TFD202"),
        (lambda c, t: mc.PadSideReading(c, 3, "left", 2, t), mc.decide_pad_side, "TFD203"),
        (lambda c, t: mc.KvCacheReading(c, 5, t), mc.decide_kv_cache, "TFD209"),
        (lambda c, t: mc.LeakReading(c, 1, 2, 3, 4, "ids", 0, True, 1, t), mc.decide_leak, "TFD201"),
        (lambda c, t: mc.LeakReading(c, 1, 2, 3, 4, "decoder_input_ids", 0, False, 0, t), mc.decide_leak, "TFD214"),
        (lambda c, t: mc.CrossSampleReading(c, 1, 2, t), mc.decide_cross_sample, "TFD217"),
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
    causal = mc.decide_causal(mc.CausalReading(0.5, 1, 3, 4, 8, 1e-2))
    assert causal.message == (
        "Future tokens change past logits: replacing the tokens after position 4 of a 8-token sequence changed the "
        "logits at position 3 (row 1) by 0.5 (tolerance 0.01)."
    )
    leak = mc.decide_leak(mc.LeakReading(0.5, 1, 2, 3, 4, "ids", 0, True, 1, 1e-2))
    assert leak.message.endswith("(tolerance 0.01); outputs up to 3 must not see them.")
    own = mc.decide_leak(mc.LeakReading(0.5, 1, 2, 3, 4, "tgt", 0, False, 0, 1e-2))
    assert "carries the label of its own position (label offset 0)" in own.message
    assert mc.alignment_not_checked("why").message == "Target alignment not checked: why."
    assert mc.cannot_call("no ids").message == "MaskProbe cannot call the model: no ids"


def test_padding_follows_the_decoder_when_the_outputs_do():
    reading = mc.PaddingReading(
        max_change=0.0, position=3, every_change=0.5, every_position=1, masked=2, tolerance=0.01
    )
    assert mc.decide_padding(reading) is None  # the real positions did not move
    assert mc.decide_padding(reading, follows_other=True).evidence["position"] == 1
    side = mc.PadSideReading(0.5, 3, "right", 2, 0.01)
    assert mc.decide_pad_side(side).code == "TFD203" and mc.decide_pad_side(side, follows_other=True) is None
    assert mc.LeakSummary(None, 0.5, 0.01).follows_other and not mc.LeakSummary(0.1, None, 0.01).follows_other


def test_objective():
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    assert mc.decide_objective(read_objective(ids, ids.clone(), -100)) is None
    assert mc.decide_objective(read_objective(ids, torch.tensor([[2, 3, 4, 5, -100]]), -100)) is None
    masked_lm = torch.tensor([[-100, 7, -100, 9, -100]])  # BERT-style: other tokens at a few positions
    verdict = mc.decide_objective(read_objective(ids, masked_lm, -100))
    assert verdict.code == "TFD212" and verdict.evidence["supervised_frac"] == pytest.approx(0.4)
    assert mc.decide_objective(Objective(0, 0, 0, 0, label_positions=5)) is None  # nothing supervised: a decoder


def _alignment(returned, losses, relation, rtol, last_try=False):
    return mc.AlignmentReading(
        returned, losses["shifted"], losses["unshifted"], losses["shifted2"], relation, rtol, last_try
    )


def test_alignment_from_real_losses():
    torch.manual_seed(0)
    ids = torch.randint(0, 11, (2, 12))
    logits = torch.randn(2, 12, 11) * 3
    losses = {k: float(v) for k, v in alignment_losses(logits, ids).items()}
    relation = labels_relation(ids, ids)
    rtol = alignment_rtol(logits.dtype, torch.float32)
    assert mc.decide_alignment(_alignment(losses["shifted"], losses, relation, rtol)) == (True, None)
    decided, verdict = mc.decide_alignment(_alignment(losses["unshifted"], losses, relation, rtol))
    assert decided and verdict.code == "TFD205"
    decided, verdict = mc.decide_alignment(_alignment(losses["shifted2"], losses, relation, rtol))
    assert decided and verdict.code == "TFD206" and "shifts them twice" in verdict.message
    mixed = losses["shifted"] * 0.5 + losses["unshifted"] * 0.5  # label smoothing, extra terms
    decided, verdict = mc.decide_alignment(_alignment(mixed, losses, relation, rtol))
    assert decided and verdict.code == "TFD210" and verdict.hint and "matches neither" in verdict.message
    same = dict.fromkeys(losses, losses["shifted"])  # a model too fresh to tell the alignments apart: try again later
    assert mc.decide_alignment(_alignment(same["shifted"], same, relation, rtol)) == (False, None)
    assert mc.decide_alignment(_alignment(same["shifted"], same, relation, rtol, last_try=True))[1].code == "TFD210"


def test_order():
    def decide(order, content, step=100, last_try=False):
        return mc.decide_order(mc.OrderReading(order, content, 7, 0.01, step, last_try))

    assert decide(1.0, 5.0) == (True, None)  # order clearly matters
    decided, verdict = decide(0.0, 5.0)
    assert decided and verdict.code == "TFD215" and verdict.evidence["position"] == 7
    assert decide(0.0, 5.0, step=50) == (False, None)  # too early: attention of a fresh model is nearly uniform
    assert decide(0.05, 5.0) == (False, None) and decide(0.05, 5.0, last_try=True) == (True, None)


def test_context_verdicts():
    assert mc.context_failure(64, IndexError("index out of range")).code == "TFD207"
    fine = mc.context_limit_runs(64, "hparams['context_length']")
    assert fine.code == "TFD208" and "64 tokens (read from hparams['context_length'])" in fine.message
    assert fine.evidence == {"context_limit": 64, "source": "hparams['context_length']"}
    assert mc.unpadded_mask("attention_mask").evidence == {"mask_key": "attention_mask", "layout": "left"}
    assert mc.kv_cache_unusable(error=ImportError("x")).code == "TFD211"
    assert "the cache check is skipped" in mc.kv_cache_unusable(shape=None, expected=(1, 2, 3)).message


@pytest.mark.parametrize(
    "layout, causal, severity",
    [("left", True, "error"), ("right", False, "error"), ("right", True, "info"), ("none", False, "info")],
)
def test_a_mask_ignored_is_an_error_only_where_real_tokens_read_the_padding(layout, causal, severity):
    """Right padding of a causal model, or no padding: harmless for these batches (info, saying so)."""
    held = [mc.CausalReading(0.0, 0, 1, 2, 6, 0.01)] if causal else []
    verdicts, _ = mc.decide_probe([*held, mc.PaddingReading(0.5, 3, 0.5, 3, 2, 0.01, layout)])
    [verdict] = [v for v in verdicts if v is not None]
    assert verdict.code == "TFD202" and (verdict.severity or mc.TFD202.severity) == severity
    assert ("Harmless for this run's batches" in verdict.message) == (severity == "info")
    unmasked = mc.unpadded_mask("attention_mask", layout, causal)
    assert unmasked.code == "TFD204" and (unmasked.severity or mc.TFD204.severity) == severity
    leaked = mc.decide_probe(
        [mc.CausalReading(0.5, 0, 1, 2, 6, 0.01), mc.PaddingReading(0.5, 3, 0.5, 3, 2, 0.01, "right")]
    )
    assert [v.severity for v in leaked[0] if v is not None and v.code == "TFD202"] == [None]  # not causal: the error


def test_a_repeat_beyond_its_tolerance_is_the_only_verdict():
    readings = [mc.RepeatReading(0.5, 0, 1, 0.01), mc.CausalReading(0.5, 0, 1, 2, 6, 0.01)]
    verdicts, settled = mc.decide_probe(readings)
    assert [v.code for v in verdicts] == ["TFD213"] and settled == {"alignment"}
    verdicts, _ = mc.decide_probe([mc.RepeatReading(0.0, 0, 1, 0.01), readings[1]])
    assert [v.code for v in verdicts if v] == ["TFD201"]


def test_every_logged_key_is_declared_once():
    readings = [cls for cls in vars(mc).values() if isinstance(cls, type) and issubclass(cls, mc.Reading)]
    logged = {key for cls in readings for key in cls.LOGGED.values()}
    assert logged | {mc.CONTEXT_LIMIT, mc.SECONDS} == set(mc.KEYS) and len(set(mc.KEYS)) == len(mc.KEYS)
    assert all(key.chart == "mask probes" and key.name.startswith("mask_probe/") for key in mc.KEYS)
