"""The special token ids of a run (pad, BOS, EOS and the rest), learned from the tokenizer, the collator and the
model config: shared by BatchGuard and MaskProbe (pure; host values in)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

SPECIAL_ROLES: tuple[str, ...] = ("eos", "sep", "pad", "bos")
"""The special-token roles read from a tokenizer, a collator or a config (``<role>_token_id`` / ``<role>_id``)."""


@dataclass(frozen=True)
class SpecialIds:
    """The special token ids a batch is read against (empty: unknown), and where the EOS came from."""

    eos: tuple[int, ...] = ()
    sep: tuple[int, ...] = ()
    pad: tuple[int, ...] = ()
    bos: tuple[int, ...] = ()
    source: str = ""

    def ordered(self) -> tuple[int, ...]:
        """Every id once, EOS first: the order of :func:`~lightning_tfdebug.functional.batches.
        special_token_statistics`' pairs."""
        out: list[int] = []
        for role in SPECIAL_ROLES:
            out += [i for i in getattr(self, role) if i not in out]
        return tuple(out)


def ids_of(value: Any) -> tuple[int, ...]:
    """The non-negative token ids of an attribute: an int or a non-empty list of ints (never a bool)."""
    values = value if isinstance(value, (list, tuple)) and value else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        return ()
    return tuple(v for v in values if v >= 0)


def learn_special_ids(sources: list[tuple[str, Any]], eos_id: int | None = None) -> SpecialIds:
    """The special ids of the first source that names each: ``eos_id``, then each ``(name, obj)`` of ``sources`` in
    order (a tokenizer, a Hugging Face config) by its ``<role>_token_id`` or ``<role>_id`` attribute (a list for
    several EOS ids). Host only; an attribute that raises is skipped."""
    found: dict[str, tuple[int, ...]] = {}
    source = ""
    if eos_id is not None:
        found["eos"], source = (eos_id,), "`eos_id`"
    for name, obj in sources:
        for role in SPECIAL_ROLES if obj is not None else ():
            for attr in (f"{role}_token_id", f"{role}_id"):
                if role in found:
                    break
                try:
                    ids = ids_of(getattr(obj, attr, None))
                except Exception:  # a tokenizer property that complains about an unset token
                    ids = ()
                if ids:
                    found[role] = ids
                    source = name if role == "eos" else source
    return SpecialIds(**found, source=source)
