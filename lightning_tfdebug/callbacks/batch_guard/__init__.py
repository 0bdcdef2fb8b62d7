"""BatchGuard's room: the callback (:mod:`.callback`) and the pure modules that decide its findings.

``BatchGuard`` is imported on first use (PEP 562): the rule registry imports this package's pure modules while
``core/`` loads, before the callback (which builds on ``core/``) can be.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lightning_tfdebug.callbacks.batch_guard.callback import BatchGuard

__all__ = ["BatchGuard"]


def __getattr__(name: str) -> Any:
    if name == "BatchGuard":
        from lightning_tfdebug.callbacks.batch_guard.callback import BatchGuard

        return BatchGuard
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
