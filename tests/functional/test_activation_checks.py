from lightning_tfdebug.functional.activation_checks import (
    CAUSES_DEAD,
    CAUSES_SATURATED,
    HINT_COMPILED,
    HINT_UNHOOKED,
    ActivationHistory,
    ActivationThresholds,
    climb,
    compiled_reason,
    dead_units,
    decide_activations,
    dying_units,
    no_layer_reason,
    saturated_units,
    saturating_units,
    silent_layers_reason,
    unobservable_verdict,
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


# ---------------------------------------------------------------------------------------------- each rule, in numbers
def test_dead_units_names_the_layers_with_their_fractions():
    assert dead_units({}, LIMITS) is None  # no layer past its patience: healthy
    verdict = dead_units({"a": 0.8, "b": 1.0}, LIMITS, step=7)
    assert (verdict.code, verdict.step, verdict.severity) == ("TFD340", 7, None)  # the rule's severity: warning
    assert verdict.evidence == {"dead_frac": {"a": 0.8, "b": 1.0}, "threshold": 0.5}
    assert verdict.message == (
        "2 layer(s) have more than 50% dead units (zero for every token of the batch) for 2 measurements: "
        "a (80%), b (100%)."
    )
    assert verdict.hint == CAUSES_DEAD
    many = dead_units({f"l{i}": 0.9 for i in range(12)}, LIMITS)
    assert many.message.startswith("12 layer(s)") and "l9 (90%)" in many.message and "l10" not in many.message


def test_dying_units_gives_the_lowest_and_the_current_fraction():
    assert dying_units({}) is None
    verdict = dying_units({"a": (0.05, 0.6)}, step=3)
    assert (verdict.code, verdict.step) == ("TFD341", 3)
    assert verdict.evidence == {"dead_frac": {"a": 0.6}, "lowest": {"a": 0.05}}
    assert verdict.message == "The dead-unit fraction is rising in a (5% -> 60%): units are dying during training."
    assert verdict.hint == CAUSES_DEAD


def test_saturated_units_names_the_gradient_threshold():
    assert saturated_units({}, LIMITS) is None
    limits = ActivationThresholds(saturation=0.6, patience=3, saturation_grad=0.02)
    verdict = saturated_units({"tanh": 0.97}, limits)
    assert verdict.code == "TFD342" and verdict.evidence == {"saturated_frac": {"tanh": 0.97}, "threshold": 0.6}
    assert verdict.message == (
        "1 layer(s) have more than 60% saturated activations (local gradient below 0.02) for 3 measurements: "
        "tanh (97%)."
    )
    assert verdict.hint == CAUSES_SATURATED


def test_saturating_units_gives_the_lowest_and_the_current_fraction():
    assert saturating_units({}) is None
    verdict = saturating_units({"act": (0.0, 0.4)}, step=9)
    assert (verdict.code, verdict.step) == ("TFD344", 9)
    assert verdict.evidence == {"saturated_frac": {"act": 0.4}, "lowest": {"act": 0.0}}
    assert verdict.message == (
        "The saturated fraction is rising in act (0% -> 40%): more and more units sit where their gradient is almost "
        "zero."
    )


def test_decide_activations_stamps_every_verdict_with_the_measured_step():
    history = ActivationHistory()
    decide_activations([("a", 0.9, 0.9)], history, LIMITS, step=4)
    verdicts = decide_activations([("a", 0.9, 0.9)], history, LIMITS, step=6)
    assert [(v.code, v.step) for v in verdicts] == [("TFD340", 6), ("TFD342", 6)]


def test_a_rising_saturated_fraction_needs_patience_and_no_fall_back():
    history = ActivationHistory()
    seen = [codes(decide_activations([("t", None, f)], history, LIMITS)) for f in (0.0, 0.4, 0.45, 0.2)]
    assert seen == [[], [], ["TFD344"], []]


def test_unobservable_says_why_and_how_to_measure():
    assert unobservable_verdict(None, compiled=True) is None  # nothing in the way: no finding
    reason = compiled_reason(True)
    verdict = unobservable_verdict(reason, compiled=True)
    assert (verdict.code, verdict.evidence, verdict.step) == ("TFD343", {"compiled": True}, None)
    assert verdict.message == f"DeadActivation cannot measure: {reason}" and "torch.compile" in verdict.message
    assert verdict.hint == HINT_COMPILED
    verdict = unobservable_verdict(no_layer_reason(0, None), compiled=False, step=2)
    assert (verdict.evidence, verdict.step, verdict.hint) == ({"compiled": False}, 2, HINT_UNHOOKED)


def test_the_reasons_are_none_when_activations_can_be_observed():
    assert compiled_reason(False) is None
    assert no_layer_reason(3, None) is None and silent_layers_reason(1, compiled=True) is None
    assert no_layer_reason(0, None).startswith("no activation module (ReLU, GELU, SiLU, Tanh, Sigmoid, ...) is in")
    assert "matching `layers='blocks'` is in the model" in no_layer_reason(0, "blocks")
    assert silent_layers_reason(0, compiled=False) == (
        "none of the hooked activation modules ran during the training forward, so activations cannot be observed."
    )
    assert "forward (the model is compiled), so" in silent_layers_reason(0, compiled=True)
