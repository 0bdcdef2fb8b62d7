"""The run report (``tfdebug report`` and the summary ``TFDebug`` prints at the end of ``fit``): every rank's and
every callback's findings, read by :func:`load_run`, merged by :func:`merge_findings` and rendered by :func:`render`
as text, markdown, json or one self-contained HTML file (with pictures of the series behind the findings)."""

from __future__ import annotations

import base64
import glob
import html
import io
import json
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from lightning_tfdebug.core.base import CALLBACKS
from lightning_tfdebug.findings import SEVERITIES, Finding, format_value, read_findings

FORMATS: tuple[str, ...] = ("text", "markdown", "json", "html")
FAIL_ON: tuple[str, ...] = ("info", "warning", "error", "never")
_RANK = {s: i for i, s in enumerate(SEVERITIES)}  # info 0 < warning 1 < error 2
SHORT_INFO_LINES = 8  # the end-of-fit summary lists info findings one by one up to this many, then counts them


def series_of(source: str) -> tuple[str, ...]:
    """The series behind a source's findings: the tag patterns of the keys its callback declares on a chart
    (``KEYS``, :mod:`lightning_tfdebug.primitives.keys`); empty for a source that declares none."""
    cls = CALLBACKS.get(source)
    return tuple(f"^{key.pattern()}$" for key in getattr(cls, "KEYS", ()) if key.chart)


_OVERVIEW = (r"^loss_at_init/(loss|ln_vocab|unigram_entropy)$", r"^grad_norm/total$")


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

    @property
    def step(self) -> int:
        return min(self.steps)

    def to_dict(self) -> dict[str, Any]:
        return {
            "code": self.code,
            "severity": self.severity,
            "source": self.source,
            "step": self.step,
            "steps": list(self.steps),
            "ranks": list(self.ranks),
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
    aside = [r for p in _files(tfdebug_dir, "stood-aside-rank*.jsonl") for r in _read_aside(p)]
    return Run(log_dir, tfdebug_dir, findings, pack, nan_reports, runs[1:], aside)


def _read_aside(path: str) -> list[dict[str, Any]]:
    try:
        return read_stood_aside(path)
    except OSError:
        return []


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
            )
        )
    return sorted(merged, key=lambda m: (-_RANK[m.severity], m.step, m.code))


def counts(merged: Sequence[MergedFinding]) -> dict[str, int]:
    return {s: sum(m.severity == s for m in merged) for s in reversed(SEVERITIES)}


def exit_status(merged: Sequence[MergedFinding], fail_on: str = "error") -> int:
    """0 when nothing is at or above ``fail_on`` (``"never"``: always 0), else 1."""
    if fail_on not in FAIL_ON:
        raise ValueError(f"`fail_on` must be one of {', '.join(FAIL_ON)}; got {fail_on!r}.")
    if fail_on == "never":
        return 0
    return int(any(_RANK[m.severity] >= _RANK[fail_on] for m in merged))


def summary_line(run: Run, merged: Sequence[MergedFinding] | None = None) -> str:
    merged = run.merged if merged is None else merged
    c = counts(merged)
    parts = [_plural(c["error"], "error"), _plural(c["warning"], "warning"), f"{c['info']} info"]
    aside = len({entry.check for entry in run.did_not_run})
    tail = f"; {_plural(aside, 'check')} did not run" if aside else ""
    return f"lightning_tfdebug: {', '.join(parts)}{tail} ({run.log_dir})"


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def _ranks(ranks: Sequence[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {','.join(map(str, ranks))}"


def _short(value: Any) -> str:
    """Evidence as every printed form shows it (:func:`~lightning_tfdebug.findings.format_value`), cut at 80
    characters for a report line."""
    text = format_value(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _evidence(evidence: Mapping[str, Any]) -> str:
    return ", ".join(f"{k}={_short(v)}" for k, v in evidence.items())


# ---------------------------------------------------------------------- text forms
def render_short(run: Run) -> str:
    """What rank 0 prints at the end of ``fit``: warnings and errors one line each, the info count, the command."""
    merged = run.merged
    lines = [summary_line(run, merged)]
    info = counts(merged)["info"]
    for m in merged:
        if m.severity != "info" or info <= SHORT_INFO_LINES:
            lines.append(f"  {m.severity:<7} {m.code}  step {m.step:<6} {m.source}: {m.message}")
    if info > SHORT_INFO_LINES:
        lines.append(f"  ... and {_plural(info, 'info finding')}")
    lines += _failure_lines(run, "  ")
    if run.did_not_run:
        lines.append("  did not run (not findings; what would let each run):")
        lines += [f"    {_aside_line(entry, run)}" for entry in run.did_not_run]
    lines.append(f"  full report: tfdebug report {run.log_dir} [--format html --output report.html]")
    return "\n".join(lines)


def _aside_line(entry: StoodAside, run: Run) -> str:
    ranks = f" ({_ranks(entry.ranks)})" if len(run.ranks) > 1 and entry.ranks else ""
    return f"{entry.check}{ranks}: {entry.reason}" + (f" To let it run: {entry.setting}." if entry.setting else "")


def _failure_lines(run: Run, indent: str) -> list[str]:
    """The run's failure and, when it is known, what it means (another rank died)."""
    pack = run.pack or {}
    if not pack.get("failed"):
        return []
    lines = [f"{indent}the run failed at step {pack.get('step')}: {_short(pack['failed'])}"]
    if pack.get("failed_because"):
        lines.append(f"{indent}  {pack['failed_because']}")
    return lines


def render_text(run: Run) -> str:
    merged = run.merged
    lines = [_header(run)]
    for m in merged:
        lines.append(f"{m.severity:<7} {m.code}  step {m.step:<6} {_ranks(m.ranks):<10} {m.source}: {m.message}")
        if m.evidence:
            lines.append(f"        evidence: {_evidence(m.evidence)}")
        if m.hint:
            lines.append(f"        hint: {m.hint}")
    lines += _failure_lines(run, "")
    if run.did_not_run:
        lines.append("Checks that did not run (not findings; what would let each run):")
        lines.extend(f"  {_aside_line(entry, run)}" for entry in run.did_not_run)
    for path in run.nan_reports:
        lines.append(f"NaN report: {path}")
    lines.append(summary_line(run, merged))
    return "\n".join(lines) + "\n"


def _header(run: Run) -> str:
    pack = run.pack or {}
    bits = [run.log_dir]
    if pack:
        bits.append(f"preset {pack.get('preset')}, {len(pack.get('running', []))} members, step {pack.get('step')}")
    if run.ranks:
        bits.append(f"ranks {','.join(map(str, run.ranks))}")
    if pack.get("failed"):
        bits.append(f"the run failed: {pack['failed']}")
    if run.other_runs:
        bits.append(f"newest of {len(run.other_runs) + 1} runs; pass a version directory to choose")
    return " | ".join(bits)


def render_markdown(run: Run) -> str:
    merged = run.merged
    out = ["# lightning_tfdebug report", "", _header(run), "", f"**{summary_line(run, merged)}**", ""]
    if merged:
        out += [
            "| severity | code | step | ranks | source | finding | hint |",
            "| --- | --- | --- | --- | --- | --- | --- |",
        ]
        for m in merged:
            out.append(
                _table_row([m.severity, m.code, str(m.step), ",".join(map(str, m.ranks)), m.source, m.message, m.hint])
            )
    failure = _failure_lines(run, "")
    if failure:
        out += ["", "## The run failed", "", *failure]
    if run.did_not_run:
        out += [
            "",
            "## Checks that did not run",
            "",
            "| check | ranks | why | what would let it run |",
            "| --- | --- | --- | --- |",
        ]
        for entry in run.did_not_run:
            out.append(_table_row([entry.check, ",".join(map(str, entry.ranks)), entry.reason, entry.setting or "-"]))
    return "\n".join(out) + "\n"


def _table_row(cells: Sequence[str]) -> str:
    """A markdown table row, its cells on one line with their pipes escaped."""
    return "| " + " | ".join(c.replace("|", "\\|").replace("\n", " ") for c in cells) + " |"


def render_json(run: Run, fail_on: str = "error") -> str:
    merged = run.merged
    data = {
        "log_dir": run.log_dir,
        "summary": counts(merged),
        "exit_status": exit_status(merged, fail_on),
        "fail_on": fail_on,
        "findings": [m.to_dict() for m in merged],
        "did_not_run": [entry.to_dict() for entry in run.did_not_run],
        "pack": run.pack,
        "nan_reports": run.nan_reports,
        "other_runs": run.other_runs,
    }
    return json.dumps(data, indent=2, default=str) + "\n"


# ---------------------------------------------------------------------- html
def read_series(log_dir: str) -> dict[str, list[tuple[int, float]]]:
    """Every scalar in the TensorBoard event files directly under ``log_dir``: ``{tag: [(step, value), ...]}``."""
    if not glob.glob(os.path.join(log_dir, "events.out.tfevents.*")):
        return {}
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(log_dir, size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags().get("scalars", [])}


def _picture(title: str, series: dict[str, list[tuple[int, float]]], marks: Sequence[int] = ()) -> str | None:
    """A PNG (base64) of ``series`` with the finding steps marked; None when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg", force=False)
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(7.5, 3.2), dpi=90)
    try:
        for tag, points in list(series.items())[:16]:
            ax.plot([s for s, _ in points], [v for _, v in points], label=tag, linewidth=1.2)
        values = [v for pts in series.values() for _, v in pts if v == v]
        if values and min(values) > 0 and max(values) / min(values) > 1e3:
            ax.set_yscale("log")
        for step in sorted(set(marks)):
            ax.axvline(step, color="crimson", linestyle="--", linewidth=0.8)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="best", ncol=2 if len(series) > 6 else 1)
        buffer = io.BytesIO()
        fig.tight_layout()
        fig.savefig(buffer, format="png")
    finally:
        plt.close(fig)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def _select(series: dict[str, list[tuple[int, float]]], patterns: Sequence[str]) -> dict[str, list[tuple[int, float]]]:
    return {tag: pts for tag, pts in sorted(series.items()) if any(re.search(p, tag) for p in patterns)}


_CSS = """
body{font-family:system-ui,sans-serif;max-width:1100px;margin:2em auto;color:#222}
table{border-collapse:collapse;width:100%;font-size:0.9em}
td,th{border:1px solid #ccc;padding:4px 6px;vertical-align:top}
.error{background:#fde2e2}.warning{background:#fff4d6}.info{background:#eef4fb}
pre{background:#f6f6f6;padding:8px;overflow-x:auto;font-size:0.8em}h2{margin-top:1.6em}
"""


def render_html(run: Run) -> str:
    merged = run.merged
    esc = html.escape
    parts = [
        "<!doctype html><html><head><meta charset='utf-8'><title>lightning_tfdebug report</title>",
        f"<style>{_CSS}</style></head><body>",
        "<h1>lightning_tfdebug report</h1>",
        f"<p>{esc(_header(run))}</p><p><b>{esc(summary_line(run, merged))}</b></p>",
    ]
    if merged:
        parts.append(
            "<table><tr><th>severity</th><th>code</th><th>step</th><th>ranks</th><th>source</th><th>finding</th></tr>"
        )
        for m in merged:
            detail = esc(m.message)
            if m.evidence:
                detail += f"<br><small>evidence: {esc(_evidence(m.evidence))}</small>"
            if m.hint:
                detail += f"<br><small>hint: {esc(m.hint)}</small>"
            parts.append(
                f"<tr class='{m.severity}'><td>{m.severity}</td><td>{m.code}</td><td>{m.step}</td>"
                f"<td>{esc(','.join(map(str, m.ranks)))}</td><td>{esc(m.source)}</td><td>{detail}</td></tr>"
            )
        parts.append("</table>")
    if run.did_not_run:
        parts.append("<h2>Checks that did not run</h2><ul>")
        for entry in run.did_not_run:
            setting = f" <i>To let it run: {esc(entry.setting)}.</i>" if entry.setting else ""
            ranks = f" ({esc(_ranks(entry.ranks))})" if len(run.ranks) > 1 and entry.ranks else ""
            parts.append(f"<li><b>{esc(entry.check)}</b>{ranks}: {esc(entry.reason)}{setting}</li>")
        parts.append("</ul>")
    parts += _html_pictures(read_series(run.log_dir), merged)
    for path in run.nan_reports:
        try:
            with open(path, encoding="utf-8", errors="replace") as f:
                text = f.read()
        except OSError as err:
            text = f"(could not read: {err})"
        parts.append(f"<h2>NaN frames: {esc(os.path.basename(path))}</h2><pre>{esc(text)}</pre>")
    parts.append("</body></html>")
    return "\n".join(parts) + "\n"


def _html_pictures(series: dict[str, list[tuple[int, float]]], merged: Sequence[MergedFinding]) -> list[str]:
    """The pictures of the series behind each source's findings (their steps marked), then the overview."""
    sources = [s for s in dict.fromkeys(m.source for m in merged) if series_of(s)]
    sections = [
        (f"{s}: the series behind its findings", series_of(s), [m.step for m in merged if m.source == s])
        for s in sources
    ]
    sections.append(("Overview: loss and gradient norm", _OVERVIEW, []))
    parts: list[str] = []
    for title, patterns, marks in sections:
        chosen = _select(series, patterns)
        if not chosen:
            continue
        png = _picture(title, chosen, marks)
        if png is None:
            return [*parts, "<p>Pictures need matplotlib: <code>pip install matplotlib</code> (the report extra).</p>"]
        title = html.escape(title)
        parts.append(f"<h2>{title}</h2><img alt='{title}' src='data:image/png;base64,{png}'>")
    return parts or ["<p>No TensorBoard series found next to the findings (a TensorBoardLogger draws them).</p>"]


def render(run: Run, fmt: str = "text", fail_on: str = "error") -> str:
    """The report of ``run`` in ``fmt`` (one of :data:`FORMATS`)."""
    if fmt not in FORMATS:
        raise ValueError(f"`format` must be one of {', '.join(FORMATS)}; got {fmt!r}.")
    if fmt == "json":
        return render_json(run, fail_on)
    return {"text": render_text, "markdown": render_markdown, "html": render_html}[fmt](run)
