"""One reduction per measuring step for the whole pack (issue 25).

On a measuring step each member declares, as device tensors, ``sums`` (added up over ranks), ``anys`` (0/1 flags, 1
where any rank set them), ``maxes`` (maximum over ranks) and ``rows`` (a vector per rank, declared by name and read
back with :meth:`Reduced.named_rows`). Inside :class:`~lightning_tfdebug.TFDebug` one :class:`StepReduction` serves
every member with **one** ``all_reduce`` after the hook; a callback used alone runs its own at once.

What travels (float64, so counts stay exact): ``[sums | anys | world x (maxes + rows)]``, summed over ranks. Maxima
and rows cost one slot per rank (each rank writes its own block, zeros elsewhere), so keep them to a few scalars;
what grows with the model belongs in sums or anys.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_tfdebug.core.distributed import world_size


@dataclass(frozen=True)
class Reduced:
    """What one member declared, reduced over every rank (float64 device tensors).

    Attributes:
        sums: ``(n_sums,)`` summed over ranks.
        anys: ``(n_anys,)`` 1.0 where any rank set the flag, else 0.0.
        maxes: ``(n_maxes,)`` maximum over ranks.
        rows: ``(world_size, n_rows)``: every rank's row, rank ``r`` at index ``r``.
        row_names: the names of the row's fields, in order, when it was declared by name.
    """

    sums: Tensor
    anys: Tensor
    maxes: Tensor
    rows: Tensor
    row_names: tuple[str, ...] = ()

    def named_rows(self, rows: Sequence[Sequence[float]] | None = None) -> list[dict[str, float]]:
        """Every rank's row as ``{field: value}`` (rank ``r`` at index ``r``); ``rows``: the host copy of :attr:`rows`
        when the member already made it, else it is made here (a host sync)."""
        if rows is None:
            rows = self.rows.tolist()  # host sync: the caller's one transfer of this measuring step
        return [dict(zip(self.row_names, row, strict=True)) for row in rows]


@dataclass
class Declaration:
    """One member's part of a step's reduction: its tensors and what to do with the result."""

    owner: Any
    then: Callable[[Reduced], None] | None
    sums: Tensor
    anys: Tensor
    maxes: Tensor
    rows: Tensor
    failed: bool = False  # the member's own code failed on this rank: zeros of its usual sizes, and this flag
    row_names: tuple[str, ...] = ()  # the row's fields, when it was declared by name

    @property
    def sizes(self) -> tuple[int, int, int, int]:
        return self.sums.numel(), self.anys.numel(), self.maxes.numel(), self.rows.numel()


def declaration(
    owner: Any,
    then: Callable[[Reduced], None],
    device: torch.device,
    sums: Tensor | Sequence[Any] | None = None,
    anys: Tensor | Sequence[Any] | None = None,
    maxes: Tensor | Sequence[Any] | None = None,
    rows: Tensor | Sequence[Any] | Mapping[str, Any] | None = None,
) -> Declaration:
    """A :class:`Declaration` with every part a 1-D float64 tensor on ``device`` (None: empty). ``rows`` given as a
    mapping ``{field: value}`` keeps its field names (in the mapping's order) for :meth:`Reduced.named_rows`."""

    def flat(value: Tensor | Sequence[Any] | None) -> Tensor:
        if value is None or (not isinstance(value, Tensor) and len(value) == 0):
            return torch.zeros(0, dtype=torch.float64, device=device)
        if not isinstance(value, Tensor):
            value = torch.stack([torch.as_tensor(v, dtype=torch.float64, device=device).reshape(()) for v in value])
        return value.detach().reshape(-1).to(device=device, dtype=torch.float64)

    if isinstance(rows, Mapping):
        row, names = named_row(rows, device), tuple(rows)
        return Declaration(owner, then, flat(sums), flat(anys), flat(maxes), row, row_names=names)
    return Declaration(owner, then, flat(sums), flat(anys), flat(maxes), flat(rows))


def row_fields(row_type: type, values: Mapping[str, Any]) -> dict[str, Any]:
    """``values`` (host numbers or device scalars) in the field order of the dataclass ``row_type``, the same on
    every rank.

    Raises:
        KeyError: if ``values`` lacks a field or holds a name that is not one.
    """
    names = [f.name for f in dataclasses.fields(row_type)]
    extra = set(values) - set(names)
    if extra:
        raise KeyError(f"{row_type.__name__} has no field {sorted(extra)}.")
    return {name: values[name] for name in names}


def named_row(fields: Mapping[str, Any], device: torch.device) -> Tensor:
    """The values of ``fields`` in order, as one float64 vector on ``device``: the host numbers in one copy to the
    device, the device scalars where they are (no sync)."""
    values = list(fields.values())
    host = [i for i, v in enumerate(values) if not isinstance(v, Tensor)]
    copied = torch.tensor([float(values[i]) for i in host], dtype=torch.float64).to(device).unbind() if host else ()
    on_host = dict(zip(host, copied))
    return torch.stack(
        [
            on_host[i] if i in on_host else values[i].detach().reshape(()).to(device, torch.float64)
            for i in range(len(values))
        ]
    )


def reduce_declarations(declared: Sequence[Declaration]) -> list[Reduced]:
    """Reduce every declaration over the ranks with one ``all_reduce`` (none in a single process).

    Every rank must call this on the same step with declarations of the same sizes in the same order.
    """
    return _reduce(declared)[0]


def _reduce(declared: Sequence[Declaration]) -> tuple[list[Reduced], list[int]]:
    """The reduced declarations, and per declaration the number of ranks on which its member failed."""
    if not declared:
        return [], []
    world = world_size()
    device = declared[0].sums.device
    if world == 1:
        reduced = [Reduced(d.sums, (d.anys > 0).double(), d.maxes, d.rows.unsqueeze(0), d.row_names) for d in declared]
        return reduced, [int(d.failed) for d in declared]
    rank = dist.get_rank()
    sums = torch.cat([d.sums.to(device) for d in declared])
    # one count per declaration at the end of the sums: on how many ranks its member failed (0 on a healthy step)
    sums = torch.cat([sums, torch.tensor([float(d.failed) for d in declared], dtype=torch.float64, device=device)])
    anys = torch.cat([d.anys.to(device) for d in declared])
    own = torch.cat([t.to(device) for d in declared for t in (d.maxes, d.rows)])
    table = torch.zeros(world, own.numel(), dtype=torch.float64, device=device)
    table[rank] = own  # this rank's block; the others' stay zero, so the sum over ranks is the gathered table
    packed = torch.cat([sums, anys, table.reshape(-1)])
    # collective: the pack's one all_reduce of this measuring step, the same length on every rank
    dist.all_reduce(packed)
    n_sums, n_anys = sums.numel(), anys.numel()
    sums, anys = packed[:n_sums], packed[n_sums : n_sums + n_anys] > 0
    table = packed[n_sums + n_anys :].view(world, own.numel())
    failures = [int(v) for v in sums[n_sums - len(declared) :].tolist()]  # host sync: with the members' own read
    out: list[Reduced] = []
    s = a = o = 0
    for d in declared:
        n_s, n_a, n_m, n_r = d.sizes
        maxes = table[:, o : o + n_m].amax(0) if n_m else table.new_zeros(0)
        rows = table[:, o + n_m : o + n_m + n_r]
        out.append(Reduced(sums[s : s + n_s], anys[a : a + n_a].double(), maxes, rows, d.row_names))
        s, a, o = s + n_s, a + n_a, o + n_m + n_r
    return out, failures


def payload_slots(declared: Sequence[Declaration], world: int) -> int:
    """Number of float64 slots one rank sends in :func:`reduce_declarations` for ``world`` ranks."""
    return sum(1 + d.sizes[0] + d.sizes[1] + world * (d.sizes[2] + d.sizes[3]) for d in declared)


@dataclass
class StepReduction:
    """The declarations of one measuring step, reduced together by :meth:`run` (one collective, after each hook the
    pack forwards; members declare on steps chosen from ``global_step``, so every rank runs the same collective)."""

    pending: list[Declaration] = field(default_factory=list)
    last_slots: int = 0  # slots per rank of the last reduction run (for the payload figures)
    members: list[Any] = field(default_factory=list)  # the members that declare into it, in the pack's order
    step_at_start: int = -1  # global_step when the current batch started (set by the pack)
    #: a member failed on this rank alone and waits for its stand-in (see :meth:`_stand_ins`): from then on the pack
    #: runs this reduction at every batch's end, not only after declarations
    stand_in_due: bool = False
    #: per member (by id): the hook it declares in and the sizes of its declaration, from the last reduction (the same
    #: on every rank): what a rank whose member failed sends in its place
    layouts: dict[int, tuple[str, tuple[int, int, int, int], torch.device]] = field(default_factory=dict)

    def add(self, declared: Declaration) -> None:
        self.pending.append(declared)

    def clear(self) -> None:
        self.pending.clear()

    def can_stand_in(self, member: Any) -> bool:
        """Whether a failure of ``member`` on this rank alone can be told to the other ranks through this reduction:
        its declarations have a known layout and come on steps its cadence decides (see :meth:`run`)."""
        known = id(member) in self.layouts and any(m is member for m in self.members)
        return known and member.declares_at(0, True) is not None

    def _stand_ins(self, trainer: Any, hook: str) -> None:
        """Zeros with the failure flag for every member that failed on this rank and would declare in ``hook`` now,
        so the collective keeps its shape and every rank learns of the failure at the same step."""
        stepped = getattr(trainer, "global_step", self.step_at_start) != self.step_at_start
        declared = {id(d.owner) for d in self.pending}
        for member in self.members:
            failure = getattr(member, "failure", None)
            layout = self.layouts.get(id(member))
            if failure is None or failure.get("everywhere") is not False or layout is None or layout[0] != hook:
                continue
            if id(member) in declared:  # it declared, then failed in the same hook: its declaration carries the flag
                for d in self.pending:
                    if d.owner is member:
                        d.failed = True
                continue
            if not member.declares_at(self.step_at_start, stepped):
                continue
            zeros = [torch.zeros(n, dtype=torch.float64, device=layout[2]) for n in layout[1]]
            self.pending.append(Declaration(member, None, *zeros, failed=True))

    def run(self, trainer: Any, hook: str = "on_train_batch_end") -> None:
        """Reduce what was declared in ``hook`` (one collective) and hand each member its part, under its guard.

        A member whose own code failed on some rank gets no part: it stands aside on every rank at this step."""
        self._stand_ins(trainer, hook)
        if not self.pending:
            return
        order = {id(m): i for i, m in enumerate(self.members)}
        declared = sorted(self.pending, key=lambda d: order.get(id(d.owner), len(order)))  # the same on every rank
        self.pending = []
        self.last_slots = payload_slots(declared, world_size())
        with torch.no_grad():
            results, failures = _reduce(declared)
        for d, reduced, failed in zip(declared, results, failures):
            if not d.failed:
                self.layouts[id(d.owner)] = (hook, d.sizes, d.sums.device)
            if failed:
                d.owner.failed_on_some_rank(trainer, failed, hook)
            elif d.then is not None:
                d.owner.conclude(trainer, d.then, reduced)
