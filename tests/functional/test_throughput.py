import math
import time

import pytest
import torch

from lightning_tfdebug.core.batch import BatchKeys, StepBatch
from lightning_tfdebug.functional.throughput import (
    StepClock,
    batch_counts,
    batch_fingerprint,
    combine_fingerprints,
    compute_precision,
    device_fingerprint,
    differing_ranks,
    differing_tensors,
    host_fingerprint,
    loss_outliers,
    max_over_median,
    median_of_others,
    parameter_checksums,
    peak_flops_for,
    peak_rss_bytes,
    process_rss_bytes,
)


def counts(batch, length_fn=None):
    return batch_counts(StepBatch(batch, BatchKeys()), length_fn)


def test_batch_counts_prefer_the_attention_mask_and_read_shapes_without_a_sync():
    ids = torch.randint(0, 100, (3, 5))
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]])
    view = StepBatch({"input_ids": ids, "attention_mask": mask, "labels": ids}, BatchKeys())
    tokens, positions, samples = batch_counts(view)
    assert isinstance(tokens, int) and tokens == 9  # a CPU mask is counted on the host, with NumPy: no kernel
    assert (positions, samples) == (15, 3)
    assert batch_counts(view)[0] is tokens  # the step's one count, shared
    # a mask NumPy cannot read (bfloat16) is counted by torch, as a device tensor would be
    bf16 = StepBatch({"input_ids": ids, "attention_mask": mask.to(torch.bfloat16)}, BatchKeys())
    counted = batch_counts(bf16)[0]
    assert isinstance(counted, torch.Tensor) and int(counted) == 9
    negated = StepBatch({"input_ids": ids, "attention_mask": torch._neg_view(mask)}, BatchKeys())  # lazy negation
    counted = batch_counts(negated)[0]
    assert isinstance(counted, torch.Tensor) and int(counted) == 9


def test_batch_counts_without_a_mask_count_every_position_of_the_input():
    assert counts((torch.randint(0, 9, (4, 7)), torch.randn(4, 7, 2))) == (28, 28, 4)
    assert counts({"tokens": torch.zeros(6, dtype=torch.long)}) == (6, 6, 1)  # one unbatched sequence
    assert counts({"x": "no tensors"}) == (0, 0, 0)
    assert counts(torch.randn(4, 3)) == (12, 12, 4)  # features only: the first tensor's shape


def test_batch_counts_use_the_length_function_first():
    batch = {"input_ids": torch.zeros(2, 4, dtype=torch.long), "attention_mask": torch.ones(2, 4)}
    assert counts(batch, lambda b: 5) == (5, 8, 2)
    tokens, _, _ = counts(batch, lambda b: (b["attention_mask"][:, 1:] != 0).sum())
    assert int(tokens) == 6


def test_batch_counts_follow_the_given_keys():
    batch = {"src": torch.zeros(2, 4, dtype=torch.long), "pad": torch.tensor([[1, 1, 0, 0], [1, 0, 0, 0]])}
    tokens, positions, samples = batch_counts(StepBatch(batch, BatchKeys(mask_key="pad")))
    assert (int(tokens), positions, samples) == (3, 8, 2)


def test_batch_fingerprint_is_equal_for_equal_values_and_sensitive_to_values_and_order():
    a = torch.randint(0, 259, (8, 64))
    fp = batch_fingerprint(a)
    assert fp.dtype == torch.int64 and 0 <= int(fp) < 2**31 - 1
    assert int(batch_fingerprint(a.clone())) == int(fp)
    b = a.clone()
    b[3, 10] += 1
    assert int(batch_fingerprint(b)) != int(fp)
    assert int(batch_fingerprint(a.flip(0))) != int(fp)  # same rows, other order
    x = torch.randn(4, 4)
    assert int(batch_fingerprint(x)) == int(batch_fingerprint(x.clone()))
    assert int(batch_fingerprint(x)) != int(batch_fingerprint(x + 1e-3))


def _fingerprint_by_torch_kernels(ids):
    """The device formula, with torch's int64 kernels (what a CUDA batch gets), written out independently."""
    flat = ids.reshape(-1)
    if flat.is_floating_point():
        flat = flat.contiguous().view({8: torch.int64, 4: torch.int32, 2: torch.int16}[flat.element_size()])
    flat = flat.to(torch.int64)
    n = flat.numel()
    weights = (torch.arange(1, n + 1, dtype=torch.int64) * 1_103_515_245 + 12345) % (2**31 - 1)
    return int(((flat * weights).sum() + (int(weights.sum()) + n)) % (2**31 - 1))


@pytest.mark.parametrize(
    "ids",
    [
        torch.randint(0, 50_000, (6, 64)),
        torch.randint(-(2**62), 2**62, (100,)),  # products and sums wrap around int64
        torch.randint(0, 2**31, (3, 7), dtype=torch.int32),
        torch.randn(5, 9),
        torch.randn(4, 3).half(),
        torch.randint(0, 100, (8, 64))[:, ::2],  # not contiguous
    ],
)
def test_fingerprints_on_the_host_and_on_a_device_tell_batches_apart_alike(ids):
    # a CPU batch is hashed on the host (CRC-32 of its bytes, no torch kernel on the hot path); a device batch by the
    # weighted-sum kernels. Each: equal values give equal numbers, a one-element change or another order does not.
    changed = ids.clone()
    changed.view(-1)[0] += 1
    flipped = ids.flip(0)
    host = host_fingerprint(ids)
    assert host is not None and 0 <= host < 2**31 - 1
    assert host == host_fingerprint(ids.clone()) == host_fingerprint(ids.contiguous())
    assert host_fingerprint(changed) != host and host_fingerprint(flipped) != host
    assert int(batch_fingerprint(ids)) == host  # what BatchGuard and PerRankLogger get for a CPU batch
    on_device = int(device_fingerprint(ids))
    assert on_device == _fingerprint_by_torch_kernels(ids)
    assert int(device_fingerprint(ids.clone())) == on_device
    assert int(device_fingerprint(changed)) != on_device and int(device_fingerprint(flipped)) != on_device


def test_host_fingerprint_leaves_tensors_numpy_cannot_read_to_the_device_formula():
    ids = torch.randint(0, 9, (2, 5))
    assert host_fingerprint(ids.to(torch.bfloat16)) is None
    assert host_fingerprint(torch.randn(3, requires_grad=True)) is None
    negated = torch._neg_view(ids)  # a lazy negation (the negative bit): NumPy cannot read it
    assert host_fingerprint(negated) is None
    assert int(batch_fingerprint(negated)) == int(device_fingerprint(-ids))
    assert int(batch_fingerprint(ids.to(torch.bfloat16))) == int(device_fingerprint(ids.to(torch.bfloat16)))


def test_combine_fingerprints_is_order_sensitive():
    p, q = torch.tensor(11), torch.tensor(29)
    assert int(combine_fingerprints(None, p)) == 11
    assert int(combine_fingerprints(p, q)) != int(combine_fingerprints(q, p))


def test_parameter_checksums_catch_changes_that_keep_the_norm():
    w = torch.randn(5, 3)
    counter = torch.tensor(7)  # integer buffers are compared too
    base = parameter_checksums([w, counter])
    assert base.dtype == torch.float64 and base.shape == (4,)  # [norm_w, norm_counter, sum_w, sum_counter]
    torch.testing.assert_close(base, torch.tensor([w.norm().item(), 7.0, w.sum().item(), 7.0], dtype=torch.float64))
    flipped = parameter_checksums([-w, counter])
    assert flipped[0] == base[0] and flipped[2] != base[2]  # a sign flip keeps the norm; the sum sees it
    assert parameter_checksums([]).numel() == 0


def test_differing_ranks_takes_the_majority_and_differing_tensors_reads_every_block():
    same = [1.0, 2.0, 3.0, 4.0]
    other = [1.0, 2.5, 3.0, 4.0]
    assert differing_ranks([same, same, other, same]) == [2]
    assert differing_ranks([same, other]) == [1]  # a tie: rank 0's vector is the reference
    assert differing_ranks([same]) == []
    # two tensors, blocks [norms..., sums...]: tensor "b" differs only in its sum
    values = [[1.0, 2.0, 3.0, 4.0], [1.0, 2.0, 3.0, 4.5]]
    assert differing_tensors(values, ["a", "b"]) == ["b"]
    assert differing_tensors([[1.0, 2.0], [1.0 + 1e-9, 2.0]], ["a", "b"]) == []  # within rtol


def test_spreads():
    assert max_over_median([10.0, 10.0, 30.0]) == pytest.approx(3.0)
    assert max_over_median([5.0]) == 1.0
    assert math.isnan(max_over_median([float("nan")]))
    assert median_of_others([1.0, 2.0, 100.0], 2) == 1.5
    assert math.isnan(median_of_others([1.0], 0))


@pytest.mark.parametrize(
    "name, compute, expected",
    [
        ("NVIDIA H100 80GB HBM3", "bf16", 989e12),
        ("NVIDIA H100 PCIe", "bf16", 756e12),
        ("NVIDIA H100 NVL", "fp16", 835e12),
        ("NVIDIA H200", "tf32", 495e12),
        ("NVIDIA GH200 480GB", "bf16", 989e12),
        ("NVIDIA A100-SXM4-80GB", "tf32", 156e12),
        ("NVIDIA A10G", "fp32", 31.2e12),
        ("NVIDIA L40S", "bf16", 362e12),
        ("NVIDIA L4", "bf16", 121e12),
        ("Tesla V100-SXM2-16GB", "tf32", 15.7e12),  # no TF32 on Volta: plain fp32
        ("Tesla T4", "bf16", None),  # no bf16 on Turing
        ("Some Unknown Accelerator", "bf16", None),
    ],
)
def test_peak_flops_lookup(name, compute, expected):
    assert peak_flops_for(name, compute) == expected


@pytest.mark.parametrize(
    "precision, tf32, expected",
    [
        ("bf16-mixed", False, "bf16"),
        ("bf16-true", False, "bf16"),
        ("16-mixed", False, "fp16"),
        ("32-true", True, "tf32"),
        ("32-true", False, "fp32"),
        ("64-true", False, "fp64"),
        ("transformer-engine", False, "fp8"),
    ],
)
def test_compute_precision(precision, tf32, expected):
    assert compute_precision(precision, tf32) == expected


def test_step_clock_on_cpu_and_process_memory():
    clock = StepClock(torch.device("cpu"))
    start = clock.mark()
    time.sleep(0.01)
    end = clock.mark()
    clock.wait(end)  # no-op on CPU
    assert clock.elapsed_ms(start, end) >= 9.0
    assert process_rss_bytes() > 10 * 2**20
    assert peak_rss_bytes() >= process_rss_bytes() * 0.5


def test_loss_outliers_names_the_odd_rank_among_many_and_both_of_two():
    assert loss_outliers([2.0, 2.1, 1.9, 6.0], 0.5) == ([3], pytest.approx(2.05))
    assert loss_outliers([2.0, 2.1, 1.9, 2.2], 0.5)[0] == []
    assert loss_outliers([2.0, 6.0], 0.5) == ([0, 1], 2.0)  # two ranks: no majority, both named
    assert loss_outliers([2.0, 2.5], 0.5)[0] == []
    assert loss_outliers([2.0, float("nan"), 2.1, 9.0], 0.5)[0] == [3]  # non-finite losses are TFD505's business
    assert loss_outliers([float("nan"), 2.0], 0.5)[0] == []


def test_checksum_comparison_treats_two_nans_as_equal_and_nan_against_a_number_as_different():
    nan = float("nan")
    assert differing_ranks([[1.0, nan], [1.0, nan]]) == []
    assert differing_ranks([[1.0, nan], [1.0, nan], [1.0, 2.0]]) == [2]
    assert differing_tensors([[1.0, nan], [1.0, nan]], ["a", "b"]) == []
    assert differing_tensors([[1.0, nan], [1.0, 2.0]], ["a", "b"]) == ["b"]


# ---------------------------------------------------------------------------------------------------- decisions
def row(**values):
    base = dict(
        tokens=800.0,
        positions=1000.0,
        samples=8.0,
        wall_s=2.0,
        wait_s=0.1,
        step_ms=20.0,
        baseline_ms=20.0,
        peak=2**30,
        reserved=2**31,
        capacity=2**34,
        other_extra=0.0,
        new_graphs=float("nan"),
        limit_hits=float("nan"),
        delay_rise_ms=0.0,
        trimmed_positions=1000.0,
        cpu_ratio=1.0,
        mean_ratio=float("nan"),
        reference_ratio=float("nan"),
    )
    base.update(values)
    return base


def test_throughput_metrics_sum_work_over_ranks_and_take_the_worst_rank_for_time_and_memory():
    from lightning_tfdebug.functional.throughput_checks import SLOTS, rows_to_stats, throughput_metrics

    stats = rows_to_stats([[row()[k] for k in SLOTS], [row(wall_s=4.0, wait_s=2.0, peak=2**32)[k] for k in SLOTS]])
    metrics = throughput_metrics(stats, flops_per_token=10.0, peak_flops=1000.0)
    assert metrics["throughput/tokens_per_sec"] == 400.0  # 1600 tokens over the slowest rank's 4 s
    assert metrics["throughput/tokens_per_sec_per_device"] == 200.0
    assert metrics["throughput/padding_frac"] == pytest.approx(0.2)
    assert metrics["throughput/dataloader_wait_frac"] == 0.5
    assert metrics["memory/peak_allocated_gib"] == 4.0 and metrics["memory/reserved_gib"] == 2.0
    assert metrics["throughput/mfu"] == pytest.approx(10.0 * 200.0 / 1000.0)
    assert "throughput/mfu" not in throughput_metrics(stats)


def test_diagnosis_needs_patience_and_tells_contention_from_a_slowdown():
    from lightning_tfdebug.functional.throughput_checks import ThroughputDiagnosis, throughput_metrics

    def codes(diagnosis, stats, times):
        out = []
        for _ in range(times):
            out.append([v.code for v in diagnosis.update(throughput_metrics(stats), stats)])
        return out

    slow_padded = [row(wait_s=1.0, tokens=500.0, step_ms=40.0)]
    assert codes(ThroughputDiagnosis(patience=2), slow_padded, 2) == [[], ["TFD601", "TFD602", "TFD603"]]
    contended = [row(step_ms=40.0, other_extra=8.0, delay_rise_ms=15.0)]
    assert codes(ThroughputDiagnosis(patience=2), contended, 2) == [[], ["TFD605"]]
    self_inflicted = [row(step_ms=40.0, other_extra=8.0, delay_rise_ms=0.0)]  # others took the cores it left
    assert codes(ThroughputDiagnosis(patience=2), self_inflicted, 2) == [[], ["TFD603"]]
    # a machine already full: others cannot take more cores, they take a larger share of them. The run waits for a core
    # for the extra time and its CPU time per step rises less than its step time (only its spinning threads): contended
    full = [row(step_ms=40.0, other_extra=0.05, delay_rise_ms=15.0, cpu_ratio=1.75)]  # spinning threads: 0.75x
    assert codes(ThroughputDiagnosis(patience=2), full, 2) == [[], ["TFD605"]]
    # on the same full machine, a run that does twice the work per step also waits longer for a core (it is
    # runnable for longer); its CPU time per step doubled with its step time: its own slowdown
    heavier = [row(step_ms=40.0, other_extra=0.05, delay_rise_ms=15.0, cpu_ratio=1.95)]
    assert codes(ThroughputDiagnosis(patience=2), heavier, 2) == [[], ["TFD603"]]
    unknown = [row(step_ms=40.0, other_extra=0.05, delay_rise_ms=float("nan"), cpu_ratio=1.0)]  # no schedstat
    assert codes(ThroughputDiagnosis(patience=2), unknown, 2) == [[], ["TFD603"]]
    # a slowdown is lost time: a median that rose while the mean step time over the same steps did not is the shape of
    # the step times changing under time slicing, not a slower run
    reshuffled = [row(step_ms=40.0, mean_ratio=1.1)]
    assert codes(ThroughputDiagnosis(patience=2), reshuffled, 2) == [[], []]
    assert codes(ThroughputDiagnosis(patience=2), [row(step_ms=40.0, mean_ratio=1.9)], 2) == [[], ["TFD603"]]
    assert codes(ThroughputDiagnosis(patience=2), [row()], 3) == [[], [], []]


def test_a_machine_that_got_slower_is_told_from_a_run_that_did_by_a_fixed_reference_computation():
    from lightning_tfdebug.functional.throughput_checks import ThroughputDiagnosis, throughput_metrics

    def verdicts(stats, times=2):
        diagnosis = ThroughputDiagnosis(patience=2)
        return [diagnosis.update(throughput_metrics(stats), stats) for _ in range(times)][-1]

    # The step time doubled with no run-queue wait and no other process's CPU use (what a hypervisor taking the CPU,
    # a lower clock or a saturated memory bus look like from inside): the reference computation slowed 1.9x too.
    stolen = [row(step_ms=40.0, other_extra=0.0, delay_rise_ms=0.0, cpu_ratio=1.0, reference_ratio=1.9)]
    [verdict] = verdicts(stolen)
    assert verdict.code == "TFD605" and verdict.severity is None  # the rule's severity: info
    assert "reference computation" in verdict.message and "1.90x" in verdict.message
    assert verdict.evidence["reference_ratio"] == 1.9 and verdict.evidence["ratio_to_early"] == 2.0
    # a lower clock: the run's CPU time per step rose with its step time (the same CPU per second), and so did the
    # reference's
    lower_clock = row(step_ms=40.0, cpu_ratio=2.0, mean_ratio=2.0, reference_ratio=1.8)
    assert [v.code for v in verdicts([lower_clock])] == ["TFD605"]
    # no /proc at all (macOS): the reference alone tells
    unknown = dict(other_extra=float("nan"), delay_rise_ms=float("nan"), cpu_ratio=float("nan"))
    [verdict] = verdicts([row(step_ms=40.0, reference_ratio=2.1, **unknown)])
    assert verdict.code == "TFD605" and "nan" not in verdict.message
    # the run slowed itself: the reference computation runs as fast as it did on the early steps
    [verdict] = verdicts([row(step_ms=40.0, reference_ratio=1.05)])
    assert verdict.code == "TFD603" and verdict.evidence["reference_ratio"] == 1.05
    assert [v.code for v in verdicts([row(step_ms=40.0, reference_ratio=1.05, **unknown)])] == ["TFD603"]
    # slower by less than half the step's rise: not the machine's doing (1.4x against a 3x step time)
    assert [v.code for v in verdicts([row(step_ms=60.0, reference_ratio=1.4)])] == ["TFD603"]
    # the run's own threads took the cores: the reference slowed, but the run used 1.75x the CPU per second it did
    # early on (a busy thread of its own)
    [verdict] = verdicts([row(step_ms=40.0, cpu_ratio=3.5, mean_ratio=2.0, reference_ratio=1.9)])
    assert verdict.code == "TFD603"
    # not timed (NaN): the other readings decide as before
    assert [v.code for v in verdicts([row(step_ms=40.0)])] == ["TFD603"]


def test_padding_waste_is_info_until_padding_is_most_of_the_positions_then_a_warning_with_the_speedups():
    from lightning_tfdebug.functional.throughput_checks import ThroughputDiagnosis, throughput_metrics

    def padding_verdict(stats):
        diagnosis = ThroughputDiagnosis(patience=1)
        return next(v for v in diagnosis.update(throughput_metrics(stats), stats) if v.code == "TFD602")

    moderate = [row(tokens=600.0), row(tokens=600.0)]  # 40% padding over two ranks
    verdict = padding_verdict(moderate)
    assert verdict.severity == "info" and verdict.evidence["padding_frac"] == pytest.approx(0.4)
    assert verdict.evidence["speedup_packing"] == pytest.approx(2000 / 1200)
    # 90% padding, and every batch padded to a fixed length 4x its longest row: a warning naming both remedies
    wasteful = [row(tokens=100.0, trimmed_positions=250.0), row(tokens=100.0, trimmed_positions=250.0)]
    verdict = padding_verdict(wasteful)
    assert verdict.severity == "warning" and verdict.evidence["padding_frac"] == pytest.approx(0.9)
    assert verdict.evidence["speedup_packing"] == pytest.approx(10.0)
    assert verdict.evidence["speedup_trim_to_longest"] == pytest.approx(4.0)
    assert "10.0x fewer positions" in verdict.message and "4.0x fewer" in verdict.message
    # the padding is spread over the rows (no column is padding in every row): trimming gains nothing, packing does
    verdict = padding_verdict([row(tokens=300.0)])
    assert verdict.severity == "warning" and verdict.evidence["speedup_trim_to_longest"] == 1.0
    assert "longest sequence" not in verdict.message


def test_diagnosis_of_memory_and_compilation():
    from lightning_tfdebug.functional.throughput_checks import ThroughputDiagnosis, throughput_metrics

    diagnosis = ThroughputDiagnosis(patience=2)
    full = [row(reserved=0.95 * 2**34)]
    [verdict] = diagnosis.update(throughput_metrics(full), full)
    assert verdict.code == "TFD604" and verdict.evidence["memory_frac"] == pytest.approx(0.95)
    verdicts = []
    for graphs in (1.0, 2.0, 3.0):
        stats = [row(new_graphs=graphs, limit_hits=1.0 if graphs == 3.0 else 0.0)]
        verdicts.append([v.code for v in diagnosis.update(throughput_metrics(stats), stats)])
    assert verdicts == [[], [], ["TFD606", "TFD607"]]


# ---------------------------------------------------------------------------------------------------- per-rank
def rank_row(**values):
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
    return base


def test_per_rank_metrics_and_spreads():
    from lightning_tfdebug.functional.rank_checks import per_rank_metrics

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
    from lightning_tfdebug.functional.rank_checks import RankDiagnosis

    def run(stats, times=2, checksums=(), names=()):
        diagnosis = RankDiagnosis(patience=2)
        return [[(v.code, key) for v, key in diagnosis.update(stats, list(checksums), names, 7)] for _ in range(times)]

    assert run([rank_row(), rank_row()]) == [[], []]
    assert run([rank_row(loss=float("nan"))], times=1) == [[("TFD505", None)]]
    same = [rank_row(fingerprint=11.0), rank_row(fingerprint=11.0), rank_row(fingerprint=12.0)]
    assert run(same) == [[], [("TFD501", None)]]
    slow = [rank_row(), rank_row(busy_ms=200.0), rank_row()]
    assert run(slow) == [[], [("TFD503", "rank1")]]
    far = [rank_row(), rank_row(), rank_row(loss=9.0)]
    assert run(far) == [[], [("TFD504", "rank2")]]
    assert run([rank_row(), rank_row(loss=9.0)]) == [[], [("TFD504", "pair")]]
    [[(code, _)]] = run([rank_row(), rank_row()], times=1, checksums=[[1.0, 2.0], [1.0, 2.5]], names=["w"])
    assert code == "TFD502"


def test_agreement_sums_tell_whether_replicas_agree_whatever_the_world_size():
    """Issue 25: PerRankLogger compares per-tensor checksums through sums of a fixed size (8 per value) instead of
    gathering every rank's vector: within rtol/2 they agree, beyond rtol they differ, nan/inf/zero/sign count."""
    import torch

    from lightning_tfdebug.functional.rank_checks import agreement_sums, disagreeing, disagreeing_tensors

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


def test_the_reference_computation_spans_its_time_on_the_cpu_and_leaves_the_users_generator_alone():
    from lightning_tfdebug.functional import throughput

    state = torch.get_rng_state()
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)  # a user's default: the reference stays CPU float32, comparable over a fit
    try:
        start = time.perf_counter()
        per_round = throughput.reference_work_ms(span_ms=5.0)
        spent_ms = (time.perf_counter() - start) * 1e3
    finally:
        torch.set_default_dtype(default)
    assert torch.equal(torch.get_rng_state(), state)
    assert spent_ms >= 5.0 and 0 < per_round <= spent_ms / 2  # two rounds at least, and the mean of the rounds
    assert all(b.device.type == "cpu" and b.dtype == torch.float32 for b in throughput._REFERENCE_BUFFERS)
