"""SpikeGuard's work on a spike step: rebuild the recorded model call for the step's batch, re-run it for per-sample
losses, the groups' gradient norms, and the spike bundle (:func:`write_spike_bundle`). Spike steps only: host reads
here are deliberate."""

from __future__ import annotations

import os
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor

from lightning_tfdebug.core.batch import step_rng_state
from lightning_tfdebug.core.calls import StepRecording
from lightning_tfdebug.core.groups import build_param_groups
from lightning_tfdebug.functional.memory import budget_for
from lightning_tfdebug.functional.spike_checks import SpikeReading
from lightning_tfdebug.functional.spikes import per_sample_losses
from lightning_tfdebug.primitives import call_finder, calls

#: where the spike bundles go, under the run's tfdebug directory
SPIKE_DIR = "spikes"


COMPILED = "the forward is compiled: its call is not recorded (module hooks would make torch.compile recompile it)"
"""Why attribution stands aside on a compiled forward."""


def read_recording(
    recording: StepRecording, asker: object, fields: Any, module: torch.nn.Module
) -> calls.ModelCall | str:
    """The model call among a step's recorded calls, or why none (:func:`find_call`); ``asker`` is done with the
    recording."""
    try:
        return find_call(recording.calls(), fields, module)
    finally:
        recording.done(asker)


def find_call(recorded: list[calls.RecordedCall], fields: Any, module: torch.nn.Module) -> calls.ModelCall | str:
    """The model call among ``recorded`` that took the batch's token ids (its structure kept, its tensors released),
    or why there is none."""
    ids, mask, labels = fields.input_ids, fields.attention_mask, fields.labels
    if not isinstance(ids, Tensor) or ids.ndim != 2 or ids.is_floating_point():
        return "the batch has no 2-D token ids"
    mask = mask if isinstance(mask, Tensor) and mask.shape == ids.shape else None
    labels = labels if isinstance(labels, Tensor) and labels.shape == ids.shape else None
    found = call_finder.find_model_call(recorded, ids, mask, labels, -100, module)
    if not isinstance(found, str):
        found.release()  # the recorded output and tensors go; the call's structure stays
    return found


def call_inputs(
    found: calls.ModelCall | None, fields: Any
) -> tuple[dict[Any, Tensor], Tensor, Tensor | None, Tensor | None]:
    """The recorded call's replacements for a batch (``fields``: its ``primitives.batch`` reading):
    ``(replacements, ids, mask, labels)``."""
    assert found is not None and found.primary is not None
    ids, mask, labels = fields.input_ids, fields.attention_mask, fields.labels
    mask = mask if isinstance(mask, Tensor) and mask.shape == ids.shape else None
    labels = labels if isinstance(labels, Tensor) and labels.shape == ids.shape else None
    cut = found.columns(ids)
    repl: dict[Any, Tensor] = {found.primary.path: cut.transpose(0, 1) if found.primary.seq_first else cut}
    if found.mask_path is not None and mask is not None:
        m = found.mask_value(found.columns(mask))
        repl[found.mask_path] = m.transpose(0, 1) if found.mask_seq_first else m
    for slot in found.slots:
        if slot.primary:
            continue
        if slot.label_like and labels is not None:
            cut_labels = found.columns(labels)
            repl[slot.path] = cut_labels.transpose(0, 1) if slot.seq_first else cut_labels
        else:
            raise ValueError(f"the model call takes another token tensor ({slot.name}) this guard cannot rebuild")
    return repl, ids, mask, labels


def group_norms(pl_module: pl.LightningModule) -> list[tuple[str, float]]:
    """Each parameter group's gradient norm, largest first (spike steps only; one host read)."""
    groups = build_param_groups(pl_module)
    norms: dict[str, Tensor] = {}
    for p, gi in zip(groups.params, groups.index):
        if p.grad is None:
            continue
        group = groups.group_names[gi]
        sq = p.grad.detach().float().pow(2).sum()
        norms[group] = norms[group] + sq if group in norms else sq
    if not norms:
        return []
    values = torch.stack(list(norms.values())).sqrt().tolist()
    return sorted(zip(norms, values), key=lambda kv: -kv[1])


def write_spike_bundle(
    guard: Any, trainer: pl.Trainer, pl_module: pl.LightningModule, reading: SpikeReading, replayed: Any
) -> str | None:
    """Write SpikeGuard ``guard``'s bundle of this spike through the pack's bundle writer; its path, or None."""
    from lightning_tfdebug.repro.bundles import capture_rng, host_copy, run_info, state_size_bytes, write_bundle

    state = pl_module.state_dict()
    size = state_size_bytes(state)
    budget = budget_for(guard.memory_budget_mb, guard._params, trainer.optimizers)
    keep = size <= budget
    meta: dict[str, Any] = {
        "kind": "spike",
        "batch_idx": guard._batch_idx,
        "world_size": trainer.world_size,
        "lr": reading.lr,
        "value_name": reading.value_name,
        "value": reading.value,
        "baseline": reading.baseline,
        "skipped": reading.skipped,
        "skipped_steps": guard.skipped_steps,
        "rows": [s.row for s in reading.samples],
        "groups": reading.groups[:8],
        "run": run_info(trainer, pl_module),
        "model_state": {
            "saved": keep,
            "reason": f"{size / 2**20:.1f} MB" + ("" if keep else f" exceeds the budget of {budget / 2**20:.0f} MB"),
            "checkpoint": _last_checkpoint(trainer),
        },
        "attribution_error": reading.attribution_error,
    }
    batch: dict[str, Any] = {"batch": host_copy(guard._batch)}
    if replayed is not None and guard._found is not None:
        call, losses = replayed
        meta["per_sample_losses"] = losses
        meta["shift"] = call["shift"]
        meta["call_module"] = _module_name(pl_module, guard._found.call.module)
        meta["call_paths"] = [list(p) for p in call["repl"]]
        batch["call_args"] = _replaced(guard._found, call["repl"])
        batch["targets"] = call["targets"].detach().cpu()
    rng = capture_rng(cpu=step_rng_state(trainer, guard._batch, guard._batch_idx))
    path = write_bundle(
        os.path.join(guard.tfdebug_dir, SPIKE_DIR),
        step=reading.step,
        rank=trainer.global_rank,
        meta=meta,
        batch=batch,
        rng=rng,
        model_state=state if keep else None,
    )
    return path


def replay_losses(
    pl_module: torch.nn.Module, found: calls.ModelCall, repl: dict[Any, Tensor], targets: Tensor, shift: int
) -> Tensor:
    """Per-sample losses of the model call on replaced inputs: ``no_grad``, eval mode, the RNG forked (the run's
    generators are left as they were)."""
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() and torch.cuda.is_initialized() else []
    was_training = pl_module.training
    with torch.random.fork_rng(devices=devices), torch.no_grad():
        pl_module.eval()
        try:
            output = found.call.call(repl)
        finally:
            pl_module.train(was_training)
    logits = calls.read_logits(output, found.batch_size, found.out_seq_first)
    if logits is None:
        raise ValueError("the model call returned no logits")
    return per_sample_losses(logits, targets.to(logits.device), shift, found.ignore_index)


def _replaced(found: calls.ModelCall, repl: dict[Any, Tensor]) -> dict[str, Any]:
    """The call's arguments with this batch's tensors in place, on the host."""
    args = calls.replace_leaves(found.call.args, {p[1:]: t for p, t in repl.items() if p[0] == "args"})
    kwargs = calls.replace_leaves(found.call.kwargs, {p[1:]: t for p, t in repl.items() if p[0] == "kwargs"})
    from lightning_tfdebug.repro.bundles import host_copy

    return {"args": host_copy(list(args)), "kwargs": host_copy(dict(kwargs))}


def _module_name(root: torch.nn.Module, module: torch.nn.Module) -> str:
    for name, m in root.named_modules():
        if m is module:
            return name
    return ""


def _last_checkpoint(trainer: pl.Trainer) -> str | None:
    for cb in trainer.checkpoint_callbacks:
        path = getattr(cb, "last_model_path", "") or getattr(cb, "best_model_path", "")
        if path:
            return os.path.abspath(path)
    return os.path.abspath(trainer.ckpt_path) if trainer.ckpt_path else None
