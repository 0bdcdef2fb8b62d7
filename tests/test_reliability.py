"""Reliability: the pack never takes a run down, and loses nothing (issue 16).

* one writer (``core/io.py``): a refused write warns once and training goes on, findings kept in memory;
* tolerant readers: a cut last line, a file appended to while read;
* one guard around every hook: a callback's own exception is reported once and the callback stands aside;
* repro bundles carry the optimizer and LR-scheduler state, so a failure that depends on them replays.
"""

from __future__ import annotations

import errno
import json
import os
import threading
import time
import warnings
from pathlib import Path

import pytest

from lightning_tfdebug import (
    DebugCallback,
    NaNFirstFrame,
    PerRankLogger,
    ReproCapture,
    TFDebugError,
    TFDebugWarning,
    ThroughputMonitor,
    read_findings,
)
from lightning_tfdebug.core import io
from lightning_tfdebug.core.io import append_finding
from lightning_tfdebug.demo import TinyGPT, TinyTextDataModule
from lightning_tfdebug.findings import Finding
from lightning_tfdebug.repro import load_bundle, replay
from tests.core.emitters import StepEmitter
from tests.helpers import SMALL, make_trainer, run_distributed


def fit_collecting_warnings(tmp_path: Path, callbacks: list, model=None, data=None, **kwargs):
    """Fit the tiny transformer and return (trainer, the TFDebugWarnings raised)."""
    trainer = make_trainer(tmp_path, callbacks, **kwargs)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", TFDebugWarning)
        trainer.fit(model or TinyGPT(**SMALL), data or TinyTextDataModule(batch_size=8))
    return trainer, [str(w.message) for w in caught if issubclass(w.category, TFDebugWarning)]


def tfdebug_dir(tmp_path: Path) -> Path:
    return tmp_path / "tb" / "version_0" / "tfdebug"


# ------------------------------------------------------------------ 1. one writer
def test_a_file_in_place_of_the_tfdebug_directory_never_stops_training(tmp_path):
    """Findings, a NaN report, a profile, per-rank records and run.json all refused: one warning, the run finishes."""
    blocker = tfdebug_dir(tmp_path)
    blocker.parent.mkdir(parents=True)
    blocker.write_text("not a directory")
    before = len(io.write_failures())
    emitter, nff = StepEmitter(at_step=2), NaNFirstFrame()
    callbacks = [emitter, nff, PerRankLogger(), ReproCapture(), ThroughputMonitor(profile_steps=[1, 2])]
    model = TinyGPT(**SMALL, nan_on_rank=0, nan_at_step=4)
    trainer, messages = fit_collecting_warnings(tmp_path, callbacks, model=model, max_steps=6)
    assert trainer.global_step == 6 and trainer.state.finished
    assert [f.code for f in emitter.findings] == ["TFD399"]  # kept in memory
    assert [f.code for f in nff.findings] == ["TFD401"]
    refused = [m for m in messages if "could not write" in m]
    assert len(refused) == 1 and str(blocker) in refused[0]
    failed = {Path(f.path).name for f in io.write_failures()[before:]}
    assert {"findings-rank0.jsonl", "run.json", "nan-step4-rank0.txt", "rank0.pt.trace.json"} <= failed
    assert all("FileExistsError" in f.error or "NotADirectoryError" in f.error for f in io.write_failures()[before:])
    assert blocker.read_text() == "not a directory"
    # the findings still reached TensorBoard text (the logger's own directory is writable)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tmp_path / "tb" / "version_0"), size_guidance={"tensors": 0})
    acc.Reload()
    assert {"tfdebug/TFD399/text_summary", "tfdebug/TFD401/text_summary"} <= set(acc.Tags()["tensors"])


def test_a_full_disk_enospc_never_stops_training(tmp_path):
    """Appends that hit a real ENOSPC (the files are links to /dev/full): the run finishes, the finding is kept."""
    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full here")
    directory = tfdebug_dir(tmp_path)
    directory.mkdir(parents=True)
    (directory / "findings-rank0.jsonl").symlink_to("/dev/full")
    (directory / "rank0.jsonl").symlink_to("/dev/full")
    before = len(io.write_failures())
    emitter = StepEmitter(at_step=2)
    trainer, messages = fit_collecting_warnings(tmp_path, [emitter, PerRankLogger()], max_steps=4)
    assert trainer.global_step == 4
    assert [f.code for f in emitter.findings] == ["TFD399"]
    errors = [f.error for f in io.write_failures()[before:]]
    assert errors and all(os.strerror(errno.ENOSPC) in e for e in errors)
    assert sum("could not write" in m for m in messages) == 1


def test_the_pack_with_a_file_in_place_of_its_directory_finishes_and_still_summarizes(tmp_path, capsys):
    """The pack's own files (pack.json, the dashboard's event) go through the one writer: one warning for the whole
    run, and the end-of-fit summary is made from the findings held in memory."""
    from lightning_tfdebug import TFDebug

    blocker = tfdebug_dir(tmp_path)
    blocker.parent.mkdir(parents=True)
    blocker.write_text("not a directory")
    before = len(io.write_failures())
    pack = TFDebug(every_n_steps=2, labels_key="targets")  # LossAtInit stands aside: its record is refused too
    trainer, messages = fit_collecting_warnings(tmp_path, [pack], max_steps=4)
    assert trainer.state.finished and not pack.members["LossAtInit"].active
    assert sum("could not write" in m for m in messages) == 1
    failed = {Path(f.path).name for f in io.write_failures()[before:]}
    assert {"pack.json", "stood-aside-rank0.jsonl", "findings-rank0.jsonl"} <= failed
    summary = capsys.readouterr().out
    assert "lightning_tfdebug: " in summary and "1 check did not run" in summary and "LossAtInit" in summary


def test_a_dashboard_the_disk_refuses_warns_once_and_training_goes_on(tmp_path, monkeypatch):
    from torch.utils.tensorboard import SummaryWriter

    from lightning_tfdebug import TFDebug

    def full_disk(self, layout):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(SummaryWriter, "add_custom_scalars", full_disk)  # the disk, not the code under test
    before = len(io.write_failures())
    trainer, messages = fit_collecting_warnings(tmp_path, [TFDebug(every_n_steps=2, summary=False)], max_steps=2)
    assert trainer.state.finished
    assert [m for m in messages if "could not write" in m and "No space left" in m]
    assert any("No space left" in f.error for f in io.write_failures()[before:])


def test_atomic_writes_that_hit_enospc_leave_nothing_behind(tmp_path):
    def full_disk(_tmp):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    with pytest.warns(TFDebugWarning, match="No space left on device"):
        assert io.write_atomic(tmp_path / "tfdebug" / "report.json", full_disk) is False
    assert io.publish_dir(full_disk, tmp_path / "tfdebug" / "repro", "step1-rank0") is None  # same scope: no warning
    assert io.write_text(tmp_path / "tfdebug" / "ok.txt", "fine") is True
    assert sorted(p.name for p in (tmp_path / "tfdebug").rglob("*")) == ["ok.txt", "repro"]  # no temporary left
    assert (tmp_path / "tfdebug" / "ok.txt").read_text() == "fine"


def test_a_bug_in_what_is_written_is_not_hidden_as_a_disk_failure(tmp_path):
    def bug(_tmp):
        raise TypeError("not serialisable")

    with pytest.raises(TypeError, match="not serialisable"):
        io.write_atomic(tmp_path / "x.json", bug)
    assert list(tmp_path.iterdir()) == []


def test_a_bundle_the_disk_refuses_never_masks_the_training_exception(tmp_path, monkeypatch):
    import lightning_tfdebug.repro.bundles as repro

    def full_disk(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(repro, "_save", full_disk)  # the bundle's first .pt file hits a full disk
    capture = ReproCapture()
    data = TinyTextDataModule(batch_size=8, long_batch_every=2)  # a batch past the context limit: IndexError
    with pytest.raises(IndexError):
        fit_collecting_warnings(tmp_path, [capture], data=data, max_steps=3)
    assert [f.code for f in capture.findings] == ["TFD131"] and capture.bundles == []
    assert "No space left on device" in capture.findings[0].message
    assert not list((tfdebug_dir(tmp_path) / "repro").iterdir())  # the half-built bundle was removed


# ------------------------------------------------------------------ 2. tolerant readers
def _finding(step: int) -> Finding:
    return Finding("TFD399", "warning", "StepEmitter", step, 0, "test finding.", {"step": step})


def test_read_findings_skips_a_cut_last_line_with_a_warning(tmp_path):
    path = tmp_path / "findings-rank0.jsonl"
    append_finding(path, _finding(1))
    append_finding(path, _finding(2))
    with open(path, "a") as f:  # the process was killed in the middle of the third line
        f.write(_finding(3).to_json()[:40])
    with pytest.warns(TFDebugWarning, match=r"skipped 1 unreadable line\(s\): line 3 \(the last, cut off"):
        back = read_findings(path)
    assert [f.step for f in back] == [1, 2]
    with pytest.raises(ValueError, match="line 3"):
        read_findings(path, strict=True)


def test_read_findings_while_another_thread_appends(tmp_path):
    path = tmp_path / "findings-rank0.jsonl"
    append_finding(path, _finding(0))
    done = threading.Event()

    def writer():
        for step in range(1, 300):
            with open(path, "a") as f:  # two writes per line: a reader can land between them
                line = _finding(step).to_json()
                f.write(line[:25])
                f.flush()
                f.write(line[25:] + "\n")
        done.set()

    thread = threading.Thread(target=writer)
    thread.start()
    seen = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", TFDebugWarning)  # a read landing mid-line skips that line
        while not done.is_set():
            steps = [f.step for f in read_findings(path)]
            assert steps == list(range(len(steps)))  # always a prefix, in order, never an exception
            seen.append(len(steps))
    thread.join()
    assert [f.step for f in read_findings(path)] == list(range(300))
    assert seen and seen == sorted(seen)


# ------------------------------------------------------------------ 3. one guard
class Broken(DebugCallback):
    """A callback whose own code fails at ``at_step``; counts the hooks it runs."""

    def __init__(self, at_step: int = 2, **kwargs):
        super().__init__(**kwargs)
        self.at_step = at_step
        self.calls = {"batch_end": 0, "teardown": 0}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.calls["batch_end"] += 1
        if trainer.global_step == self.at_step:
            {}["missing"]  # a bug in the callback

    def teardown(self, trainer, pl_module, stage):
        super().teardown(trainer, pl_module, stage)
        self.calls["teardown"] += 1


def test_a_callbacks_own_exception_is_reported_once_and_the_run_goes_on(tmp_path):
    broken, emitter = Broken(at_step=2), StepEmitter(at_step=4)
    trainer, messages = fit_collecting_warnings(tmp_path, [broken, emitter], max_steps=6)
    assert trainer.global_step == 6 and trainer.state.finished
    assert broken.calls == {"batch_end": 2, "teardown": 1}  # stood aside after the failure; clean-up still ran
    assert broken.failure["hook"] == "on_train_batch_end" and broken.failure["step"] == 2
    assert not broken.active and [f.code for f in emitter.findings] == ["TFD399"]  # the others carry on
    [message] = [m for m in messages if "Broken failed" in m]
    assert "KeyError" in message and "training continues" in message
    report = (tfdebug_dir(tmp_path) / "callback-errors-rank0.txt").read_text()
    assert report.startswith("=== Broken.on_train_batch_end at step 2 (rank 0)")
    assert 'test_reliability.py", line' in report and "KeyError: 'missing'" in report


def test_a_tfdebug_error_raised_on_purpose_passes_the_guard(tmp_path):
    emitter = StepEmitter(at_step=2, on_finding="raise")
    with pytest.raises(TFDebugError, match="TFD399"):
        fit_collecting_warnings(tmp_path, [emitter], max_steps=6)
    assert emitter.failure is None


def test_the_guard_wraps_every_hook_a_subclass_defines_once():
    from lightning_tfdebug import GradNormMonitor

    for cls in (Broken, GradNormMonitor, DebugCallback):
        for name in ("setup", "on_train_batch_end", "teardown"):
            hook = cls.__dict__.get(name)
            if hook is not None:
                assert hook._tfdebug_guarded and not getattr(hook.__wrapped__, "_tfdebug_guarded", False)


@pytest.mark.slow
def test_ddp_a_failure_on_one_rank_ends_the_run_instead_of_hanging(tmp_path):
    spec = {
        "strategy": "ddp",
        "callbacks": [
            {"class_path": "tests.test_reliability.BrokenOnRank", "init_args": {"rank": 1, "at_step": 2}},
            {"class_path": "lightning_tfdebug.GradNormMonitor", "init_args": {}},
        ],
        "trainer": {"max_steps": 6},
    }
    start = time.perf_counter()
    results = run_distributed(tmp_path, spec, timeout=180)  # a hang fails here
    errors = {r["rank"]: r.get("error") or {} for r in results}
    print(f"ended in {time.perf_counter() - start:.1f} s; rank 0: {errors[0].get('type')}: {errors[0].get('message')}")
    assert (
        errors[1]["type"] == "TFDebugCallbackError" and "cannot stand aside on this rank alone" in errors[1]["message"]
    )
    assert errors[0], "rank 0 must end too (its next collective fails once rank 1 is gone), not train on alone"
    assert (tmp_path / "tb" / "version_0" / "tfdebug" / "callback-errors-rank1.txt").exists()


class BrokenOnRank(Broken):
    def __init__(self, rank: int = 1, at_step: int = 2):
        super().__init__(at_step=at_step)
        self.rank = rank

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_rank == self.rank and trainer.global_step == self.at_step:
            raise ZeroDivisionError("a bug on one rank")


# ------------------------------------------------------------------ 5. bundles replay optimizer and scheduler state
class FailsOnLateState(TinyGPT):
    """Fails only once Adam has taken three steps and the LR schedule is past its third step: a replay that starts
    the optimizer and the scheduler fresh does not reproduce it."""

    def training_step(self, batch, batch_idx):
        optimizer = self.trainer.optimizers[0]
        adam_steps = max((int(s["step"]) for s in optimizer.state.values() if "step" in s), default=0)
        schedule = self.trainer.lr_scheduler_configs[0].scheduler.last_epoch
        if adam_steps >= 3 and schedule >= 3:
            raise RuntimeError(f"late-state failure: adam step {adam_steps}, schedule {schedule}")
        return super().training_step(batch, batch_idx)


def test_a_failure_that_depends_on_optimizer_and_scheduler_state_replays(tmp_path):
    capture = ReproCapture()
    with pytest.raises(RuntimeError, match="late-state failure"):
        fit_collecting_warnings(tmp_path, [capture], model=FailsOnLateState(**SMALL), max_steps=8)
    [path] = capture.bundles
    bundle = load_bundle(path)
    assert bundle.meta["training_state"]["saved"]
    assert bundle.training_state["lr_schedulers"][0]["last_epoch"] == 3
    result = replay(bundle, FailsOnLateState(**SMALL))
    assert result.reproduced, result.traceback
    fresh = replay(bundle, FailsOnLateState(**SMALL), load_state=False)  # without the state it does not fail
    assert fresh.exception is None
    assert json.loads((Path(path) / "bundle.json").read_text())["files"]["training.pt"]


def test_the_optimizer_state_is_left_out_with_the_model_state(tmp_path):
    capture = ReproCapture(max_state_mb=0)
    with pytest.raises(RuntimeError, match="late-state failure"):
        fit_collecting_warnings(tmp_path, [capture], model=FailsOnLateState(**SMALL), max_steps=8)
    bundle = load_bundle(capture.bundles[0])
    assert bundle.training_state is None and bundle.meta["training_state"]["saved"] is False
