"""ScalerWatch: the fp16 loss scale, skipped optimizer steps, and what they say about overflow."""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from typing import Any, ClassVar

import lightning.pytorch as pl
import torch
from torch import Tensor

from lightning_tfdebug.core.base import DebugCallback, check_number
from lightning_tfdebug.core.groups import ReductionLayout, build_layout, training_model
from lightning_tfdebug.core.model import grad_scaler_of
from lightning_tfdebug.core.reduction import reduce_now
from lightning_tfdebug.findings import OnFinding
from lightning_tfdebug.functional.norms import grouped_sq_norms
from lightning_tfdebug.functional.scaler_checks import COVERAGE as COVERAGE_ROWS
from lightning_tfdebug.functional.scaler_checks import (
    ScalerReading,
    many_skipped,
    no_scaler,
    scale_collapsed,
    scale_never_grew,
    schedule_on_skipped,
    steps_on_skipped,
)
from lightning_tfdebug.primitives.keys import Key
from lightning_tfdebug.primitives.tensors import local_tensor


def _found_inf(scaler: Any, optimizer: torch.optim.Optimizer) -> Tensor | None:
    """The scaler's overflow flag for this step (device tensor), once ``unscale_`` ran; None before that."""
    state = getattr(scaler, "_per_optimizer_states", {}).get(id(optimizer), {})
    found = state.get("found_inf_per_device") or {}
    if not found:
        return None
    flags = list(found.values())
    return torch.stack([f.reshape(()).to(flags[0].device) for f in flags]).sum().clamp(max=1.0)


def _step_scheduler_position(trainer: pl.Trainer) -> int | None:
    """``last_epoch`` of the first per-step LR scheduler (how many times it stepped), or None if there is none."""
    for config in trainer.lr_scheduler_configs:
        position = getattr(config.scheduler, "last_epoch", None)
        if config.interval == "step" and isinstance(position, int):
            return position
    return None


#: The host counters a checkpoint keeps (integers).
_TOTALS = ("skipped_total", "growth_total", "backoff_total", "steps_total", "last_growth_step", "lr_steps_on_skipped")


class ScalerWatch(DebugCallback):
    r"""Watches the AMP GradScaler: loss scale, skipped steps, growth and back-off, and diagnoses a collapsing scale.

    Under fp16 a ``torch.amp.GradScaler`` (or ``ShardedGradScaler``) skips every step whose gradients overflow and
    backs the scale off; a scale that keeps halving means most updates are thrown away. Each optimizer step adds two
    device flags to device counters (no host sync); a logging step reads them with one host transfer and measures
    per-group overflow flags (one fused norm kernel) to name the groups that overflowed. Details in
    ``docs/callbacks/scaler_watch.md``.

    Findings: ``TFD410`` no scaler to watch (info; nothing runs after it), ``TFD411`` the scale collapsed,
    ``TFD412`` a high fraction of steps skipped, ``TFD413`` the LR scheduler advanced on skipped steps, ``TFD414``
    the scale never grew (see ``docs/findings.md``).

    Args:
        every_n_steps: log when ``global_step % every_n_steps == 0``; default: the Trainer's ``log_every_n_steps``.
        on_finding: ``"warn"``, ``"stop"`` or ``"raise"`` (see :class:`~lightning_tfdebug.DebugCallback`).
        min_scale: TFD411 when the scale falls below this value...
        collapse_backoffs: ... or when it was reduced this many times within the last ``window`` steps.
        window: optimizer steps over which back-offs and the skipped fraction are counted.
        max_skipped_frac: TFD412 when more than this fraction of the last ``window`` steps were skipped...
        min_steps: ... once at least this many steps were watched.
        lr_skipped_steps: TFD413 when a per-step LR scheduler advanced on this many skipped steps.
        no_growth_intervals: TFD414 when the scale did not grow for this many of the scaler's ``growth_interval``.

    Raises:
        ValueError: on an argument outside its allowed range.

    Example:
        ```python
        trainer = Trainer(accelerator="cuda", precision="16-mixed", callbacks=[ScalerWatch(every_n_steps=10)])
        ```

        With LightningCLI:

        ```yaml
        trainer:
          callbacks:
            - class_path: lightning_tfdebug.ScalerWatch
              init_args:
                every_n_steps: 10
        ```
    """

    COVERAGE: ClassVar[Mapping[str, tuple[str, ...]]] = COVERAGE_ROWS  # declared beside the rules
    COVERAGE_WATCHED: ClassVar[frozenset[str]] = frozenset(COVERAGE)  # verified by watching the whole fit

    KEYS: ClassVar[tuple[Key, ...]] = (
        Key("scaler/scale", "the current loss scale", chart="loss scale"),
        Key(
            "scaler/skipped_steps",
            "optimizer steps skipped for overflow since the start (cumulative)",
            chart="skipped steps",
        ),
        Key("scaler/skipped_frac", "fraction of optimizer steps skipped since the previous log", chart="skipped steps"),
        Key("scaler/growth_events", "times the scale grew (cumulative)"),
        Key("scaler/backoff_events", "times the scale was reduced (cumulative)"),
    )

    def __init__(
        self,
        every_n_steps: int | None = None,
        on_finding: OnFinding = "warn",
        min_scale: float = 1.0,
        collapse_backoffs: int = 8,
        window: int = 50,
        max_skipped_frac: float = 0.25,
        min_steps: int = 10,
        lr_skipped_steps: int = 10,
        no_growth_intervals: float = 3.0,
    ) -> None:
        super().__init__(every_n_steps=every_n_steps, on_finding=on_finding)
        check_number("min_scale", min_scale, low=0.0, low_inclusive=False)
        check_number("collapse_backoffs", collapse_backoffs, low=1, integer=True)
        check_number("window", window, low=1, integer=True)
        check_number("max_skipped_frac", max_skipped_frac, low=0.0, high=1.0, low_inclusive=False)
        check_number("min_steps", min_steps, low=1, integer=True)
        check_number("lr_skipped_steps", lr_skipped_steps, low=1, integer=True)
        check_number("no_growth_intervals", no_growth_intervals, low=0.0, low_inclusive=False)
        self.min_scale = float(min_scale)
        self.collapse_backoffs = collapse_backoffs
        self.window = window
        self.max_skipped_frac = float(max_skipped_frac)
        self.min_steps = min_steps
        self.lr_skipped_steps = lr_skipped_steps
        self.no_growth_intervals = float(no_growth_intervals)
        # host totals (updated on logging steps)
        self.skipped_total = 0
        self.growth_total = 0
        self.backoff_total = 0
        self.steps_total = 0
        self.last_growth_step = 0
        self.overflow_groups: dict[str, int] = {}
        self.lr_steps_on_skipped = 0  # scheduler steps taken on optimizer steps the scaler skipped
        self._scheduler_position: int | None = None
        self._recent: deque[tuple[int, int, int, int]] = deque()  # (step, steps, skipped, backoffs) per log
        # device counters since the last log
        self._skipped: Tensor | None = None
        self._growth: Tensor | None = None
        self._backoff: Tensor | None = None
        self._steps_since_log = 0
        self._scale_before: Tensor | None = None
        self._found_inf: Tensor | None = None
        self._group_flags: Tensor | None = None
        self._measure_step: int | None = None
        self._layout: ReductionLayout | None = None
        self._idle = False

    # ------------------------------------------------------------------ set-up
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        self._layout = None
        scaler = grad_scaler_of(trainer)
        enabled = scaler is not None and getattr(scaler, "is_enabled", lambda: True)()
        self._idle = not enabled
        if self._idle and stage == "fit":
            self.emit(trainer, no_scaler(str(trainer.precision)))
            self.cover("fp16 loss scale", "n/a", f"no GradScaler: the run's precision is {trainer.precision}.")

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._scheduler_position = None if self._idle else _step_scheduler_position(trainer)

    def busy_at(self, step: int) -> bool:
        """With a GradScaler every step counts (a skipped step, a growth, a back-off); without one, none does."""
        return not self._idle

    # ------------------------------------------------------------------ per step
    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        if self._idle or not self.active or trainer.sanity_checking:
            return
        scaler = grad_scaler_of(trainer)
        scale = getattr(scaler, "_scale", None)
        if scale is None:
            return
        # device copies only: the scale as it was before `update()`, and the overflow flag after `unscale_`
        self._scale_before = scale.detach().reshape(()).clone()
        self._found_inf = _found_inf(scaler, optimizer)
        if self.should_measure(trainer):
            self._measure_step = trainer.global_step
            with torch.no_grad():
                self._group_flags = self._overflow_by_group(trainer, pl_module)

    def _overflow_by_group(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> Tensor | None:
        """Per group, 1.0 when a gradient holds inf/nan (one fused norm kernel; one collective under sharding)."""
        if self._layout is None:
            self._layout = build_layout(training_model(trainer, pl_module))
            if self._layout is None:
                return None
        layout = self._layout
        params = layout.groups.params
        present = [i for i, p in enumerate(params) if p.grad is not None]
        flags = torch.zeros(len(params), device=layout.index.device)
        if present:
            positions = torch.tensor(present, device=layout.index.device)
            grads = [local_tensor(params[i].grad) for i in present]
            _, tensor_flags = grouped_sq_norms(grads, layout.index[positions], layout.n_groups)
            flags = flags.index_copy_(0, positions, tensor_flags.to(flags.device))
        # collective when sharded: a shard may hold the only inf; DDP's gradients are the same on every rank
        flags = (
            reduce_now(flags.device, maxes={"overflow": flags}, across_ranks=layout.sharded).maxes["overflow"].to(flags)
        )
        return torch.zeros(layout.n_groups, device=flags.device).scatter_reduce_(0, layout.index, flags, "amax")

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._idle or self._scale_before is None:
            return  # no optimizer step in this micro-batch
        scaler = grad_scaler_of(trainer)
        with torch.no_grad():
            after = scaler._scale.detach().reshape(()).to(self._scale_before.device)
            grew = (after > self._scale_before).float()
            shrank = (after < self._scale_before).float()
            skipped = shrank if self._found_inf is None else self._found_inf.to(shrank.device)
            self._skipped = skipped if self._skipped is None else self._skipped + skipped
            self._growth = grew if self._growth is None else self._growth + grew
            self._backoff = shrank if self._backoff is None else self._backoff + shrank
        self._steps_since_log += 1
        self._scale_before = None
        if self._measure_step is not None:
            step, self._measure_step = self._measure_step, None
            self._log(trainer, scaler, after, step)

    def _log(self, trainer: pl.Trainer, scaler: Any, scale: Tensor, step: int) -> None:
        values: dict[str, Tensor | float] = {
            "scale": scale,
            "skipped": self._skipped,
            "growth": self._growth,
            "backoff": self._backoff,
            "this_step_skipped": self._found_inf if self._found_inf is not None else 0.0,
        }
        names = self._layout.groups.group_names if self._layout is not None else ()
        if self._group_flags is not None:
            values.update({f"group/{g}": self._group_flags[i] for i, g in enumerate(names)})
        host = self.to_host(values)  # host sync: the one transfer of this logging step
        skipped, growth, backoff = int(host["skipped"]), int(host["growth"]), int(host["backoff"])
        steps = self._steps_since_log
        self._skipped = self._growth = self._backoff = None
        self._steps_since_log = 0
        self._group_flags = None
        self.skipped_total += skipped
        self.growth_total += growth
        self.backoff_total += backoff
        self.steps_total += steps
        if growth:
            self.last_growth_step = self.steps_total
        position = _step_scheduler_position(trainer)  # a host int: how often the scheduler stepped
        if position is not None and self._scheduler_position is not None:
            self.lr_steps_on_skipped += steps_on_skipped(position - self._scheduler_position, steps, skipped)
        self._scheduler_position = position
        if host["this_step_skipped"] > 0 or skipped:
            for g in names:
                if host.get(f"group/{g}", 0.0) > 0:
                    self.overflow_groups[g] = self.overflow_groups.get(g, 0) + 1
        self._recent.append((self.steps_total, steps, skipped, backoff))
        while self._recent and self._recent[0][0] <= self.steps_total - self.window:
            self._recent.popleft()
        self.log_scalars(
            trainer,
            {
                "scaler/scale": host["scale"],
                "scaler/skipped_steps": float(self.skipped_total),
                "scaler/skipped_frac": skipped / steps if steps else 0.0,
                "scaler/growth_events": float(self.growth_total),
                "scaler/backoff_events": float(self.backoff_total),
            },
            step=step,
        )
        self._diagnose(trainer, scaler, host["scale"], step)

    # ------------------------------------------------------------------ findings
    def _diagnose(self, trainer: pl.Trainer, scaler: Any, scale: float, step: int) -> None:
        reading = ScalerReading(
            step=step,
            scale=scale,
            skipped_steps=self.skipped_total,
            steps=self.steps_total,
            recent_steps=sum(r[1] for r in self._recent),
            recent_skipped=sum(r[2] for r in self._recent),
            recent_backoffs=sum(r[3] for r in self._recent),
            overflow_groups=tuple(sorted(self.overflow_groups, key=lambda g: -self.overflow_groups[g])),
        )
        schedulers = [type(c.scheduler).__name__ for c in trainer.lr_scheduler_configs if c.interval == "step"]
        growth_interval = int(getattr(scaler, "get_growth_interval", lambda: 2000)())
        self.emit(
            trainer,
            (
                scale_collapsed(reading, min_scale=self.min_scale, collapse_backoffs=self.collapse_backoffs),
                many_skipped(reading, min_steps=self.min_steps, max_skipped_frac=self.max_skipped_frac),
                schedule_on_skipped(
                    reading,
                    schedulers[0] if schedulers else None,
                    self.lr_steps_on_skipped,
                    lr_skipped_steps=self.lr_skipped_steps,
                ),
                scale_never_grew(
                    reading,
                    last_growth=self.last_growth_step,
                    growth_events=self.growth_total,
                    growth_interval=growth_interval,
                    no_growth_intervals=self.no_growth_intervals,
                ),
            ),
        )

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        totals = {name: getattr(self, name) for name in _TOTALS}
        recent = [list(r) for r in self._recent]
        return {**super().state_dict(), **totals, "overflow_groups": dict(self.overflow_groups), "recent": recent}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        for name in _TOTALS:
            setattr(self, name, int(state_dict.get(name, 0)))
        self.overflow_groups = {str(k): int(v) for k, v in state_dict.get("overflow_groups", {}).items()}
        self._recent = deque(tuple(int(x) for x in r) for r in state_dict.get("recent", []))
