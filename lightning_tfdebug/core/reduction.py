"""What crosses ranks, by name: one reduction per measuring step for the whole pack.

A member declares its statistics as **named fields** (device tensors of any shape, or host numbers), in four kinds,
as torchmetrics' ``add_state(name, default, dist_reduce_fx)`` does:

- ``sums``: added up over the ranks;
- ``anys``: 0/1 flags, 1 where any rank set them;
- ``maxes``: the maximum over the ranks;
- ``rows``: one value per rank, every rank's kept (``(world, *shape)``).

The result is a :class:`Reduced` read back by the same names (``reduced.sums["tokens"]``, ``reduced.rows["peak"]``),
or moved to the host in one transfer with :meth:`Reduced.host`. Nothing is read by offset: adding a field never
shifts another. Inside :class:`~lightning_tfdebug.TFDebug` one :class:`StepReduction` serves every member with **one**
``all_reduce`` after the hook (:meth:`DebugCallback.reduce_then`); :func:`reduce_now` reduces at once (a callback used
alone, or a decision needed inside the hook).

What travels (float64, so counts stay exact): ``[sums | anys | world x (maxes + rows)]``, summed over ranks. Maxima
and rows cost one slot per rank (each rank writes its own block, zeros elsewhere), so keep them to a few scalars;
what grows with the model belongs in sums or anys.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_tfdebug.core.distributed import world_size

Value = Tensor | float | int | bool | Sequence[Any]
"""A field's value: a device tensor of any shape, a host number, or a sequence of numbers."""


@dataclass(frozen=True)
class Fields:
    """The names and shapes of one kind of declared fields, in declaration order (the same on every rank)."""

    names: tuple[str, ...] = ()
    shapes: tuple[tuple[int, ...], ...] = ()

    @property
    def size(self) -> int:
        return sum(math.prod(s) for s in self.shapes)

    def unpack(self, flat: Tensor, lead: tuple[int, ...] = ()) -> dict[str, Tensor]:
        """``{name: tensor}`` from a vector packed by :func:`pack_fields` (``lead``: leading dims, e.g. the world)."""
        out, at = {}, 0
        for name, shape in zip(self.names, self.shapes, strict=True):
            n = math.prod(shape)
            out[name] = flat[..., at : at + n].reshape((*lead, *shape))
            at += n
        return out


def pack_fields(values: Mapping[str, Value] | None, device: torch.device, kind: str) -> tuple[Tensor, Fields]:
    """``values`` as one float64 vector on ``device`` and the :class:`Fields` that read it back: host numbers go to the
    device in one copy, device tensors stay where they are (no sync).

    Raises:
        TypeError: if ``values`` is not a mapping of names (a positional vector would be read by offset).
    """
    if values is None or len(values) == 0:
        return torch.zeros(0, dtype=torch.float64, device=device), Fields()
    if not isinstance(values, Mapping):
        raise TypeError(
            f"Declare {kind} as a mapping {{name: value}} so they are read back by name, got a {type(values).__name__}."
        )
    names = tuple(str(k) for k in values)
    host: list[float] = []
    host_at: dict[str, tuple[int, tuple[int, ...]]] = {}
    for name, value in values.items():
        if not isinstance(value, Tensor):
            flat, shape = _host_values(value)  # host numbers: no tensor, no device involved
            host_at[name] = (len(host), shape)
            host += flat
    copied = torch.tensor(host, dtype=torch.float64).to(device) if host else None  # one copy for every host number
    parts, shapes = [], []
    for name, value in values.items():
        if isinstance(value, Tensor):
            parts.append(value.detach().reshape(-1).to(device=device, dtype=torch.float64))
            shapes.append(tuple(value.shape))
        else:
            at, shape = host_at[name]
            assert copied is not None
            parts.append(copied[at : at + math.prod(shape)])
            shapes.append(shape)
    return torch.cat(parts), Fields(names, tuple(shapes))


def _host_values(value: Any) -> tuple[list[float], tuple[int, ...]]:
    """A host number or a (nested) sequence of them as a flat list of floats and its shape."""
    if not isinstance(value, Sequence):
        return [float(value)], ()
    parts = [_host_values(v) for v in value]
    inner = parts[0][1] if parts else ()
    if any(shape != inner for _, shape in parts):
        raise ValueError("A field given as nested sequences must be rectangular.")
    return [x for flat, _ in parts for x in flat], (len(parts), *inner)


@dataclass(frozen=True)
class Layout:
    """The fields of one declaration, by kind."""

    sums: Fields = Fields()
    anys: Fields = Fields()
    maxes: Fields = Fields()
    rows: Fields = Fields()


@dataclass(frozen=True)
class Reduced:
    """What one member declared, reduced over every rank, read back by name (float64 device tensors).

    Attributes:
        sums: ``{name: tensor}`` summed over ranks, each in its declared shape.
        anys: ``{name: tensor}`` 1.0 where any rank set the flag, else 0.0.
        maxes: ``{name: tensor}`` the maximum over ranks.
        rows: ``{name: tensor}`` of shape ``(world_size, *declared shape)``: rank ``r``'s value at index ``r``.
        world_size: the number of ranks the rows come from.
    """

    sums: dict[str, Tensor]
    anys: dict[str, Tensor]
    maxes: dict[str, Tensor]
    rows: dict[str, Tensor]
    world_size: int = 1

    def host(self) -> HostReduced:
        """Every field on the host (floats, or nested lists for vector fields), in **one** transfer."""
        kinds = ("sums", "anys", "maxes", "rows")
        both = host_fields({(kind, name): t for kind in kinds for name, t in getattr(self, kind).items()})
        parts = {kind: {name: v for (k, name), v in both.items() if k == kind} for kind in kinds}
        return HostReduced(**parts, world_size=self.world_size)


def host_fields(values: Mapping[Any, Tensor | float]) -> dict[Any, Any]:
    """``values`` on the host by the same names: a 0-d tensor or number becomes a float, a tensor of shape ``s`` a
    nested list of shape ``s``; every tensor in **one** transfer (stacked, not one ``.item()`` each)."""
    tensors = [v for v in values.values() if isinstance(v, Tensor)]
    if not tensors:
        return {k: float(v) for k, v in values.items()}  # type: ignore[arg-type]
    device = tensors[0].device
    flat_parts = [
        v.detach().reshape(-1).to(device, torch.float64)
        if isinstance(v, Tensor)
        else torch.tensor([float(v)], dtype=torch.float64, device=device)
        for v in values.values()
    ]
    flat = torch.cat(flat_parts).tolist()  # host sync: the caller's one transfer of this step
    out, at = {}, 0
    for (name, value), part in zip(values.items(), flat_parts):
        n = part.numel()
        shape = tuple(value.shape) if isinstance(value, Tensor) else ()
        out[name] = flat[at] if shape == () else _nest(flat[at : at + n], shape)
        at += n
    return out


def _nest(flat: list[float], shape: tuple[int, ...]) -> list[Any]:
    """``flat`` as nested lists of ``shape`` (row-major)."""
    if len(shape) == 1:
        return list(flat)
    step = math.prod(shape[1:])
    return [_nest(flat[i * step : (i + 1) * step], shape[1:]) for i in range(shape[0])]


@dataclass(frozen=True)
class HostReduced:
    """:class:`Reduced` on the host: the same names, floats or nested lists."""

    sums: dict[str, Any]
    anys: dict[str, Any]
    maxes: dict[str, Any]
    rows: dict[str, Any]
    world_size: int = 1

    def per_rank(self) -> list[dict[str, Any]]:
        """The rows as one ``{name: value}`` per rank, rank ``r`` at index ``r``."""
        return [{name: values[r] for name, values in self.rows.items()} for r in range(self.world_size)]


@dataclass
class Declaration:
    """One member's part of a step's reduction: its packed tensors, their layout and what to do with the result."""

    owner: Any
    then: Callable[[Reduced], None] | None
    sums: Tensor
    anys: Tensor
    maxes: Tensor
    rows: Tensor
    layout: Layout = Layout()
    failed: bool = False  # the member's own code failed on this rank: zeros of its usual sizes, and this flag

    @property
    def sizes(self) -> tuple[int, int, int, int]:
        return self.sums.numel(), self.anys.numel(), self.maxes.numel(), self.rows.numel()


def declaration(
    owner: Any,
    then: Callable[[Reduced], None] | None,
    device: torch.device,
    sums: Mapping[str, Value] | None = None,
    anys: Mapping[str, Value] | None = None,
    maxes: Mapping[str, Value] | None = None,
    rows: Mapping[str, Value] | None = None,
) -> Declaration:
    """A :class:`Declaration` of named fields (see the module's docstring), packed on ``device``.

    Raises:
        TypeError: if a kind is given as anything but a mapping of names.
    """
    packed = {
        kind: pack_fields(values, device, kind)
        for kind, values in (("sums", sums), ("anys", anys), ("maxes", maxes), ("rows", rows))
    }
    layout = Layout(**{kind: fields for kind, (_, fields) in packed.items()})
    return Declaration(owner, then, *(flat for flat, _ in packed.values()), layout=layout)


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


def gather_records(record: dict[str, Any]) -> list[dict[str, Any]]:
    """Every rank's ``record`` (a small dict of names, strings and numbers), rank ``r`` at index ``r``: for what
    does not fit in numbers (module names in a report). One ``all_gather_object`` (none in a single process); every
    rank must call it on the same step. Off the hot path only: it pickles."""
    if world_size() == 1:
        return [record]
    everyone: list[Any] = [None] * world_size()
    dist.all_gather_object(everyone, record)  # collective
    return everyone


def _named(d: Declaration, sums: Tensor, anys: Tensor, maxes: Tensor, rows: Tensor, world: int) -> Reduced:
    lay = d.layout
    return Reduced(
        lay.sums.unpack(sums),
        lay.anys.unpack(anys),
        lay.maxes.unpack(maxes),
        lay.rows.unpack(rows, (world,)),
        world_size=world,
    )


def reduce_now(
    device: torch.device,
    *,
    sums: Mapping[str, Value] | None = None,
    anys: Mapping[str, Value] | None = None,
    maxes: Mapping[str, Value] | None = None,
    rows: Mapping[str, Value] | None = None,
    across_ranks: bool = True,
) -> Reduced:
    """Reduce named fields at once and return them by name.

    ``across_ranks=False`` keeps this rank's values (no collective: the statistics are already the same on every
    rank, e.g. DDP's all-reduced gradients). Otherwise one ``all_reduce`` (none in a single process): every rank must
    call it on the same step with the same names and shapes.
    """
    declared = declaration(None, None, device, sums=sums, anys=anys, maxes=maxes, rows=rows)
    if not across_ranks:
        return _reduce([declared], world=1)[0][0]
    return _reduce([declared])[0][0]


def reduce_declarations(declared: Sequence[Declaration]) -> list[Reduced]:
    """Reduce every declaration over the ranks with one ``all_reduce`` (none in a single process).

    Every rank must call this on the same step with declarations of the same sizes in the same order.
    """
    return _reduce(declared)[0]


def _reduce(declared: Sequence[Declaration], world: int | None = None) -> tuple[list[Reduced], list[int]]:
    """The reduced declarations, and per declaration the number of ranks on which its member failed (``world=1``:
    this rank's values, no collective)."""
    if not declared:
        return [], []
    world = world_size() if world is None else world
    device = declared[0].sums.device
    if world == 1:
        reduced = [_named(d, d.sums, (d.anys > 0).double(), d.maxes, d.rows.unsqueeze(0), 1) for d in declared]
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
        out.append(_named(d, sums[s : s + n_s], anys[a : a + n_a].double(), maxes, rows, world))
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
    layouts: dict[int, tuple[str, tuple[int, int, int, int], torch.device, Layout]] = field(default_factory=dict)

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
            self.pending.append(Declaration(member, None, *zeros, layout=layout[3], failed=True))

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
                self.layouts[id(d.owner)] = (hook, d.sizes, d.sums.device, d.layout)
            if failed:
                d.owner.failed_on_some_rank(trainer, failed, hook)
            elif d.then is not None:
                d.owner.conclude(trainer, d.then, reduced)
