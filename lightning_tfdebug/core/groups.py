"""Parameter groups: how per-parameter statistics are rolled up into a few readable keys.

By default each child of an outermost ``nn.ModuleList`` is a group (``blocks.0``), ``nn.Embedding`` parameters outside
those form ``embeddings``, the output projection (a module named ``*head``, else the last ``nn.Linear`` outside the
blocks) ``head``, and the rest ``other``; or by regular expressions, or by the first ``depth`` name segments.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lightning_tfdebug.core.distributed import plan_sharding
from lightning_tfdebug.primitives.tensors import clean_param_name, local_tensor


@dataclass(frozen=True)
class ParamGroups:
    """Trainable parameters, their clean names, and the group each one belongs to.

    Attributes:
        names: clean parameter names (wrapper segments removed), in model order.
        params: the parameters (same order).
        group_names: the distinct groups, in first-seen order.
        index: for each parameter, the position of its group in ``group_names``.
    """

    names: tuple[str, ...]
    params: tuple[torch.Tensor, ...]
    group_names: tuple[str, ...]
    index: tuple[int, ...]

    def index_tensor(self, device: torch.device) -> torch.Tensor:
        return torch.tensor(self.index, dtype=torch.long, device=device)

    def members(self, group: str) -> list[str]:
        g = self.group_names.index(group)
        return [n for n, i in zip(self.names, self.index) if i == g]


def _outermost_module_lists(model: nn.Module) -> list[str]:
    lists = [clean_param_name(name + ".") for name, m in model.named_modules() if isinstance(m, nn.ModuleList)]
    lists = [n for n in lists if n != "."]  # a ModuleList as the root itself is unusual; ignore it
    return [n for n in lists if not any(n != o and n.startswith(o) for o in lists)]


def default_group_of(model: nn.Module) -> dict[str, str]:
    """Map each clean parameter name of ``model`` to its default group (see module docstring)."""
    block_prefixes = _outermost_module_lists(model)
    embedding_prefixes: list[str] = []
    linear_prefixes: list[str] = []
    head_prefix: str | None = None
    for name, module in model.named_modules():
        clean = clean_param_name(name + ".") if name else ""
        if any(clean.startswith(b) for b in block_prefixes) or not clean:
            continue
        if isinstance(module, nn.Embedding):
            embedding_prefixes.append(clean)
        elif isinstance(module, nn.Linear):
            linear_prefixes.append(clean)
            if clean.rstrip(".").split(".")[-1].endswith("head"):
                head_prefix = clean
    if head_prefix is None and linear_prefixes:
        head_prefix = linear_prefixes[-1]

    out: dict[str, str] = {}
    for raw, _ in model.named_parameters():
        name = clean_param_name(raw)
        group = "other"
        for prefix in block_prefixes:
            if name.startswith(prefix):
                rest = name[len(prefix) :]
                group = prefix + rest.split(".", 1)[0]
                break
        else:
            if any(name.startswith(e) for e in embedding_prefixes):
                group = "embeddings"
            elif head_prefix is not None and name.startswith(head_prefix):
                group = "head"
        out[name] = group
    return out


def build_param_groups(
    model: nn.Module,
    *,
    groups: Mapping[str, str] | None = None,
    depth: int | None = None,
    trainable_only: bool = True,
) -> ParamGroups:
    """Collect parameters and assign each to a group.

    Args:
        model: the module (possibly wrapped by FSDP1/FSDP2/``torch.compile``; wrapper name segments are removed).
        groups: ``{group_name: regex}``; the first regex that ``re.search``-matches a parameter's clean name wins,
            unmatched parameters go to ``other``. Takes precedence over ``depth``.
        depth: group by the first ``depth`` dot-separated segments of the clean name.
        trainable_only: skip parameters with ``requires_grad=False``.
    """
    compiled = {g: re.compile(p) for g, p in (groups or {}).items()}
    defaults = default_group_of(model) if not compiled and depth is None else {}
    names: list[str] = []
    params: list[torch.Tensor] = []
    group_of: list[str] = []
    for raw, p in model.named_parameters():
        if trainable_only and not p.requires_grad:
            continue
        name = clean_param_name(raw)
        if compiled:
            group = next((g for g, rx in compiled.items() if rx.search(name)), "other")
        elif depth is not None:
            group = ".".join(name.split(".")[:depth])
        else:
            group = defaults.get(name, "other")
        names.append(name)
        params.append(p)
        group_of.append(group)
    group_names = tuple(dict.fromkeys(group_of))
    index = tuple(group_names.index(g) for g in group_of)
    return ParamGroups(tuple(names), tuple(params), group_names, index)


def validate_group_args(groups: Mapping[str, str] | None, depth: int | None) -> None:
    """Check ``groups``/``depth`` arguments in ``__init__`` with clear messages."""
    if groups is not None:
        if not isinstance(groups, Mapping) or not groups:
            raise ValueError(f"`groups` must be a non-empty mapping of group name to regex, or None; got {groups!r}.")
        for g, pattern in groups.items():
            if not isinstance(g, str) or not isinstance(pattern, str):
                raise TypeError(f"`groups` maps names to regex strings; got {g!r}: {pattern!r}.")
            try:
                re.compile(pattern)
            except re.error as err:
                raise ValueError(f"`groups[{g!r}]` is not a valid regular expression ({err}): {pattern!r}.") from err
    if depth is not None and (isinstance(depth, bool) or not isinstance(depth, int) or depth < 1):
        raise ValueError(f"`group_depth` must be a positive integer or None; got {depth!r}.")


@dataclass(frozen=True)
class ReductionLayout:
    """Everything a callback needs to reduce per-group statistics across ranks (built once per fit, on the first
    measuring step, after the strategy wrapped the model).

    Attributes:
        groups: the parameters and their groups.
        index: ``(n_params,)`` long tensor on the parameters' device: each parameter's group.
        weights: ``(n_params,)`` fp32 tensor: each parameter's weight in sum-type reductions (``1/replicas``).
        sharded: whether reductions need a collective (see :func:`~lightning_tfdebug.core.distributed.plan_sharding`).
        tied: the groups holding a parameter that several modules share (input embeddings tied with the output head).
    """

    groups: ParamGroups
    index: torch.Tensor
    weights: torch.Tensor
    sharded: bool
    tied: tuple[str, ...] = ()

    @property
    def n_groups(self) -> int:
        return len(self.groups.group_names)


def training_model(trainer: Any, pl_module: nn.Module) -> nn.Module:
    """The module whose parameters the optimizer updates: the strategy's wrapper when there is one (FSDP1 registers
    the root's flat parameter on it, not on the LightningModule)."""
    wrapped = getattr(trainer.strategy, "model", None)
    return wrapped if isinstance(wrapped, nn.Module) else pl_module


def build_layout(
    model: nn.Module, *, groups: Mapping[str, str] | None = None, depth: int | None = None
) -> ReductionLayout | None:
    """Group the trainable parameters of ``model`` and plan their reduction; None if it has none."""
    param_groups = build_param_groups(model, groups=groups, depth=depth)
    if not param_groups.params:
        return None
    plan = plan_sharding(param_groups.params, root=model)
    device = local_tensor(param_groups.params[0]).device
    return ReductionLayout(
        groups=param_groups,
        index=param_groups.index_tensor(device),
        weights=torch.tensor(plan.weights, dtype=torch.float32, device=device),
        sharded=plan.sharded,
        tied=tied_groups(model, param_groups),
    )


def tied_groups(model: nn.Module, groups: ParamGroups) -> tuple[str, ...]:
    """The groups of ``groups`` holding a parameter registered under more than one name in ``model`` (tied)."""
    uses = Counter(id(p) for _, p in model.named_parameters(remove_duplicate=False))
    return tuple(dict.fromkeys(groups.group_names[i] for p, i in zip(groups.params, groups.index) if uses[id(p)] > 1))
