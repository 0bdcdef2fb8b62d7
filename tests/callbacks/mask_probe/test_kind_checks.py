"""MaskProbe measures the model's kind when the labels ask for no next token, and judges the labels against it
(:mod:`lightning_tfdebug.callbacks.mask_probe.kind_checks`): real fits of TinyGPT on the bundled corpus."""

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_tfdebug import MaskProbe, TFDebugWarning
from lightning_tfdebug.callbacks.mask_probe import kind_checks
from lightning_tfdebug.demo import TinyGPT, TinyTextDataModule
from tests.bug_models import dict_data
from tests.helpers import SMALL, make_trainer

CLASSES = 5


def relabelled(relabel):
    """The bundled batches with their labels replaced by ``relabel(batch)``."""

    class Relabelled(TinyTextDataModule):
        def train_dataloader(self):
            loader = super().train_dataloader()
            collate = loader.collate_fn
            return torch.utils.data.DataLoader(
                loader.dataset, batch_size=8, collate_fn=lambda s: (b := collate(s)) | {"labels": relabel(b)}
            )

    return Relabelled(batch_size=8)


def probed(tmp_path, model, data, **trainer):
    probe = MaskProbe()
    trainer = make_trainer(tmp_path, [probe], max_steps=1, **trainer)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", TFDebugWarning)
        trainer.fit(model, data)
    return probe, {f.code: f for f in probe.findings}


def test_a_causal_lm_fed_another_samples_labels_is_named_with_the_relation_measured(tmp_path):
    probe, found = probed(tmp_path, TinyGPT(**SMALL), dict_data(collator="wrong_labels"))
    wrong = found["TFD210"]
    assert wrong.severity == "warning" and "TFD212" not in found
    assert wrong.evidence["labels_previous_row"] > 0.95  # the collator gives row i the labels of row i-1
    assert wrong.evidence["labels_own"] < 0.5 and wrong.evidence["labels_next"] < 0.5
    assert wrong.evidence["causal_max_change"] <= wrong.evidence["causal_tolerance"]
    assert "the model is causal" in wrong.message and "the previous sample's inputs" in wrong.message
    assert probe.coverage.get("label alignment", ("",))[0] != "n/a"


class TokenClassifierGPT(TinyGPT):
    """A causal transformer with a token-classification head: five classes per position, not the vocabulary."""

    def __init__(self) -> None:
        super().__init__(**SMALL)
        self.head = nn.Linear(SMALL["d_model"], CLASSES)

    def loss(self, logits, labels):
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)


def test_a_causal_token_classifier_gets_no_alignment_finding(tmp_path):
    classes = lambda b: (b["input_ids"] % CLASSES).masked_fill(b["attention_mask"] == 0, -100)  # noqa: E731
    probe, found = probed(tmp_path, TokenClassifierGPT(), relabelled(classes))
    assert not {"TFD210", "TFD211", "TFD212"} & set(found)
    assert [c for c, f in found.items() if f.severity != "info"] == []
    assert probe.coverage["label alignment"][0] == "n/a" and "token classifier" in probe.coverage["label alignment"][1]


def masked_lm(batch):
    """Masked-LM labels: 15% of the real positions (every 7th) supervised with their own token, -100 elsewhere."""
    ids, real = batch["input_ids"], batch["attention_mask"].bool()
    chosen = real & (torch.arange(ids.shape[1]) % 7 == 3)
    return ids.masked_fill(~chosen, -100)


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_a_bidirectional_model_with_masked_lm_labels_is_measured_an_encoder(tmp_path, precision):
    class MaskedInputs(TinyTextDataModule):  # the supervised positions hold a mask id in the inputs
        def train_dataloader(self):
            loader = super().train_dataloader()
            collate = loader.collate_fn

            def masked(samples):
                b = collate(samples)
                labels = masked_lm(b)
                return b | {"input_ids": b["input_ids"].masked_fill(labels != -100, 1), "labels": labels}

            return torch.utils.data.DataLoader(loader.dataset, batch_size=8, collate_fn=masked)

    class EncoderGPT(TinyGPT):  # bidirectional, trained at the same positions, its blocks' matrices at 0.1x the init
        def __init__(self):  # (in bf16 the outputs before the cut then move by less than bf16's logit tolerance)
            super().__init__(**SMALL, no_causal_mask=True)
            with torch.no_grad():
                for p in self.blocks.parameters():
                    p.mul_(0.1 if p.ndim == 2 else 1.0)

        def loss(self, logits, labels):
            return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)

    model, data = EncoderGPT(), MaskedInputs(batch_size=8)
    probe, found = probed(tmp_path, model, data, precision=precision)
    assert "TFD210" not in found and [c for c, f in found.items() if f.severity != "info"] == []
    assert "the model is bidirectional" in found["TFD212"].message
    assert probe.coverage["label alignment"][0] == "n/a"


# ----------------------------------------------------------------------------------------------- the pure parts
def test_label_relations_count_each_comparison_over_the_supervised_positions():
    ids = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]])
    rel = kind_checks.label_relations(ids, ids.roll(1, 0), -100)
    assert rel["previous_row"] == 1.0 and rel["own"] == 0.0 and rel["next_row"] == 0.0
    labels = ids.clone()
    labels[:, :-1] = ids[:, 1:]
    labels[:, -1] = -100
    rel = kind_checks.label_relations(ids, labels, -100)
    assert rel["next"] == 1.0 and rel["own"] == 0.0
    assert kind_checks.label_relations(ids[:1], ids[:1], -100)["previous_row"] == 0.0  # one row: no neighbour


@pytest.mark.parametrize(
    "width, embedding_rows, covers", [(13, 13, True), (13, None, True), (5, None, False), (13, 20, False)]
)
def test_outputs_over_the_vocabulary_cover_the_ids_and_the_token_embedding(width, embedding_rows, covers):
    ids = torch.tensor([[1, 12, 3]])
    model = None if embedding_rows is None else nn.ModuleDict({"tok": nn.Embedding(embedding_rows, 4)})
    assert kind_checks.covers_vocabulary(width, ids, ids, -100, model) is covers


def test_an_unmeasured_kind_falls_back_to_the_labels_and_says_so():
    measured = kind_checks.KindMeasure(None, why="the eval forward does not repeat")
    from lightning_tfdebug.primitives.calls import Objective

    judged = kind_checks.judge_labels(measured, Objective(10, 1, 1, 9, 12), {}, over_vocabulary=True)
    assert judged.verdict.code == "TFD212" and not judged.causal
    assert "could not be measured (the eval forward does not repeat)" in judged.verdict.message
