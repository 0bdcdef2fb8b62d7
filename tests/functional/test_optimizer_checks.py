"""OptimizerAudit's rules on plain numbers: each fires on the numbers of its bug and stays silent on healthy ones."""

import math

import pytest

from lightning_tfdebug.functional.optimizer_checks import (
    RULES,
    DecayedNormWatch,
    coupled_l2,
    decay_on_1d,
    decay_on_embeddings,
    decay_rate,
    decay_shrinkage,
    decayed_1d_evidence,
    decayed_norms_shrink,
    frozen_parameter_moved,
    frozen_parameters_held,
    half_eps,
    parameters_held_twice,
    shown,
    stale_tensors,
    untrained_parameters,
    wiring_verdicts,
)
from lightning_tfdebug.functional.optimizers import GroupReading, ScheduleCourse, ScheduleReading, WiringReading
from lightning_tfdebug.functional.training_checks import (
    early_loss_spike,
    eval_mode,
    grads_not_zeroed,
    lr_reached_zero,
    missing_warmup,
    parameter_unchanged,
    schedule_frozen,
    scheduler_overstepped,
    submodules_in_eval,
    warmup_past_run,
    warmup_spiked,
)

ADAMW = GroupReading("group0", "AdamW", weight_decay=0.1, lr=3e-4, eps=1e-8)
"""A recipe's decayed group: AdamW, lr 3e-4, weight decay 0.1, over float32 parameters."""


def test_every_rule_has_a_message_template():
    assert all(rule.message for rule in RULES)


def test_names_are_shown_up_to_a_limit():
    assert shown(["a", "b"]) == "a, b"
    assert shown([f"p{i}" for i in range(10)]) == "p0, p1, p2, p3, p4, p5, p6, p7 and 2 more"


# ---------------------------------------------------------------------------------------- membership
def test_trainable_parameters_in_no_group():
    verdict = untrained_parameters(["head.weight", "head.bias"])
    assert (verdict.code, verdict.severity) == ("TFD320", None)  # the rule's error
    assert verdict.evidence == {"count": 2, "names": ["head.weight", "head.bias"]}
    assert verdict.message.startswith("2 trainable parameters are in no optimizer param group")
    assert verdict.message.endswith(": head.weight, head.bias.")
    assert len(untrained_parameters([f"p{i}" for i in range(60)]).evidence["names"]) == 50
    assert untrained_parameters([]) is None


def test_parameters_in_two_groups():
    verdict = parameters_held_twice(["head.weight"])
    assert verdict.code == "TFD321" and verdict.evidence == {"count": 1, "names": ["head.weight"]}
    assert "head.weight" in verdict.message
    assert parameters_held_twice(()) is None


def test_frozen_parameters_held_are_info_and_a_warning_once_one_moves():
    held = frozen_parameters_held(["ln_f.weight"])
    assert (held.code, held.severity, held.evidence["count"]) == ("TFD322", None, 1)
    assert "Torch optimizers skip parameters without a gradient" in held.message
    assert frozen_parameters_held([]) is None
    moved = frozen_parameter_moved("ln_f.weight", changed=True)
    assert (moved.code, moved.severity, moved.key) == ("TFD322", "warning", "moved")
    assert moved.evidence == {"parameter": "ln_f.weight"} and moved.message.startswith("Frozen parameter ln_f.weight")
    assert frozen_parameter_moved("ln_f.weight", changed=False) is None


def test_tensors_that_are_not_the_modules_parameters():
    verdict = stale_tensors(12)
    assert verdict.code == "TFD323" and verdict.evidence == {"count": 12} and "holds 12 tensors" in verdict.message
    assert stale_tensors(0) is None


# ---------------------------------------------------------------------------------------- each group
def test_decay_on_one_dimensional_parameters_is_advice():
    group = GroupReading("group0", "AdamW", weight_decay=0.1, decayed_1d=("ln1.weight", "ln1.bias"))
    verdict = decay_on_1d(group)
    assert (verdict.code, verdict.severity, verdict.key) == ("TFD324", None, "group0")  # the rule's info
    assert verdict.evidence == {"group": "group0", "weight_decay": 0.1, "count": 2}
    assert "ln1.weight, ln1.bias" in verdict.message and "Advice only" in verdict.message
    assert decay_on_1d(ADAMW) is None  # a group that decays only matrices


def test_the_evidence_of_a_shrink_names_every_group_that_decays_1d_parameters():
    groups = [
        GroupReading("decay", "AdamW", weight_decay=0.1, decayed_1d=("a.bias",)),
        GroupReading("norms", "AdamW", weight_decay=0.5, decayed_1d=("ln.weight", "ln.bias")),
        ADAMW,
    ]
    assert decayed_1d_evidence(groups) == {"groups": ["decay", "norms"], "weight_decay": 0.5, "count": 3}
    assert decayed_1d_evidence([ADAMW]) == {}


def test_decay_on_embedding_tables_is_advice():
    verdict = decay_on_embeddings(GroupReading("group0", "AdamW", weight_decay=0.1, decayed_embeddings=("tok_emb",)))
    assert verdict.code == "TFD325" and verdict.key == "group0" and verdict.message.endswith(": tok_emb.")
    assert verdict.evidence == {"group": "group0", "weight_decay": 0.1}
    assert decay_on_embeddings(ADAMW) is None


@pytest.mark.parametrize("optimizer", ["Adam", "NAdam", "RAdam", "Adamax", "Adagrad", "Adadelta", "RMSprop"])
def test_adam_family_weight_decay_is_coupled_l2(optimizer):
    verdict = coupled_l2(GroupReading("group0", optimizer, weight_decay=0.01))
    assert (verdict.code, verdict.key) == ("TFD326", optimizer)
    assert verdict.evidence == {"optimizer": optimizer, "weight_decay": 0.01, "group": "group0"}


def test_decoupled_or_no_decay_is_not_coupled_l2():
    assert coupled_l2(ADAMW) is None
    assert coupled_l2(GroupReading("group0", "SGD", weight_decay=0.01)) is None
    assert coupled_l2(GroupReading("group0", "Adam", weight_decay=0.01, decoupled=True)) is None
    assert coupled_l2(GroupReading("group0", "Adam", weight_decay=0.0)) is None


def test_adam_over_float16_parameters_with_a_small_eps():
    default = half_eps(GroupReading("group0", "AdamW", eps=1e-8, float16=True))
    assert (default.code, default.key) == ("TFD333", "group0")
    assert default.evidence["max_step_factor"] == math.inf and "rounds to 0 in float16" in default.message
    small = half_eps(GroupReading("group0", "AdamW", eps=1e-6, float16=True))
    assert small.evidence["max_step_factor"] == pytest.approx(1.7e-4 / 1e-6, rel=0.05)  # eps as float16 holds it
    assert "lr * m / eps, up to 168x the normal Adam step" in small.message
    assert half_eps(GroupReading("group0", "AdamW", eps=1e-4, float16=True)) is None  # at most 1.7x the step
    assert half_eps(GroupReading("group0", "AdamW", eps=1e-8)) is None  # float32 moments
    assert half_eps(GroupReading("group0", "SGD", float16=True)) is None  # no eps: not Adam-family


def test_weight_decay_that_halves_the_weights_in_a_few_dozen_steps():
    strong = decay_rate(GroupReading("group0", "AdamW", weight_decay=10.0, lr=3e-3))
    assert (strong.code, strong.key) == ("TFD336", "group0")
    assert strong.evidence["decay_per_step"] == pytest.approx(3e-2) and strong.evidence["lr"] == 3e-3
    assert "weights halve every 23 steps" in strong.message
    assert decay_rate(GroupReading("group0", "SGD", weight_decay=1.0, lr=0.1)).code == "TFD336"  # SGD's L2 too
    assert decay_rate(GroupReading("group0", "AdamW", weight_decay=1.0, lr=3e-3)) is None  # 3e-3 per step
    assert decay_rate(ADAMW) is None
    assert decay_rate(GroupReading("group0", "Adam", weight_decay=10.0, lr=3e-3)) is None  # coupled: TFD326's
    assert decay_rate(GroupReading("group0", "AdamW", weight_decay=10.0)) is None  # no LR known


def test_the_wiring_verdicts_keep_their_order():
    reading = WiringReading(
        groups=(
            GroupReading("group0", "Adam", weight_decay=0.1, lr=1e-3, decayed_1d=("ln.weight",)),
            GroupReading("group1", "AdamW", weight_decay=0.0, lr=1e-3),
        ),
        missing=("head.weight",),
        frozen=("emb.weight",),
    )
    found = [(v.code, v.key) for v in wiring_verdicts(reading) if v is not None]
    assert found == [("TFD324", "group0"), ("TFD326", "Adam"), ("TFD320", None), ("TFD322", None)]
    assert [v for v in wiring_verdicts(WiringReading(groups=(ADAMW,))) if v is not None] == []


# ---------------------------------------------------------------------------------------- train mode
def test_eval_mode_at_a_training_batch():
    verdict = eval_mode(training=False, epoch=2, step=7)
    assert (verdict.code, verdict.key, verdict.evidence) == ("TFD327", "epoch2", {"epoch": 2})
    assert "(epoch 2, step 7)" in verdict.message
    assert eval_mode(training=True, epoch=2, step=7) is None


def test_mode_dependent_submodules_in_eval_mode():
    verdict = submodules_in_eval(["tok_emb.1"])
    assert verdict.code == "TFD328" and verdict.evidence == {"count": 1}
    assert verdict.message.endswith("while the module trains: tok_emb.1.")
    assert submodules_in_eval([]) is None


# ---------------------------------------------------------------------------------------- the learning rate
def test_a_scheduler_stepped_twice_per_optimizer_step():
    once = scheduler_overstepped("LambdaLR", calls=2, steps=1, key="7")
    assert (once.code, once.key) == ("TFD329", "7") and "stepped 2 times between two optimizer steps" in once.message
    assert once.evidence == {"calls": 2, "optimizer_steps": 1, "scheduler": "LambdaLR"}
    assert "8 times over 4 optimizer steps" in scheduler_overstepped("LambdaLR", calls=8, steps=4).message
    assert scheduler_overstepped("LambdaLR", calls=4, steps=4) is None  # once per step
    assert scheduler_overstepped("LambdaLR", calls=0, steps=4) is None  # per epoch
    assert scheduler_overstepped("LambdaLR", calls=3, steps=0) is None  # no optimizer step between the readings


def test_no_warmup_is_advice():
    verdict = missing_warmup(first_lr=1e-3, lr=1e-3, step=2)
    assert (verdict.code, verdict.severity) == ("TFD330", None)
    assert verdict.evidence == {"first_lr": 1e-3, "lr": 1e-3, "step": 2} and "Advice only" in verdict.message
    assert missing_warmup(first_lr=1e-3, lr=5e-4, step=2).code == "TFD330"  # decaying from the first step
    assert missing_warmup(first_lr=2.5e-4, lr=5e-4, step=1) is None  # a warm-up raised it
    assert missing_warmup(first_lr=0.0, lr=0.0, step=1) is None


def test_the_early_loss_spikes_that_a_warmup_prevents():
    assert early_loss_spike(math.nan, 5.0, 4.0, 3)["spike"] == "the loss at step 3 is nan"
    rose = early_loss_spike(5.6, first_loss=5.0, lowest_loss=4.0, step=3)
    assert rose["spike"].startswith("the loss at step 3 (5.6) rose above") and rose["spike_step"] == 3
    doubled = early_loss_spike(2.5, first_loss=5.0, lowest_loss=1.0, step=9)
    assert "doubled from its lowest measured value (1)" in doubled["spike"]
    assert early_loss_spike(4.5, first_loss=5.0, lowest_loss=4.0, step=3) is None  # falling, a little noise
    assert early_loss_spike(0.03, first_loss=5.0, lowest_loss=0.01, step=3) is None  # doubled, but by 0.02 only


def test_a_spike_without_a_warmup_is_a_warning():
    no_warmup = missing_warmup(first_lr=1.0, lr=1.0, step=1).evidence
    spike = early_loss_spike(9.0, first_loss=5.0, lowest_loss=5.0, step=2)
    verdict = warmup_spiked(no_warmup, spike)
    assert (verdict.code, verdict.severity, verdict.key, verdict.step) == ("TFD330", "warning", "spike", 2)
    assert verdict.evidence["loss"] == 9.0 and verdict.evidence["first_lr"] == 1.0
    assert verdict.message.startswith("No learning-rate warm-up, and the early loss spiked: the loss at step 2")
    assert warmup_spiked(None, spike) is None  # a warm-up, or not a transformer
    assert warmup_spiked(no_warmup, None) is None


def test_an_lr_at_zero_long_before_the_end():
    verdict = lr_reached_zero(lr=0.0, peak_lr=1e-3, step=3, total_steps=8, fraction=0.9)
    assert verdict.code == "TFD331" and verdict.evidence == {"step": 3, "total_steps": 8.0, "peak_lr": 1e-3}
    assert "(8 steps)" in verdict.message
    unbounded = lr_reached_zero(lr=0.0, peak_lr=1e-3, step=3, total_steps=math.inf, fraction=0.9)
    assert "(unbounded steps)" in unbounded.message
    assert lr_reached_zero(lr=0.0, peak_lr=1e-3, step=95, total_steps=100, fraction=0.9) is None  # the end of a decay
    assert lr_reached_zero(lr=1e-5, peak_lr=1e-3, step=3, total_steps=100, fraction=0.9) is None
    assert lr_reached_zero(lr=0.0, peak_lr=0.0, step=3, total_steps=100, fraction=0.9) is None  # never above zero


def test_a_step_sized_warmup_stepped_per_epoch_holds_its_first_lr():
    schedules = ScheduleReading(1e-3, intervals=("epoch",), names=("LambdaLR",))
    verdict = schedule_frozen(first_lr=1e-5, lr=1e-5, step=2, schedules=schedules)
    assert (verdict.code, verdict.step) == ("TFD335", 2)
    assert verdict.evidence == {
        "lr": 1e-5,
        "base_lr": 1e-3,
        "step": 2,
        "interval": ["epoch"],
        "schedulers": ["LambdaLR"],
    }
    assert "1.0% of the 0.001" in verdict.message and "(LambdaLR, interval epoch)" in verdict.message
    assert schedule_frozen(1e-3, 1e-3, 2, ScheduleReading(1e-3)) is None  # at its peak from the start: TFD330's
    assert schedule_frozen(1e-5, 2e-5, 2, schedules) is None  # it moved
    assert schedule_frozen(1e-5, 1e-5, 2, None) is None  # no scheduler records a base LR


def course(half_step, peak_step, end=100, rises=True, start=0):
    run_max = 1e-3 * min(1.0, (end + 1) / (2 * half_step + 2)) if half_step else 1e-3
    return ScheduleCourse("LambdaLR", "step", 1e-3, start, end, run_max, half_step, peak_step, rises, 1000)


def test_a_warmup_longer_than_the_run():
    verdict = warmup_past_run(course(half_step=499, peak_step=999))  # a warm-up ten times the run's 100 steps
    assert verdict.code == "TFD337" and verdict.evidence["peak_step"] == 999 and verdict.evidence["run_end"] == 100
    assert verdict.message == (
        "The learning rate stays below half of its configured peak (0.001) for the whole run (100 steps): LambdaLR "
        "(interval step) reaches the peak at step 999, and the highest LR of this run is 0.000101 (10.1% of it)."
    )
    late = warmup_past_run(course(half_step=70, peak_step=140))  # past the run's middle
    assert "until step 70 of this run's 100 (70% of it)" in late.message
    assert "not within 1000 steps" in warmup_past_run(course(half_step=None, peak_step=None)).message
    # a warm-up that fits (10% of the run), a schedule that never rises, a trial run, a resume past the warm-up
    assert warmup_past_run(course(half_step=5, peak_step=10)) is None
    assert warmup_past_run(course(half_step=None, peak_step=None, rises=False)) is None
    assert warmup_past_run(course(half_step=499, peak_step=999, end=20)) is None
    assert warmup_past_run(course(half_step=30, peak_step=40, start=30, end=200)) is None


# ---------------------------------------------------------------------------------------- the step
def test_a_parameter_byte_identical_for_patience_measured_steps():
    verdict = parameter_unchanged("blocks.0.attn.weight", steps=2, patience=2)
    assert (verdict.code, verdict.key) == ("TFD332", "blocks.0.attn.weight")
    assert verdict.evidence == {"parameter": "blocks.0.attn.weight", "steps": 2}
    assert parameter_unchanged("blocks.0.attn.weight", steps=1, patience=2) is None


def test_gradients_not_zeroed_between_steps():
    verdict = grads_not_zeroed(left=2, probed=2, step=4)
    assert verdict.code == "TFD334" and verdict.evidence == {"groups_with_old_grads": 2, "groups_probed": 2}
    assert "at the first backward of step 4, 2 of 2 param groups" in verdict.message
    assert grads_not_zeroed(left=0, probed=2, step=4) is None


# ---------------------------------------------------------------------------------------- decayed norms
def test_decay_shrinkage_is_what_decoupled_decay_alone_takes():
    assert decay_shrinkage(0.0) == 0.0
    assert decay_shrinkage(math.log(2)) == pytest.approx(0.5)
    assert decay_shrinkage(-1.0) == 0.0


def test_a_fall_the_decay_accounts_for_is_a_warning():
    # TinyGPT, AdamW(model.parameters(), weight_decay=1.0) at lr 3e-3 after 120 steps: the norm fell 22.6%, the decay
    # alone takes 29%
    verdict = decayed_norms_shrink((0, 10.0), (120, 7.74), 0.345, {"groups": ["group0"]})
    assert verdict is not None and verdict.code == "TFD324" and verdict.severity == "warning"
    assert (verdict.key, verdict.step) == ("shrink", 120)
    assert verdict.evidence["fall"] == pytest.approx(0.226) and verdict.evidence["groups"] == ["group0"]
    assert "(22.6%)" in verdict.message


def test_the_recipes_decay_and_falls_the_decay_cannot_explain_stay_silent():
    # the recipes: the norm ends 1% to 5% above its start (weight_decay 0.01 to 0.1, lr 3e-4 to 2e-3)
    assert decayed_norms_shrink((0, 10.0), (120, 10.26), 0.023, {}) is None
    # gradients took the gains down 30%, but the decay could take only 2%: not the decay's doing
    assert decayed_norms_shrink((0, 10.0), (120, 7.0), 0.02, {}) is None
    assert decayed_norms_shrink((0, 10.0), (120, 9.5), 0.3, {}) is None  # a 5% fall: within what training moves
    assert decayed_norms_shrink((0, 0.0), (120, 0.0), 0.3, {}) is None
    assert decayed_norms_shrink((10, 10.0), (10, 5.0), 0.3, {}) is None


def test_the_decayed_norm_watch_adds_the_decay_up_from_its_first_measurement():
    watch = DecayedNormWatch(evidence={"groups": ["group0"]})
    watch.add_exposure(3e-3, step=0)  # no norm yet: nothing is added
    assert watch.observe(0, 10.0) is None and watch.first == (0, 10.0)
    for step in range(10, 130, 10):
        watch.add_exposure(3e-3, step)  # lr * weight_decay = 3e-3 over every step since the last
    assert watch.exposure == pytest.approx(0.36)
    verdict = watch.observe(120, 7.74)
    assert verdict.code == "TFD324" and verdict.evidence["groups"] == ["group0"]
    assert DecayedNormWatch().observe(0, 10.0) is None
