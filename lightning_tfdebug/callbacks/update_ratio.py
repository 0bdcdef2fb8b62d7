"""UpdateRatio: how much the optimizer step actually changed the weights, relative to their size."""

from __future__ import annotations

import math
import statistics
from collections import deque
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor

from lightning_tfdebug.core.base import DebugCallback, check_number
from lightning_tfdebug.core.batch import loss_of, step_batch
from lightning_tfdebug.core.distributed import local_tensor, world_size
from lightning_tfdebug.core.groups import ReductionLayout, build_layout, training_model, validate_group_args
from lightning_tfdebug.core.model import find_vocab_size, grad_scaler_of
from lightning_tfdebug.core.step import step_norms
from lightning_tfdebug.core.tracking import Streak
from lightning_tfdebug.findings import OnFinding
from lightning_tfdebug.functional.learning import learned, progress
from lightning_tfdebug.functional.loss import unigram_entropy
from lightning_tfdebug.functional.norms import grouped_sq_norms
from lightning_tfdebug.functional.update_checks import (
    LOSS_FALL_PER_STEP,
    below_resolution,
    expected_step,
    label_counts,
    loss_fall_per_step,
    loss_still_falling,
    outside_optimizers,
)

_UNIGRAM_BATCHES = 8
"""The supervised labels of this many measured batches (every rank's) are counted for their unigram entropy."""
_LOSSES_HELD = 64
"""At most this many batches' loss tensors are held between measurements before they are summed (long intervals)."""


class UpdateRatio(DebugCallback):
    r"""Logs ``||ΔW|| / ||W||`` per group and in total, where ΔW is the change the optimizer step really made.

    On a measuring step the trainable parameters are copied in fp32 just before ``optimizer.step()`` (that copy is
    the callback's memory cost, and exists only on measuring steps), and compared with the weights after the step.
    Any optimizer and any parameter groups work, because nothing is recomputed from the optimizer's formula. A step
    that the fp16 GradScaler skipped is recognised from the scale backing off, and is neither logged as a zero
    update nor counted in the diagnoses. Under FSDP1/FSDP2 each rank snapshots and differences only its own shard;
    the step's reduction over ranks (inside :class:`~lightning_tfdebug.TFDebug`, the pack's one collective of the
    step) combines the shards. Under DDP the weights are the same on every rank, and that reduction only adds up the
    training losses and label counts.

    The training loss returned by ``training_step`` is kept at every batch (a reference to the detached tensor: no
    kernel, no sync), added up on the device on the measuring step and read with the ratios, as the mean loss of each
    measuring interval: tiny updates are only a problem when the loss shows it.

    Logged keys (on measuring steps):

    | key | meaning |
    | --- | --- |
    | `update_ratio/total` | `‖ΔW‖ / ‖W‖` over all trainable parameters |
    | `update_ratio/<group>` | the same over one group (`blocks.0`, `embeddings`, ...) |
    | `update_ratio/band/low`, `update_ratio/band/high` | the healthy band (`low`, `high`), for the dashboard |
    | `update_ratio/param_norm/total` | `‖W‖` after the step, over all trainable parameters |
    | `update_ratio/param_norm/<group>` | `‖W‖` after the step, over one group |

    Healthy band. The classic "1e-3" rule of thumb comes from SGD. With Adam(W), a step moves each weight by about
    the learning rate, so the ratio sits near ``lr / rms(W)``: about 1e-2 early in a GPT-style run (weights of
    rms ~0.02, lr 3e-4) and falling as weights grow and gradients get noisier. The defaults ``low=3e-4`` and
    ``high=0.3`` were set from measured healthy runs (``docs/callbacks/update_ratio.md``): the tiny transformer at
    lr 3e-4 to 3e-3 and a GPT-2-small-shaped model at 6e-4 stay inside; the same runs with the LR 100x lower or
    higher leave it.

    A learning rate far too high does not always show as a large ratio: with warm-up, the weights grow while the LR
    rises and the ratio measured against the grown weights looks ordinary. What does show is the growth itself, so
    ``TFD313`` watches ``‖W‖`` per group: when the median group grew by more than ``growth_limit`` times within
    ``growth_window`` optimizer steps, the step size is large against the weights' own scale. Groups whose norm is
    under 5% of the largest group's at the start of the window (zero-initialised biases, positions) are left out:
    growing from nothing is normal.

    Tiny updates need the loss to show the harm. A fine-tune at a fine-tuning LR updates trained weights by a small
    ratio on purpose. So ``TFD310`` also needs the mean training loss over the low streak to fall by less than 0.1% of
    itself per step (:mod:`lightning_tfdebug.functional.update_checks`), and the model not to have learned
    (:mod:`lightning_tfdebug.functional.learning`): its first measured loss still near ln(V) (V from the model's input
    embedding), not most of the way down to the supervised labels' unigram entropy as a fine-tune's starts, and its
    latest loss not below that entropy. The labels of the first 8 measured batches are counted for the entropy (on
    the device, reduced with the ratios).

    A group that gets gradients but does not change is either left out of the optimizer or stepped by less than its
    weights can show: Adam moves each element by about the LR, and at lr 1e-8 fp32 norm gains of 1.0 (half a float
    spacing: 6e-8) round back to themselves. The callback tells the two apart by whether the group's parameters are
    in the optimizer's param groups (read once, with the groups), and, for a group in the optimizer or when that
    cannot be told, by comparing its expected step (its param group's LR, times ``rms(grad)`` for SGD-like
    optimizers) with half the float spacing of its weights (``torch.finfo(dtype).eps * rms(W) / 2``). Only the first
    is ``TFD312``; the second is a learning rate far too low, named in ``TFD310``'s message and evidence.

    Findings: ``TFD310`` too low while the loss barely moves, ``TFD311`` too high, ``TFD312`` a group that got
    gradients but did not change (left out of the optimizer), ``TFD313`` weights growing fast, ``TFD314`` weights
    shrinking fast (the median group norm below ``1 / growth_limit`` of its value within ``growth_window``: weight
    decay far too strong). See ``docs/findings.md``.

    Args:
        every_n_steps: measure when ``global_step % every_n_steps == 0``; default: the Trainer's
            ``log_every_n_steps``.
        on_finding: ``"warn"``, ``"stop"`` or ``"raise"``.
        groups: ``{group_name: regex}`` to group parameters by name instead of by block.
        group_depth: group by the first ``group_depth`` segments of parameter names.
        low: ``TFD310`` when the total ratio stays below this for ``patience`` consecutive measurements, and the
            training loss shows an untrained model that barely learns (see above; the ratio alone decides when the
            training step returns no loss).
        high: ``TFD311`` when the total ratio exceeds this on any measurement.
        patience: consecutive measurements for ``TFD310`` and ``TFD312``.
        decayed_lr_fraction: no ``TFD310`` while the LR is below this fraction of the highest LR seen (a schedule
            deliberately decaying it) or still rising (warm-up).
        growth_limit: ``TFD313`` when the median group norm grows by more than this factor within ``growth_window``.
        growth_window: optimizer steps over which ``growth_limit`` applies.

    Raises:
        ValueError: on an argument outside its allowed range, or ``low >= high``.

    Example:
        ```python
        trainer = Trainer(callbacks=[UpdateRatio(every_n_steps=25)])
        ```

        LightningCLI:

        ```yaml
        trainer:
          callbacks:
            - class_path: lightning_tfdebug.UpdateRatio
              init_args:
                every_n_steps: 25
                low: 3.0e-4
                high: 0.3
                growth_limit: 2.0
        ```
    """

    def __init__(
        self,
        every_n_steps: int | None = None,
        on_finding: OnFinding = "warn",
        groups: dict[str, str] | None = None,
        group_depth: int | None = None,
        low: float = 3e-4,
        high: float = 0.3,
        patience: int = 3,
        decayed_lr_fraction: float = 0.5,
        growth_limit: float = 2.0,
        growth_window: int = 50,
    ) -> None:
        super().__init__(every_n_steps=every_n_steps, on_finding=on_finding)
        validate_group_args(groups, group_depth)
        check_number("low", low, low=0.0, low_inclusive=False)
        check_number("high", high, low=0.0, low_inclusive=False)
        if low >= high:
            raise ValueError(f"`low` must be below `high`; got low={low!r}, high={high!r}.")
        check_number("patience", patience, low=1, integer=True)
        check_number("decayed_lr_fraction", decayed_lr_fraction, low=0.0, high=1.0)
        self.groups = dict(groups) if groups else None
        self.group_depth = group_depth
        self.low = float(low)
        self.high = float(high)
        self.patience = patience
        self.decayed_lr_fraction = float(decayed_lr_fraction)
        check_number("growth_limit", growth_limit, low=1.0, low_inclusive=False)
        check_number("growth_window", growth_window, low=1, integer=True)
        self.growth_limit = float(growth_limit)
        self.growth_window = growth_window
        self._norms: deque[tuple[int, dict[str, float]]] = deque()  # (step, group norms) within growth_window
        self._layout: ReductionLayout | None = None
        self._before: list[Tensor] | None = None  # fp32 snapshot, alive only between the two hooks of a step
        self._grad_sq: Tensor | None = None
        self._scale_before: Tensor | None = None
        self._lr: float = 0.0
        self._peak_lr = 0.0
        self._recent_lr: deque[float] = deque(maxlen=patience)
        self._losses: deque[tuple[int, float]] = deque(maxlen=patience)  # (step, mean loss of the interval)
        # the training losses since the last measurement: the detached loss tensors themselves (no kernel per batch),
        # added up on the measuring step; past `_LOSSES_HELD` of them, folded into `_loss_sum` (one sum on the device)
        self._loss_list: list[Tensor] = []
        self._loss_sum: Tensor | None = None
        self._loss_batches = 0
        # "has this model learned?": the first measured interval's mean loss, ln(V), the labels' unigram entropy
        self._first_loss: float | None = None
        self._ln_vocab: float | None = None
        self._vocab: int | None = None
        self._unigram = math.nan
        self._counted_batches = 0
        self._counts: Tensor | None = None  # this measuring step's label counts, until reduced
        self._streak = Streak()
        # per group, read once with the layout: any parameter in no optimizer's param groups (None: cannot tell),
        # the element count and the coarsest float spacing (torch.finfo(dtype).eps) of its parameters
        self._outside: list[bool] | None = None
        self._numel: list[int] = []
        self._eps: list[float] = []
        self._rounded: dict[str, dict[str, float]] = {}  # groups whose updates round away: TFD310's evidence
        self.skipped_measurements = 0
        self._automatic = True  # automatic optimization: at most one optimizer step per batch
        self._same_sizes_next = False  # the next declaration has the sizes of the last one (see `declares_at`)

    @property
    def state_key(self) -> str:
        return self._generate_state_key(every_n_steps=self.every_n_steps, groups=self.groups, depth=self.group_depth)

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        self._layout = None
        self._automatic = bool(getattr(pl_module, "automatic_optimization", True))
        self._same_sizes_next = False  # a new fit: nothing declared in it yet

    #: the training loss is summed on the device on every batch (the window's mean loss beside the ratios)
    every_batch_hooks = frozenset({"on_train_batch_end"})

    def busy_at(self, step: int) -> bool:
        """The weights are read before and after the step on measuring steps only."""
        return step % self._interval == 0 or self._before is not None

    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        if not self.should_measure(trainer):
            return
        if self._layout is None:
            self._layout = build_layout(training_model(trainer, pl_module), groups=self.groups, depth=self.group_depth)
            if self._layout is None:
                self.stand_aside(
                    "the model has no trainable parameters, so no update can be measured.",
                    setting="a model with trainable parameters (`requires_grad=True`)",
                )
                return
            self._read_groups(trainer, self._layout)
        layout = self._layout
        with torch.no_grad():
            locals_ = [local_tensor(p.detach()) for p in layout.groups.params]
            if all(t.dtype == torch.float32 for t in locals_):
                self._before = list(torch._foreach_mul(locals_, 1.0))  # fresh copies in one call (x * 1.0 == x)
            else:
                self._before = [t.to(torch.float32, copy=True) for t in locals_]
            grads = [
                local_tensor(p.grad) if p.grad is not None else t[:0] for p, t in zip(layout.groups.params, locals_)
            ]
            weights = layout.weights if layout.sharded else None
            # shared with GradNormMonitor on the same step (the same gradient tensors): one pass over the gradients
            norms = step_norms(trainer, grads)
            self._grad_sq, _ = grouped_sq_norms(grads, layout.index, layout.n_groups, weights, norms=norms)
            scaler = grad_scaler_of(trainer)
            scale = getattr(scaler, "_scale", None)
            self._scale_before = scale.detach().clone() if isinstance(scale, Tensor) else None
        # host-side Python floats already: no sync
        self._lr = max(float(g["lr"]) for g in optimizer.param_groups)

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        loss = loss_of(outputs) if self.active and not trainer.sanity_checking else None
        if loss is not None:
            self._loss_list.append(loss.detach())  # a reference, no kernel: summed on the measuring step
            self._loss_batches += 1
            if len(self._loss_list) >= _LOSSES_HELD:  # a long interval: bounded, one sum on the device, no sync
                self._fold_losses()
        if self._before is None:
            return
        layout = self._layout
        assert layout is not None
        before, self._before = self._before, None
        step = trainer.global_step - 1  # the optimizer step measured has already incremented global_step
        self._count_labels(trainer, pl_module, batch)
        with torch.no_grad():
            after = [local_tensor(p.detach()) for p in layout.groups.params]
            # the snapshot becomes before - after in place (no second fp32 copy): its norm is the norm of the change
            torch._foreach_sub_(before, after)
            weights = layout.weights if layout.sharded else None
            delta_sq, _ = grouped_sq_norms(before, layout.index, layout.n_groups, weights)
            del before
            param_sq, _ = grouped_sq_norms(after, layout.index, layout.n_groups, weights)
            zero = delta_sq.new_zeros(1)
            self._fold_losses()
            loss_sum = self._loss_sum.to(zero).reshape(1) if self._loss_sum is not None else zero
            losses = torch.cat([loss_sum, torch.tensor([float(self._loss_batches)]).to(zero)])
            self._loss_sum, self._loss_batches = None, 0
            counts = self._counts.to(zero) if self._counts is not None else zero[:0]
            self._counts = None
            packed = torch.cat([delta_sq, param_sq, self._grad_sq.to(zero), losses, counts])
            # a step the fp16 GradScaler skipped: its scale backed off (the same on every rank, no collective)
            scaler = grad_scaler_of(trainer)
            scale_after = getattr(scaler, "_scale", None)
            skipped = (
                (scale_after < self._scale_before).float().sum()
                if self._scale_before is not None and isinstance(scale_after, Tensor)
                else None
            )
            self._scale_before = self._grad_sq = None
        # the next declaration carries label counts or not; a stand-in for this member (its failure on one rank) has
        # the sizes of this one, so it can take this one's place only while the two agree (see `declares_at`)
        self._same_sizes_next = bool(counts.numel()) == self._counting
        # Declared into the step's one reduction over ranks (the pack's shared collective; on its own, one of its
        # own): under FSDP the weighted partial sums of each rank's shard add up to the norms; under DDP the weights
        # are the same everywhere and only the losses and label counts need adding up.
        counted, world = bool(counts.numel()), world_size()
        self.reduce_then(
            trainer,
            lambda reduced: self._conclude(trainer, layout, reduced.sums.float(), counted, skipped, world, step),
            packed.device,
            sums=packed,
        )

    def _fold_losses(self) -> None:
        """Adds the held loss tensors into ``_loss_sum`` (fp32, on the device: no sync) and lets them go."""
        if not self._loss_list:
            return
        with torch.no_grad():  # one stack and one sum, whatever the number of batches; stack promotes mixed dtypes
            total = torch.stack([loss.reshape(()) for loss in self._loss_list]).float().sum()
        self._loss_sum = total if self._loss_sum is None else self._loss_sum + total
        self._loss_list = []

    def declares_at(self, step: int, stepped: bool) -> bool | None:
        """It declares at the end of a batch whose optimizer step measured: armed in ``on_before_optimizer_step`` when
        ``step % every_n_steps == 0`` (``should_measure``), declared in ``on_train_batch_end`` of the same batch.
        None (no stand-in: a failure on one rank of many ends the run) under manual optimization, where one batch may
        step several times and measure at a ``global_step`` other than ``step``; before its first declaration; and
        when its next declaration will not have the sizes of its last one (the label counts start or stop)."""
        if not self._automatic or not self._same_sizes_next:
            return None
        return stepped and step % self._interval == 0

    @property
    def _counting(self) -> bool:
        """Whether the next measuring step counts labels (its declaration then carries V counts)."""
        return self._vocab is None or (self._vocab >= 2 and self._counted_batches < _UNIGRAM_BATCHES)

    def _conclude(
        self,
        trainer: pl.Trainer,
        layout: ReductionLayout,
        sums: Tensor,
        counted: bool,
        skipped: Tensor | None,
        world: int,
        step: int,
    ) -> None:
        """Log and diagnose the measuring step ``step`` from its ``sums`` reduced over ranks."""
        n = layout.n_groups
        with torch.no_grad():
            norms = sums[: 3 * n] if layout.sharded else sums[: 3 * n] / world  # replicated: every rank sent the same
            parts = [norms, sums[3 * n : 3 * n + 2]]
            if counted:
                parts.append(unigram_entropy(sums[3 * n + 2 :]).reshape(1).to(norms))
            if skipped is not None:
                parts.append(skipped.reshape(1).to(norms))
            # host sync: the one transfer of this measuring step; the per-group ratios are then host arithmetic
            # (a handful of kernels per group on the device would cost more than the step's one read)
            flat = torch.cat(parts).tolist()
        delta_sq, param_sq, grad_sq = flat[:n], flat[n : 2 * n], flat[2 * n : 3 * n]
        host: dict[str, float] = {
            "update_ratio/total": math.sqrt(sum(delta_sq)) / max(math.sqrt(sum(param_sq)), 1e-12),
            "update_ratio/param_norm/total": math.sqrt(sum(param_sq)),
        }
        for g, name in enumerate(layout.groups.group_names):
            host[f"update_ratio/{name}"] = math.sqrt(delta_sq[g]) / max(math.sqrt(param_sq[g]), 1e-12)
            host[f"update_ratio/param_norm/{name}"] = math.sqrt(param_sq[g])
            host[f"_delta/{name}"] = delta_sq[g]
            host[f"_grad/{name}"] = grad_sq[g]
        host["_loss_sum"], host["_loss_batches"] = flat[3 * n], flat[3 * n + 1]
        k = 3 * n + 2
        if counted:
            host["_unigram"], k = flat[k], k + 1
        if skipped is not None:
            host["_skipped"] = flat[k]
        if host.get("_skipped", 0.0) > 0:
            self.skipped_measurements += 1  # the GradScaler skipped this step: nothing was applied, nothing to judge
            return
        logged = {k: v for k, v in host.items() if not k.startswith("_")}
        # the healthy band, logged beside the ratios so the dashboard's margin charts can draw it
        logged.update({"update_ratio/band/low": self.low, "update_ratio/band/high": self.high})
        self.log_scalars(trainer, logged, step=step)
        self._diagnose(trainer, host, step)

    def _diagnose(self, trainer: pl.Trainer, host: dict[str, float], step: int) -> None:
        layout = self._layout
        assert layout is not None
        names = layout.groups.group_names
        ratio = host["update_ratio/total"]
        self._peak_lr = max(self._peak_lr, self._lr)
        self._recent_lr.append(self._lr)
        batches = host["_loss_batches"]
        mean = host["_loss_sum"] / batches if batches else math.nan
        self._losses.append((step, mean))
        if "_unigram" in host and math.isfinite(host["_unigram"]):
            self._unigram = host["_unigram"]
        if self._first_loss is None and math.isfinite(mean):
            self._first_loss = mean
        band = {"low": self.low, "high": self.high}

        # groups that got gradients and did not change: left out of the optimizer (TFD312), or rounded back (TFD310)
        stepped = sum(host[f"_delta/{g}"] for g in names) > 0
        stuck = []
        for g in names:
            unchanged = stepped and host[f"_grad/{g}"] > 0 and host[f"_delta/{g}"] == 0.0
            if self._streak.update(f"zero:{g}", unchanged) >= self.patience:
                stuck.append(g)
        frozen = self._left_out(trainer, host, stuck)

        at_plateau = (
            self._lr >= self.decayed_lr_fraction * self._peak_lr
            and len(self._recent_lr) == self._recent_lr.maxlen
            and max(self._recent_lr) <= 1.1 * min(self._recent_lr)
        )
        # tiny updates whose loss keeps falling are doing their work (a fine-tune at a fine-tuning LR): no finding
        low_streak = self._streak.update("low", ratio < self.low) >= self.patience
        if low_streak and at_plateau and not loss_still_falling(self._losses) and not self._has_learned(mean):
            below = [g for g in names if host[f"update_ratio/{g}"] < self.low]
            fall = loss_fall_per_step(self._losses)
            since = self._losses[0][0]
            barely = (
                f", while the mean training loss fell by only {fall:.3%} of itself per step since step {since} "
                f"(a loss the updates move falls by {LOSS_FALL_PER_STEP:.1%} per step or more)"
                if math.isfinite(fall)
                else ""
            )
            if self._ln_vocab is not None and self._first_loss is not None and math.isfinite(mean):
                barely += (
                    f"; the loss ({mean:.3f}, {self._first_loss:.3f} at the first measurement) is still near ln(V) = "
                    f"{self._ln_vocab:.3f}: the model has not learned"
                )
            if self._rounded:
                barely += (
                    f"; group(s) {', '.join(self._rounded)} did not change at all: they are in the optimizer, but each "
                    f"step is below half the float spacing of their weights, which round back"
                )
            self.emit_code(
                trainer,
                "TFD310",
                f"Updates are tiny: ||dW||/||W|| = {ratio:.3g} (healthy band {self.low:g} to {self.high:g}) for "
                f"{self.patience} measurements at a learning rate of {self._lr:.3g}{barely}.",
                {
                    "update_ratio": ratio,
                    "lr": self._lr,
                    "band": band,
                    "groups_below": below,
                    "groups_below_resolution": dict(self._rounded),
                    "loss_fall_per_step": fall,
                    **self._learning_evidence(mean),
                },
                step=step,
            )
        if ratio > self.high:  # one step that rewrites this much of the weights is damage already: no patience
            above = [g for g in names if host[f"update_ratio/{g}"] > self.high]
            self.emit_code(
                trainer,
                "TFD311",
                f"Updates are huge: one optimizer step changed the weights by ||dW||/||W|| = {ratio:.3g} (healthy band "
                f"{self.low:g} to {self.high:g}) at a learning rate of {self._lr:.3g}.",
                {"update_ratio": ratio, "lr": self._lr, "band": band, "groups_above": above},
                step=step,
            )
        self._check_growth(trainer, {g: host[f"update_ratio/param_norm/{g}"] for g in names}, step)
        if frozen:
            self.emit_code(
                trainer,
                "TFD312",
                f"Group(s) {', '.join(frozen)} received gradients but did not change when the optimizer stepped, "
                f"{self.patience} times in a row: their parameters are in none of the optimizer's param groups.",
                {"groups": frozen, "grad_norms": {g: host[f"_grad/{g}"] ** 0.5 for g in frozen}},
                step=step,
            )

    def _read_groups(self, trainer: pl.Trainer, layout: ReductionLayout) -> None:
        """Once per layout, on the host (no tensor data read): which groups hold parameters outside every optimizer,
        and each group's element count and float spacing, for telling TFD312 from updates that round away."""
        n = layout.n_groups
        outside = outside_optimizers(layout.groups.params, trainer.optimizers)
        group_outside = [False] * n
        self._numel, self._eps = [0] * n, [0.0] * n
        for i, (g, p) in enumerate(zip(layout.groups.index, layout.groups.params)):
            self._numel[g] += p.numel()
            eps = torch.finfo(p.dtype).eps if p.is_floating_point() else 0.0
            self._eps[g] = max(self._eps[g], eps)
            group_outside[g] = group_outside[g] or (outside is not None and outside[i])
        self._outside = None if outside is None else group_outside

    def _left_out(self, trainer: pl.Trainer, host: dict[str, float], stuck: list[str]) -> list[str]:
        """Of the groups that got gradients and did not change for ``patience`` measurements, those left out of the
        optimizer (TFD312). A group wholly in the optimizer is not: when its expected step (the LR of its param group
        times the optimizer's typical step per element) is below half the float spacing of its weights, the optimizer
        did step it and the weights rounded back, which is a learning rate far too low for them and goes to TFD310's
        evidence; above it (a param group at lr 0), nothing is said. When membership cannot be told, the same
        comparison decides, against the optimizers' largest step, and a group whose step should have shown is TFD312.
        Host floats only (a tensor LR is read to the host here), and only when a group is stuck."""
        self._rounded = {}
        if not stuck:
            return []
        layout = self._layout
        assert layout is not None
        position = {name: i for i, name in enumerate(layout.groups.group_names)}
        # the LR and kind of each parameter's optimizer param group: host floats, read only now
        settings = {
            id(p): (float(group["lr"]), "betas" in group)
            for optimizer in trainer.optimizers
            for group in optimizer.param_groups
            for p in group["params"]
        }
        frozen = []
        for name in stuck:
            g = position[name]
            if self._outside is not None and self._outside[g]:
                frozen.append(name)
                continue
            held = [
                settings[id(p)]
                for p, i in zip(layout.groups.params, layout.groups.index)
                if i == g and id(p) in settings
            ]
            if not held:  # the optimizer holds copies: judge by the most generous of its param groups
                held = list(set(settings.values()))
            numel = max(self._numel[g], 1)
            weight_rms = math.sqrt(host[f"update_ratio/param_norm/{name}"] ** 2 / numel)
            grad_rms = math.sqrt(host[f"_grad/{name}"] / numel)
            step = max((expected_step(lr, adaptive, grad_rms) for lr, adaptive in held), default=0.0)
            if held and below_resolution(step, weight_rms, self._eps[g]):
                self._rounded[name] = {"expected_step": step, "half_spacing": self._eps[g] * weight_rms / 2}
            elif self._outside is None:
                frozen.append(name)
        return frozen

    def _count_labels(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any) -> None:
        """On the first measuring steps: count this batch's supervised labels over V bins, on the device (reduced
        with the ratios). ln(V) comes from the model's input embedding, found once."""
        if self._vocab is None:
            vocab, _ = find_vocab_size(training_model(trainer, pl_module))  # a walk over modules, once
            self._vocab = vocab or 0
            self._ln_vocab = math.log(vocab) if vocab and vocab >= 2 else None
        if self._vocab < 2 or self._counted_batches >= _UNIGRAM_BATCHES:
            return
        self._counted_batches += 1  # on every rank alike: the packed vector has the same length everywhere
        view = step_batch(trainer, batch)
        with torch.no_grad():
            self._counts = label_counts(view.labels, self._vocab, view.keys.ignore_index, device=pl_module.device)

    def _has_learned(self, latest: float) -> bool:
        """The shared reading (:func:`~lightning_tfdebug.functional.learning.learned`); unknown (no loss, no V) is
        not learned: the ratio and the loss's fall decide, as they always did."""
        if self._first_loss is None or self._ln_vocab is None:
            return False
        return bool(learned(self._first_loss, latest, self._ln_vocab, self._unigram))

    def _learning_evidence(self, latest: float) -> dict[str, Any]:
        if self._first_loss is None or self._ln_vocab is None:
            return {}
        return {
            "first_loss": self._first_loss,
            "ln_vocab": self._ln_vocab,
            "unigram_entropy": self._unigram,
            "progress_first": progress(self._first_loss, self._ln_vocab, self._unigram),
            "progress_latest": progress(latest, self._ln_vocab, self._unigram),
        }

    def _check_growth(self, trainer: pl.Trainer, norms: dict[str, float], step: int) -> None:
        """``TFD313``: the median group norm grew past ``growth_limit`` x within ``growth_window`` steps."""
        while self._norms and self._norms[0][0] < step - self.growth_window:
            self._norms.popleft()
        self._norms.append((step, norms))
        start_step, start = self._norms[0]
        if start_step == step:
            return
        largest = max(start.values(), default=0.0)
        growth = {
            g: norms[g] / start[g]
            for g in norms
            if g in start and start[g] > 0.05 * largest and start[g] > 0 and math.isfinite(norms[g])
        }
        if not growth:
            return
        median = statistics.median(growth.values())
        if median < 1.0 / self.growth_limit:
            self._report_shrinking(trainer, median, start_step, step, growth)
            return
        if median <= self.growth_limit:
            return
        self.emit_code(
            trainer,
            "TFD313",
            f"Weights are growing fast: the median group norm grew {median:.3g}x in {step - start_step} optimizer "
            f"steps (limit {self.growth_limit:g}x in {self.growth_window}), at a learning rate of {self._lr:.3g}.",
            {
                "median_growth": median,
                "from_step": start_step,
                "to_step": step,
                "lr": self._lr,
                "growth": {g: round(v, 4) for g, v in sorted(growth.items(), key=lambda kv: -kv[1])},
            },
            step=step,
        )

    def _report_shrinking(
        self, trainer: pl.Trainer, median: float, start_step: int, step: int, growth: dict[str, float]
    ) -> None:
        """``TFD314``: the median group norm fell below ``1 / growth_limit`` of its value within ``growth_window``."""
        # the strongest decoupled decay per step, lr x weight_decay: host floats of the param groups (a tensor LR
        # costs a host read here, once, when the finding is emitted)
        decay = max(
            (
                float(group["lr"]) * float(group.get("weight_decay", 0.0) or 0.0)
                for optimizer in trainer.optimizers
                for group in optimizer.param_groups
            ),
            default=0.0,
        )
        half_life = math.log(2) / decay if decay > 0 else math.inf
        because = (
            f" The strongest weight decay shrinks weights by lr x weight_decay = {decay:.3g} per step (half the "
            f"norm every {half_life:.0f} steps without gradients)."
            if decay > 0
            else ""
        )
        self.emit_code(
            trainer,
            "TFD314",
            f"Weights are shrinking fast: the median group norm fell to {median:.3g}x of its value in "
            f"{step - start_step} optimizer steps (limit 1/{self.growth_limit:g} in {self.growth_window}).{because}",
            {
                "median_growth": median,
                "from_step": start_step,
                "to_step": step,
                "lr_times_weight_decay": decay,
                "growth": {g: round(v, 4) for g, v in sorted(growth.items(), key=lambda kv: kv[1])},
            },
            step=step,
        )

    def state_dict(self) -> dict[str, Any]:
        return {
            **super().state_dict(),
            "streak": self._streak.state_dict(),
            "peak_lr": self._peak_lr,
            "recent_lr": list(self._recent_lr),
            "losses": [list(point) for point in self._losses],
            "first_loss": self._first_loss,
            "unigram_entropy": self._unigram if math.isfinite(self._unigram) else None,
            "skipped_measurements": self.skipped_measurements,
            "norms": [[step, norms] for step, norms in self._norms],
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self._streak.load_state_dict(state_dict.get("streak", {}))
        self._peak_lr = float(state_dict.get("peak_lr", 0.0))
        self._recent_lr = deque(state_dict.get("recent_lr", []), maxlen=self.patience)
        self._losses = deque(
            ((int(step), float(loss)) for step, loss in state_dict.get("losses", [])), maxlen=self.patience
        )
        self.skipped_measurements = int(state_dict.get("skipped_measurements", 0))
        self._first_loss = state_dict.get("first_loss")
        unigram = state_dict.get("unigram_entropy")
        self._unigram = float(unigram) if unigram is not None else math.nan
        self._counted_batches = _UNIGRAM_BATCHES if unigram is not None else 0
        self._norms = deque((int(step), dict(norms)) for step, norms in state_dict.get("norms", []))
