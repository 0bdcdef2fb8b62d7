"""MaskProbe's probes of a model that does not read token ids (float features, image patches, per-sequence outputs):
the recorded model call replayed as it was (eval determinism, ``TFD213``) and with the first row's inputs replaced by
another row's (samples stay apart, ``TFD217``). The inputs are whatever the call took; the outputs are read in any
common shape: ``(B, T, ·)``, ``(B, C)``, a model output, a tuple or a dict."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from lightning_tfdebug.callbacks.mask_probe.leak_checks import CrossSampleReading, RepeatReading
from lightning_tfdebug.callbacks.mask_probe.readings import Reading
from lightning_tfdebug.functional.probes import logit_tolerance, max_change
from lightning_tfdebug.primitives.batch import logits_of
from lightning_tfdebug.primitives.calls import RecordedCall, tensor_leaves


def rows_output(output: Any, batch_size: int) -> Tensor | None:
    """The call's outputs as ``(B, P, C)``: its logits, else its first floating-point tensor with ``batch_size`` rows
    (``(B, C)`` becomes ``(B, 1, C)``, ``(B, T, C, ...)`` is flattened after ``C``); None when there is none."""
    found = logits_of(output)
    if found is None or found.ndim < 2 or found.shape[0] != batch_size:
        found = next(
            (t for _, t in tensor_leaves(output) if t.is_floating_point() and t.ndim >= 2 and t.shape[0] == batch_size),
            None,
        )
    if found is None:
        return None
    return found.unsqueeze(1) if found.ndim == 2 else found.flatten(2)


def outer_model_call(calls: list[RecordedCall], batch: Any, batch_idx: int, batch_size: int) -> RecordedCall | None:
    """The first outermost call of ``training_step`` (not the step itself, which Lightning routes through the module
    under DDP; the recording counts it as no level, so the calls inside it are outermost too) that returned one output
    row per batch row."""
    for call in calls:
        if call.depth != 0 or (len(call.args) >= 2 and call.args[0] is batch and call.args[1] == batch_idx):
            continue
        if rows_output(call.output, batch_size) is not None:
            return call
    return None


def batch_rows(call: RecordedCall) -> int | None:
    """How many rows the call's inputs have: the first dimension of its first tensor argument with one."""
    return next((int(t.shape[0]) for _, t in call.leaves() if t.ndim >= 1), None)


def probe_any_inputs(call: RecordedCall, batch_size: int) -> tuple[list[Reading], list[str]]:
    """The readings of the two probes on ``call`` (the caller sets eval mode, ``no_grad`` and the RNG), and the probes
    that could not run, named. Replays: two, or three with two rows or more."""
    out = rows_output(call.call(), batch_size)
    again = rows_output(call.call(), batch_size)
    if out is None or again is None or again.shape != out.shape:
        return [], ["eval determinism", "cross-sample"]
    tolerance = logit_tolerance(out)
    change, where = max_change(out, again)
    readings: list[Reading] = [RepeatReading(change, where[0], where[1], tolerance)]
    if batch_size < 2:
        return readings, ["cross-sample"]
    # the first row's inputs become the last row's, in every argument with a row per sample; the others must hold
    replacements = {}
    for path, t in call.leaves():
        if t.ndim >= 1 and t.shape[0] == batch_size and not torch.equal(t[0], t[-1]):
            changed = t.clone()
            changed[0] = t[-1]
            replacements[path] = changed
    if not replacements:
        return readings, ["cross-sample"]
    moved = rows_output(call.call(replacements), batch_size)
    if moved is None or moved.shape != out.shape:
        return readings, ["cross-sample"]
    change, where = max_change(out[1:], moved[1:])
    readings.append(CrossSampleReading(change, where[0] + 1, where[1], tolerance))
    return readings, []
