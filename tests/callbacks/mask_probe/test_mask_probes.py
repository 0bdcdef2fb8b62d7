"""MaskProbe's probe constructions and measurements without a Trainer (functional/mask_probes.py)."""

import pytest
import torch
from torch import nn

from lightning_tfdebug.callbacks.mask_probe import decisions, leak_checks, probes
from lightning_tfdebug.callbacks.mask_probe.call_probes import build_caller
from lightning_tfdebug.functional import probes as probe_math


def test_probe_constructions():
    gen = torch.Generator().manual_seed(0)
    ids = torch.arange(16).reshape(2, 8)
    pool = torch.arange(20, 30)
    mask, first, second, k = probes.masked_block(ids, pool, gen)
    assert k == 2 and mask[:, 1:3].eq(0).all() and mask[:, 0].eq(1).all() and mask[:, 3:].eq(1).all()
    for copy in (first, second):
        assert torch.equal(copy[:, 3:], ids[:, 3:]) and torch.equal(copy[:, :1], ids[:, :1])
        assert torch.isin(copy[:, 1:3], pool).all()
    assert (first[:, 1:3] != second[:, 1:3]).all()
    assert probes.masked_block(ids[:, :2], pool, gen) is None
    assert probes.causal_cut(8) == 3
    assert probes.padding_extra(8, None) == (8, 2) and probes.padding_extra(8, 9) == (7, 2)
    real, pads = torch.ones_like(ids), torch.full((2, 2), 99)
    right_ids, right_mask, keep = probes.add_padding(ids, real, "right", pads)
    assert right_ids.shape == (2, 10) and torch.equal(right_ids[:, keep], ids) and right_mask[:, 8:].eq(0).all()
    left_ids, left_mask, keep = probes.add_padding(ids, real, "left", pads)
    assert torch.equal(left_ids[:, keep], ids) and left_mask[:, :2].eq(0).all() and left_ids[:, :2].eq(99).all()
    assert probes.long_row(torch.tensor([[1, 2, 3]]), 7).shape == (1, 9)


def test_replacement_ids_are_ordinary_tokens():
    """Never a special id the pack knows, never the batch's padding value; without special ids, the real tokens."""

    class Tokenizer:
        pad_token_id, bos_token_id, eos_token_id, all_special_ids = 0, 1, 2, [0, 1, 2, 3]

    special = probes.known_special_ids([("tokenizer", Tokenizer())])
    assert special == (0, 1, 2, 3)
    ids = torch.tensor([[1, 5, 6, 3, 7, 2, 0, 0], [1, 8, 9, 5, 2, 0, 0, 0]])
    mask = (ids != 0).long()
    pool, padding = probes.ordinary_ids(ids, mask, special)
    assert pool.tolist() == [5, 6, 7, 8, 9] and int(padding) == 0
    pool, _ = probes.ordinary_ids(ids, mask, ())  # no special id known: the real tokens' ids, never the padding value
    assert pool.tolist() == [1, 2, 3, 5, 6, 7, 8, 9]
    pool, padding = probes.ordinary_ids(ids, None, special)
    assert 0 not in pool.tolist() and padding is None
    drawn = probe_math.other_ids(pool, ids, torch.Generator().manual_seed(0))
    assert torch.isin(drawn, pool).all() and (drawn != ids).all()


def test_alignment_rtol_widens_for_half_precision_losses():
    assert probes.alignment_rtol(torch.float32) == 2e-5
    assert probes.alignment_rtol(torch.float32, torch.bfloat16) == 4 * torch.finfo(torch.bfloat16).eps
    assert probes.alignment_rtol(torch.bfloat16) == 1e-3


class Causal(nn.Module):
    """Logits at t from the tokens up to t (a running sum of embeddings): causal, mask-blind."""

    def __init__(self, causal: bool = True) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.head, self.causal = nn.Embedding(20, 8), nn.Linear(8, 20), causal

    def forward(self, input_ids, attention_mask=None):
        h = self.emb(input_ids)
        h = h.cumsum(1) if self.causal else h.sum(1, keepdim=True).expand_as(h)
        return self.head(h)


@pytest.mark.parametrize("causal", [True, False])
def test_a_session_measures_causality_into_readings(causal):
    ids = torch.randint(0, 20, (2, 8), generator=torch.Generator().manual_seed(1))
    settings = probes.ProbeSettings(check_padding=False)
    session = probes.MaskProbes(build_caller(Causal(causal)), ids, torch.Generator().manual_seed(0), settings)
    with torch.no_grad():
        session.masks(ids, None, None)
    kinds = [type(r).__name__ for r in session.readings]
    assert kinds[:2] == ["RepeatReading", "CausalReading"]
    readings = probes.on_host(session.readings, lambda d: {k: float(v) for k, v in d.items()})
    verdicts, settled = decisions.decide_probe(readings)
    codes = [v.code for v in verdicts if v is not None]
    assert codes == ([] if causal else ["TFD201"]) and settled == set()
    assert readings[0].logged() == {"mask_probe/repeat_max_change": 0.0}


def test_a_session_reads_the_context_limit_and_a_missing_mask():
    ids = torch.randint(0, 20, (2, 8))
    mask = torch.ones_like(ids)
    mask[:, -2:] = 0  # the batch pads, the positional forward takes no mask
    model = nn.Sequential(nn.Embedding(20, 4), nn.Linear(4, 20))
    session = probes.MaskProbes(build_caller(model), ids, torch.Generator(), probes.ProbeSettings(), causal=False)
    with torch.no_grad():
        session.masks(ids, mask, None)
        session.positions(ids, 16, "hparams")
    assert [v.code for v in session.verdicts] == ["TFD204", "TFD208"]
    assert session.logged == {"mask_probe/context_limit": 16.0}


def _verdicts(session) -> list[str]:
    readings = probes.on_host(session.readings, lambda d: {k: float(v) for k, v in d.items()})
    verdicts, _ = decisions.decide_probe(readings)
    return [v.code for v in session.verdicts + verdicts if v is not None]


@pytest.mark.parametrize("family", ["t5", "bart"])
@pytest.mark.parametrize("bug", [False, True])
def test_an_encoder_decoder_is_probed_through_its_decoder_input(family, bug):
    from tests.primitives.test_calls import _seq2seq_call

    # healthy: labels equal to the encoder's input, shifted into the decoder by the model (the former false TFD201)
    found, _ = _seq2seq_call(family, decoder_fed_labels=bug, labels_are_ids=not bug)
    ids = found.batch_first(found.primary)
    session = probes.MaskProbes(found, ids, torch.Generator().manual_seed(0), probes.ProbeSettings(check_padding=False))
    causal, alignment = session.decide_causal(ids, ids if not bug else None)
    assert causal and not alignment  # the loss-alignment check (TFD205) does not apply to an encoder-decoder
    with torch.no_grad():
        session.masks(ids, None, None)
    assert _verdicts(session) == (["TFD214"] if bug else [])
    session.alignment(ids, None, ids, lambda: torch.tensor(1.0), automatic=True, last_try=False)  # even if asked
    assert "alignment" in session.settled and not any(type(r).__name__ == "AlignmentReading" for r in session.readings)


def test_a_model_of_unknown_kind_without_labels_gets_no_causality_verdict():
    ids = torch.randint(0, 20, (2, 8), generator=torch.Generator().manual_seed(1))
    settings = probes.ProbeSettings(check_padding=False)  # (the kind-independent padding probes run alike)
    session = probes.MaskProbes(build_caller(Causal(False)), ids, torch.Generator().manual_seed(0), settings)
    assert session.decide_causal(ids, None) == (False, False) and "cannot be told" in session.aside[0]
    with torch.no_grad():
        session.masks(ids, None, None)
    assert "CausalReading" not in [type(r).__name__ for r in session.readings] and _verdicts(session) == []
    session = probes.MaskProbes(build_caller(Causal(False)), ids, torch.Generator().manual_seed(0), settings)
    session.kind = "decoder"  # told by `model_kind=` or a config: probed as a decoder, and the leak is caught
    assert session.decide_causal(ids, None) == (True, True)
    with torch.no_grad():
        session.masks(ids, None, None)
    assert "TFD201" in _verdicts(session)


class BatchMixer(Causal):
    """The running sum of :class:`Causal`, centred over the batch (a normalisation over the samples)."""

    def forward(self, input_ids, attention_mask=None):
        h = self.emb(input_ids).cumsum(1)
        return self.head(h - h.mean(0, keepdim=True))


@pytest.mark.parametrize(
    "model, rows, found", [(Causal(), 2, None), (BatchMixer(), 2, "TFD217"), (BatchMixer(), 1, None)]
)
def test_the_cross_sample_probe(model, rows, found):
    """Other samples' logits must not move when one sample's tokens change; one sample: the probe stands aside."""
    ids = torch.randint(0, 20, (rows, 8), generator=torch.Generator().manual_seed(1))
    settings = probes.ProbeSettings(check_padding=False)
    session = probes.MaskProbes(build_caller(model), ids, torch.Generator().manual_seed(0), settings, cross_sample=True)
    with torch.no_grad():
        session.masks(ids, None, None)
    verdicts, _ = decisions.decide_probe(
        probes.on_host(session.readings, lambda d: {k: float(v) for k, v in d.items()})
    )
    assert [v.code for v in verdicts if v is not None] == ([found] if found else [])
    assert session.not_run == ([leak_checks.CROSS_SAMPLE_ASIDE] if rows == 1 else [])


class PadCountingPositions(nn.Module):
    """Positions count the real tokens (``ids != 0``, as RoBERTa's do); attention honours the mask."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.pos, self.head = nn.Embedding(8, 4), nn.Embedding(16, 4), nn.Linear(4, 8)

    def forward(self, input_ids, attention_mask):
        real = input_ids != 0
        h = self.emb(input_ids) + self.pos((real.cumsum(1) - 1).clamp_min(0) * real)
        weights = attention_mask[:, None, :].float().expand(-1, input_ids.shape[1], -1)
        return self.head(weights @ h / weights.sum(-1, keepdim=True))


def test_the_masked_block_never_writes_the_pad_id():
    """Two real ids and the pad id 0: a block drawn from every id of the batch holds the pad id and moves this healthy
    model's positions (a false TFD202); ordinary ids never do."""
    ids = torch.tensor([[3, 4, 3, 4, 3, 4, 3, 4, 3, 4, 3, 0], [4, 3, 4, 3, 4, 3, 4, 3, 4, 0, 0, 0]])
    mask = (ids != 0).long()

    def findings(batch_mask):
        settings = probes.ProbeSettings(padding_side="right")
        model, generator = build_caller(PadCountingPositions()), torch.Generator().manual_seed(0)
        session = probes.MaskProbes(model, ids, generator, settings, causal=False, attention_mask=batch_mask)
        with torch.no_grad():
            session.masks(ids, mask, None)
        host = probes.on_host(session.readings, lambda d: {k: float(v) for k, v in d.items()})
        return [v.code for v in decisions.decide_probe(host)[0] if v is not None], session

    found, session = findings(mask)
    assert found == [] and session.pool.tolist() == [3, 4] and int(session.pad_value) == 0
    assert findings(None)[0] == ["TFD202"]  # padding unknown: the pad id is drawn, and the probe measures itself
