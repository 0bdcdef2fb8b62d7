"""BatchGuard's rules in code order, collected from the modules that decide them (each rule sits just above its
decider there): the registry (:mod:`lightning_tfdebug.rules`) and the docs read them from here."""

from __future__ import annotations

from lightning_tfdebug.callbacks.batch_guard.eos_checks import TFD124
from lightning_tfdebug.callbacks.batch_guard.length_checks import TFD120
from lightning_tfdebug.callbacks.batch_guard.mask_hole_checks import TFD122
from lightning_tfdebug.callbacks.batch_guard.repeat_checks import TFD121, TFD123, TFD125
from lightning_tfdebug.callbacks.batch_guard.schema_checks import TFD101, TFD102, TFD103, TFD104, TFD105, TFD111
from lightning_tfdebug.callbacks.batch_guard.value_checks import (
    TFD110,
    TFD112,
    TFD113,
    TFD114,
    TFD115,
    TFD116,
    TFD117,
    TFD118,
    TFD119,
)
from lightning_tfdebug.functional.verdicts import Rule

BLOCK = ("TFD101", "TFD129")
"""The codes reserved for BatchGuard's rules."""

RULES: tuple[Rule, ...] = (
    TFD101,
    TFD102,
    TFD103,
    TFD104,
    TFD105,
    TFD110,
    TFD111,
    TFD112,
    TFD113,
    TFD114,
    TFD115,
    TFD116,
    TFD117,
    TFD118,
    TFD119,
    TFD120,
    TFD121,
    TFD122,
    TFD123,
    TFD124,
    TFD125,
)
"""BatchGuard's rules, in code order."""
