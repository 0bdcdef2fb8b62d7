"""MaskProbe's room: the callback (:mod:`.callback`), its probes (:mod:`.probes`, :mod:`.call_probes`) and its rules,
one module per thing decided (:mod:`.leak_checks`, :mod:`.padding_checks`, :mod:`.position_checks`,
:mod:`.alignment_checks`; :mod:`.decisions` orders them). The rule modules are pure: the rule registry imports them
without the callback, which is imported here on first use."""

from __future__ import annotations

from typing import Any

__all__ = ["MaskProbe"]


def __getattr__(name: str) -> Any:
    if name == "MaskProbe":  # imported on first use: the rule registry reads this package's rules without it
        from lightning_tfdebug.callbacks.mask_probe.callback import MaskProbe

        return MaskProbe
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
