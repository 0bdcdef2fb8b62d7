"""MaskProbe's probes of models that read no token ids, under 2-rank DDP (real gloo processes): the recorded model
call is replayed on every rank, every rank ends with the same findings and the same Coverage, and a healthy model
stays silent."""

from __future__ import annotations

import json
from typing import Any

import lightning.pytorch as pl
import pytest

from tests.helpers import run_distributed
from tests.kind_models import kind_data

pytestmark = [pytest.mark.ddp, pytest.mark.slow, pytest.mark.ci]


class KindData(pl.LightningDataModule):
    """A family's training data of ``tests/kind_models.py`` as a DataModule (for ``tests/scripts/dist_run.py``)."""

    def __init__(self, family: str, batch_size: int = 8) -> None:
        super().__init__()
        self.family, self.batch_size = family, batch_size

    def train_dataloader(self) -> Any:
        return kind_data(self.family, batch_size=self.batch_size)


def _spec(model_class: str, family: str, model: dict[str, Any]) -> dict[str, Any]:
    return {
        "strategy": "ddp",
        "model_class": f"tests.kind_models:{model_class}",
        "model": model,
        "data_class": f"{__name__}:KindData",
        "data": {"family": family},
        "callbacks": [{"class_path": "lightning_tfdebug.MaskProbe", "init_args": {}}],
        "trainer": {"max_steps": 2},
    }


def _coverage(tmp_path, rank: int) -> dict[str, str]:
    [path] = list(tmp_path.rglob(f"coverage-rank{rank}.jsonl"))
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    return {r["check"]: r["status"] for r in rows}


@pytest.mark.parametrize(
    "model_class, family, model, expected",
    [
        pytest.param("FloatTokenEncoder", "float_encoder", {"eval_dropout": 0.1}, {"TFD213"}, id="eval-random"),
        pytest.param("PatchViT", "vit", {}, set(), id="healthy-vit"),
    ],
)
def test_every_rank_probes_the_recorded_call_and_ends_with_the_same_findings(
    tmp_path, model_class, family, model, expected
):
    results = run_distributed(tmp_path, _spec(model_class, family, model))
    assert all(r["error"] is None for r in results), [r["error"] for r in results]
    said = [
        sorted((f["code"], f["severity"]) for f in r["findings"]["MaskProbe"] if f["severity"] != "info")
        for r in results
    ]
    assert said[0] == said[1]  # the ranks agree
    assert {code for code, _ in said[0]} == expected
    for rank in (0, 1):  # every rank probed the recorded call (a finding among a row's codes marks it in the report)
        coverage = _coverage(tmp_path, rank)
        assert coverage["eval determinism"] == coverage["cross-sample"] == "verified", coverage
