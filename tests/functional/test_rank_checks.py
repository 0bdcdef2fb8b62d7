"""PerRankLogger's rules (functional/rank_checks.py) with plain numbers: one row per rank in, verdicts out."""

import torch

from lightning_tfdebug.functional.rank_checks import (
    KEYS,
    RankDiagnosis,
    RankRow,
    agreement_sums,
    disagreeing,
    disagreeing_tensors,
    nonfinite_loss_verdict,
    parameters_verdict,
    per_rank_metrics,
)


def rank_row(**values):
    """One rank's row of a healthy measurement, with ``values`` changed."""
    base = dict(
        loss=2.0,
        has_loss=1.0,
        step_time_ms=100.0,
        busy_ms=60.0,
        dataloader_wait_ms=5.0,
        peak_memory_gib=1.0,
        fingerprint=-1.0,
        checksum=1.0,
    )
    base.update(values)
    return RankRow(**base)


def test_per_rank_metrics_and_spreads():
    stats = [rank_row(), rank_row(loss=3.0, step_time_ms=150.0, dataloader_wait_ms=25.0)]
    metrics = per_rank_metrics(stats)
    assert metrics["per_rank/loss/rank1"] == 3.0 and metrics["per_rank/step_time_ms/rank0"] == 100.0
    assert metrics["per_rank/loss/max_minus_min"] == 1.0
    assert metrics["per_rank/dataloader_wait_ms/max_minus_median"] == 0.0  # median of two: the upper one
    assert not any("/rank" in k for k in per_rank_metrics(stats, log_per_rank=False))
    assert set(per_rank_metrics([rank_row(has_loss=0.0)])) == {
        f"per_rank/{k}/rank0" for k in ("step_time_ms", "busy_ms", "dataloader_wait_ms", "peak_memory_gib")
    }


def test_rank_diagnosis_names_the_rank_after_patience_measurements():
    def run(stats, times=2, differing=None):
        diagnosis = RankDiagnosis(patience=2)
        return [[(v.code, v.key) for v in diagnosis.update(stats, 7, differing)] for _ in range(times)]

    assert run([rank_row(), rank_row()]) == [[], []]
    assert run([rank_row(loss=float("nan"))], times=1) == [[("TFD505", None)]]
    same = [rank_row(fingerprint=11.0), rank_row(fingerprint=11.0), rank_row(fingerprint=12.0)]
    assert run(same) == [[], [("TFD501", None)]]
    slow = [rank_row(), rank_row(busy_ms=200.0), rank_row()]
    assert run(slow) == [[], [("TFD503", "rank1")]]
    far = [rank_row(), rank_row(), rank_row(loss=9.0)]
    assert run(far) == [[], [("TFD504", "rank2")]]
    assert run([rank_row(), rank_row(loss=9.0)]) == [[], [("TFD504", "pair")]]
    [[(code, _)]] = run([rank_row(), rank_row(checksum=2.0)], times=1, differing=["w"])
    assert code == "TFD502"


def test_agreement_sums_tell_whether_replicas_agree_whatever_the_world_size():
    """Issue 25: PerRankLogger compares per-tensor checksums through sums of a fixed size (8 per value) instead of
    gathering every rank's vector: within rtol/2 they agree, beyond rtol they differ, nan/inf/zero/sign count."""

    def reduced(*ranks):
        return sum(agreement_sums(torch.tensor(v, dtype=torch.float64)) for v in ranks).tolist(), len(ranks)

    nan, inf = float("nan"), float("inf")
    assert agreement_sums(torch.tensor([1.0, 2.0])).numel() == 16
    assert disagreeing(*reduced(*[[1.0, -2.0, 0.0, nan, inf]] * 5)) == [False] * 5
    assert disagreeing(*reduced([1.0, 2.0, -3.0], [1.0, 2.0 * (1 + 1e-5), -3.0], [1.0, 2.0, 3.0])) == [
        False,
        True,
        True,
    ]
    assert disagreeing(*reduced([1.0], [1.0 + 3e-7])) == [False]  # within rtol / 2
    assert disagreeing(*reduced([1.0], [1.0 + 2e-6])) == [True]  # beyond rtol
    assert disagreeing(*reduced([0.0], [1e-20])) == [False] and disagreeing(*reduced([inf], [nan])) == [True]
    # checksums are [norms..., sums...]: a tensor differs when either of its values does
    assert disagreeing_tensors(*reduced([1.0, 2.0, 3.0, 4.0], [1.0, 2.0, 3.0, 4.5]), ["a", "b"]) == ["b"]
    # the same answer from 64 ranks, one of them off
    many = [[1.0, 2.0, 3.0, 4.0]] * 63 + [[1.5, 2.0, 3.0, 4.0]]
    assert disagreeing_tensors(*reduced(*many), ["a", "b"]) == ["a"]


def test_every_key_the_metrics_compute_is_declared():
    metrics = per_rank_metrics([rank_row(), rank_row()])
    assert all(any(key.matches(name) for key in KEYS) for name in metrics)
    assert {key.name.split("/")[1] for key in KEYS} == {
        "loss",
        "step_time_ms",
        "busy_ms",
        "dataloader_wait_ms",
        "peak_memory_gib",
    }


def test_tfd505_names_the_ranks_with_a_non_finite_loss_at_once():
    verdict = nonfinite_loss_verdict([rank_row(), rank_row(loss=float("inf")), rank_row(loss=float("nan"))], 12)
    assert verdict.code == "TFD505" and verdict.evidence["ranks"] == [1, 2] and verdict.step == 12
    assert verdict.message == "Rank(s) 1, 2 produced a non-finite loss at step 12 while rank(s) 0 did not."
    assert nonfinite_loss_verdict([rank_row(loss=float("nan"), has_loss=0.0)], 12) is None  # no loss returned
    assert nonfinite_loss_verdict([rank_row()], 12) is None


def test_tfd501_identical_batches_on_two_ranks_after_patience():
    diagnosis = RankDiagnosis(patience=2)
    same = [rank_row(fingerprint=5.0), rank_row(fingerprint=5.0)]
    assert diagnosis.update(same, 3) == []
    [verdict] = diagnosis.update(same, 4)
    assert verdict.code == "TFD501" and verdict.evidence["identical_ranks"] == [[0, 1]] and verdict.step == 4
    assert verdict.message.startswith("Ranks [0, 1] trained on identical batches at 2 measured steps in a row")
    assert RankDiagnosis(patience=1).update([rank_row(), rank_row()], 4) == []  # no ids (-1): no verdict


def test_tfd502_names_the_odd_replica_and_the_tensors():
    # the tensors come from the reduced agreement sums; each rank's weighted total checksum names the odd replica
    stats = [rank_row(checksum=1.0), rank_row(checksum=1.0), rank_row(checksum=2.0)]
    verdict = parameters_verdict(stats, ["b"], 6)
    assert verdict.code == "TFD502" and verdict.evidence["ranks"] == [2] and verdict.evidence["tensors"] == ["b"]
    assert verdict.evidence["checksums"] == [1.0, 1.0, 2.0] and verdict.step == 6
    assert verdict.message == (
        "Parameters or buffers differ between DDP replicas at step 6: rank(s) 2 disagree with the others on "
        "1 tensor(s): b."
    )
    names = [f"w{i}" for i in range(7)]
    verdict = parameters_verdict(stats, names, 6)
    assert verdict.evidence["tensors"] == names and verdict.message.endswith("on 7 tensor(s): w0, w1, w2, w3, w4 ....")
    # the pack's reduction found no tensor that differs: no verdict
    assert RankDiagnosis(patience=1).update(stats, 6, differing=[]) == []
    assert [v.code for v in RankDiagnosis(patience=1).update(stats, 6, differing=["b"])] == ["TFD502"]


def test_tfd503_straggler_needs_the_factor_the_margin_and_patience():
    slow = [rank_row(busy_ms=60.0), rank_row(busy_ms=200.0), rank_row(busy_ms=60.0)]
    diagnosis = RankDiagnosis(patience=2)
    assert diagnosis.update(slow, 4) == []
    [verdict] = diagnosis.update(slow, 5)
    assert verdict.code == "TFD503" and verdict.key == "rank1" and verdict.evidence["others_median_ms"] == 65.0
    assert "Rank 1 is a straggler: its own work per step (205.0 ms" in verdict.message and "3.2x" in verdict.message
    # 1.4x the others: below the factor; 12 ms against 5 ms: 2.4x but less than straggler_min_ms more
    assert RankDiagnosis(patience=1).update([rank_row(busy_ms=86.0), rank_row(), rank_row()], 5) == []
    fast = [rank_row(busy_ms=7.0, dataloader_wait_ms=5.0), rank_row(busy_ms=0.0), rank_row(busy_ms=0.0)]
    assert RankDiagnosis(patience=1).update(fast, 5) == []


def test_tfd504_one_odd_loss_among_many_and_both_of_two():
    [verdict] = RankDiagnosis(patience=1).update([rank_row(), rank_row(), rank_row(loss=9.0)], 5)
    assert verdict.code == "TFD504" and verdict.key == "rank2" and verdict.evidence["median"] == 2.0
    assert verdict.message == "Rank 2's loss (9) is far from the median over ranks (2) for 1 measurements in a row."
    assert verdict.hint.startswith("That rank sees different data")
    [verdict] = RankDiagnosis(patience=1).update([rank_row(), rank_row(loss=9.0)], 5)
    assert verdict.key == "pair" and verdict.evidence["ranks"] == [0, 1]
    assert verdict.message == (
        "The two ranks' losses (2 and 9) differ by more than 50% for 1 measurements in a row; with two ranks, "
        "which one is off cannot be told."
    )
    assert RankDiagnosis(patience=1).update([rank_row(), rank_row(loss=2.5)], 5) == []
