"""The special token ids of a run (end-of-sequence, separator, padding, beginning-of-sequence), read from the
objects that name them: a tokenizer, a Hugging Face config. Shared by BatchGuard (``TFD124``) and MaskProbe."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

SPECIAL_ROLES: tuple[str, ...] = ("eos", "sep", "pad", "bos")
"""The roles a special id can have, in the order :meth:`SpecialIds.ordered` lists them."""


@dataclass(frozen=True)
class SpecialIds:
    """The special token ids a batch is read against (empty: unknown), and where the EOS came from."""

    eos: tuple[int, ...] = ()
    sep: tuple[int, ...] = ()
    pad: tuple[int, ...] = ()
    bos: tuple[int, ...] = ()
    source: str = ""

    def ordered(self) -> tuple[int, ...]:
        """Every id once, EOS first: the order of the per-id counts of BatchGuard's special-token statistics."""
        out: list[int] = []
        for role in SPECIAL_ROLES:
            out += [i for i in getattr(self, role) if i not in out]
        return tuple(out)


def _ids_of(value: Any) -> tuple[int, ...]:
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
                    ids = _ids_of(getattr(obj, attr, None))
                except Exception:  # a tokenizer property that complains about an unset token
                    ids = ()
                if ids:
                    found[role] = ids
                    source = name if role == "eos" else source
    return SpecialIds(**found, source=source)
