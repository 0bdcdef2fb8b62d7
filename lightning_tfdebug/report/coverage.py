"""Coverage: what a run checked. Every member writes rows to ``<log_dir>/tfdebug/coverage-rank<r>.jsonl`` (one JSON
object a line: ``member``, ``check``, ``status`` = ``verified`` | ``n/a`` | ``unknown``, ``reason``, ``setting``,
``codes``, ``step``, ``rank``); the report reads every rank's file and merges them into one row per check.

Per rank the last line for a ``(member, check)`` wins. Across ranks a row is ``finding`` when a finding with one of
its codes was raised (on any rank), else ``unknown`` when any rank could not check, else ``verified`` when any rank
verified it, else ``n/a``.

Example:
    >>> rows = merge_coverage([{"member": "MaskProbe", "check": "causal mask", "status": "verified",
    ...                         "codes": ["TFD201"], "rank": 0}], found_codes={"TFD201"})
    >>> rows[0].status, rows[0].found
    ('finding', ('TFD201',))
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

STATUSES: tuple[str, ...] = ("verified", "n/a", "unknown")
"""What a member writes of a check; the report adds ``finding``."""

SYMBOLS: dict[str, str] = {"verified": "✓", "finding": "✗", "n/a": "\u2013", "unknown": "?"}
ASCII_SYMBOLS: dict[str, str] = {"verified": "ok", "finding": "X", "n/a": "-", "unknown": "?"}
"""The same, for a terminal that cannot print the others."""

WORDS: dict[str, str] = {"verified": "verified", "finding": "finding", "n/a": "n/a", "unknown": "could not check"}


@dataclass(frozen=True)
class CoverageRow:
    """One check of one member, merged over the ranks."""

    member: str
    check: str
    status: str  # "finding", "unknown", "verified" or "n/a"
    reason: str | None
    setting: str | None
    codes: tuple[str, ...]
    found: tuple[str, ...]  # the codes of `codes` that were raised
    ranks: tuple[int, ...]  # the ranks that wrote the row
    said: tuple[tuple[int, str], ...]  # (rank, status) as each rank wrote it last

    def to_dict(self) -> dict[str, Any]:
        return {
            "member": self.member,
            "check": self.check,
            "status": self.status,
            "reason": self.reason,
            "setting": self.setting,
            "codes": list(self.codes),
            "found": list(self.found),
            "ranks": list(self.ranks),
        }

    def explanation(self) -> str:
        """Why the row is what it is, in words: the codes found, the reason (and the setting) of the others."""
        if self.status == "finding":
            return "finding " + ", ".join(self.found)
        if self.status == "verified":
            return ""
        text = (self.reason or "").rstrip(".")
        if self.status == "unknown" and self.setting:
            text = f"{text}; to let it run: {self.setting}" if text else f"to let it run: {self.setting}"
        return text

    def line(self, symbols: Mapping[str, str] = SYMBOLS) -> str:
        """``✓ MaskProbe: causal mask``; ``? MaskProbe: cross-sample (could not check: why; to let it run: ...)``."""
        why = self.explanation()
        if self.status in ("n/a", "unknown"):
            why = f"{WORDS[self.status]}: {why}" if why else WORDS[self.status]
        return f"{symbols[self.status]} {self.member}: {self.check}" + (f" ({why})" if why else "")


def read_coverage(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The records of one ``coverage-rank<r>.jsonl``; a line that is not one (cut by a crash, or damaged) is
    skipped: the file is read up to the cut."""
    with open(path, "rb") as f:
        data = f.read()  # one read: a snapshot
    out = []
    for raw in data.split(b"\n"):
        try:
            record = json.loads(raw.decode("utf-8"))
        except (ValueError, UnicodeDecodeError):
            continue
        if isinstance(record, dict) and record.get("member") and record.get("check") and record.get("status"):
            out.append(record)
    return out


def merge_coverage(records: Iterable[Mapping[str, Any]], found_codes: Iterable[str] = ()) -> list[CoverageRow]:
    """One :class:`CoverageRow` per ``(member, check)``, in the order first written; ``found_codes``: the codes of
    every finding of the run (any rank)."""
    found_codes = set(found_codes)
    last: dict[tuple[str, str], dict[int, Mapping[str, Any]]] = {}
    for record in records:
        key = (str(record["member"]), str(record["check"]))
        rank = record.get("rank")
        last.setdefault(key, {})[int(rank) if isinstance(rank, int) else -1] = record  # the last line wins
    rows = []
    for (member, check), by_rank in last.items():
        codes = tuple(dict.fromkeys(c for r in by_rank.values() for c in (r.get("codes") or ()) if isinstance(c, str)))
        found = tuple(c for c in codes if c in found_codes)
        said = {rank: str(r.get("status")) for rank, r in by_rank.items()}
        if found:
            status = "finding"
        else:
            status = next((s for s in ("unknown", "verified") if s in said.values()), "n/a")
        source = next((r for r in by_rank.values() if str(r.get("status")) == status), next(iter(by_rank.values())))
        rows.append(
            CoverageRow(
                member=member,
                check=check,
                status=status,
                reason=_text(source.get("reason")),
                setting=_text(source.get("setting")),
                codes=codes,
                found=found,
                ranks=tuple(sorted(r for r in by_rank if r >= 0)),
                said=tuple(sorted((r, s) for r, s in said.items() if r >= 0)),
            )
        )
    return rows


def _text(value: Any) -> str | None:
    return None if value is None or value == "" else str(value)


def coverage_counts(rows: Sequence[CoverageRow]) -> dict[str, int]:
    """``{status: rows}`` in the order ``finding``, ``unknown``, ``verified``, ``n/a``."""
    return {s: sum(r.status == s for r in rows) for s in ("finding", "unknown", "verified", "n/a")}


def coverage_summary(rows: Sequence[CoverageRow]) -> str:
    """``coverage: 9 verified, 1 finding, 2 n/a, 1 could not check`` (empty when nothing was written)."""
    if not rows:
        return ""
    c = coverage_counts(rows)
    parts = [f"{c['verified']} verified"]
    parts += [f"{c[s]} {WORDS[s]}" for s in ("finding", "n/a", "unknown") if c[s]]
    return "coverage: " + ", ".join(parts)


def terminal_symbols(stream: Any) -> Mapping[str, str]:
    """:data:`SYMBOLS` when ``stream`` can print them, else :data:`ASCII_SYMBOLS` (never an encoding error)."""
    encoding = getattr(stream, "encoding", None) or "ascii"
    try:
        "".join(SYMBOLS.values()).encode(encoding)
    except (UnicodeEncodeError, LookupError):
        return ASCII_SYMBOLS
    return SYMBOLS
