"""CheckpointAudit's room: the callback (:mod:`.callback`) and its probe (:mod:`.capture`: the model call the
real ``training_step`` made on the first batch, kept on a few rows and replayed at saves and resumes); its rules are in
:mod:`lightning_tfdebug.functional.checkpoint_checks` and :mod:`lightning_tfdebug.functional.resume_checks`. The
callback is imported here on first use, as the other rooms do."""

from __future__ import annotations

from typing import Any

__all__ = ["CheckpointAudit"]


def __getattr__(name: str) -> Any:
    if name == "CheckpointAudit":
        from lightning_tfdebug.callbacks.checkpoint_audit.callback import CheckpointAudit

        return CheckpointAudit
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
