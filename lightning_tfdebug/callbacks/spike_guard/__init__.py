"""SpikeGuard's room: the callback (:mod:`.callback`) and what it does on a spike step (:mod:`.capture`: the replay of
the model call, the per-sample losses, the bundle); its rules are in :mod:`lightning_tfdebug.functional.spike_checks`.
The callback is imported here on first use, as the other rooms do."""

from __future__ import annotations

from typing import Any

__all__ = ["SpikeGuard"]


def __getattr__(name: str) -> Any:
    if name == "SpikeGuard":
        from lightning_tfdebug.callbacks.spike_guard.callback import SpikeGuard

        return SpikeGuard
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
