import pytest

from lightning_tfdebug.functional.verdicts import Rule, Verdict


def rule(**overrides) -> Rule:
    fields = dict(
        code="TFD301",
        severity="warning",
        source="GradNormMonitor",
        title="norm spike",
        trigger="the norm rose",
        hint="lower the LR",
        reason="a spike precedes divergence",
        message="the norm rose {factor:.1f}x at {where}",
    )
    return Rule(**{**fields, **overrides})


def test_a_verdict_fills_the_template_from_evidence_and_text_and_keeps_only_the_evidence():
    verdict = rule().verdict({"factor": 12.04}, where="blocks.0", key="blocks.0", step=7)
    said = "the norm rose 12.0x at blocks.0"
    assert verdict == Verdict(
        "TFD301", said, {"factor": 12.04}, hint=None, severity=None, key="blocks.0", step=7, headline="norm spike"
    )  # the rule has no headline template: the headline is its title
    headlined = rule(headline="rose {factor:.1f}x at {where}")
    assert headlined.verdict({"factor": 12.04}, where="b").headline == "rose 12.0x at b"


def test_a_decision_may_escalate_the_severity_and_give_its_own_hint_and_message():
    verdict = rule().verdict({"factor": 3}, severity="error", hint="stop", message="custom")
    assert (verdict.severity, verdict.hint, verdict.message) == ("error", "stop", "custom")
    with pytest.raises(ValueError, match="severity must be one of"):
        rule().verdict({"factor": 3}, where="x", severity="fatal")


def test_a_template_field_missing_from_the_evidence_is_a_clear_error_not_a_key_error():
    with pytest.raises(ValueError, match=r"TFD301: its message template needs 'where'"):
        rule().verdict({"factor": 2.0})
    with pytest.raises(ValueError, match="has no message template; pass `message`"):
        rule(message="").verdict({})
    assert rule(message="").verdict({}, message="said").message == "said"


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [
        ("code", "TFD1", "TFD"),
        ("severity", "fatal", "severity must be one of"),
        ("source", " ", "`source` must not be empty"),
        ("hint", "", "`hint` must not be empty"),
        ("reason", "", "`reason` must not be empty"),
    ],
)
def test_a_rule_with_a_bad_field_is_refused_at_declaration(field, value, match):
    with pytest.raises(ValueError, match=match):
        rule(**{field: value})
