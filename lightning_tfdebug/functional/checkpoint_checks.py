"""The rules CheckpointAudit decides: each finding code with its severity, text and hint."""

from __future__ import annotations

from lightning_tfdebug.functional.verdicts import Rule

TFD701 = Rule(
    "TFD701",
    "error",
    "CheckpointAudit",
    title="weights missing from the file",
    trigger="the saved file lacks weights for tensors of the module's `state_dict`",
    hint="check `on_save_checkpoint` overrides and how the checkpoint is written",
    reason=(
        "A checkpoint without all the weights cannot restore the model: resuming from it fails or resumes another model"
    ),
)

TFD702 = Rule(
    "TFD702",
    "error",
    "CheckpointAudit",
    title="saved tensors with the wrong shape",
    trigger="saved tensors with the wrong shape",
    hint="save full (gathered) tensors; the model was not rebuilt between save and load",
    reason="Tensors saved with the wrong shape cannot be loaded back: the checkpoint cannot restore this run",
)

TFD703 = Rule(
    "TFD703",
    "error",
    "CheckpointAudit",
    title="optimizer state missing (in a saved file, or in a checkpoint being resumed)",
    trigger="optimizer state missing from the file (or from a checkpoint being resumed)",
    hint="do not drop `optimizer_states`; not `save_weights_only` for resumable checkpoints",
    reason=(
        "Without optimizer state, resuming fails (Lightning requires it) or restarts the optimizer: the run cannot "
        "be resumed as saved"
    ),
)

TFD704 = Rule(
    "TFD704",
    "error",
    "CheckpointAudit",
    title="optimizer state incomplete: param groups, per-parameter state or step counts",
    trigger="optimizer state incomplete: param groups, per-parameter state or step counts missing",
    hint="save the optimizer's full `state_dict()`",
    reason=(
        "Incomplete optimizer state resumes with moments or step counts lost: the resumed run is not the run saved"
    ),
)

TFD705 = Rule(
    "TFD705",
    "error",
    "CheckpointAudit",
    title="LR scheduler state missing",
    trigger="LR scheduler state missing",
    hint="do not drop `lr_schedulers`",
    reason=("Without scheduler state a resumed run restarts its schedule (a second warm-up): it is not the run saved"),
)

TFD706 = Rule(
    "TFD706",
    "error",
    "CheckpointAudit",
    title="fp16 GradScaler state missing",
    trigger="fp16 GradScaler state missing under the precision plugin's key",
    hint="keep the precision plugin's entry in the checkpoint",
    reason="Without GradScaler state a resumed fp16 run restarts its loss scale: it is not the run saved",
)

TFD707 = Rule(
    "TFD707",
    "error",
    "CheckpointAudit",
    title="loop progress missing or inconsistent with the step it was saved at",
    trigger="loop progress (`loops`, `global_step`, `epoch`) missing or inconsistent",
    hint="keep Lightning's loop state",
    reason=("Without consistent loop progress a resumed run restarts or skips steps and data: it is not the run saved"),
)

TFD708 = Rule(
    "TFD708",
    "warning",
    "CheckpointAudit",
    title="a callback's state missing",
    trigger="a callback's state missing",
    hint='keep `checkpoint["callbacks"]`',
    reason="Loses work: a callback's state (early-stopping counters, an EMA) restarts on resume",
)

TFD709 = Rule(
    "TFD709",
    "info",
    "CheckpointAudit",
    title=(
        "a checkpoint not checked (sharded directory, written outside the CheckpointIO, unreadable), or "
        "weights-only (a warning when no checkpoint the run keeps can resume it)"
    ),
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
)

TFD710 = Rule(
    "TFD710",
    "error",
    "CheckpointAudit",
    title="weights after resume differ from the checkpoint, or changed dtype",
    trigger="restored weights differ from the checkpoint (checksums) or changed dtype",
    hint="nothing may re-initialise or convert the module after loading",
    reason="Measured: weights after resume are not the checkpoint's, so the resumed run is another run",
)

TFD711 = Rule(
    "TFD711",
    "error",
    "CheckpointAudit",
    title="optimizer step counts after resume differ from the checkpoint",
    trigger="optimizer step counts after resume differ from the checkpoint",
    hint="the optimizer was rebuilt or reset after loading",
    reason=(
        "Measured: the optimizer's step counts changed on resume (bias correction restarts): the resumed run is "
        "another run"
    ),
)

TFD712 = Rule(
    "TFD712",
    "error",
    "CheckpointAudit",
    title="learning rates after resume differ from the checkpoint",
    trigger="learning rates after resume differ from the checkpoint",
    hint="the scheduler or param groups were rebuilt after loading",
    reason="Measured: the learning rates changed on resume: the resumed run is not the run saved",
)

TFD713 = Rule(
    "TFD713",
    "error",
    "CheckpointAudit",
    title="GradScaler scale after resume differs from the checkpoint",
    trigger="GradScaler scale after resume differs from the checkpoint",
    hint="the scaler was replaced after loading",
    reason="Measured: the loss scale changed on resume: the resumed run is not the run saved",
)

TFD714 = Rule(
    "TFD714",
    "error",
    "CheckpointAudit",
    title="global step after resume differs from the checkpoint",
    trigger="global step after resume differs from the checkpoint",
    hint=("keep the loop state: resume from a checkpoint with `loops`, and do not drop it in `on_load_checkpoint`"),
    reason="Measured: the global step changed on resume: schedules and step-based logic follow another run",
)

TFD715 = Rule(
    "TFD715",
    "error",
    "CheckpointAudit",
    title="the loss on the probe batch after resuming differs from the loss at save time",
    trigger="the loss on the stored probe batch right after resuming differs from the loss at save time",
    hint="the model that trains is not the one saved: re-initialised, dtype or architecture changed",
    reason=(
        "Measured: the same batch gives a different loss after resuming, so the model restored is not the one saved"
    ),
)

TFD716 = Rule(
    "TFD716",
    "error",
    "CheckpointAudit",
    title="a checkpoint this run wrote is truncated, corrupt or incomplete",
    trigger=(
        "a checkpoint file this run wrote cannot be read back (cut short, not a valid archive), or a sharded "
        "distributed-checkpoint directory lacks its metadata or a shard file the metadata lists"
    ),
    hint=(
        "a full disk, a quota, or a process killed while saving; free space, then resume from an earlier "
        "checkpoint that checks out"
    ),
    reason="A checkpoint this run wrote cannot be read back: resuming from it will fail",
)

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
    TFD710,
    TFD711,
    TFD712,
    TFD713,
    TFD714,
    TFD715,
    TFD716,
)
"""The rules decided in this module, in code order."""
