"""UpdateRatio's readings: what one measured optimizer step's update looks like per group (:class:`UpdateReading`),
what earlier measurements left (:class:`UpdateMemory`, updated apart from the decisions of
:mod:`~lightning_tfdebug.functional.update_checks`), the groups' facts read once (:class:`GroupFacts`), and the host
arithmetic the decisions share. Host numbers in; no Trainer.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from lightning_tfdebug.functional.loss import label_counts as count_labels
from lightning_tfdebug.primitives.tracking import Streak


# ------------------------------------------------------------------------------------------------------ readings
@dataclass(frozen=True)
class UpdateReading:
    """One measured optimizer step, on the host, reduced over ranks.

    Attributes:
        step: the optimizer step measured (``global_step`` before it).
        lr: the highest learning rate of the optimizer's param groups at that step.
        total: ``‖ΔW‖ / ‖W‖`` over all trainable parameters.
        param_norm_total: ``‖W‖`` after the step, over all of them.
        ratios: ``‖ΔW‖ / ‖W‖`` per group.
        param_norms: ``‖W‖`` per group after the step.
        delta_sq: ``‖ΔW‖²`` per group.
        grad_sq: ``‖grad‖²`` per group before the step.
        mean_loss: the mean training loss of the batches since the previous measurement (NaN: none returned).
        unigram: the supervised labels' unigram entropy, when this step counted them (else NaN).
        stepped: whether the optimizer changed any weight on this step; None: some group of ``delta_sq`` changed.
            A snapshot in parts (``memory_budget_mb``) measures ``ratios``, ``delta_sq`` and ``total`` of some
            groups only (``total`` NaN: none measured).
    """

    step: int
    lr: float
    total: float
    param_norm_total: float
    ratios: dict[str, float]
    param_norms: dict[str, float]
    delta_sq: dict[str, float]
    grad_sq: dict[str, float]
    mean_loss: float = math.nan
    unigram: float = math.nan
    stepped: bool | None = None

    @classmethod
    def from_squares(
        cls,
        step: int,
        lr: float,
        names: Sequence[str],
        squares: Sequence[float],
        loss_sum: float = 0.0,
        loss_batches: float = 0.0,
        unigram: float = math.nan,
        measured: Sequence[bool] | None = None,
    ) -> UpdateReading:
        """The reading of ``squares``: per group ``‖ΔW‖²``, then ``‖W‖²``, then ``‖grad‖²`` (``3 * len(names)``
        host floats), and the interval's summed loss over ``loss_batches`` batches. ``measured``: the groups the
        snapshot covered (None: all); the ``‖ΔW‖²`` slot of another group holds how much its ``‖W‖²`` changed."""
        n = len(names)
        delta_sq, param_sq, grad_sq = squares[:n], squares[n : 2 * n], squares[2 * n : 3 * n]
        stepped = None if measured is None else sum(delta_sq) > 0  # a group changed, or the norm of one not measured
        kept = [True] * n if measured is None else [bool(m) for m in measured]
        delta = [(g, d, w) for g, d, w, m in zip(names, delta_sq, param_sq, kept) if m]
        total = math.nan
        if delta:
            total = math.sqrt(sum(d for _, d, _ in delta)) / max(math.sqrt(sum(w for _, _, w in delta)), 1e-12)
        return cls(
            step=step,
            lr=lr,
            total=total,
            param_norm_total=math.sqrt(sum(param_sq)),
            ratios={g: math.sqrt(d) / max(math.sqrt(w), 1e-12) for g, d, w in delta},
            param_norms={g: math.sqrt(w) for g, w in zip(names, param_sq)},
            delta_sq={g: d for g, d, _ in delta},
            grad_sq=dict(zip(names, grad_sq)),
            mean_loss=loss_sum / loss_batches if loss_batches else math.nan,
            unigram=unigram,
            stepped=stepped,
        )

    def scalars(self, low: float, high: float) -> dict[str, float]:
        """The logged keys (``UpdateRatio.KEYS``), with the healthy band; ratios of the groups measured only."""
        out = {"update_ratio/param_norm/total": self.param_norm_total}
        if self.ratios:
            out = {"update_ratio/total": self.total, **out}
        for g, norm in self.param_norms.items():
            if g in self.ratios:
                out[f"update_ratio/{g}"] = self.ratios[g]
            out[f"update_ratio/param_norm/{g}"] = norm
        out.update({"update_ratio/band/low": low, "update_ratio/band/high": high})
        return out


@dataclass
class UpdateMemory:
    """What the rules remember between measurements (saved in checkpoints).

    Attributes:
        patience: how many recent learning rates and losses are kept.
        peak_lr: the highest learning rate measured.
        recent_lr: the last ``patience`` learning rates.
        losses: ``(step, mean loss of the interval)`` of the last ``patience`` measurements.
        first_loss: the first finite mean loss measured.
        unigram: the labels' unigram entropy (NaN until counted).
        streak: measurements in a row with the total ratio below ``low`` (``"low"``) and, per group, with gradients
            but no change (``"zero:<group>"``).
        norms: ``(step, group norms, mean loss)`` within the growth window.
    """

    patience: int
    peak_lr: float = 0.0
    recent_lr: deque[float] = field(default_factory=deque)
    losses: deque[tuple[int, float]] = field(default_factory=deque)
    first_loss: float | None = None
    unigram: float = math.nan
    streak: Streak = field(default_factory=Streak)
    norms: deque[tuple[int, dict[str, float], float]] = field(default_factory=deque)

    def __post_init__(self) -> None:
        self.recent_lr = deque(self.recent_lr, maxlen=self.patience)
        self.losses = deque(self.losses, maxlen=self.patience)

    def observe(self, reading: UpdateReading) -> None:
        """Remember the learning rate, the mean loss and the unigram entropy of ``reading``."""
        self.peak_lr = max(self.peak_lr, reading.lr)
        self.recent_lr.append(reading.lr)
        self.losses.append((reading.step, reading.mean_loss))
        if math.isfinite(reading.unigram):
            self.unigram = reading.unigram
        if self.first_loss is None and math.isfinite(reading.mean_loss):
            self.first_loss = reading.mean_loss

    def at_plateau(self, lr: float, decayed_lr_fraction: float) -> bool:
        """The learning rate is at its plateau: not decayed below ``decayed_lr_fraction`` of its peak, and steady
        (within 10%) over the last ``patience`` measurements (not rising in a warm-up)."""
        return (
            lr >= decayed_lr_fraction * self.peak_lr
            and len(self.recent_lr) == self.recent_lr.maxlen
            and max(self.recent_lr) <= 1.1 * min(self.recent_lr)
        )

    def state_dict(self) -> dict[str, Any]:
        return {
            "streak": self.streak.state_dict(),
            "peak_lr": self.peak_lr,
            "recent_lr": list(self.recent_lr),
            "losses": [list(point) for point in self.losses],
            "first_loss": self.first_loss,
            "unigram_entropy": self.unigram if math.isfinite(self.unigram) else None,
            "norms": [list(entry) for entry in self.norms],
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.streak.load_state_dict(state.get("streak", {}))
        self.peak_lr = float(state.get("peak_lr", 0.0))
        self.recent_lr = deque(state.get("recent_lr", []), maxlen=self.patience)
        self.losses = deque(((int(step), float(loss)) for step, loss in state.get("losses", [])), maxlen=self.patience)
        self.first_loss = state.get("first_loss")
        unigram = state.get("unigram_entropy")
        self.unigram = float(unigram) if unigram is not None else math.nan
        entries = ([*entry, math.nan][:3] for entry in state.get("norms", []))  # older checkpoints: no loss
        self.norms = deque((int(step), dict(norms), float(loss)) for step, norms, loss in entries)


@dataclass(frozen=True)
class GroupFacts:
    """What UpdateRatio reads once per layout about each group (host only, no tensor data).

    Attributes:
        params: the ids of the group's parameters.
        numel: the group's element count.
        eps: the coarsest float spacing (``torch.finfo(dtype).eps``) of its parameters.
        outside: whether the group holds a parameter in no optimizer's param groups; None when that cannot be told
            (:func:`outside_optimizers`).
    """

    params: dict[str, tuple[int, ...]]
    numel: dict[str, int]
    eps: dict[str, float]
    outside: dict[str, bool] | None


def group_facts(
    names: Sequence[str], params: Sequence[Tensor], index: Sequence[int], optimizers: Sequence[torch.optim.Optimizer]
) -> GroupFacts:
    """The :class:`GroupFacts` of the groups ``names``, given each of ``params``' group ``index``."""
    outside = outside_optimizers(params, optimizers)
    ids: dict[str, list[int]] = {g: [] for g in names}
    numel, eps, out = dict.fromkeys(names, 0), dict.fromkeys(names, 0.0), dict.fromkeys(names, False)
    for i, (g, p) in enumerate(zip(index, params)):
        name = names[g]
        ids[name].append(id(p))
        numel[name] += p.numel()
        eps[name] = max(eps[name], torch.finfo(p.dtype).eps if p.is_floating_point() else 0.0)
        out[name] = out[name] or (outside is not None and outside[i])
    return GroupFacts({g: tuple(v) for g, v in ids.items()}, numel, eps, None if outside is None else out)


# ---------------------------------------------------------------------------------------------------- helpers
LOSS_FALL_PER_STEP = 1e-3
"""The loss is still falling when its mean fell by at least this fraction of itself per optimizer step over the last
``patience`` measurements (measured: fine-tunes fall by about 0.4% per step, runs with the LR 100x too low by 0.02%
to 0.03%)."""


def loss_fall_per_step(losses: Sequence[tuple[int, float]]) -> float:
    """The fall of the loss from the first to the last of ``losses`` (``(step, mean loss)``, oldest first), as a
    fraction of the first, per optimizer step; NaN when it cannot be told."""
    if len(losses) < 2:
        return math.nan
    (first_step, first), (last_step, last) = losses[0], losses[-1]
    if last_step <= first_step or not (math.isfinite(first) and math.isfinite(last)) or first == 0:
        return math.nan
    return (first - last) / abs(first) / (last_step - first_step)


def loss_still_falling(losses: Sequence[tuple[int, float]], min_fall_per_step: float = LOSS_FALL_PER_STEP) -> bool:
    """Whether the loss over ``losses`` fell by at least ``min_fall_per_step`` of itself per step; False when unknown
    (no loss to read: the ratio alone decides)."""
    rate = loss_fall_per_step(losses)
    return math.isfinite(rate) and rate >= min_fall_per_step


def label_counts(labels: Tensor | None, vocab_size: int, ignore_index: int, device: torch.device) -> Tensor:
    """How often each class ``0 .. vocab_size - 1`` occurs among the supervised labels, on ``device`` (no host sync);
    zeros when the batch holds no integer labels, so every rank packs a vector of the same length."""
    if labels is None or labels.is_floating_point() or labels.dtype == torch.bool:
        return torch.zeros(vocab_size, device=device)
    return count_labels(labels.to(device), vocab_size, ignore_index)


def outside_optimizers(params: Sequence[Tensor], optimizers: Sequence[torch.optim.Optimizer]) -> list[bool] | None:
    """For each of ``params``, whether it is in none of the ``optimizers``' param groups (by identity). None when no
    parameter is held by any optimizer (one that holds copies or flattened views: nothing can be told)."""
    held = {id(p) for optimizer in optimizers for group in optimizer.param_groups for p in group["params"]}
    outside = [id(p) not in held for p in params]
    return None if all(outside) else outside


def expected_step(lr: float, adaptive: bool, grad_rms: float) -> float:
    """The typical change of one element in one step: about ``lr`` for the Adam family, ``lr * rms(grad)`` for SGD."""
    return lr if adaptive else lr * grad_rms


def below_resolution(step: float, weight_rms: float, eps: float) -> bool:
    """Whether a change of ``step`` to weights of size ``weight_rms`` rounds back: below half the float spacing there
    (``eps * |w| / 2``, ``eps`` of the weights' dtype)."""
    return weight_rms > 0 and step < eps * weight_rms / 2
