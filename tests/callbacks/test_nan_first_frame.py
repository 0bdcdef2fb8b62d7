import contextlib
import io
import json
import math
import re
import warnings
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.precision import MixedPrecision
from torch import nn

from lightning_tfdebug import NaNFirstFrame, TFDebugError, TFDebugWarning, read_findings
from lightning_tfdebug.demo import TinyGPT, TinyTextDataModule
from tests.helpers import SMALL, make_trainer, read_scalars, run_distributed
from tests.helpers import fit_tiny as fit

# d_model 64: blocks.0.mlp.fc outputs reach ~0.6, so the 1e5 of bug 15 pushes them past fp16's 65504 (from step 1)
OVERFLOW = dict(d_model=64, n_layers=2, n_heads=2, overflow_module="blocks.0.mlp.fc")


def fp16():
    return MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))


def hooks_left(model: nn.Module) -> int:
    """Frame hooks still attached (the bug flags and FSDP2 add hooks of their own, which are not counted)."""
    hooks = [h for m in model.modules() for h in (*m._forward_hooks.values(), *m._backward_hooks.values())]
    return sum("FrameRecorder" in getattr(h, "__qualname__", "") for h in hooks)


class Snapshots(pl.Callback):
    """Keeps each step's batch and the weights as they were when the step started."""

    def __init__(self):
        self.batches, self.weights = {}, {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.batches[trainer.global_step] = {k: v.clone() for k, v in batch.items()}
        self.weights[trainer.global_step] = {n: p.detach().clone() for n, p in pl_module.named_parameters()}


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"mode": "always"}, "mode"),
        ({"max_frames": 0}, "max_frames"),
        ({"max_reports": -1}, "max_reports"),
        ({"check_gradients": "yes"}, "check_gradients"),
        ({"skip_nonfinite_steps": 1}, "skip_nonfinite_steps"),
        ({"on_finding": "ignore"}, "on_finding"),
    ],
)
def test_bad_arguments_fail_at_construction(kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        NaNFirstFrame(**kwargs)


def test_fp16_overflow_names_the_module_skips_the_step_and_writes_the_report(tmp_path):
    """Bug 15 in lazy mode: the first bad step is replayed; weights stay as they were before it."""
    snaps, nff = Snapshots(), NaNFirstFrame(on_finding="stop")
    model = TinyGPT(**OVERFLOW)
    trainer = fit(tmp_path, [snaps, nff], model=model, max_steps=10, plugins=[fp16()])
    [finding] = nff.findings
    assert finding.code == "TFD401" and finding.severity == "error"
    assert finding.evidence["module"] == "blocks.0.mlp.fc" and finding.evidence["ranks"] == [0]
    step = finding.step
    assert trainer.global_step == step + 1  # stopped right after the bad step
    for name, p in model.named_parameters():  # the bad step was not applied
        assert torch.equal(p.detach(), snaps.weights[step][name]), name
    report = json.loads(Path(finding.evidence["report_json"]).read_text())
    assert Path(finding.evidence["report"]).name == f"nan-step{step}-rank0.txt"
    assert (report["step"], report["rank"], report["precision"], report["mode"]) == (step, 0, "16-mixed", "lazy")
    assert report["loss_nonfinite"] and report["first_forward"]["module"] == "blocks.0.mlp.fc"
    assert report["first_forward"]["tensor"] == "output"
    last = report["forward_frames"][-1]
    assert last["module"] == "blocks.0.mlp.fc" and not last["finite"]
    labels = [e["label"] for e in last["entries"]]
    assert labels == ["weight", "bias", "input[0]", "output"]
    out = last["entries"][-1]
    assert out["dtype"] == "float16" and out["abs_max"] == "inf" and out["fp16_headroom"] is None
    before = report["forward_frames"][-2]
    assert before["finite"] and all(float(e["fp16_headroom"]) > 1 for e in before["entries"])
    assert report["first_backward"] is not None  # the overflow reaches the gradients too
    text = Path(finding.evidence["report"]).read_text()
    assert "blocks.0.mlp.fc Linear   <-- non-finite" in text and "fp16 room" in text
    assert read_findings(Path(nff.tfdebug_dir) / "findings-rank0.jsonl")[0].evidence["module"] == "blocks.0.mlp.fc"
    assert hooks_left(model) == 0  # the replay removed every hook it attached


def _hf_first_module(model: TinyGPT, batch: dict) -> str:
    """The module Hugging Face's DebugUnderflowOverflow names on the same forward (it prints, then raises)."""
    from transformers.debug_utils import DebugUnderflowOverflow

    debug = DebugUnderflowOverflow(model)
    printed = io.StringIO()
    try:
        with (
            contextlib.redirect_stdout(printed),
            pytest.raises(ValueError, match="inf/nan detected"),
            torch.autocast("cpu", dtype=torch.float16),
        ):
            model(batch["input_ids"], batch.get("attention_mask"))
    finally:
        for m in model.modules():  # DebugUnderflowOverflow keeps no handles: remove its hooks by identity
            for key, hook in list(m._forward_hooks.items()):
                if getattr(hook, "__self__", None) is debug:
                    del m._forward_hooks[key]
    frames = re.findall(r"^ {18}(\S+) (\w+)$", printed.getvalue(), re.M)
    return frames[-1][0]


def test_eager_mode_names_the_same_module_as_lazy_mode_and_hugging_face(tmp_path):
    snaps, nff = Snapshots(), NaNFirstFrame(mode="eager", on_finding="stop")
    model = TinyGPT(**OVERFLOW)
    fit(tmp_path, [snaps, nff], model=model, max_steps=10, plugins=[fp16()])
    [finding] = nff.findings
    assert finding.code == "TFD401" and finding.evidence["module"] == "blocks.0.mlp.fc"
    report = json.loads(Path(finding.evidence["report_json"]).read_text())
    assert report["mode"] == "eager" and report["first_forward"]["module"] == "blocks.0.mlp.fc"
    assert hooks_left(model) == 0  # eager hooks are gone after fit
    # same weights (the bad step was skipped), same batch: the anchor tool agrees
    model.train()
    assert _hf_first_module(model, snaps.batches[finding.step]) == "blocks.0.mlp.fc"


def test_nan_inside_a_module_in_32_bit_with_raise_writes_the_report_first(tmp_path):
    nff = NaNFirstFrame(on_finding="raise", max_frames=4)
    model = TinyGPT(nan_module="blocks.1.attn.proj", nan_at_step=3, **SMALL)
    trainer = make_trainer(tmp_path, [nff], max_steps=10)
    with warnings.catch_warnings(), pytest.raises(TFDebugError, match=r"blocks\.1\.attn\.proj") as raised:
        warnings.simplefilter("ignore", TFDebugWarning)
        trainer.fit(model, TinyTextDataModule(batch_size=8))
    [finding] = raised.value.findings
    assert finding.step == 3 and finding.evidence["module"] == "blocks.1.attn.proj"
    report = json.loads(Path(finding.evidence["report_json"]).read_text())
    assert report["loss_nonfinite"] and report["grad_nonfinite"] and report["precision"] == "32-true"
    assert len(report["forward_frames"]) == 4  # the ring: the last max_frames frames up to the first bad one
    assert [f["module"] for f in report["forward_frames"]][-2:] == ["blocks.1.attn.qkv", "blocks.1.attn.proj"]
    assert report["first_backward"]["module"] is not None
    assert hooks_left(model) == 0


def test_nan_in_the_loss_outside_any_module_is_named_as_the_training_step(tmp_path):
    """Bug 23's mechanism in one process: the model's outputs are finite, the loss is not."""
    nff = NaNFirstFrame()
    fit(tmp_path, [nff], model=TinyGPT(nan_on_rank=0, nan_at_step=2, **SMALL), max_steps=5)
    [finding] = nff.findings  # one report; the later bad steps are skipped and counted
    assert finding.code == "TFD401" and finding.step == 2
    assert finding.evidence["module"] == "training_step" and finding.evidence["backward_module"] == "head"
    assert nff.skipped_steps == 3
    assert dict(read_scalars(Path(nff._log_dir))["nan_first_frame/skipped_steps"]) == {2: 1.0, 3: 2.0, 4: 3.0}


class SideBranchGPT(TinyGPT):
    """Computes a discarded branch whose output is nan: the loss never sees it."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.side = nn.Sequential(nn.Linear(kwargs["d_model"], 4), LogOfNegative())

    def forward(self, input_ids, attention_mask=None):
        logits = super().forward(input_ids, attention_mask)
        self.side(self.tok_emb(input_ids))  # result discarded
        return logits


class LogOfNegative(nn.Module):
    def forward(self, x):
        return (x.abs() + 1).neg().log()


def test_eager_mode_finds_nan_that_never_reaches_the_loss_and_lazy_mode_stays_silent(tmp_path):
    eager, lazy = NaNFirstFrame(mode="eager"), NaNFirstFrame()
    fit(tmp_path, [eager, lazy], model=SideBranchGPT(**SMALL), max_steps=3)
    assert lazy.findings == [] and lazy.skipped_steps == 0
    [finding] = eager.findings
    assert finding.code == "TFD402" and finding.severity == "info"  # reached neither loss nor gradients
    assert finding.evidence["module"] == "side.1" and eager.skipped_steps == 0


@pytest.mark.parametrize("mode", ["lazy", "eager"])
@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed", "16-mixed"])
def test_healthy_runs_raise_nothing(tmp_path, precision, mode):
    nff = NaNFirstFrame(mode=mode)
    kwargs = {"plugins": [fp16()]} if precision == "16-mixed" else {"precision": precision}
    model = TinyGPT(**SMALL)
    fit(tmp_path, [nff], model=model, max_steps=6, **kwargs)
    assert nff.findings == [] and nff.skipped_steps == 0 and nff.reports == []
    assert hooks_left(model) == 0


class FailingReplayGPT(TinyGPT):
    """Its loss turns nan at step 2, and the replay of that step raises."""

    def training_step(self, batch, batch_idx):
        if self.trainer.global_step == 2:
            self.calls = getattr(self, "calls", 0) + 1
            if self.calls == 2:
                raise RuntimeError("replay exploded")
        loss = super().training_step(batch, batch_idx)
        return loss * float("nan") if self.trainer.global_step == 2 else loss


def test_a_failing_replay_still_removes_its_hooks_and_reports(tmp_path):
    nff = NaNFirstFrame()
    model = FailingReplayGPT(**SMALL)
    fit(tmp_path, [nff], model=model, max_steps=4)
    [finding] = nff.findings
    assert finding.code == "TFD403" and "replay exploded" in finding.message
    assert Path(finding.evidence["report"]).exists() and hooks_left(model) == 0
    assert nff.skipped_steps == 1  # the bad step was still skipped, and training went on


def test_state_survives_a_checkpoint_resume(tmp_path):
    first = NaNFirstFrame()
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True)
    model_kwargs = dict(nan_on_rank=0, nan_at_step=2, **SMALL)
    fit(tmp_path, [first, ckpt], model=TinyGPT(**model_kwargs), max_steps=4, enable_checkpointing=True)
    assert first.skipped_steps == 2 and len(first.reports) == 1
    resumed = NaNFirstFrame()
    trainer = make_trainer(tmp_path, [resumed], max_steps=5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(
            TinyGPT(**model_kwargs), TinyTextDataModule(batch_size=8), ckpt_path=str(tmp_path / "ckpt/last.ckpt")
        )
    assert resumed.skipped_steps == 3
    assert resumed.reports == first.reports and resumed.findings == []  # max_reports=1 was already used


def test_built_from_lightning_cli_yaml(tmp_path):
    from lightning.pytorch.cli import LightningCLI

    config = tmp_path / "config.yaml"
    config.write_text(
        """
trainer:
  callbacks:
    - class_path: lightning_tfdebug.NaNFirstFrame
      init_args:
        mode: eager
        on_finding: stop
        max_frames: 8
        check_gradients: false
"""
    )
    cli = LightningCLI(TinyGPT, TinyTextDataModule, run=False, args=["--config", str(config)])
    [nff] = [c for c in cli.trainer.callbacks if isinstance(c, NaNFirstFrame)]
    assert (nff.mode, nff.on_finding, nff.max_frames, nff.check_gradients) == ("eager", "stop", 8, False)


def dist_extra(trainer, model, callbacks):
    """Per rank: the reports it wrote and whether any frame hook outlived the fit."""
    [nff] = [c for c in callbacks if isinstance(c, NaNFirstFrame)]
    return {"reports": nff.reports, "skipped": nff.skipped_steps, "hooks": hooks_left(model)}


@pytest.mark.ddp
@pytest.mark.timeout(200)
@pytest.mark.parametrize(
    "strategy, on_finding, mode",
    [("ddp", "raise", "lazy"), ("fsdp2", "stop", "lazy"), pytest.param("ddp", "stop", "eager", marks=pytest.mark.slow)],
)
def test_nan_on_one_rank_stops_every_rank_at_the_same_step(tmp_path, strategy, on_finding, mode):
    """Bug 23: a module turns nan on rank 1 only. No rank hangs; every rank acts at step 3 and names rank 1."""
    spec = {
        "strategy": strategy,
        "model": {**SMALL, "nan_module": "blocks.1.mlp.fc", "nan_module_rank": 1, "nan_at_step": 3},
        "data": {"batch_size": 4},
        "trainer": {"max_steps": 8},
        "callbacks": [
            {"class_path": "lightning_tfdebug.NaNFirstFrame", "init_args": {"on_finding": on_finding, "mode": mode}}
        ],
        "extra": "tests.callbacks.test_nan_first_frame:dist_extra",
    }
    results = run_distributed(tmp_path, spec, timeout=150)
    for r in results:
        [finding] = r["findings"]["NaNFirstFrame"]
        assert finding["code"] == "TFD401" and finding["step"] == 3
        assert finding["evidence"]["module"] == "blocks.1.mlp.fc" and finding["evidence"]["module_rank"] == 1
        assert finding["evidence"]["ranks"] == [1]
        assert r["extra"]["hooks"] == 0 and len(r["extra"]["reports"]) == 1
        if on_finding == "raise":
            assert r["error"]["type"] == "TFDebugError"
        else:
            assert r["error"] is None and r["global_step"] == 4
    report = json.loads(Path(results[1]["extra"]["reports"][0]).with_suffix(".json").read_text())
    assert report["rank"] == 1 and report["first_forward"]["module"] == "blocks.1.mlp.fc"
    assert json.loads(Path(results[0]["extra"]["reports"][0]).with_suffix(".json").read_text())["first_forward"] is None


def test_a_loss_that_is_nan_while_every_module_is_finite_is_said_so(tmp_path):
    nan = NaNFirstFrame()
    fit(tmp_path, [nan], data=TinyTextDataModule(batch_size=8, all_labels_ignored=True), max_steps=2)
    first = next(f for f in nan.findings if f.code == "TFD401")
    assert "no module output held inf/nan" in first.message and "loss computed in training_step" in first.message
    assert "ignore_index" in first.hint


@pytest.mark.ddp
@pytest.mark.timeout(200)
@pytest.mark.parametrize("check_gradients", [True, False])
def test_a_nan_loss_on_one_ddp_rank_stops_every_rank_with_or_without_the_gradient_check(tmp_path, check_gradients):
    """Issue 25: under DDP the gradient check decides with no collective (the all-reduced gradients are non-finite on
    every rank when one rank's loss is); without it (check_gradients=False) a one-element all_reduce of the rank-local
    loss flag does. Either way every rank stops at step 3 and names rank 1."""
    spec = {
        "strategy": "ddp",
        "model": {**SMALL, "nan_on_rank": 1, "nan_at_step": 3},
        "data": {"batch_size": 4},
        "trainer": {"max_steps": 8},
        "callbacks": [
            {
                "class_path": "lightning_tfdebug.NaNFirstFrame",
                "init_args": {"on_finding": "stop", "check_gradients": check_gradients},
            }
        ],
        "extra": "tests.callbacks.test_nan_first_frame:dist_extra",
    }
    results = run_distributed(tmp_path, spec, timeout=150)
    for r in results:
        [finding] = r["findings"]["NaNFirstFrame"]
        assert finding["code"] == "TFD401" and finding["step"] == 3, finding
        assert finding["evidence"]["ranks"] == [1]
        assert finding["evidence"]["module"] == "training_step" and finding["evidence"]["module_rank"] == 1
        assert r["error"] is None and r["global_step"] == 4 and r["extra"]["skipped"] == 1


# ---------------------------------------------------------------- issue 25: eager mode's every-step cost
class HookCounts(pl.Callback):
    """Counts, per step, the abs ranges computed and the tensor (gradient) hooks registered up to the optimizer step,
    and how many output sums eager mode's flags held then. Listed before NaNFirstFrame, so it sees the step before
    NaNFirstFrame's check (and any replay) runs."""

    def __init__(self, nff, monkeypatch):
        import lightning_tfdebug.functional.frames as frames

        self.nff, self.calls, self.per_step, self.sums = nff, {"abs_range": 0, "register_hook": 0}, {}, {}
        abs_range, register_hook = frames.abs_range, torch.Tensor.register_hook

        def counted_abs_range(tensor):
            self.calls["abs_range"] += 1
            return abs_range(tensor)

        def counted_register_hook(tensor, hook):
            self.calls["register_hook"] += 1
            return register_hook(tensor, hook)

        monkeypatch.setattr(frames, "abs_range", counted_abs_range)
        monkeypatch.setattr(torch.Tensor, "register_hook", counted_register_hook)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.start = dict(self.calls)

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.per_step[trainer.global_step] = {k: v - self.start[k] for k, v in self.calls.items()}
        self.sums[trainer.global_step] = self.nff._flags.count()


def test_eager_healthy_steps_record_one_sum_per_output_and_no_ranges_and_a_nan_step_is_named(tmp_path, monkeypatch):
    """Healthy steps: no abs range, no gradient hook, only output sums. The NaN injected in blocks.1.attn.proj at
    step 2 is named from the step's own flags, and the replay gives the full frames (forward and backward)."""
    nff = NaNFirstFrame(mode="eager", on_finding="stop")
    counts = HookCounts(nff, monkeypatch)
    model = TinyGPT(nan_module="blocks.1.attn.proj", nan_at_step=2, **SMALL)
    fit(tmp_path, [counts, nff], model=model, max_steps=6)
    assert counts.per_step == {s: {"abs_range": 0, "register_hook": 0} for s in range(3)}
    calls = sum(1 for m in model.modules() if m is not model) + 1  # every submodule call, the root and the loss
    assert all(n >= calls - 1 for n in counts.sums.values()), (counts.sums, calls)
    assert counts.calls["abs_range"] > 0 and counts.calls["register_hook"] > 0  # the replay of step 2, only
    [finding] = nff.findings
    assert finding.code == "TFD401" and finding.step == 2 and finding.evidence["module"] == "blocks.1.attn.proj"
    report = json.loads(Path(finding.evidence["report_json"]).read_text())
    assert report["mode"] == "eager" and report["replay_reproduced"] is True
    first = report["first_forward"]
    assert (first["module"], first["source"], first["tensor"]) == ("blocks.1.attn.proj", "step", "output")
    assert next(f for f in report["forward_frames"] if f["index"] == first["index"])["module"] == first["module"]
    assert report["first_backward"] is not None and report["frames_recorded"]["backward"] > 0
    assert nff.skipped_steps == 1 and hooks_left(model) == 0


class FlakyNaNGPT(TinyGPT):
    """blocks.0.mlp.fc turns nan on the first call at step 2 only: a replay of the step does not reproduce it."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.fired = False
        self.blocks[0].mlp.fc.register_forward_hook(self._flaky)

    def _flaky(self, module, args, output):
        trainer = self._trainer
        if trainer is None or not self.training or trainer.global_step != 2 or self.fired:
            return output
        self.fired = True
        return output * float("nan")


def test_eager_names_a_nan_that_the_replay_does_not_reproduce_from_the_steps_flags(tmp_path):
    nff = NaNFirstFrame(mode="eager")
    fit(tmp_path, [nff], model=FlakyNaNGPT(**SMALL), max_steps=4)
    [finding] = nff.findings
    assert finding.code == "TFD401" and finding.step == 2 and nff.skipped_steps == 1
    assert finding.evidence["module"] == "blocks.0.mlp.fc" and finding.evidence["replay_reproduced"] is False
    assert "did not reproduce" in finding.message
    report = json.loads(Path(finding.evidence["report_json"]).read_text())
    assert report["replay_reproduced"] is False and report["replay_first_forward"] is None
    assert report["first_forward"]["module"] == "blocks.0.mlp.fc" and report["first_forward"]["source"] == "step"
    assert "did not reproduce" in Path(finding.evidence["report"]).read_text()
    lazy = NaNFirstFrame()  # lazy mode has only the replay: it cannot name the module
    fit(tmp_path / "lazy", [lazy], model=FlakyNaNGPT(**SMALL), max_steps=4)
    [finding] = lazy.findings
    assert finding.code == "TFD401" and finding.evidence["module"] != "blocks.0.mlp.fc"


class MaskedScores(nn.Module):
    def forward(self, scores, mask):
        return scores.masked_fill(mask, float("-inf"))


class MaskedScoresGPT(TinyGPT):
    """Attention-style -inf at masked positions: the module's output holds -inf, softmax turns it into 0, so the loss
    and the gradients stay finite."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.masked = MaskedScores()

    def forward(self, input_ids, attention_mask=None):
        logits = super().forward(input_ids, attention_mask)
        mask = torch.zeros_like(logits, dtype=torch.bool)
        mask[..., -1] = True
        probs = torch.softmax(self.masked(logits, mask), dim=-1)
        return logits * (1 + 0 * probs)


def test_eager_finds_a_masked_inf_that_never_reaches_the_loss_and_still_applies_the_step(tmp_path):
    snaps, nff = Snapshots(), NaNFirstFrame(mode="eager")
    fit(tmp_path, [snaps, nff], model=MaskedScoresGPT(**SMALL), max_steps=2)
    [finding] = nff.findings
    assert finding.code == "TFD402" and finding.severity == "info" and finding.step == 0
    assert finding.evidence["module"] == "masked" and finding.evidence["ranks"] == [0]
    assert nff.skipped_steps == 0
    report = json.loads(Path(finding.evidence["report_json"]).read_text())
    assert not report["loss_nonfinite"] and not report["grad_nonfinite"] and report["replay_reproduced"] is True
    frame = next(f for f in report["forward_frames"] if f["index"] == report["first_forward"]["index"])
    assert frame["module"] == "masked" and frame["entries"][-1]["abs_max"] == "inf"
    changed = [n for n, w in snaps.weights[0].items() if not torch.equal(w, snaps.weights[1][n])]
    assert changed  # the step was applied with its own gradients (the replay's were dropped)


class HugeSideGPT(TinyGPT):
    """A discarded branch whose finite output (3e38 per value) sums past float32's range: no inf, no nan."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.huge = Huge()

    def forward(self, input_ids, attention_mask=None):
        self.huge(input_ids)
        return super().forward(input_ids, attention_mask)


class Huge(nn.Module):
    def forward(self, ids):
        return torch.full((4,), 3e38)


def test_eager_does_not_report_a_finite_output_whose_sum_overflows(tmp_path):
    nff = NaNFirstFrame(mode="eager")
    fit(tmp_path, [nff], model=HugeSideGPT(**SMALL), max_steps=2)
    assert nff.findings == [] and nff.reports == [] and nff.skipped_steps == 0


class NaNConstantInLoss(TinyGPT):
    """Adds a nan constant to the loss at one micro-batch: the loss is nan, every gradient stays finite."""

    def __init__(self, bad_batch: int, **kwargs):
        super().__init__(**kwargs)
        self.bad_batch = bad_batch
        self.seen = []  # (batch_idx, the loss value Lightning got back) for every micro-batch

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        if batch_idx == self.bad_batch:
            loss = loss + torch.tensor(float("nan"))  # a constant: no gradient flows through it
        self.seen.append((batch_idx, loss.detach()))
        return loss

    def on_train_batch_end(self, outputs, batch, batch_idx):
        # the loss object Lightning hands back after the step: the check must not have written into it
        self.after = [*getattr(self, "after", []), float(outputs["loss"])]


@pytest.mark.parametrize("accumulate", [1, 20])
def test_a_nan_loss_with_finite_gradients_is_caught_in_the_fused_check_and_left_unchanged(tmp_path, accumulate):
    # one process, CPU gradients: the losses and the gradients are checked in one pass; with 20 micro-batches per
    # step the first 16 losses are folded into a flag on the way (long gradient accumulation)
    bad = 3 * accumulate + accumulate - 1  # the last micro-batch of step 3
    model = NaNConstantInLoss(bad, **SMALL)
    nff = NaNFirstFrame()
    fit(tmp_path, [nff], model=model, max_steps=5, accumulate_grad_batches=accumulate)
    [finding] = [f for f in nff.findings if f.code == "TFD401"]
    assert finding.step == 3 and nff.skipped_steps == 1
    # the values Lightning saw are the values the step computed (finite ones stay finite, the nan stays nan)
    # (the bad micro-batch appears twice: the step, then its replay)
    assert all(math.isfinite(float(v)) == (i != bad) for i, v in model.seen) and len(model.seen) > bad
    assert all(math.isfinite(v) for i, v in enumerate(model.after) if i != bad)


def test_the_fused_check_leaves_a_healthy_step_s_loss_and_gradients_bit_for_bit(tmp_path):
    nff = NaNFirstFrame()
    fit(tmp_path, [nff], max_steps=1)  # set up its parameter list on a real fit
    params = nff._finite.params
    for i, p in enumerate(params):
        p.grad = torch.randn_like(p) * 10.0 ** (i % 7 - 3)
    grads = [p.grad.clone() for p in params]
    loss = torch.tensor(2.5, requires_grad=True) * 1.0
    nff._finite.losses = [loss.detach()]
    decision = nff._finite.one_pass()
    assert decision is not None and float(decision) == 0.0
    assert all(torch.equal(p.grad, g) for p, g in zip(params, grads)) and loss.item() == 2.5
    assert loss._version == 0  # the loss was copied, not written into
    nff._finite.losses = [loss.detach(), torch.tensor(float("inf"))]
    assert float(nff._finite.one_pass()) == 1.0
