import warnings

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.precision import MixedPrecision

from lightning_tfdebug import ScalerWatch
from lightning_tfdebug.demo import TinyGPT, TinyTextDataModule
from tests.helpers import SMALL, make_trainer, read_csv_metrics, read_scalars, run_distributed
from tests.helpers import fit_tiny as fit

# d_model 64: blocks.0.mlp.fc outputs reach ~0.6, so the 1e5 of bug 15 pushes them past fp16's 65504
OVERFLOW = dict(d_model=64, n_layers=2, n_heads=2, overflow_module="blocks.0.mlp.fc")


def fp16(**scaler_kwargs):
    return MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", **scaler_kwargs))


def codes(callback):
    return [f.code for f in callback.findings]


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"min_scale": 0}, "min_scale"),
        ({"collapse_backoffs": 0}, "collapse_backoffs"),
        ({"window": 1.5}, "window"),
        ({"max_skipped_frac": 1.5}, "max_skipped_frac"),
        ({"min_steps": 0}, "min_steps"),
        ({"lr_skipped_steps": 0}, "lr_skipped_steps"),
        ({"no_growth_intervals": -1}, "no_growth_intervals"),
        ({"on_finding": "explode"}, "on_finding"),
    ],
)
def test_bad_arguments_fail_at_construction(kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        ScalerWatch(**kwargs)


def test_injected_overflow_skips_steps_and_collapses_the_scale(tmp_path):
    """Bug 15 under fp16 with a real CPU GradScaler: skipped steps counted, scale collapse and skip rate found."""
    watch = ScalerWatch(every_n_steps=1, window=20, min_steps=8, lr_skipped_steps=8)
    fit(tmp_path, [watch], model=TinyGPT(**OVERFLOW), max_steps=20, plugins=[fp16()])
    scalars = read_scalars(tmp_path / "tb" / "version_0")
    scale = dict(scalars["scaler/scale"])
    skipped = dict(scalars["scaler/skipped_steps"])
    assert scale[19] < scale[0] / 1000  # halved on (almost) every step
    assert skipped[19] >= 17 and skipped[19] == watch.skipped_total
    assert dict(scalars["scaler/backoff_events"])[19] == watch.backoff_total >= 17
    assert dict(scalars["scaler/skipped_frac"])[19] == 1.0
    found = {f.code: f for f in watch.findings}
    assert {"TFD411", "TFD412", "TFD413"} <= set(found)
    assert found["TFD411"].severity == "error"
    # the overflow enters at blocks.0 and reaches every later group's gradients; the head overflows with it
    assert "blocks.0" in found["TFD412"].evidence["overflow_groups"]
    assert found["TFD413"].evidence["scheduler"] == "LambdaLR"
    rows = [r for r in read_csv_metrics(tmp_path / "csv" / "version_0") if r.get("scaler/scale")]
    assert len(rows) == 20
    assert found["TFD413"].evidence["scheduler_steps_on_skipped"] == 8  # emitted when it reached lr_skipped_steps
    assert watch.lr_steps_on_skipped >= 16  # every skipped step but (perhaps) the last moved the schedule


class SkipAwareScheduler(TinyGPT):
    """Steps its LR scheduler only when the GradScaler did not just lower the scale (the step was applied)."""

    def lr_scheduler_step(self, scheduler, metric):
        scale = self.trainer.precision_plugin.scaler.get_scale()
        if scale >= getattr(self, "last_scale", 2.0**16):  # GradScaler's init_scale
            scheduler.step()
        self.last_scale = scale


def test_a_scheduler_that_waits_for_applied_steps_is_not_blamed(tmp_path):
    watch = ScalerWatch(every_n_steps=5, window=20, min_steps=8, lr_skipped_steps=3)
    fit(tmp_path, [watch], model=SkipAwareScheduler(**OVERFLOW), max_steps=20, plugins=[fp16()])
    assert watch.skipped_total >= 14 and watch.lr_steps_on_skipped == 0  # 16 steps counted by the log at step 15
    assert {"TFD411", "TFD412"} <= set(codes(watch)) and "TFD413" not in codes(watch)


def test_healthy_fp16_run_raises_nothing_and_logs_only_on_measuring_steps(tmp_path):
    watch = ScalerWatch(every_n_steps=4, min_steps=4)
    fit(tmp_path, [watch], max_steps=12, plugins=[fp16(growth_interval=3)])
    scalars = read_scalars(tmp_path / "tb" / "version_0")
    assert sorted(dict(scalars["scaler/scale"])) == [0, 4, 8]
    # the scale grows every 3 clean steps; an occasional probe past the limit is skipped, as designed
    assert watch.growth_total >= 2 and watch.skipped_total <= 2
    assert dict(scalars["scaler/skipped_steps"])[8] == watch.skipped_total
    assert dict(scalars["scaler/scale"])[8] > 65536.0
    assert watch.findings == []


def test_scale_that_never_grows_is_found(tmp_path):
    """Overflow on every third step: the scale drops, never completes growth_interval clean steps, never grows."""

    class EveryThirdOverflows(TinyGPT):
        def training_step(self, batch, batch_idx):
            loss = super().training_step(batch, batch_idx)
            return loss * 1e38 if self.trainer.global_step % 3 == 2 else loss  # the scaled loss overflows

    watch = ScalerWatch(every_n_steps=1, no_growth_intervals=2, collapse_backoffs=50, max_skipped_frac=0.9)
    fit(tmp_path, [watch], model=EveryThirdOverflows(**SMALL), max_steps=12, plugins=[fp16(growth_interval=4)])
    assert watch.growth_total == 0 and watch.skipped_total == 4
    assert codes(watch) == ["TFD414"]


@pytest.mark.parametrize("precision", ["bf16-mixed", "32-true"])
def test_without_a_scaler_one_info_finding_and_nothing_else(tmp_path, precision):
    watch = ScalerWatch(every_n_steps=1)
    trainer = fit(tmp_path, [watch], max_steps=3, precision=precision)
    [finding] = watch.findings
    assert finding.code == "TFD410" and finding.severity == "info"
    assert not any(k.startswith("scaler/") for k in trainer.callback_metrics)


def test_counters_survive_a_checkpoint_resume(tmp_path):
    first = ScalerWatch(every_n_steps=1)
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True)
    fit(tmp_path, [first, ckpt], model=TinyGPT(**OVERFLOW), max_steps=6, plugins=[fp16()], enable_checkpointing=True)
    assert first.skipped_total >= 4
    resumed = ScalerWatch(every_n_steps=1)
    trainer = make_trainer(tmp_path, [resumed], max_steps=8, plugins=[fp16()])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(
            TinyGPT(**OVERFLOW), TinyTextDataModule(batch_size=8), ckpt_path=str(tmp_path / "ckpt" / "last.ckpt")
        )
    assert resumed.steps_total == 8
    assert resumed.skipped_total >= first.skipped_total + 2


def test_built_from_lightning_cli_yaml(tmp_path):
    from lightning.pytorch.cli import LightningCLI

    config = tmp_path / "config.yaml"
    config.write_text(
        """
trainer:
  precision: 16-mixed
  callbacks:
    - class_path: lightning_tfdebug.ScalerWatch
      init_args:
        every_n_steps: 5
        min_scale: 0.5
        max_skipped_frac: 0.1
        on_finding: raise
"""
    )
    cli = LightningCLI(TinyGPT, TinyTextDataModule, run=False, args=["--config", str(config)])
    [watch] = [c for c in cli.trainer.callbacks if isinstance(c, ScalerWatch)]
    assert (watch.every_n_steps, watch.min_scale, watch.max_skipped_frac, watch.on_finding) == (5, 0.5, 0.1, "raise")


class UseCpuFp16(pl.Callback):
    """Installs fp16 AMP with a real CPU GradScaler in a Trainer built from a spec (plugins are not JSON).

    Its ``setup`` runs before the strategy sets the precision plugin up, and before ScalerWatch's (list order).
    """

    def setup(self, trainer, pl_module, stage):
        trainer.strategy.precision_plugin = fp16()


def dist_extra(trainer, model, callbacks):
    [watch] = [c for c in callbacks if isinstance(c, ScalerWatch)]
    return {"skipped": watch.skipped_total, "backoff": watch.backoff_total, "groups": sorted(watch.overflow_groups)}


@pytest.mark.ddp
@pytest.mark.timeout(200)
def test_every_ddp_rank_counts_the_same_skips_and_reaches_the_same_findings(tmp_path):
    spec = {
        "strategy": "ddp",
        "model": OVERFLOW,
        "data": {"batch_size": 4},
        "trainer": {"max_steps": 12},
        "callbacks": [
            {"class_path": "tests.callbacks.test_scaler_watch.UseCpuFp16"},
            {
                "class_path": "lightning_tfdebug.ScalerWatch",
                "init_args": {"every_n_steps": 1, "window": 12, "min_steps": 6, "lr_skipped_steps": 6},
            },
        ],
        "extra": "tests.callbacks.test_scaler_watch:dist_extra",
    }
    results = run_distributed(tmp_path, spec, timeout=150)
    assert all(r["error"] is None and r["global_step"] == 12 for r in results)
    assert results[0]["extra"] == results[1]["extra"] and results[0]["extra"]["skipped"] >= 10
    assert results[0]["metrics"]["scaler/scale"] == results[1]["metrics"]["scaler/scale"] < 65536 / 1000
    for r in results:
        assert {"TFD411", "TFD412", "TFD413"} <= {f["code"] for f in r["findings"]["ScalerWatch"]}
