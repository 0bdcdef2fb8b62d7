"""The report a user reads at a glance (issue 48): a headline per finding, an evidence chart per warning or error, the
run on one page (the loss with the findings marked, Coverage, the ranks), one self-contained HTML file; Coverage rows
read and merged; older and cut files read as far as they go."""

from __future__ import annotations

import json
import re
from html.parser import HTMLParser
from pathlib import Path

import pytest

from lightning_tfdebug.__main__ import main
from lightning_tfdebug.findings import HEADLINE_LIMIT, Finding
from lightning_tfdebug.functional.evidence_chart import EvidenceChart
from lightning_tfdebug.report import load_run, render
from lightning_tfdebug.report.coverage import ASCII_SYMBOLS, merge_coverage, terminal_symbols
from lightning_tfdebug.report.svg import bar_chart, line_chart, missing_chart, nice_ticks
from lightning_tfdebug.rules import RULES, Rule, render_chart_table


# ---------------------------------------------------------------------------------------------- the parsed page
class Page(HTMLParser):
    """The structure a test reads back from a report: tags, external references, figures with their alt texts and
    captions, and the ids the headlines link to."""

    def __init__(self, text: str) -> None:
        super().__init__()
        self.tags: list[str] = []
        self.external: list[str] = []
        self.figures: list[dict[str, str]] = []
        self.ids: set[str] = set()
        self.links: list[str] = []
        self.stack: list[str] = []
        self._caption: list[str] | None = None
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        self.tags.append(tag)
        self.stack.append(tag)
        if "id" in a:
            self.ids.add(a["id"])
        if tag in ("script", "link", "iframe") or (tag == "img" and not a.get("src", "").startswith("data:")):
            self.external.append(f"{tag} {a}")
        if tag == "a" and a.get("href"):
            self.links.append(a["href"])
        if tag == "figure":
            self.figures.append({"class": a.get("class", ""), "alt": "", "caption": "", "src": ""})
        if tag == "img" and self.figures and self.stack.count("figure"):
            self.figures[-1].update(alt=a.get("alt", ""), src=a.get("src", ""))
        if tag == "figcaption":
            self._caption = []

    def handle_endtag(self, tag):
        if tag == "figcaption" and self._caption is not None:
            self.figures[-1]["caption"] = "".join(self._caption)
            self._caption = None
        if tag in self.stack:
            del self.stack[len(self.stack) - 1 - self.stack[::-1].index(tag)]

    def handle_data(self, data):
        if self._caption is not None:
            self._caption.append(data)


def evidence_figures(page: Page) -> list[dict[str, str]]:
    return [f for f in page.figures if f["class"] == "evidence"]


def check_page(text: str, merged) -> Page:
    """The page is one self-contained file with one evidence chart per warning or error, its code in caption and alt
    text, every headline linking to its details, and no empty chart."""
    page = Page(text)
    assert page.external == [], page.external  # no script, stylesheet, font or image from elsewhere
    assert "http://" not in text.replace("http://www.w3.org/2000/svg", "") and "https://" not in text
    flagged = [m for m in merged if m.severity != "info"]
    figures = evidence_figures(page)
    assert len(figures) == len(flagged)
    for m, figure in zip(flagged, figures):
        assert m.code in figure["caption"] and m.code in figure["alt"], figure
        assert len(m.headline) <= HEADLINE_LIMIT
    assert all(link[1:] in page.ids for link in page.links if link.startswith("#"))
    assert len([link for link in page.links if link.startswith("#")]) == len(merged)
    assert page.figures[0]["class"] == "overview"
    for figure in page.figures:
        assert figure["alt"] and figure["src"].startswith("data:image/svg+xml;base64,")
    return page


# ---------------------------------------------------------------------------------------------- headlines
def test_a_headline_is_the_rules_template_filled_the_first_that_fits_else_the_title():
    rule = Rule(
        "TFD301", "warning", "GradNormMonitor", title="explosion", trigger="t", hint="h", reason="r",
        message="m {grad_norm}", headline=("cap c = {cap:g}, floor {floor:.2f}", "floor {floor:.2f} nats"),
    )  # fmt: skip
    assert rule.verdict({"grad_norm": 1.0, "cap": 1.0, "floor": 2.9}).headline == "cap c = 1, floor 2.90"
    assert rule.verdict({"grad_norm": 1.0, "floor": 2.9}).headline == "floor 2.90 nats"
    assert rule.verdict({"grad_norm": 1.0, "floor": "nan"}).headline == "explosion"  # not a number: the title
    long = Rule("TFD301", "warning", "G", title="x" * 400, trigger="t", hint="h", reason="r")
    assert len(long.headline_for({})) == HEADLINE_LIMIT and long.headline_for({}).endswith("...")


def test_a_finding_stores_its_headline_with_where_and_how_bad_and_reads_it_back():
    found = Finding("TFD301", "warning", "GradNormMonitor", 12, 1, "m", {"grad_norm": 50.0, "factor": 12.5,
                    "running_median": 4.0}, headline="")  # fmt: skip
    line = "TFD301 warning step 12 rank 1: gradient norm explosion: 50, 12.5x the running median 4"
    assert found.headline == line and found.what == line.split(": ", 1)[1]
    data = json.loads(found.to_json())
    assert data["headline"] == line and Finding.from_dict(data) == found
    given = Finding("TFD301", "warning", "GradNormMonitor", 12, 1, "m", headline="said by the verdict")
    assert given.headline == "TFD301 warning step 12 rank 1: said by the verdict"
    older = {k: v for k, v in data.items() if k != "headline"}  # a line an older pack wrote
    assert Finding.from_dict(older).headline == line
    unknown = Finding("TFD799", "info", "Mine", 0, 0, "a message of a rule nobody registered " * 10)
    assert len(unknown.headline) == HEADLINE_LIMIT


def test_every_rule_with_a_chart_is_in_the_registrys_chart_table():
    table = render_chart_table()
    charted = [r for r in RULES.values() if r.chart is not None]
    assert len(charted) >= 25
    for r in charted:
        assert isinstance(r.chart, EvidenceChart) and f"| {r.code} |" in table and r.chart.question in table
    assert "none of its own: the training loss around its step" in table


# ---------------------------------------------------------------------------------------------- coverage
def coverage_record(member, check, status, rank, codes=(), reason=None, setting=None):
    return {"member": member, "check": check, "status": status, "reason": reason, "setting": setting,
            "codes": list(codes), "step": 3, "rank": rank}  # fmt: skip


def write_lines(path: Path, records: list[dict], cut: str = "") -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records) + cut)


def test_coverage_rows_merge_over_ranks_the_last_line_wins_and_a_finding_turns_a_row():
    records = [
        coverage_record("MaskProbe", "causal mask", "unknown", 0, ["TFD201"], reason="fused", setting="eager"),
        coverage_record("MaskProbe", "causal mask", "verified", 0, ["TFD201"]),  # the last line of rank 0 wins
        coverage_record("MaskProbe", "causal mask", "verified", 1, ["TFD201"]),
        coverage_record("MaskProbe", "padding", "verified", 0, ["TFD202"]),
        coverage_record("MaskProbe", "padding", "unknown", 1, ["TFD202"], reason="no mask", setting="`mask_key`"),
        coverage_record("OptimizerAudit", "eval determinism", "n/a", 0, reason="no validation loop"),
        coverage_record("OptimizerAudit", "eval determinism", "n/a", 1, reason="no validation loop"),
        coverage_record("LossAtInit", "loss = cross-entropy of the logits", "verified", 1, ["TFD233"]),
    ]
    rows = {r.check: r for r in merge_coverage(records, found_codes={"TFD233"})}
    assert rows["causal mask"].status == "verified" and rows["causal mask"].ranks == (0, 1)
    assert rows["padding"].status == "unknown" and rows["padding"].setting == "`mask_key`"
    assert rows["padding"].line() == "? MaskProbe: padding (could not check: no mask; to let it run: `mask_key`)"
    assert rows["eval determinism"].line() == "\u2013 OptimizerAudit: eval determinism (n/a: no validation loop)"
    assert rows["loss = cross-entropy of the logits"].status == "finding"
    assert rows["loss = cross-entropy of the logits"].line(ASCII_SYMBOLS).startswith("X LossAtInit")

    class Latin1:
        encoding = "latin-1"

    assert terminal_symbols(Latin1()) == ASCII_SYMBOLS  # a terminal that cannot print a check mark gets words


def test_coverage_is_read_up_to_a_cut_line_shown_in_every_form_and_fails_check_when_unverified(tmp_path, capsys):
    tfdebug = tmp_path / "version_0" / "tfdebug"
    write_lines(
        tfdebug / "coverage-rank0.jsonl",
        [coverage_record("MaskProbe", "causal mask", "verified", 0, ["TFD201"])],
        cut='{"member": "MaskProbe", "check": "padd',  # the process was killed mid-line
    )
    write_lines(tfdebug / "findings-rank0.jsonl", [])
    run = load_run(tmp_path)
    assert [(r.check, r.status) for r in run.coverage] == [("causal mask", "verified")]
    assert main(["report", str(tmp_path), "--fail-on", "unverified"]) == 0
    assert "coverage: 1 verified" in capsys.readouterr().out
    write_lines(
        tfdebug / "coverage-rank1.jsonl",
        [coverage_record("MaskProbe", "padding", "unknown", 1, ["TFD202"], reason="no mask", setting="`mask_key`")],
    )
    assert main(["report", str(tmp_path), "--fail-on", "unverified"]) == 1
    assert main(["report", str(tmp_path)]) == 0  # the default (error) does not fail on a row it could not check
    text = capsys.readouterr().out
    assert "coverage: 1 verified, 1 could not check" in text and "to let it run: `mask_key`" in text
    assert main(["report", str(tmp_path), "--format", "markdown"]) == 0
    markdown = capsys.readouterr().out
    assert "| ? | MaskProbe | padding | no mask; to let it run: `mask_key` |" in markdown
    assert main(["report", str(tmp_path), "--format", "json", "--fail-on", "unverified"]) == 1
    data = json.loads(capsys.readouterr().out)
    assert [row["status"] for row in data["coverage"]] == ["verified", "unknown"] and data["exit_status"] == 1
    page = Page(render(load_run(tmp_path), "html"))
    assert "table" in page.tags and page.external == []


# ---------------------------------------------------------------------------------------------- bad input
def test_an_older_log_dir_is_read_as_far_as_it_goes_and_says_what_is_missing(tmp_path, capsys):
    tfdebug = tmp_path / "version_0" / "tfdebug"
    old = {"code": "TFD301", "severity": "warning", "source": "GradNormMonitor", "step": 7, "rank": 0,
           "message": "The gradient norm rose.", "evidence": {"grad_norm": 80.0, "factor": 20.0,
           "running_median": 4.0}, "hint": "Lower the LR."}  # fmt: skip
    write_lines(tfdebug / "findings-rank0.jsonl", [old], cut='{"code": "TFD3')
    with pytest.warns(UserWarning, match="cut off"):
        run = load_run(tmp_path)
    [m] = run.merged
    assert m.headline == "TFD301 warning step 7 rank 0: gradient norm explosion: 80, 20.0x the running median 4"
    assert any(w.startswith("pack.json") for w in run.missing)
    assert any(w.startswith("coverage-rank<r>.jsonl") for w in run.missing)
    assert any("`headline` field in findings-rank0.jsonl" in w for w in run.missing)
    with pytest.warns(UserWarning):
        assert main(["report", str(tmp_path), "--verbose"]) == 0
    text = capsys.readouterr().out
    assert "not in this run's files: pack.json" in text and "hint: Lower the LR." in text
    with pytest.warns(UserWarning):
        page_text = render(load_run(tmp_path), "html")
    page = check_page(page_text, run.merged)
    # no series were logged (no TensorBoard files): the charts say what is missing instead of drawing empty axes
    [figure] = evidence_figures(page)
    assert "not drawn: the logged series `grad_norm/total`" in figure["caption"]
    assert "<polyline" not in page_text and "Not drawn" in decoded(page_text)


def decoded(text: str) -> str:
    import base64

    return "".join(base64.b64decode(b).decode() for b in re.findall(r"base64,([A-Za-z0-9+/=]+)", text))


# ---------------------------------------------------------------------------------------------- drawing
def test_the_svg_charts_have_one_unit_a_title_an_alt_text_and_say_what_is_missing():
    assert nice_ticks(0.3, 7.9) == [2, 4, 6] and nice_ticks(5.0, 5.0) == [5.0]
    chart = line_chart("Q?", "nats", {"a": [(0, 3.0), (5, float("nan")), (9, 2.0)]}, alt="TFD233 alt",
                       marks=[(4, "TFD233")], lines=[(2.5, "floor 2.5")])  # fmt: skip
    assert chart.count("<title>TFD233 alt</title>") == 1 and ">nats<" in chart and ">Q?<" in chart
    assert "floor 2.5" in chart and ">TFD233<" in chart
    empty = line_chart("Q?", "nats", {"a": [(0, float("nan"))]}, alt="alt")
    assert "<polyline" not in empty and "no finite value" in empty
    bars = bar_chart("B?", "GiB", [("weights", 1.0), ("held", 3.0)], alt="bars")
    assert bars.count("<rect") >= 3 and ">weights<" in bars
    gone = missing_chart("M?", "not logged: x", "alt")
    assert "not logged: x" in gone and "<line" not in gone


# ---------------------------------------------------------------------------------------------- the bug matrix
REPORTED = [(7, "encoder_lm"), (15, "encoder_lm"), (19, "encoder_lm"), (22, "encoder_lm"), (26, "encoder_lm"),
            (9, "gpt2"), (12, "gpt2"), (13, "tinygpt"), (41, "tinygpt"), (47, "tinygpt"), (36, "t5"), (36, "bart"),
            (29, "llama")]  # fmt: skip
"""One or two rows of every family of the bug matrix, whose warnings and errors the report must show."""


@pytest.mark.slow
@pytest.mark.parametrize("row, family", REPORTED, ids=[f"row{r}-{f}" for r, f in REPORTED])
def test_every_warning_and_error_of_a_bug_matrix_run_has_a_headline_and_its_chart(tmp_path, row, family):
    pytest.importorskip("transformers")
    from tests.test_bug_matrix import CASES, run_case

    run_case(tmp_path, CASES[row, family])
    run = load_run(tmp_path / "tb" / "version_0")
    flagged = [m for m in run.merged if m.severity != "info"]
    assert flagged, f"row {row} on {family}: no warning or error to report"
    for m in flagged:  # a rule with a headline template fills it from the finding (not the title, its fallback)
        assert not RULES[m.code].headline or m.what != " ".join(RULES[m.code].title.split()), m.headline
    page_text = render(run, "html")
    page = check_page(page_text, run.merged)
    # a rule's own chart, drawn from the run (the loss around the step for a rule without one)
    drawn = [f for f in evidence_figures(page) if "not drawn" not in f["caption"]]
    assert drawn, [f["caption"] for f in evidence_figures(page)]
    markdown = render(run, "markdown")
    assert all(f"- [{m.headline}](#" in markdown for m in run.merged)
    assert markdown.count("![") == 1 + len(flagged) + sum(len(f) for _, f in _folds(run))


def _folds(run):
    from lightning_tfdebug.report.evidence import fold_figures
    from lightning_tfdebug.report.run import read_series

    return fold_figures(read_series(run.log_dir))


def test_a_chart_from_the_evidence_alone_needs_no_logged_series(tmp_path):
    """A stall: each rank's last step as a bar, labelled with its phase; no TensorBoard file is needed."""
    ranks = {"0": {"step": 3, "phase": "backward", "where": "x"}, "1": {"step": 2, "phase": "training step"}}
    stall = Finding("TFD520", "error", "StallWatchdog", 3, 0, "No progress.",
                    {"rank": 0, "step": 3, "phase": "backward", "idle_s": 2.4, "ranks": ranks})  # fmt: skip
    write_lines(tmp_path / "version_0" / "tfdebug" / "findings-rank0.jsonl", [stall.to_dict()])
    run = load_run(tmp_path)
    assert run.merged[0].headline == "TFD520 error step 3 rank 0: no progress for 2.4 s on rank 0 at step 3 (backward)"
    text = render(run, "html")
    [figure] = evidence_figures(check_page(text, run.merged))
    assert "not drawn" not in figure["caption"] and "TFD520" in figure["alt"]
    svg = decoded(text)
    assert ">0 (backward)<" in svg and ">1 (training step)<" in svg


def test_the_end_of_fit_summary_prints_headlines_the_open_coverage_rows_and_where_the_report_is(tmp_path):
    from lightning_tfdebug.report import render_short

    tfdebug = tmp_path / "version_0" / "tfdebug"
    found = Finding("TFD312", "error", "UpdateRatio", 4, 0, "Group(s) head received gradients but did not change.",
                    {"groups": ["head"]}, headline="groups got gradients but did not change: head")  # fmt: skip
    write_lines(tfdebug / "findings-rank0.jsonl", [found.to_dict()])
    write_lines(tfdebug / "coverage-rank0.jsonl", [
        coverage_record("UpdateRatio", "optimizer covers the parameters", "verified", 0, ["TFD312"]),
        coverage_record("MaskProbe", "causal mask", "verified", 0, ["TFD201"]),
        coverage_record("MaskProbe", "padding", "unknown", 0, ["TFD202"], reason="no mask", setting="`mask_key`"),
    ])  # fmt: skip
    lines = render_short(load_run(tmp_path), symbols=ASCII_SYMBOLS).splitlines()
    assert lines[1] == "  TFD312 error step 4 rank 0: groups got gradients but did not change: head"
    assert lines[2:5] == [
        "  coverage: 1 verified, 1 finding, 1 could not check",
        "    X UpdateRatio: optimizer covers the parameters (finding TFD312)",
        "    ? MaskProbe: padding (could not check: no mask; to let it run: `mask_key`)",
    ]
    assert lines[-1].startswith(f"  full report: tfdebug report {tmp_path / 'version_0'}")
    assert "Group(s) head" not in "\n".join(lines)  # the message: in the full report
