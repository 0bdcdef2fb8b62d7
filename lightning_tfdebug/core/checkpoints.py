"""CheckpointAudit's readers of checkpoint files, sharded directories and the live objects a checkpoint is compared
with; :mod:`lightning_tfdebug.functional.checkpoint_checks` decides."""

from __future__ import annotations

import os
import pickle
from collections.abc import Mapping, Sequence
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor

from lightning_tfdebug.core.model import grad_scaler_of
from lightning_tfdebug.functional.checkpoint_checks import ShardedReading, damaged_checkpoint
from lightning_tfdebug.functional.checkpoints import checksums, max_step
from lightning_tfdebug.functional.verdicts import Verdict


# ------------------------------------------------------------------------------------------------------ live objects
def expectation(trainer: pl.Trainer, pl_module: pl.LightningModule, callback_keys: list[str]) -> dict[str, Any]:
    """What a full checkpoint of this Trainer must hold, from the live objects (taken at save time); checked against
    the file by :func:`~lightning_tfdebug.functional.checkpoint_checks.content_problems`."""
    optimizers = []
    for optimizer in trainer.optimizers:
        with_state = [s for s in optimizer.state.values() if isinstance(s, Mapping) and s]
        optimizers.append(
            {
                "groups": len(optimizer.param_groups),
                "with_state": len(with_state),
                "has_step": any("step" in s for s in with_state),
            }
        )
    plugin = trainer.precision_plugin
    return {
        "global_step": trainer.global_step,
        "params": {k: list(v.shape) for k, v in pl_module.state_dict().items() if isinstance(v, Tensor)},
        "optimizers": optimizers,
        "schedulers": len(trainer.lr_scheduler_configs),
        "scaler_key": type(plugin).__qualname__ if grad_scaler_of(trainer) is not None else None,
        "callbacks": list(callback_keys),
    }


def live_state(trainer: pl.Trainer, pl_module: pl.LightningModule, restored: Mapping[str, Any]) -> dict[str, Any]:
    """The live objects at the start of a resumed fit, in the shape of
    :func:`~lightning_tfdebug.functional.checkpoints.restored_state`. Resume time only."""
    weights = pl_module.state_dict()
    names = [n for n in restored["names"] if n in weights]
    scaler = grad_scaler_of(trainer)
    return {
        "names": names,
        "dtypes": {n: str(weights[n].dtype) for n in names},
        "sums": checksums([weights[n] for n in names]),  # host sync: one per resume
        "steps": [max_step(opt.state) for opt in trainer.optimizers],
        "lrs": [[float(g["lr"]) for g in opt.param_groups] for opt in trainer.optimizers],
        # host sync: resume time only, and only when the checkpoint holds a scale to compare with
        "scale": float(scaler.get_scale()) if scaler is not None and restored["scale"] is not None else None,
        "global_step": trainer.global_step,
    }


def resumable_savers(savers: Sequence[Any]) -> list[str]:
    """The checkpoint callbacks that keep full checkpoints (not ``save_weights_only``; ``save_top_k != 0`` or
    ``save_last``), each named by its class and directory."""
    out = []
    for saver in savers:
        if getattr(saver, "save_weights_only", False):
            continue
        if getattr(saver, "save_top_k", 1) == 0 and not getattr(saver, "save_last", False):
            continue
        where = getattr(saver, "dirpath", None)
        out.append(f"{type(saver).__name__}({where})" if where else type(saver).__name__)
    return out


# ------------------------------------------------------------------------------------------------------------ files
class DamagedCheckpoint(Exception):
    """A checkpoint that cannot be read back: its :class:`Verdict` (``TFD716``) says why."""

    def __init__(self, verdict: Verdict) -> None:
        super().__init__(verdict.message)
        self.verdict = verdict


def _torch_load(path: str, weights_only: bool) -> Any:
    try:  # memory-mapped where the format allows: checking keys and shapes reads no tensor data
        return torch.load(path, map_location="cpu", weights_only=weights_only, mmap=True)
    except RuntimeError as err:
        if "mmap" not in str(err).lower() and "legacy" not in str(err).lower():
            raise
        return torch.load(path, map_location="cpu", weights_only=weights_only)  # legacy (non-zip) format


def load_checkpoint(path: str, *, written_by_this_run: bool) -> tuple[Any, bool]:
    """Open a checkpoint file safely: ``(checkpoint, weights_only)``.

    ``torch.load(weights_only=True)`` first; only a file this run wrote itself falls back to a full unpickling.

    Raises:
        DamagedCheckpoint: the file is empty, cut short or not a valid archive (``TFD716``).
        pickle.UnpicklingError: a file not written by this run holds objects other than data.
    """
    size = os.path.getsize(path)
    try:
        return _torch_load(path, weights_only=True), True
    except pickle.UnpicklingError:  # holds objects other than data (`weights_only` refused them)
        if not written_by_this_run:
            raise
    except (RuntimeError, EOFError, OSError, ValueError) as err:
        raise DamagedCheckpoint(damaged_checkpoint(path, size, err)) from None
    try:
        return _torch_load(path, weights_only=False), False
    except (RuntimeError, EOFError, ValueError, pickle.UnpicklingError) as err:
        raise DamagedCheckpoint(damaged_checkpoint(path, size, err)) from None


def read_sharded(directory: str) -> ShardedReading:
    """What a distributed-checkpoint directory holds, from its ``.metadata`` and file sizes (no tensor is read)."""
    from torch.distributed.checkpoint import FileSystemReader

    meta_path = os.path.join(directory, ".metadata")
    if not os.path.isfile(meta_path):
        return ShardedReading(directory, has_metadata=False, metadata_path=meta_path)
    try:
        metadata = FileSystemReader(directory).read_metadata()
    except Exception as err:  # a cut or foreign metadata file
        size = os.path.getsize(meta_path)
        return ShardedReading(directory, metadata_path=meta_path, metadata_bytes=size, metadata_error=err)
    needed: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        relative = getattr(info, "relative_path", None)
        if relative is not None:
            end = int(getattr(info, "offset", 0)) + int(getattr(info, "length", 0))
            needed[relative] = max(needed.get(relative, 0), end)
    files = {name: os.path.join(directory, name) for name in needed}
    sizes = {name: os.path.getsize(file) if os.path.isfile(file) else None for name, file in files.items()}
    return ShardedReading(directory, metadata_path=meta_path, needed=needed, sizes=sizes)
