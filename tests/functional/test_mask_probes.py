"""MaskProbe's probes and decisions without a Trainer (functional/mask_probes.py)."""

import math

import pytest
import torch
from torch import nn

from lightning_tfdebug.functional import mask_probes as mp
from lightning_tfdebug.functional.probes import alignment_losses, labels_relation


class KeywordModel(nn.Module):
    def forward(self, input_ids, attention_mask=None):
        return {"ids": input_ids, "mask": attention_mask}


class KwargsModel(nn.Module):
    def forward(self, **kwargs):
        return kwargs


class PositionalModel(nn.Module):
    def forward(self, x):
        return x


class NoArgsModel(nn.Module):
    def forward(self, *args):
        return args


def test_build_caller_reads_the_forward_signature():
    ids, mask = torch.zeros(1, 3, dtype=torch.long), torch.ones(1, 3, dtype=torch.long)
    keyword = mp.build_caller(KeywordModel())
    assert (keyword.takes_mask, keyword.mask_named) == (True, True)
    assert keyword.call(ids, mask)["mask"] is mask
    kwargs = mp.build_caller(KwargsModel(), input_key="tokens", mask_key="keep")
    assert (kwargs.takes_mask, kwargs.mask_named) == (True, False)
    assert set(kwargs.call(ids, mask)) == {"tokens", "keep"}
    positional = mp.build_caller(PositionalModel())
    assert (positional.takes_mask, positional.mask_named) == (False, False)
    assert positional.call(ids, None) is ids
    assert "set `forward_fn`" in mp.build_caller(NoArgsModel())
    custom = mp.build_caller(PositionalModel(), forward_fn=lambda module, i, m: (module, i, m))
    assert custom.takes_mask and custom.call(ids, mask)[2] is mask


def test_objective_counts_and_decision():
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    assert mp.decide_objective(*mp.objective_counts(ids, ids.clone(), -100).tolist(), label_positions=5) is None
    preshifted = torch.tensor([[2, 3, 4, 5, -100]])
    assert mp.decide_objective(*mp.objective_counts(ids, preshifted, -100).tolist(), label_positions=5) is None
    masked_lm = torch.tensor([[-100, 7, -100, 9, -100]])  # BERT-style: other tokens at a few positions
    verdict = mp.decide_objective(*mp.objective_counts(ids, masked_lm, -100).tolist(), label_positions=5)
    assert verdict.code == "TFD212" and verdict.evidence["supervised_frac"] == pytest.approx(0.4)
    assert mp.decide_objective(0, 0, 0, 0, label_positions=5) is None  # nothing supervised: a decoder


def test_probe_constructions():
    gen = torch.Generator().manual_seed(0)
    ids = torch.arange(16).reshape(2, 8)
    mask, other, k = mp.masked_block(ids, gen)
    assert k == 2 and mask[:, 1:3].eq(0).all() and mask[:, 0].eq(1).all() and mask[:, 3:].eq(1).all()
    assert torch.equal(other[:, 3:], ids[:, 3:]) and torch.equal(other[:, :1], ids[:, :1])
    assert mp.masked_block(ids[:, :2], gen) is None
    assert mp.causal_cut(8) == 3
    assert mp.padding_extra(8, None) == (8, 2) and mp.padding_extra(8, 9) == (7, 2)
    real = torch.ones_like(ids)
    right_ids, right_mask, keep = mp.add_padding(ids, real, "right", 2, gen)
    assert right_ids.shape == (2, 10) and torch.equal(right_ids[:, keep], ids) and right_mask[:, 8:].eq(0).all()
    left_ids, left_mask, keep = mp.add_padding(ids, real, "left", 2, gen)
    assert torch.equal(left_ids[:, keep], ids) and left_mask[:, :2].eq(0).all()
    assert mp.probe_padding_side("auto", torch.tensor([[0, 1, 1]])) == "left"
    assert mp.probe_padding_side("auto", None) == "right" and mp.probe_padding_side("left", None) == "left"
    assert mp.long_row(torch.tensor([[1, 2, 3]]), 7).shape == (1, 9)


@pytest.mark.parametrize(
    "decide, args, code",
    [
        (mp.decide_repeat, (0, 3), "TFD213"),
        (mp.decide_causal, (0, 3, 4, 8), "TFD201"),
        (mp.decide_padding, (3, 2), "TFD202"),
        (mp.decide_pad_side, (3, "left", 2), "TFD203"),
        (mp.decide_kv_cache, (5,), "TFD209"),
    ],
)
def test_tolerance_decisions(decide, args, code):
    """Within the tolerance: nothing; beyond it, or NaN: the finding, with the change and the tolerance."""
    assert decide(1e-3, *args, 1e-2) is None
    assert decide(1e-2, *args, 1e-2) is None  # at the tolerance is within it
    verdict = decide(0.5, *args, 1e-2)
    assert verdict.code == code and verdict.evidence["max_change"] == 0.5 and "0.5" in verdict.message
    assert decide(math.nan, *args, 1e-2).code == code


def test_alignment_decision_from_real_losses():
    torch.manual_seed(0)
    ids = torch.randint(0, 11, (2, 12))
    logits = torch.randn(2, 12, 11) * 3
    losses = {k: float(v) for k, v in alignment_losses(logits, ids).items()}
    relation = labels_relation(ids, ids)
    rtol = mp.alignment_rtol(logits.dtype, torch.float32)

    def decide(returned, last_try=False):
        return mp.decide_alignment(
            returned, losses["shifted"], losses["unshifted"], losses["shifted2"], relation, rtol, last_try
        )

    assert decide(losses["shifted"]) == (True, None)
    decided, verdict = decide(losses["unshifted"])
    assert decided and verdict.code == "TFD205"
    decided, verdict = decide(losses["shifted2"])
    assert decided and verdict.code == "TFD206" and "shifts them twice" in verdict.message
    decided, verdict = decide(losses["shifted"] * 0.5 + losses["unshifted"] * 0.5)  # label smoothing, extra terms
    assert decided and verdict.code == "TFD210" and verdict.hint
    same = losses["shifted"]  # a model too fresh to tell the alignments apart: try again later
    assert mp.decide_alignment(same, same, same, same, relation, rtol, last_try=False) == (False, None)
    assert mp.decide_alignment(same, same, same, same, relation, rtol, last_try=True)[1].code == "TFD210"


def test_alignment_rtol_widens_for_half_precision_losses():
    assert mp.alignment_rtol(torch.float32) == 2e-5
    assert mp.alignment_rtol(torch.float32, torch.bfloat16) == 4 * torch.finfo(torch.bfloat16).eps
    assert mp.alignment_rtol(torch.bfloat16) == 1e-3


def test_context_verdicts():
    assert mp.context_failure_verdict(64, IndexError("index out of range")).code == "TFD207"
    fine = mp.context_limit_verdict(64, "hparams['context_length']")
    assert fine.code == "TFD208" and "64 tokens (read from hparams['context_length'])" in fine.message
    assert fine.evidence == {"context_limit": 64, "source": "hparams['context_length']"}
    assert mp.unpadded_mask_verdict("attention_mask").evidence == {"mask_key": "attention_mask"}
