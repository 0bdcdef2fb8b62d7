import math
import warnings

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.precision import MixedPrecision

from lightning_tfdebug import GradNormMonitor
from lightning_tfdebug.demo import TinyGPT, TinyTextDataModule
from tests.helpers import SMALL, make_trainer, read_csv_metrics, read_scalars, run_distributed
from tests.helpers import fit_tiny as fit
from tests.reference import ReferenceGradNorm


def codes(callback):
    return [f.code for f in callback.findings]


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"explosion_factor": 1.0}, "explosion_factor"),
        ({"vanishing_ratio": 0}, "vanishing_ratio"),
        ({"patience": 0}, "patience"),
        ({"history": 2.5}, "history"),
        ({"groups": {"attn": "("}}, "not a valid regular expression"),
        ({"groups": {}}, "non-empty mapping"),
        ({"group_depth": 0}, "group_depth"),
    ],
)
def test_bad_arguments_fail_at_construction(kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        GradNormMonitor(**kwargs)


def test_total_matches_clip_grad_norm_and_keys_reach_tensorboard_and_csv(tmp_path):
    reference, monitor = ReferenceGradNorm(), GradNormMonitor(every_n_steps=3)
    fit(tmp_path, [reference, monitor], max_steps=10)
    scalars = read_scalars(tmp_path / "tb" / "version_0")
    logged = dict(scalars["grad_norm/total"])
    assert sorted(logged) == [0, 3, 6, 9]
    for step, value in logged.items():
        assert value == pytest.approx(reference.norms[step], rel=1e-5)
    for key in ("grad_norm/blocks.0", "grad_norm/blocks.1", "grad_norm/embeddings", "grad_norm/head"):
        assert key in scalars
    # groups add up to the total
    groups = [k for k in scalars if k.startswith("grad_norm/") and k not in ("grad_norm/total", "grad_norm/nonfinite")]
    assert math.sqrt(sum(dict(scalars[k])[9] ** 2 for k in groups)) == pytest.approx(logged[9], rel=1e-5)
    rows = [r for r in read_csv_metrics(tmp_path / "csv" / "version_0") if r.get("grad_norm/total")]
    assert [int(r["step"]) for r in rows] == [0, 3, 6, 9]
    assert float(rows[1]["grad_norm/total"]) == pytest.approx(logged[3], rel=1e-5)
    assert monitor.findings == []


def test_metrics_reach_callback_metrics_for_early_stopping(tmp_path):
    trainer = fit(tmp_path, [GradNormMonitor(every_n_steps=2)], max_steps=4, logger=False)
    assert "grad_norm/total" in trainer.callback_metrics
    assert trainer.callback_metrics["grad_norm/total"].ndim == 0


def test_regex_and_depth_grouping(tmp_path):
    regex = GradNormMonitor(every_n_steps=1, groups={"attention": r"\.attn\.", "mlp": r"\.mlp\."})
    fit(tmp_path / "a", [regex], max_steps=1)
    assert {"grad_norm/attention", "grad_norm/mlp", "grad_norm/other"} <= set(
        read_scalars(tmp_path / "a" / "tb" / "version_0")
    )
    depth = GradNormMonitor(every_n_steps=1, group_depth=1)
    fit(tmp_path / "b", [depth], max_steps=1)
    assert {"grad_norm/blocks", "grad_norm/tok_emb", "grad_norm/head"} <= set(
        read_scalars(tmp_path / "b" / "tb" / "version_0")
    )


def test_norm_clipping_is_read_after_lightning_clips_and_a_tiny_clip_value_is_named(tmp_path):
    reference, monitor = ReferenceGradNorm(), GradNormMonitor(every_n_steps=2, patience=3)
    fit(tmp_path / "tiny", [reference, monitor], max_steps=8, gradient_clip_val=1e-4)
    kept = dict(read_scalars(tmp_path / "tiny" / "tb" / "version_0")["grad_norm/clip_kept"])
    # Lightning clips after the hook: each measured clipping is read at the next measuring step, logged at its own
    assert sorted(kept) == [0, 2, 4]
    assert kept[4] == pytest.approx(1e-4 / reference.norms[4], rel=1e-3)
    [finding] = [f for f in monitor.findings if f.code == "TFD306"]
    assert finding.step == 6 and finding.evidence["clipped_step"] == 4  # the third measured clipping in a row
    assert finding.evidence["gradient_clip_algorithm"] == "norm" and "gradient_clip_val=0.0001" in finding.message
    # a clip value that cuts spikes, or every step by a few x, is not a finding
    usual = GradNormMonitor(every_n_steps=2, patience=3)
    fit(tmp_path / "usual", [usual], max_steps=8, gradient_clip_val=0.1)
    assert "TFD306" not in codes(usual)


class ManualClipGPT(TinyGPT):
    """Manual optimization that clips by value in ``training_step``, recording the norms before and after."""

    def __init__(self, clip_val: float) -> None:
        super().__init__(**SMALL)
        self.automatic_optimization = False
        self.clip_val, self.kept = clip_val, {}

    def training_step(self, batch, batch_idx):
        optimizer = self.optimizers()
        optimizer.zero_grad()
        self.manual_backward(self.loss(self(batch["input_ids"]), batch["labels"]))
        grads = [p.grad for p in self.parameters() if p.grad is not None]
        before = torch.linalg.vector_norm(torch.stack([g.norm() for g in grads]))
        self.clip_gradients(optimizer, gradient_clip_val=self.clip_val, gradient_clip_algorithm="value")
        after = torch.linalg.vector_norm(torch.stack([g.norm() for g in grads]))
        self.kept[self.trainer.global_step] = float(after / before)
        optimizer.step()


def test_value_clipping_under_manual_optimization_is_read_on_its_own_step(tmp_path):
    module, monitor = ManualClipGPT(clip_val=1e-5), GradNormMonitor(every_n_steps=1, patience=3)
    fit(tmp_path, [monitor], model=module, max_steps=3)
    kept = dict(read_scalars(tmp_path / "tb" / "version_0")["grad_norm/clip_kept"])
    assert kept == pytest.approx(module.kept, rel=1e-4) and max(kept.values()) < 1 / 30
    [finding] = [f for f in monitor.findings if f.code == "TFD306"]
    assert finding.step == 2 and finding.evidence["gradient_clip_algorithm"] == "value"


def test_fp16_gradients_are_measured_unscaled(tmp_path):
    reference, monitor = ReferenceGradNorm(), GradNormMonitor(every_n_steps=1)
    plugin = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=2.0**16))
    fit(tmp_path, [reference, monitor], max_steps=3, plugins=[plugin])
    logged = dict(read_scalars(tmp_path / "tb" / "version_0")["grad_norm/total"])
    assert 0.1 < logged[0] < 100  # a scaled norm would be ~65536x larger
    assert logged[0] == pytest.approx(reference.norms[0], rel=1e-4)


class SpikeGPT(TinyGPT):
    """Multiplies the loss at one step, as a bad batch or an LR spike would scale the gradients."""

    def __init__(self, spike_step: int = 12, **kwargs):
        super().__init__(**kwargs)
        self.spike_step = spike_step

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        return loss * 1000.0 if self.trainer.global_step == self.spike_step else loss


def test_explosion_against_its_own_history(tmp_path):
    monitor = GradNormMonitor(every_n_steps=2, warmup_measurements=3)
    fit(tmp_path, [monitor], model=SpikeGPT(spike_step=12, **SMALL), max_steps=16)
    [finding] = [f for f in monitor.findings if f.code == "TFD301"]
    assert finding.step == 12 and finding.evidence["factor"] > 100


def test_vanishing_groups_in_a_deep_stack_without_residuals(tmp_path):
    monitor = GradNormMonitor(every_n_steps=5)
    model = TinyGPT(d_model=32, n_heads=2, n_layers=8, no_residual=True, activation="sigmoid")
    fit(tmp_path, [monitor], model=model, max_steps=30)
    [finding] = [f for f in monitor.findings if f.code == "TFD302"]
    assert "blocks.0" in finding.evidence["groups"] and "head" not in finding.evidence["groups"]
    assert finding.evidence["largest_group"] in finding.message


def test_a_group_no_optimizer_steps_is_not_the_reference_for_vanishing(tmp_path):
    # bug 10: the head is in no optimizer. It never learns, its gradient stays ~100 while the trained groups' fall, and
    # next to it the final LayerNorm looked vanishing (TFD302 at step 80 before). OptimizerAudit and UpdateRatio name
    # the bug (TFD320, TFD312); the vanishing check judges the groups that train, against each other.
    monitor = GradNormMonitor(every_n_steps=10)
    fit(tmp_path, [monitor], model=TinyGPT(head_not_in_optimizer=True, **SMALL), max_steps=100)
    assert "TFD302" not in codes(monitor), [(f.code, f.step, f.evidence) for f in monitor.findings]
    assert monitor._trained and not all(monitor._trained)  # the head's group is known to be out of the optimizer
    head = monitor._layout.groups.group_names.index("head")
    assert monitor._trained[head] is False


def test_healthy_runs_raise_nothing(tmp_path):
    monitor = GradNormMonitor(every_n_steps=5)
    fit(tmp_path, [monitor], model=TinyGPT(d_model=32, n_heads=2, n_layers=8), max_steps=60)
    assert codes(monitor) == []


class UnusedGPT(TinyGPT):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.extra = torch.nn.Linear(4, 4)  # trainable, never called in forward


def test_unused_parameters_are_named(tmp_path):
    monitor = GradNormMonitor(every_n_steps=1, patience=2)
    fit(tmp_path, [monitor], model=UnusedGPT(**SMALL), max_steps=3)
    [finding] = [f for f in monitor.findings if f.code == "TFD304"]
    assert finding.evidence["parameters"] == ["extra.weight", "extra.bias"]


def test_nonfinite_gradients_are_an_error_naming_the_groups(tmp_path):
    monitor = GradNormMonitor(every_n_steps=1)
    fit(tmp_path, [monitor], model=TinyGPT(nan_on_rank=0, nan_at_step=2, **SMALL), max_steps=3)
    [finding] = [f for f in monitor.findings if f.code == "TFD303"]
    assert finding.severity == "error" and finding.step == 2 and "blocks.0" in finding.evidence["groups"]


def test_state_is_saved_and_restored_on_resume(tmp_path):
    first = GradNormMonitor(every_n_steps=1)
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True)
    fit(tmp_path, [first, ckpt], max_steps=6, enable_checkpointing=True)
    history = list(first._memory.history.values)
    assert len(history) == 6
    resumed = GradNormMonitor(every_n_steps=1)
    trainer = make_trainer(tmp_path, [resumed], max_steps=7)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(TinyGPT(**SMALL), TinyTextDataModule(batch_size=8), ckpt_path=str(tmp_path / "ckpt" / "last.ckpt"))
    assert list(resumed._memory.history.values)[:6] == history
    assert len(resumed._memory.history) == 7


def test_built_from_lightning_cli_yaml(tmp_path):
    from lightning.pytorch.cli import LightningCLI

    config = tmp_path / "config.yaml"
    config.write_text(
        """
trainer:
  callbacks:
    - class_path: lightning_tfdebug.GradNormMonitor
      init_args:
        every_n_steps: 7
        explosion_factor: 20.0
        groups: {attention: attn, mlp: mlp}
        on_finding: stop
"""
    )
    cli = LightningCLI(TinyGPT, TinyTextDataModule, run=False, args=["--config", str(config)])
    [monitor] = [c for c in cli.trainer.callbacks if isinstance(c, GradNormMonitor)]
    assert (monitor.every_n_steps, monitor.explosion_factor, monitor.on_finding) == (7, 20.0, "stop")
    assert monitor.groups == {"attention": "attn", "mlp": "mlp"}


@pytest.mark.ddp
@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_distributed_total_matches_the_unsharded_reference(tmp_path, strategy):
    spec = {
        "strategy": strategy,
        "model": SMALL,
        "data": {"batch_size": 4},
        "trainer": {"max_steps": 4},
        "callbacks": [
            {"class_path": "tests.reference.ReferenceGradNorm"},
            {"class_path": "lightning_tfdebug.GradNormMonitor", "init_args": {"every_n_steps": 1}},
        ],
        "extra": "tests.reference:reference_results",
    }
    results = run_distributed(tmp_path, spec)
    for r in results:
        assert r["error"] is None, r["error"]
        assert r["metrics"]["grad_norm/total"] == pytest.approx(r["extra"]["grad_norm"]["3"], rel=1e-5)
        assert r["findings"]["GradNormMonitor"] == []
    assert results[0]["metrics"]["grad_norm/total"] == pytest.approx(results[1]["metrics"]["grad_norm/total"])
    blocks = [results[0]["metrics"][f"grad_norm/blocks.{i}"] for i in range(2)]
    assert all(b > 0 for b in blocks)


class FusedAdamGPT(TinyGPT):
    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3, fused=True)  # unscales inside step()


def test_gradients_still_scaled_by_amp_are_divided_by_the_scale(tmp_path):
    reference, monitor = ReferenceGradNorm(), GradNormMonitor(every_n_steps=1)
    plugin = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=2.0**10))
    fit(tmp_path, [reference, monitor], model=FusedAdamGPT(**SMALL), max_steps=2, plugins=[plugin])
    logged = dict(read_scalars(tmp_path / "tb" / "version_0")["grad_norm/total"])
    assert reference.norms[0] > 100  # what a naive hook sees: gradients times 1024
    assert logged[0] == pytest.approx(reference.norms[0] / 2.0**10, rel=1e-4)
    [finding] = [f for f in monitor.findings if f.code == "TFD305"]
    assert finding.severity == "info" and finding.evidence["loss_scale"] == 1024.0


def test_grad_norm_monitor_and_update_ratio_share_one_pass_over_the_gradients(tmp_path, monkeypatch):
    import lightning_tfdebug.core.step as step_module
    import lightning_tfdebug.functional.norms as norms_module
    from lightning_tfdebug import UpdateRatio

    passes = []  # (global step, number of tensors) of each per-tensor norm pass over gradients
    original = norms_module.per_tensor_norms

    class Counting(ReferenceGradNorm):
        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            self.step = trainer.global_step
            self.grad_ids = {id(p.grad) for p in pl_module.parameters() if p.grad is not None}
            super().on_before_optimizer_step(trainer, pl_module, optimizer)

    reference = Counting()

    def counted(tensors):
        if tensors and all(id(t) in reference.grad_ids for t in tensors):
            passes.append(reference.step)
        return original(tensors)

    monkeypatch.setattr(norms_module, "per_tensor_norms", counted)
    monkeypatch.setattr(step_module, "per_tensor_norms", counted)  # `step_norms` holds its own reference
    monitor, ratio = GradNormMonitor(every_n_steps=3), UpdateRatio(every_n_steps=3)
    fit(tmp_path, [reference, monitor, ratio], max_steps=7)
    # one pass per measuring step for both members; the values are still the reference's
    assert passes == [0, 3, 6]
    logged = dict(read_scalars(tmp_path / "tb" / "version_0")["grad_norm/total"])
    assert all(logged[s] == pytest.approx(reference.norms[s], rel=1e-5) for s in (0, 3, 6))
