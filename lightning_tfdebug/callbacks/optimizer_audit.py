"""OptimizerAudit: is the optimizer wired to the model the way training needs, and does the LR behave?"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor, nn

from lightning_tfdebug.core.base import DebugCallback, check_number
from lightning_tfdebug.core.batch import loss_of
from lightning_tfdebug.core.distributed import clean_param_name, local_tensor
from lightning_tfdebug.core.groups import training_model
from lightning_tfdebug.core.model import grad_scaler_of
from lightning_tfdebug.findings import OnFinding
from lightning_tfdebug.functional.optimizer_checks import decayed_norms_shrink

# Optimizers whose ``weight_decay`` is L2 added to the gradient (coupled), unless ``decoupled_weight_decay`` is set.
_COUPLED_DECAY = frozenset({"Adam", "NAdam", "RAdam", "Adamax", "Adagrad", "Adadelta", "RMSprop"})
_MODE_DEPENDENT = (nn.Dropout, nn.modules.batchnorm._BatchNorm, nn.modules.instancenorm._InstanceNorm)


_FP16_SQ_UNDERFLOW_GRAD = 1.7e-4
"""Gradients below this square to less than float16's smallest subnormal (about 6e-8)."""
_HALF_EPS_STEP_FACTOR = 10.0
"""TFD333 when an underflowed second moment can make a step this many times Adam's normal one."""
_DECAY_PER_STEP = 5e-3
"""TFD336 when ``lr * weight_decay`` exceeds this: weights halve in under ~140 steps (recipes use 1e-5 to 1e-4)."""


def _names(names: list[str], limit: int = 8) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def is_transformer(module: nn.Module) -> bool:
    """Whether the model has attention: an ``nn.MultiheadAttention`` or a module whose class name says Attention."""
    return any(
        isinstance(m, nn.MultiheadAttention) or "attention" in type(m).__name__.lower() for m in module.modules()
    )


class OptimizerAudit(DebugCallback):
    r"""Checks how the optimizer is wired to the model, the module's train mode, and the learning rate it really uses.

    At the start of training (after any checkpoint is restored), once:

    - every trainable parameter must sit in exactly one param group of one optimizer: missing ones are an error
      naming them (``TFD320``: a head or adapter left out, or an optimizer built before the model was moved or
      rebuilt), parameters listed twice get ``TFD321``, frozen parameters (``requires_grad=False``) still in the
      optimizer get ``TFD322`` (info: torch optimizers skip parameters without a gradient, as in a LoRA fine-tune
      whose optimizer was built from all parameters; a warning once a measured step changes one of them), and
      tensors in the optimizer that are not parameters of the module get ``TFD323`` (stale copies);
    - weight decay on 1-D parameters (norm weights, biases) is ``TFD324`` (info: at the decay values and run lengths
      of published recipes nothing measurable happens to them; a warning once their norm, measured on measuring
      steps, fell by more than 10% of its first measured value and the decay accounts for at least half of that
      fall); on embedding tables ``TFD325`` (info; common practice excludes them); ``Adam``-family optimizers
      with ``weight_decay > 0`` (coupled L2, not decoupled decay) get ``TFD326`` (info): use ``AdamW``; over
      float16 parameters (moments in float16 too) with ``eps`` below 1.7e-5, ``TFD333``: the second moment of
      gradients below 1.7e-4 underflows and the step becomes ``lr * m / eps``, over 10x Adam's normal one (a
      division by zero at the default 1e-8).

    At the first batch of each epoch and the first batch after each validation run, once its forward has run (so an
    ``.eval()`` from a module hook or from ``training_step`` itself is seen): the module must be in train
    mode (``TFD327``, error). Submodules with mode-dependent layers (dropout, batch/instance norm) left in eval mode
    while the module trains get ``TFD328`` (info; deliberate for frozen BatchNorm).

    Every optimizer step, without touching tensors: an LR scheduler whose ``last_epoch`` (its count of ``step()``
    calls) advanced more than once since its optimizer's previous step (``TFD329``: stepped per micro-batch, or by
    hand and by Lightning). On measuring steps: the effective LR of every param group is logged
    (``optimizer_audit/lr/<group>``); a transformer trained from step 0 whose LR at a later step is not above its LR
    at the first step has no warm-up (``TFD330``: info, since many runs train well without one; a warning when a
    measured loss in the first ``warmup_window`` steps shows what a warm-up prevents: not finite, above the first
    step's loss by 10%, or doubled from its lowest point; never decided from the first step after a resume, which
    is past any warm-up); an LR that reached zero before 90% of the run (``TFD331``); and one
    parameter per group is snapshotted before the step and compared byte for byte after it: unchanged on
    ``patience`` consecutive measured steps although it had a gradient and a non-zero LR is ``TFD332``. Steps the
    fp16 GradScaler skipped are not counted. At the first backward after an optimizer step on a measuring step, a
    param group whose first trainable parameter still holds non-zero gradients from before the step is ``TFD334``
    (manual optimization without ``zero_grad``); whether ``.grad`` exists is host-side, its values are read only
    when it does.

    Logged keys (on measuring steps):

    | key | meaning |
    | --- | --- |
    | `optimizer_audit/lr/<group>` | learning rate of a param group as the optimizer will apply it at this step |

    ``<group>`` is the param group's ``name`` when it has one, else ``group<i>`` (``opt<j>.group<i>`` with several
    optimizers).

    Findings: ``TFD320`` to ``TFD336`` as above, and: ``TFD335``, a transformer's LR unchanged since the first step
    and below half of the schedulers' base LR (a step-sized warm-up stepped per epoch; reported instead of
    ``TFD330``); ``TFD336``, decoupled or SGD weight decay with ``lr * weight_decay`` above 5e-3 per step (weights
    halving in under ~140 steps). See ``docs/findings.md``.

    Distributed: every rank holds the same optimizer, parameters and LR under DDP, so every rank reaches the same
    findings; no collective runs. Under FSDP the byte comparison uses each rank's local shard, so ``TFD332`` is
    rank-local: every rank resolves it together after each measuring step (one boolean reduction, only when
    ``on_finding`` is not ``"warn"``).

    Args:
        every_n_steps: measure when ``global_step % every_n_steps == 0``; default: the Trainer's
            ``log_every_n_steps``.
        on_finding: ``"warn"``, ``"stop"`` or ``"raise"``.
        check_warmup: check that a transformer's LR warms up (``TFD330``).
        warmup_window: the first optimizer steps in which a loss spike makes a missing warm-up a warning.
        zero_lr_fraction: ``TFD331`` when the LR is zero before this fraction of the run's steps.
        patience: consecutive measured steps a parameter must stay byte-identical for ``TFD332``.

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

    def __init__(
        self,
        every_n_steps: int | None = None,
        on_finding: OnFinding = "warn",
        check_warmup: bool = True,
        zero_lr_fraction: float = 0.9,
        patience: int = 2,
        warmup_window: int = 1000,
    ) -> None:
        super().__init__(every_n_steps=every_n_steps, on_finding=on_finding)
        if not isinstance(check_warmup, bool):
            raise TypeError(f"`check_warmup` must be True or False; got {check_warmup!r}.")
        check_number("zero_lr_fraction", zero_lr_fraction, low=0.0, high=1.0)
        check_number("patience", patience, low=1, integer=True)
        check_number("warmup_window", warmup_window, low=1, integer=True)
        self.warmup_window = warmup_window
        self.check_warmup = check_warmup
        self.zero_lr_fraction = float(zero_lr_fraction)
        self.patience = patience
        self._check_mode = False
        self._sched_seen: dict[int, tuple[int, int]] = {}  # id(scheduler) -> (its step() calls, global step)
        self._first_lr: float | None = None
        self._peak_lr = 0.0
        self._warmup_decided = False
        self._snapshots: list[tuple[str, Tensor, Tensor]] | None = None
        self._scale_before: Tensor | None = None
        self._unchanged: dict[str, int] = defaultdict(int)
        self._compare_due = False
        self._transformer = False
        self._backward_step = -1  # the global step of the last backward seen: a new one is the first after a step
        self._no_warmup: dict[str, Any] | None = None  # the evidence of TFD330 (info) until the early loss shows harm
        self._first_loss: float | None = None  # the loss of step 0, read on that measuring step
        self._lowest_loss = math.inf
        self._measured_step = 0  # the optimizer step whose snapshot is compared at the end of its batch
        self._spike: dict[str, Any] | None = None  # the first early loss spike, kept until the warm-up is decided
        self._frozen_in_optimizer: set[int] = set()  # ids of frozen parameters the optimizer holds (TFD322)
        self._frozen_snaps: list[tuple[str, Tensor, Tensor]] = []
        # TFD324 measured: the decayed 1-D parameters, their groups, their first measured norm and the decay since
        self._decayed_1d: list[nn.Parameter] = []
        self._decay_groups: list[dict[str, Any]] = []
        self._decay_evidence: dict[str, Any] = {}
        self._decay_first: tuple[int, float] | None = None
        self._decay_exposure = 0.0  # sum of lr * weight_decay over the optimizer steps since the first norm
        self._decay_last_step: int | None = None

    @property
    def state_key(self) -> str:
        return self._generate_state_key(every_n_steps=self.every_n_steps)

    # ------------------------------------------------------------------ set-up and static audit
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._named_ids = None  # a new fit: the parameter names are walked again at the first snapshot
        if not self.active:
            return
        self._transformer = is_transformer(pl_module)
        self._audit_wiring(trainer, pl_module)
        self._sched_seen = {}
        self._check_mode = True

    def _audit_wiring(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        model = training_model(trainer, pl_module)
        self._decayed_1d, self._decay_groups, self._decay_evidence = [], [], {}
        named: dict[int, tuple[str, nn.Parameter]] = {}
        for name, param in model.named_parameters(remove_duplicate=True):
            named.setdefault(id(param), (clean_param_name(name), param))
        embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
        membership: dict[int, list[str]] = defaultdict(list)
        several = len(trainer.optimizers) > 1
        strangers = 0
        for oi, optimizer in enumerate(trainer.optimizers):
            for gi, group in enumerate(optimizer.param_groups):
                label = self._group_label(oi, gi, group, several)
                decay = float(group.get("weight_decay", 0.0) or 0.0)
                one_d, embed = [], []
                for param in group["params"]:
                    membership[id(param)].append(label)
                    if id(param) not in named:
                        strangers += 1
                        continue
                    name = named[id(param)][0]
                    if not param.requires_grad:
                        continue  # frozen: the optimizer skips it (no gradient), so no decay reaches it either
                    if decay > 0 and param.ndim <= 1:
                        one_d.append(name)
                    elif decay > 0 and id(param) in embeddings:
                        embed.append(name)
                if one_d:
                    self.emit_code(
                        trainer,
                        "TFD324",
                        f"Weight decay {decay:g} is applied to {len(one_d)} one-dimensional parameters (norm weights, "
                        f"biases) in param group {label}: {_names(one_d)}. Advice only while their norm is not "
                        "measured to shrink (watched on measuring steps).",
                        {"group": label, "weight_decay": decay, "count": len(one_d)},
                        key=label,
                    )
                    self._decayed_1d.extend(
                        p for p in group["params"] if p.requires_grad and p.ndim <= 1 and id(p) in named
                    )
                    self._decay_groups.append(group)
                    self._decay_evidence.setdefault("groups", []).append(label)
                    self._decay_evidence["weight_decay"] = max(decay, self._decay_evidence.get("weight_decay", 0.0))
                    self._decay_evidence["count"] = self._decay_evidence.get("count", 0) + len(one_d)
                if embed:
                    self.emit_code(
                        trainer,
                        "TFD325",
                        f"Weight decay {decay:g} is applied to embedding tables in param group {label}: "
                        f"{_names(embed)}.",
                        {"group": label, "weight_decay": decay},
                        key=label,
                    )
                kind = type(optimizer).__name__
                self._check_half_eps(trainer, kind, label, group)
                self._check_decay_rate(trainer, kind, label, group, decay)
                if decay > 0 and kind in _COUPLED_DECAY and not group.get("decoupled_weight_decay", False):
                    self.emit_code(
                        trainer,
                        "TFD326",
                        f"{kind} with weight_decay={decay:g} adds L2 to the gradient, which the adaptive step then "
                        "rescales: the decay is not the decoupled weight decay transformer recipes use "
                        f"(group {label}).",
                        {"optimizer": kind, "weight_decay": decay, "group": label},
                        key=kind,
                    )
        missing = [n for pid, (n, p) in named.items() if p.requires_grad and pid not in membership]
        frozen = [n for pid, (n, p) in named.items() if not p.requires_grad and pid in membership]
        twice = [n for pid, (n, _) in named.items() if len(membership.get(pid, ())) > 1]
        if missing:
            self.emit_code(
                trainer,
                "TFD320",
                f"{len(missing)} trainable parameters are in no optimizer param group and will never change: "
                f"{_names(missing)}.",
                {"count": len(missing), "names": missing[:50]},
            )
        if twice:
            self.emit_code(
                trainer,
                "TFD321",
                f"{len(twice)} parameters appear in more than one param group or optimizer: {_names(twice)}.",
                {"count": len(twice), "names": twice[:50]},
            )
        self._frozen_in_optimizer = {pid for pid, (_, p) in named.items() if not p.requires_grad and pid in membership}
        if frozen:
            self.emit_code(
                trainer,
                "TFD322",
                f"{len(frozen)} frozen parameters (requires_grad=False) are in the optimizer: {_names(frozen)}. Torch "
                "optimizers skip parameters without a gradient, so they stay put unless this optimizer steps them "
                "anyway (checked on measuring steps).",
                {"count": len(frozen), "names": frozen[:50]},
            )
        if strangers:
            self.emit_code(
                trainer,
                "TFD323",
                f"The optimizer holds {strangers} tensors that are not parameters of the module: they are updated "
                "but the model never uses them.",
                {"count": strangers},
            )

    def _check_decay_rate(
        self, trainer: pl.Trainer, kind: str, label: str, group: dict[str, Any], decay: float
    ) -> None:
        """``TFD336``: decay that shrinks every weight by more than ``_DECAY_PER_STEP`` of itself per step.

        Decoupled decay (AdamW) and SGD's L2 both multiply the weights by ``1 - lr * weight_decay`` every step;
        Adam's coupled L2 is rescaled by the adaptive step (that is ``TFD326``'s). The LR is the group's peak as a
        scheduler recorded it (``initial_lr``), else its current value: a warm-up starts far below the peak.
        """
        if decay <= 0 or (kind in _COUPLED_DECAY and not group.get("decoupled_weight_decay", False)):
            return
        lr = group.get("initial_lr", group.get("lr"))
        if lr is None:
            return
        rate = float(lr) * decay  # a tensor LR is read once, at the start of training
        if not rate > _DECAY_PER_STEP:
            return
        self.emit_code(
            trainer,
            "TFD336",
            f"Weight decay {decay:g} at a learning rate of {float(lr):.3g} shrinks every decayed weight by "
            f"{rate:.3g} of itself per step (group {label}, {kind}): without gradients pushing back, weights halve "
            f"every {math.log(2) / rate:.0f} steps, so decay rather than the loss sets their scale.",
            {"group": label, "weight_decay": decay, "lr": float(lr), "decay_per_step": rate},
            key=label,
        )

    def _check_half_eps(self, trainer: pl.Trainer, kind: str, label: str, group: dict[str, Any]) -> None:
        """``TFD333``: an Adam-family group over float16 parameters (so float16 moments) with a small ``eps``."""
        eps = group.get("eps")
        if "betas" not in group or isinstance(eps, bool) or not isinstance(eps, (int, float)):
            return
        if not any(p.dtype == torch.float16 for p in group["params"]):
            return
        # torch's Adam(W) keeps exp_avg / exp_avg_sq in the parameter's dtype: for |g| < ~2.4e-4, g*g is below
        # float16's smallest subnormal and the second moment is 0, so the step is lr * m / eps instead of ~lr.
        eps16 = float(torch.tensor(eps, dtype=torch.float16))
        factor = _FP16_SQ_UNDERFLOW_GRAD / eps16 if eps16 > 0 else float("inf")
        if factor <= _HALF_EPS_STEP_FACTOR:
            return
        outcome = (
            "eps itself rounds to 0 in float16, so that step divides by zero (inf/nan weights)"
            if eps16 == 0
            else f"that step becomes lr * m / eps, up to {factor:.3g}x the normal Adam step"
        )
        self.emit_code(
            trainer,
            "TFD333",
            f"{kind} steps float16 parameters with eps={eps:g} (group {label}): its moments are float16 too, the "
            f"second moment of any gradient below {_FP16_SQ_UNDERFLOW_GRAD:.1e} underflows to 0, and {outcome}.",
            {"optimizer": kind, "eps": eps, "group": label, "max_step_factor": factor},
            key=label,
        )

    @staticmethod
    def _group_label(oi: int, gi: int, group: dict[str, Any], several: bool) -> str:
        name = group.get("name")
        if isinstance(name, str) and name:
            label = name
        else:
            label = f"group{gi}"
        return f"opt{oi}.{label}" if several else label

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
        """``TFD334``: the first backward after an optimizer step finds the previous gradients still there.

        Lightning's automatic optimization zeroes (to ``None``) before that backward; a manual ``training_step``
        that never calls ``zero_grad`` adds every step's gradient to all the earlier ones. One parameter per param
        group is looked at: whether its ``.grad`` exists is host-side; only when one does (``zero_grad`` with
        ``set_to_none=False``, or no ``zero_grad``) are its values read, on this measuring step.
        """
        probes = []
        for optimizer in trainer.optimizers:
            for group in optimizer.param_groups:
                param = next((p for p in group["params"] if p.requires_grad), None)
                if param is not None and param.grad is not None:
                    probes.append(param)
        if probes:
            with torch.no_grad():
                flags = torch.stack([(local_tensor(p.grad) != 0).any().to(probes[0].device) for p in probes])
            # host sync: measuring steps only, and only when gradients were left allocated
            left = int(flags.sum().item())
            if left:
                self.emit_code(
                    trainer,
                    "TFD334",
                    f"Gradients were not zeroed after the optimizer step: at the first backward of step "
                    f"{trainer.global_step}, {left} of {len(probes)} param groups still hold the previous steps' "
                    "gradients, so every step adds its gradient to all the earlier ones.",
                    {"groups_with_old_grads": left, "groups_probed": len(probes)},
                    synchronized=False,
                )
        # rank-local under FSDP (each rank reads its own shard); every rank gets here on the same step
        self.resolve_local_findings(trainer)

    def _check_train_mode(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self.active or not self._check_mode:
            return
        self._check_mode = False  # once per epoch start / after validation: a loop over modules, no tensor work
        where = f"epoch {trainer.current_epoch}, step {trainer.global_step}"
        if not pl_module.training:
            self.emit_code(
                trainer,
                "TFD327",
                f"The module is in eval mode at a training batch ({where}): dropout is off and batch norm uses "
                "frozen running statistics, so training is not the training you configured.",
                {"epoch": trainer.current_epoch},
                key=f"epoch{trainer.current_epoch}",
            )
            return
        stuck = [
            name or type(pl_module).__name__
            for name, m in pl_module.named_modules()
            if not m.training and isinstance(m, _MODE_DEPENDENT) and (not isinstance(m, nn.Dropout) or m.p > 0)
        ]
        if stuck:
            self.emit_code(
                trainer,
                "TFD328",
                f"{len(stuck)} mode-dependent submodules are in eval mode while the module trains: {_names(stuck)}.",
                {"count": len(stuck)},
            )

    # ------------------------------------------------------------------ per step
    def busy_at(self, step: int) -> bool:
        """Measuring steps, and the steps with a check pending: the module's train mode (once per epoch and after
        validation), the comparison after a snapshot, the first learning rate. The scheduler's cadence is read at
        each of them (calls against the optimizer steps since), so nothing is needed on the steps between."""
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
        if not (first or self.should_measure(trainer)):
            return
        lrs = self._read_lrs(trainer)
        top = max(lrs.values(), default=0.0)
        if first:
            self._first_lr = top
        self._peak_lr = max(self._peak_lr, top)
        if self.should_measure(trainer):
            self.log_scalars(trainer, lrs)
            self._add_decay_exposure(trainer.global_step)
            self._check_lr(trainer, top, first)
            self._snapshot(trainer, optimizer)
            self._compare_due = True  # on every rank: the comparison after the step resolves findings together
            self._measured_step = trainer.global_step

    def _add_decay_exposure(self, step: int) -> None:
        """Add up ``lr * weight_decay`` of the groups decaying 1-D parameters since the last measuring step: the
        strongest group's rate now, times the steps since (the LRs were just read on this measuring step)."""
        if not self._decay_groups:
            return
        rate = max(float(g["lr"]) * float(g.get("weight_decay", 0.0) or 0.0) for g in self._decay_groups)
        if self._decay_last_step is not None and self._decay_first is not None:
            self._decay_exposure += rate * max(step - self._decay_last_step, 0)
        self._decay_last_step = step

    def _check_decay_shrink(self, trainer: pl.Trainer, norm: float) -> None:
        """``TFD324`` as a warning: the decayed 1-D parameters' norm measured to fall, the decay accounting for it."""
        step = self._measured_step
        if self._decay_first is None:
            self._decay_first, self._decay_exposure = (step, norm), 0.0
            return
        verdict = decayed_norms_shrink(self._decay_first, (step, norm), self._decay_exposure, self._decay_evidence)
        if verdict is not None:
            self.emit_code(
                trainer,
                verdict.code,
                verdict.message,
                verdict.evidence,
                severity=verdict.severity,
                key="shrink",
                step=step,
                synchronized=False,  # each rank's own shard under FSDP; resolved together after the comparison
            )

    def _check_scheduler_cadence(self, trainer: pl.Trainer, optimizer: torch.optim.Optimizer) -> None:
        for config in trainer.lr_scheduler_configs:
            scheduler = config.scheduler
            if getattr(scheduler, "optimizer", None) is not optimizer:
                continue
            # `last_epoch` counts the scheduler's `step()` calls (a host int: no tensor work, nothing wrapped)
            now = getattr(scheduler, "last_epoch", None)
            if not isinstance(now, int):
                continue
            # read on the steps this callback is called at (measuring steps inside TFDebug): the calls since the last
            # reading against the optimizer steps since, so a scheduler stepped twice per step shows as 2n in n
            step = trainer.global_step
            before = self._sched_seen.get(id(scheduler))
            self._sched_seen[id(scheduler)] = (now, step)
            if before is None or step <= before[1]:
                continue
            calls, steps = now - before[0], step - before[1]
            if calls > steps:
                per_step = (
                    f"{calls} times between two optimizer steps"
                    if steps == 1
                    else (f"{calls} times over {steps} optimizer steps")
                )
                self.emit_code(
                    trainer,
                    "TFD329",
                    f"The LR scheduler {type(scheduler).__name__} was stepped {per_step}: a schedule sized in "
                    "optimizer steps runs that many times too fast.",
                    {"calls": calls, "optimizer_steps": steps, "scheduler": type(scheduler).__name__},
                    key=str(id(scheduler)),
                )

    def _read_lrs(self, trainer: pl.Trainer) -> dict[str, float]:
        several = len(trainer.optimizers) > 1
        out = {}
        for oi, optimizer in enumerate(trainer.optimizers):
            for gi, group in enumerate(optimizer.param_groups):
                lr = group["lr"]
                # a tensor LR (capturable / compiled optimizers) costs a host sync here: measuring steps only
                out[f"optimizer_audit/lr/{self._group_label(oi, gi, group, several)}"] = float(lr)
        return out

    def _check_lr(self, trainer: pl.Trainer, top: float, first: bool) -> None:
        step = trainer.global_step
        if not first and step > 0:
            self._decide_warmup(trainer, top)
        total = trainer.estimated_stepping_batches
        if self._peak_lr > 0 and top <= 1e-12 * self._peak_lr and step < self.zero_lr_fraction * float(total):
            self.emit_code(
                trainer,
                "TFD331",
                f"The learning rate reached zero at step {step}, long before the end of the run "
                f"({int(total) if total != float('inf') else 'unbounded'} steps): the remaining steps train nothing.",
                {"step": step, "total_steps": float(total), "peak_lr": self._peak_lr},
            )

    def _decide_warmup(self, trainer: pl.Trainer, top: float) -> None:
        if not self.check_warmup or self._warmup_decided:
            return
        self._warmup_decided = True
        first_lr = self._first_lr or 0.0
        step = trainer.global_step
        if self._transformer and first_lr > 0 and top <= first_lr * (1 + 1e-9):
            if top >= first_lr * (1 - 1e-9) and self._stuck_below_base(trainer, top):
                return
            self._no_warmup = {"first_lr": first_lr, "lr": top, "step": step}
            self.emit_code(
                trainer,
                "TFD330",
                f"No learning-rate warm-up: the LR at step {step} ({top:.3g}) is not above the LR of the first "
                f"step ({first_lr:.3g}), so this transformer starts at its peak LR. Advice only while the early loss "
                "stays well-behaved (watched for the first warmup_window steps).",
                self._no_warmup,
            )
            self._escalate_warmup(trainer)

    def _check_early_loss(self, trainer: pl.Trainer, loss: float, step: int) -> None:
        """``TFD330`` as a warning: without a warm-up, a measured loss early in the run shows what one prevents."""
        if self._first_loss is None:
            if step == 0:
                self._first_loss, self._lowest_loss = loss, loss
            return
        first, lowest = self._first_loss, self._lowest_loss
        spike = None
        if not math.isfinite(loss):
            spike = f"the loss at step {step} is {loss}"
        elif loss > 1.1 * first:
            spike = f"the loss at step {step} ({loss:.4g}) rose above the first step's ({first:.4g})"
        elif loss > 2.0 * lowest and loss - lowest > 0.1 * first:
            spike = f"the loss at step {step} ({loss:.4g}) doubled from its lowest measured value ({lowest:.4g})"
        if math.isfinite(loss):
            self._lowest_loss = min(lowest, loss)
        if spike is not None and self._spike is None:
            self._spike = {"spike": spike, "loss": loss, "first_loss": first, "lowest_loss": lowest, "spike_step": step}
        self._escalate_warmup(trainer)

    def _escalate_warmup(self, trainer: pl.Trainer) -> None:
        if self._spike is None or self._no_warmup is None:
            return
        self.emit_code(
            trainer,
            "TFD330",
            f"No learning-rate warm-up, and the early loss spiked: {self._spike['spike']}, with the LR at its peak "
            f"from the first step ({self._no_warmup['first_lr']:.3g}).",
            {**self._no_warmup, **self._spike},
            severity="warning",
            key="spike",
            step=self._spike["spike_step"],
            synchronized=False,  # each rank's own loss; resolved together after the comparison
        )

    def _stuck_below_base(self, trainer: pl.Trainer, top: float) -> bool:
        """``TFD335``: the LR has not moved since the first step and sits far below the schedulers' base LR.

        A schedule sized in optimizer steps (a warm-up ``LambdaLR``) stepped per epoch, Lightning's default
        ``interval``, holds its first value for the whole epoch: a warm-up frozen at its first percent. Host-side
        attributes only.
        """
        configs = [c for c in trainer.lr_scheduler_configs if getattr(c.scheduler, "base_lrs", None)]
        if not configs:
            return False
        base = max(float(lr) for c in configs for lr in c.scheduler.base_lrs)
        if not top < 0.5 * base:
            return False
        intervals = sorted({str(c.interval) for c in configs})
        names = sorted({type(c.scheduler).__name__ for c in configs})
        step = trainer.global_step
        self.emit_code(
            trainer,
            "TFD335",
            f"The learning rate has not moved since the first step: at step {step} it is {top:.3g}, "
            f"{top / base:.1%} of the {base:.3g} the optimizer was configured with, and the scheduler "
            f"({', '.join(names)}, interval {'/'.join(intervals)}) has not raised it.",
            {"lr": top, "base_lr": base, "step": step, "interval": intervals, "schedulers": names},
            step=step,
        )
        return True

    def _names_by_id(self, trainer: pl.Trainer, optimizer: torch.optim.Optimizer) -> dict[int, str]:
        """The parameter names by ``id``: walked once per fit, and again only when the optimizer holds a parameter the
        last walk did not see (a walk over every module on every measuring step costs more than the snapshot)."""
        named = self.__dict__.get("_named_ids")
        if named is None or any(id(p) not in named for g in optimizer.param_groups for p in g["params"]):
            model = training_model(trainer, trainer.lightning_module)
            named = self._named_ids = {id(p): n for n, p in model.named_parameters()}
        return named

    def _snapshot(self, trainer: pl.Trainer, optimizer: torch.optim.Optimizer) -> None:
        named = self._names_by_id(trainer, optimizer)
        snaps = []
        with torch.no_grad():
            for gi, group in enumerate(optimizer.param_groups):
                if not float(group["lr"]) > 0:  # host-side float, read just above
                    continue
                # a parameter this rank holds elements of (an FSDP shard may be empty on some ranks)
                param = next(
                    (p for p in group["params"] if p.grad is not None and local_tensor(p.detach()).numel() > 0), None
                )
                if param is None:
                    continue
                name = clean_param_name(named.get(id(param), f"group{gi}.param"))
                snaps.append((name, param, local_tensor(param.detach()).clone()))
            # one frozen parameter the optimizer holds: torch optimizers skip it (no gradient); TFD322 becomes a
            # warning if this one moves
            frozen = next(
                (
                    p
                    for group in optimizer.param_groups
                    for p in group["params"]
                    if id(p) in self._frozen_in_optimizer and local_tensor(p.detach()).numel() > 0
                ),
                None,
            )
            self._frozen_snaps = (
                [(clean_param_name(named.get(id(frozen), "frozen")), frozen, local_tensor(frozen.detach()).clone())]
                if frozen is not None
                else []
            )
            scale = getattr(grad_scaler_of(trainer), "_scale", None)
            self._scale_before = scale.detach().clone() if isinstance(scale, Tensor) else None
        self._snapshots = snaps or None

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
        if not snaps and not frozen and loss is None and not self._decayed_1d:
            return
        with torch.no_grad():
            values: dict[str, Tensor | float] = {
                name: (local_tensor(param.detach()) != before).any().float() for name, param, before in snaps
            }
            values.update(
                {f"__frozen:{name}": (local_tensor(p.detach()) != before).any().float() for name, p, before in frozen}
            )
            if loss is not None:
                values["__loss"] = loss.detach().float().reshape(())
            shards = [t for t in (local_tensor(p.detach()) for p in self._decayed_1d) if t.numel()]
            if shards:  # the decayed 1-D parameters' norm (this rank's shards under FSDP), on the device
                values["__decayed_norm"] = torch.linalg.vector_norm(
                    torch.stack([n.float() for n in torch._foreach_norm(shards)])
                )
            scale = getattr(grad_scaler_of(trainer), "_scale", None)
            if self._scale_before is not None and isinstance(scale, Tensor):
                values["__skipped"] = (scale < self._scale_before).float()
        host = self.to_host(values)  # host sync: one per measuring step, for all of this check's flags and the loss
        if "__loss" in host:
            self._check_early_loss(trainer, host.pop("__loss"), self._measured_step)
        if "__decayed_norm" in host:
            self._check_decay_shrink(trainer, host.pop("__decayed_norm"))
        for key in [k for k in host if k.startswith("__frozen:")]:
            if host.pop(key) > 0:
                name = key.split(":", 1)[1]
                self.emit_code(
                    trainer,
                    "TFD322",
                    f"Frozen parameter {name} (requires_grad=False) changed at an optimizer step: this optimizer "
                    "steps frozen parameters (weight decay or momentum without a gradient, or a gradient set by "
                    "hand), so the weights meant to stay fixed drift.",
                    {"parameter": name},
                    severity="warning",
                    key="moved",
                    synchronized=False,
                )
        if host.pop("__skipped", 0.0) > 0:
            return  # the GradScaler skipped this step: nothing should have changed
        for name, changed in host.items():
            self._unchanged[name] = 0 if changed > 0 else self._unchanged[name] + 1
            if self._unchanged[name] >= self.patience:
                self.emit_code(
                    trainer,
                    "TFD332",
                    f"Parameter {name} was byte-identical after {self._unchanged[name]} consecutive measured optimizer "
                    "steps although it had a gradient and a non-zero learning rate.",
                    {"parameter": name, "steps": self._unchanged[name]},
                    key=name,
                    synchronized=False,
                )

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.active and self._first_lr is not None and trainer.global_step >= 2:
            # a run too short to reach a second measuring step: decide the warm-up from the LR now
            self._decide_warmup(trainer, max(self._read_lrs(trainer).values(), default=0.0))

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
            "decay_first": list(self._decay_first) if self._decay_first is not None else None,
            "decay_exposure": self._decay_exposure,
            "decay_last_step": self._decay_last_step,
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
        first = state_dict.get("decay_first")
        self._decay_first = (int(first[0]), float(first[1])) if first else None
        self._decay_exposure = float(state_dict.get("decay_exposure", 0.0))
        last = state_dict.get("decay_last_step")
        self._decay_last_step = int(last) if last is not None else None
