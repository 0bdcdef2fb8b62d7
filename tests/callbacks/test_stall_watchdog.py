"""StallWatchdog on real runs: a rank that hangs is named with its frame while the job still hangs, the job is then
killed with SIGKILL and ``tfdebug report`` shows the stall; a rank-zero-only barrier is named as mismatched
collectives; a blocked step and a stuck DataLoader worker in one process; healthy runs with long phases stay silent.
The rules themselves are tested with plain values in ``tests/functional/test_stall_checks.py``."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest

from lightning_tfdebug import StallWatchdog, TFDebug
from lightning_tfdebug.findings import read_findings
from tests.helpers import DIST_SCRIPT, ROOT, SMALL, fit_tiny
from tests.stall_models import StallTinyGPT, stalling_worker_data

STALL_AFTER = 2.0


# ------------------------------------------------------------------ launching a job that hangs, and killing it
class Job:
    """``tests/scripts/dist_run.py`` with ``spec`` as a process group of its own, which the test kills."""

    def __init__(self, tmp_path: Path, spec: dict[str, Any]) -> None:
        self.out = tmp_path
        spec = {"strategy": "ddp", "devices": 2, **spec, "out": str(tmp_path)}
        (tmp_path / "spec.json").write_text(json.dumps(spec))
        env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
        env.pop("LOCAL_RANK", None)
        with open(tmp_path / "job.log", "wb") as log:  # the job writes its own copy of the descriptor
            self.proc = subprocess.Popen(
                [sys.executable, str(DIST_SCRIPT), str(tmp_path / "spec.json")],
                cwd=tmp_path,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    @property
    def tfdebug_dir(self) -> Path:
        return self.out / "tb" / "version_0" / "tfdebug"

    def findings(self) -> dict[int, list[Any]]:
        found: dict[int, list[Any]] = {}
        for path in self.tfdebug_dir.glob("findings-rank*.jsonl"):
            for finding in read_findings(path):
                found.setdefault(finding.rank, []).append(finding)
        return found

    def wait_for(self, codes: set[str], ranks: tuple[int, ...], timeout: float) -> dict[int, list[Any]]:
        """Every rank of ``ranks`` has a finding with a code in ``codes`` (while the job still runs), or fail."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = self.findings()
            if all(any(f.code in codes for f in found.get(r, [])) for r in ranks):
                assert self.proc.poll() is None, "the job ended; the watchdog must report while it hangs"
                return found
            if self.proc.poll() is not None:
                break
            time.sleep(0.2)
        raise AssertionError(f"no {codes} from ranks {ranks} in {timeout} s; log:\n{self.output()[-4000:]}")

    def wait_done(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"the job did not finish in {timeout} s:\n{self.output()[-4000:]}") from None

    def kill(self) -> None:
        """SIGKILL to the whole job, as a scheduler ends a hung one."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()

    def output(self) -> str:
        return (self.out / "job.log").read_text(errors="replace")


def report(path: Path) -> str:
    """``tfdebug report <path> --verbose``'s output (the command's own entry point, in this process)."""
    import contextlib
    import io

    from lightning_tfdebug.__main__ import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        main(["report", str(path), "--verbose"])  # the messages under the headlines
    return out.getvalue()


def stalled_job(tmp_path: Path, callbacks: list[dict[str, Any]], **model: Any) -> Job:
    return Job(
        tmp_path,
        {
            "model_class": "tests.stall_models:StallTinyGPT",
            "model": {**SMALL, "marker_dir": str(tmp_path), **model},
            "data": {"batch_size": 8},
            "trainer": {"max_steps": 12},
            "callbacks": callbacks,
        },
    )


WATCHDOG = {"class_path": "lightning_tfdebug.StallWatchdog", "init_args": {"stall_after": STALL_AFTER}}


# ------------------------------------------------------------------ two ranks
@pytest.mark.ddp
def test_the_rank_that_hangs_is_named_with_its_frame_and_the_report_shows_it_after_sigkill(tmp_path):
    job = stalled_job(tmp_path, [WATCHDOG], stall_rank=1, stall_at_step=3)
    try:
        found = job.wait_for({"TFD520"}, ranks=(0, 1), timeout=120)
    finally:
        job.kill()
    for rank in (0, 1):
        [stall] = [f for f in found[rank] if f.code == "TFD520"]
        assert stall.severity == "error" and stall.step == 3, stall.format()
        assert stall.evidence["idle_s"] <= 2 * STALL_AFTER, stall.format()  # named within 2x stall_after
        assert stall.evidence["behind"] == [1], stall.format()
        # the stalled rank, its step and its frame; where the other one waits
        assert "Behind: rank 1 at step 3" in stall.message and "stall_models.py" in stall.message, stall.message
        assert "rank 0 at step 3 (backward, where DDP's gradient all-reduce" in stall.message, stall.message
    stacks = (job.tfdebug_dir / "stall-rank1.txt").read_text()
    assert "in training_step" in stacks and "in _block" in stacks and "tfdebug-stall-watchdog" in stacks
    assert "_engine_run_backward" in (job.tfdebug_dir / "stall-rank0.txt").read_text()
    assert "[TFD520] ERROR from StallWatchdog" in job.output()  # the job's log, while it hung
    text = report(tmp_path)  # after SIGKILL
    assert "TFD520" in text and "Behind: rank 1 at step 3" in text, text
    assert "stall-rank1.txt" in text, text


@pytest.mark.slow
@pytest.mark.ddp
def test_a_barrier_in_a_rank_zero_only_hook_is_named_as_mismatched_collectives(tmp_path):
    barrier = {"class_path": "tests.stall_models.RankZeroBarrier", "init_args": {"at_step": 3}}
    job = stalled_job(tmp_path, [WATCHDOG, barrier])
    try:
        found = job.wait_for({"TFD521"}, ranks=(0, 1), timeout=120)
    finally:
        job.kill()
    for rank in (0, 1):
        [mismatch] = [f for f in found[rank] if f.code == "TFD521"]
        assert "rank 0 at step 3" in mismatch.message and "a barrier (torch.distributed.barrier)" in mismatch.message
        assert "on_train_batch_end (tests/stall_models.py" in mismatch.message, mismatch.message
        # rank 1 went on to the next batch, whose first collective (Lightning's) waits for rank 0
        waits = "rank 1 at step 3 (between batches, a collective (torch.distributed.broadcast)"
        assert waits in mismatch.message, mismatch.message
        assert "_broadcast_sigterm_tensor" in mismatch.message, mismatch.message
    assert "in barrier" in (job.tfdebug_dir / "stall-rank0.txt").read_text()


@pytest.mark.slow
@pytest.mark.ddp
def test_abort_ends_the_stalled_job_with_the_stated_exit_code_after_the_report(tmp_path):
    watchdog = {**WATCHDOG, "init_args": {**WATCHDOG["init_args"], "on_stall": "abort", "abort_exit_code": 42}}
    job = stalled_job(tmp_path, [watchdog], stall_rank=1, stall_at_step=3)
    try:
        code = job.wait_done(timeout=180)
    finally:
        job.kill()
    assert code == 42  # rank 0's process: the launcher's
    assert "StallWatchdog ends rank 0 with exit status 42" in job.output()
    for rank in (0, 1):  # each rank reported before it ended
        assert any(f.code == "TFD520" for f in job.findings().get(rank, [])), job.output()[-4000:]


def test_a_store_that_cannot_be_reached_still_dumps_the_stacks_and_says_so():
    """A real TCPStore client to a port where no store listens: the rank still reports, and says why the others
    could not be read."""
    import datetime
    import socket

    from torch.distributed import TCPStore

    from lightning_tfdebug.core.watchdog import Watchdog

    with socket.socket() as probe:  # a free port, closed again: nobody listens there
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    stalls = []

    def unreachable() -> TCPStore:
        return TCPStore("127.0.0.1", port, 2, False, timeout=datetime.timedelta(seconds=1), wait_for_workers=False)

    watchdog = Watchdog(0, 2, stalls.append, stall_after=0.5, store=unreachable)
    watchdog.start()
    watchdog.mark(5, "training step")
    try:
        deadline = time.monotonic() + 15
        while not stalls and time.monotonic() < deadline:
            time.sleep(0.1)  # this (main) thread makes no progress: the watchdog fires
    finally:
        assert watchdog.stop()
    [stall] = stalls
    assert stall.others is None and stall.unreadable, stall
    assert "test_a_store_that_cannot_be_reached" in stall.stacks and "[main]" in stall.stacks
    from lightning_tfdebug.functional.stall_checks import stall_verdicts

    [verdict] = stall_verdicts(stall.own, stall.others, 2, "stall-rank0.txt", stall.unreadable)
    assert "The other ranks' progress could not be read" in verdict.message


@pytest.mark.slow
@pytest.mark.ddp
def test_healthy_ranks_with_long_validation_a_slow_checkpoint_and_a_long_first_step_stay_silent(tmp_path):
    """An explicit stall_after of 2 s still allows the phases that take long: a validation of ten 3-second batches
    (30 s), two checkpoint writes of 5 s, a first step of 6 s (a compile warm-up's stand-in)."""
    callbacks = [WATCHDOG, {"class_path": "tests.stall_models.SlowCheckpointWrite", "init_args": {"seconds": 5.0}}]
    spec = {
        "model_class": "tests.stall_models:SlowPhasesGPT",
        "model": {**SMALL, "val_batch_s": 3.0},
        "data": {"batch_size": 8},
        "trainer": {
            "max_steps": 8,
            "val_check_interval": 4,
            "limit_val_batches": 10,
            "num_sanity_val_steps": 0,
            "enable_checkpointing": True,
        },
        "callbacks": callbacks,
    }
    first = {**spec, "model_class": "tests.stall_models:StallTinyGPT", "model": {**SMALL, "first_step_s": 6.0}}
    for name, run in (("phases", spec), ("first_step", first)):
        (tmp_path / name).mkdir()
        job = Job(tmp_path / name, run)
        code = job.wait_done(timeout=300)
        job.kill()
        assert code == 0, job.output()[-4000:]
        assert job.findings() == {}, job.findings()
        assert not list(job.tfdebug_dir.glob("stall-rank*.txt"))


# ------------------------------------------------------------------ one process
def test_a_blocked_step_in_one_process_is_named_and_the_thread_ends_with_the_fit(tmp_path):
    watchdog = StallWatchdog(stall_after=1.0)
    fit_tiny(tmp_path, [watchdog], model=StallTinyGPT(**SMALL, stall_rank=0, stall_at_step=3, stall_s=2.5), max_steps=5)
    [stall] = watchdog.findings
    assert stall.code == "TFD520" and stall.step == 3, stall.format()
    assert "in _block (tests/stall_models.py" in stall.message and "training step" in stall.message, stall.message
    assert watchdog.watchdog is None
    assert not [t for t in threading.enumerate() if t.name == "tfdebug-stall-watchdog"]  # stopped at teardown
    assert (tmp_path / "tb" / "version_0" / "tfdebug" / "stall-rank0.txt").exists()


@pytest.mark.slow  # a worker process to start and a 5-second block: kept out of the default run
def test_a_stuck_dataloader_worker_is_named(tmp_path):
    pack = TFDebug(overrides={"StallWatchdog": {"stall_after": 1.5}}, summary=False, dashboard=False)
    data = stalling_worker_data(at_item=8 * 3 + 1, seconds=5.0, batch_size=8)  # the first sample of batch 4
    fit_tiny(tmp_path, [pack], data=data, max_steps=6)
    stalls = [f for f in pack.findings if f.code == "TFD520"]
    assert len(stalls) == 1, [f.format() for f in pack.findings]
    assert "waiting for a batch from the DataLoader's worker processes" in stalls[0].message, stalls[0].message
    assert stalls[0].evidence["phase"] == "between batches"
    assert not [t for t in threading.enumerate() if t.name == "tfdebug-stall-watchdog"]


def test_a_second_fit_with_the_same_callback_starts_a_fresh_watchdog(tmp_path):
    watchdog = StallWatchdog()
    for run in ("a", "b"):
        fit_tiny(tmp_path / run, [watchdog], max_steps=3)
        assert watchdog.watchdog is None and watchdog.findings == []
    assert not [t for t in threading.enumerate() if t.name == "tfdebug-stall-watchdog"]


def test_arguments_are_checked_at_construction():
    with pytest.raises(ValueError, match="stall_after"):
        StallWatchdog(stall_after=0)
    with pytest.raises(ValueError, match="on_stall"):
        StallWatchdog(on_stall="kill")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="abort_exit_code"):
        StallWatchdog(abort_exit_code=0)


class RaisingGPT(StallTinyGPT):
    def training_step(self, batch: Any, batch_idx: int) -> Any:
        if self.global_step == 2:
            raise RuntimeError("the user's step failed")
        return super().training_step(batch, batch_idx)


def test_the_thread_stops_when_the_fit_raises(tmp_path):
    watchdog = StallWatchdog(stall_after=30.0)
    with pytest.raises(RuntimeError, match="the user's step failed"):
        fit_tiny(tmp_path, [watchdog], model=RaisingGPT(**SMALL), max_steps=5)
    assert watchdog.watchdog is None and watchdog.findings == []
    assert not [t for t in threading.enumerate() if t.name == "tfdebug-stall-watchdog"]


# ------------------------------------------------------------------ bug-zoo row 48 on the bug matrix's families
ROW48_MODELS = {
    "encoder_lm": ("tests.stall_models:StallEncoderLM", {}),
    "gpt2": ("tests.stall_models:StallHFLM", {"family": "gpt2"}),
    "tinygpt": ("tests.stall_models:StallBugTinyGPT", {}),
}


@pytest.mark.slow
@pytest.mark.ddp
@pytest.mark.parametrize("family", sorted(ROW48_MODELS))
def test_row48_one_rank_stalls_under_the_whole_pack(tmp_path, family):
    """Bug-zoo row 48 in the bug matrix's style (its harness waits for a run to end, so a hang is tested here): the
    whole pack, every callback at its defaults but ``stall_after``, rank 1 blocked in ``training_step`` at step 3.
    Every rank names rank 1 behind, within 2x ``stall_after``; the report shows it after SIGKILL."""
    pytest.importorskip("transformers")
    from tests.healthy_models import PACK_NAMES

    model_class, model = ROW48_MODELS[family]
    callbacks = [{"class_path": f"lightning_tfdebug.{name}"} for name in PACK_NAMES if name != "StallWatchdog"]
    job = Job(
        tmp_path,
        {
            "model_class": model_class,
            "model": {**model, "stall_rank": 1, "stall_at_step": 3},
            "data": {"batch_size": 8},
            "trainer": {"max_steps": 12},
            "callbacks": [*callbacks, WATCHDOG],
        },
    )
    try:
        found = job.wait_for({"TFD520"}, ranks=(0, 1), timeout=240)
    finally:
        job.kill()
    for rank in (0, 1):
        [stall] = [f for f in found[rank] if f.code == "TFD520"]
        assert stall.evidence["behind"] == [1] and stall.step == 3, stall.format()
        assert stall.evidence["idle_s"] <= 2 * STALL_AFTER, stall.format()
        assert "Behind: rank 1 at step 3 (training step, in _block (tests/stall_models.py" in stall.message
    assert "Behind: rank 1 at step 3" in report(tmp_path)


@pytest.mark.slow
@pytest.mark.ddp
def test_it_runs_no_collective_at_all(tmp_path):
    """Every collective called from Python on each rank of a real 2-rank DDP fit, from set-up to the end (the counter
    of ``tests/test_collectives.py``): none on any step; at set-up only the one every member of the pack shares
    (``DebugCallback.setup`` reads ``trainer.log_dir``, a broadcast from rank 0). Its thread talks to the store only."""
    from tests.test_collectives import count_collectives, pack_calls

    ranks = count_collectives(tmp_path, 2, [WATCHDOG], steps=12)
    for calls in ranks:
        ours = {step: pack_calls(made) for step, made in calls.items() if pack_calls(made)}
        assert ours == {"setup": ["broadcast_object_list <- base.py"]}, calls
        assert any("_broadcast_sigterm_tensor" in c for made in calls.values() for c in made)  # the counter counts


def test_library_files_are_told_from_the_users():
    import torch

    from lightning_tfdebug.core.watchdog import library_file

    assert (
        library_file(torch.__file__) and library_file(threading.__file__) and library_file(__import__("json").__file__)
    )
    assert library_file("<frozen importlib._bootstrap>")
    assert not library_file(__file__)  # the user's code (here: this test)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_compile_warm_up_and_a_recompilation_mid_run_stay_silent(tmp_path):
    """A compiled forward (inductor, CPU: seconds per compile here, minutes on a large model) with an explicit
    ``stall_after`` of 1 s: the first step compiles, and step 4 compiles again (shorter batches). The stack inside
    torch._dynamo / torch._inductor earns the compile allowance, so the watchdog stays silent; its thread looked."""
    import torch._dynamo
    import torch._functorch.config
    import torch._inductor.config

    from tests.stall_models import RecompilingGPT

    torch._dynamo.reset()
    watchdog = StallWatchdog(stall_after=1.0)
    seconds: list[float] = []
    with torch._inductor.config.patch(fx_graph_cache=False), torch._functorch.config.patch(enable_autograd_cache=False):
        # no compile cache from an earlier run: each compile takes as long as it would the first time
        fit_tiny(tmp_path, [watchdog, BatchSeconds(seconds)], model=RecompilingGPT(**SMALL), max_steps=7)
    print("batch seconds:", [round(s, 2) for s in seconds])
    assert watchdog.findings == [], [f.format() for f in watchdog.findings]
    # both compiles kept the loop still longer than stall_after: only the compile allowance kept the watchdog quiet
    assert seconds[0] > 1.0 and seconds[4] > 1.0, seconds


class BatchSeconds(pl.Callback):
    """Each training batch's duration, from its start to its end."""

    def __init__(self, out: list[float]) -> None:
        self.out, self.start = out, 0.0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.start = time.monotonic()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.out.append(time.monotonic() - self.start)


@pytest.mark.slow
@pytest.mark.ddp
def test_under_ddp_the_thread_ends_with_the_fit_and_leaves_no_store_key(tmp_path):
    from tests.helpers import run_distributed

    spec = {
        "strategy": "ddp",
        "model": dict(SMALL),
        "data": {"batch_size": 8},
        "trainer": {"max_steps": 6},
        "callbacks": [{"class_path": "lightning_tfdebug.StallWatchdog", "init_args": {"stall_after": 2.0}}],
        "extra": "tests.stall_models:store_keys_left",
    }
    for result in run_distributed(tmp_path, spec):
        assert result["error"] is None, result["error"]
        assert result["extra"] == {"keys_left": [], "threads": [], "watchdog": [False]}, result["extra"]
        assert result["findings"] == {"StallWatchdog": []}  # stall_after 2 s on steps of a few ms: silent


def test_a_running_profiler_is_seen_from_the_watchdog_thread():
    """The profiler's allowance needs to know that a profiler records: asked from another thread, as the watchdog
    does."""
    import torch

    from lightning_tfdebug.core.watchdog import profiler_running

    def ask() -> bool:
        seen: list[bool] = []
        thread = threading.Thread(target=lambda: seen.append(profiler_running()))
        thread.start()
        thread.join()
        return seen[0]

    assert not ask()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
        assert ask()
    assert not ask()
