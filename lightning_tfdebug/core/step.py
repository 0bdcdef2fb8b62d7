"""The step's shared state: what one callback reads or copies on a step and the others reuse, in one typed place.

One :class:`StepState` per Trainer (a weak mapping, :func:`step_state`); each field holds only the latest step's
value, keyed by what it belongs to, so a later batch never reads an earlier one's value.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from torch import Tensor

from lightning_tfdebug.functional.norms import per_tensor_norms


@dataclass
class StepState:
    """What the callbacks share on the current step.

    Attributes:
        batch: the batch the views below belong to (compared by identity).
        batch_views: the batch read once per key settings (``primitives.batch.StepBatch`` by ``BatchKeys``).
        norms_key: ``(global_step, ids of the tensors)`` the ``norms`` belong to.
        norms: the per-tensor gradient norms of that step (GradNormMonitor and UpdateRatio read the same gradients).
        rng_key: ``(batch object, (global_step, batch_idx))`` the ``rng`` belongs to.
        rng: the torch CPU generator's state as that batch's step started (NaNFirstFrame and ReproCapture replay it).
        host_copy_of: the batch ``host_copy`` is a copy of.
        host_copy: ReproCapture's host copy of that batch (BatchGuard reads it after a device-side assert).
        recording: the module calls of the latest recorded ``training_step`` (``core.calls.StepRecording``), read by
            every member that asked for it on that batch.
        warned_no_logger: the Trainer has no logger and one callback said so (once per Trainer, not per callback).
        skipped_step: the global step whose optimizer step NaNFirstFrame skipped last (non-finite values, decided on
            every rank together): nothing was applied, so UpdateRatio does not judge its update.
        explains_oom: a member (MemoryWatch) explains out-of-memory errors: ReproCapture leaves its own line on them
            to that member's finding.
        repro_bundle: ``(id of the exception, path)`` of the bundle ReproCapture wrote for the failure in flight.
        folded_flag: a member's per-step device flag (SpikeGuard's ``StepFlag``) that NaNFirstFrame reads in its one
            host read before ``optimizer.step()``, so the member adds no host sync of its own.
    """

    batch: Any = None
    batch_views: dict[Any, Any] = field(default_factory=dict)
    norms_key: Any = None
    norms: Tensor | None = None
    rng_key: Any = None
    rng: Tensor | None = None
    host_copy_of: Any = None
    host_copy: Any = None
    recording: Any = None
    warned_no_logger: bool = False
    skipped_step: int | None = None
    explains_oom: bool = False
    repro_bundle: tuple[int, str] | None = None
    folded_flag: Any = None


_STATES: weakref.WeakKeyDictionary[Any, StepState] = weakref.WeakKeyDictionary()


def step_state(trainer: Any) -> StepState:
    """The :class:`StepState` of ``trainer``, created on first use."""
    state = _STATES.get(trainer)
    if state is None:
        state = _STATES[trainer] = StepState()
    return state


def step_norms(trainer: Any, tensors: Sequence[Tensor]) -> Tensor:
    """:func:`~lightning_tfdebug.functional.norms.per_tensor_norms` of ``tensors``, computed once per optimizer step
    for the same tensors (GradNormMonitor and UpdateRatio read the same gradients). Keyed by the step and the ids of
    the tensors (alive throughout the asking hook); only the norm vector is held.
    """
    state = step_state(trainer)
    key = (getattr(trainer, "global_step", None), tuple(map(id, tensors)))
    if state.norms is None or state.norms_key != key:
        state.norms_key, state.norms = key, per_tensor_norms(tensors)
    return state.norms
