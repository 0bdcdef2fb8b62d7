"""NaNFirstFrame's rules with plain values: which code a bad step gets, its text, evidence and hint."""

from lightning_tfdebug.functional.frames import LOSS_FRAME
from lightning_tfdebug.functional.nan_checks import NaNStep, nonfinite_step, rank_frames, replay_failed_on_rank


def rank(r, forward=None, backward=None, reproduced=None):
    return {"rank": r, "forward": forward, "backward": backward, "reproduced": reproduced}


def step(bad, frames, everyone, **kwargs):
    kwargs.setdefault("batch_idx", 7)
    kwargs.setdefault("precision", "16-mixed")
    return NaNStep(3, bad, frames, everyone, "r.txt", "r.json", **kwargs)


def test_a_nonfinite_loss_located_in_a_module_is_tfd401_naming_module_rank_and_report():
    everyone = [rank(0), rank(1, "blocks.1.mlp.fc", "head")]
    verdict = nonfinite_step(step([1], [], everyone, skipped=True))
    assert verdict.code == "TFD401" and verdict.severity is None and verdict.key == "step3"
    assert verdict.message == (
        "The loss or gradients became non-finite at step 3 on rank(s) [1]: the first module whose forward output "
        "held inf/nan was `blocks.1.mlp.fc` on rank 1; the first non-finite gradient reached the output of `head`. "
        "The optimizer step was not applied. Report: r.txt"
    )
    e = verdict.evidence
    assert (e["module"], e["backward_module"], e["module_rank"], e["ranks"]) == ("blocks.1.mlp.fc", "head", 1, [1])
    assert e["per_rank"] == {
        "0": {"forward": None, "backward": None},
        "1": {"forward": "blocks.1.mlp.fc", "backward": "head"},
    }
    assert (e["batch_idx"], e["precision"], e["report"], e["report_json"]) == (7, "16-mixed", "r.txt", "r.json")
    assert "replay_reproduced" not in e and "fp16 room" in verdict.hint


def test_a_step_left_applied_says_nothing_of_skipping():
    verdict = nonfinite_step(step([0], [], [rank(0, "fc")], skipped=False))
    assert verdict.code == "TFD401" and "not applied" not in verdict.message


def test_a_nan_loss_with_every_module_finite_points_at_the_loss():
    verdict = nonfinite_step(step([0], [], [rank(0, LOSS_FRAME)]))
    assert verdict.code == "TFD401" and "no module output held inf/nan" in verdict.message
    assert "loss computed in training_step on rank 0" in verdict.message and "ignore_index" in verdict.hint


def test_a_backward_only_culprit_and_no_module_at_all():
    verdict = nonfinite_step(step([0], [], [rank(0, None, "head")]))
    assert verdict.evidence["module"] is None and verdict.evidence["backward_module"] == "head"
    assert "no module output held inf/nan in the replay; the first non-finite gradient" in verdict.message
    verdict = nonfinite_step(step([0], [], [rank(0)]))
    assert verdict.code == "TFD401" and verdict.evidence["module_rank"] is None


def test_a_value_the_replay_did_not_reproduce_is_said_so():
    verdict = nonfinite_step(step([0], [0], [rank(0, "fc", reproduced=False)]))
    assert "did not reproduce" in verdict.message and verdict.evidence["replay_reproduced"] is False


def test_a_failed_replay_is_tfd403_with_the_error():
    verdict = nonfinite_step(step([0, 1], [], [rank(0), rank(1)], error="RuntimeError: boom"))
    assert verdict.code == "TFD403" and verdict.key == "step3"
    assert verdict.message == (
        "The loss or gradients became non-finite at step 3 on rank(s) [0, 1], and replaying the batch to locate the "
        "first bad frame failed: RuntimeError: boom. Report: r.txt"
    )
    verdict = replay_failed_on_rank(3, [1], 1, "RuntimeError: boom", "r.txt")
    assert verdict.code == "TFD403" and "failed on rank 1: RuntimeError: boom" in verdict.message
    assert verdict.evidence == {"ranks": [1], "report": "r.txt", "replay_error": "RuntimeError: boom"}


def test_eager_inf_that_never_reached_the_loss_is_tfd402_on_the_ranks_that_named_a_module():
    everyone = [rank(0, "masked", reproduced=True), rank(1)]
    verdict = nonfinite_step(step([], [0, 1], everyone))
    assert verdict.code == "TFD402" and verdict.evidence["ranks"] == [0]
    assert verdict.message == (
        "At step 3 a module produced inf/nan that did not reach the loss, on rank(s) [0]: the first module whose "
        "forward output held inf/nan was `masked` on rank 0. Report: r.txt"
    )
    verdict = nonfinite_step(step([], [0], [rank(0, "masked")], error="ValueError: x"))
    assert verdict.code == "TFD402" and " The replay failed: ValueError: x. Report" in verdict.message


def test_flags_that_were_only_float32_sum_overflows_give_no_finding():
    assert nonfinite_step(step([], [0, 1], [rank(0), rank(1)])) is None


def test_the_reading_of_a_report_summary():
    summary = {
        "step": 5, "batch_idx": 2, "rank": 1, "precision": "32-true", "nonfinite_ranks": [1],
        "frame_nonfinite_ranks": [], "replay_error": None, "replay_reproduced": None,
        "first_forward": {"module": "fc"}, "first_backward": None,
    }  # fmt: skip
    mine = rank_frames(1, summary)
    assert mine == {"rank": 1, "forward": "fc", "backward": None, "reproduced": None}
    reading = NaNStep.of(summary, [mine], "a.txt", "a.json", skipped=True)
    assert (reading.step, reading.bad_ranks, reading.batch_idx, reading.skipped) == (5, [1], 2, True)
    assert nonfinite_step(reading).message.endswith("on rank 1. The optimizer step was not applied. Report: a.txt")
