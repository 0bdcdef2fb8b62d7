import math

import pytest

from lightning_tfdebug.functional.optimizer_checks import decay_shrinkage, decayed_norms_shrink


def test_decay_shrinkage_is_what_decoupled_decay_alone_takes():
    assert decay_shrinkage(0.0) == 0.0
    assert decay_shrinkage(math.log(2)) == pytest.approx(0.5)
    assert decay_shrinkage(-1.0) == 0.0


def test_a_fall_the_decay_accounts_for_is_a_warning():
    # TinyGPT, AdamW(model.parameters(), weight_decay=1.0) at lr 3e-3 after 120 steps: the norm fell 22.6%, the decay
    # alone takes 29%
    verdict = decayed_norms_shrink((0, 10.0), (120, 7.74), 0.345, {"groups": ["group0"]})
    assert verdict is not None and verdict.code == "TFD324" and verdict.severity == "warning"
    assert verdict.evidence["fall"] == pytest.approx(0.226) and verdict.evidence["groups"] == ["group0"]


def test_the_recipes_decay_and_falls_the_decay_cannot_explain_stay_silent():
    # the recipes: the norm ends 1% to 5% above its start (weight_decay 0.01 to 0.1, lr 3e-4 to 2e-3)
    assert decayed_norms_shrink((0, 10.0), (120, 10.26), 0.023, {}) is None
    # gradients took the gains down 30%, but the decay could take only 2%: not the decay's doing
    assert decayed_norms_shrink((0, 10.0), (120, 7.0), 0.02, {}) is None
    assert decayed_norms_shrink((0, 10.0), (120, 9.5), 0.3, {}) is None  # a 5% fall: within what training moves
    assert decayed_norms_shrink((0, 0.0), (120, 0.0), 0.3, {}) is None
    assert decayed_norms_shrink((10, 10.0), (10, 5.0), 0.3, {}) is None
