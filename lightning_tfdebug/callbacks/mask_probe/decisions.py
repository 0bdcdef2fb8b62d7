"""One probing step's verdicts: :func:`decide_probe` sends each reading to its rule, in the one place where the
order between the codes is decided (a repeat beyond its tolerance silences every other comparison).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from lightning_tfdebug.functional.verdicts import Verdict

if TYPE_CHECKING:
    pass
from lightning_tfdebug.callbacks.mask_probe.alignment_checks import AlignmentReading, decide_alignment
from lightning_tfdebug.callbacks.mask_probe.leak_checks import (
    CausalReading,
    CrossSampleReading,
    LeakReading,
    LeakSummary,
    RepeatReading,
    decide_causal,
    decide_cross_sample,
    decide_leak,
    decide_repeat,
)
from lightning_tfdebug.callbacks.mask_probe.padding_checks import (
    PaddingReading,
    PadSideReading,
    decide_pad_side,
    decide_padding,
)
from lightning_tfdebug.callbacks.mask_probe.position_checks import (
    KvCacheReading,
    OrderReading,
    PositionTablesReading,
    decide_kv_cache,
    decide_order,
    decide_position_tables,
)
from lightning_tfdebug.callbacks.mask_probe.readings import Reading, _beyond


# --------------------------------------------------------------------------------------------------- one probing step
def decide_probe(readings: Sequence[Reading]) -> tuple[list[Verdict | None], set[str]]:
    """The verdicts of one probing step's readings, and the pending checks it settled. A repeat beyond its tolerance
    (``TFD213``) is then the only verdict: every other comparison would measure its noise."""
    repeat = next((r for r in readings if isinstance(r, RepeatReading)), None)
    noisy = None if repeat is None else decide_repeat(repeat)
    if noisy is not None:
        return [noisy], {"alignment"}
    follows = any(r.follows_other for r in readings if isinstance(r, LeakSummary))
    causal = [r for r in readings if isinstance(r, CausalReading) or (isinstance(r, LeakReading) and r.primary)]
    held = bool(causal) and not any(_beyond(r.max_change, r.tolerance) for r in causal)
    verdicts: list[Verdict | None] = []
    settled: set[str] = set()
    for r in readings:
        if isinstance(r, (AlignmentReading, OrderReading)):
            decided, verdict = decide_alignment(r) if isinstance(r, AlignmentReading) else decide_order(r)
            if decided:
                settled.add("alignment" if isinstance(r, AlignmentReading) else "order")
            verdicts.append(verdict)
        elif isinstance(r, (PaddingReading, PadSideReading)):
            verdicts.append(
                decide_padding(r, follows, held) if isinstance(r, PaddingReading) else decide_pad_side(r, follows)
            )
        elif type(r) in _RULE_OF:
            verdicts.append(_RULE_OF[type(r)](r))
    return verdicts, settled


_RULE_OF: dict[type, Callable[[Any], Verdict | None]] = {
    CausalReading: decide_causal,
    LeakReading: decide_leak,
    KvCacheReading: decide_kv_cache,
    PositionTablesReading: decide_position_tables,
    CrossSampleReading: decide_cross_sample,
}


ROWS: dict[str, tuple[str, ...]] = {
    "RepeatReading": ("eval determinism",),
    "CausalReading": ("causal mask",),
    "KvCacheReading": ("causal mask",),
    "CrossSampleReading": ("cross-sample",),
    "PaddingReading": ("padding",),
    "PadSideReading": ("padding",),
    "OrderReading": ("positions and order",),
    "PositionTablesReading": ("positions and order",),
    "LeakReading": ("target leak into the inputs", "causal mask"),  # future ids reaching past outputs: TFD201 too
    "LeakSummary": ("target leak into the inputs",),
    "AlignmentReading": ("label alignment",),
}
"""The Coverage rows each probe's reading answers."""


def rows_verified(readings: Any) -> list[str]:
    """The Coverage rows the probes that produced ``readings`` ran for, in order, once each."""
    found = [row for r in readings for row in ROWS.get(type(r).__name__, ())]
    return list(dict.fromkeys(found))


COVERAGE: dict[str, tuple[str, ...]] = {
    "causal mask": (
        "TFD201",
        "TFD209",
    ),
    "padding": (
        "TFD202",
        "TFD203",
        "TFD204",
    ),
    "label alignment": (
        "TFD205",
        "TFD206",
        "TFD210",
        "TFD212",
    ),
    "positions and order": (
        "TFD207",
        "TFD215",
        "TFD216",
    ),
    "eval determinism": ("TFD213",),
    "cross-sample": ("TFD217",),
    "target leak into the inputs": ("TFD214",),
}
"""The rows of the run's Coverage table these rules answer: the check -> the codes that decide it."""
