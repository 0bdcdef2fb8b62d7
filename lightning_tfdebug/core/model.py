"""Lightning and model plumbing shared by the pack's callbacks: the GradScaler in use, a training step replayed
without logging, whether a forward runs inside ``training_step``, whether the model is compiled, and imports of
user functions named in a config. Nothing here measures or decides.
"""

from __future__ import annotations

import importlib
from typing import Any

import lightning.pytorch as pl
from torch import nn


def grad_scaler_of(trainer: pl.Trainer) -> Any | None:
    """The precision plugin's GradScaler (fp16 AMP), or None."""
    return getattr(trainer.precision_plugin, "scaler", None)


def import_object(path: str) -> Any:
    """Import ``"package.module:name"`` or ``"package.module.name"``."""
    module, sep, name = path.partition(":")
    if not sep:
        module, _, name = path.rpartition(".")
    if not module or not name:
        raise ValueError(f"expected an import path like 'package.module:function'; got {path!r}.")
    obj: Any = importlib.import_module(module)
    for part in name.split("."):
        obj = getattr(obj, part)
    return obj


def quiet_training_step(pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> Any:
    """Call ``pl_module.training_step`` with ``self.log`` / ``self.log_dict`` silenced, so a probe call logs nothing.

    The caller is responsible for ``no_grad``, the module's mode and the precision context. Only for modules with
    automatic optimization: a manual-optimization ``training_step`` steps optimizers itself.
    """

    def _silent(*args: Any, **kwargs: Any) -> None:
        return None

    saved = {name: pl_module.__dict__[name] for name in ("log", "log_dict") if name in pl_module.__dict__}
    pl_module.__dict__["log"] = _silent
    pl_module.__dict__["log_dict"] = _silent
    try:
        return pl_module.training_step(batch, batch_idx)
    finally:
        for name in ("log", "log_dict"):
            pl_module.__dict__.pop(name, None)
        pl_module.__dict__.update(saved)


def in_training_step(pl_module: nn.Module | None) -> bool:
    """Whether a forward runs inside the Trainer's ``training_step``, and not in another callback's probe.

    Other callbacks may call the model from their own hooks (``on_train_batch_start``) while ours are attached; their
    forwards must not be counted. Lightning names the hook or strategy call in progress in the module's
    ``_current_fx_name`` (it also drives ``self.log``); where that attribute is missing, every forward counts.
    """
    name = getattr(pl_module, "_current_fx_name", None)
    return not isinstance(name, str) or name == "training_step"


def is_compiled(trainer: pl.Trainer, pl_module: pl.LightningModule) -> bool:
    """Whether ``torch.compile`` wraps the model or any submodule (hooks added afterwards may never run)."""
    if getattr(pl_module, "_compiler_ctx", None) is not None:  # trainer.fit(torch.compile(model))
        return True
    try:
        from torch._dynamo.eval_frame import OptimizedModule
    except ImportError:  # pragma: no cover
        return False
    roots = [pl_module]
    wrapped = getattr(trainer.strategy, "model", None)
    if isinstance(wrapped, nn.Module) and wrapped is not pl_module:
        roots.append(wrapped)
    for root in roots:
        for module in root.modules():
            if isinstance(module, OptimizedModule) or getattr(module, "_compiled_call_impl", None) is not None:
                return True
    return False
