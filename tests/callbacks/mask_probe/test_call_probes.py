"""Calling the model for the probes, without a Trainer (functional/call_probes.py): by signature, and through a
recorded call re-issued with perturbed tokens."""

import torch
from torch import nn

from lightning_tfdebug.callbacks.mask_probe import call_probes
from lightning_tfdebug.callbacks.mask_probe.leak_checks import LeakReading, LeakSummary, RepeatReading
from lightning_tfdebug.primitives.call_finder import find_model_call
from lightning_tfdebug.primitives.calls import record_calls


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
    keyword = call_probes.build_caller(KeywordModel())
    assert (keyword.takes_mask, keyword.mask_named) == (True, True)
    assert keyword.call(ids, mask)["mask"] is mask
    kwargs = call_probes.build_caller(KwargsModel(), input_key="tokens", mask_key="keep")
    assert (kwargs.takes_mask, kwargs.mask_named) == (True, False)
    assert set(kwargs.call(ids, mask)) == {"tokens", "keep"}
    positional = call_probes.build_caller(PositionalModel())
    assert (positional.takes_mask, positional.mask_named) == (False, False)
    assert positional.call(ids, None) is ids
    assert "set `forward_fn`" in call_probes.build_caller(NoArgsModel())
    custom = call_probes.build_caller(PositionalModel(), forward_fn=lambda module, i, m: (module, i, m))
    assert custom.takes_mask and custom.call(ids, mask)[2] is mask


class Seq2Seq(nn.Module):
    """Source and decoder input; the decoder output at t reads the decoder input at t (and, when ``leak``, t + 1)."""

    def __init__(self, leak: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.head, self.leak = nn.Embedding(30, 8), nn.Linear(8, 30), leak

    def forward(self, src, tgt):
        h = self.emb(tgt) + self.emb(src).mean(1, keepdim=True)
        if self.leak:
            h = h + torch.roll(self.emb(tgt), -1, dims=1)
        return self.head(h)


def test_leaks_are_measured_through_the_argument_that_carries_the_labels():
    src = torch.randint(0, 30, (2, 8), generator=torch.Generator().manual_seed(0))
    labels = torch.randint(1, 30, (2, 8), generator=torch.Generator().manual_seed(1))
    decoder_input = torch.cat([torch.zeros(2, 1, dtype=torch.long), labels[:, :-1]], 1)  # shifted right
    for leak, leaked in ((False, False), (True, True)):
        model = Seq2Seq(leak)
        _, calls = record_calls(model, lambda model=model: model(src, decoder_input))
        found = find_model_call(calls, src, labels=labels)
        assert not isinstance(found, str) and found.kind == "encoder-decoder" and found.kind_source == "decoder input"
        [slot] = found.related()
        assert slot.name == "tgt" and slot.offset == 1 and not slot.primary
        with torch.no_grad():
            readings = call_probes.measure_leaks(
                found, call_probes.call_vocab(found, src), 2, torch.Generator().manual_seed(0)
            )
        repeat, leak_reading, summary = readings
        assert isinstance(repeat, RepeatReading) and isinstance(summary, LeakSummary)
        assert isinstance(leak_reading, LeakReading) and (float(leak_reading.max_change) > 1e-3) == leaked


def test_a_recorded_call_is_reissued_with_the_probes_tokens():
    model = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 10))
    ids = torch.randint(0, 10, (3, 5))
    _, calls = record_calls(model, lambda: model(ids))
    found = find_model_call(calls, ids, labels=ids)
    vocab = call_probes.call_vocab(found, ids)
    other = ids.flip(1)[:2]
    logits = call_probes.call_logits(found, vocab, other, None, torch.Generator())
    assert torch.allclose(logits, model(other))
    perturbed = call_probes.perturb_from(found, vocab, found.primary, 2, 2, torch.Generator().manual_seed(0))
    assert torch.equal(perturbed[:, :2], ids[:2, :2]) and not torch.equal(perturbed[:, 2:], ids[:2, 2:])
