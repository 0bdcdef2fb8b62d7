"""LossAtInit reads the loss where the bug lives: the loss ``training_step`` returns against the cross-entropy of the
logits the model returned, on the compared steps (10, 20, 30 and 40, half-way and three quarters to the check, and the
check); the family is decided from the third compared step on (step 30), inside a preflight's 50 steps.

Bugs placed where users place them (in ``training_step``, in a loss wrapper module), each on two model families, one
of them not the bundled TinyGPT the thresholds were measured on: a sigmoid (TFD233), ``c * tanh(logits / c)`` in a
loss module (TFD233), a division by a temperature (TFD234). Healthy controls that make the returned loss differ from
the logits' cross-entropy on purpose stay silent (label smoothing is named at info): label smoothing, a z-loss, an
auxiliary loss, ``loss / k`` for manual accumulation, a sum divided by every label position; and a plain run. Hugging
Face variants are marked slow.
"""

import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_tfdebug import LossAtInit
from lightning_tfdebug.demo import TinyGPT
from tests.healthy_models import HFLM, EncoderLM, HealthyTinyGPT, data
from tests.helpers import SMALL, fit_tiny, read_scalars, run_distributed

LN_V = math.log(259)
CHECK = 100
EARLY = 30  # the third compared step: the family and floor are decided here


def shifted_ce(logits, labels, **kwargs):
    """Next-token cross-entropy of ``(batch, time, vocab)`` logits against labels that mirror the inputs."""
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100, **kwargs)


def aligned_ce(logits, targets, **kwargs):
    """Cross-entropy against targets already shifted by the data (EncoderLM's tuple batches)."""
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100, **kwargs)


class TanhLoss(nn.Module):
    """A loss wrapper that soft-caps the logits with ``c * tanh(logits / c)`` before the cross-entropy."""

    def __init__(self, cap: float, ce) -> None:
        super().__init__()
        self.cap, self.ce = cap, ce

    def forward(self, logits, labels):
        return self.ce(self.cap * torch.tanh(logits / self.cap), labels)


def _transform(module, how: str, logits, labels, ce):
    if how == "sigmoid":
        return ce(logits.sigmoid(), labels)
    if how == "tanh_loss":
        return module.criterion(logits, labels)
    if how == "temperature":
        return ce(logits / 2.0, labels)
    if how == "label_smoothing":
        return ce(logits, labels, label_smoothing=0.1)
    if how == "z_loss":
        return ce(logits, labels) + 1e-4 * logits.logsumexp(-1).square().mean()
    if how == "aux_loss":
        weights = [p for n, p in module.named_parameters() if p.ndim >= 2]
        return ce(logits, labels) + 0.01 * torch.stack([w.square().mean() for w in weights]).sum()
    if how == "sum_over_positions":  # summed over supervised tokens, divided by every label position
        return ce(logits, labels, reduction="sum") / labels.numel()
    assert how == "plain"
    return ce(logits, labels)


class StepTinyGPT(HealthyTinyGPT):
    """The bundled TinyGPT whose ``training_step`` does ``how`` to its logits on the way to the loss."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.criterion = TanhLoss(1.0, shifted_ce)

    def training_step(self, batch, batch_idx):
        logits = self(batch["input_ids"], batch.get("attention_mask"))
        return _transform(self, self.how, logits, batch["labels"], shifted_ce)


class StepEncoderLM(EncoderLM):
    """A causal LM on ``nn.TransformerEncoder`` with PyTorch's default initialisation, tuple batches of targets shifted
    by the data; its ``training_step`` does ``how`` to the logits."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.criterion = TanhLoss(1.0, aligned_ce)

    def training_step(self, batch, batch_idx):
        tokens, targets = batch
        return _transform(self, self.how, self(tokens), targets, aligned_ce)


class StepHF(HFLM):
    """A Hugging Face causal LM whose logits the step takes (``.logits``) and transforms before its own loss."""

    def __init__(self, family: str, how: str) -> None:
        super().__init__(family)
        self.how = how
        self.criterion = TanhLoss(1.0, shifted_ce)

    def training_step(self, batch, batch_idx):
        logits = self.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        return _transform(self, self.how, logits, batch["labels"], shifted_ce)


class SigmoidStepGPT(TinyGPT):
    """TinyGPT (any of its arguments) with ``logits.sigmoid()`` in ``training_step``, for the distributed run."""

    def training_step(self, batch, batch_idx):
        return shifted_ce(self(batch["input_ids"], batch.get("attention_mask")).sigmoid(), batch["labels"])


class ManualAccumulationGPT(HealthyTinyGPT):
    """Manual optimization with gradient accumulation over 4 batches: each returns ``loss / 4``."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        optimizer, schedule = self.optimizers(), self.lr_schedulers()
        loss = shifted_ce(self(batch["input_ids"], batch.get("attention_mask")), batch["labels"]) / 4
        self.manual_backward(loss)
        if (batch_idx + 1) % 4 == 0:
            optimizer.step()
            optimizer.zero_grad()
            schedule.step()
        return loss


def build(family: str, how: str):
    if family == "tinygpt":
        return StepTinyGPT(how), data("tinygpt")
    if family == "encoder_lm":
        return StepEncoderLM(how), data("encoder_lm")
    return StepHF(family, how), data(family)


def fit(tmp_path, model, datamodule, check_step=CHECK, max_steps=None, **kwargs):
    torch.manual_seed(0)
    monitor = LossAtInit(check_step=check_step, every_n_steps=10)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = fit_tiny(tmp_path, [monitor], model, datamodule, max_steps=max_steps or check_step + 1, **kwargs)
    return monitor, trainer


def compared(tmp_path):
    """``(step, the recorded logits' cross-entropy)`` on the compared steps, as logged."""
    return read_scalars(tmp_path / "tb" / "version_0").get("loss_at_init/logits_loss", [])


def transform_findings(monitor):
    return [f for f in monitor.findings if f.code in ("TFD233", "TFD234", "TFD235")]


@pytest.mark.parametrize(
    "family, how, width",
    [
        pytest.param("tinygpt", "sigmoid", 1.0, id="tinygpt-sigmoid"),
        pytest.param("encoder_lm", "sigmoid", 1.0, id="encoder_lm-sigmoid"),
        pytest.param("encoder_lm", "tanh_loss", 2.0, id="encoder_lm-tanh-loss-module"),
        pytest.param("llama", "sigmoid", 1.0, id="llama-sigmoid", marks=pytest.mark.slow),
        pytest.param("gpt2", "tanh_loss", 2.0, id="gpt2-tanh-loss-module", marks=pytest.mark.slow),
    ],
)
def test_a_squash_between_the_model_and_the_loss_pins_the_loss_at_its_floor(tmp_path, family, how, width):
    model, datamodule = build(family, how)
    monitor, trainer = fit(tmp_path, model, datamodule, max_steps=EARLY + 1)
    [finding] = transform_findings(monitor)
    assert finding.code == "TFD233" and finding.severity == "warning" and finding.step == EARLY
    evidence = finding.evidence
    assert evidence["steps"] == [10, 20, 30]
    # the forward's logits are unbounded and predict better than the loss says: the squash is after the forward
    assert all(c < r for c, r in zip(evidence["logits_loss"], evidence["returned_loss"]))
    assert not any(f.code == "TFD230" for f in monitor.findings)
    # the loss sits at the floor of a range no wider than the bound's
    assert 0.5 * width < evidence["width"] <= width
    assert evidence["floor"] == pytest.approx(math.log1p(258 * math.exp(-evidence["width"])))
    assert evidence["floor"] >= math.log1p(258 * math.exp(-width))
    # and that floor binds: above half of ln(V), an error (what `tfdebug check` exits 1 on)
    [floor] = [f for f in monitor.findings if f.code == "TFD236"]
    assert floor.severity == "error" and floor.step == EARLY and floor.evidence["floor"] == evidence["floor"]
    # the logits' own cross-entropy is logged beside the loss
    assert trainer.callback_metrics["loss_at_init/logits_loss"].item() == pytest.approx(evidence["logits_loss"][-1])


@pytest.mark.parametrize(
    "family",
    [
        pytest.param("tinygpt", id="tinygpt"),
        pytest.param("encoder_lm", id="encoder_lm"),
        pytest.param("llama", id="llama", marks=pytest.mark.slow),
    ],
)
def test_a_temperature_in_the_step_is_named_with_its_value(tmp_path, family):
    model, datamodule = build(family, "temperature")
    monitor, _ = fit(tmp_path, model, datamodule)
    [finding] = transform_findings(monitor)
    assert finding.code == "TFD234" and finding.severity == "info"
    assert finding.evidence["temperature"] == pytest.approx(2.0, rel=0.03)
    assert "T = 2" in finding.message


@pytest.mark.parametrize(
    "family, how",
    [
        pytest.param(family, how, id=f"{family}-{how}")
        for family in ("tinygpt", "encoder_lm")
        for how in ("plain", "label_smoothing", "z_loss", "aux_loss", "sum_over_positions")
    ]
    + [
        pytest.param("llama", "label_smoothing", id="llama-label_smoothing", marks=pytest.mark.slow),
        pytest.param("gpt2", "plain", id="gpt2-own-loss", marks=pytest.mark.slow),
    ],
)
def test_healthy_differences_between_the_loss_and_the_logits_stay_silent(tmp_path, family, how):
    if family == "gpt2":  # the common path: the model computes its own loss from the labels
        model, datamodule = HFLM("gpt2"), data("gpt2")
    else:
        model, datamodule = build(family, how)
    monitor, _ = fit(tmp_path, model, datamodule)
    if how == "label_smoothing":  # named, at info, with its eps
        [named] = monitor.findings
        assert named.code == "TFD237" and named.severity == "info" and "eps = 0.1" in named.message
    else:
        assert monitor.findings == []
    assert [step for step, _ in compared(tmp_path)] == [10, 20, 30, 40, 50, 80, 100]


def test_manual_accumulation_that_divides_the_loss_stays_silent(tmp_path):
    monitor, _ = fit(tmp_path, ManualAccumulationGPT(), data("tinygpt"), max_steps=CHECK + 1)
    assert monitor.findings == []  # nor TFD223 at step 0: Lightning does not divide a manual loss
    losses = dict(read_scalars(tmp_path / "tb" / "version_0")["loss_at_init/loss"])
    ratios = [losses[step] / logits_loss for step, logits_loss in compared(tmp_path)]
    assert len(ratios) == 7 and all(q == pytest.approx(0.25, rel=1e-3) for q in ratios)


def test_one_step_of_disagreement_is_not_persistent(tmp_path):
    """A check at step 10 has no compared step before it (the first early one is step 10): one step, nothing claimed."""
    model, datamodule = build("tinygpt", "sigmoid")
    torch.manual_seed(0)
    monitor = LossAtInit(check_step=10, every_n_steps=40)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fit_tiny(tmp_path, [monitor], model, datamodule, max_steps=11)
    assert [step for step, _ in compared(tmp_path)] == [10]
    assert transform_findings(monitor) == []


def test_compared_readings_survive_a_resume(tmp_path):
    model, datamodule = build("tinygpt", "temperature")
    _, trainer = fit(tmp_path / "a", model, datamodule, max_steps=21)
    assert [step for step, _ in compared(tmp_path / "a")] == [10, 20]
    path = tmp_path / "mid.ckpt"
    trainer.save_checkpoint(path)
    model, datamodule = build("tinygpt", "temperature")
    torch.manual_seed(0)
    resumed = LossAtInit(check_step=CHECK, every_n_steps=10)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fit_tiny(tmp_path / "b", [resumed], model, datamodule, max_steps=EARLY + 1, ckpt_path=str(path))
    [finding] = transform_findings(resumed)
    assert finding.code == "TFD234" and finding.evidence["steps"] == [10, 20, 30]  # 10 and 20 from the checkpoint


@pytest.mark.ddp
def test_ddp_every_rank_compares_on_the_same_steps_and_reaches_the_same_finding(tmp_path):
    spec = {
        "strategy": "ddp",
        "model_class": "tests.callbacks.loss_at_init.test_callback_transforms:SigmoidStepGPT",
        "model": {**SMALL, "lr": 2e-3},
        "data": {"batch_size": 4},
        "trainer": {"max_steps": 31},
        "callbacks": [
            {"class_path": "lightning_tfdebug.LossAtInit", "init_args": {"check_step": 60, "every_n_steps": 10}}
        ],
    }
    results = run_distributed(tmp_path, spec)
    evidence = []
    for r in results:
        assert r["error"] is None, r["error"]
        [finding] = [f for f in r["findings"]["LossAtInit"] if f["code"] in ("TFD233", "TFD234", "TFD235")]
        assert finding["code"] == "TFD233" and finding["evidence"]["steps"] == [10, 20, 30]
        evidence.append(finding["evidence"])
    assert evidence[0]["returned_loss"] == evidence[1]["returned_loss"]  # reduced over ranks: the same numbers
    assert evidence[0]["logits_loss"] == evidence[1]["logits_loss"]
