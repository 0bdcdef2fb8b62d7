"""MaskProbe's reach into the run: imports named in its arguments, the loss the real step returned, and the model call
among those the step's one recording holds (:mod:`lightning_tfdebug.core.calls`). Nothing here replays the step."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor

from lightning_tfdebug.callbacks.mask_probe import any_inputs, decisions, order_any, probes
from lightning_tfdebug.callbacks.mask_probe.order_checks import OrderSeenReading
from lightning_tfdebug.core.base import eager_model_calls
from lightning_tfdebug.core.batch import step_batch
from lightning_tfdebug.core.calls import StepRecording, record_step
from lightning_tfdebug.core.logits import training_loss
from lightning_tfdebug.core.model import grad_scaler_of, import_object
from lightning_tfdebug.functional.verdicts import Verdict
from lightning_tfdebug.primitives import call_finder
from lightning_tfdebug.primitives.calls import ModelCall, takes_tokens


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
    if (
        ids is not None
        and labels is None
        and any(  # (features, labels): the only integer tensor is the labels
            isinstance(t, Tensor) and t.is_floating_point() and t.ndim >= 3 and t.shape[:2] == ids.shape
            for t in fields.leaves.values()
        )
    ):
        ids = None
    mask = mask if ids is not None and mask is not None and mask.shape == ids.shape else None
    labels = labels if ids is not None and labels is not None and labels.shape == ids.shape else None
    return ids, mask, labels, fields.paths.get("attention_mask")


def sequence_labels(fields: Any, ids: Tensor | None) -> Tensor | None:
    """The batch's labels as the call's token tensors are compared with: 2-D integers with a row per sample, of any
    length (an encoder-decoder's labels follow the decoder's length, not the source's); None otherwise."""
    labels = fields.labels
    if ids is None or not isinstance(labels, Tensor) or labels.ndim != 2 or labels.is_floating_point():
        return None
    return labels if labels.shape[0] == ids.shape[0] else None


def per_sequence(member: Any, pl_module: pl.LightningModule, fields: tuple) -> str | None:
    """Why the token probes do not apply to the recorded model call when it returns one output per sequence (a
    sequence classifier), else None."""
    found = recorded_model_call(member._recording, fields, member.ignore_index, pl_module, member.model_kind)
    return found if isinstance(found, str) and call_finder.PER_SEQUENCE in found else None


def dated(verdicts: Any, step: int | None) -> Any:
    """``verdicts`` (one, several or None) with the step of those without one set to ``step`` (None: unchanged)."""
    if step is None or verdicts is None:
        return verdicts
    items = [verdicts] if isinstance(verdicts, Verdict) else list(verdicts)
    return [v if v is None or v.step is not None else dataclasses.replace(v, step=step) for v in items]


def outer_call(recording: StepRecording | None, step_args: tuple[Any, int]) -> tuple[Any, int] | None:
    """``(call, rows)``: the outermost model call ``recording`` holds for the batch of ``step_args`` (not the step) and
    how many rows its inputs have; None when there is none."""
    batch, batch_idx = step_args
    calls = [] if recording is None else recording.calls()
    rows = next((r for c in calls if c.depth == 0 and (r := any_inputs.batch_rows(c)) is not None), None)
    call = None if rows is None else any_inputs.outer_model_call(calls, batch, batch_idx, rows)
    return None if call is None or rows is None else (call, rows)


@contextlib.contextmanager
def replaying(trainer: pl.Trainer, pl_module: pl.LightningModule) -> Iterator[None]:
    """The context of a probe's replay of the model: eager, RNG forked, ``no_grad``, the run's precision, eval mode;
    every module's mode restored after."""
    modes = {m: m.training for m in pl_module.modules()}
    try:
        with (
            eager_model_calls(),
            torch.random.fork_rng(),
            torch.no_grad(),
            trainer.precision_plugin.train_step_context(),
        ):
            pl_module.eval()
            yield
    finally:
        for module, flag in modes.items():
            module.training = flag


def probe_features(
    member: Any,
    trainer: pl.Trainer,
    pl_module: pl.LightningModule,
    recording: StepRecording | None,
    step_args: tuple[Any, int],
) -> str:
    """For a batch without token ids: the probes of :mod:`.any_inputs` on the outermost recorded model call (eval mode,
    ``no_grad``, RNG forked, modes restored), logged, covered and emitted by ``member`` (MaskProbe). Returns a sentence
    saying what ran (empty when nothing could). Host sync: one transfer, on the probing step."""
    # the order watch decides at a step every rank fixes here alike, whatever its own probe finds below
    member.order_watch.start(trainer.global_step, _last_step(trainer))
    found = outer_call(recording, step_args)
    if found is None:
        return ""
    call, rows = found
    try:
        with replaying(trainer, pl_module):
            readings, not_run = any_inputs.probe_any_inputs(call, rows)
            order, order_aside = _probe_order(member, trainer, step_args[0], call, rows)
    except Exception as err:  # a call that cannot be replayed: said in the stand-aside's reason
        return f" Replaying the model call failed ({type(err).__name__}: {err})."
    readings = probes.on_host(readings + order, member.to_host)  # host sync: one transfer (probing steps only)
    member.log_scalars(trainer, {k: v for r in readings for k, v in r.logged().items()})
    ran = decisions.rows_verified(readings)
    for row in ran:
        member.cover(row, "verified")  # a finding among the row's codes makes it one in the report
    verdicts = decisions.decide_probe(readings)[0]
    member.emit(trainer, verdicts, synchronized=False)
    noisy = any(v is not None and v.code == "TFD213" for v in verdicts)
    order_any.conclude(member, member.order_watch, readings, order_aside, noisy)
    cover_what_does_not_apply(member, call, rows, order_aside)
    said = f" On the recorded model call, {' and '.join(ran)} were probed" if ran else ""
    return said + (f" ({', '.join(not_run)} could not be)." if not_run else ".")


NO_SEQUENCE_ROWS = ("causal mask", "padding", "label alignment", "target leak into the inputs")
"""The per-position rows that do not apply to a model call that takes no sequence (an image's pixels)."""


def cover_what_does_not_apply(member: Any, call: Any, rows: int, order_aside: str | None) -> None:
    """The Coverage rows the token probes would answer that do not apply to this model call (from shapes, no sync):
    label alignment for one output per sequence (a classifier: no positions whose labels could be shifted), and every
    per-position row for a call that takes no sequence (the order probe found none)."""
    if order_aside is not None and order_aside.startswith("the model call takes no sequence"):
        why = "the model call takes no sequence (no (B, T) ids or (B, T, F) features): nothing per position to check."
        for row in NO_SEQUENCE_ROWS:
            member.cover(row, "n/a", why)
        return
    out = any_inputs.rows_output(call.output, rows)
    if out is not None and out.shape[1] == 1:
        why = "the model returns one output per sequence (a classifier): no per-position labels that could be shifted."
        member.cover("label alignment", "n/a", why)


# ------------------------------------------------------------------------------- the order of an order-blind model
def _last_step(trainer: pl.Trainer) -> float:
    """The fit's last optimizer step as Lightning estimates it (infinite when it cannot)."""
    try:
        return float(trainer.estimated_stepping_batches) - 1
    except Exception:  # a set-up Lightning cannot estimate: the watch decides DECIDE_STEP steps on
        return float("inf")


def _probe_order(member: Any, trainer: pl.Trainer, batch: Any, call: Any, rows: int) -> tuple[list, str | None]:
    """:func:`.order_any.probe_order` on the recorded call (in the caller's eval context): its readings and why it
    could not run; a replay that fails here costs the other probes nothing."""
    try:
        labels = order_any.batch_labels(step_batch(trainer, batch, member._keys).fields, call)
        return order_any.probe_order(call, rows, labels, member.ignore_index)
    except Exception as err:  # an argument the permutation breaks: the row says so
        return [], f"replaying it with its positions permuted failed ({type(err).__name__}: {err})"


def order_batch_start(member: Any, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any) -> int:
    """At a batch's start: its step (returned), and on the decision step of a model order-blind at the first probe,
    the recording of its model call (in ``member``'s recording slot: MaskProbe stood aside on this path, nothing else
    uses it)."""
    watch = member.order_watch
    step = watch.step = trainer.global_step
    if watch.records(step) and member.forward_fn is None and member._recording is None:
        member._recording = record_step(trainer, pl_module, batch, member, takes_tokens)
    return step


def order_batch_end(
    member: Any, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, step_args: tuple[Any, int]
) -> None:
    """At a batch's end: the returned loss of a watched step added on the device; at the decision step (the same on
    every rank), the order probed again on its recorded call, the verdict emitted, and every rank resolves."""
    watch = member.order_watch
    if watch.step is None or watch.done or watch.decide_at is None:
        return
    if watch.window(watch.step):
        watch.add(watch.step, training_loss(trainer, pl_module, outputs))
    if watch.step != watch.decide_at:
        return
    recording, member._recording = member._recording, None
    again = None
    if recording is not None:
        again = _probe_order_again(member, trainer, pl_module, recording, step_args)
        recording.done(member)
    member.emit(trainer, watch.conclude(member, again), synchronized=False)  # host sync: two sums, once per fit
    member.resolve_local_findings(trainer)


def order_fit_end(member: Any, trainer: pl.Trainer) -> None:
    """At the end of a fit stopped before the order decision step (``EarlyStopping``, ``max_time``): the decision, on
    every rank alike, from the first probe's reading and no loss trend (the late window was never read), dated at the
    fit's last step. Every rank that started the watch resolves here (the start and the decision step are the same on
    every rank, whatever each rank's own probe read). Host sync: none (no losses to read)."""
    watch = member.order_watch
    if watch.done or watch.decide_at is None or watch.start_step is None:
        return
    watch.decide_at = max(watch.start_step, trainer.global_step - 1)
    watch.clear_losses()  # an early window alone is no trend
    member.emit(trainer, watch.conclude(member, None), synchronized=False)
    member.resolve_local_findings(trainer)


def _probe_order_again(
    member: Any, trainer: Any, pl_module: Any, recording: Any, step_args: tuple[Any, int]
) -> OrderSeenReading | None:
    """The order probe on the model call ``recording`` holds (eval mode, ``no_grad``, RNG forked, modes restored), on
    the host; None when it cannot run. Host sync: one transfer, at the decision step only."""
    found = outer_call(recording, step_args)
    if found is None:
        return None
    call, rows = found
    with replaying(trainer, pl_module):
        readings, _ = _probe_order(member, trainer, step_args[0], call, rows)
    found = [r for r in probes.on_host(readings, member.to_host) if isinstance(r, OrderSeenReading)]  # host sync (once)
    return found[0] if found else None
