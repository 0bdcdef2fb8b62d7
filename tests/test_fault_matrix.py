"""The fault matrix (issue 16, part 4): real multi-process runs (gloo, CPU) in which something goes wrong on one rank
or on every rank, and every run must end, with the documented outcome, within a bounded time.

* non-finite values (a module's output turns nan at step 3) on rank 1 only or on every rank, under DDP and FSDP2
  (``ModelParallelStrategy``, ``fully_shard`` in ``TinyGPT.configure_model``), with ``on_finding`` "stop" and
  "raise", NaNFirstFrame in lazy and eager mode: every rank acts at step 3 (stop: the fit ends at step 4; raise:
  ``TFDebugError`` on every rank), every rank's report and findings file are complete on disk;
* a rank killed mid-run (``SIGKILL`` on rank 1 at step 3): the other rank ends within the time limit with an error,
  its findings and ``pack.json`` are valid files and the pack's summary names the lost peer;
* an FSDP2 lazy replay that fails on rank 1 only: every rank ends (no hang), rank 1's report records the failure.

The default run holds one case of each kind (about 60 s); ``-m slow`` runs the whole matrix, each case
``TFDEBUG_FAULT_REPEATS`` times (default 10). The figures are in ``docs/reliability.md``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from lightning_tfdebug.demo import TinyGPT
from lightning_tfdebug.findings import read_findings
from tests.helpers import DIST_SCRIPT, ROOT, SMALL

LIMIT_S = 150  # a run that has not ended by then hung: its process group is killed and the test fails
REPEATS = int(os.environ.get("TFDEBUG_FAULT_REPEATS", "10"))
NAN_STEP = 3


def run_ranks(tmp_path: Path, spec: dict[str, Any], timeout: float = LIMIT_S) -> tuple[dict[int, dict], str, float]:
    """Run ``tests/scripts/dist_run.py`` on 2 gloo processes; return the result of every rank that wrote one (a
    killed rank writes none), the output, and the wall time. A run still going after ``timeout`` fails the test."""
    spec = {"devices": 2, **spec, "out": str(tmp_path)}
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env.pop("LOCAL_RANK", None)
    start = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, str(DIST_SCRIPT), str(tmp_path / "spec.json")],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        raise AssertionError(f"the run hung for {timeout} s:\n{output.decode()[-4000:]}") from None
    wall = time.perf_counter() - start
    with_results = {}
    for rank in range(spec["devices"]):
        path = tmp_path / f"result-rank{rank}.json"
        if path.exists():
            with_results[rank] = json.loads(path.read_text())
    return with_results, output.decode(), wall


def tfdebug_dir(tmp_path: Path) -> Path:
    return tmp_path / "tb" / "version_0" / "tfdebug"


def nan_extra(trainer, model, callbacks) -> dict[str, Any]:
    from lightning_tfdebug import NaNFirstFrame

    [nff] = [c for c in callbacks if isinstance(c, NaNFirstFrame)]
    return {"reports": nff.reports}


# ------------------------------------------------------------------ non-finite values x strategy x action x mode
MATRIX = [
    (strategy, on_finding, mode, where)
    for strategy in ("ddp", "fsdp2")
    for on_finding in ("stop", "raise")
    for mode in ("lazy", "eager")
    for where in ("rank1", "every rank")
]
DEFAULT_CASE = ("fsdp2", "raise", "eager", "rank1")  # the one the per-callback tests do not already run


def check_nan_case(tmp_path: Path, strategy: str, on_finding: str, mode: str, where: str) -> float:
    spec = {
        "strategy": strategy,
        "model": {
            **SMALL,
            "nan_module": "blocks.1.mlp.fc",
            "nan_module_rank": 1 if where == "rank1" else None,
            "nan_at_step": NAN_STEP,
        },
        "data": {"batch_size": 4},
        "trainer": {"max_steps": 8},
        "callbacks": [
            {"class_path": "lightning_tfdebug.NaNFirstFrame", "init_args": {"on_finding": on_finding, "mode": mode}},
            {"class_path": "lightning_tfdebug.GradNormMonitor", "init_args": {"on_finding": on_finding}},
        ],
        "extra": "tests.test_fault_matrix:nan_extra",
    }
    results, output, wall = run_ranks(tmp_path, spec)
    assert set(results) == {0, 1}, f"a rank wrote no result:\n{output[-4000:]}"
    bad = [1] if where == "rank1" else [0, 1]
    for rank, r in results.items():
        [finding] = [f for f in r["findings"]["NaNFirstFrame"] if f["code"] == "TFD401"]
        assert finding["step"] == NAN_STEP, (rank, finding)  # every rank acts at the same step
        assert finding["evidence"]["ranks"] == bad
        if on_finding == "raise":
            assert r["error"] and r["error"]["type"] == "TFDebugError", (rank, r["error"])
        else:
            assert r["error"] is None and r["global_step"] == NAN_STEP + 1, (rank, r["error"], r["global_step"])
        # reports complete on disk: the NaN report (both forms) and a findings file every line of which reads back
        [report] = r["extra"]["reports"]
        assert Path(report).is_file() and Path(report).stat().st_size > 0
        summary = json.loads(Path(report).with_suffix(".json").read_text())
        assert summary["step"] == NAN_STEP and summary["rank"] == rank and summary["nonfinite_ranks"] == bad
        codes = [f.code for f in read_findings(tfdebug_dir(tmp_path) / f"findings-rank{rank}.jsonl", strict=True)]
        assert "TFD401" in codes
    if where == "rank1":
        first = json.loads(Path(results[1]["extra"]["reports"][0]).with_suffix(".json").read_text())["first_forward"]
        assert first and first["module"] == "blocks.1.mlp.fc"
    return wall


@pytest.mark.ddp
@pytest.mark.timeout(LIMIT_S + 30)
def test_nan_on_one_rank_fsdp2_raise_eager(tmp_path):
    """The default run's case of the matrix: FSDP2, raise, eager frame hooks, nan on rank 1 only."""
    wall = check_nan_case(tmp_path, *DEFAULT_CASE)
    print(f"fault matrix {DEFAULT_CASE}: ended in {wall:.1f} s")


@pytest.mark.slow
@pytest.mark.timeout(LIMIT_S + 30)
@pytest.mark.parametrize("repeat", range(REPEATS))
@pytest.mark.parametrize("strategy, on_finding, mode, where", MATRIX)
def test_nan_fault_matrix(tmp_path, strategy, on_finding, mode, where, repeat):
    wall = check_nan_case(tmp_path, strategy, on_finding, mode, where)
    print(f"fault matrix ({strategy}, {on_finding}, {mode}, {where}) #{repeat}: ended in {wall:.1f} s")


# ------------------------------------------------------------------ a rank killed mid-run
class KilledOnRank1(TinyGPT):
    """Rank 1 is killed (SIGKILL: no handler, no clean-up, as the OOM killer or a lost node does) at step 3."""

    def training_step(self, batch, batch_idx):
        if self.trainer.global_rank == 1 and self.trainer.global_step == NAN_STEP:
            os.kill(os.getpid(), signal.SIGKILL)
        return super().training_step(batch, batch_idx)


def check_killed_rank(tmp_path: Path, strategy: str) -> float:
    spec = {
        "strategy": strategy,
        "model_class": "tests.test_fault_matrix:KilledOnRank1",
        "model": dict(SMALL),
        "data": {"batch_size": 4},
        "trainer": {"max_steps": 8},
        "callbacks": [{"class_path": "lightning_tfdebug.TFDebug", "init_args": {"every_n_steps": 1}}],
    }
    results, output, wall = run_ranks(tmp_path, spec)  # ended within LIMIT_S, or the test failed as a hang
    assert 1 not in results, "rank 1 was killed: it cannot have written a result"
    # Rank 0 ends one of two ways, whichever comes first: its next collective fails (gloo: "Connection reset by
    # peer") and the fit raises; or Lightning's launcher, which watches the rank processes it started, sees rank 1
    # die and kills the whole group ("Child process ... terminated with code -9. Forcefully terminating all other
    # processes"), sometimes before rank 0 has written its result file.
    observer = "Forcefully terminating all other processes" in output
    assert 0 in results or observer, f"rank 0 neither ended with an error nor was ended:\n{output[-4000:]}"
    if 0 in results:
        error = results[0]["error"]
        assert error, "rank 0 must end with an error, not train on alone"
        assert results[0]["global_step"] <= NAN_STEP + 1
        # the summary printed on rank 0 says what the low-level error means
        assert "another rank" in output and "stopped answering" in output, output[-3000:]
        print(f"rank 0: {error['type']}: {error['message'][:200]}")
    else:
        print("rank 0 was ended by Lightning's launcher before it wrote its result")
    # the files rank 0 leaves are valid whichever way it ended: the findings read back strictly, and pack.json
    # (written atomically: complete or absent) records the failure
    findings = tfdebug_dir(tmp_path) / "findings-rank0.jsonl"
    if findings.exists():
        read_findings(findings, strict=True)
    pack_file = tfdebug_dir(tmp_path) / "pack.json"
    if 0 in results or pack_file.exists():
        pack = json.loads(pack_file.read_text())
        assert pack["failed"] and pack["step"] <= NAN_STEP + 1
    return wall


@pytest.mark.ddp
@pytest.mark.timeout(LIMIT_S + 30)
def test_a_killed_rank_ends_the_other_ddp(tmp_path):
    wall = check_killed_rank(tmp_path, "ddp")
    print(f"killed rank, ddp: rank 0 ended in {wall:.1f} s")


@pytest.mark.slow
@pytest.mark.timeout(LIMIT_S + 30)
@pytest.mark.parametrize("repeat", range(REPEATS))
@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_a_killed_rank_repeated(tmp_path, strategy, repeat):
    wall = check_killed_rank(tmp_path, strategy)
    print(f"killed rank, {strategy} #{repeat}: rank 0 ended in {wall:.1f} s")


# ------------------------------------------------------------------ an FSDP2 replay that fails on one rank only
class ReplayFailsOnRank1(TinyGPT):
    """Rank 1's loss turns nan at step 3; when NaNFirstFrame replays that step (a second training_step call at the
    same step), rank 1's replay raises inside the second block's forward, between FSDP2's all-gathers."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self._calls: dict[int, int] = {}
        self.blocks[1].register_forward_pre_hook(self._fail_in_replay)

    def _fail_in_replay(self, module, args):
        trainer = self._trainer
        if trainer is None or trainer.global_rank != 1 or trainer.global_step != NAN_STEP:
            return None
        if self._calls.get(NAN_STEP, 0) >= 2:
            raise RuntimeError("the replay fails on rank 1 only")
        return None

    def training_step(self, batch, batch_idx):
        step = self.trainer.global_step
        self._calls[step] = self._calls.get(step, 0) + 1
        return super().training_step(batch, batch_idx)


def check_replay_fails_on_one_rank(tmp_path: Path) -> float:
    spec = {
        "strategy": "fsdp2",
        "model_class": "tests.test_fault_matrix:ReplayFailsOnRank1",
        "model": {**SMALL, "nan_on_rank": 1, "nan_at_step": NAN_STEP},
        "data": {"batch_size": 4},
        "trainer": {"max_steps": 8},
        "callbacks": [{"class_path": "lightning_tfdebug.NaNFirstFrame", "init_args": {"on_finding": "warn"}}],
    }
    results, output, wall = run_ranks(tmp_path, spec)
    assert set(results) == {0, 1}, f"a rank wrote no result:\n{output[-4000:]}"
    for rank, r in results.items():
        assert r["error"], f"rank {rank} trained on past a replay its peer abandoned"
        assert r["global_step"] == NAN_STEP, (rank, r["global_step"])
    assert "the replay fails on rank 1 only" in results[1]["error"]["message"]
    assert "replay" in results[0]["error"]["message"], results[0]["error"]["message"]
    report = json.loads((tfdebug_dir(tmp_path) / f"nan-step{NAN_STEP}-rank1.json").read_text())
    assert "the replay fails on rank 1 only" in report["replay_error"]
    [finding] = read_findings(tfdebug_dir(tmp_path) / "findings-rank1.jsonl", strict=True)
    assert finding.code == "TFD403" and finding.step == NAN_STEP
    for rank, r in sorted(results.items()):
        print(f"rank {rank}: {r['error']['type']}: {r['error']['message'][:300]}")
    return wall


@pytest.mark.ddp
@pytest.mark.timeout(LIMIT_S + 30)
def test_an_fsdp2_replay_that_fails_on_one_rank_ends_every_rank(tmp_path):
    wall = check_replay_fails_on_one_rank(tmp_path)
    print(f"FSDP2 replay failing on rank 1: every rank ended in {wall:.1f} s")


@pytest.mark.slow
@pytest.mark.timeout(LIMIT_S + 30)
@pytest.mark.parametrize("repeat", range(REPEATS))
def test_an_fsdp2_replay_that_fails_on_one_rank_repeated(tmp_path, repeat):
    wall = check_replay_fails_on_one_rank(tmp_path)
    print(f"FSDP2 replay failing on rank 1 #{repeat}: every rank ended in {wall:.1f} s")


# ------------------------------------------------------------------ a member failing while it declares
class MemberFailsOnRank1(TinyGPT):
    """ThroughputMonitor's own code raises on rank 1 while it computes what it declares into the pack's shared
    reduction, at measuring step 2 (the first measuring step, 0, has passed on both ranks)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        from lightning_tfdebug import ThroughputMonitor

        original = ThroughputMonitor._measure

        def failing(monitor, trainer, now):
            if trainer.global_rank == 1 and monitor._step_at_start == 2:
                raise RuntimeError("ThroughputMonitor fails on rank 1 only")
            return original(monitor, trainer, now)

        ThroughputMonitor._measure = failing


def check_member_fails_while_declaring(tmp_path: Path) -> float:
    spec = {
        "strategy": "ddp",
        "model_class": "tests.test_fault_matrix:MemberFailsOnRank1",
        "model": dict(SMALL),
        "data": {"batch_size": 4},
        "trainer": {"max_steps": 8},
        "callbacks": [{"class_path": "lightning_tfdebug.TFDebug", "init_args": {"every_n_steps": 2}}],
        "extra": "tests.test_fault_matrix:member_extra",
    }
    results, output, wall = run_ranks(tmp_path, spec)  # ended within LIMIT_S, or the test failed as a hang
    assert set(results) == {0, 1}, f"a rank wrote no result:\n{output[-4000:]}"
    # Rank 1 sends zeros in the member's place, flagged, in the same all_reduce: the collective keeps its shape, and
    # every rank stands ThroughputMonitor aside at step 2, together; training goes on to the end on both ranks.
    for rank, r in results.items():
        assert r["error"] is None and r["global_step"] == 8, (rank, r["error"], output[-3000:])
        assert r["extra"]["failure"]["step"] in (2, 3), (rank, r["extra"])  # the same batch end on every rank
        assert r["extra"]["failure"]["everywhere"] is True
        assert r["extra"]["others_failed"] == [], (rank, r["extra"])
    assert "ThroughputMonitor fails on rank 1 only" in results[1]["extra"]["failure"]["error"]
    assert "failed on 1 other rank(s)" in results[0]["extra"]["failure"]["error"]
    errors = (tfdebug_dir(tmp_path) / "callback-errors-rank1.txt").read_text()
    assert "ThroughputMonitor fails on rank 1 only" in errors
    return wall


def member_extra(trainer, model, callbacks) -> dict[str, Any]:
    [pack] = callbacks
    failure = pack.members["ThroughputMonitor"].failure or {}
    others = [n for n, m in pack.members.items() if n != "ThroughputMonitor" and m.failure is not None]
    return {
        "failure": {k: failure.get(k) for k in ("step", "error", "everywhere")},
        "others_failed": others,
    }


@pytest.mark.ddp
@pytest.mark.timeout(LIMIT_S + 30)
def test_a_member_failing_on_one_rank_while_declaring_stands_aside_on_every_rank_at_the_same_step(tmp_path):
    wall = check_member_fails_while_declaring(tmp_path)
    print(f"a member failing while declaring on rank 1: stood aside on every rank, the run ended in {wall:.1f} s")


class UpdateRatioFailsOnRank1(TinyGPT):
    """UpdateRatio's own code raises on rank 1 only at optimizer step 4 (measuring steps 0 and 2 have passed on both
    ranks, its label counts still travel in its declaration): in ``on_before_optimizer_step`` (``should_measure``),
    before it declares, or in ``on_train_batch_end`` while it computes what it declares (``_count_labels``). Methods
    that its guarded hooks call are patched, not the hooks themselves (the guard wraps those)."""

    def __init__(self, fail_in: str = "should_measure", fail_at: int = 4, **kwargs):
        super().__init__(**kwargs)
        from lightning_tfdebug import UpdateRatio

        original = getattr(UpdateRatio, fail_in)
        at = fail_at if fail_in == "should_measure" else fail_at + 1  # global_step has moved on at the batch's end

        def failing(callback, trainer, *args, **kwargs):
            if trainer.global_rank == 1 and trainer.global_step == at:
                raise RuntimeError("UpdateRatio fails on rank 1 only")
            return original(callback, trainer, *args, **kwargs)

        setattr(UpdateRatio, fail_in, failing)


def update_ratio_extra(trainer, model, callbacks) -> dict[str, Any]:
    [pack] = callbacks
    member = pack.members["UpdateRatio"]
    failure = member.failure or {}
    others = [n for n, m in pack.members.items() if n != "UpdateRatio" and m.failure is not None]
    return {
        "failure": {k: failure.get(k) for k in ("step", "error", "everywhere")},
        "others_failed": others,
        "measured": sorted({entry[0] for entry in member._memory.norms}),
    }


@pytest.mark.ddp
@pytest.mark.timeout(LIMIT_S + 30)
# `_count_labels` (a failure while it computes what it declares) goes the same way through the same stand-in: CI's
# main lane runs it (`-m "slow and ci"`); the default run keeps `should_measure`
@pytest.mark.parametrize(
    "fail_in", ["should_measure", pytest.param("_count_labels", marks=[pytest.mark.slow, pytest.mark.ci])]
)
def test_update_ratio_failing_on_one_rank_stands_aside_on_every_rank_at_the_same_step(tmp_path, fail_in):
    """UpdateRatio declares on a cadence (``declares_at``): rank 1 sends zeros of its usual sizes, flagged, in the
    pack's one all_reduce at step 4, and both ranks stand it aside there; training goes on to the end."""
    spec = {
        "strategy": "ddp",
        "model_class": "tests.test_fault_matrix:UpdateRatioFailsOnRank1",
        "model": {**SMALL, "fail_in": fail_in},
        "data": {"batch_size": 4},
        "trainer": {"max_steps": 8},
        "callbacks": [{"class_path": "lightning_tfdebug.TFDebug", "init_args": {"every_n_steps": 2}}],
        "extra": "tests.test_fault_matrix:update_ratio_extra",
    }
    results, output, wall = run_ranks(tmp_path, spec)
    assert set(results) == {0, 1}, f"a rank wrote no result:\n{output[-4000:]}"
    for rank, r in results.items():
        assert r["error"] is None and r["global_step"] == 8, (rank, r["error"], output[-3000:])
        assert r["extra"]["failure"]["step"] in (4, 5), (rank, r["extra"])
        assert r["extra"]["failure"]["everywhere"] is True
        assert r["extra"]["others_failed"] == [], (rank, r["extra"])
    assert results[0]["extra"]["measured"] == [0, 2], results[0]["extra"]  # step 4 reached no one's diagnosis
    assert "UpdateRatio fails on rank 1 only" in results[1]["extra"]["failure"]["error"]
    assert "failed on 1 other rank(s)" in results[0]["extra"]["failure"]["error"]
    print(f"UpdateRatio failing in {fail_in} on rank 1: stood aside on every rank, the run ended in {wall:.1f} s")


@pytest.mark.ddp
@pytest.mark.timeout(LIMIT_S + 30)
def test_update_ratio_failing_on_one_rank_when_its_sizes_change_ends_every_rank(tmp_path):
    """Measuring every step, UpdateRatio's declarations carry label counts on steps 0 to 7 and none from step 8: a
    stand-in with the sizes of step 7's would not fit, so ``declares_at`` says None there and a failure on rank 1 at
    step 8 ends the run loudly (``TFDebugCallbackError`` on rank 1, a lost peer on rank 0) instead of hanging."""
    spec = {
        "strategy": "ddp",
        "model_class": "tests.test_fault_matrix:UpdateRatioFailsOnRank1",
        "model": {**SMALL, "fail_in": "should_measure", "fail_at": 8},
        "data": {"batch_size": 4},
        "trainer": {"max_steps": 12},
        "callbacks": [{"class_path": "lightning_tfdebug.TFDebug", "init_args": {"every_n_steps": 1}}],
    }
    results, output, wall = run_ranks(tmp_path, spec)
    assert set(results) == {0, 1}, f"a rank wrote no result:\n{output[-4000:]}"
    for rank, r in results.items():
        assert r["error"], f"rank {rank} trained on past a member its peer could not stand in for"
        assert r["global_step"] in (8, 9), (rank, r["global_step"])
    assert results[1]["error"]["type"] == "TFDebugCallbackError", results[1]["error"]
    assert "UpdateRatio" in results[1]["error"]["message"]
    print(f"UpdateRatio failing on rank 1 at step 8: every rank ended in {wall:.1f} s")
