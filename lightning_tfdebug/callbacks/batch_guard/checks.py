"""BatchGuard's rules in code order, collected from the modules that decide them (each rule sits just above its
decider there): the registry (:mod:`lightning_tfdebug.rules`) and the docs read them from here. A rule declared in
one of these modules is registered without a second list to keep."""

from __future__ import annotations

from lightning_tfdebug.callbacks.batch_guard import (
    eos_checks,
    leakage_checks,
    length_checks,
    mask_hole_checks,
    repeat_checks,
    schema_checks,
    value_checks,
)
from lightning_tfdebug.callbacks.batch_guard.leakage_rows import LEAKAGE_ROW
from lightning_tfdebug.functional.verdicts import Rule

BLOCK = ("TFD101", "TFD129")
"""The codes reserved for BatchGuard's rules."""

_MODULES = (
    schema_checks,
    value_checks,
    mask_hole_checks,
    length_checks,
    repeat_checks,
    eos_checks,
    leakage_checks,
)

RULES: tuple[Rule, ...] = tuple(
    sorted({id(v): v for m in _MODULES for v in vars(m).values() if isinstance(v, Rule)}.values(), key=lambda r: r.code)
)
"""BatchGuard's rules, in code order."""


COVERAGE: dict[str, tuple[str, ...]] = {
    "batch schema and values": (
        "TFD101",
        "TFD102",
        "TFD103",
        "TFD104",
        "TFD105",
        "TFD110",
        "TFD111",
        "TFD112",
        "TFD113",
        "TFD114",
    ),
    "special tokens and padding": (
        "TFD115",
        "TFD116",
        "TFD117",
        "TFD118",
        "TFD119",
        "TFD122",
        "TFD124",
    ),
    "data order and repeats": (
        "TFD120",
        "TFD121",
        "TFD123",
        "TFD125",
    ),
    LEAKAGE_ROW: ("TFD126", "TFD127"),
}
"""The rows of the run's Coverage table these rules answer: the check -> the codes that decide it."""
