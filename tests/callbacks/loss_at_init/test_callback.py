import math
import warnings

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_tfdebug import LossAtInit, TFDebugError, TFDebugWarning
from lightning_tfdebug.demo import TinyGPT, TinyTextDataModule
from tests.callbacks.torch_calls import TorchCalls
from tests.helpers import (
    SMALL,
    BatchEncodingGPT,
    DataclassBatchGPT,
    make_trainer,
    read_csv_metrics,
    read_scalars,
    run_distributed,
)
from tests.helpers import fit_tiny as fit

LN_V = math.log(259)


def codes(callback):
    return [f.code for f in callback.findings]


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"labels_key": 1.5}, "labels_key"),
        ({"labels_key": -1}, "labels_key"),
        ({"input_key": [0]}, "input_key"),
        ({"logits_module": 3}, "logits_module"),
        ({"shift_labels": "yes"}, "shift_labels"),
        ({"label_smoothing": 1.5}, "label_smoothing"),
        ({"vocab_size": 1}, "vocab_size"),
        ({"init_tolerance": 0}, "init_tolerance"),
        ({"check_step": 0}, "check_step"),
        ({"stall_tolerance": 0}, "stall_tolerance"),
        ({"copy_threshold": 2}, "copy_threshold"),
        ({"max_rows": 0}, "max_rows"),
        ({"every_n_steps": 0}, "every_n_steps"),
        ({"on_finding": "explode"}, "on_finding"),
    ],
)
def test_bad_arguments_fail_at_construction(kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        LossAtInit(**kwargs)


def test_healthy_run_logs_the_initial_loss_and_raises_nothing(tmp_path):
    monitor = LossAtInit(check_step=20)
    fit(tmp_path, [monitor], max_steps=21)
    assert codes(monitor) == []
    scalars = read_scalars(tmp_path / "tb" / "version_0")
    observed = dict(scalars["loss_at_init/observed"])
    assert list(observed) == [0]
    assert scalars["loss_at_init/expected"] == [(0, pytest.approx(LN_V))]
    assert observed[0] == pytest.approx(LN_V, rel=0.02)
    # the training step's own loss at step 0 (TinyGPT logs it) is what LossAtInit reports as observed
    assert observed[0] == pytest.approx(dict(scalars["train/loss"])[0], rel=1e-5)
    # TinyGPT shifts labels like the default alignment assumes, so the recomputed loss agrees
    assert dict(scalars["loss_at_init/recomputed"])[0] == pytest.approx(observed[0], rel=1e-4)
    assert 0 < dict(scalars["loss_at_init/logit_std"])[0] < 1
    assert dict(scalars["loss_at_init/check_loss"])[20] < 0.95 * LN_V
    assert dict(scalars["loss_at_init/copy_rate"])[20] < 0.5
    rows = [r for r in read_csv_metrics(tmp_path / "csv" / "version_0") if r.get("loss_at_init/observed")]
    assert [int(r["step"]) for r in rows] == [0]


def test_gradient_accumulation_reports_the_undivided_loss(tmp_path):
    monitor = LossAtInit(check_step=None)
    trainer = fit(tmp_path, [monitor], max_steps=1, accumulate_grad_batches=4)
    observed = trainer.callback_metrics["loss_at_init/observed"].item()
    assert observed == pytest.approx(trainer.callback_metrics["loss_at_init/recomputed"].item(), rel=1e-4)


def test_softmax_before_cross_entropy_is_an_error_and_the_loss_stalls(tmp_path):
    """Bug 1 (seed 002): forward returns probabilities, cross_entropy applies softmax again."""
    monitor = LossAtInit(check_step=20)
    trainer = fit(tmp_path, [monitor], model=TinyGPT(softmax_output=True, **SMALL), max_steps=21)
    assert codes(monitor) == ["TFD220", "TFD225"]
    probs, stalled = monitor.findings
    assert probs.severity == "error" and probs.step == 0 and probs.evidence["probability_rows"] == 1.0
    assert probs.evidence["logit_std"] < 0.01
    assert stalled.step == 20 and abs(stalled.evidence["loss"] - LN_V) < 0.05 * LN_V
    assert "double softmax" in stalled.hint
    assert trainer.callback_metrics["loss_at_init/observed"].item() == pytest.approx(LN_V, rel=0.01)


def test_unshifted_labels_make_the_model_copy_its_input(tmp_path):
    """Bug 9: labels not shifted and the model does not shift them: position t learns token t."""
    monitor = LossAtInit(check_step=25)
    trainer = fit(tmp_path, [monitor], model=TinyGPT(unshifted_labels=True, **SMALL), max_steps=26)
    [finding] = monitor.findings
    assert finding.code == "TFD226" and finding.step == 25
    assert finding.evidence["copy_rate"] > 0.5 > finding.evidence["repeat_rate"]
    assert trainer.callback_metrics["loss_at_init/copy_rate"].item() == pytest.approx(finding.evidence["copy_rate"])


def test_all_labels_ignored_is_no_supervised_tokens(tmp_path):
    """Bug 2 (loss side): every label is ignore_index, so the mean loss is NaN."""
    monitor = LossAtInit(check_step=None)
    trainer = fit(tmp_path, [monitor], data=TinyTextDataModule(batch_size=8, all_labels_ignored=True), max_steps=2)
    [finding] = monitor.findings
    assert finding.code == "TFD224" and finding.severity == "error" and finding.step == 0
    assert math.isnan(finding.evidence["observed_loss"])
    assert trainer.callback_metrics["loss_at_init/supervised_frac"].item() == 0.0


class LoudHeadGPT(TinyGPT):
    """An output layer initialised far too large: confident wrong predictions at init."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        torch.nn.init.normal_(self.head.weight, std=3.0)


class NLLOnLogitsGPT(TinyGPT):
    """NLLLoss fed raw logits (no log_softmax): not a cross-entropy, far below ln(V) at init (O16)."""

    def loss(self, logits, labels):
        return F.nll_loss(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100)


class LogSoftmaxGPT(TinyGPT):
    def forward(self, input_ids, attention_mask=None):
        return super().forward(input_ids, attention_mask).log_softmax(-1)


def test_initial_loss_far_from_ln_v_and_log_probabilities(tmp_path):
    loud = LossAtInit(check_step=None)
    fit(tmp_path / "loud", [loud], model=LoudHeadGPT(**SMALL), max_steps=1)
    [above] = loud.findings
    assert above.code == "TFD222" and above.evidence["observed_loss"] > 1.25 * LN_V
    assert above.evidence["logit_std"] > 5
    nll = LossAtInit(check_step=None)
    fit(tmp_path / "nll", [nll], model=NLLOnLogitsGPT(**SMALL), max_steps=1)
    [below] = nll.findings
    assert below.code == "TFD223" and below.evidence["observed_loss"] < 0.75 * LN_V and "NLLLoss" in below.hint
    logp = LossAtInit(check_step=None)
    fit(tmp_path / "logp", [logp], model=LogSoftmaxGPT(**SMALL), max_steps=1)
    assert codes(logp) == ["TFD221"] and logp.findings[0].severity == "info"  # right with cross_entropy


class SummedLossGPT(TinyGPT):
    """``reduction="sum"``: the loss (and the gradients) grow with the number of supervised tokens."""

    def loss(self, logits, labels):
        targets = labels[:, 1:].flatten().long()
        return F.cross_entropy(logits[:, :-1].flatten(0, 1), targets, ignore_index=-100, reduction="sum")


class DividedByAccumulationGPT(TinyGPT):
    """Divides by the accumulation count although Lightning already does."""

    def loss(self, logits, labels):
        return super().loss(logits, labels) / self.trainer.accumulate_grad_batches


def test_a_summed_or_twice_divided_loss_is_a_scaled_loss_not_large_logits(tmp_path):
    summed = LossAtInit(check_step=None)
    fit(tmp_path / "sum", [summed], model=SummedLossGPT(**SMALL), max_steps=1)
    [finding] = summed.findings
    assert finding.code == "TFD229" and finding.severity == "warning"
    assert finding.evidence["matched_count"] == "supervised tokens per batch"
    supervised = finding.evidence["factor"]
    assert 0.85 * 8 * 63 < supervised < 1.15 * 8 * 63  # 8 rows of 64 tokens, shifted: at most 63 labels a row
    assert "reduction='mean'" in finding.hint and finding.evidence["recomputed_loss"] < 1.25 * LN_V
    divided = LossAtInit(check_step=None)
    fit(tmp_path / "div", [divided], model=DividedByAccumulationGPT(**SMALL), max_steps=1, accumulate_grad_batches=4)
    [finding] = divided.findings
    assert finding.code == "TFD229" and finding.evidence["matched_count"] == "accumulate_grad_batches"
    assert finding.evidence["factor"] == pytest.approx(0.25, rel=0.15)
    # the same division without accumulation is a factor of one: silent
    alone = LossAtInit(check_step=None)
    fit(tmp_path / "one", [alone], model=DividedByAccumulationGPT(**SMALL), max_steps=1)
    assert alone.findings == []


class NaiveLogSoftmaxGPT(TinyGPT):
    """``log(softmax(logits))`` in two steps instead of ``log_softmax``: a probability that underflows to 0 gives
    log(0) = -inf."""

    def loss(self, logits, labels):
        logp = logits.softmax(-1).log()
        return F.nll_loss(logp[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100)


@pytest.mark.parametrize(
    "model_class, bug, non_finite",
    [
        (TinyGPT, {"nan_on_rank": 0}, math.isnan),  # bug 23 from step 0: the loss itself becomes NaN
        (NaiveLogSoftmaxGPT, {"overflow_module": "head"}, math.isinf),  # logits x 1e5: softmax underflows, log(0)
    ],
    ids=["nan", "inf"],
)
def test_non_finite_initial_loss_with_supervised_labels(tmp_path, model_class, bug, non_finite):
    monitor = LossAtInit(check_step=None)
    trainer = fit(tmp_path / "bug", [monitor], model=model_class(**SMALL, **bug), max_steps=1)
    [finding] = monitor.findings
    assert (finding.code, finding.severity, finding.step) == ("TFD227", "error", 0)
    assert non_finite(finding.evidence["observed_loss"])
    assert f"is {finding.evidence['observed_loss']}, before any update" in finding.message
    # the labels are supervised (not TFD224) and the cross-entropy of the captured logits is finite: the loss
    # computation is at fault, and the hint points to NaNFirstFrame
    assert trainer.callback_metrics["loss_at_init/supervised_frac"].item() > 0.9
    assert math.isfinite(finding.evidence["recomputed_loss"])
    assert "NaNFirstFrame" in finding.hint
    healthy = LossAtInit(check_step=None)  # the same model without the bug
    fit(tmp_path / "healthy", [healthy], model=model_class(**SMALL), max_steps=1)
    assert codes(healthy) == []


class TupleBatchGPT(TinyGPT):
    """Batches as ``(input_ids, labels)`` tuples."""

    def on_after_batch_transfer(self, batch, dataloader_idx):
        return (batch["input_ids"], batch["labels"])

    def training_step(self, batch, batch_idx):
        input_ids, labels = batch
        return self.loss(self(input_ids), labels)


def test_tuple_batches_and_a_clear_message_when_labels_are_not_found(tmp_path):
    lost = LossAtInit(check_step=None, labels_key="targets")
    # TFD228 is info: recorded and listed at the end of fit, not warned as the run goes
    make_trainer(tmp_path / "a", [lost], max_steps=2).fit(TupleBatchGPT(**SMALL), TinyTextDataModule(batch_size=8))
    [finding] = lost.findings
    assert finding.code == "TFD228" and "tuple of 2 items" in finding.message and not lost.active
    assert "set `labels_key`" in finding.message
    found = LossAtInit(check_step=None, labels_key=1, input_key=0)
    trainer = fit(tmp_path / "b", [found], model=TupleBatchGPT(**SMALL), max_steps=1)
    assert codes(found) == []
    assert trainer.callback_metrics["loss_at_init/observed"].item() == pytest.approx(LN_V, rel=0.02)
    # left at their defaults, the keys find `(input_ids, labels)` tuples too: the copy check runs on them
    default = LossAtInit(check_step=2, stall_tolerance=1e-4)  # two steps are too few to leave ln(V)
    trainer = fit(tmp_path / "c", [default], model=TupleBatchGPT(unshifted_labels=True, **SMALL), max_steps=3)
    assert codes(default) == [] and default.active
    assert "loss_at_init/copy_rate" in trainer.callback_metrics


class Classifier(pl.LightningModule):
    """Not a language model: ``(batch, classes)`` logits, labels under ``"label"``, no time dimension."""

    def __init__(self, softmax_output=False):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10))
        torch.nn.init.normal_(self.net[2].weight, std=0.01)
        self.softmax_output = softmax_output

    def forward(self, features):
        out = self.net(features)
        return out.softmax(-1) if self.softmax_output else out

    def training_step(self, batch, batch_idx):
        return F.cross_entropy(self(batch["features"]), batch["label"])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        gen = torch.Generator().manual_seed(0)
        rows = [{"features": torch.randn(16, generator=gen), "label": torch.tensor(i % 10)} for i in range(64)]
        return torch.utils.data.DataLoader(rows, batch_size=16)


def test_a_classifier_works_with_the_defaults(tmp_path):
    healthy = LossAtInit(check_step=None)
    trainer = make_trainer(tmp_path / "a", [healthy], max_steps=1)
    trainer.fit(Classifier())
    assert codes(healthy) == [] and healthy.active
    assert trainer.callback_metrics["loss_at_init/expected"].item() == pytest.approx(math.log(10))
    assert trainer.callback_metrics["loss_at_init/observed"].item() == pytest.approx(math.log(10), rel=0.05)
    assert trainer.callback_metrics["loss_at_init/supervised_frac"].item() == 1.0  # no shift without a time axis
    softmax = LossAtInit(check_step=None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", TFDebugWarning)
        make_trainer(tmp_path / "b", [softmax], max_steps=1).fit(Classifier(softmax_output=True))
    assert codes(softmax) == ["TFD220"]


def test_named_logits_module(tmp_path):
    # the head's output is the raw logits even when forward applies softmax: a way to look past a wrapper
    head = LossAtInit(check_step=None, logits_module="head")
    fit(tmp_path / "a", [head], model=TinyGPT(softmax_output=True, **SMALL), max_steps=1)
    assert "TFD220" not in codes(head)
    missing = LossAtInit(check_step=None, logits_module="decoder.lm_head")
    make_trainer(tmp_path / "b", [missing], max_steps=1).fit(TinyGPT(**SMALL), TinyTextDataModule(batch_size=8))
    assert codes(missing) == ["TFD228"] and not missing.active
    assert "is not a submodule" in missing.findings[0].message  # TFD228 is info: recorded, listed at the end


class HFCausalLM(pl.LightningModule):
    """A Hugging Face model inside a LightningModule, the common way: the module's own forward is never called."""

    def __init__(self):
        super().__init__()
        from transformers import GPT2Config, GPT2LMHeadModel

        config = GPT2Config(vocab_size=259, n_positions=64, n_embd=32, n_layer=2, n_head=2)
        self.model = GPT2LMHeadModel(config)

    def training_step(self, batch, batch_idx):
        return self.model(**batch).loss  # shifts the labels internally

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def test_hugging_face_model_without_configuration(tmp_path):
    monitor = LossAtInit(check_step=None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = fit(tmp_path, [monitor], model=HFCausalLM(), max_steps=1)
    assert codes(monitor) == []
    observed = trainer.callback_metrics["loss_at_init/observed"].item()
    assert observed == pytest.approx(LN_V, rel=0.05)
    assert trainer.callback_metrics["loss_at_init/recomputed"].item() == pytest.approx(observed, rel=1e-4)


class MultiLabel(Classifier):
    """Multi-label targets (float, one column per class) under BCE: not a V-way cross-entropy."""

    def training_step(self, batch, batch_idx):
        return F.binary_cross_entropy_with_logits(self(batch["features"]), batch["label"])

    def train_dataloader(self):
        gen = torch.Generator().manual_seed(0)
        rows = [
            {"features": torch.randn(16, generator=gen), "label": (torch.rand(10, generator=gen) > 0.5).float()}
            for _ in range(32)
        ]
        return torch.utils.data.DataLoader(rows, batch_size=16)


def test_float_targets_are_said_to_be_out_of_scope(tmp_path):
    monitor = LossAtInit(check_step=None)
    make_trainer(tmp_path, [monitor], max_steps=1).fit(MultiLabel())
    assert codes(monitor) == ["TFD228"] and not monitor.active  # no false TFD223 from BCE's ~0.69 against ln(10)
    assert "not class indices" in monitor.findings[0].message  # TFD228 is info: recorded, listed at the end


class WrapperModule(pl.LightningModule):
    """The common pattern: the network is a child and ``training_step`` calls ``self.net(x)``, never ``self(x)``."""

    def __init__(self, **kwargs):
        super().__init__()
        self.net = TinyGPT(**kwargs)

    def training_step(self, batch, batch_idx):
        return self.net.loss(self.net(batch["input_ids"]), batch["labels"])

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class TiedHeadSteps(TinyGPT):
    """``training_step`` runs the children itself and the head is tied to the embedding (``F.linear``): no child
    returns the logits, only hidden states of the same rank."""

    def training_step(self, batch, batch_idx):
        ids = batch["input_ids"]
        x = self.tok_emb(ids) + self.pos_emb(torch.arange(ids.shape[1]))
        for block in self.blocks:
            x = block(x)
        return self.loss(F.linear(self.ln_f(x), self.tok_emb.weight), batch["labels"])


def test_logits_of_a_child_network_are_found_without_configuration(tmp_path):
    monitor = LossAtInit(check_step=None)
    trainer = fit(tmp_path / "a", [monitor], model=WrapperModule(softmax_output=True, **SMALL), max_steps=1)
    assert codes(monitor) == ["TFD220"]
    assert trainer.callback_metrics["loss_at_init/expected"].item() == pytest.approx(LN_V)
    healthy = LossAtInit(check_step=None)
    trainer = fit(tmp_path / "b", [healthy], model=WrapperModule(**SMALL), max_steps=1)
    assert codes(healthy) == []
    observed = trainer.callback_metrics["loss_at_init/observed"].item()
    assert trainer.callback_metrics["loss_at_init/recomputed"].item() == pytest.approx(observed, rel=1e-4)
    # hidden states (batch, time, d_model) are not taken for logits: labels reach 258 > d_model
    tied = LossAtInit(check_step=None)
    make_trainer(tmp_path / "c", [tied], max_steps=1).fit(TiedHeadSteps(**SMALL), TinyTextDataModule(batch_size=8))
    assert codes(tied) == ["TFD228"] and not tied.active
    assert "set `logits_module`" in tied.findings[0].message  # TFD228 is info: recorded, listed at the end
    assert "tok_emb" in tied.findings[0].message  # the direct children are listed


class ProbeForward(pl.Callback):
    """Another callback that runs the model on a slice of the batch from its own hook (as MaskProbe does)."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        with torch.no_grad():
            pl_module(batch["input_ids"][:2])


def test_forwards_of_other_callbacks_are_not_taken_for_the_training_logits(tmp_path):
    monitor = LossAtInit(check_step=None)
    trainer = fit(tmp_path, [monitor, ProbeForward()], max_steps=1)
    assert codes(monitor) == [] and monitor.active
    observed = trainer.callback_metrics["loss_at_init/observed"].item()
    assert trainer.callback_metrics["loss_at_init/recomputed"].item() == pytest.approx(observed, rel=1e-4)


def test_hooks_and_captured_logits_are_gone_before_backward(tmp_path):
    monitor = LossAtInit(check_step=2)
    seen = []

    class Probe(pl.Callback):  # runs after LossAtInit in the same hook
        def on_before_backward(self, trainer, pl_module, loss):
            hooks = sum(len(m._forward_hooks) for m in pl_module.modules())
            seen.append((trainer.global_step, hooks, monitor._capture.held))

    trainer = fit(tmp_path, [monitor, Probe()], model=WrapperModule(**SMALL), max_steps=3)
    assert seen == [(0, 0, 0), (1, 0, 0), (2, 0, 0)]
    # what the measured steps needed was kept as a few scalars, and both steps were still measured
    assert {"loss_at_init/observed", "loss_at_init/check_loss"} <= set(trainer.callback_metrics)


def test_on_finding_raise_stops_the_run(tmp_path):
    monitor = LossAtInit(check_step=None, on_finding="raise")
    trainer = make_trainer(tmp_path, [monitor], max_steps=3)
    with pytest.raises(TFDebugError, match="TFD220"):
        trainer.fit(TinyGPT(softmax_output=True, **SMALL), TinyTextDataModule(batch_size=8))
    assert all(len(m._forward_hooks) == 0 for m in trainer.lightning_module.modules())


def test_state_is_saved_and_restored_on_resume(tmp_path):
    first = LossAtInit(check_step=3)
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True)
    fit(tmp_path, [first, ckpt], max_steps=2, enable_checkpointing=True)
    assert first.state_dict()["init_done"] and not first.state_dict()["check_done"]
    resumed = LossAtInit(check_step=3)
    trainer = make_trainer(tmp_path / "resumed", [resumed], max_steps=4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(TinyGPT(**SMALL), TinyTextDataModule(batch_size=8), ckpt_path=str(tmp_path / "ckpt" / "last.ckpt"))
    assert resumed._run.init_done and resumed._run.check_done
    assert "loss_at_init/observed" not in trainer.callback_metrics  # step 0 is not measured again
    assert "loss_at_init/check_loss" in trainer.callback_metrics


def test_built_from_lightning_cli_yaml(tmp_path):
    from lightning.pytorch.cli import LightningCLI

    config = tmp_path / "config.yaml"
    config.write_text(
        """
trainer:
  callbacks:
    - class_path: lightning_tfdebug.LossAtInit
      init_args:
        labels_key: 1
        input_key: null
        logits_module: model.lm_head
        shift_labels: false
        label_smoothing: 0.1
        check_step: 300
        on_finding: stop
"""
    )
    cli = LightningCLI(TinyGPT, TinyTextDataModule, run=False, args=["--config", str(config)])
    [monitor] = [c for c in cli.trainer.callbacks if isinstance(c, LossAtInit)]
    assert (monitor.labels_key, monitor.input_key, monitor.logits_module) == (1, None, "model.lm_head")
    assert (monitor.shift_labels, monitor.label_smoothing, monitor.check_step, monitor.on_finding) == (
        False,
        0.1,
        300,
        "stop",
    )


@pytest.mark.ddp
def test_ddp_double_softmax_is_found_on_every_rank_with_reduced_values(tmp_path):
    spec = {
        "strategy": "ddp",
        "model": {**SMALL, "softmax_output": True},
        "data": {"batch_size": 4},
        "trainer": {"max_steps": 4},
        "callbacks": [{"class_path": "lightning_tfdebug.LossAtInit", "init_args": {"check_step": 3}}],
    }
    results = run_distributed(tmp_path, spec)
    for r in results:
        assert r["error"] is None, r["error"]
        assert [(f["code"], f["step"]) for f in r["findings"]["LossAtInit"]] == [("TFD220", 0), ("TFD225", 3)]
        assert r["metrics"]["loss_at_init/observed"] == pytest.approx(LN_V, rel=0.01)
    ours = [{k: v for k, v in r["metrics"].items() if k.startswith("loss_at_init/")} for r in results]
    assert ours[0] == ours[1]  # averaged over ranks (the label counts summed in the same collective): the same
    assert {"loss_at_init/check_loss", "loss_at_init/loss", "loss_at_init/unigram_entropy"} <= set(ours[0])


@pytest.mark.ddp
def test_ddp_a_summed_loss_is_matched_to_each_rank_s_own_token_count(tmp_path):
    spec = {
        "strategy": "ddp",
        "model_class": "tests.callbacks.loss_at_init.test_callback:SummedLossGPT",
        "model": SMALL,
        "data": {"batch_size": 4},
        "trainer": {"max_steps": 1},
        "callbacks": [{"class_path": "lightning_tfdebug.LossAtInit", "init_args": {"check_step": None}}],
    }
    results = run_distributed(tmp_path, spec)
    for r in results:
        assert r["error"] is None, r["error"]
        [finding] = r["findings"]["LossAtInit"]
        # per rank: 4 rows of up to 63 shifted labels, not the 8 rows both ranks hold together
        assert finding["code"] == "TFD229" and finding["evidence"]["matched_count"] == "supervised tokens per batch"
        assert 0.85 * 4 * 63 < finding["evidence"]["factor"] < 1.15 * 4 * 63
    assert results[0]["findings"]["LossAtInit"][0]["evidence"] == results[1]["findings"]["LossAtInit"][0]["evidence"]


class FloatLabelsOnRank1(pl.Callback):
    """Rank 1's labels become float (TinyGPT's loss casts them back), so only rank 1 cannot use them."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_rank == 1:
            batch["labels"] = batch["labels"].float()


@pytest.mark.ddp
@pytest.mark.slow  # ~20 s; standing aside together is the fault matrix's default case
def test_ddp_a_rank_that_cannot_read_its_labels_makes_every_rank_stand_aside_together(tmp_path):
    spec = {
        "strategy": "ddp",
        "model": SMALL,
        "data": {"batch_size": 4},
        "trainer": {"max_steps": 3},
        "callbacks": [
            {"class_path": "tests.callbacks.loss_at_init.test_callback.FloatLabelsOnRank1"},
            {"class_path": "lightning_tfdebug.LossAtInit", "init_args": {"check_step": 2, "on_finding": "raise"}},
        ],
    }
    results = run_distributed(tmp_path, spec)
    for r in results:
        assert r["error"] is None, r["error"]  # nobody hangs in the collective, nobody raises on an info finding
        assert r["global_step"] == 3
        [finding] = r["findings"]["LossAtInit"]
        assert (finding["code"], finding["step"]) == ("TFD228", 0)
        assert not any(k.startswith("loss_at_init/") for k in r["metrics"])  # stood aside: step 2 not checked
    assert "another rank" in results[0]["findings"]["LossAtInit"][0]["message"]
    assert "not class indices" in results[1]["findings"]["LossAtInit"][0]["message"]


# ------------------------------------------------------------------ batch types (the shared reading of core.batch)
@pytest.mark.parametrize("model_class", [DataclassBatchGPT, BatchEncodingGPT])
def test_dataclass_and_batch_encoding_batches_are_read(tmp_path, model_class):
    pytest.importorskip("transformers")
    healthy = LossAtInit(check_step=None)
    trainer = fit(tmp_path / "healthy", [healthy], model=model_class(**SMALL), max_steps=1)
    assert codes(healthy) == [] and healthy.active
    assert trainer.callback_metrics["loss_at_init/observed"].item() == pytest.approx(LN_V, rel=0.02)
    assert "loss_at_init/copy_rate" in trainer.callback_metrics  # the input ids were found for the copy check
    softmax = LossAtInit(check_step=None)
    fit(tmp_path / "softmax", [softmax], model=model_class(softmax_output=True, **SMALL), max_steps=1)
    assert codes(softmax) == ["TFD220"]


def test_keys_point_at_fields_with_other_names(tmp_path):
    """``labels_key`` and ``input_key`` as dotted paths into a nested batch with unusual names; a key that names
    nothing gets TFD228 with the batch's keys."""

    class NestedGPT(TinyGPT):
        def on_after_batch_transfer(self, batch, dataloader_idx):
            return {"text": {"codes": batch["input_ids"]}, "gold": batch["labels"]}

        def training_step(self, batch, batch_idx):
            return self.loss(self(batch["text"]["codes"]), batch["gold"])

    found = LossAtInit(check_step=None, labels_key="gold", input_key="text.codes")
    trainer = fit(tmp_path / "a", [found], model=NestedGPT(**SMALL), max_steps=1)
    assert codes(found) == [] and "loss_at_init/copy_rate" in trainer.callback_metrics
    lost = LossAtInit(check_step=None, labels_key="answers")
    fit(tmp_path / "b", [lost], model=NestedGPT(**SMALL), max_steps=1)
    [finding] = lost.findings
    assert finding.code == "TFD228" and "['gold', 'text']" in finding.message and not lost.active


class HookSpy(pl.Callback):
    """Records, at every batch start (after LossAtInit armed or not), whether any module holds a forward hook."""

    def __init__(self):
        self.hooked = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.hooked.append(any(m._forward_hooks for m in pl_module.modules()))


def test_steps_that_do_not_measure_cost_nothing(tmp_path):
    """Only step 0, ``check_step`` and the measuring steps run tensor ops, and forward hooks exist only during the
    first two."""
    calls, spy = TorchCalls(), HookSpy()
    fit(tmp_path, [*calls.around(LossAtInit(check_step=3, every_n_steps=5)), spy], max_steps=7)
    assert set(calls.counts) == {0, 3, 5}
    assert spy.hooked == [True, False, False, True, False, False, False]


class RowFeatures(pl.LightningModule):
    """Token rows without labels fed to a network whose outputs are features narrower than the token ids, not logits
    (a regression on embeddings): no call returns logits."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Embedding(259, 16), torch.nn.Linear(16, 16))

    def training_step(self, batch, batch_idx):
        return self.net(batch[:, :-1]).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def test_token_rows_whose_calls_return_no_logits_are_explained_by_the_shared_call_finder(tmp_path):
    from tests.wild_models import token_rows

    monitor = LossAtInit(check_step=None)
    fit(tmp_path, [monitor], model=RowFeatures(), data=token_rows(), max_steps=2)
    [finding] = monitor.findings
    assert finding.code == "TFD228" and not monitor.active
    assert (
        "no call made in `training_step` takes the batch's token ids and returns logits (modules called: Sequential); "
        "set `logits_module`" in finding.message
    )
    assert monitor._aside_setting == "`logits_module`"


@pytest.mark.parametrize("model_kind", [None, "encoder-decoder"])
def test_a_t5_decoder_fed_its_own_targets_is_not_read_as_pretrained(tmp_path, model_kind):
    pytest.importorskip("transformers")
    from tests.bug_models import BugSeq2SeqLM
    from tests.healthy_models import data

    torch.manual_seed(0)
    cb = LossAtInit(check_step=None, model_kind=model_kind)
    fit(tmp_path, [cb], model=BugSeq2SeqLM("t5"), data=data("t5"), max_steps=1)
    [low] = [f for f in cb.findings if f.code == "TFD223"]
    assert (low.severity, low.evidence["pretrained"]) == ("warning", False), low.format()
