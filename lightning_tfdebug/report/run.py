"""What the report knows of a run: every rank's findings, read by :func:`load_run` and merged by
:func:`merge_findings`, the checks that did not run, the Coverage rows (:mod:`.coverage`) and the logged series
(:func:`read_series`)."""

from __future__ import annotations

import glob
import json
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from lightning_tfdebug.core.base import CALLBACKS
from lightning_tfdebug.findings import SEVERITIES, Finding, format_value, headline_line, read_findings
from lightning_tfdebug.report.coverage import CoverageRow, merge_coverage, read_coverage

FORMATS: tuple[str, ...] = ("text", "markdown", "json", "html")
FAIL_ON: tuple[str, ...] = ("info", "warning", "error", "unverified", "never")
"""``--fail-on``: a severity, ``unverified`` (an error, or a Coverage row that could not be checked), or never."""
_RANK = {s: i for i, s in enumerate(SEVERITIES)}  # info 0 < warning 1 < error 2
SHORT_INFO_LINES = 8  # the end-of-fit summary lists info findings one by one up to this many, then counts them


def series_of(source: str) -> tuple[str, ...]:
    """The series behind a source's findings: the tag patterns of the keys its callback declares on a chart
    (``KEYS``, :mod:`lightning_tfdebug.primitives.keys`); empty for a source that declares none."""
    cls = CALLBACKS.get(source)
    return tuple(f"^{key.pattern()}$" for key in getattr(cls, "KEYS", ()) if key.chart)


@dataclass(frozen=True)
class MergedFinding:
    """One finding as the report shows it: the same code, source and message on several ranks is one line."""

    code: str
    severity: str
    source: str
    message: str
    hint: str
    evidence: dict[str, Any]
    ranks: tuple[int, ...]
    steps: tuple[int, ...]
    what: str = ""  # what the headline says after where and how bad (the rule's headline, filled)

    @property
    def step(self) -> int:
        return min(self.steps)

    @property
    def headline(self) -> str:
        """``TFD233 warning step 100 ranks 0,1: the loss trains squashed logits (cap c = 1, floor 2.90 nats)``: at
        most 160 characters."""
        return headline_line(f"{self.code} {self.severity} step {self.step} {ranks_text(self.ranks)}: ", self.what)

    def to_dict(self) -> dict[str, Any]:
        return {
            "code": self.code,
            "severity": self.severity,
            "source": self.source,
            "step": self.step,
            "steps": list(self.steps),
            "ranks": list(self.ranks),
            "headline": self.headline,
            "message": self.message,
            "evidence": self.evidence,
            "hint": self.hint,
        }


@dataclass(frozen=True)
class StoodAside:
    """One check that did not run, as the report lists it apart from the findings: merged over ranks."""

    check: str
    reason: str
    setting: str | None
    ranks: tuple[int, ...]

    def to_dict(self) -> dict[str, Any]:
        return {"check": self.check, "reason": self.reason, "setting": self.setting, "ranks": list(self.ranks)}


def merge_stood_aside(records: Sequence[Mapping[str, Any]]) -> list[StoodAside]:
    """One entry per (check, reason, setting), with the ranks that reported it, in the order first seen."""
    groups: dict[tuple[str, str, str | None], set[int]] = {}
    for record in records:
        key = (str(record.get("check")), str(record.get("reason")), record.get("setting"))
        ranks = groups.setdefault(key, set())
        if record.get("rank") is not None:
            ranks.add(int(record["rank"]))
    return [StoodAside(c, r, s, tuple(sorted(ranks))) for (c, r, s), ranks in groups.items()]


def _pack_stood_aside(pack: Mapping[str, Any] | None) -> list[dict[str, Any]]:
    """``pack.json``'s ``stood_aside`` (rank 0's members) as records; the older form ``{name: reason}`` too."""
    out = []
    for name, entry in ((pack or {}).get("stood_aside") or {}).items():
        if isinstance(entry, Mapping):
            out.append({"check": name, "reason": entry.get("reason"), "setting": entry.get("setting"), "rank": 0})
        else:
            out.append({"check": name, "reason": entry, "setting": None, "rank": 0})
    return out


def read_stood_aside(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The records of a ``stood-aside-rank<r>.jsonl`` file; a line that is not one (cut by a crash) is skipped."""
    out = []
    with open(path, "rb") as f:
        data = f.read()  # one read: a snapshot
    for raw in data.split(b"\n"):
        try:
            record = json.loads(raw.decode("utf-8"))
        except (ValueError, UnicodeDecodeError):
            continue
        if isinstance(record, dict) and record.get("check") and record.get("reason"):
            out.append(record)
    return out


@dataclass
class Run:
    """What the report knows of one run."""

    log_dir: str
    tfdebug_dir: str
    findings: list[Finding]
    pack: dict[str, Any] | None = None
    nan_reports: list[str] = field(default_factory=list)
    other_runs: list[str] = field(default_factory=list)
    aside_records: list[dict[str, Any]] = field(default_factory=list)
    coverage_records: list[dict[str, Any]] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    """What this run's files do not hold that the report reads (an older version of the pack wrote them)."""

    @property
    def merged(self) -> list[MergedFinding]:
        return merge_findings(self.findings)

    @property
    def did_not_run(self) -> list[StoodAside]:
        """The checks that did not run, why, and the setting that would let each run: every rank's
        ``stood-aside-rank<r>.jsonl`` (callbacks on their own and the pack's members) merged with ``pack.json``'s
        list, one entry per check and reason with the ranks that reported it."""
        return merge_stood_aside([*self.aside_records, *_pack_stood_aside(self.pack)])

    @property
    def stood_aside(self) -> dict[str, str]:
        """``{check: reason}`` of :attr:`did_not_run`."""
        return {entry.check: entry.reason for entry in self.did_not_run}

    @property
    def coverage(self) -> list[CoverageRow]:
        """What the run checked: every rank's ``coverage-rank<r>.jsonl`` merged, one row per check
        (:func:`~lightning_tfdebug.report.coverage.merge_coverage`)."""
        return merge_coverage(self.coverage_records, {f.code for f in self.findings})

    @property
    def ranks(self) -> list[int]:
        files = _files(self.tfdebug_dir, "findings-rank*.jsonl")
        found = {int(m.group(1)) for p in files if (m := re.search(r"rank(\d+)", os.path.basename(p)))}
        return sorted(found | {f.rank for f in self.findings})


def _files(directory: str, pattern: str) -> list[str]:
    return sorted(glob.glob(os.path.join(directory, pattern)))


def _run_dirs(root: str) -> list[str]:
    """Directories under ``root`` (itself included) that hold a ``tfdebug/`` folder, newest first."""
    found = []
    for dirpath, dirnames, _ in os.walk(root):
        if "tfdebug" in dirnames and os.path.isdir(os.path.join(dirpath, "tfdebug")):
            found.append(dirpath)
        dirnames[:] = [d for d in dirnames if d != "tfdebug" and not d.startswith(".")]
    return sorted(found, key=lambda d: os.path.getmtime(os.path.join(d, "tfdebug")), reverse=True)


def load_run(path: str | os.PathLike[str]) -> Run:
    """Read the run at or under ``path``.

    Args:
        path: a run's log directory (``.../version_N``), its ``tfdebug`` folder, or a directory above several runs
            (the newest is read; the others are listed in :attr:`Run.other_runs`).

    Raises:
        FileNotFoundError: if ``path`` does not exist or holds no lightning_tfdebug output.
    """
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"{path} is not a directory")
    if os.path.basename(os.path.normpath(path)) == "tfdebug":
        runs = [os.path.dirname(os.path.normpath(path))]
    else:
        runs = _run_dirs(path)
    if not runs:
        raise FileNotFoundError(f"no lightning_tfdebug output (a `tfdebug/` folder) under {path}")
    log_dir = runs[0]
    tfdebug_dir = os.path.join(log_dir, "tfdebug")
    findings = [f for p in _files(tfdebug_dir, "findings-rank*.jsonl") for f in read_findings(p)]
    try:
        with open(os.path.join(tfdebug_dir, "pack.json"), encoding="utf-8") as f:
            pack = json.load(f)
    except (OSError, ValueError):  # absent, or cut short by a crash: the findings still stand
        pack = None
    nan_reports = _files(tfdebug_dir, "nan-step*-rank*.txt")
    aside = [r for p in _files(tfdebug_dir, "stood-aside-rank*.jsonl") for r in _read(read_stood_aside, p)]
    coverage_files = _files(tfdebug_dir, "coverage-rank*.jsonl")
    coverage = [r for p in coverage_files for r in _read(read_coverage, p)]
    missing = _missing(tfdebug_dir, pack, bool(coverage_files))
    return Run(log_dir, tfdebug_dir, findings, pack, nan_reports, runs[1:], aside, coverage, missing)


def _read(reader: Any, path: str) -> list[dict[str, Any]]:
    try:
        return reader(path)
    except OSError:
        return []


_OLDER = "(written by an older version of lightning_tfdebug, or the run stopped before it was written)"


def _missing(tfdebug_dir: str, pack: Mapping[str, Any] | None, coverage: bool) -> list[str]:
    """What an older pack (or a run cut short) did not write and the report would read, one sentence each."""
    out = []
    if pack is None:
        out.append(f"pack.json {_OLDER}: the preset, the members and the last step are not known")
    if not coverage:
        out.append(f"coverage-rank<r>.jsonl {_OLDER}: what the run checked is not known")
    without = []
    for path in _files(tfdebug_dir, "findings-rank*.jsonl"):
        try:
            with open(path, "rb") as f:
                data = f.read()
        except OSError:
            continue
        if any(line.strip() and b'"headline"' not in line for line in data.split(b"\n")):
            without.append(os.path.basename(path))
    if without:
        out.append(
            f"the `headline` field in {', '.join(without)} {_OLDER}: the headlines are filled from today's rules"
        )
    return out


def merge_findings(findings: Sequence[Finding]) -> list[MergedFinding]:
    """One line per (code, source, message); ranks and steps collected; sorted by severity (errors first), step."""
    groups: dict[tuple[str, str, str], list[Finding]] = {}
    for finding in findings:
        groups.setdefault((finding.code, finding.source, finding.message), []).append(finding)
    merged = []
    for (code, source, message), same in groups.items():
        first = min(same, key=lambda f: (f.step, f.rank))
        merged.append(
            MergedFinding(
                code=code,
                severity=max((f.severity for f in same), key=_RANK.__getitem__),
                source=source,
                message=message,
                hint=first.hint,
                evidence=first.evidence,
                ranks=tuple(sorted({f.rank for f in same})),
                steps=tuple(sorted({f.step for f in same})),
                what=first.what,
            )
        )
    return sorted(merged, key=lambda m: (-_RANK[m.severity], m.step, m.code))


def counts(merged: Sequence[MergedFinding]) -> dict[str, int]:
    return {s: sum(m.severity == s for m in merged) for s in reversed(SEVERITIES)}


def exit_status(merged: Sequence[MergedFinding], fail_on: str = "error", coverage: Sequence[CoverageRow] = ()) -> int:
    """0 when nothing is at or above ``fail_on`` (``"never"``: always 0), else 1. ``"unverified"``: 1 on an error or
    on a ``coverage`` row that could not be checked (``unknown``)."""
    if fail_on not in FAIL_ON:
        raise ValueError(f"`fail_on` must be one of {', '.join(FAIL_ON)}; got {fail_on!r}.")
    if fail_on == "never":
        return 0
    if fail_on == "unverified":
        return int(any(m.severity == "error" for m in merged) or any(r.status == "unknown" for r in coverage))
    return int(any(_RANK[m.severity] >= _RANK[fail_on] for m in merged))


def summary_line(run: Run, merged: Sequence[MergedFinding] | None = None) -> str:
    merged = run.merged if merged is None else merged
    c = counts(merged)
    parts = [plural(c["error"], "error"), plural(c["warning"], "warning"), f"{c['info']} info"]
    aside = len({entry.check for entry in run.did_not_run})
    tail = f"; {plural(aside, 'check')} did not run" if aside else ""
    return f"lightning_tfdebug: {', '.join(parts)}{tail} ({run.log_dir})"


def plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def ranks_text(ranks: Sequence[int]) -> str:
    """``rank 0`` or ``ranks 0,1``."""
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {','.join(map(str, ranks))}"


def short(value: Any) -> str:
    """Evidence as every printed form shows it (:func:`~lightning_tfdebug.findings.format_value`), cut at 80
    characters for a report line."""
    text = format_value(value)
    return text if len(text) <= 80 else text[:77] + "..."


def evidence_text(evidence: Mapping[str, Any]) -> str:
    return ", ".join(f"{k}={short(v)}" for k, v in evidence.items())


# ---------------------------------------------------------------------- series
def read_series(log_dir: str) -> dict[str, list[tuple[int, float]]]:
    """Every scalar in the TensorBoard event files directly under ``log_dir``: ``{tag: [(step, value), ...]}``."""
    if not glob.glob(os.path.join(log_dir, "events.out.tfevents.*")):
        return {}
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(log_dir, size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags().get("scalars", [])}
