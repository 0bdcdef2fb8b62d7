"""The report as text (one headline per finding; ``verbose``: with its message, evidence and hint), as the summary
``TFDebug`` prints at the end of ``fit``, as markdown (the run on one page, then each finding's details and
evidence chart) and as json."""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from lightning_tfdebug.report.coverage import SYMBOLS, CoverageRow, coverage_summary, terminal_symbols
from lightning_tfdebug.report.run import (
    SHORT_INFO_LINES,
    MergedFinding,
    Run,
    StoodAside,
    counts,
    evidence_text,
    exit_status,
    plural,
    ranks_text,
    short,
    summary_line,
)


def render_short(run: Run, symbols: Mapping[str, str] | None = None) -> str:
    """What rank 0 prints at the end of ``fit``: the summary line, each warning and error in one headline (the info
    findings too, up to :data:`SHORT_INFO_LINES`), the Coverage rows that are not verified, the checks that did not
    run, and where the full report is."""
    symbols = terminal_symbols(sys.stdout) if symbols is None else symbols
    merged = run.merged
    lines = [summary_line(run, merged)]
    info = counts(merged)["info"]
    for m in merged:
        if m.severity != "info" or info <= SHORT_INFO_LINES:
            lines.append(f"  {m.headline}")
    if info > SHORT_INFO_LINES:
        lines.append(f"  ... and {plural(info, 'info finding')}")
    lines += _failure_lines(run, "  ")
    lines += coverage_lines(run.coverage, "  ", symbols, only_open=True)
    aside = _not_in_coverage(run)
    if aside:
        lines.append("  did not run (not findings; what would let each run):")
        lines += [f"    {_aside_line(entry, run)}" for entry in aside]
    lines.append(f"  full report: tfdebug report {run.log_dir} (--verbose: every message; --format html: the charts)")
    return "\n".join(lines)


def log_headlines(trainer: Any, run: Run) -> None:
    """Write the run's headlines, the summary line and the Coverage count as one text card (``tfdebug/headlines``)
    to every TensorBoardLogger of ``trainer``; a logger that refuses is passed over (the summary is a convenience)."""
    from lightning_tfdebug.core.compat import is_lightning_instance

    merged = run.merged
    lines = [f"**{summary_line(run, merged)}**", *(f"- {m.headline}" for m in merged)]
    covered = coverage_summary(run.coverage)
    if covered:
        lines.append(f"- {covered}")
    lines.append(f"- full report: `tfdebug report {run.log_dir} --format html`")
    for logger in trainer.loggers:
        if not is_lightning_instance(logger, "TensorBoardLogger"):
            continue
        try:
            logger.experiment.add_text("tfdebug/headlines", "  \n".join(lines), global_step=trainer.global_step)
            logger.experiment.flush()
        except Exception:  # the logger's own failure (a closed or refused event file): the run is not disturbed
            continue


def coverage_lines(
    rows: Sequence[CoverageRow], indent: str, symbols: Mapping[str, str] = SYMBOLS, only_open: bool = False
) -> list[str]:
    """The Coverage block: its count line, then a row per check (``only_open``: only the rows with a finding or
    that could not be checked)."""
    if not rows:
        return []
    shown = [r for r in rows if r.status in ("finding", "unknown")] if only_open else list(rows)
    order = {"finding": 0, "unknown": 1, "verified": 2, "n/a": 3}
    return [f"{indent}{coverage_summary(rows)}"] + [
        f"{indent}  {r.line(symbols)}" for r in sorted(shown, key=lambda r: order[r.status])
    ]


def _not_in_coverage(run: Run) -> list[StoodAside]:
    """The checks that did not run, less those a Coverage row already says could not be checked."""
    said = {f"{r.member}: {r.check}" for r in run.coverage if r.status == "unknown"}
    return [entry for entry in run.did_not_run if entry.check not in said]


def _aside_line(entry: StoodAside, run: Run) -> str:
    ranks = f" ({ranks_text(entry.ranks)})" if len(run.ranks) > 1 and entry.ranks else ""
    return f"{entry.check}{ranks}: {entry.reason}" + (f" To let it run: {entry.setting}." if entry.setting else "")


def _failure_lines(run: Run, indent: str) -> list[str]:
    """The run's failure and, when it is known, what it means (another rank died)."""
    pack = run.pack or {}
    if not pack.get("failed"):
        return []
    lines = [f"{indent}the run failed at step {pack.get('step')}: {short(pack['failed'])}"]
    if pack.get("failed_because"):
        lines.append(f"{indent}  {pack['failed_because']}")
    return lines


def render_text(run: Run, verbose: bool = False) -> str:
    """One headline per finding; ``verbose``: each followed by its source, message, evidence and hint."""
    merged = run.merged
    lines = [header(run)]
    for m in merged:
        lines.append(m.headline)
        if verbose:
            lines.append(f"        {m.source}: {m.message}")
            if m.evidence:
                lines.append(f"        evidence: {evidence_text(m.evidence)}")
            if m.hint:
                lines.append(f"        hint: {m.hint}")
    lines += _failure_lines(run, "")
    lines += coverage_lines(run.coverage, "", terminal_symbols(sys.stdout))
    aside = _not_in_coverage(run)
    if aside:
        lines.append("Checks that did not run (not findings; what would let each run):")
        lines.extend(f"  {_aside_line(entry, run)}" for entry in aside)
    for path in run.nan_reports:
        lines.append(f"NaN report: {path}")
    for what in run.missing:
        lines.append(f"not in this run's files: {what}")
    lines.append(summary_line(run, merged))
    if merged and not verbose:
        lines.append(f"every finding's message, evidence and hint: tfdebug report {run.log_dir} --verbose")
    return "\n".join(lines) + "\n"


def header(run: Run) -> str:
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


def anchor(index: int, m: MergedFinding) -> str:
    """The id of a finding's details in the markdown and HTML reports."""
    return f"{m.code.lower()}-{index}"


def table_row(cells: Sequence[str]) -> str:
    """A markdown table row, its cells on one line with their pipes escaped."""
    return "| " + " | ".join(str(c).replace("|", "\\|").replace("\n", " ") for c in cells) + " |"


def _number(value: Any, digits: str = ".4g") -> str:
    return "-" if value is None else format(value, digits)


def render_markdown(run: Run) -> str:
    """The run on one page (the loss with the findings marked, the headlines linking to their details, Coverage, the
    ranks), then each finding's details and evidence chart, then every series by unit behind one fold."""
    from lightning_tfdebug.report import evidence
    from lightning_tfdebug.report.run import read_series

    merged = run.merged
    series = read_series(run.log_dir)
    overview = evidence.overview_figure(run, series, merged)
    out = ["# lightning_tfdebug report", "", header(run), "", f"**{summary_line(run, merged)}**", ""]
    out += [f"![{overview.alt}]({overview.uri})", "", f"*{overview.caption}*", ""]
    if merged:
        out += ["## Findings", ""]
        out += [f"- [{m.headline}](#{anchor(i, m)})" for i, m in enumerate(merged)]
        out.append("")
    out += _markdown_coverage(run.coverage)
    out += [
        "## Ranks",
        "",
        "| rank | errors | warnings | info | first warning or error | could not check | "
        "step time (ms, median) | peak memory (GiB) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for row in evidence.rank_rows(run, series, merged):
        out.append(
            table_row(
                [
                    row["rank"],
                    row["error"],
                    row["warning"],
                    row["info"],
                    _number(row["first_finding_step"]),
                    row["could_not_check"],
                    _number(row["step_time_ms"], ".1f"),
                    _number(row["peak_memory_gib"], ".3g"),
                ]
            )
        )
    out.append("")
    failure = _failure_lines(run, "")
    if failure:
        out += ["## The run failed", "", *failure, ""]
    if merged:
        out += ["## Details", ""]
    for i, m in enumerate(merged):
        out += [f'### <a id="{anchor(i, m)}"></a>{m.headline}', "", f"{m.source}: {m.message}", ""]
        if m.evidence:
            out += [f"evidence: {evidence_text(m.evidence)}", ""]
        if m.hint:
            out += [f"hint: {m.hint}", ""]
        if len(run.ranks) > 1 or len(m.steps) > 1:
            out += [f"{ranks_text(m.ranks)}; steps {', '.join(map(str, m.steps[:20]))}", ""]
        if m.severity != "info":
            figure = evidence.finding_figure(m, series)
            out += [f"![{figure.alt}]({figure.uri})", "", f"*{figure.caption}*", ""]
    aside = _not_in_coverage(run)
    if aside:
        out += [
            "## Checks that did not run",
            "",
            "| check | ranks | why | what would let it run |",
            "| --- | --- | --- | --- |",
        ]
        for entry in aside:
            out.append(table_row([entry.check, ",".join(map(str, entry.ranks)), entry.reason, entry.setting or "-"]))
        out.append("")
    if run.missing:
        out += ["## Not in this run's files", "", *[f"- {what}" for what in run.missing], ""]
    folds = evidence.fold_figures(series)
    if folds:
        total = sum(len(figures) for _, figures in folds)
        out += [f"<details><summary>Every logged series, grouped by unit ({plural(total, 'chart')})</summary>", ""]
        for unit, figures in folds:
            out += [f"#### {unit}", ""]
            out += [f"![{f.alt}]({f.uri})" for f in figures]
            out.append("")
        out += ["</details>", ""]
    return "\n".join(out)


def _markdown_coverage(rows: Sequence[CoverageRow]) -> list[str]:
    if not rows:
        return [
            "## Coverage",
            "",
            "No Coverage rows: this run's members wrote none (an older version of the pack?).",
            "",
        ]
    out = ["## Coverage", "", coverage_summary(rows), "", "| | member | check | why |", "| --- | --- | --- | --- |"]
    out += [table_row([SYMBOLS[r.status], r.member, r.check, r.explanation() or "-"]) for r in rows]
    return [*out, ""]


def render_json(run: Run, fail_on: str = "error") -> str:
    merged = run.merged
    coverage = run.coverage
    data = {
        "log_dir": run.log_dir,
        "summary": counts(merged),
        "exit_status": exit_status(merged, fail_on, coverage),
        "fail_on": fail_on,
        "findings": [m.to_dict() for m in merged],
        "coverage": [row.to_dict() for row in coverage],
        "did_not_run": [entry.to_dict() for entry in run.did_not_run],
        "missing": run.missing,
        "pack": run.pack,
        "nan_reports": run.nan_reports,
        "other_runs": run.other_runs,
    }
    return json.dumps(data, indent=2, default=str) + "\n"
