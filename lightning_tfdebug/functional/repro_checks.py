"""ReproCapture's rules ``TFD130``-``TFD131``, both rank-local (each rank writes its own bundle). Host values only."""

from __future__ import annotations

from lightning_tfdebug.functional.verdicts import Rule, Verdict

TFD130 = Rule(
    "TFD130",
    "info",
    "ReproCapture",
    title="training failed; a bundle was written (the message has its path and the replay command)",
    trigger="training raised an exception; a repro bundle was written (path in the message)",
    hint="`python -m lightning_tfdebug replay <bundle> --config <your LightningCLI config>`",
    reason=(
        "The failure itself propagates as the exception; the finding only points at the bundle written to reproduce it"
    ),
    message=(
        "Training failed with {exception} at step {failed_step} (rank {rank}); a repro bundle was written to "
        "{bundle}.{replayable}"
    ),
    details=(
        "When the fit raises an exception (inside a training batch, or outside one with "
        "`capture_exceptions_outside_training`, then without a batch) and the bundle was written; the exception "
        "itself propagates unchanged. Not written for an out-of-memory error while MemoryWatch is in the run: its "
        "TFD621 names the bundle instead."
    ),
)


def bundle_written(
    bundle: str, exception: str, *, step: int, rank: int, in_batch: bool, batch_saved: bool, after_step: bool
) -> Verdict:
    """TFD130: a bundle was written for ``exception`` (its class name) at ``step``; the message says what it can
    replay (no batch, or the batch of a step whose backward had already run)."""
    if not in_batch:
        replayable = " It holds no batch (the exception came outside a training batch)."
    elif not batch_saved:
        replayable = " The batch could not be copied to the host (see bundle.json); it cannot be replayed."
    elif after_step:
        replayable = (
            " It came after that step's training_step and backward (a batch-end hook, the LR scheduler, or loading "
            "the next batch); the bundle holds that step's batch."
        )
    else:
        replayable = ""
    hint = f"Replay the failing step: python -m lightning_tfdebug replay {bundle} --config <your LightningCLI config>"
    evidence = {"bundle": bundle, "exception": exception}
    return TFD130.verdict(evidence, hint=hint, key=bundle, failed_step=step, rank=rank, replayable=replayable)


TFD131 = Rule(
    "TFD131",
    "warning",
    "ReproCapture",
    title="the bundle could not be written; the original exception propagates unchanged",
    headline="the repro bundle could not be written: {error}",
    trigger=("the bundle could not be written (disk full, no permission); the original exception still propagates"),
    hint="Check free disk space and write permission on the log directory.",
    reason="Loses work: the evidence needed to replay the crash is gone, though the crash itself still propagates",
    message="ReproCapture could not write a bundle for the {exception} at step {failed_step}: {error}",
    details=(
        "When writing the bundle fails with an `OSError` (disk full, no permission, a file where the directory should"
        " be); the training exception still propagates unchanged."
    ),
)


def bundle_not_written(exception: str, error: str, *, step: int, key: str) -> Verdict:
    """TFD131: the bundle for ``exception`` (its class name) at ``step`` could not be written (``error``)."""
    return TFD131.verdict({"error": error}, key=key, failed_step=step, exception=exception)


BLOCK = ("TFD130", "TFD139")
"""The codes reserved for ReproCapture's rules."""

RULES: tuple[Rule, ...] = (TFD130, TFD131)
"""The rules decided in this module, in code order."""
