"""The run report (``tfdebug report`` and the summary ``TFDebug`` prints at the end of ``fit``): every rank's and
every callback's findings and Coverage rows, read by :func:`load_run`, merged (:func:`merge_findings`,
:mod:`~lightning_tfdebug.report.coverage`) and rendered by :func:`render` as text (a headline per finding), markdown,
json or one self-contained HTML file (the run on one page, an evidence chart per warning or error, every series by
unit).

Modules: :mod:`.run` (reading and merging), :mod:`.coverage`, :mod:`.text` (text, the end-of-fit summary, markdown,
json), :mod:`.page` (HTML), :mod:`.evidence` (which charts), :mod:`.svg` (drawing them)."""

from __future__ import annotations

from lightning_tfdebug.report.coverage import CoverageRow, merge_coverage, read_coverage
from lightning_tfdebug.report.run import (
    FAIL_ON,
    FORMATS,
    SHORT_INFO_LINES,
    MergedFinding,
    Run,
    StoodAside,
    counts,
    exit_status,
    load_run,
    merge_findings,
    merge_stood_aside,
    read_series,
    read_stood_aside,
    series_of,
    summary_line,
)
from lightning_tfdebug.report.text import log_headlines, render_json, render_markdown, render_short, render_text

__all__ = [
    "FAIL_ON",
    "FORMATS",
    "SHORT_INFO_LINES",
    "CoverageRow",
    "MergedFinding",
    "Run",
    "StoodAside",
    "counts",
    "exit_status",
    "load_run",
    "log_headlines",
    "merge_coverage",
    "merge_findings",
    "merge_stood_aside",
    "read_coverage",
    "read_series",
    "read_stood_aside",
    "render",
    "render_html",
    "render_json",
    "render_markdown",
    "render_short",
    "render_text",
    "series_of",
    "summary_line",
]


def render_html(run: Run) -> str:
    """The report of ``run`` as one self-contained HTML page (:mod:`.page`)."""
    from lightning_tfdebug.report.page import render_html as page

    return page(run)


def render(run: Run, fmt: str = "text", fail_on: str = "error", verbose: bool = False) -> str:
    """The report of ``run`` in ``fmt`` (one of :data:`FORMATS`); ``verbose``: text with every finding's message,
    evidence and hint (markdown and HTML always carry them)."""
    if fmt not in FORMATS:
        raise ValueError(f"`format` must be one of {', '.join(FORMATS)}; got {fmt!r}.")
    if fmt == "json":
        return render_json(run, fail_on)
    if fmt == "text":
        return render_text(run, verbose)
    return {"markdown": render_markdown, "html": render_html}[fmt](run)
