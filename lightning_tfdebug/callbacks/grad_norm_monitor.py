"""GradNormMonitor: gradient norms per block and in total, with explosion, vanishing and wiring diagnoses."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins.precision.amp import _optimizer_handles_unscaling
from torch import Tensor

from lightning_tfdebug.core.base import DebugCallback, check_number
from lightning_tfdebug.core.compat import overrides
from lightning_tfdebug.core.distributed import DTensor, local_tensor, packed_reduce
from lightning_tfdebug.core.groups import ReductionLayout, build_layout, training_model, validate_group_args
from lightning_tfdebug.core.model import grad_scaler_of
from lightning_tfdebug.core.step import step_norms
from lightning_tfdebug.core.tracking import RunningWindow, Streak
from lightning_tfdebug.findings import OnFinding
from lightning_tfdebug.functional.norms import group_sums, grouped_sq_norms
from lightning_tfdebug.functional.update_checks import outside_optimizers

_OVERCLIP = 100.0
"""TFD306 when every step's gradient norm is more than this many times ``gradient_clip_val``."""


class GradNormMonitor(DebugCallback):
    r"""Logs gradient L2 norms per group and in total, and diagnoses exploding, vanishing and missing gradients.

    Norms are taken in ``on_before_optimizer_step``: after AMP unscaling and after all micro-batches of gradient
    accumulation, before clipping. The total equals what ``torch.nn.utils.clip_grad_norm_`` returns on the same
    gradients. It is computed with fused ``_foreach_norm`` kernels on the device; under FSDP1/FSDP2 each rank's
    shard contributes once through one packed collective, under DDP no collective runs. On steps that do not
    measure, the callback does no tensor work (with norm clipping on, it adds one device comparison to the norm
    that clipping computes anyway, to count clipped steps).

    Logged keys (on measuring steps):

    | key | meaning |
    | --- | --- |
    | `grad_norm/total` | L2 norm over all gradients (unscaled, before clipping) |
    | `grad_norm/<group>` | L2 norm over one group (`blocks.0`, `embeddings`, `head`, `other`) |
    | `grad_norm/nonfinite` | number of parameter tensors whose gradient holds inf or nan |
    | `grad_norm/clip_frac` | fraction of optimizer steps since the last log whose norm exceeded `gradient_clip_val` |

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
        self._history = RunningWindow(history)
        self._vanishing = Streak()
        self._no_grad = Streak()
        self._overclip = Streak()
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
        with torch.no_grad():
            self._measure(trainer, optimizer)

    def _measure(self, trainer: pl.Trainer, optimizer: torch.optim.Optimizer) -> None:
        layout = self._layout
        assert layout is not None
        names, params = layout.groups.names, layout.groups.params
        present = [i for i, p in enumerate(params) if p.grad is not None]
        missing = [names[i] for i, p in enumerate(params) if p.grad is None]
        if not present:
            self._track_unused(trainer, missing, len(params))
            return
        device = layout.index.device
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
        still_scaled = scaler is not None and _optimizer_handles_unscaling(optimizer)
        if still_scaled:  # the optimizer unscales inside step(): divide by the scale here, on the device
            inv_scale = 1.0 / scaler._scale.to(device=device, dtype=torch.float32).squeeze()
            group_sq = group_sq * inv_scale.square()

        n = layout.n_groups
        # host sync: the one transfer of this measuring step; the per-group values are then host arithmetic (a few
        # kernels per group on the device would cost more than the read)
        flat = torch.cat([group_sq.float(), group_nonfinite.to(group_sq.device, torch.float32)]).tolist()
        squares, nonfinite = flat[:n], flat[n:]
        host: dict[str, float] = {"grad_norm/total": math.sqrt(sum(squares))}
        for g, name in enumerate(layout.groups.group_names):
            host[f"grad_norm/{name}"] = math.sqrt(squares[g])
        host["grad_norm/nonfinite"] = float(sum(nonfinite))
        for g, name in enumerate(layout.groups.group_names):
            host[f"_nonfinite/{name}"] = nonfinite[g]
        clip_by_norm = self._clipping_by_norm(trainer)
        if clip_by_norm and self._patched_plugin is not None and self._clip_steps:
            host["grad_norm/clip_frac"] = self._clip_count / self._clip_steps  # type: ignore[operator]
        elif clip_by_norm:  # fallback: whether this measured step will be clipped
            host["grad_norm/clip_frac"] = float(host["grad_norm/total"] > float(trainer.gradient_clip_val))
        self._clip_count, self._clip_steps = None, 0
        logged = {k: v for k, v in host.items() if not k.startswith("_")}
        if not self.log_groups:
            keep = ("grad_norm/total", "grad_norm/nonfinite", "grad_norm/clip_frac")
            logged = {k: v for k, v in logged.items() if k in keep}
        self.log_scalars(trainer, logged)
        if still_scaled:
            self.emit_code(
                trainer,
                "TFD305",
                f"The optimizer ({type(optimizer).__name__}) unscales gradients inside step(), so they were still "
                "multiplied by the AMP loss scale when measured; GradNormMonitor divided them by the scale.",
                {"loss_scale": 1.0 / float(inv_scale)},
            )
        if not self._trained:  # once per fit, host only: which groups an optimizer steps at all
            outside = outside_optimizers(layout.groups.params, trainer.optimizers)
            held = {g for i, g in enumerate(layout.groups.index) if outside is None or not outside[i]}
            self._trained = tuple(g in held for g in range(layout.n_groups))
        self._diagnose(trainer, host, scaler is not None)
        self._diagnose_clipping(trainer, host)
        self._track_unused(trainer, missing, len(params))

    # ------------------------------------------------------------------ findings
    def _diagnose(self, trainer: pl.Trainer, host: Mapping[str, float], has_scaler: bool) -> None:
        layout = self._layout
        assert layout is not None
        total = host["grad_norm/total"]
        group_names = layout.groups.group_names
        nonfinite_groups = [g for g in group_names if host[f"_nonfinite/{g}"] > 0]
        if nonfinite_groups and not has_scaler:
            # under a GradScaler an overflowing step is skipped by design; ScalerWatch owns that diagnosis
            self.emit_code(
                trainer,
                "TFD303",
                f"{int(host['grad_norm/nonfinite'])} parameter tensor(s) have inf/nan gradients, in groups "
                f"{', '.join(nonfinite_groups)}.",
                {"nonfinite_tensors": host["grad_norm/nonfinite"], "groups": nonfinite_groups},
            )
            return
        if total != total or total == float("inf"):
            return
        median = self._history.median()
        if len(self._history) >= self.warmup_measurements and total > self.explosion_factor * median > 0:
            self.emit_code(
                trainer,
                "TFD301",
                f"The gradient norm exploded to {total:.4g}, {total / median:.1f}x its running median of {median:.4g}.",
                {"grad_norm": total, "running_median": median, "factor": total / median},
            )
        self._history.add(total)

        # Reference: the largest group norm. The median would sink with the groups it should expose when half of
        # a deep stack vanishes (bug 13), so vanishing groups are judged against the best-served group instead.
        # Only groups an optimizer steps count, as reference or as vanishing: a group left out of every optimizer
        # never learns, its gradient stays as large as at initialisation while the trained groups' fall, and every
        # other group would look vanishing next to it (TFD320/TFD312 name that bug).
        trained = [g for g, held in zip(group_names, self._trained) if held]  # set in `_measure` before this
        norms = [host[f"grad_norm/{g}"] for g in trained]
        reference = max(norms, default=0.0)
        if len(norms) >= 2 and reference > 0:
            vanishing = []
            for g, n in zip(trained, norms):
                if self._vanishing.update(g, n < self.vanishing_ratio * reference) >= self.patience:
                    vanishing.append(g)
            if vanishing:
                largest = trained[norms.index(reference)]
                self.emit_code(
                    trainer,
                    "TFD302",
                    f"Gradients vanish in {', '.join(vanishing)}: below {self.vanishing_ratio:g} x the largest group "
                    f"norm ({largest}) for {self.patience} measurements in a row.",
                    {
                        "groups": vanishing,
                        "group_norms": {g: host[f"grad_norm/{g}"] for g in vanishing},
                        "largest_group": largest,
                        "largest_group_norm": reference,
                    },
                )

    def _diagnose_clipping(self, trainer: pl.Trainer, host: Mapping[str, float]) -> None:
        """``TFD306``: norm clipping that cuts every step by orders of magnitude (host values of this measurement)."""
        frac = host.get("grad_norm/clip_frac")
        if frac is None:
            return
        clip = float(trainer.gradient_clip_val)
        total = host["grad_norm/total"]
        over = frac >= 0.99 and total == total and total > _OVERCLIP * clip
        if self._overclip.update("total", over) < self.patience:
            return
        self.emit_code(
            trainer,
            "TFD306",
            f"Every step is clipped, by a factor of {total / clip:.3g}: the gradient norm is {total:.4g} and "
            f"gradient_clip_val is {clip:g}, for {self.patience} measurements in a row. The clip value, not the "
            "gradient, sets the update's size.",
            {"grad_norm": total, "gradient_clip_val": clip, "factor": total / clip, "clip_frac": frac},
        )

    def _track_unused(self, trainer: pl.Trainer, missing: list[str], n_params: int) -> None:
        unused = [n for n in missing if self._no_grad.update(n, True) >= self.patience]
        present = set(self._layout.groups.names) - set(missing) if self._layout else set()
        for n in present:
            self._no_grad.counts.pop(n, None)
        if unused:
            self.emit_code(
                trainer,
                "TFD304",
                f"{len(unused)} of {n_params} trainable parameter tensor(s) never received a gradient in "
                f"{self.patience} measured steps: {', '.join(unused[:10])}{' ...' if len(unused) > 10 else ''}.",
                {"parameters": unused[:50], "count": len(unused)},
            )

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        return {
            **super().state_dict(),
            "history": self._history.state_dict(),
            "vanishing": self._vanishing.state_dict(),
            "no_grad": self._no_grad.state_dict(),
            "overclip": self._overclip.state_dict(),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self._history.load_state_dict(state_dict.get("history", {}))
        self._vanishing.load_state_dict(state_dict.get("vanishing", {}))
        self._no_grad.load_state_dict(state_dict.get("no_grad", {}))
        self._overclip.load_state_dict(state_dict.get("overclip", {}))
