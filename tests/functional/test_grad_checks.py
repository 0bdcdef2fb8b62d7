"""GradNormMonitor's rules on plain numbers: each fires on the numbers of its bug and stays quiet on healthy ones."""

import math

import pytest

from lightning_tfdebug.functional.grad_checks import (
    Clipping,
    GradMemory,
    GradReading,
    explosion,
    grad_verdicts,
    nonfinite_gradients,
    overclipping,
    still_scaled,
    unused_parameters,
    vanishing,
)
from lightning_tfdebug.primitives.tracking import RunningWindow, Streak


def reading(total=1.0, groups=None, nonfinite=None):
    groups = groups or {"blocks.0": 0.6, "blocks.1": 0.8}
    return GradReading(total, groups, nonfinite or dict.fromkeys(groups, 0.0))


def test_a_reading_from_squares_and_its_logged_keys():
    r = GradReading.from_squares(["a", "b"], [9.0, 16.0], [0.0, 2.0])
    assert r.total == 5.0 and r.groups == {"a": 3.0, "b": 4.0} and r.nonfinite_tensors == 2.0
    assert r.scalars() == {"grad_norm/total": 5.0, "grad_norm/a": 3.0, "grad_norm/b": 4.0, "grad_norm/nonfinite": 2.0}
    assert set(GradReading.from_squares(["a"], [1.0], [0.0]).scalars(log_groups=False)) == {
        "grad_norm/total",
        "grad_norm/nonfinite",
    }


def test_explosion_against_the_running_median_after_warmup():
    history = RunningWindow(50)
    for value in (1.0, 1.1, 0.9):
        assert explosion(value, history, factor=10.0, warmup=3) is None
    assert explosion(9.0, history, factor=10.0, warmup=3) is None  # 9x: below the factor
    verdict = explosion(150.0, history, factor=10.0, warmup=3)
    assert verdict.code == "TFD301" and verdict.evidence["running_median"] == pytest.approx(1.05)
    assert verdict.evidence["factor"] == pytest.approx(150 / 1.05)
    assert "exploded to 150" in verdict.message and f"{150 / 1.05:.1f}x" in verdict.message
    # during warm-up nothing is judged, whatever the value
    assert explosion(1e6, RunningWindow(50), factor=10.0, warmup=1) is None


def test_vanishing_groups_sustained_for_patience_measurements():
    streak = Streak()
    deep = {"blocks.0": 1e-6, "blocks.1": 1e-2, "head": 1.0}  # bug 13: the first block far below the head
    assert vanishing(deep, streak, ratio=1e-3, patience=3) is None
    assert vanishing(deep, streak, ratio=1e-3, patience=3) is None
    verdict = vanishing(deep, streak, ratio=1e-3, patience=3)
    assert verdict.code == "TFD302" and verdict.evidence["groups"] == ["blocks.0"]
    assert verdict.evidence["largest_group"] == "head" and verdict.evidence["largest_group_norm"] == 1.0
    assert verdict.message.startswith("Gradients vanish in blocks.0: below 0.001 x the largest group norm (head)")
    # healthy: groups within a few x of each other; a streak broken by one healthy measurement starts again
    healthy, streak = {"blocks.0": 0.3, "blocks.1": 0.5, "head": 1.0}, Streak()
    assert all(vanishing(healthy, streak, ratio=1e-3, patience=1) is None for _ in range(5))
    vanishing(deep, streak, ratio=1e-3, patience=2)
    vanishing(healthy, streak, ratio=1e-3, patience=2)
    assert vanishing(deep, streak, ratio=1e-3, patience=2) is None
    # one group, or no gradient at all: nothing to compare
    assert vanishing({"head": 1.0}, Streak(), ratio=1e-3, patience=1) is None
    assert vanishing({"a": 0.0, "b": 0.0}, Streak(), ratio=1e-3, patience=1) is None


def test_a_tied_group_is_judged_but_is_no_reference():
    """BART's healthy fine-tune (healthy matrix): the embeddings tied with the LM head carry the head's gradient; the
    first encoder layer sits at 3e-4 of them and at 1.3e-3 and more of the largest untied group while it trains."""
    bart = {"embeddings": 1.0, "encoder.layers.0": 2.8e-4, "encoder.layers.1": 2.1e-3, "decoder.layers.1": 0.215}
    streak = Streak()
    assert all(vanishing(bart, streak, ratio=1e-3, patience=1, tied=("embeddings",)) is None for _ in range(3))
    assert vanishing(bart, Streak(), ratio=1e-3, patience=1).evidence["groups"] == ["encoder.layers.0"]  # untold
    # GPT-2 of bug 13 (tied wte): its blocks still vanish next to the untied sigmoid stack; a tied group is judged
    gpt2 = {"embeddings": 1.0, "h.0": 3e-7, "h.1": 3e-7, "other": 0.04}
    verdict = vanishing(gpt2, Streak(), ratio=1e-3, patience=1, tied=("embeddings",))
    assert verdict.evidence["groups"] == ["h.0", "h.1"] and verdict.evidence["largest_group"] == "other"
    only_tied = vanishing({"wte": 1.0, "h.0": 1e-7}, Streak(), ratio=1e-3, patience=1, tied=("wte", "h.0"))
    assert only_tied.evidence["largest_group"] == "wte"  # nothing untied: the largest group, tied or not


def test_nonfinite_gradients_are_an_error_without_a_scaler_only():
    bad = reading(math.inf, nonfinite={"blocks.0": 2.0, "blocks.1": 0.0})
    verdict = nonfinite_gradients(bad, has_scaler=False)
    assert verdict.code == "TFD303" and verdict.evidence == {"nonfinite_tensors": 2.0, "groups": ["blocks.0"]}
    assert verdict.message == "2 parameter tensor(s) have inf/nan gradients, in groups blocks.0."
    assert nonfinite_gradients(bad, has_scaler=True) is None  # a GradScaler skips the step: ScalerWatch's
    assert nonfinite_gradients(reading(), has_scaler=False) is None


def test_unused_parameters_after_patience_measurements_without_a_gradient():
    streak = Streak()
    assert unused_parameters(["extra.weight"], ["w"], streak, patience=2) is None
    verdict = unused_parameters(["extra.weight", "extra.bias"], ["w"], streak, patience=2)
    assert verdict.code == "TFD304" and verdict.evidence == {"parameters": ["extra.weight"], "count": 1}
    assert verdict.message == (
        "1 of 3 trainable parameter tensor(s) never received a gradient in 2 measured steps: extra.weight."
    )
    # a parameter that gets a gradient again starts its count from zero
    unused_parameters([], ["extra.weight", "extra.bias", "w"], streak, patience=2)
    assert unused_parameters(["extra.weight"], ["w"], streak, patience=2) is None
    many = unused_parameters([f"p{i}" for i in range(12)], [], Streak(), patience=1)
    assert many.evidence["count"] == 12 and many.message.endswith("p9 ....")


def test_still_scaled_gradients_are_an_observation():
    verdict = still_scaled("AdamW", 1024.0)
    assert verdict.code == "TFD305" and verdict.evidence == {"loss_scale": 1024.0}
    assert "The optimizer (AdamW) unscales gradients inside step()" in verdict.message
    assert still_scaled("AdamW", None) is None


def test_overclipping_on_every_measured_step_for_patience_measurements():
    streak = Streak()
    value = Clipping.from_squares(4, 1e-4, "value", before=4.0, after=1.6e-3)  # kept 2%: a cut of 50x
    assert value.kept == pytest.approx(0.02)
    assert overclipping(value, streak, patience=3) is None
    assert overclipping(value, streak, patience=3) is None
    verdict = overclipping(value, streak, patience=3)
    assert verdict.code == "TFD306" and verdict.evidence["factor"] == pytest.approx(50.0)
    assert 'gradient_clip_val=0.0001 and gradient_clip_algorithm="value"' in verdict.message
    assert "keeps only 2.00% of the gradient's norm" in verdict.message
    # a clip that cuts by 20x, a measurement without clipping in between, or a zero gradient: quiet
    streak = Streak()
    assert all(overclipping(Clipping(0, 0.1, "norm", 0.05), streak, patience=1) is None for _ in range(4))
    streak = Streak()
    assert [overclipping(c, streak, patience=2) for c in (value, None, value)] == [None, None, None]
    assert Clipping.from_squares(0, 1.0, "norm", before=0.0, after=0.0).kept == 1.0


def test_the_norm_rules_together():
    memory = GradMemory(RunningWindow(50))
    kwargs = dict(trained=["blocks.0", "blocks.1"], explosion_factor=10.0, warmup=1, vanishing_ratio=1e-3, patience=1)
    assert grad_verdicts(reading(1.0), memory, has_scaler=False, **kwargs) == [None, None]
    [exploded, _] = grad_verdicts(reading(50.0), memory, has_scaler=False, **kwargs)
    assert exploded.code == "TFD301"
    # non-finite gradients end the diagnosis; an overflow under a GradScaler is not judged and not remembered
    bad = reading(math.nan, nonfinite={"blocks.0": 1.0, "blocks.1": 0.0})
    assert [v.code for v in grad_verdicts(bad, memory, has_scaler=False, **kwargs)] == ["TFD303"]
    assert grad_verdicts(bad, memory, has_scaler=True, **kwargs) == []
    assert list(memory.history.values) == [1.0, 50.0]
    # a group outside every optimizer is neither the reference nor judged (bug 10)
    frozen = reading(1.0, groups={"blocks.0": 1e-5, "blocks.1": 1e-5, "head": 100.0})
    assert grad_verdicts(frozen, memory, has_scaler=False, **kwargs) == [None, None]


def test_the_memory_round_trips_through_a_state_dict():
    memory = GradMemory(RunningWindow(3))
    for value in (1.0, 2.0, 3.0, 4.0):
        memory.history.add(value)
    memory.no_grad.update("extra.weight", True)
    state = memory.state_dict()
    assert set(state) == {"history", "vanishing", "no_grad", "overclip"}  # the checkpoint keys of before
    restored = GradMemory(RunningWindow(50))
    restored.load_state_dict(state)
    assert list(restored.history.values) == [2.0, 3.0, 4.0] and restored.no_grad.counts == {"extra.weight": 1}
