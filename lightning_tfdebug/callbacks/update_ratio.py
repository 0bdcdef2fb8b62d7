"""UpdateRatio: how much the optimizer step actually changed the weights, relative to their size."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, ClassVar

import lightning.pytorch as pl
import torch
from torch import Tensor

from lightning_tfdebug.core.base import DebugCallback, check_number
from lightning_tfdebug.core.batch import step_batch
from lightning_tfdebug.core.distributed import world_size
from lightning_tfdebug.core.groups import ReductionLayout, build_layout, training_model, validate_group_args
from lightning_tfdebug.core.model import find_vocab_size, grad_scaler_of, schedule_courses
from lightning_tfdebug.core.reduction import Reduced, host_fields
from lightning_tfdebug.core.step import step_norms, step_state
from lightning_tfdebug.findings import OnFinding
from lightning_tfdebug.functional.loss import unigram_entropy
from lightning_tfdebug.functional.memory import WeightSnapshot, budget_for, check_budget, plan_notes
from lightning_tfdebug.functional.norms import grouped_sq_norms
from lightning_tfdebug.functional.update_checks import COVERAGE as COVERAGE_ROWS
from lightning_tfdebug.functional.update_checks import update_verdicts
from lightning_tfdebug.functional.updates import GroupFacts, UpdateMemory, UpdateReading, group_facts, label_counts
from lightning_tfdebug.primitives.batch import loss_of
from lightning_tfdebug.primitives.keys import Key
from lightning_tfdebug.primitives.tensors import local_tensor

_UNIGRAM_BATCHES = 8
"""The supervised labels of this many measured batches (every rank's) are counted for their unigram entropy."""
_LOSSES_HELD = 64
"""At most this many batches' loss tensors are held between measurements before they are summed (long intervals)."""
_RATIOS = "update ratio per group (band: healthy)"
_NORMS = "parameter norm per group"
"""The dashboard charts of the ratios (with the band) and of the weight norms."""


class UpdateRatio(DebugCallback):
    r"""Logs ``||ΔW|| / ||W||`` per group and in total, where ΔW is the change the optimizer step really made.

    On a measuring step the trainable parameters are copied in fp32 just before ``optimizer.step()`` and compared with
    the weights after it, so any optimizer and any parameter groups work. The copy stays within ``memory_budget_mb``
    (taken in parts, in turn, when all of it would not fit). A step the fp16 GradScaler skipped is not judged. Under
    FSDP each rank differences its own shard and the pack's one reduction of the step combines them; under DDP that
    reduction adds up the training losses and label counts only. The loss returned by ``training_step`` is kept at
    every batch (a reference, no kernel) and read as each interval's mean loss; the labels of the first 8 measured
    batches give their unigram entropy, to tell an untrained model from a fine-tune. Each LR schedule is replayed on
    a copy once per fit, for the LR it reaches in the run. See ``docs/callbacks/update_ratio.md``.

    Logged keys (on measuring steps): :attr:`KEYS`. Findings (:mod:`lightning_tfdebug.functional.update_checks`):
    ``TFD310`` too low while the loss barely moves, ``TFD311`` too high, ``TFD312`` a group left out of the
    optimizer, ``TFD313`` weights growing fast, ``TFD314`` weights shrinking fast.

    Args:
        every_n_steps: measure when ``global_step % every_n_steps == 0``; default: the Trainer's
            ``log_every_n_steps``.
        on_finding: ``"warn"``, ``"stop"`` or ``"raise"``.
        groups: ``{group_name: regex}`` to group parameters by name instead of by block.
        group_depth: group by the first ``group_depth`` segments of parameter names.
        low: ``TFD310`` when the total ratio stays below this for ``patience`` consecutive measurements and the
            loss shows an untrained model that barely learns.
        high: ``TFD311`` when the total ratio exceeds this on any measurement.
        patience: consecutive measurements for ``TFD310`` and ``TFD312``.
        decayed_lr_fraction: no ``TFD310`` while the LR is below this fraction of the highest LR seen.
        growth_limit: ``TFD313`` when the median group norm grows by more than this factor within ``growth_window``.
        growth_window: optimizer steps over which ``growth_limit`` applies.
        memory_budget_mb: the most the fp32 snapshot of a measuring step may take, in MiB; None: ``max(2% of the
            training state (weights, gradients, optimizer state), 32 MiB)``. A larger snapshot is taken in parts.

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

    COVERAGE: ClassVar[Mapping[str, tuple[str, ...]]] = COVERAGE_ROWS  # declared beside the rules
    COVERAGE_WATCHED: ClassVar[frozenset[str]] = frozenset(COVERAGE)  # verified by watching the whole fit

    KEYS: ClassVar[tuple[Key, ...]] = (
        Key(
            "update_ratio/total",
            "`‖ΔW‖ / ‖W‖` over all trainable parameters (over the groups measured, when the snapshot is in parts)",
            chart=_RATIOS,
        ),
        Key("update_ratio/<group>", "the same over one group (`blocks.0`, `embeddings`, ...)", chart=_RATIOS),
        Key("update_ratio/band/low", "the healthy band's lower edge (`low`), drawn around the ratios", chart=_RATIOS),
        Key("update_ratio/band/high", "the healthy band's upper edge (`high`), drawn around the ratios", chart=_RATIOS),
        Key("update_ratio/param_norm/total", "`‖W‖` after the step", chart=_NORMS),
        Key("update_ratio/param_norm/<group>", "`‖W‖` of one group after the step", chart=_NORMS),
    )

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
        memory_budget_mb: float | None = None,
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
        self.memory_budget_mb = check_budget(memory_budget_mb)
        self._memory = UpdateMemory(patience)  # what the rules remember between measurements
        self._layout: ReductionLayout | None = None
        self._snapshot: WeightSnapshot | None = None  # the fp32 weights before the step, made with the layout
        self._grad_sq: Tensor | None = None
        self._scale_before: Tensor | None = None
        self._lr: float = 0.0
        self._planned_lr: float | None = None
        # the training losses since the last measurement: the detached loss tensors themselves (no kernel per batch),
        # added up on the measuring step; past `_LOSSES_HELD` of them, folded into `_loss_sum` (one sum on the device)
        self._loss_list: list[Tensor] = []
        self._loss_sum: Tensor | None = None
        self._loss_batches = 0
        # "has this model learned?": ln(V) from the model's input embedding, the labels counted for their entropy
        self._ln_vocab: float | None = None
        self._vocab: int | None = None
        self._counted_batches = 0
        self._counts: Tensor | None = None  # this measuring step's label counts, until reduced
        self._facts: GroupFacts | None = None  # read once with the layout (host only)
        self.skipped_measurements = 0
        self._automatic = True  # automatic optimization: at most one optimizer step per batch
        self._same_sizes_next = False  # the next declaration has the sizes of the last one (see `declares_at`)

    @property
    def state_key(self) -> str:
        return self._generate_state_key(every_n_steps=self.every_n_steps, groups=self.groups, depth=self.group_depth)

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        self._layout = self._snapshot = None
        self._automatic = bool(getattr(pl_module, "automatic_optimization", True))
        self._same_sizes_next = False  # a new fit: nothing declared in it yet

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # the highest LR the schedules reach in this run (replayed on copies, once per fit): TFD310's yardstick while
        # the LR still rises
        courses = schedule_courses(trainer, pl_module) if self.active else []
        self._planned_lr = max((c.run_max for c in courses), default=None)

    #: the training loss is summed on the device on every batch (the window's mean loss beside the ratios)
    every_batch_hooks = frozenset({"on_train_batch_end"})

    def busy_at(self, step: int) -> bool:
        """The weights are read before and after the step on measuring steps only."""
        return step % self._interval == 0 or (self._snapshot is not None and self._snapshot.taken)

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
            groups = self._layout.groups
            self._facts = group_facts(groups.group_names, groups.params, groups.index, trainer.optimizers)
            weights = self._layout.weights if self._layout.sharded else None
            numels = [p.numel() for p in groups.params]
            self._snapshot = WeightSnapshot(numels, groups.index, self._layout.index, self._layout.n_groups, weights)
        layout, snapshot = self._layout, self._snapshot
        assert snapshot is not None
        self._plan_snapshot(trainer, layout, snapshot)
        with torch.no_grad():
            locals_ = [local_tensor(p.detach()) for p in layout.groups.params]
            # memory: the fp32 snapshot, of every parameter or of this step's part of the groups (within the budget)
            snapshot.take(locals_, trainer.global_step // self._interval)  # the same part on every rank
            weights = layout.weights if layout.sharded else None
            grads = [
                local_tensor(p.grad) if p.grad is not None else t[:0] for p, t in zip(layout.groups.params, locals_)
            ]
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
        snapshot = self._snapshot
        if snapshot is None or not snapshot.taken:
            return
        layout = self._layout
        assert layout is not None
        step = trainer.global_step - 1  # the optimizer step measured has already incremented global_step
        self._count_labels(trainer, pl_module, batch)
        with torch.no_grad():
            after = [local_tensor(p.detach()) for p in layout.groups.params]
            # the snapshot becomes before - after in place (no second copy), freed once its norms are taken
            delta_sq, param_sq, measured = snapshot.change(after)
            zero = delta_sq.new_zeros(())
            self._fold_losses()
            declared: dict[str, Tensor | float] = {
                "delta_sq": delta_sq,
                "param_sq": param_sq,
                "grad_sq": self._grad_sq.to(zero),
                "loss_sum": self._loss_sum.to(zero).reshape(()) if self._loss_sum is not None else zero,
                "loss_batches": float(self._loss_batches),
            }
            if self._counts is not None and self._counts.numel():
                declared["label_counts"] = self._counts.to(zero)
            self._loss_sum, self._loss_batches, self._counts = None, 0, None
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
        self._same_sizes_next = ("label_counts" in declared) == self._counting
        # Declared into the step's one reduction over ranks (the pack's shared collective; on its own, one of its
        # own): under FSDP the weighted partial sums of each rank's shard add up to the norms; under DDP the weights
        # are the same everywhere and only the losses and label counts need adding up.
        world = world_size()
        self.reduce_then(
            trainer,
            lambda reduced: self._conclude(trainer, layout, reduced, skipped, world, step, measured),
            delta_sq.device,
            sums=declared,
        )

    def _plan_snapshot(self, trainer: pl.Trainer, layout: ReductionLayout, snapshot: WeightSnapshot) -> None:
        """Plan the snapshot's parts within the budget (again when it changes); what is measured less often is
        recorded once. Host arithmetic on sizes, no sync."""
        if snapshot.replan(budget_for(self.memory_budget_mb, layout.groups.params, trainer.optimizers)):
            assert snapshot.plan is not None
            for check, reason, setting in plan_notes(snapshot.plan, layout.groups.group_names):
                self.check_aside(check, reason, setting)

    def _fold_losses(self) -> None:
        """Adds the held loss tensors into ``_loss_sum`` (fp32, on the device: no sync) and lets them go."""
        if not self._loss_list:
            return
        with torch.no_grad():  # one stack and one sum, whatever the number of batches; stack promotes mixed dtypes
            total = torch.stack([loss.reshape(()) for loss in self._loss_list]).float().sum()
        self._loss_sum = total if self._loss_sum is None else self._loss_sum + total
        self._loss_list = []

    def declares_at(self, step: int, stepped: bool) -> bool | None:
        """It declares at the end of a batch whose optimizer step measured. None (no stand-in) under manual
        optimization, before its first declaration, and when its next declaration changes size (label counts)."""
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
        reduced: Reduced,
        skipped: Tensor | None,
        world: int,
        step: int,
        measured: tuple[bool, ...] | None = None,
    ) -> None:
        """Log and diagnose the measuring step ``step`` from its fields reduced over ranks."""
        sums = reduced.sums
        with torch.no_grad():
            copies = 1.0 if layout.sharded else float(world)  # replicated: every rank sent the same norms
            fields = {name: sums[name] / copies for name in ("delta_sq", "param_sq", "grad_sq")}
            fields |= {"loss_sum": sums["loss_sum"], "loss_batches": sums["loss_batches"]}
            if "label_counts" in sums:
                fields["unigram"] = unigram_entropy(sums["label_counts"].float())
            if skipped is not None:
                fields["skipped"] = skipped
            # host sync: the one transfer of this measuring step; the per-group ratios are then host arithmetic
            # (a handful of kernels per group on the device would cost more than the step's one read)
            host = host_fields(fields)
        unigram = host.get("unigram", math.nan)
        if host.get("skipped", 0.0) > 0 or step_state(trainer).skipped_step == step:
            # the GradScaler or NaNFirstFrame (the same on every rank) skipped this step: nothing was applied, nothing
            # to judge
            self.skipped_measurements += 1
            return
        names = layout.groups.group_names
        reading = UpdateReading.from_squares(
            step,
            self._lr,
            names,
            host["delta_sq"] + host["param_sq"] + host["grad_sq"],
            host["loss_sum"],
            host["loss_batches"],
            unigram,
            measured,
        )
        self.log_scalars(trainer, reading.scalars(self.low, self.high), step=step)
        assert self._facts is not None
        verdicts = update_verdicts(
            reading,
            self._memory,
            self._facts,
            [group for optimizer in trainer.optimizers for group in optimizer.param_groups],
            low=self.low,
            high=self.high,
            patience=self.patience,
            decayed_lr_fraction=self.decayed_lr_fraction,
            growth_limit=self.growth_limit,
            growth_window=self.growth_window,
            ln_vocab=self._ln_vocab,
            planned_lr=self._planned_lr,
        )
        self.emit(trainer, verdicts)

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
        with torch.no_grad():  # memory: V floats on the device, until the step's reduction
            self._counts = label_counts(view.labels, self._vocab, view.keys.ignore_index, device=pl_module.device)

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), **self._memory.state_dict(), "skipped_measurements": self.skipped_measurements}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self._memory.load_state_dict(state_dict)
        self.skipped_measurements = int(state_dict.get("skipped_measurements", 0))
        unigram_counted = state_dict.get("unigram_entropy") is not None
        self._counted_batches = _UNIGRAM_BATCHES if unigram_counted else 0
