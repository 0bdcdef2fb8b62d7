"""The step's shared batch view: :func:`step_batch` reads the training batch once per step and key settings (the views
themselves are pure: :mod:`lightning_tfdebug.primitives.batch`), and :func:`step_rng_state` keeps the RNG state the
replaying callbacks share."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from lightning_tfdebug.core.step import step_state
from lightning_tfdebug.primitives.batch import BatchKeys, StepBatch


def step_batch(trainer: Any, batch: Any, keys: BatchKeys | None = None) -> StepBatch:
    """The shared :class:`StepBatch` of ``batch`` (per key settings); only the latest batch is kept."""
    keys = keys or BatchKeys()
    state = step_state(trainer)
    if state.batch is not batch:
        state.batch, state.batch_views = batch, {}
    view = state.batch_views.get(keys)
    if view is None:
        view = state.batch_views[keys] = StepBatch(batch, keys)
    return view


def step_rng_state(trainer: Any, batch: Any, batch_idx: int) -> Tensor:
    """The torch CPU generator's state as this batch's step starts (a host copy), shared by the callbacks that replay
    the step; keyed on the batch object, its index and the step. Callers must not modify the tensor."""
    state = step_state(trainer)
    key = (trainer.global_step, batch_idx)
    if state.rng is None or state.rng_key is None or state.rng_key[0] is not batch or state.rng_key[1] != key:
        state.rng_key, state.rng = (batch, key), torch.get_rng_state()
    return state.rng
