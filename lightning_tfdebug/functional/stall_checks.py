"""StallWatchdog's decisions and rules ``TFD520``-``TFD521``: from where each rank is (its step, its phase, how long
it has made no progress, what its main thread waits in) to the verdict that names the rank that hangs.

Pure: frames and host numbers in, verdicts out. The watchdog thread (:mod:`lightning_tfdebug.core.watchdog`) reads
the stacks and the other ranks' records and hands them here.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from lightning_tfdebug.functional.evidence_chart import EvidenceChart
from lightning_tfdebug.functional.verdicts import Rule, Verdict

DEFAULT_FLOOR_S = 90.0
"""The least default ``stall_after``: on sub-second steps the watchdog fires within two minutes (poll included)."""
DEFAULT_STEP_FACTOR = 20.0
"""The default ``stall_after`` is at least this many typical (median) batch times ..."""
DEFAULT_SLOWEST_FACTOR = 3.0
"""... and this many times the slowest batch seen (a loaded machine slows steps unevenly)."""

#: The least allowance of a phase that may legitimately take minutes, in seconds, whatever ``stall_after`` is.
PHASE_ALLOWANCE_S: dict[str, float] = {
    "set-up": 600.0,  # from setup to the first batch, an epoch's start: strategy set-up, DataLoader workers starting
    "first step": 600.0,  # lazy initialisation, cuDNN autotuning, the first fetch
    "compile": 1800.0,  # torch.compile's warm-up (a stack inside torch._dynamo / torch._inductor)
    "validation": 600.0,  # one validation batch (each batch is progress) and the sanity check
    "checkpoint": 900.0,  # writing a checkpoint to a slow or remote file system
    "profiler": 600.0,  # a profiled step and the trace export
    "end": 600.0,  # the end of fit: the last checkpoint, the loggers' flush
}

#: Wait kinds in which a rank waits for the others (the ranks there are victims of a stall, not its cause).
COLLECTIVE_KINDS = frozenset({"barrier", "collective", "backward"})


@dataclass(frozen=True)
class Frame:
    """One frame of a stack: its file, line and function; ``library``: the file belongs to Python, torch, Lightning
    or another installed package (not the user's code)."""

    file: str
    line: int
    function: str
    library: bool = False

    def __str__(self) -> str:
        return f"{self.function} ({_short_path(self.file)}:{self.line})"


@dataclass(frozen=True)
class Wait:
    """What a main thread waits in: ``kind`` (``"compile"``, ``"barrier"``, ``"collective"``, ``"backward"``,
    ``"dataloader"``, ``"checkpoint"``, ``"profiler"``, ``"code"``), a phrase for the finding, and the innermost frame
    of the user's code (None: none on the stack)."""

    kind: str
    text: str
    user_frame: str | None = None


@dataclass(frozen=True)
class RankRecord:
    """Where one rank is, as it published it: the step, the phase of the training loop (the last hook that ran), the
    seconds without progress, and what its main thread waits in (None: not yet looked at, it was not idle)."""

    rank: int
    step: int
    phase: str
    idle_s: float
    kind: str | None = None
    where: str | None = None


def _short_path(path: str) -> str:
    parts = path.replace("\\", "/").split("/")
    for anchor in ("site-packages", "dist-packages"):
        if anchor in parts:
            return "/".join(parts[parts.index(anchor) + 1 :])
    return "/".join(parts[-2:]) if len(parts) > 1 else path


def _in(frame: Frame, *fragments: str) -> bool:
    path = frame.file.replace("\\", "/")
    return any(f in path for f in fragments)


def classify_stack(frames: Sequence[Frame], distributed: bool) -> Wait:
    """What a main thread whose stack is ``frames`` (outermost first) waits in.

    Example:
        >>> c10d = "/x/site-packages/torch/distributed/distributed_c10d.py"
        >>> stack = [Frame("/u/train.py", 12, "on_train_batch_end"), Frame(c10d, 4000, "barrier", True)]
        >>> classify_stack(stack, distributed=True).text
        'a barrier (torch.distributed.barrier)'
    """
    # the innermost frame of the user's code that a library called back (a hook, training_step, a dataset), not the
    # script that called `trainer.fit`
    first_library = next((i for i, f in enumerate(frames) if f.library), len(frames))
    user = next((str(f) for f in reversed(frames[first_library:]) if not f.library), None)
    called = f", called from {user}" if user else ""
    if any(_in(f, "/torch/_dynamo/", "/torch/_inductor/") for f in frames):
        return Wait("compile", "compiling (torch.compile)", user)
    c10d = [i for i, f in enumerate(frames) if _in(f, "/torch/distributed/distributed_c10d.py")]
    public = [i for i in c10d if not frames[i].function.startswith("_")]
    if public:
        name = frames[public[0]].function
        outside = [f for f in frames[: c10d[0]] if not _in(f, "/torch/distributed/")]
        caller = outside[-1] if outside else None  # the frame that called the collective (the user's or Lightning's)
        if caller is not None:
            called = f", called from {caller}" + (f" in {user}" if caller.library and user else "")
        kind = "barrier" if "barrier" in name else "collective"
        return Wait(kind, f"a {kind} (torch.distributed.{name}){called}", user)
    if any(_in(f, "/torch/profiler/") for f in frames):
        return Wait("profiler", "the profiler", user)
    if any(_in(f, "/torch/serialization.py") or "save_checkpoint" in f.function for f in frames):
        return Wait("checkpoint", f"writing a checkpoint{called}", user)
    if frames and not frames[-1].library:  # the user's own code is running (a data source inside the step, a lock)
        return Wait("code", f"in {frames[-1]}", user)
    if any(_in(f, "/torch/utils/data/") for f in frames):
        if any(f.function in ("_try_get_data", "_get_data") for f in frames):
            return Wait("dataloader", "waiting for a batch from the DataLoader's worker processes", user)
        return Wait("dataloader", f"loading a batch{called}", user)
    if any(_in(f, "/torch/autograd/") for f in frames):
        if distributed:
            return Wait("backward", "backward, where DDP's gradient all-reduce waits for every rank", user)
        return Wait("code", f"backward{called}", user)
    if user is not None:  # library code called from the user's (a lock, a queue, a socket)
        return Wait("code", f"in {user}, inside {frames[-1]}", user)
    return Wait("code", f"in {frames[-1]}" if frames else "in no Python frame", user)


def default_stall_after(batch_seconds: Sequence[float]) -> float:
    """The default ``stall_after`` from the run's own batch times (seconds): at least :data:`DEFAULT_FLOOR_S`,
    :data:`DEFAULT_STEP_FACTOR` median batches and :data:`DEFAULT_SLOWEST_FACTOR` of the slowest.

    Example:
        >>> default_stall_after([0.2, 0.3, 0.25]), default_stall_after([10.0, 12.0, 11.0])
        (90.0, 220.0)
    """
    if not batch_seconds:
        return DEFAULT_FLOOR_S
    median = statistics.median(batch_seconds)
    return max(DEFAULT_FLOOR_S, DEFAULT_STEP_FACTOR * median, DEFAULT_SLOWEST_FACTOR * max(batch_seconds))


def phase_kind(phase: str, wait: str | None, profiling: bool) -> str | None:
    """The phase whose allowance applies (a key of :data:`PHASE_ALLOWANCE_S`), or None for a plain step: from the
    loop's phase (the last hook), what the stack waits in (``wait``: a :class:`Wait` kind) and the profiler's state."""
    if wait == "compile":
        return "compile"
    if wait == "checkpoint" or phase == "checkpoint save":
        return "checkpoint"
    if wait == "profiler" or profiling:
        return "profiler"
    if phase in ("validation", "sanity check"):
        return "validation"
    if phase in ("set-up", "fit start", "waiting for the first batch", "epoch start"):  # DataLoader workers start
        return "set-up"
    if phase.startswith("first "):
        return "first step"
    if phase in ("fit end",):
        return "end"
    return None


def allowance(stall_after: float, kind: str | None) -> float:
    """How long a rank may go without progress in a phase of ``kind`` (:func:`phase_kind`) before it has stalled."""
    return max(stall_after, PHASE_ALLOWANCE_S.get(kind, 0.0)) if kind else stall_after


def _rank_phrase(record: RankRecord) -> str:
    if record.where and record.where.startswith(record.phase):
        return f"rank {record.rank} at step {record.step} ({record.where})"
    where = f", {record.where}" if record.where else ""
    return f"rank {record.rank} at step {record.step} ({record.phase}{where})"


TFD520 = Rule(
    "TFD520",
    "error",
    "StallWatchdog",
    title="a rank made no progress for `stall_after` seconds: the rank that hangs, its step, phase and frame",
    headline="no progress for {idle_s:.1f} s on rank {rank} at step {step} ({phase})",
    chart=EvidenceChart(
        "Where is each rank: its last step and phase?",
        "step",
        bars="ranks",
        bar_value="step",
        bar_label="phase",
    ),
    trigger=(
        "no hook of the training loop ran on a rank for longer than `stall_after` (default: from the run's own "
        "step times, at least 90 s; the first step, compilation, validation, checkpoint saving and the profiler get "
        "minutes)"
    ),
    hint=(
        "Read the stacks in tfdebug/stall-rank<r>.txt of the rank named behind: its main thread shows where it is "
        "stuck (a data source that never returns, a lock, a collective the others did not enter). The ranks that "
        "wait in a collective are victims, not the cause."
    ),
    reason="Measured: the run stopped moving; every rank burns its allocation until the collective timeout",
    message="No progress for {idle_s:.1f} s on rank {rank} at step {step} ({phase}): {where}.{others} Stacks: {stacks}",
)


TFD521 = Rule(
    "TFD521",
    "error",
    "StallWatchdog",
    title="the ranks wait in different collectives (a collective that only some ranks call)",
    headline="the ranks wait in different collectives (no progress for {idle_s:.1f} s)",
    chart=EvidenceChart(
        "Where is each rank: its last step and phase?",
        "step",
        bars="ranks",
        bar_value="step",
        bar_label="phase",
    ),
    trigger="every rank stalled inside a collective, and not all in the same one, or not at the same step",
    hint=(
        "A collective must be called by every rank in the same order: a barrier, a broadcast or a `sync_dist` log "
        "inside a rank-zero-only branch (`if trainer.is_global_zero`, `@rank_zero_only`) hangs the job. Call it on "
        "every rank, or take it out of the branch. The stacks in tfdebug/stall-rank<r>.txt show each call site."
    ),
    reason="Measured: the ranks are deadlocked on each other; the job cannot go on",
    message="The ranks wait in different collectives: {waits}. No progress for {idle_s:.1f} s. Stacks: {stacks}",
)


def stall_verdicts(
    own: RankRecord,
    others: Sequence[RankRecord] | None,
    world_size: int,
    stacks: str,
    unreadable: str | None = None,
) -> list[Verdict]:
    """The finding of a rank whose watchdog fired: ``own`` is this rank, ``others`` every other rank's last record
    (None: they could not be read, ``unreadable`` says why), ``stacks`` the file with this process's stacks.

    ``TFD521`` when every rank waits in a collective and not in the same one (or at different steps); else ``TFD520``
    naming the ranks behind (those not in a collective, else those at the lowest step) and where the others wait."""
    evidence = {"rank": own.rank, "step": own.step, "phase": own.phase, "idle_s": round(own.idle_s, 1)}
    where = own.where or "no Python frame"
    if world_size <= 1:
        return [TFD520.verdict(evidence, key=f"step{own.step}", step=own.step, where=where, others="", stacks=stacks)]
    if others is None:
        tail = f" The other ranks' progress could not be read ({unreadable or 'no store'}): their own stall files tell."
        evidence["others_read"] = False
        return [TFD520.verdict(evidence, key=f"step{own.step}", step=own.step, where=where, others=tail, stacks=stacks)]
    records = sorted([own, *others], key=lambda r: r.rank)
    missing = sorted(set(range(world_size)) - {r.rank for r in records})
    evidence["ranks"] = {str(r.rank): {"step": r.step, "phase": r.phase, "where": r.where} for r in records}
    waiting = [r for r in records if r.kind in COLLECTIVE_KINDS]
    if not missing and len(waiting) == len(records) and _differ(waiting):
        waits = "; ".join(_rank_phrase(r) for r in waiting)
        evidence["mismatched"] = True
        return [TFD521.verdict(evidence, key=f"step{own.step}", step=own.step, waits=waits, stacks=stacks)]
    behind = _behind(records)
    evidence["behind"] = [r.rank for r in behind]
    parts = []
    if behind:
        parts.append("Behind: " + "; ".join(_rank_phrase(r) for r in behind) + ".")
    rest = [r for r in records if r not in behind]
    if rest:
        parts.append("The others wait: " + "; ".join(_rank_phrase(r) for r in rest) + ".")
    if missing:
        parts.append(f"No record from rank(s) {', '.join(map(str, missing))} (not started, or gone).")
    others_text = " " + " ".join(parts) if parts else ""
    return [
        TFD520.verdict(evidence, key=f"step{own.step}", step=own.step, where=where, others=others_text, stacks=stacks)
    ]


def _behind(records: Sequence[RankRecord]) -> list[RankRecord]:
    """The ranks the others wait for: at the lowest step when the ranks are at different steps (under NCCL a rank
    that waits for another runs ahead until a host sync, which may sit in any code, so the step decides), else those
    not inside a collective."""
    low = min(r.step for r in records)
    if any(r.step != low for r in records):
        return [r for r in records if r.step == low]
    return [r for r in records if r.kind not in COLLECTIVE_KINDS]


def _differ(waiting: Sequence[RankRecord]) -> bool:
    """Whether ranks that all wait in collectives wait in different ones: other kinds, other call sites, other
    steps (the collective text names the call; backward's all-reduce has one)."""
    return len({(r.kind, r.where, r.step) for r in waiting}) > 1


BLOCK = ("TFD520", "TFD529")

RULES = (TFD520, TFD521)


COVERAGE: dict[str, tuple[str, ...]] = {
    "hangs": (
        "TFD520",
        "TFD521",
    ),
}
"""The rows of the run's Coverage table these rules answer: the check -> the codes that decide it."""
