"""The memory a measuring step may add, and measurements that fit in it. Host numbers and tensors in; no Trainer.

A weight snapshot (UpdateRatio's) stays under a budget (:func:`default_budget_bytes`) by being taken in parts
(:func:`plan_snapshot`), one part per measuring step; :func:`chunked_sums` adds tensors up in float64 without a
float64 copy of a whole tensor (see ``docs/callbacks/update_ratio.md``, Memory).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from lightning_tfdebug.functional.norms import grouped_sq_norms

MIB = 2**20
"""Bytes in a mebibyte: ``memory_budget_mb`` counts in MiB."""

BUDGET_FRACTION = 0.02
"""By default a measuring step may add this fraction of the training state (weights, gradients, optimizer state)..."""

BUDGET_FLOOR = 32 * MIB
"""... or this many bytes, whichever is larger: small models keep their whole snapshot."""

SNAPSHOT_BYTES = 4
"""Bytes per element of a snapshot: the weights are copied in fp32 whatever their dtype."""

CHUNK_ELEMENTS = 2**18
"""Elements per chunk of :func:`chunked_sum`: its float64 copy of one chunk is 2 MiB."""


# ---------------------------------------------------------------------------------------------------------- budget
def training_state_bytes(params: Iterable[Tensor], optimizers: Iterable[torch.optim.Optimizer]) -> int:
    """Bytes of the weights ``params``, of their gradients (those that exist) and of every tensor in the
    ``optimizers``' state. Sizes are read from ``numel()``, the global size of a DTensor, so every rank of a sharded
    run computes the same number (no tensor data is read)."""
    return sum(training_state_split(params, optimizers))


def training_state_split(params: Iterable[Tensor], optimizers: Iterable[torch.optim.Optimizer]) -> tuple[int, int, int]:
    """:func:`training_state_bytes` in its three parts: ``(weights, gradients, optimizer state)``, in bytes."""
    weights = gradients = state = 0
    for p in params:
        weights += p.numel() * p.element_size()
        if p.grad is not None:
            gradients += p.grad.numel() * p.grad.element_size()
    for optimizer in optimizers:
        for values in optimizer.state.values():
            for value in values.values():
                if isinstance(value, Tensor):
                    state += value.numel() * value.element_size()
    return weights, gradients, state


def default_budget_bytes(state_bytes: int) -> int:
    """``max(2% of state_bytes, 32 MiB)``: what a measuring step may add to peak memory unless told otherwise."""
    return max(int(BUDGET_FRACTION * state_bytes), BUDGET_FLOOR)


def budget_bytes(memory_budget_mb: float | None, state_bytes: int) -> int:
    """The budget in bytes: ``memory_budget_mb`` MiB when set, else :func:`default_budget_bytes` of the state."""
    if memory_budget_mb is None:
        return default_budget_bytes(state_bytes)
    return int(min(memory_budget_mb * MIB, 2**62))  # inf: no limit


def check_budget(memory_budget_mb: float | None) -> float | None:
    """``memory_budget_mb`` as a float, or None.

    Raises:
        ValueError: if it is not a number of MiB above 0 (nor None).
    """
    valid = memory_budget_mb is None or (
        isinstance(memory_budget_mb, (int, float)) and not isinstance(memory_budget_mb, bool) and memory_budget_mb > 0
    )
    if not valid:
        raise ValueError(f"`memory_budget_mb` must be a number of MiB > 0 or None; got {memory_budget_mb!r}.")
    return None if memory_budget_mb is None else float(memory_budget_mb)


def budget_for(
    memory_budget_mb: float | None, params: Iterable[Tensor], optimizers: Iterable[torch.optim.Optimizer]
) -> int:
    """:func:`budget_bytes` of ``memory_budget_mb``, or by default of the training state of ``params`` and
    ``optimizers`` (host arithmetic on sizes, no tensor data read)."""
    if memory_budget_mb is not None:
        return budget_bytes(memory_budget_mb, 0)
    return budget_bytes(None, training_state_bytes(params, optimizers))


def group_snapshot_bytes(numels: Sequence[int], index: Sequence[int], n_groups: int) -> list[int]:
    """Bytes of each group's fp32 snapshot, given each parameter's element count ``numels`` and group ``index``."""
    out = [0] * n_groups
    for numel, g in zip(numels, index):
        out[g] += numel * SNAPSHOT_BYTES
    return out


# ------------------------------------------------------------------------------------------------------------ plan
@dataclass(frozen=True)
class SnapshotPlan:
    """Which groups each measuring step snapshots, so that no step copies more than ``budget`` bytes.

    Attributes:
        budget: the budget in bytes.
        group_bytes: each group's snapshot size in bytes.
        parts: the groups measured together on one measuring step (indices), in turn; one part holding every group
            when the whole snapshot fits (:attr:`whole`).
        too_large: the groups larger than the budget on their own: never measured.
    """

    budget: int
    group_bytes: tuple[int, ...]
    parts: tuple[tuple[int, ...], ...]
    too_large: tuple[int, ...]

    @property
    def whole(self) -> bool:
        """Every group on every measuring step (today's one snapshot)."""
        return len(self.parts) == 1 and len(self.parts[0]) == len(self.group_bytes)

    def part_at(self, measurement: int) -> tuple[int, ...]:
        """The groups the ``measurement``-th measuring step snapshots (none when no group fits the budget)."""
        return self.parts[measurement % len(self.parts)] if self.parts else ()

    @property
    def largest_part(self) -> int:
        """Bytes of the largest part: the most a measuring step copies."""
        return max((sum(self.group_bytes[g] for g in part) for part in self.parts), default=0)


def plan_snapshot(group_bytes: Sequence[int], budget: int) -> SnapshotPlan:
    """Split the groups into parts of at most ``budget`` bytes each (first fit, in group order); a group larger than
    the budget is in no part (``too_large``)."""
    sizes = tuple(int(b) for b in group_bytes)
    if sum(sizes) <= budget:
        return SnapshotPlan(budget, sizes, (tuple(range(len(sizes))),), ())
    parts: list[list[int]] = []
    room: list[int] = []
    too_large = []
    for g, size in enumerate(sizes):
        if size > budget:
            too_large.append(g)
            continue
        for i, left in enumerate(room):
            if size <= left:
                parts[i].append(g)
                room[i] -= size
                break
        else:
            parts.append([g])
            room.append(budget - size)
    return SnapshotPlan(budget, sizes, tuple(tuple(p) for p in parts), tuple(too_large))


# ---------------------------------------------------------------------------------------------------- chunked sums
def chunked_sums(
    tensors: Sequence[Tensor], dtype: torch.dtype = torch.float64, chunk: int = CHUNK_ELEMENTS, *, squares: bool = False
) -> Tensor:
    """``torch.stack([t.sum(dtype=dtype) for t in tensors])`` (of the squares, with ``squares``) without a copy of a
    whole tensor: a 1-D ``dtype`` tensor on the first tensor's device, no host sync.

    Memory: ``t.sum(dtype=torch.float64)`` converts the whole tensor first (8 bytes per element, one copy per tensor
    shape; +100 MiB peak RSS for a 25.5M-parameter model, ``benchmarks/memory.py``). Here each tensor goes ``chunk``
    elements at a time through one ``dtype`` buffer per device (2 MiB by default), the call's only allocation. Equal
    to the whole sums up to the order of additions; the same on every rank for the same tensors.
    """
    if not tensors:
        return torch.zeros(0, dtype=dtype)
    device = tensors[0].device
    buffers: dict[torch.device, Tensor] = {}
    sums = []
    for tensor in tensors:
        tensor = tensor.detach()
        buffer = buffers.get(tensor.device)
        if buffer is None:  # memory: one chunk of `dtype` per device, for the whole call
            size = min(chunk, max(t.numel() for t in tensors if t.device == tensor.device))
            buffer = buffers[tensor.device] = torch.empty(max(size, 1), dtype=dtype, device=tensor.device)
        total = torch.zeros((), dtype=dtype, device=tensor.device)
        for piece in _pieces(tensor, chunk):
            view = buffer[: piece.numel()].view(piece.shape)
            view.copy_(piece)
            total += view.square_().sum() if squares else view.sum()
        sums.append(total if total.device == device else total.to(device))
    return torch.stack(sums)


def chunked_sum(
    tensor: Tensor, dtype: torch.dtype = torch.float64, chunk: int = CHUNK_ELEMENTS, *, squares: bool = False
) -> Tensor:
    """The sum of one tensor's elements in ``dtype`` (:func:`chunked_sums`), as a 0-dim tensor."""
    return chunked_sums([tensor], dtype, chunk, squares=squares)[0]


def _pieces(tensor: Tensor, chunk: int) -> Sequence[Tensor]:
    """Views of ``tensor`` of at most ``chunk`` elements each (a row larger than that of a non-contiguous tensor: the
    row), covering it once."""
    if tensor.ndim == 0:
        return [tensor]
    if tensor.is_contiguous():
        return tensor.reshape(-1).split(chunk)
    rows = max(1, chunk // max(tensor[0].numel(), 1))
    if tensor[0].numel() <= chunk:
        return tensor.split(rows, dim=0)
    return [piece for row in tensor.unbind(0) for piece in _pieces(row, chunk)]


# -------------------------------------------------------------------------------------------------------- snapshots
def take_snapshot(tensors: Sequence[Tensor], chosen: Sequence[bool] | None = None) -> list[Tensor]:
    """fp32 copies of ``tensors``, or of those ``chosen`` with an empty fp32 tensor in the place of each other one."""
    picked = list(tensors) if chosen is None else [t for t, c in zip(tensors, chosen) if c]
    # memory: the snapshot, 4 bytes per element of the tensors picked (what the budget counts)
    if picked and all(t.dtype == torch.float32 for t in picked):
        copies = list(torch._foreach_mul(picked, 1.0))  # fresh copies in one call (x * 1.0 == x)
    else:
        copies = [t.to(torch.float32, copy=True) for t in picked]
    if chosen is None:
        return copies
    taken = iter(copies)
    return [next(taken) if c else t.new_empty(0, dtype=torch.float32) for t, c in zip(tensors, chosen)]


class WeightSnapshot:
    """The weights before an optimizer step, in fp32, all of them or one part of the groups (a :class:`SnapshotPlan`),
    and the change of each group over the step. Device work only: no host sync.

    Args:
        numels: each parameter's element count (the global one of a DTensor: the same on every rank).
        group_of: each parameter's group.
        index: the same as a long tensor on the parameters' device.
        n_groups: the number of groups.
        weights: each parameter's weight in the per-group sums (``1/replicas`` under sharding), or None.
    """

    def __init__(
        self, numels: Sequence[int], group_of: Sequence[int], index: Tensor, n_groups: int, weights: Tensor | None
    ) -> None:
        self.group_of, self.index, self.n_groups, self.weights = tuple(group_of), index, n_groups, weights
        self.group_bytes = group_snapshot_bytes(numels, group_of, n_groups)
        self.plan: SnapshotPlan | None = None
        self._before: list[Tensor] | None = None  # alive only between the two hooks of a measuring step
        self._part: tuple[int, ...] | None = None  # the groups copied on this step, when not all of them
        self._sq_before: Tensor | None = None  # then each group's ‖W‖² before the step
        self._masks: dict[tuple[int, ...], Tensor] = {}  # each part as a bool mask of groups on the device

    @property
    def taken(self) -> bool:
        """A snapshot waits for the weights after the step."""
        return self._before is not None

    def replan(self, budget: int) -> bool:
        """Plan the parts for ``budget`` bytes unless planned for it already; True when the plan is new."""
        if self.plan is not None and self.plan.budget == budget:
            return False
        self.plan = plan_snapshot(self.group_bytes, budget)
        return True

    def take(self, tensors: Sequence[Tensor], measurement: int) -> None:
        """Copy ``tensors`` (the local weights, before the step) as the ``measurement``-th measuring step's part."""
        self._part = None if self.plan is None or self.plan.whole else self.plan.part_at(measurement)
        self._before = take_snapshot(tensors, self._chosen())
        if self._part is not None:  # each group's ‖W‖² (a fused norm, no copy): did the groups not copied change?
            self._sq_before = grouped_sq_norms(tensors, self.index, self.n_groups, self.weights)[0]

    def change(self, after: Sequence[Tensor]) -> tuple[Tensor, Tensor, tuple[bool, ...] | None]:
        """``(‖ΔW‖² per group, ‖W‖² per group after the step, the groups measured)`` (None: all), freeing the copy.

        Memory: the snapshot becomes ``before - after`` in place (no second copy). A group not measured carries how
        much its ``‖W‖²`` changed instead (did the optimizer step at all)."""
        before, chosen, part = self._before, self._chosen(), self._part
        self._before = self._part = None
        assert before is not None
        pairs = [(b, a) for b, a, c in zip(before, after, chosen or [True] * len(before)) if c]
        if pairs:
            torch._foreach_sub_([b for b, _ in pairs], [a for _, a in pairs])
        delta_sq, _ = grouped_sq_norms(before, self.index, self.n_groups, self.weights)
        del before, pairs
        param_sq, _ = grouped_sq_norms(after, self.index, self.n_groups, self.weights)
        if part is None:
            return delta_sq, param_sq, None
        measured = tuple(g in part for g in range(self.n_groups))
        if part not in self._masks:  # host-to-device copy: once per part
            self._masks[part] = torch.tensor(measured, device=delta_sq.device)
        assert self._sq_before is not None
        delta_sq = torch.where(self._masks[part], delta_sq, (param_sq - self._sq_before).abs())
        self._sq_before = None
        return delta_sq, param_sq, measured

    def _chosen(self) -> list[bool] | None:
        return None if self._part is None else [g in self._part for g in self.group_of]


def plan_notes(plan: SnapshotPlan, names: Sequence[str]) -> list[tuple[str, str, str]]:
    """What a plan measures less often than every measuring step, as ``(check, reason, setting)`` for the member's
    record of checks that do not run in full (``DebugCallback.check_aside``): empty for a whole snapshot."""
    whole = sum(plan.group_bytes) / MIB
    budget = plan.budget / MIB
    notes = []
    if len(plan.parts) > 1:
        notes.append(
            (
                "update ratio of every group on every measuring step",
                f"the fp32 snapshot of all {len(names)} groups ({whole:.1f} MiB) would exceed the memory budget "
                f"({budget:.1f} MiB), so each measuring step snapshots one of {len(plan.parts)} parts: every group's "
                f"ratio is measured once every {len(plan.parts)} measuring steps (the weight norms on every one), and "
                "the total ratio covers the groups measured on that step.",
                f"`memory_budget_mb` >= {whole:.1f}",
            )
        )
    if plan.too_large:
        large = [names[g] for g in plan.too_large]
        largest = max(plan.group_bytes[g] for g in plan.too_large) / MIB
        notes.append(
            (
                f"update ratio of {', '.join(large)}",
                f"the fp32 snapshot of each of these groups is larger than the whole memory budget ({budget:.1f} "
                "MiB), so their update ratio is never measured (their weight norms are).",
                f"`memory_budget_mb` >= {largest:.1f}, or `groups` that split them",
            )
        )
    return notes
