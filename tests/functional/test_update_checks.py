import math
from collections import deque

import pytest
import torch

from lightning_tfdebug.functional.update_checks import (
    growth_harm,
    huge_update,
    left_out_or_rounded,
    norm_change,
    not_in_optimizer,
    stuck_groups,
    tiny_updates,
    update_verdicts,
    weight_decay_per_step,
    weights_growing,
    weights_shrinking,
)
from lightning_tfdebug.functional.updates import (
    GroupFacts,
    UpdateMemory,
    UpdateReading,
    below_resolution,
    expected_step,
    group_facts,
    label_counts,
    loss_fall_per_step,
    loss_still_falling,
    outside_optimizers,
)
from lightning_tfdebug.primitives.tracking import Streak


def test_the_fall_of_the_loss_per_step_is_a_fraction_of_the_loss():
    assert loss_fall_per_step([(10, 2.0), (20, 1.9), (30, 1.8)]) == pytest.approx(0.2 / 2.0 / 20)
    assert loss_fall_per_step([(10, 2.0), (30, 2.1)]) < 0  # rising
    assert math.isnan(loss_fall_per_step([(10, 2.0)]))
    assert math.isnan(loss_fall_per_step([(10, math.nan), (20, 1.0)]))
    # a fine-tune whose loss keeps falling (0.4% per step, measured) against a run from scratch with the learning rate
    # 100x too low (0.02% per step): the updates of the first move the loss, those of the second barely do
    assert loss_still_falling([(10, 0.96), (20, 0.91), (30, 0.88)])
    assert not loss_still_falling([(10, 5.552), (20, 5.545), (30, 5.537)])
    assert not loss_still_falling([(10, 1.0)])  # unknown: the ratio alone decides


def test_label_counts_skip_ignored_and_out_of_range_labels_without_a_sync():
    labels = torch.tensor([[1, 2, 2, -100], [3, 7, 2, 1]])
    counts = label_counts(labels, 5, -100, torch.device("cpu"))
    assert counts.tolist() == [0.0, 2.0, 3.0, 1.0, 0.0]  # 7 is outside the vocabulary, -100 ignored
    assert label_counts(None, 4, -100, torch.device("cpu")).tolist() == [0.0] * 4
    assert label_counts(torch.rand(2, 3), 4, -100, torch.device("cpu")).sum() == 0  # not class indices


def test_outside_optimizers_compares_parameters_by_identity():
    body, head = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    optimizer = torch.optim.AdamW(body.parameters(), lr=1e-3)
    params = [*body.parameters(), *head.parameters()]
    assert outside_optimizers(params, [optimizer]) == [False, False, True, True]
    # no parameter held by any optimizer (copies, flattened views): cannot be told
    assert outside_optimizers(list(head.parameters()), [optimizer]) is None
    assert outside_optimizers(params, []) is None


def test_adam_at_1e_8_cannot_move_fp32_gains_of_one_but_moves_small_matrices():
    eps32, eps16 = torch.finfo(torch.float32).eps, torch.finfo(torch.bfloat16).eps
    assert expected_step(1e-8, adaptive=True, grad_rms=5.0) == 1e-8
    assert expected_step(1e-2, adaptive=False, grad_rms=1e-3) == pytest.approx(1e-5)
    assert below_resolution(1e-8, weight_rms=1.0, eps=eps32)  # half the spacing at 1.0: 6e-8
    assert not below_resolution(1e-8, weight_rms=0.02, eps=eps32)  # 1.2e-9
    assert below_resolution(1e-3, weight_rms=1.0, eps=eps16)  # bf16 gains: 3.9e-3
    assert not below_resolution(1e-8, weight_rms=0.0, eps=eps32)  # zero weights show any step


def test_the_resolution_is_where_fp32_really_rounds_back():
    ones = torch.ones(4)
    half = torch.finfo(torch.float32).eps / 2
    # a step up from 1.0 by less than half the spacing there rounds back; a little more lands on the next float
    assert torch.equal(ones + 0.9 * half, ones) and not torch.equal(ones + 1.1 * half, ones)


# ------------------------------------------------------------------------------------------ the rules, plain numbers
NAMES = ("embed", "norm", "head")


def step_reading(step, ratio=1e-2, lr=3e-4, loss=5.5, delta=None, grad=(1.0, 1.0, 1.0), weights=(1.0, 1.0, 1.0)):
    """A reading whose every group has ``‖W‖ = weights`` and ``‖ΔW‖ = ratio x ‖W‖`` unless ``delta`` says."""
    delta = delta if delta is not None else [(ratio * w) ** 2 for w in weights]
    squares = [*delta, *(w**2 for w in weights), *grad]
    return UpdateReading.from_squares(step, lr, NAMES, squares, loss_sum=loss, loss_batches=1.0)


def test_a_reading_from_squares_and_its_logged_keys():
    r = UpdateReading.from_squares(
        4, 1e-3, ["a", "b"], [9e-6, 16e-6, 9.0, 16.0, 1.0, 4.0], loss_sum=6.0, loss_batches=3
    )
    assert r.total == pytest.approx(1e-3) and r.param_norm_total == pytest.approx(5.0)
    assert r.ratios == {"a": pytest.approx(1e-3), "b": pytest.approx(1e-3)} and r.mean_loss == 2.0
    assert math.isnan(UpdateReading.from_squares(0, 1e-3, ["a"], [0.0, 1.0, 1.0]).mean_loss)  # no loss returned
    assert set(r.scalars(3e-4, 0.3)) == {
        "update_ratio/total",
        "update_ratio/param_norm/total",
        "update_ratio/a",
        "update_ratio/b",
        "update_ratio/param_norm/a",
        "update_ratio/param_norm/b",
        "update_ratio/band/low",
        "update_ratio/band/high",
    }


LN_65 = math.log(65)


def low_lr_run(losses, ln_vocab=LN_65, lr=1e-5, ratio=1.4e-4):
    """The memory and the last reading of a run measured every 10 steps at ``lr``, its mean losses ``losses``."""
    memory, verdict = UpdateMemory(3), None
    for i, loss in enumerate(losses):
        reading = step_reading(10 * i, ratio=ratio, lr=lr, loss=loss)
        memory.observe(reading)
        kwargs = dict(low=3e-4, high=0.3, patience=3, decayed_lr_fraction=0.5, ln_vocab=ln_vocab)
        verdict = tiny_updates(reading, memory, {}, **kwargs)
    return memory, verdict


def test_tiny_updates_while_an_untrained_loss_barely_moves():  # bug 11: lr 100x too low, loss stuck near ln(V)
    _, verdict = low_lr_run([4.17, 4.168, 4.166, 4.164])
    assert verdict.code == "TFD310" and verdict.step == 30 and verdict.evidence["lr"] == 1e-5
    assert verdict.evidence["groups_below"] == list(NAMES) and verdict.evidence["progress_first"] < 0.1
    assert "Updates are tiny: ||dW||/||W|| = 0.00014 (healthy band 0.0003 to 0.3) for 3 measurements" in verdict.message
    assert "fell by only 0.005% of itself per step since step 10" in verdict.message
    assert "is still near ln(V) = 4.174: the model has not learned." in verdict.message


def test_tiny_updates_are_quiet_when_the_loss_falls_the_model_learned_or_the_ratio_is_healthy():
    assert low_lr_run([4.17, 4.0, 3.8, 3.6])[1] is None  # the loss falls by over 0.1% per step: the updates work
    assert low_lr_run([1.5, 1.499, 1.498, 1.497])[1] is None  # a fine-tune: its first loss far below ln(V)
    assert low_lr_run([4.17, 4.168, 4.166, 4.164], ratio=5e-3)[1] is None  # inside the band
    assert low_lr_run([4.17, 4.168])[1] is None  # not yet `patience` measurements
    # unknown vocabulary: the ratio and the loss's fall decide, and the message says nothing about ln(V)
    _, verdict = low_lr_run([4.17, 4.168, 4.166, 4.164], ln_vocab=None)
    assert verdict is not None and "ln(V)" not in verdict.message and "progress_first" not in verdict.evidence


def test_no_tiny_updates_in_a_warm_up_or_a_decayed_schedule():
    memory = UpdateMemory(3)
    kwargs = dict(low=3e-4, high=0.3, patience=3, decayed_lr_fraction=0.5, ln_vocab=None)
    for i, lr in enumerate((1e-6, 2e-6, 4e-6, 8e-6)):  # rising: a warm-up
        reading = step_reading(10 * i, ratio=1e-4, lr=lr)
        memory.observe(reading)
        assert tiny_updates(reading, memory, {}, **kwargs) is None
    assert memory.at_plateau(8e-6, 0.5) is False
    decayed = UpdateMemory(2, peak_lr=1e-3, recent_lr=deque([1e-4, 1e-4]))
    assert not decayed.at_plateau(1e-4, 0.5) and decayed.at_plateau(1e-4, 0.05)


def test_tiny_updates_in_a_warm_up_are_judged_at_the_lr_the_schedule_reaches():
    kwargs = dict(low=3e-4, high=0.3, patience=3, decayed_lr_fraction=0.5, ln_vocab=None)
    for planned, found in ((1e-5, True), (1e-3, False)):  # the rise tops out at 1e-5, or goes on to 1e-3
        memory, verdict = UpdateMemory(3), None
        for i, lr in enumerate((1e-6, 2e-6, 4e-6, 8e-6)):  # ratio 1e-5 at each: 1.25e-5 at 1e-5, 1.25e-3 at 1e-3
            reading = step_reading(10 * i, ratio=1e-5, lr=lr, loss=5.5 - 1e-4 * i)
            memory.observe(reading)
            verdict = tiny_updates(reading, memory, {}, planned_lr=planned, **kwargs)
        assert (verdict is not None) is found
    assert verdict is None
    memory, _ = UpdateMemory(3), None
    for i, lr in enumerate((1e-6, 2e-6, 4e-6, 8e-6)):
        reading = step_reading(10 * i, ratio=1e-5, lr=lr, loss=5.5)
        memory.observe(reading)
        verdict = tiny_updates(reading, memory, {}, planned_lr=1e-5, **kwargs)
    assert verdict.evidence["planned_lr"] == 1e-5 and verdict.evidence["ratio_at_planned_lr"] == pytest.approx(1.25e-5)
    assert "(still rising: 1.25e-05 at the 1e-05 the schedule reaches in this run)" in verdict.message


def test_one_huge_update():  # bug 12: lr 0.1 without warm-up rewrites most of the weights in one step
    verdict = huge_update(step_reading(0, ratio=0.88, lr=0.1), low=3e-4, high=0.3)
    assert verdict.code == "TFD311" and verdict.evidence["groups_above"] == list(NAMES)
    assert verdict.message == (
        "Updates are huge: one optimizer step changed the weights by ||dW||/||W|| = 0.88 (healthy band 0.0003 to 0.3) "
        "at a learning rate of 0.1."
    )
    assert huge_update(step_reading(0, ratio=2.5e-2), low=3e-4, high=0.3) is None


PARAMS = {g: object() for g in NAMES}  # stand-ins for each group's parameter: only their identity matters


def facts(outside=None, eps=1.19e-7):
    return GroupFacts(
        params={g: (id(p),) for g, p in PARAMS.items()},
        numel=dict.fromkeys(NAMES, 100),
        eps=dict.fromkeys(NAMES, eps),
        outside=outside,
    )


def test_a_group_with_gradients_that_never_changes_is_left_out_or_rounded_back():
    # the head got gradients and did not change three measurements in a row; the other groups moved
    streak, still = Streak(), step_reading(0, delta=[1e-6, 1e-6, 0.0])
    assert [stuck_groups(still, streak, patience=3) for _ in range(3)][-1] == ["head"]
    outside = {"embed": False, "norm": False, "head": True}
    assert left_out_or_rounded(["head"], still, facts(outside), []) == (["head"], {})
    verdict = not_in_optimizer(["head"], still, patience=3)
    assert verdict.code == "TFD312" and verdict.evidence == {"groups": ["head"], "grad_norms": {"head": 1.0}}
    assert "in none of the optimizer's param groups" in verdict.message
    # the same group wholly in an AdamW at lr 1e-8, weights of rms 1.0 (norm gains): below half the fp32 spacing
    gains = step_reading(0, delta=[1e-6, 1e-6, 0.0], weights=(1.0, 1.0, 10.0))  # rms(W) = 10 / sqrt(100) = 1.0
    adam = [{"lr": 1e-8, "betas": (0.9, 0.999), "params": list(PARAMS.values())}]
    left_out, rounded = left_out_or_rounded(["head"], gains, facts({g: False for g in NAMES}), adam)
    assert left_out == [] and rounded["head"]["expected_step"] == 1e-8
    assert rounded["head"]["half_spacing"] == pytest.approx(1.19e-7 / 2)
    # at an ordinary LR the step should have shown: not rounded, and in the optimizer, so nothing is said
    adam[0]["lr"] = 1e-3
    assert left_out_or_rounded(["head"], gains, facts({g: False for g in NAMES}), adam) == ([], {})
    # membership unknown (the optimizer holds copies): a step that should have shown means left out
    assert left_out_or_rounded(["head"], gains, facts(None), adam) == (["head"], {})
    assert not_in_optimizer([], gains, patience=3) is None


def test_group_facts_are_read_from_the_parameters_and_the_optimizers():
    body, head = torch.nn.Linear(4, 4), torch.nn.Linear(4, 2).to(torch.bfloat16)
    params = [*body.parameters(), *head.parameters()]
    found = group_facts(["body", "head"], params, [0, 0, 1, 1], [torch.optim.AdamW(body.parameters())])
    assert found.numel == {"body": 20, "head": 10} and found.outside == {"body": False, "head": True}
    assert found.eps == {"body": torch.finfo(torch.float32).eps, "head": torch.finfo(torch.bfloat16).eps}
    assert found.params["head"] == tuple(id(p) for p in head.parameters())


def test_weights_that_inflate_or_deflate_within_the_window():
    window = deque()
    assert norm_change(window, {"a": 1.0, "b": 1.0, "bias": 0.0}, 0, growth_window=50) is None  # nothing before
    grown = norm_change(window, {"a": 3.0, "b": 2.5, "bias": 0.4}, 10, growth_window=50)
    assert grown.median == 2.75 and set(grown.growth) == {"a", "b"}  # the zero-initialised bias is not judged
    stalled = "the mean training loss fell by only 0.010% of itself per step since step 0"
    verdict = weights_growing(grown, step_reading(10, lr=0.2), stalled, growth_limit=2.0, growth_window=50)
    assert verdict.code == "TFD313" and verdict.severity == "warning" and list(verdict.evidence["growth"]) == ["a", "b"]
    assert verdict.message == (
        "Weights are growing fast: the median group norm grew 2.75x in 10 optimizer steps (limit 2x in 50), at a "
        f"learning rate of 0.2, and {stalled}."
    )
    assert weights_shrinking(grown, [], growth_limit=2.0, growth_window=50) is None
    # 60 steps later the first entry has left the window: compared with step 10 now
    shrunk = norm_change(window, {"a": 1.2, "b": 1.0, "bias": 0.4}, 60, growth_window=50)
    assert shrunk.from_step == 10 and shrunk.median == pytest.approx(0.4)
    groups = [{"lr": 3e-3, "weight_decay": 10.0}, {"lr": 3e-3, "weight_decay": 0.0}]
    assert weight_decay_per_step(groups) == pytest.approx(3e-2)
    verdict = weights_shrinking(shrunk, groups, growth_limit=2.0, growth_window=50)
    assert verdict.code == "TFD314" and verdict.evidence["lr_times_weight_decay"] == pytest.approx(3e-2)
    assert "lr x weight_decay = 0.03 per step (half the norm every 23 steps without gradients)." in verdict.message
    assert weights_growing(shrunk, step_reading(60), None, growth_limit=2.0, growth_window=50) is None
    # healthy growth (1.1x) and decay (0.98x): quiet
    healthy = deque([(0, {"a": 1.0, "b": 1.0}, 5.0)])
    change = norm_change(healthy, {"a": 1.1, "b": 0.98}, 50, growth_window=50)
    assert weights_growing(change, step_reading(50), None, growth_limit=2.0, growth_window=50) is None
    assert weights_shrinking(change, groups, growth_limit=2.0, growth_window=50) is None


def test_weight_growth_is_a_warning_only_with_harm_beside_it():
    def grown(from_loss, to_loss):  # the norms double over 50 steps
        window = deque([(0, {"a": 1.0, "b": 1.0}, from_loss)])
        return norm_change(window, {"a": 2.1, "b": 2.0}, 50, growth_window=50, loss=to_loss)

    # a small-initialised model at a normal LR: its norms double while its loss falls (issue 38's Gemma run)
    def harm(change, reading=None, growth_limit=2.0):
        return growth_harm(change, reading or step_reading(50), high=0.3, growth_limit=growth_limit)

    falling = grown(5.1, 2.95)
    assert harm(falling) is None
    info = weights_growing(falling, step_reading(50), None, growth_limit=2.0, growth_window=50)
    assert info.severity is None and "while the loss still falls" in info.message  # the rule's default: info
    # beside harm: a loss that barely fell or rose, or went non-finite, updates above the band, growth past limit^2
    assert "rose by 0.392% of itself" in harm(grown(5.1, 6.1))
    assert "fell by only 0.020% of itself" in harm(grown(5.1, 5.05))
    assert "went from 5.1 to nan" in harm(grown(5.1, math.nan))
    assert "above the band" in harm(falling, step_reading(50, ratio=0.5))
    assert "past 1.96x" in harm(falling, growth_limit=1.4)
    assert harm(grown(math.nan, math.nan)) is None  # no loss returned: nothing shows


def test_every_rule_together_on_one_step():
    memory, kwargs = UpdateMemory(1), dict(patience=1, decayed_lr_fraction=0.5, growth_limit=2.0, growth_window=50)
    healthy = step_reading(0, ratio=1e-2)
    assert update_verdicts(healthy, memory, facts(), [], low=3e-4, high=0.3, ln_vocab=None, **kwargs) == [None] * 5
    huge = step_reading(10, ratio=0.5, weights=(3.0, 3.0, 3.0))
    verdicts = update_verdicts(huge, memory, facts(), [], low=3e-4, high=0.3, ln_vocab=None, **kwargs)
    assert [v.code for v in verdicts if v] == ["TFD311", "TFD313"]


def test_the_memory_round_trips_through_a_state_dict():
    memory = UpdateMemory(2)
    for step, loss in ((0, 5.0), (10, 4.9), (20, 4.8)):
        memory.observe(step_reading(step, loss=loss))
    memory.norms.append((20, {"a": 1.0}, 4.8))
    memory.streak.update("low", True)
    state = memory.state_dict()
    restored = UpdateMemory(2)
    restored.load_state_dict(state)
    assert list(restored.losses) == [(10, 4.9), (20, 4.8)] and restored.first_loss == 5.0
    assert (
        restored.peak_lr == 3e-4 and list(restored.recent_lr) == [3e-4, 3e-4] and restored.streak.counts == {"low": 1}
    )
    assert list(restored.norms) == [(20, {"a": 1.0}, 4.8)] and math.isnan(restored.unigram)
    restored.load_state_dict({"norms": [[20, {"a": 1.0}]]})  # a checkpoint from before the loss was kept
    assert restored.norms[0][:2] == (20, {"a": 1.0}) and math.isnan(restored.norms[0][2])
    assert state["unigram_entropy"] is None


# ------------------------------------------------------------------------------------- readings of a snapshot in parts
def test_a_reading_of_some_groups_judges_those_and_knows_the_optimizer_stepped_from_the_others():
    # groups a and c measured (‖ΔW‖ = 1e-3 ‖W‖ and 0); b not measured, its slot holds how much its ‖W‖² changed
    squares = [9e-6, 0.5, 0.0, 9.0, 16.0, 4.0, 1.0, 1.0, 1.0]
    r = UpdateReading.from_squares(4, 1e-3, ["a", "b", "c"], squares, measured=(True, False, True))
    assert r.ratios == {"a": pytest.approx(1e-3), "c": 0.0} and set(r.delta_sq) == {"a", "c"}
    assert r.total == pytest.approx(3e-3 / math.sqrt(13.0))  # over the groups measured on this step
    assert r.param_norms == {"a": 3.0, "b": 4.0, "c": 2.0} and r.param_norm_total == pytest.approx(math.sqrt(29.0))
    assert r.stepped is True
    assert set(r.scalars(3e-4, 0.3)) == {
        "update_ratio/total",
        "update_ratio/param_norm/total",
        "update_ratio/a",
        "update_ratio/c",
        *(f"update_ratio/param_norm/{g}" for g in "abc"),
        "update_ratio/band/low",
        "update_ratio/band/high",
    }
    still = UpdateReading.from_squares(4, 1e-3, ["a", "b"], [0.0, 0.0, 1.0, 1.0, 1.0, 1.0], measured=(True, False))
    assert still.stepped is False  # nothing measured changed and the other group's norm did not either
    assert UpdateReading.from_squares(4, 1e-3, ["a"], [0.0, 1.0, 1.0]).stepped is None  # whole: as ever


def test_a_group_is_judged_stuck_on_the_measurements_that_cover_it_only():
    # head (left out of the optimizer) is measured alone every third measurement; the other groups meanwhile
    streak, stuck = Streak(), []
    for i in range(9):
        head_now = i % 3 == 2
        measured = (not head_now, not head_now, head_now)
        # a part without head: both groups changed; head alone: unchanged, while embed's norm changed (0.2)
        delta = [1e-4, 1e-4, 0.0] if not head_now else [0.2, 0.0, 0.0]
        squares = [*delta, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0]
        reading = UpdateReading.from_squares(10 * i, 1e-3, NAMES, squares, measured=measured)
        stuck = stuck_groups(reading, streak, patience=3)
        if i < 8:
            assert stuck == []
    assert stuck == ["head"]  # its third measurement, the ninth measuring step


def test_no_ratio_rule_judges_a_step_that_measured_no_group():
    r = UpdateReading.from_squares(0, 1e-3, ["a"], [0.0, 1.0, 1.0], measured=(False,))
    assert math.isnan(r.total) and r.ratios == {} and "update_ratio/total" not in r.scalars(3e-4, 0.3)
    assert huge_update(r, low=3e-4, high=0.3) is None
