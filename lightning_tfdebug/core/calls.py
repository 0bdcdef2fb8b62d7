"""The model call shared on a step: :func:`share_model_call` / :func:`shared_model_call` (the call record and its
finder are pure: :mod:`lightning_tfdebug.primitives.calls`)."""

from __future__ import annotations

from typing import Any

from lightning_tfdebug.core.step import step_state
from lightning_tfdebug.primitives.calls import ModelCall


def share_model_call(trainer: Any, batch: Any, found: ModelCall) -> None:
    """Make ``found`` the model call of ``batch`` at the current step; :meth:`ModelCall.release` drops its tensors."""
    found.key = (getattr(trainer, "global_step", None), batch)
    step_state(trainer).model_call = found


def shared_model_call(trainer: Any, batch: Any) -> ModelCall | None:
    """The model call shared for ``batch`` (the same object) at the Trainer's current step, or None."""
    found = step_state(trainer).model_call
    if not isinstance(found, ModelCall) or found.key is None:
        return None
    step, recorded_batch = found.key
    return found if step == getattr(trainer, "global_step", None) and recorded_batch is batch else None
