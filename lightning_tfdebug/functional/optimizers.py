"""What OptimizerAudit reads from the optimizers and the model, without a Trainer: the wiring of the param groups
(:func:`read_wiring`, once), the learning rates, modules left in eval mode and the device flags of the per-step
checks. Nothing moves a value to the host unless its docstring says so."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from lightning_tfdebug.core.distributed import clean_param_name, local_tensor

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
    with torch.no_grad():
        return torch.stack([(local_tensor(p.grad) != 0).any().to(probes[0].device) for p in probes])


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


def _held_here(param: Tensor) -> bool:
    """This rank holds elements of ``param`` (an FSDP shard may be empty on some ranks)."""
    return local_tensor(param.detach()).numel() > 0


def snapshot_step(
    optimizer: torch.optim.Optimizer, names: Mapping[int, str], frozen_ids: set[int]
) -> tuple[list[Snapshot], list[Snapshot]]:
    """Copies taken before ``optimizer`` steps: one parameter with a gradient per param group whose LR is above 0,
    and one frozen parameter the optimizer holds (torch optimizers skip it; ``TFD322`` becomes a warning when it
    moves). ``names``: parameter names by ``id``."""
    snaps, frozen = [], []
    with torch.no_grad():
        for gi, group in enumerate(optimizer.param_groups):
            if not float(group["lr"]) > 0:  # a host float, read by read_lrs on this measuring step
                continue
            param = next((p for p in group["params"] if p.grad is not None and _held_here(p)), None)
            if param is not None:
                snaps.append(Snapshot.of(names.get(id(param), f"group{gi}.param"), param))
        held = (p for group in optimizer.param_groups for p in group["params"] if id(p) in frozen_ids)
        param = next((p for p in held if _held_here(p)), None)
        if param is not None:
            frozen.append(Snapshot.of(names.get(id(param), "frozen"), param))
    return snaps, frozen


def parameters_norm(params: Iterable[Tensor]) -> Tensor | None:
    """The L2 norm over this rank's part of ``params`` (one foreach norm, on the device); None when it holds none."""
    shards = [t for t in (local_tensor(p.detach()) for p in params) if t.numel()]
    if not shards:
        return None
    with torch.no_grad():
        return torch.linalg.vector_norm(torch.stack([n.float() for n in torch._foreach_norm(shards)]))
