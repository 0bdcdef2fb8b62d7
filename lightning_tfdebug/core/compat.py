"""Both Lightning packages: ``lightning`` (``lightning.pytorch``) and the standalone ``pytorch_lightning``.

A user's Trainer, logger or LightningModule may come from either, so the pack matches a Lightning class by name in
the object's MRO, and its callbacks derive from the ``Callback`` of both (when both are installed).
"""

from __future__ import annotations

import importlib.util
from typing import Any

from lightning.pytorch.callbacks import Callback as _LightningCallback

LIGHTNING_PACKAGES = ("lightning.pytorch", "pytorch_lightning")
"""Where a Lightning class may come from: the unified package's ``pytorch`` part, or the standalone package."""


def _from_lightning(module: str) -> bool:
    return any(module == p or module.startswith(p + ".") for p in LIGHTNING_PACKAGES)


def lightning_base(cls: type, name: str) -> type | None:
    """The Lightning class called ``name`` (from either package) in ``cls``'s MRO, or None."""
    if not isinstance(cls, type):
        return None
    return next((c for c in cls.__mro__ if c.__name__ == name and _from_lightning(c.__module__)), None)


def is_lightning_subclass(cls: Any, name: str) -> bool:
    """``issubclass(cls, <Lightning class name>)`` for the class of that name in ``lightning.pytorch`` or
    ``pytorch_lightning``, e.g. ``is_lightning_subclass(cls, "LightningModule")``."""
    return lightning_base(cls, name) is not None


def is_lightning_instance(obj: Any, name: str) -> bool:
    """``isinstance(obj, <Lightning class name>)`` whichever Lightning package the object comes from, e.g.
    ``is_lightning_instance(logger, "TensorBoardLogger")`` for both packages' TensorBoard loggers (and subclasses)."""
    return lightning_base(type(obj), name) is not None


def overrides(obj: Any, base: str, method: str) -> bool:
    """Whether ``obj``'s class replaces ``method`` of the Lightning class ``base`` it derives from (either package).

    True also when ``obj`` does not derive from ``base`` at all: then nothing of Lightning's default can be assumed.
    """
    found = lightning_base(type(obj), base)
    return found is None or getattr(type(obj), method, None) is not getattr(found, method, None)


def _callback_bases() -> tuple[type, ...]:
    bases: tuple[type, ...] = (_LightningCallback,)
    if importlib.util.find_spec("pytorch_lightning") is not None:
        try:
            from pytorch_lightning import Callback as _StandaloneCallback
        except ImportError:  # a broken standalone install must not break the pack under `lightning`
            return bases
        bases += (_StandaloneCallback,)
    return bases


class Callback(*_callback_bases()):  # type: ignore[misc]
    """The pack's callback base: ``lightning.pytorch.Callback`` and, when installed, ``pytorch_lightning.Callback``
    (so both packages' Trainer and ``LightningCLI`` accept the pack's callbacks)."""
