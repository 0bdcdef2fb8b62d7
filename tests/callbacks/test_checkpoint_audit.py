import warnings

import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.plugins.precision import MixedPrecision

from lightning_tfdebug import CheckpointAudit, TFDebugWarning
from lightning_tfdebug.core.checkpoints import read_sharded
from lightning_tfdebug.demo import TinyGPT, TinyTextDataModule
from lightning_tfdebug.functional.checkpoint_checks import sharded_problems
from tests.callbacks.torch_calls import TorchCalls
from tests.helpers import make_trainer, run_distributed

SMALL = dict(d_model=32, n_layers=2, n_heads=2)


def fit(tmp_path, callbacks, model=None, ckpt_path=None, **kwargs):
    kwargs.setdefault("max_steps", 4)
    saver = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=2, save_top_k=-1)
    trainer = make_trainer(tmp_path, [*callbacks, saver], enable_checkpointing=True, **kwargs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(model or TinyGPT(**SMALL), TinyTextDataModule(batch_size=8), ckpt_path=ckpt_path)
    return trainer


def codes(callback):
    return sorted({f.code for f in callback.findings})


@pytest.mark.parametrize(
    "kwargs, match",
    [({"probe_rows": 0}, "probe_rows"), ({"loss_rtol": 0.0}, "loss_rtol"), ({"weight_rtol": 2.0}, "weight_rtol")],
)
def test_bad_arguments_fail_at_construction(kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        CheckpointAudit(**kwargs)


def test_healthy_saves_are_opened_and_pass(tmp_path):
    audit = CheckpointAudit()
    fit(tmp_path, [audit])
    assert codes(audit) == []
    assert [p.rsplit("/", 1)[-1] for p in audit.checked_files] == ["epoch=0-step=2.ckpt", "epoch=0-step=4.ckpt"]
    saved = torch.load(audit.checked_files[-1], map_location="cpu", weights_only=False)
    state = saved["callbacks"][audit.state_key]
    probe = state["probe_call"]  # the model call training_step made, cut to 2 rows: replayed, never the step
    assert state["probe_loss_step"] == 4 and probe["module"] == ""  # TinyGPT's own forward
    ids = probe["args"][0] if probe["args"] else probe["kwargs"]["input_ids"]
    assert ids.shape[0] == 2 and ids.device.type == "cpu"


def fit_with_savers(tmp_path, savers, model=None, data=None):
    audit = CheckpointAudit()
    trainer = make_trainer(tmp_path, [audit, *savers], enable_checkpointing=True, max_steps=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(model or TinyGPT(**SMALL), data or TinyTextDataModule(batch_size=8))
    return audit


def test_a_run_whose_only_checkpoint_is_weights_only_cannot_be_resumed(tmp_path):  # issue 22, run 2
    from tests.healthy_models import build, data

    saver = ModelCheckpoint(dirpath=tmp_path / "w", every_n_train_steps=2, save_weights_only=True)
    audit = fit_with_savers(tmp_path, [saver], model=build("encoder_lm"), data=data("encoder_lm"))
    [finding] = audit.findings
    assert (finding.code, finding.severity) == ("TFD709", "warning"), finding.format()
    assert "no checkpoint this run keeps can resume it" in finding.message
    assert finding.evidence["resumable"] is False and "save_last=True" in finding.hint


def test_a_weights_only_save_beside_a_full_one_is_info(tmp_path):
    weights = ModelCheckpoint(dirpath=tmp_path / "w", every_n_train_steps=2, save_weights_only=True)
    full = ModelCheckpoint(dirpath=tmp_path / "full", every_n_train_steps=1, save_top_k=1)
    audit = fit_with_savers(tmp_path, [weights, full])
    [finding] = audit.findings
    assert (finding.code, finding.severity) == ("TFD709", "info") and "weights-only" in finding.message
    assert finding.evidence["resumable"] is True and "full" in finding.evidence["resumable_savers"][0]


class ForeignSave(Callback):
    """Saves another framework's dict (``model``/``optim``, no Lightning keys) through the strategy's CheckpointIO,
    as a user's own export hook does."""

    def __init__(self, path) -> None:
        self.path = path

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == 2:
            foreign = {"model": pl_module.state_dict(), "optim": trainer.optimizers[0].state_dict(), "iteration": 2}
            trainer.strategy.checkpoint_io.save_checkpoint(foreign, self.path)


@pytest.mark.parametrize("reload", [True, False], ids=["reload", "in-memory"])
def test_a_checkpoint_dict_from_another_framework_stands_aside_once_recorded(tmp_path, capsys, reload):
    audit = CheckpointAudit(reload=reload)
    trainer = make_trainer(tmp_path, [audit, ForeignSave(tmp_path / "export.pt")], max_steps=4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(TinyGPT(**SMALL), TinyTextDataModule(batch_size=8))
    assert [w for w in caught if issubclass(w.category, TFDebugWarning)] == []  # nothing raised, nothing warned
    assert (tmp_path / "export.pt").is_file() and audit.active
    assert audit.findings == []  # not called weights-only, nor missing its weights
    [why] = audit.checks_aside.values()
    assert "without Lightning's `state_dict` (keys: model, optim, iteration)" in why
    assert "Trainer.save_checkpoint" in why
    assert "stands aside" not in capsys.readouterr().err


def test_bug_zoo_row_22_optimizer_and_scheduler_state_dropped(tmp_path):
    audit = CheckpointAudit()
    fit(tmp_path, [audit], model=TinyGPT(**SMALL, drop_optimizer_state=True))
    assert codes(audit) == ["TFD703", "TFD705"]
    assert all(f.severity == "error" and "epoch=0-step=2.ckpt" in f.message for f in audit.findings)


class Drops(TinyGPT):
    """Saves checkpoints that lack one part, as a careless `on_save_checkpoint` override does."""

    def __init__(self, drop: str, **kwargs):
        super().__init__(**kwargs)
        self.drop = drop

    def on_save_checkpoint(self, checkpoint):
        if self.drop == "weight":
            checkpoint["state_dict"].pop("head.weight")
        elif self.drop == "shape":
            checkpoint["state_dict"]["ln_f.weight"] = checkpoint["state_dict"]["ln_f.weight"][:4]
        elif self.drop == "step_counts":
            for entry in checkpoint["optimizer_states"][0]["state"].values():
                entry.pop("step")
        else:
            checkpoint.pop(self.drop)


@pytest.mark.parametrize(
    "drop, code",
    [
        ("weight", "TFD701"),
        ("shape", "TFD702"),
        ("step_counts", "TFD704"),
        ("loops", "TFD707"),
        ("callbacks", "TFD708"),
    ],
)
def test_each_missing_piece_has_its_finding(tmp_path, drop, code):
    audit = CheckpointAudit()
    fit(tmp_path, [audit], model=Drops(drop, **SMALL), max_steps=2)
    assert codes(audit) == [code]


def test_fp16_scaler_state(tmp_path):
    def precision():
        return MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))

    audit = CheckpointAudit()
    fit(tmp_path / "ok", [audit], plugins=[precision()], max_steps=2)
    assert codes(audit) == [] and audit.checked_files
    audit = CheckpointAudit()
    fit(tmp_path / "dropped", [audit], model=Drops("MixedPrecision", **SMALL), plugins=[precision()], max_steps=2)
    assert codes(audit) == ["TFD706"]


class ResetsTheLossScale(Callback):
    """Placed before CheckpointAudit: replaces the restored GradScaler with a fresh one (scale 2**16)."""

    def on_train_start(self, trainer, pl_module):
        trainer.precision_plugin.scaler = torch.amp.GradScaler("cpu")


def test_fp16_resume_restores_the_loss_scale(tmp_path):
    def precision():
        return MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=1024.0))

    fit(tmp_path, [CheckpointAudit()], plugins=[precision()], max_steps=2)
    ckpt = str(tmp_path / "ckpt" / "epoch=0-step=2.ckpt")
    audit = CheckpointAudit()
    fit(tmp_path / "healthy", [audit], plugins=[precision()], ckpt_path=ckpt)
    assert codes(audit) == []
    audit = CheckpointAudit()
    fit(tmp_path / "reset", [ResetsTheLossScale(), audit], plugins=[precision()], ckpt_path=ckpt)
    assert codes(audit) == ["TFD713"]
    finding = audit.findings[0]
    assert finding.evidence["now"] == 2.0**16 and finding.evidence["saved"] <= 1024.0


class ReinitialisedAfterLoading(TinyGPT):
    def on_fit_start(self):  # runs after the weights are restored from `ckpt_path`
        self.apply(self._init_weights)


class BreaksTheResume(Callback):
    """Placed before CheckpointAudit: resets the optimizer and changes the LR after Lightning restored them."""

    def on_train_start(self, trainer, pl_module):
        optimizer = trainer.optimizers[0]
        optimizer.state.clear()
        for group in optimizer.param_groups:
            group["lr"] *= 2


def test_resume_checks(tmp_path):
    fit(tmp_path, [CheckpointAudit()])
    ckpt = str(tmp_path / "ckpt" / "epoch=0-step=2.ckpt")

    audit = CheckpointAudit()
    trainer = fit(tmp_path / "healthy", [audit], ckpt_path=ckpt)
    assert codes(audit) == []
    assert audit._probe_loss_step == 4  # saved again after the resume, state carried over
    assert trainer.global_step == 4

    audit = CheckpointAudit()
    fit(tmp_path / "reinit", [audit], model=ReinitialisedAfterLoading(**SMALL), ckpt_path=ckpt)
    assert codes(audit) == ["TFD710", "TFD715"]
    probe = next(f for f in audit.findings if f.code == "TFD715")
    assert probe.evidence["saved_step"] == 2 and probe.step == 2

    audit = CheckpointAudit()
    fit(tmp_path / "broken", [BreaksTheResume(), audit], ckpt_path=ckpt)
    assert codes(audit) == ["TFD711", "TFD712"]


class RestartsTheLoops(TinyGPT):
    """Keeps the weights and optimizer state of the checkpoint but drops its loop progress ("fine-tune from here"):
    the step counter restarts at 0 while Adam's step counts and the LR schedule carry on from the saved step."""

    def on_load_checkpoint(self, checkpoint):  # runs before Lightning restores the loops
        checkpoint.pop("loops")


def slimmed(ckpt, out):
    """The checkpoint rewritten by a script that copies only the keys it knows: everything but ``loops``."""
    full = torch.load(ckpt, map_location="cpu", weights_only=False)
    keep = ("state_dict", "optimizer_states", "lr_schedulers", "callbacks", "epoch", "global_step")
    torch.save({k: full[k] for k in (*keep, "pytorch-lightning_version")}, out)
    return str(out)


def test_global_step_after_resume_differs_from_the_checkpoint(tmp_path):
    fit(tmp_path, [CheckpointAudit()], max_steps=2)
    ckpt = str(tmp_path / "ckpt" / "epoch=0-step=2.ckpt")
    audit = CheckpointAudit()
    trainer = fit(tmp_path / "healthy", [audit], ckpt_path=ckpt)
    assert codes(audit) == [] and trainer.global_step == 4

    for name, model, path in [
        ("hook", RestartsTheLoops(**SMALL), ckpt),
        ("slim", None, slimmed(ckpt, tmp_path / "slim.ckpt")),
    ]:
        audit = CheckpointAudit()
        trainer = fit(tmp_path / name, [audit], model=model, ckpt_path=path)
        assert codes(audit) == ["TFD714"], name  # weights, optimizer, LR and probe loss were all restored
        [finding] = audit.findings
        assert (finding.severity, finding.step) == ("error", 0)
        assert finding.evidence == {"saved": 2, "now": 0}
        assert finding.message == "The global step after resume is 0, the checkpoint was saved at 2."
        assert trainer.global_step == 4  # four more steps instead of two: the run restarted its step count


def test_resuming_without_optimizer_state_is_explained_before_lightning_fails(tmp_path):
    fit(tmp_path, [CheckpointAudit()], model=TinyGPT(**SMALL, drop_optimizer_state=True), max_steps=2)
    audit = CheckpointAudit()
    with pytest.raises(KeyError, match="optimizer"):
        fit(tmp_path / "resume", [audit], ckpt_path=str(tmp_path / "ckpt" / "epoch=0-step=2.ckpt"))
    assert codes(audit) == ["TFD703", "TFD705"]


def test_built_from_lightning_cli_yaml(tmp_path):
    from lightning.pytorch.cli import LightningCLI

    config = tmp_path / "config.yaml"
    config.write_text(
        "trainer:\n  callbacks:\n    - class_path: lightning_tfdebug.CheckpointAudit\n"
        "      init_args: {probe_rows: 4, loss_rtol: 1.0e-2, on_finding: stop}\n"
    )
    cli = LightningCLI(TinyGPT, TinyTextDataModule, run=False, args=["--config", str(config)])
    [audit] = [c for c in cli.trainer.callbacks if isinstance(c, CheckpointAudit)]
    assert (audit.probe_rows, audit.loss_rtol, audit.on_finding) == (4, 1e-2, "stop")


SAVER = {
    "class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
    "init_args": {"dirpath": "ckpt", "every_n_train_steps": 2, "save_top_k": -1},
}


@pytest.mark.ddp
def test_ddp_rank_zero_verifies_and_every_rank_raises_together(tmp_path):
    spec = {
        "strategy": "ddp",
        "model": {**SMALL, "drop_optimizer_state": True},
        "data": {"batch_size": 4},
        "trainer": {"max_steps": 6, "enable_checkpointing": True},
        "callbacks": [
            {"class_path": "lightning_tfdebug.CheckpointAudit", "init_args": {"on_finding": "raise"}},
            SAVER,
        ],
    }
    results = run_distributed(tmp_path, spec)
    rank0, rank1 = results
    assert sorted(f["code"] for f in rank0["findings"]["CheckpointAudit"]) == ["TFD703", "TFD705"]
    assert rank1["findings"]["CheckpointAudit"] == []  # only rank 0 writes and reads the file
    for r in results:  # both stop at the same step: the batch after the save at step 2
        assert r["error"] is not None and r["error"]["type"] == "TFDebugError", r["error"]
        assert r["global_step"] == 3


@pytest.mark.ddp
def test_fsdp2_sharded_checkpoints_are_checked_from_their_metadata(tmp_path):
    spec = {
        "strategy": "fsdp2",
        "model": SMALL,
        "data": {"batch_size": 4},
        "trainer": {"max_steps": 4, "enable_checkpointing": True},
        "callbacks": [{"class_path": "lightning_tfdebug.CheckpointAudit"}, SAVER],
    }
    rank0, rank1 = run_distributed(tmp_path, spec)
    assert rank0["error"] is None and rank1["error"] is None, (rank0["error"], rank1["error"])
    assert rank0["findings"]["CheckpointAudit"] == []  # both directories complete: silent
    assert rank1["findings"]["CheckpointAudit"] == []
    directories = sorted(p for p in (tmp_path / "ckpt").iterdir() if p.is_dir())
    assert len(directories) == 2 and all(sharded_problems(read_sharded(str(d))) == [] for d in directories)
    # what a full disk or a killed save leaves: a shard cut short, a shard missing, no metadata
    shards = sorted(directories[0].glob("*.distcp"))
    shards[0].write_bytes(shards[0].read_bytes()[:100])
    [short] = sharded_problems(read_sharded(str(directories[0])))
    assert short.code == "TFD716" and short.evidence["short"] == [shards[0].name]
    shards[-1].unlink()
    [missing] = sharded_problems(read_sharded(str(directories[0])))
    assert missing.evidence["missing"] == [shards[-1].name] and "missing" in missing.message
    (directories[1] / ".metadata").unlink()
    [unfinished] = sharded_problems(read_sharded(str(directories[1])))
    assert "has no `.metadata`" in unfinished.message


@pytest.mark.ddp
@pytest.mark.slow  # ~30 s: three DDP fits; the resume checks are tested in one process by default
def test_ddp_resume_is_checked_on_every_rank(tmp_path):
    """Two processes save; two more resume, healthy (silent) and with weights re-initialised after loading (named)."""
    audit = {"class_path": "lightning_tfdebug.CheckpointAudit"}
    base = {"strategy": "ddp", "model": SMALL, "data": {"batch_size": 4}}
    save = {**base, "trainer": {"max_steps": 2, "enable_checkpointing": True}, "callbacks": [audit, SAVER]}
    for r in run_distributed(tmp_path / "save", save):
        assert r["error"] is None and r["findings"]["CheckpointAudit"] == [], r
    ckpt = str(tmp_path / "save" / "ckpt" / "epoch=0-step=2.ckpt")

    resume = {**base, "trainer": {"max_steps": 4}, "callbacks": [audit], "ckpt_path": ckpt}
    for r in run_distributed(tmp_path / "healthy", resume):
        assert r["error"] is None, r["error"]
        assert r["findings"]["CheckpointAudit"] == [], (r["rank"], r["findings"])
        assert r["global_step"] == 4

    reinit = {**resume, "model_class": "tests.callbacks.test_checkpoint_audit:ReinitialisedAfterLoading"}
    for r in run_distributed(tmp_path / "reinit", reinit):
        assert r["error"] is None, r["error"]
        assert sorted(f["code"] for f in r["findings"]["CheckpointAudit"]) == ["TFD710", "TFD715"], r["rank"]


def test_steps_without_a_save_cost_nothing(tmp_path):
    """The probe batch is copied once, at the first batch; later steps without a save run no tensor op."""
    calls = TorchCalls()
    trainer = make_trainer(tmp_path, calls.around(CheckpointAudit()), max_steps=5)
    trainer.fit(TinyGPT(d_model=32, n_layers=2, n_heads=2), TinyTextDataModule(batch_size=8))
    assert set(calls.counts) == {0}
