import math

import pytest
import torch

from lightning_tfdebug.functional.batches import (
    batch_fingerprint,
    combine_fingerprints,
    device_fingerprint,
    host_fingerprint,
)
from lightning_tfdebug.functional.throughput import (
    LoadReading,
    MachineLoad,
    StepTimes,
    WindowCounts,
    batch_counts,
    compute_precision,
    differing_ranks,
    loss_outliers,
    max_over_median,
    median_of_others,
    parameter_checksums,
    peak_flops_for,
    trimmed_positions,
)
from lightning_tfdebug.primitives.batch import BatchKeys, StepBatch


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


def test_differing_ranks_takes_the_majority():
    same = [1.0, 2.0, 3.0, 4.0]
    other = [1.0, 2.5, 3.0, 4.0]
    assert differing_ranks([same, same, other, same]) == [2]
    assert differing_ranks([same, other]) == [1]  # a tie: rank 0's vector is the reference
    assert differing_ranks([same]) == []
    assert differing_ranks([[1.0], [1.0 + 1e-9]]) == [] and differing_ranks([[1.0], [1.0 + 1e-9]], 0.0) == [1]


def test_spreads():
    assert max_over_median([10.0, 10.0, 30.0]) == pytest.approx(3.0)
    assert max_over_median([5.0]) == 1.0
    assert math.isnan(max_over_median([float("nan")]))
    assert median_of_others([1.0, 2.0, 100.0], 2) == 1.5
    assert math.isnan(median_of_others([1.0], 0))


@pytest.mark.parametrize(
    "name, compute, expected",
    [
        ("NVIDIA H100 NVL", "fp16", 835e12),  # per board (Lightning's figure is for a pair)
        ("NVIDIA H100 80GB HBM3", "fp8", 1979e12),  # Lightning has no fp8 column
        ("NVIDIA H100 PCIe", "fp8", 1513e12),
        ("NVIDIA H200", "tf32", 495e12),
        ("NVIDIA GH200 480GB", "bf16", 989e12),
        ("NVIDIA L40S", "bf16", 362e12),  # not an L4
        ("NVIDIA L4", "fp8", 242e12),
        ("NVIDIA A10", "bf16", 125e12),
        ("NVIDIA GeForce RTX 4090", "bf16", 165.2e12),
        ("AMD Instinct MI250X", "tf32", 95.7e12),  # no TF32: plain fp32
        # Lightning's table answers these: ours holds no such chip or no such column
        ("NVIDIA H100 80GB HBM3", "bf16", None),
        ("NVIDIA A100-SXM4-80GB", "tf32", None),  # whole words: not an "a10"
        ("NVIDIA A10G", "fp32", None),
        ("Tesla T4", "bf16", None),
        ("Some Unknown Accelerator", "bf16", None),
    ],
)
def test_peak_flops_of_what_lightning_lacks(name, compute, expected):
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
    assert differing_ranks([[nan], [nan]], 0.0) == []


def test_trimmed_positions_is_rows_times_the_span_of_real_columns():
    """The per-batch padding-to-longest count (few kernels on the hot path) against a loop over the columns: random
    masks of every density, left and right padding, bool and integer masks, and a mask with no real token."""
    g = torch.Generator().manual_seed(0)
    for trial in range(200):
        rows, width = int(torch.randint(1, 5, (1,), generator=g)), int(torch.randint(1, 20, (1,), generator=g))
        mask = (torch.rand(rows, width, generator=g) < torch.rand(1, generator=g)).long()
        if trial % 3 == 0:
            mask = mask.bool()
        real = [c for c in range(width) if bool(mask[:, c].any())]
        expected = rows * (real[-1] - real[0] + 1) if real else 0
        assert int(trimmed_positions(mask, rows * width)) == expected, mask
    left_padded = torch.tensor([[0, 0, 1, 1], [0, 1, 1, 1]])
    assert int(trimmed_positions(left_padded, 8)) == 2 * 3
    assert trimmed_positions(None, 12) == 12  # no mask: every position counts


def test_window_counts_sum_a_window_and_scale_the_sampled_padding_span():
    counts = WindowCounts()
    mask = torch.tensor([[1, 1, 0, 0], [1, 0, 0, 0]])  # real tokens in the first 2 columns
    counts.add(torch.tensor(3), 8, 2, mask, sample=True)
    counts.add(5, 8, 2, None, sample=False)  # not sampled: counted, its span is not read
    window = counts.take(torch.device("cpu"))
    assert float(window["tokens"]) == 8.0 and (window["positions"], window["samples"]) == (16, 4)
    assert float(window["trimmed_positions"]) == 4 * 16 / 8  # the sample's span (2 x 2 of 8), scaled to 16 positions
    empty = counts.take(torch.device("cpu"))  # the next window starts empty
    assert float(empty["tokens"]) == 0.0 and empty["positions"] == 0 and empty["trimmed_positions"] == 0.0


def test_step_times_skip_the_warm_up_then_fill_the_early_window():
    times = StepTimes(window=3, skip_steps=2, baseline_steps=3)
    times.seen = 4
    assert times.add([50.0, 40.0, 10.0, 12.0]) is True  # the first 2 are warm-up
    assert list(times.baseline.values) == [10.0, 12.0] and not times.ready
    assert times.median() == 12.0  # the last 3: 40, 10, 12
    times.seen = 6
    assert times.add([11.0, 30.0]) is True and times.ready and list(times.baseline.values) == [10.0, 12.0, 11.0]
    times.seen = 7
    assert times.add([99.0]) is False  # the early window is full
    assert math.isnan(StepTimes(3, 0, 1).median())


def test_machine_load_reads_the_median_steps_against_the_early_windows():
    load = MachineLoad(window=4)
    # early windows of 2 steps: 10 ms of CPU and 5 ms of run-queue wait per step (1.5x), 20 ms a step
    load.update(2, True, 0.010, 0.020, 0.040)
    first = load.update(2, True, 0.010, 0.020, 0.040)
    assert first == LoadReading(contention_ratio=1.0, cpu_ratio=1.0, mean_ratio=1.0)
    # later windows: the same CPU per step, 25 ms of wait per step (3.5x), 40 ms a step
    load.update(2, False, 0.050, 0.020, 0.080)
    later = load.update(2, False, 0.050, 0.020, 0.080)
    assert len(load.windows) == 2  # the windows since the median's oldest step (window=4)
    assert later.contention_ratio == pytest.approx(3.5 / 1.5) and later.cpu_ratio == pytest.approx(1.0)
    assert later.mean_ratio == pytest.approx(2.0)
    # no /proc: NaN, never a guess
    assert math.isnan(MachineLoad(window=4).update(2, True, math.nan, 0.02, 0.04).contention_ratio)


def test_machine_load_times_the_reference_early_and_on_slow_measurements_only():
    load, timed = MachineLoad(window=4), []

    def reference():
        timed.append(1)
        return 2.0 * len(timed)  # 2 ms, then 4 ms

    assert math.isnan(load.reference_ratio(True, False, reference)) and len(timed) == 1
    assert math.isnan(load.reference_ratio(False, False, reference)) and len(timed) == 1  # not slow: not timed
    assert load.reference_ratio(False, True, reference) == 2.0  # 4 ms now against the early 2 ms
    state = load.state_dict()
    resumed = MachineLoad(window=4)
    resumed.load_state_dict(state)
    assert list(resumed.reference_base.values) == [2.0] and set(state) >= {"reference_baseline", "cpu_baseline"}
