"""GradNormMonitor: gradient norms per block and in total, with explosion, vanishing and wiring diagnoses."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins.precision.amp import _optimizer_handles_unscaling
from torch import Tensor

from lightning_tfdebug.core.base import DebugCallback, check_number
from lightning_tfdebug.core.groups import ReductionLayout, build_layout, training_model, validate_group_args
from lightning_tfdebug.core.model import grad_scaler_of
from lightning_tfdebug.core.reduction import host_fields, reduce_now
from lightning_tfdebug.core.step import step_norms
from lightning_tfdebug.findings import OnFinding
from lightning_tfdebug.functional.grad_checks import COVERAGE as COVERAGE_ROWS
from lightning_tfdebug.functional.grad_checks import (
    Clipping,
    GradMemory,
    GradReading,
    grad_verdicts,
    overclipping,
    still_scaled,
    unused_parameters,
)
from lightning_tfdebug.functional.norms import group_sums, grouped_sq_norms, per_tensor_norms
from lightning_tfdebug.functional.updates import outside_optimizers
from lightning_tfdebug.functional.verdicts import Verdict
from lightning_tfdebug.primitives.keys import Key
from lightning_tfdebug.primitives.tensors import local_tensor
from lightning_tfdebug.primitives.tracking import RunningWindow

_TOTALS = "gradient norm: total, clipped and non-finite"
"""The dashboard chart of the total, the fraction clipping kept and the non-finite count."""


class GradNormMonitor(DebugCallback):
    r"""Logs gradient L2 norms per group and in total, and diagnoses exploding, vanishing and missing gradients.

    Norms are taken in ``on_before_optimizer_step``: after AMP unscaling and after all micro-batches of gradient
    accumulation, before Lightning clips them (under manual optimization, after the ``clip_gradients`` call of
    ``training_step``). The total equals what ``torch.nn.utils.clip_grad_norm_`` returns on the same gradients; one
    fused ``_foreach_norm`` on the device, one packed collective under FSDP, none under DDP. Clipping is read where
    Lightning applies it (the precision plugin's ``clip_gradients``, both algorithms) on measuring steps only: steps
    that do not measure get no tensor work. See ``docs/callbacks/grad_norm_monitor.md``.

    Logged keys (on measuring steps): :attr:`KEYS`. Findings: ``TFD301`` explosion, ``TFD302`` vanishing group,
    ``TFD303`` non-finite gradients, ``TFD304`` unused parameters, ``TFD305`` gradients still scaled by AMP,
    ``TFD306`` clipping that keeps under 1/30 of the gradient on every measured step (``docs/findings.md``).

    Args:
        every_n_steps: measure when ``global_step % every_n_steps == 0``; default: the Trainer's
            ``log_every_n_steps``.
        on_finding: ``"warn"``, ``"stop"`` or ``"raise"`` (see :class:`~lightning_tfdebug.DebugCallback`).
        groups: ``{group_name: regex}`` to group parameters by name instead of by block.
        group_depth: group by the first ``group_depth`` segments of parameter names instead of by block.
        log_groups: log one key per group (``False``: only the total and the non-finite count).
        explosion_factor: ``TFD301`` when the total exceeds this multiple of the median of its recent history.
        warmup_measurements: measurements collected before ``TFD301`` can fire.
        history: number of recent measurements the median is taken over.
        vanishing_ratio: ``TFD302`` when a group's norm is below this fraction of the largest group norm...
        patience: ...for this many consecutive measurements; also for ``TFD304`` and ``TFD306``.

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

    COVERAGE: ClassVar[Mapping[str, tuple[str, ...]]] = COVERAGE_ROWS  # declared beside the rules
    COVERAGE_WATCHED: ClassVar[frozenset[str]] = frozenset(COVERAGE)  # verified by watching the whole fit

    KEYS: ClassVar[tuple[Key, ...]] = (
        Key("grad_norm/total", "L2 norm over all gradients (unscaled, before clipping)", chart=_TOTALS),
        Key(
            "grad_norm/<group>",
            "L2 norm over one group (`blocks.0`, `embeddings`, `head`, `other`, or your regex groups)",
            chart="gradient norm per block",
        ),
        Key("grad_norm/nonfinite", "number of parameter tensors whose gradient holds inf or nan", chart=_TOTALS),
        Key(
            "grad_norm/clip_kept",
            "the norm of the clipped gradient over its norm before clipping, on the measuring steps where clipping "
            "ran (1: nothing cut; only with `gradient_clip_val` or `clip_gradients`)",
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
        # the latest measured clipping, until the next host transfer: (step, clip_val, algorithm, squared norms
        # before and after on the device)
        self._clipped: tuple[int, float, str, Tensor] | None = None
        self._patched: tuple[Any, Any] | None = None  # (the precision plugin, our clip_gradients on it)

    @property
    def state_key(self) -> str:
        return self._generate_state_key(every_n_steps=self.every_n_steps, groups=self.groups, depth=self.group_depth)

    # ------------------------------------------------------------------ set-up
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        self._layout = None
        self._trained = ()
        if stage == "fit":
            self._read_clipping(trainer)

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self._patched is not None:
            plugin, ours = self._patched
            if plugin.__dict__.get("clip_gradients") is ours:
                del plugin.clip_gradients
            self._patched = None

    def _read_clipping(self, trainer: pl.Trainer) -> None:
        """Wrap the precision plugin's ``clip_gradients``, which Lightning calls for ``gradient_clip_val`` and a
        manual ``self.clip_gradients(...)`` alike: on measuring steps, the squared gradient norm before and after it
        (two fused norms on the device, no sync); on other steps, Lightning's own call and nothing else."""
        plugin = trainer.precision_plugin
        original = plugin.clip_gradients

        def clip_gradients(optimizer: Any, clip_val: Any = 0.0, gradient_clip_algorithm: Any = "norm") -> Any:
            if not clip_val or not self.should_measure(trainer):
                return original(optimizer, clip_val, gradient_clip_algorithm)
            with torch.no_grad():
                grads = [local_tensor(p.grad) for p in plugin.main_params(optimizer) if p.grad is not None]
                before = per_tensor_norms(grads).square().sum()
                result = original(optimizer, clip_val, gradient_clip_algorithm)
                squares = torch.stack([before, per_tensor_norms(grads).square().sum().to(before)])
            if self._clipped is not None and self._clipped[0] == trainer.global_step:  # several optimizers
                squares = squares + self._clipped[3]
            algorithm = str(getattr(gradient_clip_algorithm, "value", gradient_clip_algorithm))
            self._clipped = (trainer.global_step, float(clip_val), algorithm, squares)
            return result

        plugin.clip_gradients = clip_gradients  # an instance attribute; removed in teardown
        self._patched = (plugin, clip_gradients)

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
            if reading.clipping is not None:
                clip = reading.clipping
                self.log_scalars(trainer, {"grad_norm/clip_kept": clip.kept}, step=clip.step)
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
            verdicts.append(overclipping(reading.clipping, self._memory.overclip, patience=self.patience))
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
        # the clipping measured since the last transfer: its squares add up over shards like the groups' (a ratio,
        # so replicas count alike before and after)
        clipped, self._clipped = self._clipped, None
        sums: dict[str, Tensor] = {"group_sq": group_sq.float()}
        if clipped is not None:
            sums["clip_sq"] = clipped[3].to(sums["group_sq"])
        # one collective under sharding (sums of squares; per-tensor non-finite flags by max); none under DDP, whose
        # gradients are the same on every rank
        all_flags = torch.zeros(len(params), device=device).index_copy_(0, positions, flags)
        reduced = reduce_now(device, sums=sums, maxes={"nonfinite": all_flags}, across_ranks=layout.sharded)
        fields = {**reduced.sums, "nonfinite": group_sums(reduced.maxes["nonfinite"], layout.index, layout.n_groups)}
        scaler = grad_scaler_of(trainer)
        scaled = scaler is not None and _optimizer_handles_unscaling(optimizer)
        if scaled:  # the optimizer unscales inside step(): divide by the scale, on the host
            fields["loss_scale"] = scaler._scale.reshape(())
        # host sync: the one transfer of this measuring step; the per-group values are then host arithmetic (a few
        # kernels per group on the device would cost more than the read)
        host = host_fields(fields)
        squares, clip_sq = host["group_sq"], host.get("clip_sq", [])
        nonfinite, loss_scale = host["nonfinite"], host.get("loss_scale")
        if loss_scale:
            squares = [sq / loss_scale**2 for sq in squares]
        clipping = None
        if clipped is not None:
            clipping = Clipping.from_squares(clipped[0], clipped[1], clipped[2], *clip_sq)
        return GradReading.from_squares(layout.groups.group_names, squares, nonfinite, clipping), loss_scale

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), **self._memory.state_dict()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self._memory.load_state_dict(state_dict)
