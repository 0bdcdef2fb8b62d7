"""LossAtInit: the first loss against ln(V), the shape of the model's outputs, and the later checks of the loss.

The room: :mod:`.callback` (the Lightning hooks), :mod:`.phases` (which steps are armed; the run's memory),
:mod:`.readings` (host readings of the reduced sums), and the decisions :mod:`.init_checks` (step 0),
:mod:`.stall_checks`, :mod:`.transform_checks` and :mod:`.floor_checks` (the compared steps and the check), put in
one order by :mod:`.check`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lightning_tfdebug.callbacks.loss_at_init.callback import LossAtInit

__all__ = ["LossAtInit"]


def __getattr__(name: str) -> Any:
    # Imported on first use: the rule registry (lightning_tfdebug.rules, which core/ imports) reads this package's
    # pure rule modules, and importing the callback here would import core/ back while the registry is half-built.
    if name == "LossAtInit":
        from lightning_tfdebug.callbacks.loss_at_init.callback import LossAtInit

        return LossAtInit
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
