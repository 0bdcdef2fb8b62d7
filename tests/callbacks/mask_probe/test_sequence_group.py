"""MaskProbe on a model call that carries several sequences sharing a length (a decoder's ids, its mask and the
per-position labels): the probes cut, extend and perturb them together so the replayed call stays valid, leave the
encoder's tensors of another length alone, and read the outputs as a dict, a tuple or a ``ModelOutput``. Real
Trainers on tiny ``nn.Transformer`` encoder-decoders."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import DataLoader

from lightning_tfdebug import MaskProbe
from lightning_tfdebug.callbacks.mask_probe.call_probes import call_logits, call_vocab, extended
from lightning_tfdebug.primitives.call_finder import find_model_call
from lightning_tfdebug.primitives.calls import record_calls
from tests.bug_models import kind_loader, kind_module
from tests.helpers import fit_tiny
from tests.kind_models import BOS, EOS, IGNORE, PAD, KindModule, ReverseRows

VOCAB, WIDTH = 16, 16


def no_problems(probe: MaskProbe) -> list[str]:
    return [f.format() for f in probe.findings if f.severity in ("warning", "error")]


# ------------------------------------------------------------------------------------------- the kind family's model
@pytest.mark.parametrize("leak", [False, True])
def test_the_decoder_fed_its_targets_is_caught_through_labels_of_the_decoders_length(tmp_path, leak):
    """``nn.Transformer`` called with input_ids (12 tokens), attention_mask, decoder_input_ids, decoder_attention_mask
    and keyword labels (13): the labels are read at their own length, so the decoder input is found to carry them."""
    probe = MaskProbe()
    model, data = kind_module("seq2seq_reverse", leak=leak)(), kind_loader("seq2seq_reverse")()
    fit_tiny(tmp_path, [probe], model=model, data=data, max_steps=2)
    if not leak:
        assert no_problems(probe) == []
        assert probe.coverage["target leak into the inputs"][0] == "verified"  # probed, and held
        status, reason, _ = probe.coverage["label alignment"]  # the decoder's targets: the leak probe's, not this row's
        assert status == "n/a" and "encoder-decoder" in reason
        assert probe.last_report["mask_probe/causal_max_change"] == 0.0  # a causal decoder fed shifted targets
        return
    [found] = [f for f in probe.findings if f.code == "TFD214"]
    assert found.severity == "error" and found.evidence["argument"] == "decoder_input_ids"
    assert found.evidence["label_offset"] == 0 and "the label of its own position" in found.message


# ------------------------------------------------------------------- a positional call, one length on both sides
class Seq2Seq(nn.Module):
    """An encoder-decoder called positionally: ``(src, src_pad, tgt, tgt_pad, tgt_weight, labels)``, the pads boolean
    (True = padding), ``tgt_weight`` a float per decoder position; returns ``output`` (``"dict"``, ``"tuple"`` or
    ``"model_output"``) holding the loss and the logits."""

    def __init__(self, output: str) -> None:
        super().__init__()
        self.output = output
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.pos = nn.Parameter(torch.randn(32, WIDTH) * 0.1)
        self.transformer = nn.Transformer(WIDTH, 2, 1, 1, 2 * WIDTH, dropout=0.0, batch_first=True)
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, src, src_pad, tgt, tgt_pad, tgt_weight, labels) -> Any:
        t = tgt.shape[1]
        causal = nn.Transformer.generate_square_subsequent_mask(t, device=tgt.device)
        h = self.transformer(
            self.embed(src) + self.pos[: src.shape[1]],
            (self.embed(tgt) + self.pos[:t]) * tgt_weight.unsqueeze(-1),
            tgt_mask=causal,
            tgt_is_causal=True,
            src_key_padding_mask=src_pad,
            memory_key_padding_mask=src_pad,
            tgt_key_padding_mask=tgt_pad,
        )
        logits = self.head(h)
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE)
        if self.output == "tuple":
            return loss, logits
        if self.output == "model_output":
            from transformers.modeling_outputs import Seq2SeqLMOutput

            return Seq2SeqLMOutput(loss=loss, logits=logits)
        return {"loss": loss, "logits": logits}


class Seq2SeqModule(KindModule):
    """The step builds the decoder's tensors from the batch (``leak``: the decoder reads the labels unshifted)."""

    def __init__(self, output: str = "dict", leak: bool = False) -> None:
        super().__init__(lr=3e-3)
        self.net, self.leak = Seq2Seq(output), leak

    def loss(self, batch: dict[str, Tensor]) -> Tensor:
        labels = batch["labels"]
        tgt = labels.masked_fill(labels == IGNORE, PAD) if self.leak else batch["decoder_input_ids"]
        pad = labels == IGNORE
        out = self.net(batch["input_ids"], batch["attention_mask"] == 0, tgt, pad, (~pad).float(), labels)
        return out[0] if isinstance(out, tuple) else out["loss"]


def one_length(rows: list[Tensor]) -> dict[str, Tensor]:
    """Sources and targets padded to one width (the source reversed, then EOS; the decoder reads BOS first)."""
    targets = [torch.cat([r.flip(0), torch.tensor([EOS])]) for r in rows]
    width = max(len(t) for t in targets)
    src = torch.full((len(rows), width), PAD)
    tgt = torch.full((len(rows), width), IGNORE)
    for i, (r, t) in enumerate(zip(rows, targets)):
        src[i, : len(r)], tgt[i, : len(t)] = r, t
    decoder = torch.cat([torch.full((len(rows), 1), BOS), tgt[:, :-1]], 1).clamp(min=PAD)
    return {"input_ids": src, "attention_mask": (src != PAD).long(), "decoder_input_ids": decoder, "labels": tgt}


def one_length_data() -> DataLoader:
    return DataLoader(ReverseRows(rows=64), batch_size=8, collate_fn=one_length)


@pytest.mark.parametrize("output, leak", [("dict", False), ("tuple", True), ("model_output", True)])
def test_sequences_of_one_length_are_cut_together_in_a_positional_call(tmp_path, output, leak):
    """Source and decoder share a length and the probes cut the rows to ``probe_length``: the decoder's ids, its
    boolean padding mask, its float weights and the labels are cut with them, so every replay runs."""
    if output == "model_output":
        pytest.importorskip("transformers")
    probe = MaskProbe(probe_length=6)
    fit_tiny(tmp_path, [probe], model=Seq2SeqModule(output, leak=leak), data=one_length_data(), max_steps=2)
    assert not [f for f in probe.findings if f.code == "TFD211"], "a replay failed"
    assert probe.coverage["cross-sample"][0] == "verified" and probe.coverage["padding"][0] == "verified"
    if leak:
        [found] = [f for f in probe.findings if f.code == "TFD214"]
        assert found.evidence["argument"] == "tgt" and found.severity == "error"
    else:
        assert no_problems(probe) == [] and probe.coverage["target leak into the inputs"][0] == "verified"


def test_the_group_is_read_by_shape_and_cut_or_extended_together():
    """The tensors of the ids' length along dim 1 form one group, whatever their dtype and name; cutting the ids cuts
    them all; only labels may take a longer probe (ids of the batch); other members copy their last position."""
    net = Seq2Seq("dict").eval()
    batch = one_length([torch.arange(3, 3 + n) for n in (5, 7)])
    ids, labels = batch["input_ids"], batch["labels"]
    pad = labels == IGNORE
    args = (ids, ids == PAD, batch["decoder_input_ids"], pad, (~pad).float(), labels)
    with torch.no_grad():
        _, calls = record_calls(net, lambda: net(*args))
        found = find_model_call(calls, ids, labels=labels, model=net)
        assert not isinstance(found, str) and found.kind == "encoder-decoder"
        group = found.sequence_group(ids.shape[1])
        assert group == [("args", i) for i in range(6)]  # ids, both boolean pads, decoder ids, weights, labels
        assert found.time_cut_safe and not found.resizable  # the decoder's ids cannot take a longer probe
        assert found.decoder_input is not None and found.decoder_input.offset == 1  # BOS + the labels
        vocab = call_vocab(found, ids)
        cut = call_logits(found, vocab, ids[:, :5], None, torch.Generator().manual_seed(0))
        assert cut.shape == (2, 5, VOCAB)
        # a call whose only other sequence of the ids' length is the labels: extended with the ignored value
        only_labels = find_model_call(calls, ids, labels=labels, model=net)
        assert not isinstance(only_labels, str)
        only_labels.tensors = {p: t for p, t in only_labels.tensors.items() if p in (("args", 0), ("args", 5))}
        only_labels.slots = [s for s in only_labels.slots if s.path in only_labels.tensors]
        assert only_labels.resizable
        longer = extended(only_labels, ("args", 5), labels, labels.shape[1] + 3, vocab, torch.Generator())
        assert torch.equal(longer[:, : labels.shape[1]], labels) and torch.isin(longer[:, -3:], vocab).all()
        weights = extended(only_labels, ("args", 4), (~pad).float(), labels.shape[1] + 3, vocab, torch.Generator())
        assert torch.equal(weights[:, -3:], (~pad).float()[:, -1:].expand(2, 3))  # copies of its last position


# ------------------------------------------------------------------------------------------ a call that cannot replay
class OnceOnly(nn.Module):
    """A forward that consumes a queue the step fills: a second call of the same arguments finds it empty."""

    def __init__(self) -> None:
        super().__init__()
        self.net = Seq2Seq("dict")
        self.queue: list[int] = []

    def forward(self, *args: Tensor) -> Any:
        self.queue.pop()
        return self.net(*args)


class OnceOnlyModule(Seq2SeqModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = OnceOnly()

    def loss(self, batch: dict[str, Tensor]) -> Tensor:
        self.net.queue.append(1)
        return super().loss(batch)


def test_a_call_that_cannot_be_replayed_is_a_question_mark_in_coverage(tmp_path):
    probe = MaskProbe()
    trainer = fit_tiny(tmp_path, [probe], model=OnceOnlyModule(), data=one_length_data(), max_steps=2)
    assert trainer.global_step == 2  # the user's run went on
    status, reason, setting = probe.coverage["target leak into the inputs"]
    assert status == "unknown" and "IndexError" in (reason or "") and "forward_fn" in (setting or "")
    assert [f.severity for f in probe.findings if f.code == "TFD211"] == ["info"]


class SeqFirst(nn.Module):
    """``nn.Transformer`` sequence-first: ``(src (S, B), tgt (T, B), tgt_pad (B, T))``, logits ``(T, B, V)``."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.transformer = nn.Transformer(WIDTH, 2, 1, 1, 2 * WIDTH, dropout=0.0)
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, src: Tensor, tgt: Tensor, tgt_pad: Tensor) -> Tensor:
        causal = nn.Transformer.generate_square_subsequent_mask(tgt.shape[0])
        return self.head(
            self.transformer(self.embed(src), self.embed(tgt), tgt_mask=causal, tgt_key_padding_mask=tgt_pad)
        )


def test_a_sequence_first_call_keeps_each_tensors_own_layout():
    """The decoder's ids are ``(T, B)``, its padding mask ``(B, T)``: both follow a cut of the ids, each in its layout,
    and the probe rows narrow each along its own row dimension."""
    net = SeqFirst().eval()
    batch = one_length([torch.arange(3, 3 + n) for n in (5, 7, 6)])
    ids, labels = batch["input_ids"], batch["labels"]
    tgt, pad = batch["decoder_input_ids"].T, labels == IGNORE
    with torch.no_grad():
        _, calls = record_calls(net, lambda: net(ids.T, tgt, pad))
        found = find_model_call(calls, ids, labels=labels, model=net)
        assert not isinstance(found, str) and found.out_seq_first
        assert found.sequence_group(ids.shape[1]) == [("args", 0), ("args", 1), ("args", 2)]
        assert [found.seq_first_at(p) for p in found.sequence_group(ids.shape[1])] == [True, True, False]
        logits = call_logits(found, call_vocab(found, ids), ids[:2, :5], None, torch.Generator().manual_seed(0))
    assert logits.shape == (2, 5, VOCAB)
