"""The rule registry is the one source of every finding code: the docs are generated from it, callbacks emit only
registered codes, and a finding takes its severity and hint from its rule unless the callback says more."""

from __future__ import annotations

import ast
import re
import runpy
from pathlib import Path

import pytest

import lightning_tfdebug
from lightning_tfdebug import DebugCallback
from lightning_tfdebug.functional.verdicts import Verdict
from lightning_tfdebug.rules import (
    AREAS,
    BLOCKS,
    BUILTIN_CODES,
    RULES,
    Rule,
    register_rule,
    render_rule_table,
    rule,
    rules_of,
)
from tests.core.emitters import StepEmitter
from tests.helpers import fit_tiny

ROOT = Path(__file__).resolve().parents[1]
gen_rule_docs = runpy.run_path(str(ROOT / "scripts" / "gen_rule_docs.py"))


def test_the_docs_tables_are_generated_from_the_registry():
    assert gen_rule_docs["main"](["--check"]) == 0, "run python scripts/gen_rule_docs.py"


def test_the_check_fails_when_a_table_drifts(tmp_path):
    text = (ROOT / "docs" / "findings.md").read_text()
    drifted = text.replace("| TFD312 | error |", "| TFD312 | warning |")
    assert drifted != text
    assert gen_rule_docs["render"](drifted) == text


def test_every_code_of_the_findings_page_is_registered_and_back():
    text = (ROOT / "docs" / "findings.md").read_text()
    documented = re.findall(r"^\| (TFD\d{3}) \|", text, re.M)
    assert len(documented) == len(set(documented)), "a code has two rows"
    assert set(documented) == set(BUILTIN_CODES)
    regions = gen_rule_docs["regions"](text)
    assert {source for source, detail in regions if detail} == {source for source, _, _ in BLOCKS}


@pytest.mark.parametrize("source", [b[0] for b in BLOCKS])
def test_each_callback_page_lists_exactly_its_rules(source):
    page = gen_rule_docs["page_of"](source)
    text = page.read_text()
    assert (source, False) in gen_rule_docs["regions"](text), f"{page.name} has no generated findings table"
    section = text.split(f"<!-- rules:{source} -->", 1)[1].split("<!-- /rules -->", 1)[0]
    assert set(re.findall(r"^\| (TFD\d{3}) \|", section, re.M)) == {r.code for r in rules_of(source)}


def test_every_rule_sits_in_its_callbacks_block_and_area():
    blocks = {source: (int(first[3:]), int(last[3:])) for source, first, last in BLOCKS}
    areas = {a[0][0] for a in AREAS}
    for code in BUILTIN_CODES:
        r = RULES[code]
        assert isinstance(getattr(lightning_tfdebug, r.source), type), f"{code}: {r.source} is not a callback"
        assert issubclass(getattr(lightning_tfdebug, r.source), DebugCallback)
        low, high = blocks[r.source]
        assert low <= int(code[3:]) <= high, f"{code} is outside {r.source}'s block {low}-{high}"
        assert code[3] in areas


def _literal_codes(tree: ast.AST) -> set[str]:
    """The codes a module names, outside a rule module's ``BLOCK`` (the range it reserves)."""
    reserved = {
        id(c)
        for n in ast.walk(tree)
        if isinstance(n, ast.Assign) and any(getattr(t, "id", None) == "BLOCK" for t in n.targets)
        for c in ast.walk(n.value)
    }
    return {
        n.value
        for n in ast.walk(tree)
        if isinstance(n, ast.Constant)
        and isinstance(n.value, str)
        and re.fullmatch(r"TFD[1-7]\d\d", n.value)
        and id(n) not in reserved
    }


def test_every_code_named_in_the_package_is_registered():
    """Codes appear in callbacks and in the functional decisions they call (Verdicts); every one is registered.
    That a callback emits only its own codes is enforced by emit itself (see the test below)."""
    for path in sorted((ROOT / "lightning_tfdebug").rglob("*.py")):
        if path.name == "rules.py":
            continue
        for code in _literal_codes(ast.parse(path.read_text())):
            assert code in RULES, f"{path.relative_to(ROOT)} names {code}, which is not registered"
    for source, _, _ in BLOCKS:  # and every callback can emit something
        assert rules_of(source), source


def test_a_finding_takes_severity_and_hint_from_its_rule(tmp_path):
    emitter = StepEmitter(at_step=2, severity="warning")
    fit_tiny(tmp_path, [emitter], max_steps=4)
    [finding] = emitter.findings
    assert finding.hint == RULES["TFD399"].hint == "none"
    assert finding.severity == "warning"


def test_an_unregistered_code_or_a_code_of_another_callback_is_refused(tmp_path):
    class Stray(DebugCallback):
        def __init__(self, code: str) -> None:
            super().__init__()
            self.code = code

        def on_train_batch_end(self, trainer, *args) -> None:
            self.emit(trainer, Verdict(self.code, "never"))

    # A bug in a callback's own code: the guard reports it once (with the traceback) and the callback stands aside.
    unregistered, foreign = Stray("TFD397"), Stray("TFD312")
    fit_tiny(tmp_path / "a", [unregistered], max_steps=1)
    fit_tiny(tmp_path / "b", [foreign], max_steps=1)
    assert re.search(r"KeyError: .*TFD397.*not in lightning_tfdebug\.rules\.RULES", unregistered.failure["error"])
    assert foreign.failure["error"] == "ValueError: Stray emitted TFD312, which belongs to UpdateRatio."
    assert not unregistered.active and not foreign.active


def test_register_rule_refuses_a_different_rule_under_a_taken_code():
    same = RULES["TFD312"]
    assert register_rule(same) is same
    with pytest.raises(ValueError, match="TFD312 is already registered by UpdateRatio"):
        register_rule(Rule("TFD312", "info", "Mine", title="t", trigger="t", hint="h", reason="r"))
    with pytest.raises(TypeError):
        register_rule({"code": "TFD396"})
    with pytest.raises(ValueError, match="must look like 'TFD301'"):
        Rule("TFD999", "info", "Mine", title="t", trigger="t", hint="h", reason="r")
    with pytest.raises(ValueError, match="severity must be one of"):
        Rule("TFD396", "fatal", "Mine", title="t", trigger="t", hint="h", reason="r")
    with pytest.raises(KeyError):
        rule("TFD396")


def test_every_rule_names_the_reason_for_its_severity_and_the_findings_page_shows_it():
    # the severity policy (docs/severity.md): every registry entry says why it has its severity
    assert [code for code in BUILTIN_CODES if len(RULES[code].reason.strip()) < 20] == []
    with pytest.raises(ValueError, match="`reason` must not be empty"):
        Rule("TFD396", "info", "Mine", title="t", trigger="t", hint="h")
    findings = (ROOT / "docs" / "findings.md").read_text()
    assert "why this severity" in findings and "(severity.md)" in findings
    for code in ("TFD324", "TFD709", "TFD310"):
        row = next(line for line in findings.splitlines() if line.startswith(f"| {code} |"))
        assert row.rstrip(" |").endswith(RULES[code].reason.replace("|", "\\|").rstrip(" |")), code


def test_the_severities_the_policy_set():
    # info unless the run measures harm (escalated by the callbacks with their evidence)
    assert {c: RULES[c].severity for c in ("TFD324", "TFD326", "TFD402", "TFD604", "TFD709")} == dict.fromkeys(
        ("TFD324", "TFD326", "TFD402", "TFD604", "TFD709"), "info"
    )


def test_a_rules_details_are_rendered_under_its_callbacks_detailed_table():
    detailed = [r for r in rules_of("GradNormMonitor") if r.details]
    assert detailed, "GradNormMonitor's rules carry their thresholds in `details`"
    table = render_rule_table("GradNormMonitor", detail=True)
    for r in detailed:
        assert f"- **{r.code}**: {' '.join(r.details.split())}" in table
    assert "**TFD301**" not in render_rule_table("GradNormMonitor", detail=False), "the short table stays short"
    text = (ROOT / "docs" / "findings.md").read_text()
    assert "`explosion_factor` (default 10)" in text.split("<!-- rules:GradNormMonitor:detail -->", 1)[1]
