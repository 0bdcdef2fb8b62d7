"""GradNormMonitor: gradient norms per block and in total, with explosion, vanishing and wiring diagnoses."""

from __future__ import annotations

import math
from typing import Any, ClassVar

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins.precision.amp import _optimizer_handles_unscaling
from torch import Tensor

from lightning_tfdebug.core.base import DebugCallback, check_number
from lightning_tfdebug.core.compat import overrides
from lightning_tfdebug.core.distributed import DTensor, local_tensor, packed_reduce
from lightning_tfdebug.core.groups import ReductionLayout, build_layout, training_model, validate_group_args
from lightning_tfdebug.core.keys import Key
from lightning_tfdebug.core.model import grad_scaler_of
from lightning_tfdebug.core.step import step_norms
from lightning_tfdebug.core.tracking import RunningWindow
from lightning_tfdebug.findings import OnFinding
from lightning_tfdebug.functional.grad_checks import (
    GradMemory,
    GradReading,
    grad_verdicts,
    overclipping,
    still_scaled,
    unused_parameters,
)
from lightning_tfdebug.functional.norms import group_sums, grouped_sq_norms
from lightning_tfdebug.functional.update_checks import outside_optimizers
from lightning_tfdebug.functional.verdicts import Verdict

_TOTALS = "gradient norm: total, clipped and non-finite"
"""The dashboard chart of the total, the clipped fraction and the non-finite count."""


class GradNormMonitor(DebugCallback):
    r"""Logs gradient L2 norms per group and in total, and diagnoses exploding, vanishing and missing gradients.

    Norms are taken in ``on_before_optimizer_step``: after AMP unscaling and after all micro-batches of gradient
    accumulation, before clipping. The total equals what ``torch.nn.utils.clip_grad_norm_`` returns on the same
    gradients. It is computed with fused ``_foreach_norm`` kernels on the device; under FSDP1/FSDP2 each rank's
    shard contributes once through one packed collective, under DDP no collective runs. On steps that do not
    measure, the callback does no tensor work (with norm clipping on, it adds one device comparison to the norm
    that clipping computes anyway, to count clipped steps).

    Logged keys (on measuring steps): :attr:`KEYS`, tabled in ``docs/callbacks/grad_norm_monitor.md``.

    Findings: ``TFD301`` explosion, ``TFD302`` vanishing group, ``TFD303`` non-finite gradients, ``TFD304`` unused
    parameters, ``TFD305`` gradients still scaled by AMP, ``TFD306`` norm clipping cuts every step by over 100x
    (``gradient_clip_val`` far below the gradient norm, for ``patience`` measurements); see ``docs/findings.md``.

    Args:
        every_n_steps: measure when ``global_step % every_n_steps == 0``; default: the Trainer's
            ``log_every_n_steps``.
        on_finding: ``"warn"``, ``"stop"`` or ``"raise"`` (see :class:`~lightning_tfdebug.DebugCallback`).
        groups: ``{group_name: regex}`` to group parameters by name instead of by block.
        group_depth: group by the first ``group_depth`` segments of parameter names instead of by block.
        log_groups: log one key per group (``False``: only the total, non-finite count and clip fraction).
        explosion_factor: ``TFD301`` when the total exceeds this multiple of the median of its recent history.
        warmup_measurements: measurements collected before ``TFD301`` can fire.
        history: number of recent measurements the median is taken over.
        vanishing_ratio: ``TFD302`` when a group's norm is below this fraction of the largest group norm...
        patience: ...for this many consecutive measurements; also the measurements a trainable parameter must go
            without a gradient before ``TFD304``.

    Raises:
        ValueError: on an argument outside its allowed range.

    Example:
        ```python
        trainer = Trainer(callbacks=[GradNormMonitor(every_n_steps=10)])
        ```

        LightningCLI:

        ```yaml
        trainer:
          callbacks:
            - class_path: lightning_tfdebug.GradNormMonitor
              init_args:
                every_n_steps: 10
                explosion_factor: 10.0
        ```
    """

    KEYS: ClassVar[tuple[Key, ...]] = (
        Key("grad_norm/total", "L2 norm over all gradients (unscaled, before clipping)", chart=_TOTALS),
        Key(
            "grad_norm/<group>",
            "L2 norm over one group (`blocks.0`, `embeddings`, `head`, `other`, or your regex groups)",
            chart="gradient norm per block",
        ),
        Key("grad_norm/nonfinite", "number of parameter tensors whose gradient holds inf or nan", chart=_TOTALS),
        Key(
            "grad_norm/clip_frac",
            "fraction of optimizer steps since the last log whose norm exceeded `gradient_clip_val` (only with norm "
            "clipping)",
            chart=_TOTALS,
        ),
    )

    def __init__(
        self,
        every_n_steps: int | None = None,
        on_finding: OnFinding = "warn",
        groups: dict[str, str] | None = None,
        group_depth: int | None = None,
        log_groups: bool = True,
        explosion_factor: float = 10.0,
        warmup_measurements: int = 5,
        history: int = 50,
        vanishing_ratio: float = 1e-3,
        patience: int = 3,
    ) -> None:
        super().__init__(every_n_steps=every_n_steps, on_finding=on_finding)
        validate_group_args(groups, group_depth)
        check_number("explosion_factor", explosion_factor, low=1.0, low_inclusive=False)
        check_number("warmup_measurements", warmup_measurements, low=1, integer=True)
        check_number("history", history, low=1, integer=True)
        check_number("vanishing_ratio", vanishing_ratio, low=0.0, high=1.0, low_inclusive=False)
        check_number("patience", patience, low=1, integer=True)
        self.groups = dict(groups) if groups else None
        self.group_depth = group_depth
        if not isinstance(log_groups, bool):
            raise TypeError(f"`log_groups` must be True or False; got {log_groups!r}.")
        self.log_groups = log_groups
        self.explosion_factor = float(explosion_factor)
        self.warmup_measurements = warmup_measurements
        self.vanishing_ratio = float(vanishing_ratio)
        self.patience = patience
        self._memory = GradMemory(RunningWindow(history))
        self._layout: ReductionLayout | None = None
        self._trained: tuple[bool, ...] = ()  # per group: an optimizer holds at least one of its parameters
        self._clip_count: Tensor | None = None  # device counter of clipped steps since the last log
        self._clip_steps = 0
        self._patched_plugin: Any = None  # the Trainer's precision plugin while its clipping is counted

    @property
    def state_key(self) -> str:
        return self._generate_state_key(every_n_steps=self.every_n_steps, groups=self.groups, depth=self.group_depth)

    # ------------------------------------------------------------------ set-up
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        self._layout = None
        self._trained = ()
        if stage == "fit":
            self._install_clip_counter(trainer)

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self._patched_plugin is not None:
            self._patched_plugin.__dict__.pop("clip_grad_by_norm", None)
            self._patched_plugin = None

    def _clipping_by_norm(self, trainer: pl.Trainer) -> bool:
        return bool(trainer.gradient_clip_val) and trainer.gradient_clip_algorithm in (None, "norm")

    def _install_clip_counter(self, trainer: pl.Trainer) -> None:
        """Count clipped steps from the norm that clipping computes anyway (no extra norm, no host sync).

        Only for precision plugins that use Lightning's default ``clip_grad_by_norm``; with others (FSDP1,
        DeepSpeed) ``clip_frac`` is estimated from measuring steps only.
        """
        plugin = trainer.precision_plugin
        # Lightning's own `Precision` (of whichever package the Trainer comes from) must do the clipping
        if not self._clipping_by_norm(trainer) or overrides(plugin, "Precision", "clip_grad_by_norm"):
            return

        def clip_grad_by_norm(optimizer: Any, clip_val: float) -> None:
            norm = torch.nn.utils.clip_grad_norm_(plugin.main_params(optimizer), clip_val)
            if isinstance(norm, DTensor):
                norm = norm.full_tensor()
            clipped = (norm > clip_val).float()
            self._clip_count = clipped if self._clip_count is None else self._clip_count + clipped
            self._clip_steps += 1

        plugin.clip_grad_by_norm = clip_grad_by_norm  # instance attribute; removed in teardown
        self._patched_plugin = plugin

    # ------------------------------------------------------------------ measuring
    def busy_at(self, step: int) -> bool:
        """Its one hook measures on measuring steps only."""
        return step % self._interval == 0

    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        if not self.should_measure(trainer):
            return
        if self._layout is None:
            self._layout = build_layout(training_model(trainer, pl_module), groups=self.groups, depth=self.group_depth)
            if self._layout is None:
                self.stand_aside(
                    "the model has no trainable parameters, so there are no gradients to measure.",
                    setting="a model with trainable parameters (`requires_grad=True`)",
                )
                return
        if not self._trained:  # once per fit, host only: the groups an optimizer steps at all
            outside = outside_optimizers(self._layout.groups.params, trainer.optimizers)
            held = {g for i, g in enumerate(self._layout.groups.index) if outside is None or not outside[i]}
            self._trained = tuple(g in held for g in range(self._layout.n_groups))
        with torch.no_grad():
            self._measure(trainer, optimizer)

    def _measure(self, trainer: pl.Trainer, optimizer: torch.optim.Optimizer) -> None:
        layout = self._layout
        assert layout is not None
        names, params = layout.groups.names, layout.groups.params
        present = [i for i, p in enumerate(params) if p.grad is not None]
        missing = [names[i] for i, p in enumerate(params) if p.grad is None]
        verdicts: list[Verdict | None] = []
        if present:
            reading, loss_scale = self._read(trainer, optimizer, present)
            self.log_scalars(trainer, reading.scalars(self.log_groups))
            verdicts.append(still_scaled(type(optimizer).__name__, loss_scale))
            verdicts += grad_verdicts(
                reading,
                self._memory,
                trained=[g for g, held in zip(layout.groups.group_names, self._trained) if held],
                has_scaler=grad_scaler_of(trainer) is not None,
                explosion_factor=self.explosion_factor,
                warmup=self.warmup_measurements,
                vanishing_ratio=self.vanishing_ratio,
                patience=self.patience,
                tied=layout.tied,
            )
            clip = float(trainer.gradient_clip_val or 0.0)
            verdicts.append(overclipping(reading, clip, self._memory.overclip, patience=self.patience))
        present_names = [names[i] for i in present]
        verdicts.append(unused_parameters(missing, present_names, self._memory.no_grad, patience=self.patience))
        self.emit(trainer, verdicts)

    def _read(
        self, trainer: pl.Trainer, optimizer: torch.optim.Optimizer, present: list[int]
    ) -> tuple[GradReading, float | None]:
        """The reading of this step's gradients (``present``: the positions of the parameters that have one), and the
        loss scale they were divided by when the optimizer unscales inside ``step()`` (else None)."""
        layout = self._layout
        assert layout is not None
        params, device = layout.groups.params, layout.index.device
        positions = torch.tensor(present, device=device)
        grads = [local_tensor(params[i].grad) for i in present]
        group_sq, flags = grouped_sq_norms(
            grads,
            layout.index[positions],
            layout.n_groups,
            layout.weights[positions] if layout.sharded else None,
            norms=step_norms(trainer, grads),  # shared with UpdateRatio on the same step: one pass over the grads
        )
        # one packed collective under sharding (sums of squares; per-tensor non-finite flags by max); none under DDP
        all_flags = torch.zeros(len(params), device=device).index_copy_(0, positions, flags)
        group_sq, all_flags = packed_reduce(group_sq, all_flags, collective=layout.sharded)
        group_nonfinite = group_sums(all_flags, layout.index, layout.n_groups)

        scaler = grad_scaler_of(trainer)
        scaled = scaler is not None and _optimizer_handles_unscaling(optimizer)
        if scaled:  # the optimizer unscales inside step(): divide by the scale here, on the device
            inv_scale = 1.0 / scaler._scale.to(device=device, dtype=torch.float32).squeeze()
            group_sq = group_sq * inv_scale.square()
        parts = [group_sq.float(), group_nonfinite.to(group_sq.device, torch.float32)]
        if scaled:
            parts.append(inv_scale.reshape(1).to(group_sq.device))
        clipping = self._clipping_by_norm(trainer)
        counted = clipping and self._patched_plugin is not None and self._clip_steps > 0
        if counted:
            parts.append(self._clip_count.reshape(1).to(group_sq.device, torch.float32))  # type: ignore[union-attr]
        # host sync: the one transfer of this measuring step; the per-group values are then host arithmetic (a few
        # kernels per group on the device would cost more than the read)
        flat = torch.cat(parts).tolist()
        n = layout.n_groups
        squares, nonfinite, rest = flat[:n], flat[n : 2 * n], flat[2 * n :]
        loss_scale = 1.0 / rest.pop(0) if scaled else None
        clip_frac = None
        if counted:
            clip_frac = rest.pop(0) / self._clip_steps
        elif clipping:  # fallback: whether this measured step will be clipped
            clip_frac = float(math.sqrt(sum(squares)) > float(trainer.gradient_clip_val))
        self._clip_count, self._clip_steps = None, 0
        return GradReading.from_squares(layout.groups.group_names, squares, nonfinite, clip_frac), loss_scale

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), **self._memory.state_dict()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self._memory.load_state_dict(state_dict)
