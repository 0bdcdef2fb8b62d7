"""What OptimizerAudit reads from the optimizers and the model, without a Trainer: the wiring of the param groups
(:func:`read_wiring`, once), the learning rates, modules left in eval mode and the device flags of the per-step
checks. Nothing moves a value to the host unless its docstring says so."""

from __future__ import annotations

import copy
import math
import warnings
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from lightning_tfdebug.primitives.tensors import clean_param_name, local_tensor

_MODE_DEPENDENT = (nn.Dropout, nn.modules.batchnorm._BatchNorm, nn.modules.instancenorm._InstanceNorm)


@dataclass(frozen=True)
class GroupReading:
    """One param group as the wiring audit reads it.

    Attributes:
        label: the group's name in findings and logged keys (:func:`group_label`).
        optimizer: the optimizer's class name.
        weight_decay: the group's ``weight_decay`` (0.0 when unset).
        decoupled: the group sets ``decoupled_weight_decay`` (Adam's and friends' AdamW mode).
        lr: the group's peak LR: ``initial_lr`` when a scheduler recorded it (a warm-up starts far below the peak),
            else ``lr``; None when the group has neither.
        eps: ``eps`` of an Adam-family group (one with ``betas``) when it is a number, else None.
        float16: the group holds float16 parameters (so an Adam-family optimizer keeps float16 moments).
        decayed_1d: the trainable one-dimensional parameters (norm weights, biases) the group decays.
        decayed_embeddings: the trainable embedding tables the group decays.
    """

    label: str
    optimizer: str
    weight_decay: float = 0.0
    decoupled: bool = False
    lr: float | None = None
    eps: float | None = None
    float16: bool = False
    decayed_1d: tuple[str, ...] = ()
    decayed_embeddings: tuple[str, ...] = ()


@dataclass(frozen=True)
class WiringReading:
    """How the optimizers hold the module's parameters, by name.

    Attributes:
        groups: every param group of every optimizer, in order.
        missing: trainable parameters in no param group.
        twice: parameters in more than one param group or optimizer.
        frozen: frozen parameters (``requires_grad=False``) the optimizers hold.
        strangers: how many tensors the optimizers hold that are not parameters of the module.
    """

    groups: tuple[GroupReading, ...] = ()
    missing: tuple[str, ...] = ()
    twice: tuple[str, ...] = ()
    frozen: tuple[str, ...] = ()
    strangers: int = 0


@dataclass
class Wiring:
    """:func:`read_wiring`'s result: the ``reading`` the rules decide on, and what later measuring steps watch."""

    reading: WiringReading = field(default_factory=WiringReading)
    decayed_1d: list[nn.Parameter] = field(default_factory=list)
    """The trainable 1-D parameters under weight decay: their norm is measured (``TFD324`` as a warning)."""
    decay_groups: list[dict[str, Any]] = field(default_factory=list)
    """The param groups that decay them: their ``lr * weight_decay`` is added up between measurements."""
    frozen_ids: set[int] = field(default_factory=set)
    """``id`` of the frozen parameters the optimizers hold: one is compared across a step (``TFD322``)."""

    def decay_rate(self) -> float:
        """The strongest ``lr * weight_decay`` of :attr:`decay_groups` now (0.0 without any): the rate at which the
        decay shrinks the 1-D parameters per step. Their current ``lr``: read it on measuring steps only."""
        return max((float(g["lr"]) * float(g.get("weight_decay", 0.0) or 0.0) for g in self.decay_groups), default=0.0)


def group_label(optimizer_index: int, group_index: int, group: Mapping[str, Any], several: bool) -> str:
    """A param group's name: its ``name`` entry when it has one, else ``group<i>``; ``opt<j>.`` in front when there
    are ``several`` optimizers."""
    name = group.get("name")
    label = name if isinstance(name, str) and name else f"group{group_index}"
    return f"opt{optimizer_index}.{label}" if several else label


def labelled_groups(optimizers: Sequence[torch.optim.Optimizer]) -> list[tuple[str, torch.optim.Optimizer, dict]]:
    """Every param group of every optimizer with its :func:`group_label` and its optimizer, in order."""
    several = len(optimizers) > 1
    return [
        (group_label(oi, gi, group, several), optimizer, group)
        for oi, optimizer in enumerate(optimizers)
        for gi, group in enumerate(optimizer.param_groups)
    ]


def read_wiring(model: nn.Module, optimizers: Sequence[torch.optim.Optimizer]) -> Wiring:
    """Walk the param groups against the module's parameters (host-side: names, shapes, dtypes, group entries;
    frozen parameters are not counted among the decayed ones)."""
    named: dict[int, tuple[str, nn.Parameter]] = {}
    for name, param in model.named_parameters(remove_duplicate=True):
        named.setdefault(id(param), (clean_param_name(name), param))
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    membership: dict[int, int] = defaultdict(int)
    wiring, groups, strangers = Wiring(), [], 0
    for label, optimizer, group in labelled_groups(optimizers):
        decay = float(group.get("weight_decay", 0.0) or 0.0)
        one_d, embed = [], []
        for param in group["params"]:
            membership[id(param)] += 1
            if id(param) not in named:
                strangers += 1
            elif param.requires_grad and decay > 0 and param.ndim <= 1:
                one_d.append(param)
            elif param.requires_grad and decay > 0 and id(param) in embeddings:
                embed.append(named[id(param)][0])
        if one_d:
            wiring.decayed_1d.extend(one_d)
            wiring.decay_groups.append(group)
        eps = group.get("eps")
        lr = group.get("initial_lr", group.get("lr"))
        groups.append(
            GroupReading(
                label=label,
                optimizer=type(optimizer).__name__,
                weight_decay=decay,
                decoupled=bool(group.get("decoupled_weight_decay", False)),
                lr=None if lr is None else float(lr),
                eps=eps if "betas" in group and isinstance(eps, (int, float)) and not isinstance(eps, bool) else None,
                float16=any(p.dtype == torch.float16 for p in group["params"]),
                decayed_1d=tuple(named[id(p)][0] for p in one_d),
                decayed_embeddings=tuple(embed),
            )
        )
    wiring.frozen_ids = {pid for pid, (_, p) in named.items() if not p.requires_grad and pid in membership}
    wiring.reading = WiringReading(
        groups=tuple(groups),
        missing=tuple(n for pid, (n, p) in named.items() if p.requires_grad and pid not in membership),
        twice=tuple(n for pid, (n, _) in named.items() if membership.get(pid, 0) > 1),
        frozen=tuple(n for pid, (n, _) in named.items() if pid in wiring.frozen_ids),
        strangers=strangers,
    )
    return wiring


def read_lrs(optimizers: Sequence[torch.optim.Optimizer]) -> dict[str, float]:
    """The learning rate of every param group, by :func:`group_label`, as the optimizer will apply it next (host
    sync for a tensor LR: call it on measuring steps only)."""
    return {label: float(group["lr"]) for label, _, group in labelled_groups(optimizers)}


@dataclass(frozen=True)
class ScheduleReading:
    """The LR schedulers that record a base LR: the largest of those ``base_lrs``, their ``interval`` settings and their
    class names (both sorted)."""

    base_lr: float
    intervals: tuple[str, ...] = ()
    names: tuple[str, ...] = ()


def read_schedules(configs: Iterable[Any]) -> ScheduleReading | None:
    """A :class:`ScheduleReading` of Lightning's scheduler configs (``trainer.lr_scheduler_configs``: host-side
    attributes only); None when no scheduler records ``base_lrs``."""
    configs = [c for c in configs if getattr(c.scheduler, "base_lrs", None)]
    if not configs:
        return None
    return ScheduleReading(
        base_lr=max(float(lr) for c in configs for lr in c.scheduler.base_lrs),
        intervals=tuple(sorted({str(c.interval) for c in configs})),
        names=tuple(sorted({type(c.scheduler).__name__ for c in configs})),
    )


REPLAY_LIMIT = 100_000
"""The most scheduler steps a replay takes (a schedule that has not reached its peak by then is reported so)."""


@dataclass(frozen=True)
class ScheduleCourse:
    """The course of one LR scheduler from the current step, replayed on a copy (:func:`replay_schedule`).

    Attributes:
        scheduler: its class name.
        interval: Lightning's ``interval`` for it (``"step"`` or ``"epoch"``).
        peak: its configured peak, the largest of its ``base_lrs``.
        start: the optimizer step the replay starts from.
        end: the optimizer step the run ends at.
        run_max: the highest LR it reaches by ``end``.
        half_step: the first optimizer step at which its LR is at least half of ``peak`` (None: not in the replay).
        peak_step: the first optimizer step at which it reaches ``peak`` (None: not in the replay).
        rises: its LR rises at some point of the replay.
        replayed: the optimizer steps the replay covered.
    """

    scheduler: str
    interval: str
    peak: float
    start: int
    end: int
    run_max: float
    half_step: int | None
    peak_step: int | None
    rises: bool
    replayed: int


class _StandIn:
    """The optimizer a replayed scheduler steps: copies of the param groups' settings, no parameters."""

    _opt_called = True  # torch's scheduler checks, on its first step, that the optimizer stepped

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
        self.param_groups = copy.deepcopy(groups)  # a tensor LR is written in place: never the live one
        self.defaults = dict(getattr(optimizer, "defaults", {}))

    def step(self) -> None:  # pragma: no cover - never called by a scheduler
        pass

    step._wrapped_by_lr_sched = True  # type: ignore[attr-defined]


def replay_schedule(
    config: Any, start: int, end: float, steps_per_epoch: float, shared: Iterable[Any] = ()
) -> ScheduleCourse | None:
    """The course of the scheduler of a Lightning scheduler ``config`` from optimizer step ``start`` to ``end``, and
    past it until it reaches its peak (at most :data:`REPLAY_LIMIT` scheduler steps), without touching it: a deep copy
    steps a stand-in optimizer; ``shared`` (the module, the Trainer) is referenced by the copy, never copied. None
    when it cannot be told: no base LR (``base_lrs`` or the groups' ``initial_lr``), an unbounded run, a scheduler
    that needs a metric or fails on a copy."""
    scheduler = config.scheduler
    optimizer = getattr(scheduler, "optimizer", None)
    base = getattr(scheduler, "base_lrs", None) or [g["initial_lr"] for g in _groups(optimizer) if "initial_lr" in g]
    per_unit = 1.0 if config.interval == "step" else steps_per_epoch
    period = int(max(1, config.frequency) * per_unit) if math.isfinite(per_unit) and per_unit >= 1 else 0
    if optimizer is None or not base or not math.isfinite(end) or period < 1:
        return None
    memo = {id(optimizer): _StandIn(optimizer), **{id(obj): obj for obj in shared}}
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            replica = copy.deepcopy(scheduler, memo)
            return _follow(replica, config, start, int(end), period, max(float(lr) for lr in base))
    except Exception:  # a scheduler that cannot be copied or stepped alone: nothing is said about its course
        return None


def _groups(optimizer: Any) -> list[dict[str, Any]]:
    return list(getattr(optimizer, "param_groups", []))


def _follow(replica: Any, config: Any, start: int, end: int, period: int, peak: float) -> ScheduleCourse:
    """Step ``replica`` (once every ``period`` optimizer steps) from ``start`` until its peak is reached and either the
    run is covered or its LR stops rising."""
    step, first, top, run_max = start, math.nan, -math.inf, 0.0
    half_step = peak_step = None
    for _ in range(REPLAY_LIMIT):
        lr = max(float(v) for v in replica.get_last_lr())
        first = lr if math.isnan(first) else first
        if step <= end:
            run_max = max(run_max, lr)
        if half_step is None and lr >= 0.5 * peak:
            half_step = step
        if peak_step is None and lr >= peak * (1 - 1e-6):
            peak_step = step
        past_run, at_top = step >= end, lr <= top
        if (peak_step is not None and (at_top or past_run)) or (past_run and at_top):
            break  # at the top of the schedule, or past the run and its peak (or no longer rising)
        top = max(top, lr)
        replica.step()
        step += period
    rises = max(top, lr) > first * (1 + 1e-6)
    name, interval = type(replica).__name__, str(config.interval)
    return ScheduleCourse(name, interval, peak, start, end, run_max, half_step, peak_step, rises, step - start)


def is_transformer(module: nn.Module) -> bool:
    """Whether the model has attention: an ``nn.MultiheadAttention`` or a module whose class name says Attention."""
    return any(
        isinstance(m, nn.MultiheadAttention) or "attention" in type(m).__name__.lower() for m in module.modules()
    )


def modules_left_in_eval(module: nn.Module) -> list[str]:
    """The mode-dependent submodules (dropout that drops something, batch or instance norm) in eval mode."""
    return [
        name or type(module).__name__
        for name, m in module.named_modules()
        if not m.training and isinstance(m, _MODE_DEPENDENT) and (not isinstance(m, nn.Dropout) or m.p > 0)
    ]


def stale_grad_flags(optimizers: Iterable[torch.optim.Optimizer]) -> Tensor | None:
    """One flag per param group (on the device): its first trainable parameter holds a non-zero ``.grad``. Whether
    a ``.grad`` exists is host-side; its values are read only where one does. None when none does."""
    probes = []
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            param = next((p for p in group["params"] if p.requires_grad), None)
            if param is not None and param.grad is not None:
                probes.append(param)
    if not probes:
        return None
    with torch.no_grad():  # memory: a reduction per gradient, no copy of it
        return torch.stack([local_tensor(p.grad).any().to(probes[0].device) for p in probes])


@dataclass(frozen=True)
class Snapshot:
    """A parameter and a copy of this rank's part of it, taken before an optimizer step."""

    name: str
    param: Tensor
    before: Tensor

    @classmethod
    def of(cls, name: str, param: Tensor) -> Snapshot:
        # memory: a copy of this rank's part of the parameter, in its dtype, between the two hooks of a measuring step
        return cls(clean_param_name(name), param, local_tensor(param.detach()).clone())

    def changed(self) -> Tensor:
        """1.0 (on the device) when the parameter differs from the copy in any byte, else 0.0."""
        return (local_tensor(self.param.detach()) != self.before).any().float()


def snapshot_step(
    optimizer: torch.optim.Optimizer, names: Mapping[int, str], frozen_ids: set[int], budget: float = math.inf
) -> tuple[list[Snapshot], list[Snapshot], int]:
    """Copies taken before ``optimizer`` steps: per param group whose LR is above 0, its first parameter with a
    gradient whose copy fits what is left of ``budget`` bytes, and one frozen parameter the optimizer holds (torch
    optimizers skip it; ``TFD322`` becomes a warning when it moves). ``names``: parameter names by ``id``. Also
    returns how many groups had a parameter with a gradient but none that fit."""
    snaps, frozen, unfit = [], [], 0

    def pick(params: Iterable[Tensor]) -> Tensor | None:
        nonlocal budget
        for param in params:
            local = local_tensor(param.detach())
            cost = local.numel() * (local.element_size() + 1)  # the copy, and the comparison's boolean mask
            if local.numel() and cost <= budget:
                budget -= cost
                return param
        return None

    with torch.no_grad():
        for gi, group in enumerate(optimizer.param_groups):
            if not float(group["lr"]) > 0:  # a host float, read by read_lrs on this measuring step
                continue
            candidates = [p for p in group["params"] if p.grad is not None]
            param = pick(candidates)
            if param is not None:
                snaps.append(Snapshot.of(names.get(id(param), f"group{gi}.param"), param))
            elif any(local_tensor(p.detach()).numel() for p in candidates):
                unfit += 1
        param = pick(p for group in optimizer.param_groups for p in group["params"] if id(p) in frozen_ids)
        if param is not None:
            frozen.append(Snapshot.of(names.get(id(param), "frozen"), param))
    return snaps, frozen, unfit


def parameters_norm(params: Iterable[Tensor]) -> Tensor | None:
    """The L2 norm over this rank's part of ``params`` (one foreach norm, on the device); None when it holds none."""
    shards = [t for t in (local_tensor(p.detach()) for p in params) if t.numel()]
    if not shards:
        return None
    with torch.no_grad():
        return torch.linalg.vector_norm(torch.stack([n.float() for n in torch._foreach_norm(shards)]))
