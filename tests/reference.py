"""Plain reference implementations the callbacks are compared against (unsharded, straightforward, slow)."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch


def _params(trainer: pl.Trainer, pl_module: pl.LightningModule):
    # the strategy's wrapper holds every parameter the optimizer updates (FSDP1's root flat parameter included)
    model = trainer.strategy.model if isinstance(trainer.strategy.model, torch.nn.Module) else pl_module
    return list(model.parameters())


def _full(t: torch.Tensor) -> torch.Tensor:
    # DTensor -> the whole tensor (an all-gather every rank runs: reference only, never in the pack)
    return t.full_tensor() if hasattr(t, "full_tensor") else t


class ReferenceGradNorm(pl.Callback):
    """Records, every step, ``clip_grad_norm_``-style total norm over the whole (unsharded) gradients."""

    def __init__(self) -> None:
        self.norms: dict[int, float] = {}

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        grads = [_full(p.grad).float() for p in _params(trainer, pl_module) if p.grad is not None]
        self.norms[trainer.global_step] = float(torch.nn.utils.get_total_norm(grads, 2.0))


class ReferenceUpdateRatio(pl.Callback):
    """Records ``||W_after - W_before|| / ||W_after||`` and ``||W_after||`` over all trainable parameters, every
    step."""

    def __init__(self) -> None:
        self.ratios: dict[int, float] = {}
        self.param_norms: dict[int, float] = {}
        self._before: list[torch.Tensor] | None = None
        self._step = -1

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        self._step = trainer.global_step
        self._before = [_full(p.detach()).float().clone() for p in _params(trainer, pl_module) if p.requires_grad]

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if self._before is None:
            return
        after = [_full(p.detach()).float() for p in _params(trainer, pl_module) if p.requires_grad]
        delta = torch.sqrt(sum(((a - b) ** 2).sum() for a, b in zip(after, self._before)))
        norm = torch.sqrt(sum((a**2).sum() for a in after))
        self.ratios[self._step] = float(delta / norm)
        self.param_norms[self._step] = float(norm)
        self._before = None


def reference_results(trainer: pl.Trainer, model: pl.LightningModule, callbacks: list) -> dict[str, Any]:
    """``extra`` hook for tests/scripts/dist_run.py: the reference values recorded on this rank."""
    out: dict[str, Any] = {}
    for cb in callbacks:
        if isinstance(cb, ReferenceGradNorm):
            out["grad_norm"] = cb.norms
        if isinstance(cb, ReferenceUpdateRatio):
            out["update_ratio"] = cb.ratios
            out["param_norm"] = cb.param_norms
    return out


class MetricTrace(pl.Callback):
    """Records the callback metrics under ``prefix`` after every batch (for runs where loggers are not read)."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self.trace: list[dict[str, float]] = []

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self.trace.append({k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith(self.prefix)})
