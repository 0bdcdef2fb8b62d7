"""The contract of every member (tests/test_contract.py), held by MaskProbe's probes of models that read no token ids:
the same findings alone and in the pack, a resumed run decides again, and the callback deep-copies and pickles after
such a fit. Real Trainers on the tiny families of ``tests/kind_models.py``."""

from __future__ import annotations

import copy
import pickle

import pytest
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_tfdebug import MaskProbe, TFDebug
from tests.bug_models import kind_loader, kind_module
from tests.helpers import fit_tiny


def _said(findings) -> list[tuple[str, str, int | None]]:
    return sorted((f.code, f.severity, f.step) for f in findings if f.source == "MaskProbe")


@pytest.mark.parametrize(
    "family, bugs, steps, code",
    [
        pytest.param("vit", {"eval_dropout": 0.1}, 2, "TFD213", id="eval-random-vit"),
        pytest.param("float_encoder", {"positions": False}, 25, "TFD215", id="order-blind-float-features"),
    ],
)
def test_the_same_findings_alone_and_in_the_pack(tmp_path, family, bugs, steps, code):
    alone, pack = MaskProbe(), TFDebug()
    for where, callback in (("alone", alone), ("pack", pack)):
        model, data = kind_module(family, **bugs)(), kind_loader(family)()
        fit_tiny(tmp_path / where, [callback], model=model, data=data, max_steps=steps)
    said = _said(alone.findings)
    assert code in {c for c, _, _ in said} and said == _said(pack.findings)
    # the fitted callback deep-copies and pickles (its order watch included)
    assert _said(copy.deepcopy(alone).findings) == said
    assert _said(pickle.loads(pickle.dumps(alone)).findings) == said


def test_a_resumed_run_probes_the_recorded_call_again_and_decides(tmp_path):
    """A fit of 10 steps decides at its last step (9) and saves; the resumed fit probes its first batch again and
    decides again at its own last step: the finding, said before the checkpoint, is not said twice, and the row says
    the check ran."""
    family, bugs = "float_encoder", {"positions": False}
    saver = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=10, save_last=True)
    first = MaskProbe()
    fit_tiny(
        tmp_path / "first",
        [first, saver],
        model=kind_module(family, **bugs)(),
        data=kind_loader(family)(),
        max_steps=10,
        enable_checkpointing=True,
    )
    assert [(f.code, f.step) for f in first.findings if f.code in ("TFD215", "TFD218")] == [("TFD215", 9)]
    resumed = MaskProbe()
    fit_tiny(
        tmp_path / "resumed",
        [resumed],
        model=kind_module(family, **bugs)(),
        data=kind_loader(family)(),
        max_steps=35,
        ckpt_path=str(tmp_path / "ckpt" / "last.ckpt"),
    )
    assert resumed.order_watch.done and resumed.order_watch.decide_at == 34  # decided again at its own last step
    assert [f.code for f in resumed.findings if f.code in ("TFD215", "TFD218")] == []  # said once, before the save
    assert resumed.coverage["positions and order"][0] == "verified"  # probed on resume: the check ran
    assert resumed.coverage["eval determinism"][0] == "verified"
