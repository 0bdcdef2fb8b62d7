"""MaskProbe's reach into the run: imports named in its arguments, the loss the real step returned, and the model call
among those the step's one recording holds (:mod:`lightning_tfdebug.core.calls`). Nothing here replays the step."""

from __future__ import annotations

import dataclasses
from typing import Any

import lightning.pytorch as pl
from torch import Tensor

from lightning_tfdebug.core.calls import StepRecording
from lightning_tfdebug.core.model import grad_scaler_of, import_object
from lightning_tfdebug.functional.verdicts import Verdict
from lightning_tfdebug.primitives import call_finder
from lightning_tfdebug.primitives.calls import ModelCall


def imported(path: str | None) -> Any:
    """The object at an import path (None for None), or the error importing it raised."""
    try:
        return None if path is None else import_object(path)
    except (ImportError, AttributeError, ValueError) as err:
        return err


def check_import_paths(**paths: str | None) -> None:
    """Import each named path now, so that a typo fails at construction and not mid-fit.

    Raises:
        ValueError: naming the argument whose path is not importable.
    """
    for name, value in paths.items():
        found = imported(value) if isinstance(value, str) and value.strip() else ValueError("not a path")
        if value is not None and isinstance(found, Exception):
            raise ValueError(
                f"`{name}` must be an importable path like 'package.module:function' or None; got {value!r} ({found})."
            )


def returned_loss(trainer: pl.Trainer, pl_module: pl.LightningModule, loss: Tensor) -> Tensor:
    """The loss ``training_step`` returned, from the one ``on_before_backward`` receives: undone of gradient
    accumulation (automatic optimization) and of an fp16 loss scale. Host sync: the scale, on probing steps only."""
    scaler = grad_scaler_of(trainer)
    scale = float(scaler.get_scale()) if scaler is not None and scaler.is_enabled() else 1.0
    accumulate = trainer.accumulate_grad_batches if pl_module.automatic_optimization else 1
    return loss.detach() * (accumulate / scale)


def recorded_model_call(
    recording: StepRecording | None,
    fields: tuple[Tensor | None, Tensor | None, Tensor | None],
    ignore_index: int,
    pl_module: pl.LightningModule,
    kind: Any,
) -> ModelCall | str:
    """The model call among those the real ``training_step`` made on this batch, or why there is none."""
    if recording is None:
        return "the calls of `training_step` were not recorded"
    recorded = recording.calls()
    if recording.compiled:
        # hooks inside compiled code would make Dynamo recompile it: only the compiled boundaries were recorded
        recorded = [c for c in recorded if c.depth == 0]
    return call_finder.find_model_call(recorded, *fields, ignore_index, pl_module, kind)


def token_fields(fields: Any) -> tuple[Tensor | None, Tensor | None, Tensor | None, str | None]:
    """``(input_ids, attention_mask, labels, where the mask is)`` from the shared reading of a batch: 2-D integer ids,
    the others of their shape (None otherwise)."""
    ids, mask, labels = fields.input_ids, fields.attention_mask, fields.labels
    ids = ids if isinstance(ids, Tensor) and ids.ndim == 2 and not ids.is_floating_point() else None
    mask = mask if ids is not None and mask is not None and mask.shape == ids.shape else None
    labels = labels if ids is not None and labels is not None and labels.shape == ids.shape else None
    return ids, mask, labels, fields.paths.get("attention_mask")


def dated(verdicts: Any, step: int | None) -> Any:
    """``verdicts`` (one, several or None) with the step of those without one set to ``step`` (None: unchanged)."""
    if step is None or verdicts is None:
        return verdicts
    items = [verdicts] if isinstance(verdicts, Verdict) else list(verdicts)
    return [v if v is None or v.step is not None else dataclasses.replace(v, step=step) for v in items]
