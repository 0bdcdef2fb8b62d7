from lightning_tfdebug.primitives.tracking import RunningWindow, Streak


def test_a_running_window_keeps_the_last_finite_values_and_their_median():
    window = RunningWindow(3)
    assert len(window) == 0 and window.median() != window.median()  # empty: nan
    for value in (5.0, float("nan"), 1.0, float("inf"), 3.0, 10.0):
        window.add(value)
    assert list(window.values) == [1.0, 3.0, 10.0] and window.median() == 3.0
    restored = RunningWindow(99)
    restored.load_state_dict(window.state_dict())
    assert list(restored.values) == [1.0, 3.0, 10.0] and restored.values.maxlen == 3


def test_a_streak_counts_consecutive_holds_per_key_and_resets():
    streak = Streak()
    assert [streak.update("a", c) for c in (True, True, False, True)] == [1, 2, 0, 1]
    assert streak.update("b", True) == 1
    restored = Streak()
    restored.load_state_dict({"a": "1", "b": 1.0})
    assert restored.update("a", True) == 2 and restored.counts == {"a": 2, "b": 1}
