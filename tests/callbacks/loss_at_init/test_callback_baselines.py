"""LossAtInit's data-aware baselines and the failure classes they expose, on two model families each (TinyGPT and
Hugging Face GPT-2 / Llama built from tiny configs; the Hugging Face variants are marked slow, run them with
``-m slow``), with healthy controls: the labels' unigram entropy, the bounded-output floor (TFD230), labels from other
samples (TFD231), a model that ignores its context (TFD232), a stall judged over a window (TFD225), masked-LM labels,
and a pretrained model's first loss (TFD223 info)."""

import math
import warnings

import pytest
import torch
from torch import nn

from lightning_tfdebug import LossAtInit, OptimizerAudit, TFDebugWarning
from lightning_tfdebug.demo import TinyGPT, TinyTextDataModule
from tests.healthy_models import HFLM, build, data, pretrain, with_lora
from tests.helpers import SMALL, fit_tiny, make_trainer, read_scalars

LN_V = math.log(259)
CHECK = 100  # long enough for the tests' models to reach the labels' unigram entropy


def codes(callback):
    return [f.code for f in callback.findings]


class Relabelled(TinyTextDataModule):
    """The bundled text with labels that belong to other samples: ``"roll"`` joins each row's labels to the next
    row's inputs (an off-by-one in an index join), ``"shuffle"`` permutes the label column within the batch."""

    def __init__(self, how: str) -> None:
        super().__init__(batch_size=8)
        inner, self.how = self.collator, how

        def collate(samples):
            batch = inner(samples)
            labels = batch["labels"]
            batch["labels"] = labels.roll(1, 0) if how == "roll" else labels[torch.randperm(labels.shape[0])]
            return batch

        self.collator = collate


class TanhTinyGPT(TinyGPT):
    """Logits squashed by a tanh before the loss: a range of width 2 at most."""

    def forward(self, input_ids, attention_mask=None):
        return super().forward(input_ids, attention_mask).tanh()


class BlindTinyGPT(TinyGPT):
    """Every input token replaced by token 0 before the model: it sees positions only, never its context."""

    def forward(self, input_ids, attention_mask=None):
        return super().forward(torch.zeros_like(input_ids), attention_mask)


class SquashedHF(HFLM):
    """A Hugging Face causal LM whose output layer ends in a squashing activation."""

    def __init__(self, family: str, squash: nn.Module) -> None:
        super().__init__(family)
        self.model.lm_head = nn.Sequential(self.model.lm_head, squash)


class BlindHF(HFLM):
    def training_step(self, batch, batch_idx):
        blind = torch.zeros_like(batch["input_ids"])
        return self.model(input_ids=blind, attention_mask=batch["attention_mask"], labels=batch["labels"]).loss


def fit(tmp_path, model, data=None, check_step=CHECK, **kwargs):
    monitor = LossAtInit(check_step=check_step, every_n_steps=10)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = fit_tiny(tmp_path, [monitor], model, data, max_steps=check_step + 1, **kwargs)
    return monitor, trainer


@pytest.mark.parametrize(
    "model",
    [
        pytest.param(lambda: TanhTinyGPT(**SMALL, lr=2e-3), id="tinygpt-tanh"),
        pytest.param(lambda: SquashedHF("llama", nn.Sigmoid()), id="llama-sigmoid", marks=pytest.mark.slow),
    ],
)
def test_outputs_squashed_into_a_bounded_range_pin_the_loss_at_their_floor(tmp_path, model):
    monitor, trainer = fit(tmp_path, model())
    [early, finding] = monitor.findings
    # the compared steps read the bound from the logits' own range first: its floor binds (TFD236, by step 40)
    assert early.code == "TFD236" and early.severity == "error" and early.step <= 40
    assert finding.code == "TFD230" and finding.severity == "warning" and finding.step == CHECK
    evidence = finding.evidence
    # the floor is the bound of the measured range, and it is above what learning the frequencies gives
    assert evidence["logit_range"] <= 2.0
    assert evidence["floor"] == pytest.approx(math.log1p(258 * math.exp(-evidence["logit_range"])), rel=0.05)
    assert evidence["unigram_entropy"] < evidence["floor"] <= evidence["loss"] < 0.95 * LN_V
    assert trainer.callback_metrics["loss_at_init/loss_floor"].item() == pytest.approx(evidence["floor"])


@pytest.mark.parametrize(
    "model, how, relation",
    [
        pytest.param(lambda: TinyGPT(**SMALL, lr=2e-3), "roll", "neighbouring", id="tinygpt-off-by-one"),
        pytest.param(lambda: HFLM("gpt2"), "shuffle", "neither", id="gpt2-shuffled", marks=pytest.mark.slow),
    ],
)
def test_labels_that_belong_to_other_samples(tmp_path, model, how, relation):
    monitor, _ = fit(tmp_path, model(), Relabelled(how))
    [finding] = monitor.findings
    assert finding.code == "TFD231" and finding.step == CHECK and relation in finding.message
    evidence = finding.evidence
    assert evidence["rolled_loss"] - evidence["loss"] <= 0.01 * evidence["loss"]  # no better on its own labels
    assert 0.85 * evidence["unigram_entropy"] <= evidence["loss"] <= 1.1 * evidence["unigram_entropy"]
    if how == "roll":  # the labels are the next row's inputs
        assert evidence["rolled_match"] > 0.9 > 0.3 > evidence["own_match"]


@pytest.mark.parametrize(
    "model",
    [
        pytest.param(lambda: BlindTinyGPT(**SMALL, lr=2e-3), id="tinygpt"),
        pytest.param(lambda: BlindHF("gpt2"), id="gpt2", marks=pytest.mark.slow),
    ],
)
def test_a_model_that_ignores_its_context_stalls_at_the_unigram_entropy(tmp_path, model):
    monitor, _ = fit(tmp_path, model())
    [finding] = monitor.findings
    assert finding.code == "TFD232" and "ignores its context" in finding.message
    assert finding.evidence["own_match"] > 0.9  # the labels are right: they repeat their own inputs


@pytest.mark.parametrize(
    "model",
    [
        pytest.param(lambda: TinyGPT(**SMALL, lr=2e-3), id="tinygpt"),
        pytest.param(lambda: HFLM("gpt2"), id="gpt2", marks=pytest.mark.slow),
        pytest.param(lambda: HFLM("llama"), id="llama", marks=pytest.mark.slow),
    ],
)
def test_healthy_runs_raise_nothing_and_log_the_baselines(tmp_path, model):
    monitor, _ = fit(tmp_path, model())
    assert codes(monitor) == []
    scalars = read_scalars(tmp_path / "tb" / "version_0")
    assert [s for s, _ in scalars["loss_at_init/loss"]] == list(range(0, CHECK + 1, 10))
    assert scalars["loss_at_init/ln_vocab"][0] == (0, pytest.approx(LN_V))
    entropy = dict(scalars["loss_at_init/unigram_entropy"])
    assert min(entropy) == 10  # step 0's labels are reduced with the next measuring step's
    assert 0.4 * LN_V < entropy[CHECK] < 0.6 * LN_V  # English bytes: about 2.9 nats of ln(259) = 5.56
    losses = dict(scalars["loss_at_init/loss"])
    assert losses[0] == pytest.approx(LN_V, rel=0.05) and losses[CHECK] < entropy[CHECK]
    assert dict(scalars["loss_at_init/rolled_loss"])[CHECK] > 1.05 * losses[CHECK]  # it uses its context


def test_a_stall_is_a_flat_window_not_one_point(tmp_path):
    """A learning rate so low the loss creeps: at ln(V) at the check but still falling is no stall, a flat one is."""
    monitor = LossAtInit(check_step=20, every_n_steps=2)
    fit_tiny(tmp_path / "flat", [monitor], TinyGPT(**SMALL, lr=1e-6, warmup_steps=0), max_steps=21)
    [stall] = monitor.findings
    assert stall.code == "TFD225" and stall.evidence["window_start"] == 10
    assert stall.evidence["unigram_entropy"] < 0.6 * LN_V and "not even the frequencies" in stall.message


def test_masked_lm_labels_are_recognised_and_checked_later(tmp_path):
    """BERT's masking recipe: few supervised positions, most of their inputs the mask token. Its loss sits at the
    unigram entropy for a while, so the check moves to 5x check_step, with the labels aligned (no shift)."""
    monitor = LossAtInit(check_step=4, every_n_steps=2)
    trainer = make_trainer(tmp_path, [monitor], max_steps=21)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(build("bert_mlm"), data("bert_mlm"))
    assert monitor._run.masked_lm and monitor._run.check_at == 20 and monitor._run.check_done
    assert codes(monitor) == []
    assert "loss_at_init/check_loss" in trainer.callback_metrics
    state = monitor.state_dict()
    restored = LossAtInit(check_step=4)
    restored.load_state_dict(state)
    assert restored._run.check_at == 20 and restored._run.masked_lm
    assert restored._frequencies.entropy == pytest.approx(monitor._frequencies.entropy)


def _progressions(rows: int = 512, length: int = 32, vocab: int = 64) -> torch.Tensor:
    """Rows ``(start + stride * t) mod vocab``: every token equally frequent (the unigram entropy is ln(vocab)), and
    each masked token follows from its neighbours."""
    g = torch.Generator().manual_seed(0)
    start = torch.randint(0, vocab, (rows, 1), generator=g)
    stride = torch.randint(1, 4, (rows, 1), generator=g) * 2 - 1
    return (start + stride * torch.arange(length)) % vocab


def _mask_tokens(rows: list[torch.Tensor], mask_id: int = 64) -> dict[str, torch.Tensor]:
    ids = torch.stack(rows)
    draw = torch.rand(ids.shape)
    chosen = draw < 0.15
    labels = torch.where(chosen, ids, torch.full_like(ids, -100))
    inputs = torch.where(chosen & (draw < 0.12), torch.full_like(ids, mask_id), ids)
    return {"input_ids": inputs, "attention_mask": torch.ones_like(ids), "labels": labels}


class NearUniformMLM(HFLM):
    def __init__(self) -> None:
        import transformers

        super().__init__("bert_mlm", lr=4e-3, warmup_steps=10)
        config = transformers.BertConfig(
            vocab_size=65, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2
        )
        self.model = transformers.BertForMaskedLM(config)


def test_the_masked_lm_plateau_at_a_near_uniform_unigram_entropy_is_no_stall(tmp_path):
    """The issue's run: a BERT-style masked LM whose loss sits at the data's unigram entropy (0.99 ln(V) here) for
    dozens of steps and then falls. At `check_step` it is on the plateau, within 5% of ln(V); the check waits."""
    torch.manual_seed(0)
    monitor = LossAtInit(check_step=20, every_n_steps=5)
    loader = torch.utils.data.DataLoader(list(_progressions()), batch_size=16, shuffle=True, collate_fn=_mask_tokens)
    trainer = make_trainer(tmp_path, [monitor], max_steps=101)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(NearUniformMLM(), loader)
    ln_v, history = math.log(65), dict(monitor._run.history)
    assert monitor._frequencies.entropy > 0.99 * ln_v  # the data's own floor for a model that ignores context
    assert abs(history[20] - ln_v) < 0.05 * ln_v  # on the plateau at check_step: a one-point check would fire
    assert monitor._run.masked_lm and monitor._run.check_at == 100 and codes(monitor) == []
    assert history[100] < 0.95 * ln_v  # it left the plateau


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_fine_tuning_a_pretrained_model_is_no_warning(tmp_path, lora):
    """A pretrained model's first loss is far below ln(V) (TFD223 info, not a leak); LoRA with an optimizer built
    from every parameter holds frozen weights that AdamW skips (TFD322 info); a constant fine-tuning LR without
    warm-up is advice only (TFD330 info)."""
    weights = pretrain(tmp_path, "gpt2", steps=60)
    model = HFLM("gpt2", lr=5e-4, warmup_steps=0)
    model.model.load_state_dict({k.removeprefix("model."): v for k, v in weights.items()})
    if lora:
        model = with_lora(model, "gpt2")
        model.configure_optimizers = lambda: torch.optim.AdamW(model.parameters(), lr=5e-4)  # all, frozen too
    monitor, audit = LossAtInit(check_step=10, every_n_steps=5), OptimizerAudit(every_n_steps=5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", TFDebugWarning)
        warnings.simplefilter("ignore", UserWarning)
        fit_tiny(tmp_path / "tune", [monitor, audit], model, max_steps=12)
    [first] = monitor.findings
    assert (first.code, first.severity) == ("TFD223", "info") and first.evidence["pretrained"]
    assert first.evidence["observed_loss"] < 0.75 * LN_V
    severities = {(f.code, f.severity) for f in audit.findings}
    assert ("TFD330", "info") in severities and all(s == "info" for _, s in severities)
    assert (("TFD322", "info") in severities) == lora


@pytest.mark.parametrize(
    "family",
    ["encoder_lm", pytest.param("t5", marks=pytest.mark.slow)],
    ids=["encoder-lm-shifted-targets", "t5-decoder-labels"],
)
def test_a_pretrained_model_whose_labels_are_already_aligned_is_recognised(tmp_path, family):
    """Tuple batches of targets shifted by the data, and a seq2seq decoder's labels, are scored at their own position,
    not the next: ``shift_labels`` (default True) assumes otherwise. An untrained model gives ln(V) under either
    alignment; a trained one gives its loss only under the right one, so the loss the training step returned picks
    it, and the fine-tune's low first loss is the pretrained model's (info), not a loss unrelated to its logits."""
    weights = pretrain(tmp_path, family, steps=60)
    model = build(family, lr=2e-4)
    model.load_state_dict(weights)
    monitor = LossAtInit(check_step=20, every_n_steps=5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = make_trainer(tmp_path / "tune", [monitor], max_steps=21)
        trainer.fit(model, data(family))
    [first] = [f for f in monitor.findings if f.code == "TFD223"]
    assert first.severity == "info" and first.evidence["pretrained"] and not first.evidence["shift_labels"]
    assert first.evidence["recomputed_loss"] == pytest.approx(first.evidence["observed_loss"], rel=0.05)
    assert all(f.severity == "info" for f in monitor.findings), [f.format() for f in monitor.findings]
