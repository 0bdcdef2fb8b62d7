"""The run's Coverage rows, as members record them (``DebugCallback.cover`` -> ``coverage-rank<r>.jsonl``): every
member of the pack answers its rows on a real fit, verified, not applicable or not checked with the reason."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lightning_tfdebug import MaskProbe, TFDebug
from lightning_tfdebug.core.base import COVERAGE_FILE
from tests.helpers import fit_tiny


def coverage(log_dir) -> dict[tuple[str, str], dict]:
    """The last record per (member, check) of rank 0."""
    rows: dict[tuple[str, str], dict] = {}
    for line in (log_dir / "tfdebug" / COVERAGE_FILE.format(rank=0)).read_text().splitlines():
        record = json.loads(line)
        rows[record["member"], record["check"]] = record
    return rows


def test_every_member_answers_every_row_it_declares(tmp_path):
    pack = TFDebug(summary=False)
    trainer = fit_tiny(tmp_path, [pack], max_steps=3)
    rows = coverage(Path(trainer.log_dir))
    declared = {(name, check) for name, member in pack.members.items() for check in type(member).COVERAGE}
    assert declared and set(rows) == declared  # every row of every member, once the fit ended
    assert all(r["status"] in ("verified", "n/a", "unknown") for r in rows.values())
    assert all(r["codes"] == list(type(pack.members[r["member"]]).COVERAGE[r["check"]]) for r in rows.values())
    status = {key: r["status"] for key, r in rows.items()}
    assert status["MaskProbe", "causal mask"] == "verified"  # probed on the real call at step 0
    assert status["MaskProbe", "eval determinism"] == "verified"
    assert status["LossAtInit", "loss at init"] == "verified"
    assert status["GradNormMonitor", "gradient norms"] == "verified"  # watched the whole fit
    assert (
        status["ScalerWatch", "fp16 loss scale"] == "n/a"
        and "GradScaler" in rows["ScalerWatch", "fp16 loss scale"]["reason"]
    )
    assert status["PerRankLogger", "ranks agree"] == "n/a"
    # too short for the stall check, and nothing saved: said, with what would let each run
    stall = rows["LossAtInit", "loss leaves the uniform level"]
    assert stall["status"] == "unknown" and "ended at step 3" in stall["reason"] and stall["setting"]
    saved = rows["CheckpointAudit", "checkpoint resumable"]
    assert saved["status"] == "unknown" and "no checkpoint" in saved["reason"]


def test_cover_refuses_rows_and_statuses_it_does_not_know():
    probe = MaskProbe()
    with pytest.raises(ValueError, match="declares no Coverage row 'nonsense'"):
        probe.cover("nonsense", "verified")
    with pytest.raises(ValueError, match="`status` must be one of"):
        probe.cover("causal mask", "passed")
