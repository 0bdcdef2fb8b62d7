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
    lrs = [v for _, v in scalars["lr/group0"]]
    # LambdaLR warm-up (s+1)/4 of 1e-3, read from the optimizer as it will be applied at each step
    assert lrs == pytest.approx([2.5e-4, 5e-4, 7.5e-4, 1e-3])
    assert [v for _, v in scalars["lr/group1"]] == pytest.approx(lrs)


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
        (FrozenStillInOptimizer, ["TFD322", "TFD330"]),
        (DuplicateParameter, ["TFD321"]),
        (StaleCopies, ["TFD320", "TFD323", "TFD330"]),
    ],
)
def test_wiring_findings(tmp_path, model_cls, expected):
    audit = OptimizerAudit()
    fit(tmp_path, [audit], model=model_cls(**SMALL))
    assert codes(audit) == expected


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
    assert codes(audit) == ["TFD330", "TFD331"]
    assert next(f for f in audit.findings if f.code == "TFD331").step == 3
    audit = OptimizerAudit(every_n_steps=1)
    fit(tmp_path / "nowarmup", [audit], model=TinyGPT(**SMALL, warmup_steps=0))
    assert codes(audit) == ["TFD330"]


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
        assert found == ["TFD320", "TFD324", "TFD326", "TFD327"], (r["rank"], found)
        assert "lr/group0" in r["metrics"]


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
