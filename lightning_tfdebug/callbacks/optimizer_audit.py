"""OptimizerAudit: is the optimizer wired to the model the way training needs, and does the LR behave?"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Mapping
from typing import Any, ClassVar

import lightning.pytorch as pl
import torch
from torch import Tensor

from lightning_tfdebug.core.base import DebugCallback, check_number
from lightning_tfdebug.core.groups import training_model
from lightning_tfdebug.core.model import grad_scaler_of, schedule_courses
from lightning_tfdebug.findings import OnFinding
from lightning_tfdebug.functional import optimizer_checks as checks
from lightning_tfdebug.functional import training_checks as training
from lightning_tfdebug.functional.memory import budget_for, check_budget
from lightning_tfdebug.functional.optimizers import (
    Snapshot,
    Wiring,
    is_transformer,
    modules_left_in_eval,
    parameters_norm,
    read_lrs,
    read_schedules,
    read_wiring,
    snapshot_step,
    stale_grad_flags,
)
from lightning_tfdebug.primitives.batch import loss_of
from lightning_tfdebug.primitives.keys import Key


class OptimizerAudit(DebugCallback):
    r"""Checks how the optimizer is wired to the model, the module's train mode, and the learning rate it really uses.

    Once at the start of training (after any checkpoint is restored): the param groups against the module's
    parameters (``TFD320``-``TFD323``), each group's weight decay and ``eps`` (``TFD324``-``TFD326``, ``TFD333``,
    ``TFD336``), and each LR schedule replayed on a copy against the run's length (``TFD337``). At the first batch of
    each epoch and after each validation run: the module's train mode (``TFD327``, ``TFD328``). Host-side, at every
    step it is called at: a scheduler stepped more than once per optimizer step (``TFD329``). On measuring steps: the
    LR of every group is logged and judged (``TFD330``, ``TFD331``, ``TFD335``); one parameter per group that fits
    the memory budget is compared byte for byte across the step (``TFD332``); the decayed 1-D parameters' norm is
    watched (``TFD324`` as a warning); gradients left from before the step are looked for (``TFD334``). The rules
    are in :mod:`lightning_tfdebug.functional.optimizer_checks` and
    :mod:`~lightning_tfdebug.functional.training_checks`; ``docs/callbacks/optimizer_audit.md`` explains each.

    Logged keys: :attr:`KEYS`. Distributed: the same findings on every rank under DDP, no collective; under FSDP
    ``TFD332`` compares each rank's shard and is resolved together after each measuring step.

    Args:
        every_n_steps: measure when ``global_step % every_n_steps == 0``; default: the Trainer's
            ``log_every_n_steps``.
        on_finding: ``"warn"``, ``"stop"`` or ``"raise"``.
        check_warmup: check that a transformer's LR warms up (``TFD330``).
        zero_lr_fraction: ``TFD331`` when the LR is zero before this fraction of the run's steps.
        patience: consecutive measured steps a parameter must stay byte-identical for ``TFD332``.
        warmup_window: the first optimizer steps in which a loss spike makes a missing warm-up a warning.
        check_schedule_fits: replay each LR schedule against the run's length (``TFD337``); a preflight, shorter
            than the real run, turns it off.
        memory_budget_mb: the most the copies of a measuring step may take, in MiB; None: ``max(2% of the training
            state, 32 MiB)``.

    Raises:
        ValueError: on an argument outside its allowed range.

    Example:
        ```python
        trainer = Trainer(callbacks=[OptimizerAudit(every_n_steps=50)])
        ```

        LightningCLI:

        ```yaml
        trainer:
          callbacks:
            - class_path: lightning_tfdebug.OptimizerAudit
              init_args:
                every_n_steps: 50
                check_warmup: true
        ```
    """

    COVERAGE: ClassVar[Mapping[str, tuple[str, ...]]] = checks.COVERAGE  # declared beside the rules
    COVERAGE_WATCHED: ClassVar[frozenset[str]] = frozenset(COVERAGE)  # verified by watching the whole fit
    KEYS: ClassVar[tuple[Key, ...]] = (
        Key(
            "optimizer_audit/lr/<group>",
            "learning rate of a param group as the optimizer applies it at this step; `<group>` is the group's `name` "
            "when it has one, else `group<i>` (`opt<j>.group<i>` with several optimizers)",
            chart="learning rate per group",
        ),
    )

    def __init__(
        self,
        every_n_steps: int | None = None,
        on_finding: OnFinding = "warn",
        check_warmup: bool = True,
        zero_lr_fraction: float = 0.9,
        patience: int = 2,
        warmup_window: int = 1000,
        check_schedule_fits: bool = True,
        memory_budget_mb: float | None = None,
    ) -> None:
        super().__init__(every_n_steps=every_n_steps, on_finding=on_finding)
        for name, flag in (("check_warmup", check_warmup), ("check_schedule_fits", check_schedule_fits)):
            if not isinstance(flag, bool):
                raise TypeError(f"`{name}` must be True or False; got {flag!r}.")
        check_number("zero_lr_fraction", zero_lr_fraction, low=0.0, high=1.0)
        check_number("patience", patience, low=1, integer=True)
        check_number("warmup_window", warmup_window, low=1, integer=True)
        self.warmup_window = warmup_window
        self.check_warmup = check_warmup
        self.zero_lr_fraction = float(zero_lr_fraction)
        self.patience = patience
        self.check_schedule_fits = check_schedule_fits
        self.memory_budget_mb = check_budget(memory_budget_mb)
        self._check_mode = False
        self._transformer = False
        self._wiring = Wiring()  # what the audit at train start found, and the tensors measuring steps watch
        self._named_ids: dict[int, str] | None = None  # parameter names by id, walked once per fit
        self._sched_seen: dict[int, tuple[int, int]] = {}  # id(scheduler) -> (its step() calls, global step)
        self._backward_step = -1  # the global step of the last backward seen: a new one is the first after a step
        # the learning rate and the warm-up (TFD330, TFD331, TFD335)
        self._first_lr: float | None = None
        self._peak_lr = 0.0
        self._warmup_decided = False
        self._no_warmup: dict[str, Any] | None = None  # the evidence of TFD330 (info) until the early loss shows harm
        self._first_loss: float | None = None  # the loss of step 0, read on that measuring step
        self._lowest_loss = math.inf
        self._spike: dict[str, Any] | None = None  # the first early loss spike, kept until the warm-up is decided
        # the byte comparison across a measured step (TFD332, TFD322 as a warning)
        self._measured_step = 0  # the optimizer step whose snapshot is compared at the end of its batch
        self._compare_due = False
        self._snapshots: list[Snapshot] | None = None
        self._frozen_snaps: list[Snapshot] = []
        self._scale_before: Tensor | None = None
        self._unchanged: dict[str, int] = defaultdict(int)
        self._decay = checks.DecayedNormWatch()  # TFD324 measured: the decayed 1-D parameters' norm and the decay

    @property
    def state_key(self) -> str:
        return self._generate_state_key(every_n_steps=self.every_n_steps)

    # ------------------------------------------------------------------ set-up and wiring
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._named_ids = None  # a new fit: the parameter names are walked again at the first snapshot
        if not self.active:
            return
        self._transformer = is_transformer(pl_module)
        self._wiring = read_wiring(training_model(trainer, pl_module), trainer.optimizers)
        self._decay.evidence = checks.decayed_1d_evidence(self._wiring.reading.groups)
        self.emit(trainer, checks.wiring_verdicts(self._wiring.reading))
        self._sched_seen = {}
        self._check_mode = True
        if self.check_schedule_fits:  # TFD337: each schedule replayed on a copy, once per fit (host only)
            self.emit(trainer, [training.warmup_past_run(c) for c in schedule_courses(trainer, pl_module)])

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._snapshots = None

    # ------------------------------------------------------------------ train mode
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._check_mode = True

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not trainer.sanity_checking:
            self._check_mode = True

    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: Any) -> None:
        # after the forward: the mode it ran in (the LightningModule's own `on_train_batch_start` runs after ours)
        self._check_train_mode(trainer, pl_module)
        # the first backward at a new global step comes after an optimizer step (global_step counts them)
        step = trainer.global_step
        stepped, self._backward_step = step != self._backward_step and step > 0, step
        if stepped and self.active and self.should_measure(trainer):
            self._check_grads_zeroed(trainer)

    def _check_grads_zeroed(self, trainer: pl.Trainer) -> None:
        """``TFD334``: the first backward after an optimizer step finds the previous gradients still there."""
        flags = stale_grad_flags(trainer.optimizers)
        if flags is not None:
            left = int(flags.sum().item())  # host sync: measuring steps only, and only when gradients were left
            self.emit(trainer, training.grads_not_zeroed(left, len(flags), trainer.global_step), synchronized=False)
        # rank-local under FSDP (each rank reads its own shard); every rank gets here on the same step
        self.resolve_local_findings(trainer)

    def _check_train_mode(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self.active or not self._check_mode:
            return
        self._check_mode = False  # once per epoch start / after validation: a loop over modules, no tensor work
        verdict = training.eval_mode(pl_module.training, trainer.current_epoch, trainer.global_step)
        self.emit(trainer, verdict or training.submodules_in_eval(modules_left_in_eval(pl_module)))

    # ------------------------------------------------------------------ per step
    def busy_at(self, step: int) -> bool:
        """Measuring steps, and the steps with a check pending (train mode, a comparison, the first LR)."""
        return (
            step % self._interval == 0
            or self._check_mode
            or self._compare_due
            or (self._first_lr is None and not self._warmup_decided)
        )

    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        if not self.active:
            return
        self._check_scheduler_cadence(trainer, optimizer)
        first = self._first_lr is None and not self._warmup_decided
        if first and trainer.global_step > 0:
            # resumed without this callback's state: the first LR seen is past any warm-up, so no schedule is
            # inferred from it (TFD330 is not decided in this run)
            self._warmup_decided, first = True, False
        measure = self.should_measure(trainer)
        if not (first or measure):
            return
        lrs = read_lrs(trainer.optimizers)  # host floats (a tensor LR syncs here: first and measuring steps only)
        top = max(lrs.values(), default=0.0)
        if first:
            self._first_lr = top
        self._peak_lr = max(self._peak_lr, top)
        if measure:
            self.log_scalars(trainer, {f"optimizer_audit/lr/{label}": lr for label, lr in lrs.items()})
            if self._wiring.decay_groups:  # TFD324: the decay's lr * weight_decay since the last measuring step
                self._decay.add_exposure(self._wiring.decay_rate(), trainer.global_step)
            self._check_lr(trainer, top, first)
            self._snapshot(trainer, optimizer)
            self._compare_due = True  # on every rank: the comparison after the step resolves findings together
            self._measured_step = trainer.global_step

    def _check_scheduler_cadence(self, trainer: pl.Trainer, optimizer: torch.optim.Optimizer) -> None:
        """``TFD329``: each scheduler's ``last_epoch`` (its ``step()`` calls, a host int) against the optimizer steps
        since the last reading."""
        step = trainer.global_step
        for config in trainer.lr_scheduler_configs:
            scheduler, now = config.scheduler, getattr(config.scheduler, "last_epoch", None)
            if getattr(scheduler, "optimizer", None) is not optimizer or not isinstance(now, int):
                continue
            before = self._sched_seen.get(id(scheduler))
            self._sched_seen[id(scheduler)] = (now, step)
            if before is not None:
                name, key = type(scheduler).__name__, str(id(scheduler))
                self.emit(trainer, training.scheduler_overstepped(name, now - before[0], step - before[1], key=key))

    def _check_lr(self, trainer: pl.Trainer, top: float, first: bool) -> None:
        step = trainer.global_step
        if not first and step > 0:
            self._decide_warmup(trainer, top)
        total = trainer.estimated_stepping_batches
        self.emit(trainer, training.lr_reached_zero(top, self._peak_lr, step, total, self.zero_lr_fraction))

    def _decide_warmup(self, trainer: pl.Trainer, top: float) -> None:
        """``TFD335``, else ``TFD330``: decided once, from the first LR and the LR ``top`` at a later step."""
        if not self.check_warmup or self._warmup_decided:
            return
        self._warmup_decided = True
        if not self._transformer:
            return
        first_lr, step = self._first_lr or 0.0, trainer.global_step
        frozen = training.schedule_frozen(first_lr, top, step, read_schedules(trainer.lr_scheduler_configs))
        if frozen is not None:
            self.emit(trainer, frozen)
            return
        verdict = training.missing_warmup(first_lr, top, step)
        if verdict is not None:
            self._no_warmup = dict(verdict.evidence)
            self.emit(trainer, verdict)
            self._escalate_warmup(trainer)

    def _check_early_loss(self, trainer: pl.Trainer, loss: float, step: int) -> None:
        """``TFD330`` as a warning: without a warm-up, a measured loss early in the run shows what one prevents."""
        if self._first_loss is None:
            if step == 0:
                self._first_loss, self._lowest_loss = loss, loss
            return
        spike = training.early_loss_spike(loss, self._first_loss, self._lowest_loss, step)
        if math.isfinite(loss):
            self._lowest_loss = min(self._lowest_loss, loss)
        if self._spike is None:
            self._spike = spike
        self._escalate_warmup(trainer)

    def _escalate_warmup(self, trainer: pl.Trainer) -> None:
        # each rank's own loss: resolved together after the comparison
        self.emit(trainer, training.warmup_spiked(self._no_warmup, self._spike), synchronized=False)

    def _snapshot(self, trainer: pl.Trainer, optimizer: torch.optim.Optimizer) -> None:
        """Copy one parameter per group (and one frozen one) before the step, and the GradScaler's scale."""
        named = self._named_ids
        if named is None or any(id(p) not in named for g in optimizer.param_groups for p in g["params"]):
            # walked once per fit, and again only when the optimizer holds a parameter the last walk did not see
            model = training_model(trainer, trainer.lightning_module)
            named = self._named_ids = {id(p): n for n, p in model.named_parameters()}
        held = [p for optimizer in trainer.optimizers for g in optimizer.param_groups for p in g["params"]]
        budget = budget_for(self.memory_budget_mb, held, trainer.optimizers)  # host arithmetic on sizes
        snaps, self._frozen_snaps, unfit = snapshot_step(optimizer, named, self._wiring.frozen_ids, budget)
        self._snapshots = snaps or None
        if unfit:
            self.check_aside(
                "byte comparison of every param group",
                f"no parameter with a gradient in {unfit} param group(s) fits the memory budget ({budget / 2**20:.1f} "
                "MiB) for its copy, so those groups are not compared.",
                "a larger `memory_budget_mb`",
            )
        scale = getattr(grad_scaler_of(trainer), "_scale", None)
        self._scale_before = scale.detach().clone() if isinstance(scale, Tensor) else None

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._check_train_mode(trainer, pl_module)  # manual optimization without a backward on this batch
        if not self._compare_due:
            return
        self._compare_due = False
        loss = loss_of(outputs) if self._watching_loss() else None
        self._compare_snapshots(trainer, loss)
        # TFD332 compares each rank's own shard, so it is rank-local under FSDP; every rank that measured this step
        # (all of them: the step was chosen from global_step) resolves it here together.
        self.resolve_local_findings(trainer)

    def _watching_loss(self) -> bool:
        """Whether this measuring step reads the loss: the early window of a run trained from step 0, while a
        missing warm-up may still be found or shown harmful."""
        return (
            self.check_warmup
            and self._transformer
            and self._first_lr is not None
            and self._measured_step <= self.warmup_window
            and (self._first_loss is not None or self._measured_step == 0)
        )

    def _compare_snapshots(self, trainer: pl.Trainer, loss: Tensor | None = None) -> None:
        snaps, self._snapshots = self._snapshots or [], None
        frozen, self._frozen_snaps = self._frozen_snaps, []
        if not snaps and not frozen and loss is None and not self._wiring.decayed_1d:
            return
        with torch.no_grad():
            values: dict[str, Tensor | float] = {snap.name: snap.changed() for snap in snaps}
            values.update({f"__frozen:{snap.name}": snap.changed() for snap in frozen})
            if loss is not None:
                values["__loss"] = loss.detach().float().reshape(())
            norm = parameters_norm(self._wiring.decayed_1d)  # this rank's shards under FSDP, on the device
            if norm is not None:
                values["__decayed_norm"] = norm
            scale = getattr(grad_scaler_of(trainer), "_scale", None)
            if self._scale_before is not None and isinstance(scale, Tensor):
                values["__skipped"] = (scale < self._scale_before).float()
        host = self.to_host(values)  # host sync: one per measuring step, for all of this check's flags and the loss
        if "__loss" in host:
            self._check_early_loss(trainer, host.pop("__loss"), self._measured_step)
        if "__decayed_norm" in host:  # TFD324 as a warning; each rank's own shards under FSDP, resolved after this
            self.emit(trainer, self._decay.observe(self._measured_step, host.pop("__decayed_norm")), synchronized=False)
        moved = [checks.frozen_parameter_moved(s.name, host.pop(f"__frozen:{s.name}", 0.0) > 0) for s in frozen]
        self.emit(trainer, moved, synchronized=False)
        if host.pop("__skipped", 0.0) > 0:
            return  # the GradScaler skipped this step: nothing should have changed
        for name, changed in host.items():
            self._unchanged[name] = 0 if changed > 0 else self._unchanged[name] + 1
            verdict = training.parameter_unchanged(name, self._unchanged[name], self.patience)
            self.emit(trainer, verdict, synchronized=False)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.active and self._first_lr is not None and trainer.global_step >= 2:
            # a run too short to reach a second measuring step: decide the warm-up from the LR now
            self._decide_warmup(trainer, max(read_lrs(trainer.optimizers).values(), default=0.0))

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        return {
            **super().state_dict(),
            "first_lr": self._first_lr,
            "peak_lr": self._peak_lr,
            "warmup_decided": self._warmup_decided,
            "first_loss": self._first_loss,
            "lowest_loss": self._lowest_loss if math.isfinite(self._lowest_loss) else None,
            "no_warmup": self._no_warmup,
            "decay_first": list(self._decay.first) if self._decay.first is not None else None,
            "decay_exposure": self._decay.exposure,
            "decay_last_step": self._decay.last_step,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self._first_lr = state_dict.get("first_lr")
        self._peak_lr = float(state_dict.get("peak_lr", 0.0))
        self._warmup_decided = bool(state_dict.get("warmup_decided", False))
        self._first_loss = state_dict.get("first_loss")
        lowest = state_dict.get("lowest_loss")
        self._lowest_loss = float(lowest) if lowest is not None else math.inf
        self._no_warmup = state_dict.get("no_warmup")
        first, last = state_dict.get("decay_first"), state_dict.get("decay_last_step")
        self._decay.first = (int(first[0]), float(first[1])) if first else None
        self._decay.exposure = float(state_dict.get("decay_exposure", 0.0))
        self._decay.last_step = int(last) if last is not None else None
