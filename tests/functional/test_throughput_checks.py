"""ThroughputMonitor's rules (functional/throughput_checks.py) with plain numbers: one row per rank in, verdicts out."""

import math

import pytest

from lightning_tfdebug.functional.throughput_checks import (
    KEYS,
    ThroughputDiagnosis,
    ThroughputRow,
    compile_limit_verdict,
    contended,
    memory_verdict,
    throughput_metrics,
)


def row(**values):
    """One rank's row of a healthy measurement, with ``values`` changed."""
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
        new_graphs=float("nan"),
        limit_hits=float("nan"),
        trimmed_positions=1000.0,
        contention_ratio=1.0,
        cpu_ratio=1.0,
        mean_ratio=float("nan"),
        reference_ratio=float("nan"),
        parallel_ratio=float("nan"),
    )
    base.update(values)
    return ThroughputRow(**base)


def test_throughput_metrics_sum_work_over_ranks_and_take_the_worst_rank_for_time_and_memory():
    stats = [row(), row(wall_s=4.0, wait_s=2.0, peak=2**32)]
    metrics = throughput_metrics(stats, flops_per_token=10.0, peak_flops=1000.0)
    assert metrics["throughput/tokens_per_sec"] == 400.0  # 1600 tokens over the slowest rank's 4 s
    assert metrics["throughput/tokens_per_sec_per_device"] == 200.0
    assert metrics["throughput/padding_frac"] == pytest.approx(0.2)
    assert metrics["throughput/dataloader_wait_frac"] == 0.5
    assert metrics["memory/peak_allocated_gib"] == 4.0 and metrics["memory/reserved_gib"] == 2.0
    assert metrics["throughput/mfu"] == pytest.approx(10.0 * 200.0 / 1000.0)
    assert "throughput/mfu" not in throughput_metrics(stats)


def test_diagnosis_needs_patience_and_tells_contention_from_a_slowdown():
    def codes(stats, times=2):
        diagnosis = ThroughputDiagnosis(patience=2)
        return [[v.code for v in diagnosis.update(throughput_metrics(stats), stats)] for _ in range(times)]

    assert codes([row(wait_s=1.0, tokens=500.0, step_ms=40.0)]) == [[], ["TFD601", "TFD602", "TFD603"]]
    # other processes took the cores: the same work waited 1.6x as long for a core, as much as the step time rose
    assert codes([row(step_ms=40.0, contention_ratio=1.6)]) == [[], ["TFD605"]]
    # spinning torch threads amplify contention: the step 9.4x, the CPU per step 4.4x (measured), the wait 2.1x
    spinning = row(step_ms=188.0, mean_ratio=9.4, cpu_ratio=4.4, contention_ratio=2.1)
    assert codes([spinning]) == [[], ["TFD605"]]
    # on a crowded machine, twice the work per step: the CPU per step doubled with the step time, the wait per CPU
    # second did not move (the run waits longer only because it runs longer): its own slowdown
    assert codes([row(step_ms=40.0, cpu_ratio=1.95, contention_ratio=1.05)]) == [[], ["TFD603"]]
    # a sleep, I/O or a device: no more CPU, no more waiting per CPU second, the reference as fast as before
    assert codes([row(step_ms=80.0, cpu_ratio=1.0, reference_ratio=1.05)]) == [[], ["TFD603"]]
    # nothing measured (no /proc, the reference not timed): a slowdown is the run's
    unknown = dict(contention_ratio=float("nan"), cpu_ratio=float("nan"))
    assert codes([row(step_ms=40.0, **unknown)]) == [[], ["TFD603"]]
    # a slowdown is lost time: a median that rose while the mean over the same steps did not is the shape of the step
    # times changing under time slicing, not a slower run
    assert codes([row(step_ms=40.0, mean_ratio=1.1)]) == [[], []]
    assert codes([row(step_ms=40.0, mean_ratio=1.9, cpu_ratio=1.9)]) == [[], ["TFD603"]]
    assert codes([row()], 3) == [[], [], []]


def test_a_machine_that_got_slower_is_told_from_a_run_that_did_by_a_fixed_reference_computation():
    def verdicts(stats, times=2):
        diagnosis = ThroughputDiagnosis(patience=2)
        return [diagnosis.update(throughput_metrics(stats), stats) for _ in range(times)][-1]

    # the step time doubled with no wait for a core (steal, a lower clock): the reference slowed 1.9x too
    [verdict] = verdicts([row(step_ms=40.0, reference_ratio=1.9)])
    assert verdict.code == "TFD605" and verdict.severity is None  # the rule's severity: info
    assert "reference computation ran 1.90x slower" in verdict.message
    assert verdict.evidence["reference_ratio"] == 1.9 and verdict.evidence["ratio_to_early"] == 2.0
    # a lower clock: the CPU time per step rose with the step time (the same CPU per second), and the reference's
    assert [v.code for v in verdicts([row(step_ms=40.0, cpu_ratio=2.0, mean_ratio=2.0, reference_ratio=1.8)])] == [
        "TFD605"
    ]
    # without /proc the reference's wall time carries the scheduler's luck: CPU per step that rose with the step
    # time is the run's own work
    more_work = row(step_ms=40.0, cpu_ratio=2.0, mean_ratio=2.0, reference_ratio=1.8, contention_ratio=float("nan"))
    assert [v.code for v in verdicts([more_work])] == ["TFD603"]
    # no /proc (macOS): the reference alone tells, and the message quotes only what was measured
    [verdict] = verdicts([row(step_ms=40.0, reference_ratio=2.1, contention_ratio=float("nan"))])
    assert verdict.code == "TFD605" and "nan" not in verdict.message and "waited" not in verdict.message
    # the run slowed itself: the reference runs as fast as it did early on, or slowed by less than half the rise
    [verdict] = verdicts([row(step_ms=40.0, cpu_ratio=2.0, reference_ratio=1.05)])
    assert verdict.code == "TFD603" and verdict.evidence["reference_ratio"] == 1.05
    assert [v.code for v in verdicts([row(step_ms=60.0, cpu_ratio=3.0, reference_ratio=1.4)])] == ["TFD603"]
    # its own threads took the cores: the reference slowed, but the run used 1.75x the CPU per second it did early on
    assert [v.code for v in verdicts([row(step_ms=40.0, cpu_ratio=3.5, mean_ratio=2.0, reference_ratio=1.9)])] == [
        "TFD603"
    ]


def test_padding_waste_is_info_until_padding_is_most_of_the_positions_then_a_warning_with_the_speedups():
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
    diagnosis = ThroughputDiagnosis(patience=2)
    full = [row(reserved=0.95 * 2**34)]
    [verdict] = diagnosis.update(throughput_metrics(full), full)
    assert verdict.code == "TFD604" and verdict.evidence["memory_frac"] == pytest.approx(0.95)
    verdicts = []
    for graphs in (1.0, 2.0, 3.0):
        stats = [row(new_graphs=graphs, limit_hits=1.0 if graphs == 3.0 else 0.0)]
        verdicts.append([v.code for v in diagnosis.update(throughput_metrics(stats), stats)])
    assert verdicts == [[], [], ["TFD606", "TFD607"]]


def verdicts_after(diagnosis, rows, times):
    """The verdicts of the last of ``times`` identical measurements."""
    out = []
    for _ in range(times):
        out = diagnosis.update(throughput_metrics(rows), rows, step=7)
    return out


def test_every_key_the_metrics_compute_is_declared():
    declared = {key.name for key in KEYS}
    assert set(throughput_metrics([row()], flops_per_token=1.0, peak_flops=1.0)) == declared


def test_tfd601_data_loading_bound_on_the_worst_rank_after_patience():
    rows = [row(wait_s=0.2), row(wait_s=1.0)]  # 10% and 50% of 2 s
    [verdict] = verdicts_after(ThroughputDiagnosis(patience=2), rows, 2)
    assert verdict.code == "TFD601" and verdict.step == 7
    assert verdict.evidence["dataloader_wait_frac"] == 0.5 and verdict.evidence["worst_rank"] == 1
    assert "50% of wall time" in verdict.message and "(threshold 20%) for 2 measurements" in verdict.message
    assert verdicts_after(ThroughputDiagnosis(patience=2), rows, 1) == []  # not sustained yet
    assert verdicts_after(ThroughputDiagnosis(patience=1), [row(wait_s=0.4)], 1) == []  # 20%: not above


def test_tfd603_names_the_ratio_and_what_ruled_contention_out():
    [verdict] = verdicts_after(ThroughputDiagnosis(patience=2), [row(step_ms=50.0), row(step_ms=30.0)], 2)
    assert verdict.code == "TFD603" and verdict.evidence["ratio_to_early"] == 2.5
    assert verdict.evidence["step_time_ms"] == 50.0 and verdict.evidence["contention_ratio"] == 1.0
    assert "rose to 50.0 ms, 2.50x the early steps' median, for 2 measurements" in verdict.message
    assert verdicts_after(ThroughputDiagnosis(patience=1), [row(step_ms=30.0)], 1) == []  # 1.5x: not above
    assert verdicts_after(ThroughputDiagnosis(patience=1), [row(step_ms=40.0, baseline_ms=math.nan)], 1) == []


def test_tfd605_quotes_the_contended_row_through_a_dip_in_the_readings():
    diagnosis = ThroughputDiagnosis(patience=3)
    contended_row = row(step_ms=40.0, contention_ratio=2.5)
    for rows in ([contended_row], [row(step_ms=40.0)], [row(step_ms=40.0)]):  # contended once, then no sign of load
        found = diagnosis.update(throughput_metrics(rows), rows, step=9)
    [verdict] = found
    assert verdict.code == "TFD605" and verdict.evidence["contention_ratio"] == 2.5
    assert "waited 2.50x as long for a CPU core per second of work" in verdict.message
    assert verdict.message.endswith("not reported as a slowdown of the run itself (TFD603).")
    # back to speed: the streak and its row are gone
    assert verdicts_after(diagnosis, [row()], 1) == [] and diagnosis.contended_row is None


def test_contended_with_plain_numbers():
    slow = dict(step_ms=40.0, baseline_ms=20.0)  # 2x
    assert contended(row(**slow, contention_ratio=1.5), 1.5)  # the machine explains half the rise
    assert not contended(row(**slow, contention_ratio=1.49, cpu_ratio=2.0), 1.5)
    # 3x: 1.6x contended explains less than half the rise, but half its rise per unit of work (3 / 1.5 = 2x)
    assert contended(row(step_ms=60.0, contention_ratio=1.6, cpu_ratio=1.5), 1.5)
    assert not contended(row(step_ms=60.0, contention_ratio=1.6, cpu_ratio=2.9), 1.5)
    assert not contended(row(**slow, contention_ratio=1.2, cpu_ratio=1.0), 1.5)  # too little to tell: the run's
    assert not contended(row(contention_ratio=9.0), 1.5)  # not slow at all
    # asleep: a wait per CPU second that rose with a sleep (its wake-ups) is not the machine's
    assert not contended(row(step_ms=80.0, contention_ratio=1.9, cpu_ratio=1.0), 1.5)


def test_threads_spinning_under_contention_are_told_from_more_work_by_the_parallel_reference():
    """Measured: a T5 run beside another job's 2-thread torch ranks, loaded from its first step: the step time 8.5x,
    its CPU per step 12.7x (threads spinning at barriers while a peer waits for a core), its run-queue wait per CPU
    second unchanged and the one-thread reference 1.2x. Those numbers alone read as more work (TFD603); the same fixed
    computation at the run's thread count, waits left in, slowing as the steps did is the machine's."""
    spinning = dict(step_ms=170.0, baseline_ms=20.0, contention_ratio=1.0, cpu_ratio=12.65, reference_ratio=1.2)
    assert not contended(row(**spinning), 1.5)
    assert contended(row(**spinning, parallel_ratio=6.0), 1.5)
    assert not contended(row(**spinning, parallel_ratio=1.3), 1.5)  # the run's own work, on a steady machine
    diagnosis = ThroughputDiagnosis(patience=2)
    [verdict] = verdicts_after(diagnosis, [row(**spinning, parallel_ratio=6.0)], 2)
    assert verdict.code == "TFD605" and verdict.evidence["parallel_ratio"] == 6.0
    assert "6.00x slower at the run's thread count" in verdict.message


def test_tfd604_memory_on_the_fullest_rank():
    rows = [row(peak=2**30, capacity=2**34), row(reserved=15 * 2**30, capacity=2**34)]
    verdict = memory_verdict(rows, 4.0, 0.9, step=3)
    assert verdict.code == "TFD604" and verdict.evidence == {"memory_frac": 15 / 16, "peak_allocated_gib": 4.0}
    assert "reached 94% of capacity on rank 1 (threshold 90%)" in verdict.message and verdict.step == 3
    assert memory_verdict(rows, 4.0, 0.95) is None
    assert memory_verdict([row(capacity=0.0)], 4.0, 0.1) is None  # capacity unknown


def test_tfd606_needs_new_graphs_at_each_measurement_and_tfd607_any_limit_hit():
    diagnosis = ThroughputDiagnosis(patience=2)
    found = [verdicts_after(diagnosis, [row(new_graphs=graphs)], 1) for graphs in (0.0, 2.0, 5.0, 5.0)]
    assert [[v.code for v in f] for f in found] == [[], [], ["TFD606"], []]
    assert found[2][0].evidence == {"new_graphs": 5.0} and "5 new graph(s)" in found[2][0].message
    verdict = compile_limit_verdict([row(limit_hits=0.0), row(limit_hits=2.0)])
    assert verdict.code == "TFD607" and verdict.evidence == {"limit_hits": 2.0} and "2 time(s)" in verdict.message
    assert compile_limit_verdict([row(limit_hits=0.0)]) is None and compile_limit_verdict([row()]) is None
