"""MemoryWatch's rules with plain numbers: the fit, the longest possible batch, the forecast over ranks, the
explanation and its ranked remedies, the phase and what counts as out of memory."""

from __future__ import annotations

import math

import pytest
import torch

from lightning_tfdebug.functional import memory_checks as m

MIB = 2**20


def test_the_fit_needs_two_batches_a_quarter_apart_and_follows_their_slope():
    assert m.fit_memory([(100, 500 * MIB)], base=None) is None
    assert m.fit_memory([(100, 500 * MIB), (110, 600 * MIB)], base=None) is None  # 1.1x apart: too close
    fit = m.fit_memory([(100, 300 * MIB), (200, 400 * MIB), (300, 500 * MIB)], base=None)
    assert fit is not None and fit.per_position == pytest.approx(MIB)
    assert fit.at(600) == pytest.approx(800 * MIB) and fit.at(50) == 500 * MIB  # never below the latest reading


def test_the_slope_is_never_steeper_than_all_memory_above_the_base_scaling_with_the_batch():
    # allocator noise: a reading 300 MiB up for 10% more positions; above the base 200 MiB, 1 MiB per position at most
    fit = m.fit_memory([(100, 250 * MIB), (125, 325 * MIB)], base=200 * MIB)
    assert fit is not None and fit.per_position == pytest.approx((325 - 200) * MIB / 125)


def tally(widths: list[int], rows: int = 8) -> m.LengthTally:
    t = m.LengthTally()
    for w in widths:
        t.add(rows, w)
    return t


def test_the_longest_possible_batch_is_the_context_unless_the_batches_show_a_cap():
    growing = tally([8, 16, 24, 32, 40, 48, 12, 20])
    assert m.longest_possible_width(growing, 64) == 64
    assert m.longest_possible_width(growing, None) == 48  # no limit known: the longest seen
    assert m.longest_possible_width(tally([32] * 20), 64) == 32  # packed or padded to a fixed length
    assert m.longest_possible_width(tally([10, 48, 20, 48, 30, 48, 40, 48]), 64) == 48  # truncated at 48
    assert m.longest_possible_width(tally([8, 16, 24]), 64) == 24  # too few batches to tell
    assert tally([8, 16, 16, 64]).median_positions() == 8 * 16


def test_the_forecast_names_the_ranks_that_would_not_fit():
    fits = m.ForecastRow(70 * 2**30, 80 * 2**30, 2048, 8, 1024, 61 * 2**30)
    over = m.ForecastRow(83 * 2**30, 80 * 2**30, 2048, 8, 1024, 61 * 2**30)
    none = m.ForecastRow(-1, 80 * 2**30, -1, -1, -1, -1)
    assert m.forecast_verdict([fits, none], "device") is None
    found = m.forecast_verdict([fits, over, none], "device", step=40)
    assert found is not None and found.code == "TFD620" and found.step == 40
    assert found.evidence["ranks"] == [1]
    assert found.message == (
        "Batches of 2,048 tokens a row (8 rows) would need ~83.00 GiB on rank 1; the device has 80.00 GiB; the longest "
        "so far was 1,024 (61.00 GiB)."
    )


def test_the_remedies_follow_the_numbers():
    long_batch = m.ranked_remedies(4.0, m.MemorySplit(MIB, MIB, 2 * MIB, 100 * MIB, 128 * MIB))
    assert long_batch[0][0].startswith("cap or bucket the lengths (this batch was 4.0x")
    state_heavy = m.ranked_remedies(1.0, m.MemorySplit(20 * MIB, 20 * MIB, 45 * MIB, 90 * MIB, 100 * MIB))
    assert (
        state_heavy[0][0].startswith("shard the training state") and "most of it optimizer state" in state_heavy[0][0]
    )
    activations = m.ranked_remedies(1.1, m.MemorySplit(MIB, MIB, 2 * MIB, 100 * MIB, 128 * MIB))
    assert activations[0][0].startswith("a smaller micro-batch")


def test_the_explanation_sets_the_batch_beside_the_usual():
    t = tally([16] * 9 + [64])
    batch = m.FailingBatch(8, 64, "the training step", "batch 9 of epoch 0 (step 9)", 8 * 16, 9)
    found = m.oom_verdict(batch, t, m.MemorySplit(MIB, MIB, 2 * MIB), rank=1, device="device", when="x")
    assert found.code == "TFD621" and found.evidence["ratio"] == 4.0
    assert "on rank 1, batch 9 of epoch 0 (step 9): its batch was 8 x 64 (512 token positions), against a median " in (
        found.message
    )
    assert "the rest unknown" in found.message and "(1) cap or bucket the lengths" in found.message
    usual = m.oom_verdict(
        m.FailingBatch(8, 16, "validation", "validation batch 0", 8 * 16, 10),
        t,
        m.MemorySplit(MIB, 0, 0),
        rank=0,
        device="device",
        when="x",
    )
    assert usual.evidence["remedy_order"][-1].startswith("cap or bucket")  # not the lengths: their remedy goes last


def test_what_counts_as_out_of_memory_and_where():
    assert m.is_out_of_memory(torch.OutOfMemoryError("CUDA out of memory"))
    assert m.is_out_of_memory(RuntimeError("[enforce fail] DefaultCPUAllocator: can't allocate memory: you tried"))
    assert m.is_out_of_memory(MemoryError())
    assert not m.is_out_of_memory(IndexError("index out of range in self"))
    assert m.failure_phase(["fit", "_run_stage", "save_checkpoint", "dump_checkpoint"], "x") == "checkpoint saving"
    assert m.failure_phase(["fit", "run", "validation_step"], "x") == "validation"
    assert m.failure_phase(["fit", "advance", "training_step", "forward"], "x") == "the training step"
    assert m.failure_phase(["fit", "setup"], "the run") == "the run"
    assert m.size_text(83 * 2**30) == "83.00 GiB" and m.size_text(172 * 2**10) == "172 KiB"
    assert math.isnan(m.LengthTally().median_positions())
