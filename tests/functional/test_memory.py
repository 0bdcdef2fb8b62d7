import random

import pytest
import torch

from lightning_tfdebug.functional.memory import (
    BUDGET_FLOOR,
    MIB,
    WeightSnapshot,
    budget_bytes,
    chunked_sum,
    chunked_sums,
    default_budget_bytes,
    group_snapshot_bytes,
    plan_notes,
    plan_snapshot,
    training_state_bytes,
)


# ---------------------------------------------------------------------------------------------------------- budget
def test_the_default_budget_is_two_percent_of_the_training_state_or_32_mib():
    assert default_budget_bytes(0) == BUDGET_FLOOR == 32 * MIB
    assert default_budget_bytes(1000 * MIB) == 32 * MIB  # 2% is 20 MiB: the floor wins
    assert default_budget_bytes(1600 * MIB) == 32 * MIB  # exactly 2%
    assert default_budget_bytes(16 * 1024 * MIB) == int(0.02 * 16 * 1024 * MIB)  # 1B parameters under AdamW
    assert budget_bytes(None, 16 * 1024 * MIB) == default_budget_bytes(16 * 1024 * MIB)
    assert budget_bytes(1.5, 16 * 1024 * MIB) == int(1.5 * MIB)  # set by the user: the state does not matter
    assert budget_bytes(float("inf"), 0) >= 2**62


def test_the_training_state_is_weights_gradients_and_optimizer_state():
    model = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.Linear(4, 2))  # 36 + 10 parameters in 4 tensors
    optimizer = torch.optim.AdamW(model.parameters())
    params = list(model.parameters())
    assert training_state_bytes(params, [optimizer]) == 46 * 4  # no gradient, no state yet
    model(torch.randn(3, 8)).sum().backward()
    assert training_state_bytes(params, [optimizer]) == 46 * 4 * 2
    optimizer.step()  # exp_avg and exp_avg_sq in fp32, and a scalar fp32 step count per tensor
    assert training_state_bytes(params, [optimizer]) == 46 * 4 * 4 + 4 * 4


def test_group_snapshot_sizes_count_four_bytes_per_element_whatever_the_dtype():
    assert group_snapshot_bytes([10, 20, 5, 1], [0, 1, 0, 2], 3) == [60, 80, 4]


# ------------------------------------------------------------------------------------------------------------ plan
def test_a_snapshot_that_fits_is_one_part_of_every_group():
    plan = plan_snapshot([100, 200, 50], 350)
    assert plan.whole and plan.parts == ((0, 1, 2),) and plan.too_large == ()
    assert all(plan.part_at(m) == (0, 1, 2) for m in range(5))
    assert plan_notes(plan, ["a", "b", "c"]) == []


def test_parts_fit_the_budget_and_every_group_is_measured_within_len_parts_measuring_steps():
    rng = random.Random(0)
    for _ in range(200):
        sizes = [rng.randint(1, 1000) for _ in range(rng.randint(1, 20))]
        budget = rng.randint(1, sum(sizes))
        plan = plan_snapshot(sizes, budget)
        fits = [g for g, size in enumerate(sizes) if size <= budget]
        assert sorted(plan.too_large) == [g for g, size in enumerate(sizes) if size > budget]
        assert all(sum(sizes[g] for g in part) <= budget for part in plan.parts)
        assert plan.largest_part <= budget
        assert sorted(g for part in plan.parts for g in part) == fits  # each fitting group in exactly one part
        for start in range(3):  # any len(parts) consecutive measuring steps cover every group that fits
            seen = {g for m in range(start, start + len(plan.parts)) for g in plan.part_at(m)}
            assert seen == set(fits)
        # first fit: no two parts could be merged, so the parts are at most twice the fewest possible
        assert len(plan.parts) <= max(1, 2 * -(-sum(sizes[g] for g in fits) // budget))


def test_the_plan_of_the_issue_decoder_at_the_default_budget():
    # TinyGPT(d_model=512, n_layers=8): blocks of 12.6 MB, AdamW state of 16 bytes per parameter (408 MB: 2% is 8 MB)
    names = ["embeddings", *[f"blocks.{i}" for i in range(8)], "other", "head"]
    sizes = group_snapshot_bytes([165_376, *[3_152_384] * 8, 1024, 132_608], range(11), 11)
    budget = budget_bytes(None, 16 * 25_518_080)
    plan = plan_snapshot(sizes, budget)
    assert budget == 32 * MIB and len(plan.parts) == 4 and not plan.too_large
    assert plan.largest_part <= budget < sum(sizes)
    [(check, reason, setting)] = plan_notes(plan, names)
    assert check == "update ratio of every group on every measuring step"
    assert "once every 4 measuring steps" in reason and setting == "`memory_budget_mb` >= 97.3"


def test_a_budget_too_small_for_some_groups_measures_those_that_fit_and_names_the_others():
    plan = plan_snapshot([400, 50, 300, 20], 100)
    assert plan.parts == ((1, 3),) and plan.too_large == (0, 2)
    [(check, reason, setting)] = plan_notes(plan, ["embeddings", "norm", "blocks.0", "bias"])
    assert check == "update ratio of embeddings, blocks.0" and "never measured" in reason
    assert setting.startswith("`memory_budget_mb` >= 0.0")
    none_fit = plan_snapshot([400, 300], 100)
    assert none_fit.parts == () and none_fit.part_at(7) == () and none_fit.too_large == (0, 1)


# ------------------------------------------------------------------------------------------------------- snapshots
@pytest.mark.parametrize("budget", [116, 100, 20])
def test_a_snapshot_in_parts_measures_its_groups_exactly_and_tells_whether_the_others_changed(budget):
    group_of = [0, 1, 2, 0]  # groups of 84, 16 and 16 bytes: whole at 116, parts (0, 1), (2,) at 100
    for measurement in range(3):
        torch.manual_seed(0)
        weights = [torch.randn(5, 3), torch.randn(4), torch.randn(2, 2), torch.randn(6)]
        snapshot = WeightSnapshot([w.numel() for w in weights], group_of, torch.tensor(group_of), 3, None)
        snapshot.replan(budget)
        part = None if snapshot.plan.whole else snapshot.plan.part_at(measurement)
        before = [w.clone() for w in weights]
        snapshot.take(weights, measurement)
        assert snapshot.taken
        for w in weights[:3]:  # the last tensor of group 0 does not change
            w.add_(0.01 * torch.randn_like(w))
        delta_sq, param_sq, measured = snapshot.change(weights)
        assert not snapshot.taken
        true_delta = [
            sum(((w - b) ** 2).sum() for w, b, g in zip(weights, before, group_of) if g == k) for k in range(3)
        ]
        squares = [sum((w**2).sum() for w, g in zip(weights, group_of) if g == k) for k in range(3)]
        old = [sum((b**2).sum() for b, g in zip(before, group_of) if g == k) for k in range(3)]
        assert param_sq.tolist() == pytest.approx([float(s) for s in squares], rel=1e-6)
        if part is None:
            assert measured is None
            assert delta_sq.tolist() == pytest.approx([float(d) for d in true_delta], rel=1e-5)
            continue
        assert measured == tuple(g in part for g in range(3))
        for g in range(3):
            expected = true_delta[g] if g in part else abs(squares[g] - old[g])
            assert delta_sq[g].item() == pytest.approx(float(expected), rel=1e-3)


def test_a_snapshot_of_weights_that_did_not_change_shows_no_change_in_any_slot():
    weights = [torch.randn(10), torch.randn(3, 3)]
    snapshot = WeightSnapshot([10, 9], [0, 1], torch.tensor([0, 1]), 2, None)
    snapshot.replan(40)  # one group at a time
    snapshot.take(weights, 1)
    delta_sq, _, measured = snapshot.change(weights)
    assert measured == (False, True) and delta_sq.tolist() == [0.0, 0.0]


# ---------------------------------------------------------------------------------------------------- chunked sums
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_a_chunked_float64_sum_equals_the_whole_float64_sum(dtype):
    torch.manual_seed(0)
    x = torch.randn(3 * 1000 + 7).to(dtype)
    whole = x.sum(dtype=torch.float64)
    chunked = chunked_sum(x, chunk=1000)
    assert chunked.dtype == torch.float64 and chunked.shape == ()
    assert chunked.item() == pytest.approx(whole.item(), rel=1e-12, abs=1e-12)
    assert chunked_sum(x) == whole  # one chunk: the same call


def test_a_chunked_sum_is_exact_where_the_whole_one_is():
    x = torch.arange(-5000, 12_345, dtype=torch.float32)
    assert chunked_sum(x, chunk=999).item() == x.sum(dtype=torch.float64).item() == float(sum(range(-5000, 12_345)))


def test_a_chunked_sum_of_a_non_contiguous_tensor_sums_row_blocks():
    torch.manual_seed(0)
    x = torch.randn(300, 70).t()  # 70 rows of 300, not contiguous
    assert not x.is_contiguous()
    assert chunked_sum(x, chunk=1000).item() == pytest.approx(x.sum(dtype=torch.float64).item(), rel=1e-12)
    wide = torch.randn(40, 5000).t()[:, ::2]  # rows larger than a chunk: one row at a time
    assert chunked_sum(wide, chunk=16).item() == pytest.approx(wide.sum(dtype=torch.float64).item(), rel=1e-12)


def test_a_chunked_sum_of_squares_equals_the_whole_one():
    torch.manual_seed(0)
    x = torch.randn(5000)
    whole = x.double().square().sum()
    assert chunked_sum(x, chunk=1000, squares=True).item() == pytest.approx(whole.item(), rel=1e-12)
    assert chunked_sum(x, squares=True) == whole
    assert chunked_sum(x.double(), chunk=1000, squares=True).item() == pytest.approx(whole.item(), rel=1e-12)


class _LargestFloat64:
    """Records the largest float64 tensor any torch op creates while active."""

    def __init__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        largest = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                for t in out if isinstance(out, (tuple, list)) else [out]:
                    if isinstance(t, torch.Tensor) and t.dtype == torch.float64:
                        largest.numel = max(largest.numel, t.numel())
                return out

        self.numel = 0
        self.mode = Mode()


def test_a_chunked_float64_sum_of_a_large_tensor_holds_one_chunk_where_the_whole_sum_copies_it():
    # what the op graph allocates, not the resident set (which depends on the allocator and the machine):
    # no float64 tensor larger than one chunk is created, where `.double().sum()` creates one of the whole tensor
    x = torch.ones(50_000)
    seen = _LargestFloat64()
    with seen.mode:
        total = chunked_sum(x, chunk=1000)
        totals = chunked_sums([x, x[:777], torch.ones(30, 40).t()], chunk=1000, squares=True)
    assert total.item() == 50_000 and totals.tolist() == [50_000, 777, 1200]
    assert 0 < seen.numel <= 1000, seen.numel
    whole = _LargestFloat64()
    with whole.mode:
        x.double().sum()
    assert whole.numel == 50_000  # the observer sees a whole copy where one is made


def test_a_plan_with_no_part_copies_nothing_and_still_tells_whether_the_weights_moved():
    weights = [torch.randn(10), torch.randn(3, 3)]
    snapshot = WeightSnapshot([10, 9], [0, 1], torch.tensor([0, 1]), 2, None)
    snapshot.replan(8)  # smaller than either group
    assert snapshot.plan.parts == () and snapshot.plan.too_large == (0, 1)
    snapshot.take(weights, 0)
    weights[1].mul_(2.0)
    delta_sq, _, measured = snapshot.change(weights)
    assert measured == (False, False) and delta_sq[0] == 0 and delta_sq[1] > 0


def test_chunked_sums_of_many_tensors_are_their_float64_sums_in_one_vector():
    torch.manual_seed(0)
    tensors = [torch.randn(3000), torch.randn(7, 500).t(), torch.tensor(2.5), torch.arange(10), torch.randn(0)]
    sums = chunked_sums(tensors, chunk=1024)
    assert sums.dtype == torch.float64 and sums.shape == (5,)
    expected = [t.sum(dtype=torch.float64).item() for t in tensors]
    assert sums.tolist() == pytest.approx(expected, rel=1e-12, abs=1e-12)
    squares = chunked_sums(tensors, chunk=1024, squares=True)
    assert squares.tolist() == pytest.approx([t.double().square().sum().item() for t in tensors], rel=1e-12)
    assert chunked_sums([]).shape == (0,)
