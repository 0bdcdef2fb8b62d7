"""CheckpointAudit's rules: each finding code with its text, and the functions that decide it from host values
(read from files and live objects by :mod:`lightning_tfdebug.core.checkpoints`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import PurePath
from typing import Any

from torch import Tensor

from lightning_tfdebug.functional.checkpoints import max_step
from lightning_tfdebug.functional.verdicts import Rule, Verdict

HINT_STATE = (
    "Something drops it from the checkpoint: `save_weights_only=True`, or an `on_save_checkpoint` override that pops "
    "`optimizer_states` / `lr_schedulers`. Resume needs them for the same training run."
)


def _file_name(path: str) -> str:
    """The last part of a path (as ``os.path.basename``), named in the messages."""
    return PurePath(path).name


# ------------------------------------------------------------------------------------------------------ saved files
TFD701 = Rule(
    "TFD701",
    "error",
    "CheckpointAudit",
    title="weights missing from the file",
    headline="{count} of {total} weights missing from {file}",
    trigger="the saved file lacks weights for tensors of the module's `state_dict`",
    hint="Save with `trainer.save_checkpoint` / ModelCheckpoint; check `on_save_checkpoint` overrides.",
    reason=(
        "A checkpoint without all the weights cannot restore the model: resuming from it fails or resumes another model"
    ),
    message="The checkpoint lacks weights for {count} of the model's {total} tensors: {names}. (file {file})",
)


TFD702 = Rule(
    "TFD702",
    "error",
    "CheckpointAudit",
    title="saved tensors with the wrong shape",
    headline="{count} saved tensors with the wrong shape in {file}",
    trigger="saved tensors with the wrong shape",
    hint="Save the full (gathered) tensors, or check the model was not rebuilt between save and load.",
    reason="Tensors saved with the wrong shape cannot be loaded back: the checkpoint cannot restore this run",
    message="{count} saved tensors have the wrong shape: {shapes}. (file {file})",
)


# A loaded checkpoint against what it must hold (`core.checkpoints.expectation` at save time).
def weights_problems(checkpoint: Mapping[str, Any], params: Mapping[str, list[int]], path: str) -> list[Verdict]:
    """``TFD701``: weights missing (no ``state_dict`` at all, or tensors of the module's); ``TFD702``: saved tensors
    of another shape than the module's."""
    saved, file = checkpoint.get("state_dict"), _file_name(path)
    if not isinstance(saved, Mapping):
        message = f"The checkpoint holds no `state_dict` (model weights). (file {file})"
        return [TFD701.verdict({"path": path}, key="TFD701", message=message)]
    out = []
    missing = [k for k in params if k not in saved]
    if missing:
        names = f"{', '.join(missing[:8])}{' ...' if len(missing) > 8 else ''}"
        evidence = {"missing": missing[:50], "count": len(missing), "path": path}
        out.append(TFD701.verdict(evidence, key="TFD701", total=len(params), names=names, file=file))
    wrong = [
        f"{k} {list(saved[k].shape)} != {params[k]}"
        for k in params
        if k in saved and isinstance(saved[k], Tensor) and list(saved[k].shape) != params[k]
    ]
    if wrong:
        evidence = {"mismatches": wrong[:50], "path": path}
        out.append(TFD702.verdict(evidence, key="TFD702", count=len(wrong), shapes="; ".join(wrong[:5]), file=file))
    return out


TFD703 = Rule(
    "TFD703",
    "error",
    "CheckpointAudit",
    title="optimizer state missing (in a saved file, or in a checkpoint being resumed)",
    headline="optimizer state missing in {file}",
    trigger="optimizer state missing from the file (or from a checkpoint being resumed)",
    hint=HINT_STATE,
    reason=(
        "Without optimizer state, resuming fails (Lightning requires it) or restarts the optimizer: the run cannot "
        "be resumed as saved"
    ),
    message=(
        "The checkpoint holds optimizer state for {saved} of {expected} optimizers: a resume restarts Adam's moments "
        "and step counts from zero. (file {file})"
    ),
)


TFD704 = Rule(
    "TFD704",
    "error",
    "CheckpointAudit",
    title="optimizer state incomplete: param groups, per-parameter state or step counts",
    headline="optimizer state incomplete in {file}",
    trigger="optimizer state incomplete: param groups, per-parameter state or step counts missing",
    hint=HINT_STATE,
    reason=(
        "Incomplete optimizer state resumes with moments or step counts lost: the resumed run is not the run saved"
    ),
    message=(
        "Optimizer {optimizer}'s saved state is incomplete: {groups} of {expected_groups} param groups, state for "
        "{params_with_state} of {expected_with_state} parameters{no_step}. (file {file})"
    ),
)


def optimizer_problems(
    checkpoint: Mapping[str, Any], optimizers: Sequence[Mapping[str, Any]], path: str
) -> list[Verdict]:
    """``TFD703``: optimizer state for fewer optimizers than the run has; ``TFD704``: an optimizer's state with fewer
    param groups, fewer parameters with state, or no step counts where the live one has them (``optimizers``: per
    optimizer ``groups``, ``with_state``, ``has_step``)."""
    states, file = checkpoint.get("optimizer_states"), _file_name(path)
    if not optimizers:
        return []
    if not isinstance(states, list) or len(states) < len(optimizers):
        evidence = {"saved": len(states) if isinstance(states, list) else 0, "expected": len(optimizers), "path": path}
        return [TFD703.verdict(evidence, key="TFD703", file=file)]
    out = []
    for i, (expected, state) in enumerate(zip(optimizers, states)):
        groups = len(state.get("param_groups", [])) if isinstance(state, Mapping) else 0
        per_param = state.get("state", {}) if isinstance(state, Mapping) else {}
        with_state = sum(1 for s in per_param.values() if isinstance(s, Mapping) and s)
        no_step = expected["has_step"] and max_step(per_param) is None
        if groups != expected["groups"] or with_state < expected["with_state"] or no_step:
            evidence = {"optimizer": i, "groups": groups, "params_with_state": with_state, "path": path}
            verdict = TFD704.verdict(
                evidence,
                key="TFD704",
                expected_groups=expected["groups"],
                expected_with_state=expected["with_state"],
                no_step=", no step counts" if no_step else "",
                file=file,
            )
            out.append(verdict)
    return out


TFD705 = Rule(
    "TFD705",
    "error",
    "CheckpointAudit",
    title="LR scheduler state missing",
    headline="LR scheduler state missing in {file}",
    trigger="LR scheduler state missing",
    hint=HINT_STATE,
    reason=("Without scheduler state a resumed run restarts its schedule (a second warm-up): it is not the run saved"),
    message=(
        "The checkpoint holds LR scheduler state for {saved} of {expected} schedulers: a resume restarts the schedule "
        "(warm-up again from its first step). (file {file})"
    ),
)


def scheduler_problem(checkpoint: Mapping[str, Any], schedulers: int, path: str) -> Verdict | None:
    """``TFD705``: LR scheduler state for fewer schedulers than the run has."""
    saved = checkpoint.get("lr_schedulers")
    if not schedulers or (isinstance(saved, list) and len(saved) >= schedulers):
        return None
    evidence = {"saved": len(saved) if isinstance(saved, list) else 0, "expected": schedulers, "path": path}
    return TFD705.verdict(evidence, key="TFD705", file=_file_name(path))


TFD706 = Rule(
    "TFD706",
    "error",
    "CheckpointAudit",
    title="fp16 GradScaler state missing",
    headline="fp16 GradScaler state missing in {file}",
    trigger="fp16 GradScaler state missing under the precision plugin's key",
    hint=HINT_STATE,
    reason="Without GradScaler state a resumed fp16 run restarts its loss scale: it is not the run saved",
    message=(
        "The checkpoint lacks the fp16 GradScaler state (key `{key}`): a resume restarts the loss scale at its initial "
        "value and skips steps while it backs off again. (file {file})"
    ),
)


def scaler_problem(checkpoint: Mapping[str, Any], scaler_key: str | None, path: str) -> Verdict | None:
    """``TFD706``: no fp16 GradScaler state (a ``scale``) under the precision plugin's key while the run has one."""
    if not scaler_key or (isinstance(checkpoint.get(scaler_key), Mapping) and "scale" in checkpoint[scaler_key]):
        return None
    return TFD706.verdict({"key": scaler_key, "path": path}, key="TFD706", file=_file_name(path))


TFD707 = Rule(
    "TFD707",
    "error",
    "CheckpointAudit",
    title="loop progress missing or inconsistent with the step it was saved at",
    headline="loop progress missing or inconsistent in {file}: {parts}",
    trigger="loop progress (`loops`, `global_step`, `epoch`) missing or inconsistent",
    hint=HINT_STATE,
    reason=("Without consistent loop progress a resumed run restarts or skips steps and data: it is not the run saved"),
    message=(
        "The checkpoint lacks loop progress ({parts}): a resume restarts the epoch and step counters and the data "
        "order. (file {file})"
    ),
)


def progress_problem(checkpoint: Mapping[str, Any], global_step: int | None, path: str) -> Verdict | None:
    """``TFD707``: loop progress (``global_step``, ``epoch``, ``loops.fit_loop``) missing, or a ``global_step`` other
    than the step the checkpoint was saved at."""
    loops, file = checkpoint.get("loops"), _file_name(path)
    missing = [k for k in ("global_step", "epoch") if k not in checkpoint]
    if not (isinstance(loops, Mapping) and "fit_loop" in loops):
        missing.append("loops.fit_loop")
    if missing:
        evidence = {"missing": missing, "path": path}
        return TFD707.verdict(evidence, key="TFD707", parts=", ".join(missing), file=file)
    saved = checkpoint.get("global_step")
    if global_step is None or saved == global_step:
        return None
    message = f"The checkpoint's global_step is {saved} but it was saved at step {global_step}. (file {file})"
    evidence = {"saved": saved, "expected": global_step, "path": path}
    return TFD707.verdict(evidence, key="TFD707", message=message)


TFD708 = Rule(
    "TFD708",
    "warning",
    "CheckpointAudit",
    title="a callback's state missing",
    headline="{count} callbacks' state missing in {file}: {names}",
    trigger="a callback's state missing",
    hint=(
        "Something removed `checkpoint['callbacks']` entries (an `on_save_checkpoint` override?); early stopping, "
        "checkpointing and the pack's callbacks lose their history on resume."
    ),
    reason="Loses work: a callback's state (early-stopping counters, an EMA) restarts on resume",
    message="The checkpoint lacks the state of {count} callbacks: {names}. (file {file})",
)


def callbacks_problem(checkpoint: Mapping[str, Any], callbacks: Sequence[str], path: str) -> Verdict | None:
    """``TFD708``: the state of callbacks the run has is missing from ``checkpoint["callbacks"]``."""
    saved = checkpoint.get("callbacks")
    lost = [k for k in callbacks if not isinstance(saved, Mapping) or k not in saved]
    if not lost:
        return None
    evidence = {"missing": lost, "path": path}
    return TFD708.verdict(evidence, key="TFD708", count=len(lost), names=", ".join(lost[:5]), file=_file_name(path))


def content_problems(checkpoint: Mapping[str, Any], expected: Mapping[str, Any], path: str) -> list[Verdict]:
    """``TFD701``-``TFD708``, in code order: a loaded checkpoint against what it must hold (``expected``, from
    :func:`~lightning_tfdebug.core.checkpoints.expectation`)."""
    found = [
        *weights_problems(checkpoint, expected.get("params", {}), path),
        *optimizer_problems(checkpoint, expected.get("optimizers", []), path),
        scheduler_problem(checkpoint, int(expected.get("schedulers", 0)), path),
        scaler_problem(checkpoint, expected.get("scaler_key"), path),
        progress_problem(checkpoint, expected.get("global_step"), path),
        callbacks_problem(checkpoint, expected.get("callbacks", []), path),
    ]
    return [v for v in found if v is not None]


TFD709 = Rule(
    "TFD709",
    "info",
    "CheckpointAudit",
    title=(
        "a checkpoint not checked (sharded directory, written outside the CheckpointIO, unreadable), or "
        "weights-only (a warning when no checkpoint the run keeps can resume it)"
    ),
    headline="checkpoint not checked: {path}",
    trigger=(
        "a checkpoint not checked (sharded distributed-checkpoint directory, written outside the CheckpointIO, "
        "unreadable), or a weights-only checkpoint (not resumable): a warning when no checkpoint callback of the "
        "run keeps full checkpoints and the run wrote none"
    ),
    hint="verify by resuming: the resume checks still run; keep one full checkpoint to resume from",
    reason=(
        "Info when another checkpoint the run keeps can resume it; a warning when none can (a crash then loses the "
        "optimizer, schedule and loop state)"
    ),
    message="Checkpoint {path} not checked: {why}.",
    details=(
        "A weights-only save (`save_weights_only=True`) is named once: info when another checkpoint callback of the "
        "run keeps full checkpoints (or the run wrote one), a warning when none does (no checkpoint the run keeps can"
        " resume it, and a crash loses the optimizer, the schedule and the loop position). A checkpoint that could "
        "not be checked after its save (a sharded distributed-checkpoint directory, a file written outside the "
        "strategy's CheckpointIO) is info: the checks on resume still run."
    ),
)


def weights_only_checkpoint(path: str, resumable_savers: list[str], full_saved: bool, savers: int) -> Verdict:
    """``TFD709`` for a weights-only file: info when a checkpoint callback keeps full checkpoints
    (``resumable_savers``) or the run wrote one (``full_saved``), a warning when none can resume the run."""
    name = _file_name(path)
    prefix = f"Checkpoint {name} is weights-only (no optimizer, scheduler or loop state)"
    if resumable_savers or full_saved:
        resume_from = f"{', '.join(resumable_savers)} keeps full checkpoints" if resumable_savers else ""
        message = (
            f"{prefix}, so only its existence was checked; it serves inference or fine-tuning, while "
            f"{resume_from or 'this run also wrote a full one'} to resume from."
        )
        evidence = {"path": path, "resumable_savers": resumable_savers, "resumable": True}
        return TFD709.verdict(evidence, key="weights_only", message=message)
    message = (
        f"{prefix}, and no checkpoint this run keeps can resume it ({savers} checkpoint callback(s), none saving full "
        "checkpoints): after a crash the run restarts from step 0 or resumes with a fresh optimizer and schedule."
    )
    hint = (
        "Keep at least one full checkpoint: `save_weights_only=False` on this ModelCheckpoint, or a second "
        "`ModelCheckpoint(save_last=True)` beside it."
    )
    evidence = {"path": path, "resumable_savers": [], "resumable": False}
    return TFD709.verdict(evidence, severity="warning", hint=hint, key="weights_only", message=message)


def checkpoint_not_checked(path: str, why: str) -> Verdict:
    """``TFD709``: a checkpoint that could not be checked (``why``); the resume checks still run."""
    hint = "Verify by resuming: the resume checks (TFD710-TFD715) still run."
    return TFD709.verdict({"path": path}, hint=hint, key="not_checked", why=why)


def unreadable_checkpoint(path: str, error: BaseException) -> Verdict:
    """``TFD709``: a file this run wrote that could not be opened for checking (not a damaged archive: ``TFD716``)."""
    message = f"Checkpoint {path} could not be opened for checking: {type(error).__name__}: {error}"
    return TFD709.verdict({"path": path}, key=path, message=message)


TFD716 = Rule(
    "TFD716",
    "error",
    "CheckpointAudit",
    title="a checkpoint this run wrote is truncated, corrupt or incomplete",
    headline="checkpoint {path} is truncated, corrupt or incomplete ({bytes} bytes)",
    trigger=(
        "a checkpoint file this run wrote cannot be read back (cut short, not a valid archive), or a sharded "
        "distributed-checkpoint directory lacks its metadata or a shard file the metadata lists"
    ),
    hint=(
        "A full disk, a quota, or a process killed while saving leaves such a file: free space and resume from an "
        "earlier checkpoint that checks out."
    ),
    reason="A checkpoint this run wrote cannot be read back: resuming from it will fail",
    message="Checkpoint {path} ({bytes} bytes) cannot be read back: it is truncated or corrupt ({first}).",
)


def damaged_checkpoint(path: str, size: int, error: BaseException, key: str | None = None) -> Verdict:
    """``TFD716``: the checkpoint file at ``path`` (``size`` bytes) could not be read back; ``key`` defaults to one
    per file."""
    first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    evidence = {"path": path, "bytes": size, "error": f"{type(error).__name__}: {first}"}
    return TFD716.verdict(evidence, key=key or f"damaged:{path}", first=first)


@dataclass(frozen=True)
class ShardedReading:
    """A distributed-checkpoint directory, read from its ``.metadata`` and file sizes: ``needed`` bytes per shard file
    for the items the metadata places in it, and each file's size (None: missing)."""

    path: str
    has_metadata: bool = True
    metadata_path: str = ""
    metadata_bytes: int = 0
    metadata_error: BaseException | None = None
    needed: dict[str, int] = field(default_factory=dict)
    sizes: dict[str, int | None] = field(default_factory=dict)


def sharded_problems(reading: ShardedReading) -> list[Verdict]:
    """``TFD716`` for a sharded directory without loadable metadata, or with shard files missing or too short."""
    path, key = reading.path, f"sharded:{reading.path}"
    if not reading.has_metadata:
        message = f"Sharded checkpoint {path} has no `.metadata`: the save did not finish (rank 0 writes it last)."
        return [TFD716.verdict({"path": path}, key=key, message=message)]
    if reading.metadata_error is not None:
        return [damaged_checkpoint(reading.metadata_path, reading.metadata_bytes, reading.metadata_error, key=key)]
    missing = sorted(name for name in reading.needed if reading.sizes.get(name) is None)
    short = sorted(
        name for name, end in reading.needed.items() if name not in missing and (reading.sizes[name] or 0) < end
    )
    if not missing and not short:
        return []
    parts = []
    if missing:
        parts.append(f"{len(missing)} shard file(s) its metadata lists are missing ({', '.join(missing[:4])})")
    if short:
        parts.append(f"{len(short)} shard file(s) are shorter than the items they hold ({', '.join(short[:4])})")
    message = f"Sharded checkpoint {path} is incomplete: " + "; ".join(parts) + "."
    evidence = {"path": path, "missing": missing, "short": short, "files": len(reading.needed)}
    return [TFD716.verdict(evidence, key=key, message=message)]


BLOCK = ("TFD701", "TFD719")
"""The codes reserved for CheckpointAudit's rules."""

RULES: tuple[Rule, ...] = (
    TFD701,
    TFD702,
    TFD703,
    TFD704,
    TFD705,
    TFD706,
    TFD707,
    TFD708,
    TFD709,
    TFD716,
)
"""The rules decided in this module, in code order."""


COVERAGE: dict[str, tuple[str, ...]] = {
    "checkpoint resumable": (
        "TFD701",
        "TFD702",
        "TFD703",
        "TFD704",
        "TFD705",
        "TFD706",
        "TFD707",
        "TFD708",
        "TFD709",
        "TFD710",
        "TFD711",
        "TFD712",
        "TFD713",
        "TFD714",
        "TFD715",
        "TFD716",
    ),
}
"""The rows of the run's Coverage table these rules answer: the check -> the codes that decide it."""
