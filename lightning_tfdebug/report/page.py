"""The report as one self-contained HTML file: no script, no font, no network; every chart an SVG embedded in the
page. At the top, the run on one page (the training loss with every warning and error marked, the headlines linking
to their details, Coverage, the ranks); then each finding (its headline, its evidence chart, its message, evidence and
hint behind a fold); then every logged series, grouped by unit, behind one fold."""

from __future__ import annotations

import html
import os
from collections.abc import Sequence

from lightning_tfdebug.report import evidence
from lightning_tfdebug.report.coverage import SYMBOLS, WORDS, CoverageRow, coverage_summary
from lightning_tfdebug.report.evidence import Figure
from lightning_tfdebug.report.run import Run, evidence_text, plural, ranks_text, read_series, summary_line
from lightning_tfdebug.report.text import _aside_line, _failure_lines, _not_in_coverage, _number, anchor, header

_CSS = """
body{font-family:system-ui,sans-serif;max-width:1100px;margin:2em auto;color:#222;padding:0 1em}
table{border-collapse:collapse;width:100%;font-size:0.9em}
td,th{border:1px solid #ccc;padding:4px 6px;vertical-align:top;text-align:left}
.error{background:#fde2e2}.warning{background:#fff4d6}.info{background:#eef4fb}
.finding{background:#fde2e2}.unknown{background:#fff4d6}.verified{background:#eaf7ea}.na{color:#666}
ul.headlines{font-family:ui-monospace,monospace;font-size:0.85em;padding-left:1.2em}
section.finding{border-left:4px solid #ccc;padding-left:10px;margin:1.4em 0}
section.error{border-color:#d62728;background:none}section.warning{border-color:#e6a000;background:none}
section.info{border-color:#1f77b4;background:none}
figure{margin:0.6em 0}figcaption{font-size:0.85em;color:#444}img{max-width:100%}
pre{background:#f6f6f6;padding:8px;overflow-x:auto;font-size:0.8em}h2{margin-top:1.6em}
"""


def _figure(figure: Figure, cls: str = "") -> str:
    esc = html.escape
    kind = f" class='{cls}'" if cls else ""
    return (
        f"<figure{kind}><img alt='{esc(figure.alt, quote=True)}' src='{figure.uri}'>"
        f"<figcaption>{esc(figure.caption)}</figcaption></figure>"
    )


def render_html(run: Run) -> str:
    merged = run.merged
    esc = html.escape
    series = read_series(run.log_dir)
    parts = [
        "<!doctype html><html lang='en'><head><meta charset='utf-8'><title>lightning_tfdebug report</title>",
        f"<style>{_CSS}</style></head><body>",
        "<h1>lightning_tfdebug report</h1>",
        f"<p>{esc(header(run))}</p><p><b>{esc(summary_line(run, merged))}</b></p>",
        "<section id='overview'>",
        _figure(evidence.overview_figure(run, series, merged), "overview"),
    ]
    if merged:
        parts.append("<h2>Findings</h2><ul class='headlines'>")
        parts += [
            f"<li class='{m.severity}'><a href='#{anchor(i, m)}'>{esc(m.headline)}</a></li>"
            for i, m in enumerate(merged)
        ]
        parts.append("</ul>")
    parts += _coverage(run.coverage)
    parts += _ranks(run, series)
    parts.append("</section>")
    failure = _failure_lines(run, "")
    if failure:
        parts.append("<h2>The run failed</h2>" + "".join(f"<p>{esc(line)}</p>" for line in failure))
    if merged:
        parts.append("<h2>Details</h2>")
    for i, m in enumerate(merged):
        parts.append(f"<section class='finding {m.severity}' id='{anchor(i, m)}'><h3>{esc(m.headline)}</h3>")
        if m.severity != "info":
            parts.append(_figure(evidence.finding_figure(m, series), "evidence"))
        body = [f"<p><b>{esc(m.source)}</b>: {esc(m.message)}</p>"]
        if m.evidence:
            body.append(f"<p><small>evidence: {esc(evidence_text(m.evidence))}</small></p>")
        if m.hint:
            body.append(f"<p><small>hint: {esc(m.hint)}</small></p>")
        body.append(f"<p><small>{esc(ranks_text(m.ranks))}; steps {esc(', '.join(map(str, m.steps[:20])))}</small></p>")
        parts.append(f"<details><summary>message, evidence and hint</summary>{''.join(body)}</details></section>")
    aside = _not_in_coverage(run)
    if aside:
        parts.append("<h2>Checks that did not run</h2><ul>")
        parts += [f"<li>{esc(_aside_line(entry, run))}</li>" for entry in aside]
        parts.append("</ul>")
    if run.missing:
        parts.append("<h2>Not in this run's files</h2><ul>")
        parts += [f"<li>{esc(what)}</li>" for what in run.missing]
        parts.append("</ul>")
    for path in run.nan_reports:
        try:
            with open(path, encoding="utf-8", errors="replace") as f:
                text = f.read()
        except OSError as err:
            text = f"(could not read: {err})"
        parts.append(f"<h2>NaN frames: {esc(os.path.basename(path))}</h2><pre>{esc(text)}</pre>")
    parts += _fold(series)
    parts.append("</body></html>")
    return "\n".join(parts) + "\n"


def _coverage(rows: Sequence[CoverageRow]) -> list[str]:
    esc = html.escape
    if not rows:
        return [
            "<h2>Coverage</h2><p>No Coverage rows: this run's members wrote none (an older version of the pack?).</p>"
        ]
    out = [
        f"<h2>Coverage</h2><p>{esc(coverage_summary(rows))}</p>",
        "<table class='coverage'><tr><th></th><th>member</th><th>check</th><th>status</th><th>why</th></tr>",
    ]
    for r in rows:
        cls = "na" if r.status == "n/a" else r.status
        out.append(
            f"<tr class='{cls}'><td>{SYMBOLS[r.status]}</td><td>{esc(r.member)}</td><td>{esc(r.check)}</td>"
            f"<td>{WORDS[r.status]}</td><td>{esc(r.explanation())}</td></tr>"
        )
    return [*out, "</table>"]


def _ranks(run: Run, series: evidence.Series) -> list[str]:
    out = [
        "<h2>Ranks</h2><table class='ranks'><tr><th>rank</th><th>errors</th><th>warnings</th><th>info</th>"
        "<th>first warning or error</th><th>could not check</th><th>step time (ms, median)</th>"
        "<th>peak memory (GiB)</th></tr>"
    ]
    for row in evidence.rank_rows(run, series, run.merged):
        cells = [
            row["rank"],
            row["error"],
            row["warning"],
            row["info"],
            _number(row["first_finding_step"]),
            row["could_not_check"],
            _number(row["step_time_ms"], ".1f"),
            _number(row["peak_memory_gib"], ".3g"),
        ]
        out.append("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in cells) + "</tr>")
    return [*out, "</table>"]


def _fold(series: evidence.Series) -> list[str]:
    folds = evidence.fold_figures(series)
    if not folds:
        return ["<p>No logged series found next to the findings (a TensorBoardLogger writes them).</p>"]
    total = sum(len(figures) for _, figures in folds)
    out = [f"<details id='series'><summary>Every logged series, grouped by unit ({plural(total, 'chart')})</summary>"]
    for unit, figures in folds:
        out.append(f"<h3>{html.escape(unit)}</h3>")
        out += [_figure(f, "series") for f in figures]
    return [*out, "</details>"]
