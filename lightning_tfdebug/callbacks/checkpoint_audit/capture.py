"""CheckpointAudit's probe: the first model call the real ``training_step`` made on the first batch, its tensors cut to
a few rows and copied to the host (:func:`probe_call_of`), replayed at each save and right after a resume
(:func:`replay_probe_call`). ``training_step`` itself is never replayed: a step with side effects runs once."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor

from lightning_tfdebug.core.base import eager_model_calls
from lightning_tfdebug.core.batch import step_batch
from lightning_tfdebug.primitives.batch import logits_of, loss_of
from lightning_tfdebug.primitives.calls import RecordedCall, tensor_leaves

PROBE_CHECK = "output on a probe call after resuming"
"""The check the probe serves, as a stand-aside names it."""


def is_the_step(call: RecordedCall, batch: Any, batch_idx: int) -> bool:
    """Whether a recorded call is ``training_step`` itself: Lightning routes the step through the module's own call
    under DDP (``module(batch, batch_idx)`` with ``forward`` redirected); replaying it would replay the step."""
    args = call.args
    return len(args) >= 2 and args[0] is batch and args[1] == batch_idx


def float_output(output: Any) -> Tensor | None:
    """The logits in a call's output, else its first floating-point tensor; None when it has none."""
    logits = logits_of(output)
    if logits is not None:
        return logits
    return next((t for _, t in tensor_leaves(output) if t.is_floating_point()), None)


FINGERPRINT_VALUES = 4096
"""How many output values (evenly spaced over the flattened output) the fingerprint reads."""


def probe_value(output: Tensor | None) -> Tensor | None:
    """A fingerprint of the outputs in [-1, 1] that any change of the weights moves, however the outputs are scaled:
    ``sum(w * x) / sum(|x|)`` over up to :data:`FINGERPRINT_VALUES` evenly spaced values ``x``, with fixed random
    signs ``w``. Another model moves it by about ``1 / sqrt(n)``; the same weights replay it to rounding."""
    if output is None or output.numel() == 0:
        return None
    values = output.detach().float().reshape(-1)
    stride = max(1, values.numel() // FINGERPRINT_VALUES)
    x = values[::stride][:FINGERPRINT_VALUES]
    signs = torch.randint(0, 2, (x.numel(),), generator=torch.Generator().manual_seed(0)).to(x.device) * 2 - 1
    return (signs * x).sum() / x.abs().sum().clamp_min(torch.finfo(torch.float32).tiny)


def batch_rows(trainer: pl.Trainer, batch: Any) -> int | None:
    """How many rows the batch has: its token ids' first dimension, else its first tensor's; None without tensors."""
    view = step_batch(trainer, batch)
    if view.input_ids is not None and view.input_ids.ndim >= 2:
        return int(view.input_ids.shape[0])
    sizes: list[int] = []
    apply_to_collection(batch, Tensor, lambda t: sizes.append(t.shape[0]) if t.ndim else None)
    return sizes[0] if sizes else None


def probe_call_of(
    calls: list[RecordedCall],
    pl_module: pl.LightningModule,
    batch: Any,
    batch_idx: int,
    rows: int | None,
    keep_rows: int,
) -> dict[str, Any] | str:
    """The outermost recorded call of a submodule (or the module itself) that returned a floating-point output, as
    ``{"module": qualified name, "args", "kwargs"}`` with every tensor of the batch's ``rows`` cut to ``keep_rows``
    and copied to the host (once per fit); or why there is none."""
    names = {id(m): n for n, m in pl_module.named_modules()}
    outer = [c for c in calls if c.depth == 0 and not is_the_step(c, batch, batch_idx)]
    call = next((c for c in outer if id(c.module) in names and float_output(c.output) is not None), None)
    if call is None:
        return "no module call made by `training_step` returned a floating-point output to compare"

    def cut(t: Tensor) -> Tensor:
        if rows is not None and t.ndim and t.shape[0] == rows:
            t = t[:keep_rows]
        return t.detach().to("cpu", copy=True)  # host copy: once per fit

    return {
        "module": names[id(call.module)],
        "args": apply_to_collection(call.args, Tensor, cut),
        "kwargs": apply_to_collection(call.kwargs, Tensor, cut),
    }


def replay_probe_call(trainer: pl.Trainer, pl_module: pl.LightningModule, probe: dict[str, Any]) -> float | str | None:
    """The probe call replayed (eval mode, ``no_grad``, RNG forked): the loss it returns, else the fingerprint of its
    outputs (:func:`probe_value`); None when the module is gone; a string saying why when the call fails. Host sync:
    at save / resume time only."""
    module = dict(pl_module.named_modules()).get(probe.get("module"))
    if module is None:
        return None
    move = lambda t: t.to(pl_module.device)  # noqa: E731
    args = apply_to_collection(probe["args"], Tensor, move)
    kwargs = apply_to_collection(probe["kwargs"], Tensor, move)
    modes = {m: m.training for m in pl_module.modules()}
    device = pl_module.device
    devices = [device.index or 0] if device.type == "cuda" else []
    try:
        with (
            eager_model_calls(),  # a compiled forward runs eagerly: the probe compiles nothing new
            torch.random.fork_rng(devices=devices),
            torch.no_grad(),
            trainer.precision_plugin.train_step_context(),
        ):
            pl_module.eval()
            output = module(*args, **kwargs)
    except Exception as err:  # a call that cannot be replayed on stored rows
        return f"replaying the recorded model call on the probe rows failed ({type(err).__name__}: {err})"
    finally:
        for m, flag in modes.items():
            m.training = flag
    value = loss_of(output)
    if value is None or value.numel() != 1:
        value = probe_value(float_output(output))
    return None if value is None else float(value.detach().float())  # host sync: at save / resume time only
