"""Findings: the records every callback of the pack produces, and how they are read back and printed.

A :class:`Finding` is one diagnosis: a stable code (registered in :data:`lightning_tfdebug.rules.RULES`, its
hundreds digit naming the area, :data:`lightning_tfdebug.rules.AREAS`), a one-sentence message, the numbers that show
it and a hint on what to do.
"""

from __future__ import annotations

import json
import math
import os
import re
import warnings
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

Severity = Literal["info", "warning", "error"]
OnFinding = Literal["warn", "stop", "raise"]

SEVERITIES: tuple[str, ...] = ("info", "warning", "error")
ON_FINDING_CHOICES: tuple[str, ...] = ("warn", "stop", "raise")
_CODE_PATTERN = re.compile(r"^TFD[1-7]\d\d$")
HEADLINE_LIMIT = 160
"""The most characters a finding's :attr:`Finding.headline` has (the line the summary and the report print)."""


def check_code(code: str) -> None:
    """Raise a ValueError unless ``code`` looks like ``TFD301`` (TFD + area 1-7 + two digits)."""
    if not isinstance(code, str) or not _CODE_PATTERN.match(code):
        raise ValueError(f"Finding code must look like 'TFD301' (TFD + area 1-7 + two digits), got {code!r}.")


class TFDebugWarning(UserWarning):
    """Category of every warning the pack emits, so users can filter them (``warnings.filterwarnings``)."""


class TFDebugError(RuntimeError):
    """Raised on every rank at the same step when a callback built with ``on_finding="raise"`` finds a problem.

    Attributes:
        findings: the findings that caused the raise, as seen on this rank.
    """

    def __init__(self, message: str, findings: tuple[Finding, ...] = ()) -> None:
        super().__init__(message)
        self.findings = findings


@dataclass(frozen=True)
class Finding:
    """One diagnosis produced by a callback.

    Args:
        code: stable identifier such as ``"TFD301"``; the hundreds digit names the area.
        severity: ``"info"``, ``"warning"`` or ``"error"``.
        source: class name of the callback that produced it.
        step: ``trainer.global_step`` when it was found.
        rank: global rank of the process that found it.
        message: one sentence saying what is wrong.
        evidence: the numbers that show it (JSON-serialisable values).
        hint: likely causes and the fix.
        headline: the finding in one line of at most :data:`HEADLINE_LIMIT` characters, ``TFD233 warning step 100
            rank 0: `` then what its rule's ``headline`` says (the title with its deciding numbers). Given without
            that prefix (or not at all: filled from the rule registry and the evidence), it is stored with it.

    Raises:
        ValueError: if ``code`` or ``severity`` is malformed.
    """

    code: str
    severity: Severity
    source: str
    step: int
    rank: int
    message: str
    evidence: dict[str, Any] = field(default_factory=dict)
    hint: str = ""
    headline: str = ""

    def __post_init__(self) -> None:
        check_code(self.code)
        if self.severity not in SEVERITIES:
            raise ValueError(f"Finding severity must be one of {SEVERITIES}, got {self.severity!r}.")
        prefix = self.headline_prefix
        if not self.headline.startswith(prefix):  # frozen: the one place the field is completed
            object.__setattr__(self, "headline", headline_line(prefix, self.headline or self._what()))

    @property
    def headline_prefix(self) -> str:
        """``TFD233 warning step 100 rank 0: ``: where and how bad, before what the headline says."""
        return f"{self.code} {self.severity} step {self.step} rank {self.rank}: "

    @property
    def what(self) -> str:
        """The headline without its prefix: what its rule's ``headline`` says of this finding."""
        return self.headline[len(self.headline_prefix) :]

    def _what(self) -> str:
        """The rule's headline filled from the evidence (a finding built without one, or read from an older file);
        the message for a code no rule registers."""
        what = _headline_source(self.code, self.evidence) if _headline_source is not None else None
        return self.message if what is None else what

    def to_dict(self) -> dict[str, Any]:
        """The finding as a plain dict whose values are JSON-serialisable."""
        out = asdict(self)
        out["evidence"] = _jsonable(self.evidence)
        return out

    def to_json(self) -> str:
        """One line of JSON (no newline)."""
        return json.dumps(self.to_dict(), sort_keys=False, allow_nan=False)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Finding:
        """Inverse of :meth:`to_dict`, tolerant of extra keys."""
        names = {"code", "severity", "source", "step", "rank", "message", "evidence", "hint", "headline"}
        return cls(**{k: v for k, v in data.items() if k in names})

    def format(self) -> str:
        """Human-readable multi-line rendering, used for warnings and TensorBoard text."""
        header = f"[{self.code}] {self.severity.upper()} from {self.source} at step {self.step} (rank {self.rank}):"
        lines = [header, f"  {self.message}"]
        if self.evidence:
            shown = ", ".join(f"{k}={format_value(v)}" for k, v in self.evidence.items())
            lines.append(f"  evidence: {shown}")
        if self.hint:
            lines.append(f"  hint: {self.hint}")
        return "\n".join(lines)


_headline_source: Callable[[str, Mapping[str, Any]], str | None] | None = None


def set_headline_source(source: Callable[[str, Mapping[str, Any]], str | None]) -> None:
    """Where a finding built without a headline gets one: ``source(code, evidence)``, its rule's headline (None: no
    rule has that code). The rule registry sets it when it is imported (it reads this module, not the reverse)."""
    global _headline_source
    _headline_source = source


def headline_line(prefix: str, what: str) -> str:
    """``prefix`` + ``what`` on one line, ``what`` cut with "..." so that the whole has at most
    :data:`HEADLINE_LIMIT` characters."""
    what = " ".join(str(what).split())
    room = max(HEADLINE_LIMIT - len(prefix), 8)
    return prefix + (what if len(what) <= room else what[: room - 3] + "...")


def read_findings(path: str | os.PathLike[str], *, strict: bool = False) -> list[Finding]:
    """Read a ``findings-rank<r>.jsonl`` file back into :class:`Finding` records.

    The file is read once, as it is at that moment. A line that is not a complete finding (the last line of a process
    killed mid-write) is skipped with one :class:`TFDebugWarning` naming the file and the lines.

    Args:
        path: the ``.jsonl`` file.
        strict: raise ``ValueError`` on the first unreadable line instead of skipping it.

    Raises:
        OSError: if the file cannot be opened.
        ValueError: with ``strict=True``, on a line that is not a finding.
    """
    with open(path, "rb") as f:
        data = f.read()  # one read: a snapshot, whatever a writer appends meanwhile
    lines = data.split(b"\n")
    out: list[Finding] = []
    skipped: list[str] = []
    for number, raw in enumerate(lines, start=1):
        if not raw.strip():
            continue
        cut = number == len(lines)  # no newline after it: the writer had not finished the line
        try:
            out.append(Finding.from_dict(json.loads(raw.decode("utf-8"))))
        except (ValueError, TypeError, UnicodeDecodeError) as err:  # JSONDecodeError is a ValueError
            where = f"line {number}" + (" (the last, cut off: the writer was stopped mid-line)" if cut else "")
            if strict:
                raise ValueError(f"{os.fspath(path)}: {where} is not a finding ({err}).") from None
            skipped.append(where)
    if skipped:
        warnings.warn(
            f"{os.fspath(path)}: skipped {len(skipped)} unreadable line(s): {', '.join(skipped[:5])}"
            f"{' ...' if len(skipped) > 5 else ''}. The other {len(out)} finding(s) were read.",
            category=TFDebugWarning,
            stacklevel=2,
        )
    return out


def _jsonable(value: Any) -> Any:
    """Make evidence JSON-safe: tensors to numbers, non-finite floats to strings, tuples to lists."""
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set)):
        return [_jsonable(v) for v in value]
    if hasattr(value, "tolist") and callable(value.tolist):  # torch tensors, numpy arrays and scalars
        return _jsonable(value.tolist())
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # "nan", "inf", "-inf": JSON has no literal for them
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)


def format_value(value: Any) -> str:
    """A piece of evidence as every printed form shows it (the live warning, the summary, the report): floats to four
    significant digits, inside lists and dicts too; a list longer than eight items is cut with its length.

    Example:
        >>> format_value({"head": 1.6357474346930765, "steps": [1, 2]})
        "{'head': 1.636, 'steps': [1, 2]}"
    """
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, Mapping):
        return "{" + ", ".join(f"{k!r}: {format_value(v)}" for k, v in value.items()) + "}"
    if isinstance(value, (list, tuple)) and len(value) > 8:
        return "[" + ", ".join(format_value(v) for v in value[:8]) + f", ... ({len(value)} items)]"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(format_value(v) for v in value) + "]"
    return str(value)
