import json

import pytest
import torch

from lightning_tfdebug import Finding, read_findings
from lightning_tfdebug.core.io import append_finding


def make(**kw):
    base = dict(code="TFD301", severity="warning", source="X", step=3, rank=0, message="m.")
    base.update(kw)
    return Finding(**base)


@pytest.mark.parametrize("code", ["TFD01", "TFD801", "XYZ301", "tfd301", "TFD3011"])
def test_bad_codes_are_rejected_with_the_expected_form(code):
    with pytest.raises(ValueError, match="must look like 'TFD301'"):
        make(code=code)


def test_bad_severity_is_rejected():
    with pytest.raises(ValueError, match="one of"):
        make(severity="fatal")


def test_findings_are_frozen():
    with pytest.raises(AttributeError):
        make().code = "TFD302"


def test_json_round_trip_makes_evidence_safe(tmp_path):
    f = make(evidence={"norm": torch.tensor(2.5), "bad": float("nan"), "groups": ("a", "b"), "t": torch.ones(2)})
    line = f.to_json()
    data = json.loads(line)
    assert data["evidence"] == {"norm": 2.5, "bad": "nan", "groups": ["a", "b"], "t": [1.0, 1.0]}
    path = tmp_path / "sub" / "findings-rank0.jsonl"
    append_finding(path, f)
    append_finding(path, make(code="TFD302"))
    back = read_findings(path)
    assert [b.code for b in back] == ["TFD301", "TFD302"]
    assert back[0].evidence["norm"] == 2.5


def test_format_names_code_source_step_and_hint():
    text = make(hint="lower the LR", evidence={"x": 1.23456789}).format()
    assert "[TFD301] WARNING from X at step 3 (rank 0)" in text
    assert "x=1.235" in text and "hint: lower the LR" in text
