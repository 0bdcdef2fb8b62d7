"""BatchGuard's room: the callback (:mod:`.callback`) and its rules, one module per thing decided
(:mod:`.schema_checks`, :mod:`.value_checks`, :mod:`.repeat_checks`, :mod:`.special_token_checks`; their readings in
:mod:`.readings`). The rule modules are pure: the rule registry imports them without the callback, which is imported
here on first use."""

from __future__ import annotations

from typing import Any

__all__ = ["BatchGuard"]


def __getattr__(name: str) -> Any:
    if name == "BatchGuard":  # imported on first use: the rule registry reads this package's rules without it
        from lightning_tfdebug.callbacks.batch_guard.callback import BatchGuard

        return BatchGuard
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
