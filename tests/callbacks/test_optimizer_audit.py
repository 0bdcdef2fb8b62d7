import warnings

import pytest
import torch

from lightning_tfdebug import OptimizerAudit, TFDebugWarning
from lightning_tfdebug.demo import TinyGPT, TinyTextDataModule
from tests.helpers import SMALL, fit_tiny, make_trainer, read_scalars, run_distributed


def fit(tmp_path, callbacks, model=None, data=None, **kwargs):
    kwargs.setdefault("max_steps", 4)
    return fit_tiny(tmp_path, callbacks, model, data, **kwargs)


def codes(callback, with_info=False):
    return sorted({f.code for f in callback.findings if with_info or f.severity != "info"})


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"zero_lr_fraction": 1.5}, "zero_lr_fraction"),
        ({"warmup_window": 0}, "warmup_window"),
        ({"patience": 0}, "patience"),
        ({"check_warmup": "no"}, "check_warmup"),
        ({"on_finding": "explode"}, "on_finding"),
    ],
)
def test_bad_arguments_fail_at_construction(kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        OptimizerAudit(**kwargs)


def test_healthy_run_raises_nothing_and_logs_the_effective_lr_per_group(tmp_path):
    audit = OptimizerAudit(every_n_steps=1)
    fit(tmp_path, [audit], model=TinyGPT(**SMALL, warmup_steps=4))
    assert codes(audit, with_info=True) == []
    scalars = read_scalars(tmp_path / "tb" / "version_0")
    lrs = [v for _, v in scalars["optimizer_audit/lr/group0"]]
    # LambdaLR warm-up (s+1)/4 of 1e-3, read from the optimizer as it will be applied at each step
    assert lrs == pytest.approx([2.5e-4, 5e-4, 7.5e-4, 1e-3])
    assert [v for _, v in scalars["optimizer_audit/lr/group1"]] == pytest.approx(lrs)


def test_bug_zoo_row_10_head_left_out_of_the_optimizer(tmp_path):
    audit = OptimizerAudit()
    fit(tmp_path, [audit], model=TinyGPT(**SMALL, head_not_in_optimizer=True))
    assert codes(audit) == ["TFD320"]
    [finding] = audit.findings
    assert finding.severity == "error" and "head.weight" in finding.message


@pytest.mark.parametrize(
    "flag, expected",
    [("decay_norms", ["TFD324", "TFD325"]), ("adam_l2", ["TFD324", "TFD325", "TFD326"])],
)
def test_bug_zoo_row_20_weight_decay_wiring(tmp_path, flag, expected):
    audit = OptimizerAudit()
    fit(tmp_path, [audit], model=TinyGPT(**SMALL, **{flag: True}))
    assert codes(audit, with_info=True) == expected
    one_d = next(f for f in audit.findings if f.code == "TFD324")
    assert "ln1.weight" in one_d.message or "bias" in one_d.message


def test_bug_zoo_row_21_eval_mode_at_each_epoch(tmp_path):
    audit = OptimizerAudit()
    fit(tmp_path, [audit], model=TinyGPT(**SMALL, eval_mode=True))
    assert codes(audit) == ["TFD327"]


class EvalInItsOwnHook(TinyGPT):
    def on_train_batch_start(self, batch, batch_idx):  # runs after the callbacks' on_train_batch_start
        self.eval()


class EvalInTrainingStep(TinyGPT):
    def training_step(self, batch, batch_idx):
        self.eval()  # e.g. an inference helper called from training_step that never calls .train() again
        return super().training_step(batch, batch_idx)


@pytest.mark.parametrize("model_class", [EvalInItsOwnHook, EvalInTrainingStep])
def test_eval_mode_set_after_the_callbacks_hooks_is_seen_at_the_first_step(tmp_path, model_class):
    audit = OptimizerAudit()
    fit(tmp_path, [audit], model=model_class(**SMALL))
    assert [(f.code, f.step) for f in audit.findings if f.severity != "info"] == [("TFD327", 0)]


class StaysInEvalAfterValidation(TinyGPT):
    def on_validation_model_train(self):  # overridden: the module is never put back into train mode
        pass


def test_eval_mode_after_validation(tmp_path):
    audit = OptimizerAudit()
    fit(
        tmp_path,
        [audit],
        model=StaysInEvalAfterValidation(**SMALL),
        limit_val_batches=1,
        val_check_interval=2,
        num_sanity_val_steps=0,
    )
    [finding] = audit.findings
    assert finding.code == "TFD327" and finding.step == 2


class EmbeddingDropoutGPT(TinyGPT):
    """TinyGPT with dropout on the token embeddings; ``frozen`` puts that block in eval mode at construction, as code
    that freezes a pretrained embedding with ``.eval()`` does (Lightning keeps submodule modes at fit start)."""

    def __init__(self, p=0.1, frozen=False, **kwargs):
        super().__init__(**kwargs)
        self.tok_emb = torch.nn.Sequential(self.tok_emb, torch.nn.Dropout(p))
        if frozen:
            self.tok_emb.eval()


@pytest.mark.filterwarnings("ignore:Found .* module\\(s\\) in eval mode")
def test_dropout_left_in_eval_mode_while_the_module_trains(tmp_path):
    audit = OptimizerAudit()
    fit(tmp_path / "frozen", [audit], model=EmbeddingDropoutGPT(frozen=True, **SMALL))
    assert codes(audit) == []  # information, not a problem
    [finding] = audit.findings  # once per epoch start, not at every step
    assert (finding.code, finding.severity, finding.step) == ("TFD328", "info", 0)
    assert finding.evidence == {"count": 1} and finding.message.endswith("while the module trains: tok_emb.1.")
    # silent: the same dropout in train mode; a frozen dropout that drops nothing (p=0) next to a frozen LayerNorm
    # (no mode-dependent behaviour)
    silent = {"train": EmbeddingDropoutGPT(**SMALL), "p0": EmbeddingDropoutGPT(p=0.0, frozen=True, **SMALL)}
    silent["p0"].ln_f.eval()
    for name, model in silent.items():
        audit = OptimizerAudit()
        fit(tmp_path / name, [audit], model=model)
        assert codes(audit, with_info=True) == [], name


class FrozenStillInOptimizer(TinyGPT):
    def configure_optimizers(self):
        self.ln_f.weight.requires_grad_(False)
        return torch.optim.AdamW(self.parameters(), lr=1e-3, weight_decay=0.0)


class DuplicateParameter(TinyGPT):
    def configure_optimizers(self):
        config = super().configure_optimizers()
        config["optimizer"].param_groups[1]["params"].append(self.head.weight)  # also in group 0
        return config


class StaleCopies(TinyGPT):
    def configure_optimizers(self):
        copies = [p.detach().clone().requires_grad_() for p in self.parameters()]
        return torch.optim.AdamW(copies, lr=1e-3, weight_decay=0.0)


@pytest.mark.parametrize(
    "model_cls, expected",
    [
        (FrozenStillInOptimizer, ["TFD322", "TFD330"]),  # both info: AdamW skips the frozen weight, no spike
        (DuplicateParameter, ["TFD321"]),
        (StaleCopies, ["TFD320", "TFD323", "TFD330"]),
    ],
)
def test_wiring_findings(tmp_path, model_cls, expected):
    audit = OptimizerAudit()
    fit(tmp_path, [audit], model=model_cls(**SMALL))
    assert codes(audit, with_info=True) == expected
    assert all(f.severity != "warning" for f in audit.findings if f.code in {"TFD322", "TFD330"})


class SchedulerSteppedTwice(TinyGPT):
    def training_step(self, batch, batch_idx):
        self.lr_schedulers().step()  # by hand, and Lightning steps it again (interval: step)
        return super().training_step(batch, batch_idx)


class DecaysToZeroEarly(TinyGPT):
    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=1e-3, weight_decay=0.0)
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: max(0.0, 1 - s / 3))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


def test_scheduler_cadence_and_schedule_shape(tmp_path):
    audit = OptimizerAudit(every_n_steps=1)
    fit(tmp_path / "twice", [audit], model=SchedulerSteppedTwice(**SMALL))
    assert codes(audit) == ["TFD329"]
    audit = OptimizerAudit(every_n_steps=1)
    fit(tmp_path / "zero", [audit], model=DecaysToZeroEarly(**SMALL), max_steps=8)
    assert codes(audit, with_info=True) == ["TFD330", "TFD331"]
    assert next(f for f in audit.findings if f.code == "TFD331").step == 3
    audit = OptimizerAudit(every_n_steps=1)
    fit(tmp_path / "nowarmup", [audit], model=TinyGPT(**SMALL, warmup_steps=0))
    assert codes(audit, with_info=True) == ["TFD330"] and codes(audit) == []


class ManualSteps(TinyGPT):
    """Manual optimization: ``zero`` says how (or if) gradients are cleared; ``accumulate`` micro-batches a step."""

    def __init__(self, zero: str = "none", accumulate: int = 1, **kwargs):
        super().__init__(**kwargs)
        self.automatic_optimization = False
        self.zero, self.accumulate = zero, accumulate

    def training_step(self, batch, batch_idx):
        optimizer, schedule = self.optimizers(), self.lr_schedulers()
        loss = self.loss(self(batch["input_ids"], batch.get("attention_mask")), batch["labels"])
        self.manual_backward(loss / self.accumulate)
        if (batch_idx + 1) % self.accumulate == 0:
            optimizer.step()
            schedule.step()
            if self.zero != "none":
                optimizer.zero_grad(set_to_none=self.zero == "to_none")
        return loss


def test_gradients_never_zeroed_under_manual_optimization(tmp_path):
    audit = OptimizerAudit(every_n_steps=2)
    fit(tmp_path / "bug", [audit], model=ManualSteps(zero="none", **SMALL), max_steps=5)
    [finding] = [f for f in audit.findings if f.code == "TFD334"]
    assert finding.severity == "error" and finding.step == 2  # the first measured step after a step
    assert finding.evidence["groups_with_old_grads"] == 2 and "zero_grad" in finding.hint
    # zeroed to None, zeroed in place (the tensors stay, all zero), and zeroed once per accumulation window
    for name, model in {
        "none": ManualSteps(zero="to_none", **SMALL),
        "zeros": ManualSteps(zero="to_zeros", **SMALL),
        "accumulate": ManualSteps(zero="to_none", accumulate=3, **SMALL),
    }.items():
        audit = OptimizerAudit(every_n_steps=1)
        fit(tmp_path / name, [audit], model=model, max_steps=5)
        assert "TFD334" not in codes(audit), name
    # automatic optimization with accumulation: Lightning zeroes before the first backward of each window
    audit = OptimizerAudit(every_n_steps=1)
    fit(tmp_path / "auto", [audit], max_steps=5, accumulate_grad_batches=3)
    assert "TFD334" not in codes(audit)


def test_weight_decay_that_halves_the_weights_in_a_few_dozen_steps(tmp_path):
    audit = OptimizerAudit(every_n_steps=2)
    fit(tmp_path / "strong", [audit], model=TinyGPT(lr=3e-3, weight_decay=10.0, warmup_steps=5, **SMALL), max_steps=2)
    [finding] = [f for f in audit.findings if f.code == "TFD336"]
    # the peak LR the scheduler recorded, not the first warm-up step's 6e-4
    assert finding.evidence["lr"] == pytest.approx(3e-3) and finding.evidence["decay_per_step"] == pytest.approx(3e-2)
    assert finding.evidence["group"] == "group0"  # the no-decay group is not named
    audit = OptimizerAudit(every_n_steps=2)
    fit(tmp_path / "usual", [audit], model=TinyGPT(lr=3e-3, weight_decay=1.0, warmup_steps=5, **SMALL), max_steps=2)
    assert "TFD336" not in codes(audit)


class WarmupPerEpoch(TinyGPT):
    """A 100-step warm-up returned as a bare scheduler: Lightning steps it once per epoch."""

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=1e-3, weight_decay=0.0)
        return [optimizer], [torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 100))]


def test_a_step_sized_warmup_stepped_per_epoch_is_a_frozen_lr_not_a_missing_warmup(tmp_path):
    audit = OptimizerAudit(every_n_steps=2)
    fit(tmp_path / "epoch", [audit], model=WarmupPerEpoch(**SMALL), max_steps=5)
    assert codes(audit) == ["TFD335"]
    [finding] = audit.findings
    assert finding.step == 2 and finding.evidence["lr"] == pytest.approx(1e-5)
    assert finding.evidence["base_lr"] == pytest.approx(1e-3) and finding.evidence["interval"] == ["epoch"]
    assert "'interval': 'step'" in finding.hint
    # at its peak from the first step (no scheduler warm-up at all) it stays TFD330
    audit = OptimizerAudit(every_n_steps=2)
    fit(tmp_path / "flat", [audit], model=TinyGPT(**SMALL, warmup_steps=0), max_steps=5)
    assert codes(audit, with_info=True) == ["TFD330"]


class ConstantLR(TinyGPT):
    """Fine-tuning style: AdamW at a constant LR, no scheduler at all."""

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=3e-4, weight_decay=0.0)


def test_no_warmup_is_advice_until_the_early_loss_spikes(tmp_path):
    """TFD330 is info on a constant LR that trains well, a warning when the loss spikes in the first steps."""
    calm = OptimizerAudit(every_n_steps=1)
    fit(tmp_path / "constant", [calm], model=ConstantLR(**SMALL), max_steps=12)
    [advice] = calm.findings
    assert (advice.code, advice.severity) == ("TFD330", "info") and "Advice only" in advice.message
    assert calm._first_loss is not None and calm._lowest_loss < calm._first_loss  # the loss was watched
    hot = OptimizerAudit(every_n_steps=1)
    fit(tmp_path / "hot", [hot], model=TinyGPT(**SMALL, lr=1.0, warmup_steps=0, weight_decay=0.0), max_steps=6)
    [warned] = [f for f in hot.findings if f.code == "TFD330" and f.severity == "warning"]
    assert warned.evidence["loss"] > 1.1 * warned.evidence["first_loss"] and warned.evidence["first_lr"] == 1.0
    # the same run with a warm-up: no TFD330 at any severity
    warm = OptimizerAudit(every_n_steps=1)
    fit(tmp_path / "warm", [warm], model=TinyGPT(**SMALL, lr=1e-3, warmup_steps=4, weight_decay=0.0), max_steps=6)
    assert "TFD330" not in codes(warm, with_info=True)


def test_a_run_resumed_past_its_warmup_infers_no_schedule(tmp_path):
    """Resumed from a checkpoint past its warm-up by an audit without saved state: the first LR it sees is the
    peak, which says nothing about a warm-up."""
    trainer = fit(tmp_path / "first", [], model=TinyGPT(**SMALL, warmup_steps=3), max_steps=5)
    ckpt = tmp_path / "past_warmup.ckpt"
    trainer.save_checkpoint(ckpt)
    audit = OptimizerAudit(every_n_steps=1)
    fit(tmp_path / "resumed", [audit], model=TinyGPT(**SMALL, warmup_steps=3), max_steps=9, ckpt_path=str(ckpt))
    assert codes(audit, with_info=True) == [] and audit._first_lr is None and audit._warmup_decided


class FrozenWithDecayAll(FrozenStillInOptimizer):
    """A custom optimizer that applies weight decay to every parameter it holds, gradient or not."""

    def configure_optimizers(self):
        self.ln_f.weight.requires_grad_(False)
        return DecayAll(self.parameters(), lr=1e-3)


class DecayAll(torch.optim.Optimizer):
    def __init__(self, params, lr):
        super().__init__(params, {"lr": lr})

    def step(self, closure=None):
        with torch.enable_grad():
            loss = closure() if closure is not None else None
        with torch.no_grad():
            self._decay_then_step()
        return loss

    def _decay_then_step(self):
        for group in self.param_groups:
            for p in group["params"]:
                p.mul_(1 - group["lr"])  # decay without looking at .grad
                if p.grad is not None:
                    p.add_(p.grad, alpha=-group["lr"])


def test_frozen_parameters_in_the_optimizer_are_a_warning_only_once_one_moves(tmp_path):
    skipped = OptimizerAudit(every_n_steps=1)
    fit(tmp_path / "adamw", [skipped], model=FrozenStillInOptimizer(**SMALL))
    assert [f.severity for f in skipped.findings if f.code == "TFD322"] == ["info"]
    moved = OptimizerAudit(every_n_steps=1)
    fit(tmp_path / "decay_all", [moved], model=FrozenWithDecayAll(**SMALL))
    info, warning = [f for f in moved.findings if f.code == "TFD322"]
    assert (info.severity, warning.severity) == ("info", "warning") and warning.evidence["parameter"] == "ln_f.weight"


def test_updates_that_underflow_bf16_weights(tmp_path):
    audit = OptimizerAudit(every_n_steps=1)
    fit(tmp_path, [audit], model=TinyGPT(**SMALL, lr=1e-7, warmup_steps=0), precision="bf16-true")
    assert "TFD332" in codes(audit)
    # the same run in fp32 changes its weights
    audit = OptimizerAudit(every_n_steps=1)
    fit(tmp_path / "fp32", [audit], model=TinyGPT(**SMALL, lr=1e-7, warmup_steps=0))
    assert "TFD332" not in codes(audit)


def test_state_round_trips(tmp_path):
    audit = OptimizerAudit(every_n_steps=1)
    fit(tmp_path, [audit])
    restored = OptimizerAudit(every_n_steps=1)
    restored.load_state_dict(audit.state_dict())
    assert restored._first_lr == audit._first_lr == pytest.approx(1e-4)
    assert restored._peak_lr == pytest.approx(4e-4)
    assert restored._warmup_decided is True


def test_checkpoint_save_and_resume_carry_the_audit_state(tmp_path):
    audit = OptimizerAudit(every_n_steps=1)
    trainer = fit(tmp_path, [audit], model=TinyGPT(**SMALL, warmup_steps=8), max_steps=2)
    ckpt = tmp_path / "mid.ckpt"
    trainer.save_checkpoint(ckpt)  # the scheduler, the optimizer and the callback state must all pickle
    saved = torch.load(ckpt, map_location="cpu", weights_only=False)["callbacks"][audit.state_key]
    assert saved["first_lr"] == pytest.approx(1.25e-4)
    resumed = OptimizerAudit(every_n_steps=1)
    trainer = make_trainer(tmp_path / "resumed", [resumed], max_steps=4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", TFDebugWarning)
        trainer.fit(TinyGPT(**SMALL, warmup_steps=8), TinyTextDataModule(batch_size=8), ckpt_path=ckpt)
    assert resumed._first_lr == pytest.approx(1.25e-4)  # from the checkpoint, not the resumed run's first step
    assert resumed._warmup_decided is True
    assert codes(resumed, with_info=True) == []  # resuming is neither a second scheduler step nor a missing warm-up


def test_built_from_lightning_cli_yaml(tmp_path):
    from lightning.pytorch.cli import LightningCLI

    config = tmp_path / "config.yaml"
    config.write_text(
        "trainer:\n  callbacks:\n    - class_path: lightning_tfdebug.OptimizerAudit\n"
        "      init_args: {every_n_steps: 5, check_warmup: false, zero_lr_fraction: 0.5, patience: 3}\n"
    )
    cli = LightningCLI(TinyGPT, TinyTextDataModule, run=False, args=["--config", str(config)])
    [audit] = [c for c in cli.trainer.callbacks if isinstance(c, OptimizerAudit)]
    assert (audit.every_n_steps, audit.check_warmup, audit.zero_lr_fraction, audit.patience) == (5, False, 0.5, 3)


@pytest.mark.ddp
def test_ddp_every_rank_reaches_the_same_findings(tmp_path):
    spec = {
        "strategy": "ddp",
        "model": {**SMALL, "head_not_in_optimizer": True, "adam_l2": True, "eval_mode": True},
        "data": {"batch_size": 4},
        "trainer": {"max_steps": 3},
        "callbacks": [{"class_path": "lightning_tfdebug.OptimizerAudit", "init_args": {"every_n_steps": 1}}],
    }
    for r in run_distributed(tmp_path, spec):
        assert r["error"] is None, r["error"]
        found = sorted({f["code"] for f in r["findings"]["OptimizerAudit"] if f["severity"] != "info"})
        assert found == ["TFD320", "TFD327"], (r["rank"], found)  # TFD324 and TFD326 are info (no shrink measured)
        assert "optimizer_audit/lr/group0" in r["metrics"]


@pytest.mark.ddp
def test_fsdp2_sharded_parameters_audit_and_byte_check(tmp_path):
    # parameters are DTensor shards: membership, decay and the per-shard byte comparison (rank-local findings,
    # resolved on every rank together after each measuring step) must all work and agree across ranks
    spec = {
        "strategy": "fsdp2",
        "model": {**SMALL, "head_not_in_optimizer": True},
        "data": {"batch_size": 4},
        "trainer": {"max_steps": 3},
        "callbacks": [{"class_path": "lightning_tfdebug.OptimizerAudit", "init_args": {"every_n_steps": 1}}],
    }
    for r in run_distributed(tmp_path, spec):
        assert r["error"] is None, r["error"]
        found = sorted({f["code"] for f in r["findings"]["OptimizerAudit"] if f["severity"] != "info"})
        assert found == ["TFD320"], (r["rank"], found)
        assert "head.weight" in r["findings"]["OptimizerAudit"][0]["message"]
        assert r["global_step"] == 3


class HalfEps(TinyGPT):
    """TinyGPT whose AdamW uses a chosen eps (one group)."""

    def __init__(self, eps: float, **kwargs):
        super().__init__(**kwargs)
        self.eps = eps

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3, eps=self.eps, weight_decay=0.0)


def test_adam_over_float16_parameters_with_a_small_eps(tmp_path):  # seed O10
    # The mechanism, checked on torch itself: float16 moments, a gradient whose square underflows, eps rounding to 0.
    weight = torch.nn.Parameter(torch.ones(2, dtype=torch.float16))
    weight.grad = torch.full((2,), 1e-5, dtype=torch.float16)
    torch.optim.AdamW([weight], lr=1e-3).step()
    assert torch.isinf(weight).all()

    audit = OptimizerAudit()
    fit(tmp_path / "default", [audit], model=TinyGPT(**SMALL), precision="16-true", max_steps=1)
    found = [f for f in audit.findings if f.code == "TFD333"]
    assert [(f.severity, f.evidence["group"]) for f in found] == [("warning", "group0"), ("warning", "group1")]
    assert found[0].evidence["eps"] == 1e-8 and found[0].evidence["max_step_factor"] == float("inf")
    assert "rounds to 0 in float16" in found[0].message

    small = OptimizerAudit()
    fit(tmp_path / "small", [small], model=HalfEps(1e-6, **SMALL), precision="16-true", max_steps=1)
    [finding] = [f for f in small.findings if f.code == "TFD333"]
    assert finding.evidence["max_step_factor"] == pytest.approx(1.7e-4 / 1e-6, rel=0.05)  # eps as float16 holds it

    for name, model, precision in [
        ("big-eps", HalfEps(1e-4, **SMALL), "16-true"),
        ("bf16", TinyGPT(**SMALL), "bf16-true"),  # bfloat16 has float32's range: no underflow
        ("mixed", TinyGPT(**SMALL), "bf16-mixed"),  # float32 master weights and moments
    ]:
        quiet = OptimizerAudit()
        fit(tmp_path / name, [quiet], model=model, precision=precision, max_steps=1)
        assert "TFD333" not in codes(quiet), name


@pytest.mark.ddp
def test_ddp_gradients_never_zeroed_raise_on_every_rank_together(tmp_path):
    spec = {
        "strategy": "ddp",
        "model_class": "tests.callbacks.test_optimizer_audit:ManualSteps",
        "model": {**SMALL, "zero": "none"},
        "data": {"batch_size": 4},
        "trainer": {"max_steps": 6},
        "callbacks": [
            {"class_path": "lightning_tfdebug.OptimizerAudit", "init_args": {"every_n_steps": 2, "on_finding": "raise"}}
        ],
    }
    for r in run_distributed(tmp_path, spec):
        assert r["error"] is not None and r["error"]["type"] == "TFDebugError", (r["rank"], r["error"])
        assert "TFD334" in r["error"]["message"] and "step 2" in r["error"]["message"]


def recipe_gpt2(lr: float, weight_decay: float):
    """Hugging Face GPT-2 (tiny config) trained with the published recipes' optimizer: ``AdamW(model.parameters(),
    weight_decay=...)`` over every parameter, norm gains and biases included, after a 10-step warm-up."""
    from tests.healthy_models import build

    module = build("gpt2")

    def configure_optimizers():
        optimizer = torch.optim.AdamW(module.parameters(), lr=lr, weight_decay=weight_decay)
        warm = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 10))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": warm, "interval": "step"}}

    module.configure_optimizers = configure_optimizers
    return module


@pytest.mark.parametrize("weight_decay", [0.01, 0.1])
def test_the_published_recipes_decay_on_norms_and_biases_stays_advice(tmp_path, weight_decay):  # issue 22, run 3
    audit = OptimizerAudit(every_n_steps=10)
    fit(tmp_path, [audit], model=recipe_gpt2(2e-3, weight_decay), max_steps=100)
    [finding] = [f for f in audit.findings if f.code == "TFD324"]
    assert finding.severity == "info" and "ln_1.weight" in finding.message
    assert codes(audit) == []  # nothing above info: the decayed gains did not shrink


def test_decay_that_measurably_shrinks_norm_gains_is_a_warning_with_the_numbers(tmp_path):
    audit = OptimizerAudit(every_n_steps=10)
    fit(tmp_path, [audit], model=recipe_gpt2(3e-3, 1.0), max_steps=100)  # lr * wd = 3e-3: below TFD336's line
    [shrink] = [f for f in audit.findings if f.code == "TFD324" and f.severity == "warning"]
    evidence = shrink.evidence
    assert evidence["fall"] > 0.1 and evidence["decay_shrinkage"] >= 0.5 * evidence["fall"]
    assert evidence["norm"] < 0.9 * evidence["first_norm"] and evidence["first_step"] == 0
    assert f"{evidence['fall']:.1%}" in shrink.message
    assert "TFD336" not in codes(audit)
