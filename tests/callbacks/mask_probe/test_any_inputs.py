"""MaskProbe on transformers that read no token ids (float features, image patches, per-sequence outputs): the
recorded model call is replayed as it was (eval determinism) and with one row's inputs replaced (samples stay apart);
the token probes stand aside, saying what did run. Real Trainers on the tiny families of ``tests/kind_models.py``."""

from __future__ import annotations

import pytest

from lightning_tfdebug import MaskProbe
from tests.bug_models import kind_loader, kind_module
from tests.helpers import fit_tiny


@pytest.mark.parametrize("family", ["vit", "float_encoder"])
def test_a_forward_random_in_eval_mode_is_caught_without_token_ids(tmp_path, family):
    probe = MaskProbe()
    fit_tiny(tmp_path, [probe], model=kind_module(family, eval_dropout=0.1)(), data=kind_loader(family)(), max_steps=1)
    [random] = [f for f in probe.findings if f.code == "TFD213"]
    assert random.severity == "error" and "same inputs twice" in random.message
    assert random.evidence["max_change"] > random.evidence["tolerance"]
    [aside] = [f for f in probe.findings if f.code == "TFD211"]  # the token probes stand aside, saying what ran
    assert "no 2-D integer token ids" in aside.message and "eval determinism" in aside.message


@pytest.mark.parametrize("family", ["vit", "float_encoder", "set_max"])
def test_healthy_models_without_token_ids_pass_both_probes(tmp_path, family):
    probe = MaskProbe()
    fit_tiny(tmp_path, [probe], model=kind_module(family)(), data=kind_loader(family)(), max_steps=1)
    assert [f.code for f in probe.findings if f.severity != "info"] == []
    assert probe.coverage["eval determinism"][0] == "verified"
    assert probe.coverage["cross-sample"][0] == "verified"  # rows replaced by another row's: the others held
