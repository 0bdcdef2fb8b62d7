"""ScalerWatch's rules on plain numbers: each fires on the numbers of its bug and stays quiet on healthy ones."""

from lightning_tfdebug.functional.scaler_checks import (
    ScalerReading,
    many_skipped,
    no_scaler,
    scale_collapsed,
    scale_never_grew,
    schedule_on_skipped,
    steps_on_skipped,
)

# ScalerReading(step, scale, skipped_steps, steps, recent_steps, recent_skipped, recent_backoffs, overflow_groups)
# bug 15 after 20 steps: the scale halved on almost every step, 18 of 20 skipped, overflow entering at blocks.0
OVERFLOW = ScalerReading(19, 0.25, 18, 20, 20, 18, 18, ("blocks.0", "head"))
# a healthy fp16 run: the scale grew, one probe past the limit skipped
HEALTHY = ScalerReading(19, 2.0**18, 1, 20, 20, 1, 1, ())


def test_no_scaler_is_an_observation_naming_the_precision():
    verdict = no_scaler("bf16-mixed")
    assert verdict.code == "TFD410" and verdict.evidence == {"precision": "bf16-mixed"}
    assert "precision 'bf16-mixed' uses no GradScaler" in verdict.message


def test_a_collapsed_scale_below_min_scale_or_halved_repeatedly():
    verdict = scale_collapsed(OVERFLOW, min_scale=1.0, collapse_backoffs=8)
    assert (
        verdict.code == "TFD411" and verdict.step == 19 and verdict.evidence["overflow_groups"] == ["blocks.0", "head"]
    )
    assert verdict.message == (
        "The fp16 loss scale collapsed: it fell to 0.25 (below min_scale=1). Gradients overflow on most steps "
        "(overflowing groups: blocks.0, head)."
    )
    halved = ScalerReading(9, 256.0, 8, 10, 10, 8, 8)
    verdict = scale_collapsed(halved, min_scale=1.0, collapse_backoffs=8)
    assert verdict.message.endswith("it was reduced 8 times in the last 10 steps. Gradients overflow on most steps.")
    assert scale_collapsed(HEALTHY, min_scale=1.0, collapse_backoffs=8) is None


def test_many_skipped_steps_once_min_steps_were_watched():
    verdict = many_skipped(OVERFLOW, min_steps=8, max_skipped_frac=0.25)
    assert verdict.code == "TFD412" and verdict.evidence["recent_skipped"] == 18
    assert verdict.message == (
        "18 of the last 20 optimizer steps were skipped for fp16 overflow; gradients overflowed in blocks.0, head."
    )
    assert many_skipped(OVERFLOW, min_steps=21, max_skipped_frac=0.25) is None  # too early to tell
    assert many_skipped(HEALTHY, min_steps=8, max_skipped_frac=0.25) is None
    assert many_skipped(ScalerReading(0, 1.0, 0, 10, 0, 0, 0), min_steps=8, max_skipped_frac=0.25) is None


def test_a_scheduler_that_advanced_on_skipped_steps():
    # 10 optimizer steps, 8 skipped: a plain scheduler stepped 10 times (8 on skipped steps); a skip-aware one 2
    assert steps_on_skipped(10, 10, 8) == 8 and steps_on_skipped(2, 10, 8) == 0
    assert steps_on_skipped(12, 10, 8) == 8  # never more than the skipped steps
    verdict = schedule_on_skipped(OVERFLOW, "LambdaLR", 8, lr_skipped_steps=8)
    assert verdict.code == "TFD413" and verdict.evidence["scheduler"] == "LambdaLR"
    assert verdict.evidence["scheduler_steps_on_skipped"] == 8 and verdict.evidence["scale"] == 0.25
    assert verdict.message.startswith("A per-step LR scheduler (LambdaLR) advanced on 8 optimizer steps")
    assert schedule_on_skipped(OVERFLOW, "LambdaLR", 7, lr_skipped_steps=8) is None
    assert schedule_on_skipped(OVERFLOW, None, 20, lr_skipped_steps=8) is None  # no per-step scheduler


def test_a_scale_that_never_grew_for_several_growth_intervals():
    every_third = ScalerReading(11, 2.0**14, 4, 12, 12, 4, 4)  # overflow every third step, growth_interval 4
    verdict = scale_never_grew(every_third, last_growth=0, growth_events=0, growth_interval=4, no_growth_intervals=2)
    assert verdict.code == "TFD414" and verdict.evidence["growth_interval"] == 4
    assert verdict.message.startswith("The loss scale has not grown for 12 steps (2 x growth_interval=4)")
    assert scale_never_grew(HEALTHY, last_growth=18, growth_events=5, growth_interval=4, no_growth_intervals=2) is None
