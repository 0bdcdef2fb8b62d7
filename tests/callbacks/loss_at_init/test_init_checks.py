"""LossAtInit's decisions without a Trainer (callbacks/loss_at_init/: its readings, phases and checks)."""

import dataclasses
import math

import pytest
import torch

from lightning_tfdebug.callbacks.loss_at_init.check import check_findings
from lightning_tfdebug.callbacks.loss_at_init.init_checks import (
    batch_counts,
    classify_init_loss,
    scaled_loss_verdict,
    unreadable_verdict,
)
from lightning_tfdebug.callbacks.loss_at_init.phases import HISTORY, LossRun, compare_steps
from lightning_tfdebug.callbacks.loss_at_init.readings import (
    InitLoss,
    LossReading,
    LossSums,
    check_reading,
    late_masked_lm,
    summarize_init,
)
from lightning_tfdebug.callbacks.loss_at_init.stall_checks import (
    bounded_output_verdict,
    check_verdicts,
    context_verdict,
)
from lightning_tfdebug.functional.loss import TEMPERATURE_GRID, copy_sums, init_loss_sums
from lightning_tfdebug.rules import rules_of

V = 50
LN_V = math.log(V)


def init(observed=LN_V, recomputed=LN_V, **kwargs):
    values = dict(
        observed=observed,
        expected=LN_V,
        recomputed=recomputed,
        logit_std=0.02,
        supervised_frac=1.0,
        copy_rate=None,
        probability_rows=0.0,
        log_probability_rows=0.0,
        supervised=8 * 16.0,
        positions=8 * 16.0,
        label_rows=8.0,
        vocab=V,
    )
    values.update(kwargs)
    return InitLoss(**values)


def classify(summary, **kwargs):
    kwargs = {"init_tolerance": 0.25, "ignore_index": -100, "shifted": True, **kwargs}
    return [v.code for v in classify_init_loss(summary, **kwargs)]


def test_summary_of_real_sums():
    torch.manual_seed(0)
    logits = torch.randn(4, 16, V) * 0.01
    labels = torch.randint(0, V, (4, 16))
    host = {k: float(v) for k, v in init_loss_sums(logits, labels).items()}
    host.update({k: float(v) for k, v in copy_sums(logits, labels).items()})
    host.update(loss_sum=2 * LN_V, loss_n=2.0)  # two ranks returned ln(V)
    summary = summarize_init(LossSums.from_host(host), V)
    assert summary.observed == pytest.approx(LN_V) and summary.recomputed == pytest.approx(LN_V, rel=1e-3)
    assert summary.supervised_frac == pytest.approx(60 / 64) and summary.copy_rate is not None
    assert set(summary.metrics()) >= {"loss_at_init/observed", "loss_at_init/copy_rate", "loss_at_init/logit_std"}
    host["loss_n"] = 0.0  # no rank returned a loss: the recomputed one stands in
    assert summarize_init(LossSums.from_host(host), V).observed == summary.recomputed


def test_the_decision_tree_of_the_first_loss():
    assert classify(init()) == []
    assert classify(init(probability_rows=1.0, observed=LN_V)) == ["TFD220"]
    assert classify(init(log_probability_rows=1.0)) == ["TFD221"]
    assert classify(init(supervised=0.0, observed=math.nan)) == ["TFD224"]
    assert classify(init(observed=math.inf)) == ["TFD227"]
    assert classify(init(observed=3 * LN_V, recomputed=3 * LN_V)) == ["TFD222"]
    assert classify(init(observed=0.1 * LN_V, recomputed=0.1 * LN_V)) == ["TFD223"]
    # near-uniform logits but a returned loss 128x larger: summed over the 128 supervised tokens
    [verdict] = classify_init_loss(init(observed=128 * LN_V), init_tolerance=0.25, ignore_index=-100, shifted=True)
    assert verdict.code == "TFD229" and verdict.evidence["matched_count"] == "supervised tokens per batch"
    assert classify(init(observed=LN_V / 8)) == ["TFD229"]  # divided by the 8 sequences once too often


def test_scaled_loss_only_below_ln_v_when_a_count_explains_it():
    counts = batch_counts(supervised=128, label_rows=8, positions=128, accumulate_grad_batches=1, ranks=1)
    assert counts["label positions per sequence"] == 16
    assert scaled_loss_verdict(LN_V * 0.3, LN_V, LN_V, 0.25, counts) is None  # no count is 1/0.3
    assert scaled_loss_verdict(LN_V * 5.3, LN_V, LN_V, 0.25, counts).evidence["matched_count"] is None
    assert scaled_loss_verdict(LN_V * 16, 3 * LN_V, LN_V, 0.25, counts) is None  # the logits are not uniform


def test_check_step_verdicts():
    assert [v.code for v in check_verdicts(LN_V * 1.01, LN_V, 100, stall_tolerance=0.05)] == ["TFD225"]
    assert check_verdicts(LN_V * 0.5, LN_V, 100, stall_tolerance=0.05) == []
    copying = check_verdicts(1.0, LN_V, 100, stall_tolerance=0.05, copy_rate=0.9, repeat_rate=0.05, init_copy_rate=0.1)
    assert [v.code for v in copying] == ["TFD226"]
    tied = check_verdicts(1.0, LN_V, 100, stall_tolerance=0.05, copy_rate=0.9, repeat_rate=0.05, init_copy_rate=0.85)
    assert tied == []  # an untrained model with tied embeddings copied as much already
    repeats = check_verdicts(1.0, LN_V, 100, stall_tolerance=0.05, copy_rate=0.9, repeat_rate=0.8)
    assert repeats == []  # the data repeats tokens that often


def test_the_returned_loss_picks_the_label_alignment():
    from lightning_tfdebug.callbacks.loss_at_init.readings import follow_returned_loss

    torch.manual_seed(0)
    tokens = torch.randint(0, 50, (4, 17))
    targets = tokens[:, 1:]  # shifted by the data (a tuple batch's targets): scored at their own position
    logits = torch.nn.functional.one_hot(targets, 50).float() * 6.0  # a trained model: predicts the next token
    aligned = init_loss_sums(logits, targets, shift_labels=False)
    shifted = init_loss_sums(logits, targets, shift_labels=True)  # what `shift_labels=True` assumes
    host = {k: float(v) for k, v in shifted.items()}
    host.update({"other_ce_sum": float(aligned["ce_sum"]), "other_ce_count": float(aligned["ce_count"])})
    sums = LossSums.from_host(host)
    returned = torch.nn.functional.cross_entropy(logits.reshape(-1, 50), targets.reshape(-1)).item()
    picked, other = follow_returned_loss(sums, returned)
    assert other and picked.ce_sum / picked.ce_count == pytest.approx(returned, rel=1e-5)
    assert picked.other_ce_sum == picked.other_ce_count == 0.0  # nothing left under the other alignment's names
    # the configured alignment stays when it is the one that agrees, when nothing else was measured, or without a loss
    assert not follow_returned_loss(sums, sums.ce_sum / sums.ce_count)[1]
    assert not follow_returned_loss(dataclasses.replace(sums, other_ce_sum=0.0, other_ce_count=0.0), returned)[1]
    assert not follow_returned_loss(sums, math.nan)[1]


# ---------------------------------------------------------------------------------------------- every rule by numbers
def test_every_rule_writes_its_message_from_its_template():
    assert all(rule.message for rule in rules_of("LossAtInit"))
    [probs] = classify_init_loss(init(probability_rows=1.0), init_tolerance=0.25, ignore_index=-100, shifted=True)
    assert probs.message.startswith("The model's outputs are already probabilities: 100% of the sampled rows")
    assert probs.severity is None and probs.evidence["probability_rows"] == 1.0  # the rule's severity: error
    [none] = classify_init_loss(init(supervised=0.0, observed=0.0), init_tolerance=0.25, ignore_index=-1, shifted=True)
    assert none.code == "TFD224" and "ignore_index (-1)" in none.message
    [nan] = classify_init_loss(init(observed=math.nan), init_tolerance=0.25, ignore_index=-100, shifted=True, step=0)
    assert nan.message == "The loss of the first step is nan, before any update." and nan.step == 0


def test_a_loss_far_below_ln_v_is_info_for_a_pretrained_model_and_a_warning_for_a_copying_one():
    def below(**kwargs):
        [verdict] = classify_init_loss(init(**kwargs), init_tolerance=0.25, ignore_index=-100, shifted=True)
        return verdict

    pretrained = below(observed=0.3 * LN_V, recomputed=0.3 * LN_V)
    assert (pretrained.code, pretrained.severity, pretrained.evidence["pretrained"]) == ("TFD223", "info", True)
    assert "Nothing to fix for a pretrained model" in pretrained.message
    copying = below(observed=0.3 * LN_V, recomputed=0.3 * LN_V, copy_rate=0.9, repeat_rate=0.05)
    assert (copying.severity, copying.evidence["pretrained"]) == (None, False)
    assert "predicting the current input token at 90% of positions" in copying.message
    unrelated = below(observed=0.3 * LN_V, recomputed=LN_V * 0.6)  # the logits do not give that loss
    assert unrelated.severity is None and "is not the V-way cross-entropy of these logits" in unrelated.message


def test_a_manual_loss_divided_by_a_whole_number_is_accumulation_by_hand():
    divided = init(observed=LN_V / 8)  # `loss / 8`: one over the sequences, or accumulating 8 batches by hand
    assert classify(divided) == ["TFD229"]
    assert classify(divided, manual_optimization=True) == []


def test_bounded_outputs_pin_the_loss_at_their_floor():
    args = dict(stall_tolerance=0.05, range_spread=0.01)
    pinned = bounded_output_verdict(2.6, 2.5, 1.7, LN_V, 1.5, 100, **args)
    assert (pinned.code, pinned.step) == ("TFD230", 100) and "V=50 classes" in pinned.message
    assert bounded_output_verdict(2.6, 2.5, 1.7, LN_V, 2.5, 100, **args) is None  # the data allows no lower
    assert bounded_output_verdict(3.6, 2.5, 1.7, LN_V, 1.5, 100, **args) is None  # far above its floor: learning
    assert bounded_output_verdict(2.6, 2.5, 1.7, LN_V, 1.5, 100, stall_tolerance=0.05, range_spread=0.2) is None
    assert bounded_output_verdict(2.6, 2.5, 1.7, LN_V, math.nan, 100, **args) is None  # no unigram entropy yet


def test_a_loss_at_the_unigram_entropy_tells_labels_of_other_samples_from_a_model_ignoring_its_context():
    def context(own_match=math.nan, rolled_match=math.nan, **kwargs):
        return context_verdict(2.0, 2.005, 2.0, 100, own_match=own_match, rolled_match=rolled_match, **kwargs)

    neighbours = context(own_match=0.1, rolled_match=0.9)
    assert neighbours.code == "TFD231" and "off by one row" in neighbours.message
    assert context(own_match=0.1, rolled_match=0.1).code == "TFD231"  # neither: named both ways
    assert "cannot be told apart here" in context().message  # nothing measured
    ignores = context(own_match=0.95, rolled_match=0.1, window_steps=50)
    assert (ignores.code, ignores.severity) == ("TFD232", None) and ignores.message.endswith("ignores its context.")
    plateau = context(own_match=0.95, rolled_match=0.1, window_steps=50, masked=True)
    assert (plateau.code, plateau.severity) == ("TFD232", "info") and "their plateau" in plateau.message
    assert context(own_match=0.95, rolled_match=0.1, window_steps=5) is None  # passing through the unigram level
    assert context(own_match=0.95, rolled_match=0.1, flat=False) is None
    assert context_verdict(2.0, 2.5, 2.0, 100) is None  # its own labels predicted far better: context is used
    assert context_verdict(3.0, 3.0, 2.0, 100) is None  # far above the unigram entropy


def test_the_unreadable_rule_names_what_it_could_not_read():
    verdict = unreadable_verdict("the batch is a tuple of 2 items, which has no tensor at 'y'", "y", None, step=0)
    assert verdict.code == "TFD228" and verdict.step == 0
    assert verdict.message == (
        "LossAtInit cannot read the model's outputs or labels: the batch is a tuple of 2 items, which has no tensor "
        "at 'y'."
    )
    assert verdict.evidence == {"labels_key": "y", "logits_module": None}


# ---------------------------------------------------------------------------------------------- the check's reading
def check_host(**kwargs):
    host = dict.fromkeys(
        (
            "ce_sum",
            "ce_count",
            "copies",
            "repeats",
            "count",
            "own_ce_sum",
            "rolled_ce_sum",
            "rolled_count",
            "own_match",
            "rolled_match",
            "match_count",
            "floor_sum",
            "range_sum",
            "range_sq_sum",
            "floor_count",
            "loss_sum",
            "loss_n",
        ),
        0.0,
    )
    host.update(kwargs)
    return LossSums.from_host(host)


def test_the_check_reading_logs_only_what_was_measured():
    bare = check_reading(check_host(ce_sum=30.0, ce_count=10.0), V)
    assert bare.loss == bare.recomputed == 3.0 and bare.expected == pytest.approx(LN_V)
    assert math.isnan(bare.copy_rate) and math.isnan(bare.floor) and bare.metrics() == {"loss_at_init/check_loss": 3.0}
    full = check_reading(
        check_host(
            ce_sum=30.0,
            ce_count=10.0,
            loss_sum=5.0,
            loss_n=2.0,
            copies=3.0,
            repeats=1.0,
            count=10.0,
            own_ce_sum=20.0,
            rolled_ce_sum=21.0,
            rolled_count=10.0,
            floor_sum=25.0,
            range_sum=20.0,
            range_sq_sum=40.0,
            floor_count=10.0,
        ),
        V,
    )
    assert (full.loss, full.copy_rate, full.own_loss, full.rolled_loss, full.floor) == (2.5, 0.3, 2.0, 2.1, 2.5)
    assert full.range_spread == 0.0  # every row at width 2
    assert set(full.metrics()) == {
        f"loss_at_init/{k}" for k in ("check_loss", "copy_rate", "rolled_loss", "loss_floor")
    }


def test_the_check_findings_of_a_stalled_run_carry_the_check_step():
    run = LossRun(check_step=100, check_at=100, history=[(60, LN_V), (80, LN_V)])
    reading = check_reading(check_host(ce_sum=LN_V, ce_count=1.0, loss_sum=LN_V, loss_n=1.0), V)
    verdicts = check_findings(
        reading, 100, run, unigram_entropy=None, vocab=V, stall_tolerance=0.05, copy_threshold=0.5
    )
    assert [(v.code, v.step) for v in verdicts] == [("TFD225", 100)]
    assert verdicts[0].evidence["window_start"] == 60


def test_a_bound_after_the_forward_drops_the_context_findings():
    def reading(step, loss, ce, logit_range):
        betas = tuple(ce + abs(math.log(b)) for b in TEMPERATURE_GRID)  # the logits' best loss: their own
        return LossReading(step, loss, ce, 0.0, 3.8, logit_range, betas)

    run = LossRun(check_step=100, check_at=100)
    run.readings = [reading(50, 3.40, 2.6, 2.0), reading(80, 3.39, 2.3, 2.6), reading(100, 3.38, 2.0, 3.2)]
    at_unigram = check_reading(
        check_host(ce_sum=2.0, ce_count=1.0, own_ce_sum=2.0, rolled_ce_sum=2.0, rolled_count=1.0), V
    )
    options = dict(vocab=V, stall_tolerance=0.05, copy_threshold=0.5)
    codes = [v.code for v in check_findings(at_unigram, 100, run, unigram_entropy=2.0, **options)]
    # the loss does not train these logits: their relation to the labels says nothing; the bound's floor binds
    assert codes == ["TFD233", "TFD236"]
    run.readings = []
    assert [v.code for v in check_findings(at_unigram, 100, run, unigram_entropy=2.0, **options)] == ["TFD231"]


# ---------------------------------------------------------------------------------------------- the run's progress
def test_the_run_arms_step_zero_the_compared_steps_and_the_check_once_each():
    early = (10, 20, 30, 40)  # three compared steps by step 30: decided inside a preflight's 50 steps
    assert compare_steps(100, 10) == (*early, 50, 80) and compare_steps(100, 50) == (*early, 50)
    assert compare_steps(None, 10) == early and compare_steps(25, 10) == (10, 20)
    run = LossRun(check_step=100, check_at=100)
    phases = {step: run.arm(step, 10) for step in range(0, 120, 10)}
    compared = {s: "compare" for s in (*early, 50, 80)}
    assert {s: p for s, p in phases.items() if p} == {0: "init", **compared, 100: "check"}
    assert run.arm(0, 10) is None and run.arm(50, 10) is None and run.arm(100, 10) is None  # the first micro-batch


def test_masked_lm_labels_move_the_check_at_step_zero_or_when_first_seen_at_the_check():
    run = LossRun(check_step=20, check_at=20)
    run.start(init(mask_share=0.9, supervised_frac=0.15, copy_rate=0.4, probability_rows=1.0))
    assert (run.check_at, run.masked_lm, run.init_copy_rate, run.probabilities) == (100, True, 0.4, True)
    late = LossSums(late_mask_top=9.0, late_mask_count=10.0, late_supervised=15.0, late_positions=100.0)
    assert late_masked_lm(late) and not late_masked_lm(dataclasses.replace(late, late_supervised=90.0))
    resumed = LossRun(check_step=20, check_at=20, check_done=True)  # step 0 unseen: resumed without this state
    assert resumed.check_moves(late_masked_lm(late), 20) and (resumed.check_at, resumed.check_done) == (100, False)
    seen = LossRun(check_step=20, check_at=20, init_done=True)  # step 0 said so already
    assert not seen.check_moves(late_masked_lm(late), 20)


def test_the_run_round_trips_through_its_checkpointed_state():
    run = LossRun(check_step=100, check_at=500, init_done=True, init_copy_rate=0.3, masked_lm=True, vocab=V)
    metrics = run.keep_loss(10, 3.0, 2.5)
    assert metrics == {"loss_at_init/loss": 3.0, "loss_at_init/ln_vocab": LN_V, "loss_at_init/unigram_entropy": 2.5}
    assert run.keep_loss(20, math.nan, None) == {"loss_at_init/ln_vocab": LN_V}  # only finite values are logged
    run.add_reading(LossReading(50, 3.0, 2.9, 0.0, 3.8, 2.0, (3.0,) * len(TEMPERATURE_GRID)))
    restored = LossRun.from_state(run.to_state(), check_step=100)
    assert restored == run and restored.window(40) == [(20, restored.history[1][1])]
    fresh = LossRun.from_state({}, check_step=100, vocab=V)
    assert (fresh.check_at, fresh.init_done, fresh.vocab, fresh.history) == (100, False, V, [])
    many = LossRun(check_step=None, check_at=None)
    for step in range(100):
        many.keep_loss(step, 1.0, None)
    assert len(many.history) == HISTORY and many.history[0][0] == 100 - HISTORY


def test_an_encoder_decoder_predicting_its_decoder_input_is_no_pretrained_model():
    # T5 with its decoder fed the labels unshifted, random weights: 3.49 against ln V 5.56, the decoder's current
    # input token predicted at 49% of positions (the data repeats a token at 3%)
    numbers = dict(observed=0.63 * LN_V, recomputed=0.63 * LN_V, copy_rate=0.49, repeat_rate=0.03)
    [decoder] = classify_init_loss(init(**numbers), init_tolerance=0.25, ignore_index=-100, shifted=True)
    assert decoder.evidence["pretrained"] is True  # below the copy threshold a decoder-only reading stays lenient
    seq2seq = init(**numbers, kind="encoder-decoder")
    [leak] = classify_init_loss(seq2seq, init_tolerance=0.25, ignore_index=-100, shifted=True)
    assert (leak.code, leak.severity, leak.evidence["pretrained"]) == ("TFD223", None, False)


def test_the_payload_has_a_field_for_every_declared_sum_and_refuses_others():
    """Every sum a phase declares to the reduction is read by its name; an undeclared one is refused, not dropped."""
    from lightning_tfdebug.functional.loss import PHASE_SUMS

    for phase, names in PHASE_SUMS.items():
        values = {name: float(k + 1) for k, name in enumerate((*names, "loss_sum", "loss_n", "ok"))}
        sums = LossSums.from_host(values)
        assert (sums.loss_sum, sums.loss_n, sums.ok) == (values["loss_sum"], values["loss_n"], values["ok"]), phase
        for name in names:
            grid, _, index = name.rpartition("_")
            got = getattr(sums, grid)[int(index)] if grid in ("tx_beta", "tx_cap") else getattr(sums, name)
            assert got == values[name], (phase, name)
    with pytest.raises(KeyError, match="tx_other"):
        LossSums.from_host({"ce_sum": 1.0, "tx_other": 1.0})
