from lightning_tfdebug.functional.activation_checks import (
    ActivationHistory,
    ActivationThresholds,
    climb,
    decide_activations,
)

LIMITS = ActivationThresholds(dead=0.5, saturation=0.5, patience=2, dead_rise=0.35, saturation_rise=0.35)


def codes(verdicts):
    return [v.code for v in verdicts]


def test_dead_units_need_patience_measurements_in_a_row():
    history = ActivationHistory()
    assert decide_activations([("fc.act", 0.9, None)], history, LIMITS) == []
    [verdict] = decide_activations([("fc.act", 0.8, None)], history, LIMITS)
    assert verdict.code == "TFD340" and verdict.evidence == {"dead_frac": {"fc.act": 0.8}, "threshold": 0.5}
    assert "fc.act (80%)" in verdict.message and "negative bias" in verdict.hint
    history = ActivationHistory()  # a streak broken by a healthy measurement starts again
    for frac in (0.9, 0.1, 0.9):
        assert decide_activations([("fc.act", frac, None)], history, LIMITS) == []


def test_saturation_is_judged_only_for_layers_that_saturate():
    history = ActivationHistory()
    for _ in range(2):
        verdicts = decide_activations([("relu", 0.0, None), ("tanh", None, 0.9)], history, LIMITS)
    assert codes(verdicts) == ["TFD342"] and set(verdicts[0].evidence["saturated_frac"]) == {"tanh"}


def test_a_rising_dead_fraction_is_reported_and_a_transient_bump_is_not():
    history = ActivationHistory()
    seen = [codes(decide_activations([("a", f, None)], history, LIMITS)) for f in (0.0, 0.4, 0.45)]
    assert seen == [[], [], ["TFD341"]]
    [verdict] = decide_activations([("a", 0.45, None)], history, LIMITS)
    assert verdict.evidence == {"dead_frac": {"a": 0.45}, "lowest": {"a": 0.0}}
    history = ActivationHistory()
    seen = [codes(decide_activations([("a", f, None)], history, LIMITS)) for f in (0.0, 0.4, 0.1, 0.4)]
    assert seen == [[], [], [], []]


def test_climb_keeps_the_lowest_value_and_needs_no_fall_back():
    lowest, last = {}, {}
    assert climb(lowest, last, "x", 0.2, 0.3) is None
    assert climb(lowest, last, "x", 0.6, 0.3) == 0.2
    assert climb(lowest, last, "x", 0.4, 0.3) is None  # falling back from 0.6
    assert lowest == {"x": 0.2} and last == {"x": 0.4}


def test_history_round_trips_through_its_state_dict():
    history = ActivationHistory()
    for frac in (0.1, 0.9, 0.95):
        decide_activations([("a", frac, 0.2)], history, LIMITS)
    restored = ActivationHistory()
    restored.load_state_dict(history.state_dict())
    assert restored.state_dict() == history.state_dict()
    assert codes(decide_activations([("a", 0.97, 0.2)], restored, LIMITS)) == codes(
        decide_activations([("a", 0.97, 0.2)], history, LIMITS)
    )
