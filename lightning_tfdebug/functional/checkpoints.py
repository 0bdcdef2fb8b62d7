"""CheckpointAudit's readings of checkpoint contents, without a Trainer and without files: the step counts of an
optimizer's state, weight checksums, and what a checkpoint being loaded holds (for the resume rules of
:mod:`lightning_tfdebug.functional.checkpoint_checks`). Opening files is :mod:`lightning_tfdebug.core.checkpoints`'s.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from lightning_tfdebug.functional.memory import chunked_sums


def max_step(state: Mapping[Any, Any]) -> float | None:
    """Largest ``step`` count over an optimizer's per-parameter states (host floats; resume / save time only)."""
    steps = []
    for entry in state.values():
        if isinstance(entry, Mapping) and "step" in entry:
            step = entry["step"]
            steps.append(float(step.item() if isinstance(step, Tensor) else step))  # host sync: save/resume only
    return max(steps) if steps else None


def checksums(tensors: Sequence[Tensor]) -> list[tuple[float, float]]:
    """(sum, sum of squares) of every tensor in float64, moved to the host in one transfer."""
    if not tensors:
        return []
    with torch.no_grad():
        device = tensors[0].device
        by_device: dict[torch.device, list[int]] = {}
        for i, t in enumerate(tensors):
            by_device.setdefault(t.device, []).append(i)
        stats = torch.zeros(len(tensors), 2, dtype=torch.float64, device=device)
        for index in by_device.values():  # memory: one 2 MiB float64 buffer, no float64 copy of a tensor
            group = [tensors[i].detach() for i in index]
            rows = torch.tensor(index, device=device)
            stats[rows, 0] = chunked_sums(group).to(device)
            stats[rows, 1] = chunked_sums(group, squares=True).to(device)
    return [tuple(row) for row in stats.tolist()]  # host sync: one per resume


def restored_state(checkpoint: Mapping[str, Any]) -> dict[str, Any]:
    """What a checkpoint being loaded holds, for :func:`~lightning_tfdebug.functional.checkpoint_checks.
    resume_problems`: the floating weights' ``names``, ``dtypes`` and checksums (``sums``), every optimizer's largest
    step count (``steps``) and learning rates (``lrs``), the GradScaler's ``scale``, the ``global_step``."""
    weights = checkpoint.get("state_dict", {})
    names = [k for k, v in weights.items() if isinstance(v, Tensor) and v.is_floating_point()]
    states = [s for s in checkpoint.get("optimizer_states", []) if isinstance(s, Mapping)]
    scale = None
    for value in checkpoint.values():
        if isinstance(value, Mapping) and "scale" in value and "growth_factor" in value:
            scale = float(value["scale"])
    return {
        "names": names,
        "dtypes": {k: str(weights[k].dtype) for k in names},
        "sums": checksums([weights[k] for k in names]),
        "steps": [max_step(s.get("state", {})) for s in states],
        "lrs": [[float(g["lr"]) for g in s.get("param_groups", [])] for s in states],
        "scale": scale,
        "global_step": checkpoint.get("global_step"),
    }
