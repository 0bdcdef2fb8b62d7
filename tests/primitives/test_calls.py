"""The one model-call reading (primitives/calls.py, primitives/call_finder.py): the recorder, which call is the
model, where its tensors sit, its logits and the model's kind, on plain modules without a Trainer."""

import pytest
import torch
from torch import nn

from lightning_tfdebug.primitives.call_finder import find_model_call, model_kind
from lightning_tfdebug.primitives.calls import (
    CallRecorder,
    Objective,
    read_logits,
    read_objective,
    record_calls,
    relation_offset,
    takes_tokens,
)


class Tiny(nn.Module):
    def __init__(self, vocab: int = 12) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.head = nn.Embedding(vocab, 4), nn.Linear(4, vocab)

    def forward(self, input_ids, attention_mask=None, labels=None):
        return {"logits": self.head(self.emb(input_ids))}


class LossOnly(nn.Module):
    """A loss-only wrapper: slices the rows, calls its network, returns the loss."""

    def __init__(self) -> None:
        super().__init__()
        self.net = Tiny()

    def forward(self, rows):
        logits = self.net(rows[:, :-1])["logits"]
        return nn.functional.cross_entropy(logits.flatten(0, 1), rows[:, 1:].flatten())


def test_the_recorder_keeps_the_outermost_calls_or_every_depth():
    model = LossOnly()
    rows = torch.randint(0, 12, (2, 6))
    recorder = CallRecorder(model).start()
    model(rows)
    assert [type(c.module).__name__ for c in recorder.stop()] == ["LossOnly"]
    _, calls = record_calls(model, lambda: model(rows), nested=True, want=takes_tokens)
    assert [(type(c.module).__name__, c.depth, c.order) for c in calls] == [("LossOnly", 0, 0), ("Tiny", 1, 1)]
    assert all(not m._forward_hooks for m in model.modules())  # the hooks are gone


def test_the_model_call_and_its_tensors():
    model = Tiny()
    ids = torch.randint(0, 12, (2, 6))
    mask = torch.ones_like(ids)
    mask[1, -2:] = 0
    _, calls = record_calls(model, lambda: model(input_ids=ids, attention_mask=mask, labels=ids))
    found = find_model_call(calls, ids, mask, ids)
    assert not isinstance(found, str)
    assert found.primary.path == ("kwargs", "input_ids") and found.mask_path == ("kwargs", "attention_mask")
    assert found.shift == 1 and {s.name for s in found.related()} == {"input_ids", "labels"}
    assert (found.kind, found.kind_source) == ("decoder", "labels") and found.objective.next_token
    assert found.logits().shape == (2, 6, 12) and found.token_rows(ids, mask)[1][1, -1] == -100
    found.release()
    assert found.logits() is None and found.kind == "decoder"


def test_why_there_is_no_model_call():
    model = nn.Linear(3, 3)
    _, calls = record_calls(model, lambda: model(torch.randn(2, 3)))
    reason = find_model_call(calls, torch.randint(0, 3, (2, 4)))
    assert isinstance(reason, str) and "modules called: Linear" in reason


class Classifier(nn.Module):
    """A sequence classifier: an encoder whose per-position states (wider than the ids) are pooled to (B, C)."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = Tiny(vocab=40)  # returns {"logits": (B, T, 40)}: hidden states, for the classifier
        self.head = nn.Linear(40, 3)

    def forward(self, input_ids):
        return {"logits": self.head(self.encoder(input_ids)["logits"].mean(1))}


def test_a_sequence_classifier_is_not_read_through_its_encoder():
    model = Classifier()
    ids = torch.randint(0, 12, (2, 5))
    _, calls = record_calls(model, lambda: model(ids), nested=True, want=takes_tokens)
    assert [type(c.module).__name__ for c in calls] == ["Classifier", "Tiny"]  # the encoder's call was recorded
    reason = find_model_call(calls, ids)
    assert isinstance(reason, str) and "one output per sequence" in reason  # never the encoder's states as logits


def test_the_kind_of_a_loss_only_wrapper_and_of_configs():
    model = LossOnly()
    rows = torch.randint(0, 12, (2, 7))
    _, calls = record_calls(model, lambda: model(rows), nested=True, want=takes_tokens)
    found = find_model_call(calls, rows)
    assert (found.kind, found.kind_source, found.sliced, found.ids_stop) == ("loss-only wrapper", "wrapper", True, -1)

    class Config:
        is_encoder_decoder, is_decoder = True, False

    model.net.config = Config()
    assert model_kind(found, calls, model) == ("encoder-decoder", "config")
    assert model_kind(None, (), model) == ("encoder-decoder", "config")  # without a call: the config alone
    Config.is_encoder_decoder, Config.is_decoder = False, True
    assert model_kind(None, (), model) == ("decoder", "config")
    assert model_kind(None, (), nn.Linear(2, 2)) == ("unknown", "")


def test_masked_lm_labels_read_as_an_encoder():
    model = Tiny()
    ids = torch.randint(0, 12, (2, 8), generator=torch.Generator().manual_seed(0))
    labels = torch.full_like(ids, -100)
    labels[:, 3] = (ids[:, 3] + 1) % 12  # a masked position whose label is another token
    _, calls = record_calls(model, lambda: model(ids))
    found = find_model_call(calls, ids, labels=labels)
    assert (found.kind, found.kind_source) == ("encoder", "labels")
    assert read_objective(ids, labels, -100) == Objective(2.0, 0.0, 0.0, 2.0, label_positions=16)


@pytest.mark.parametrize(
    "shape, seq_first, expected",
    [((2, 5, 7), False, (2, 5, 7)), ((5, 2, 7), True, (2, 5, 7)), ((10, 7), False, (2, 5, 7)), ((2, 7), False, None)],
)
def test_read_logits_layouts(shape, seq_first, expected):
    logits = read_logits((torch.randn(*shape), "cache"), 2, seq_first)
    assert (None if logits is None else tuple(logits.shape)) == expected


def test_relation_offset():
    labels = torch.randint(1, 50, (2, 10), generator=torch.Generator().manual_seed(0))
    right = torch.cat([torch.zeros(2, 1, dtype=torch.long), labels[:, :-1]], 1)
    assert relation_offset(labels, labels, -100) == 0
    assert relation_offset(right, labels, -100) == 1  # a decoder input shifted right: position t carries label t-1
    assert relation_offset(torch.randint(50, 90, (2, 10)), labels, -100) is None


def _seq2seq_call(family: str, decoder_fed_labels: bool, labels_are_ids: bool = False):
    """A tiny Hugging Face encoder-decoder called with labels (and, for the bug, the labels as its decoder input)."""
    pytest.importorskip("transformers")
    from tests.healthy_models import hf_model

    model = hf_model(family).eval()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 200, (2, 10), generator=g)
    labels = ids.clone() if labels_are_ids else torch.randint(3, 200, (2, 8), generator=g)
    kwargs = {"input_ids": ids, "labels": labels}
    if decoder_fed_labels:
        kwargs["decoder_input_ids"] = labels
    with torch.no_grad():
        _, calls = record_calls(model, lambda: model(**kwargs))
    return find_model_call(calls, ids, None, labels), model


@pytest.mark.parametrize("family", ["t5", "bart"])
def test_an_encoder_decoder_is_told_apart_and_names_its_decoder_input(family):
    found, _ = _seq2seq_call(family, decoder_fed_labels=False, labels_are_ids=True)
    assert (found.kind, found.kind_source) == ("encoder-decoder", "config")
    # the labels equal the encoder's input ids, yet the encoder's input is never a probed slot; output p is label p
    assert found.shift == 0 and [s.name for s in found.related()] == ["labels"]
    assert found.decoder_input.name == "labels" and found.decoder_input.label_like
    found, model = _seq2seq_call(family, decoder_fed_labels=True)
    assert found.decoder_input.name == "decoder_input_ids" and found.decoder_input.offset == 0  # its own targets
    assert model_kind(None, model=model) == ("encoder-decoder", "config")


def test_a_kind_given_by_the_user_wins():
    model = Tiny()
    ids = torch.randint(0, 12, (2, 6))
    _, calls = record_calls(model, lambda: model(input_ids=ids, labels=ids))
    found = find_model_call(calls, ids, None, ids, kind="encoder-decoder")
    assert (found.kind, found.kind_source, found.shift) == ("encoder-decoder", "setting", 0)
    assert [s.name for s in found.related()] == ["labels"]


class NamesADecoderInput(nn.Module):
    """No config; a forward that takes ``decoder_input_ids`` (not passed here) and returns logits over the ids."""

    def __init__(self) -> None:
        super().__init__()
        self.tiny = Tiny()

    def forward(self, input_ids, decoder_input_ids=None, labels=None):
        return self.tiny(input_ids)


def test_a_forward_taking_decoder_input_ids_is_an_encoder_decoder():
    model = NamesADecoderInput()
    ids = torch.randint(0, 12, (2, 6))
    _, calls = record_calls(model, lambda: model(ids, labels=ids))
    found = find_model_call(calls, ids, None, ids)
    assert (found.kind, found.kind_source) == ("encoder-decoder", "decoder_input_ids")
    assert found.decoder_input.name == "labels" and found.shift == 0
