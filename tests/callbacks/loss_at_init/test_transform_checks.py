"""The returned loss against the logits' own cross-entropy, without a Trainer: the sums of ``loss_transform_sums`` and
the explanations of ``loss_transform_verdict`` (a bound, a temperature, label smoothing, a factor, an added term)."""

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

from lightning_tfdebug.callbacks.loss_at_init.floor_checks import smoothing_floor
from lightning_tfdebug.callbacks.loss_at_init.readings import LossReading, LossSums, loss_reading
from lightning_tfdebug.callbacks.loss_at_init.transform_checks import bound_width, loss_transform_verdict
from lightning_tfdebug.functional.loss import CAP_GRID, TEMPERATURE_GRID, TRANSFORM_SUMS, loss_transform_sums
from lightning_tfdebug.rules import RULES

V = 50


def readings_of(logits_per_step, labels, transform):
    """Readings of the loss ``transform(logits)`` gives, at steps 50, 80, 100."""
    out = []
    for step, logits in zip((50, 80, 100), logits_per_step):
        taken = loss_transform_sums(logits, labels, shift_labels=False)
        sums = LossSums.from_host({k: float(taken[k]) for k in TRANSFORM_SUMS})  # what the callback declares
        returned = float(transform(logits, labels))
        out.append(loss_reading(sums, returned, step))
    return out


def trained_logits(sharpness, seed=0):
    """Logits of a model that puts most of its weight on the label, more so the sharper."""
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, V, (4, 16), generator=g)
    logits = torch.randn(4, 16, V, generator=g) + sharpness * F.one_hot(labels, V)
    return logits, labels


def ce(logits, labels, **kwargs):
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), **kwargs)


def test_the_sums_give_the_logits_cross_entropy_and_its_value_at_every_temperature():
    logits, labels = trained_logits(3.0)
    sums = loss_transform_sums(logits, labels, shift_labels=False)
    n = float(sums["tx_count"])
    assert n == labels.numel() == float(sums["tx_total"]) == float(sums["tx_positions"])
    assert float(sums["tx_ce_sum"]) / n == pytest.approx(float(ce(logits, labels)), rel=1e-5)
    for k in (0, 8, 16, 24, 32):
        beta = TEMPERATURE_GRID[k]
        assert float(sums[f"tx_beta_{k}"]) / n == pytest.approx(float(ce(beta * logits, labels)), rel=1e-4)
    for k in (0, 4, 8, 12):
        cap = CAP_GRID[k]
        capped = cap * torch.tanh(logits / cap)
        assert float(sums[f"tx_cap_{k}"]) / n == pytest.approx(float(ce(capped, labels)), rel=1e-4)
    smoothed = float(ce(logits, labels, label_smoothing=0.1))
    uniform = float(sums["tx_uniform_sum"]) / n
    assert 0.9 * float(sums["tx_ce_sum"]) / n + 0.1 * uniform == pytest.approx(smoothed, rel=1e-5)


def test_the_lower_alignment_is_taken_when_both_are_possible():
    logits, labels = trained_logits(6.0)
    shifted_labels = torch.cat([labels[:, :1], labels[:, :-1]], dim=1)  # label t + 1 is what position t predicts
    sums = loss_transform_sums(logits, shifted_labels, shift_labels=False, both_alignments=True)
    assert float(sums["tx_other"]) == 1.0
    assert float(sums["tx_ce_sum"]) / float(sums["tx_count"]) < 1.0  # scored against the labels they predict


def test_a_temperature_is_recovered_from_the_loss_alone():
    logits, labels = trained_logits(4.0)
    [reading] = readings_of([logits], labels, lambda x, y: ce(x / 3.0, y))
    assert any(b == pytest.approx(1 / 3.0, rel=0.01) for b in reading.temperatures())


def _verdict(steps_logits, labels, transform, unigram=float("nan")):
    return loss_transform_verdict(readings_of(steps_logits, labels, transform), V, unigram)


def test_a_temperature_at_every_step_is_info_with_its_value():
    labels = trained_logits(0.0)[1]
    steps = [trained_logits(s)[0] for s in (3.0, 5.0, 7.0)]
    verdict = _verdict(steps, labels, lambda x, y: ce(x / 2.0, y))
    assert verdict.code == "TFD234" and verdict.severity == "info"
    assert verdict.evidence["temperature"] == pytest.approx(2.0, rel=0.01)


def softcap(cap):
    return lambda x, y: ce(cap * torch.tanh(x / cap), y)


@pytest.mark.parametrize("cap", [0.75, 1.2])
def test_a_soft_cap_that_keeps_every_token_unlikely_is_a_bound_not_a_temperature(cap):
    """``c * tanh(logits / c)`` with ``c`` far too small raises the loss as a temperature would; only the soft-cap
    gives it at every step, so it is named, with its floor."""
    labels = trained_logits(0.0)[1]
    steps = [trained_logits(s)[0] for s in (1.0, 1.5, 2.0)]
    verdict = _verdict(steps, labels, softcap(cap))
    assert verdict.code == "TFD233" and RULES["TFD233"].severity == "warning"
    evidence = verdict.evidence
    assert evidence["cap"] == pytest.approx(cap, rel=0.02)
    assert evidence["cap_miss"] < evidence["temperature_miss"]
    assert evidence["floor"] == pytest.approx(math.log1p((V - 1) * math.exp(-2 * evidence["cap"])))
    assert f"c = {evidence['cap']:.3g}" in verdict.message


def test_a_temperature_is_not_read_as_a_soft_cap():
    labels = trained_logits(0.0)[1]
    steps = [trained_logits(s)[0] for s in (1.0, 1.5, 2.0)]
    verdict = _verdict(steps, labels, lambda x, y: ce(x / 2.0, y))
    assert verdict.code == "TFD234" and "cap" not in verdict.evidence


def test_a_soft_cap_that_binds_nothing_says_nothing():
    """Gemma's soft-cap of 30 on logits of a few units: the loss is the logits' own; a cap of 3 on 50 tokens lets a
    token take 89% of the probability, so what it changes is explained, not a bound."""
    labels = trained_logits(0.0)[1]
    steps = [trained_logits(s)[0] for s in (1.0, 1.5, 2.0)]
    assert _verdict(steps, labels, softcap(30.0)) is None
    assert _verdict(steps, labels, softcap(3.0)) is None
    # the same cap on logits that already reach below its floor binds them: a bound
    sharp = [trained_logits(s)[0] for s in (3.0, 5.0, 7.0)]
    assert _verdict(sharp, labels, softcap(3.0)).code == "TFD233"


def test_readings_kept_before_the_soft_cap_grid_still_load():
    labels = trained_logits(0.0)[1]
    [reading] = readings_of([trained_logits(3.0)[0]], labels, lambda x, y: ce(x, y))
    old = reading.to_list()[:8]  # a checkpoint written without the soft-cap curve and the floor's readings
    restored = LossReading.from_list(old)
    assert restored.to_list()[:8] == old and restored.cap_ce == ()
    assert all(math.isnan(v) for v in (restored.range_spread, restored.floor, restored.sigmoid_ce))
    assert LossReading.from_list(reading.to_list()) == reading
    assert 0 < reading.range_spread < 1 and 0 < reading.floor < math.log(V) and reading.sigmoid_ce > reading.ce


@pytest.mark.parametrize(
    "name, transform",
    [
        ("plain", lambda x, y: ce(x, y)),
        ("z-loss", lambda x, y: ce(x, y) + 1e-4 * x.logsumexp(-1).square().mean()),
        ("accumulation", lambda x, y: ce(x, y) / 8),
        ("added term", lambda x, y: ce(x, y) + 0.05),
    ],
)
def test_healthy_transforms_are_explained_and_say_nothing(name, transform):
    labels = trained_logits(0.0)[1]
    steps = [trained_logits(s)[0] for s in (3.0, 5.0, 7.0)]
    assert _verdict(steps, labels, transform) is None


def test_label_smoothing_is_named_with_its_eps_at_info_and_its_floor():
    labels = trained_logits(0.0)[1]
    steps = [trained_logits(s)[0] for s in (3.0, 5.0, 7.0)]
    verdict = _verdict(steps, labels, lambda x, y: ce(x, y, label_smoothing=0.1))
    assert verdict.code == "TFD237" and verdict.severity == "info"
    assert verdict.evidence["eps"] == pytest.approx(0.1, rel=1e-4) and "eps = 0.1" in verdict.message
    assert verdict.evidence["floor"] == pytest.approx(smoothing_floor(0.1, V))


def test_an_unexplained_disagreement_is_info_with_both_numbers():
    labels = trained_logits(0.0)[1]
    steps = [trained_logits(s)[0] for s in (3.0, 5.0, 7.0)]
    verdict = _verdict(steps, labels, lambda x, y: ce(x, y) * (0.9 - 0.3 * x.std()))  # below, no fixed factor
    assert verdict.code == "TFD235" and verdict.severity == "info"
    assert f"{verdict.evidence['returned_loss'][-1]:.4g}" in verdict.message
    assert f"{verdict.evidence['logits_loss'][-1]:.4g}" in verdict.message


def test_a_loss_far_above_the_logits_at_every_step_is_a_warning_with_both_numbers():
    labels = trained_logits(0.0)[1]
    steps = [trained_logits(s)[0] for s in (3.0, 5.0, 7.0)]
    verdict = _verdict(steps, labels, lambda x, y: ce(x.sigmoid(), y))
    assert verdict.code == "TFD233" and RULES["TFD233"].severity == "warning"
    assert f"{verdict.evidence['returned_loss'][-1]:.4g}" in verdict.message
    assert f"{verdict.evidence['logits_loss'][-1]:.4g}" in verdict.message
    # one step far above is no persistent gap
    assert loss_transform_verdict(readings_of(steps[:1], labels, lambda x, y: ce(x.sigmoid(), y)), V) is None


def test_a_large_added_term_that_trains_with_the_loss_is_not_a_bound():
    """Distillation: the cross-entropy plus a KL to a teacher, which falls as the student learns. It is far above the
    logits' cross-entropy at every step, but it falls with it: explained (or info, TFD235), not a bound."""
    labels = trained_logits(0.0)[1]
    steps = [trained_logits(s)[0] for s in (1.0, 2.0, 3.0)]
    g = torch.Generator().manual_seed(1)  # a teacher that knows the labels, with noise of its own
    teacher = (torch.randn(4, 16, V, generator=g) + 6.0 * F.one_hot(labels, V)).log_softmax(-1)

    def distilled(x, y):
        kl = F.kl_div(x.log_softmax(-1), teacher, log_target=True, reduction="none").sum(-1).mean()
        return ce(x, y) + kl

    readings = readings_of(steps, labels, distilled)
    expected = math.log(V)
    assert all(r.loss - r.ce > max(0.2 * r.ce, 0.1 * expected) for r in readings)  # far above at every step
    verdict = loss_transform_verdict(readings, V)
    assert verdict is None or verdict.code == "TFD235"
    # the same gap without the fall: a bound
    flat = [dataclasses.replace(r, loss=readings[0].loss) for r in readings]
    assert loss_transform_verdict(flat, V).code == "TFD233"


def _reading(step, loss, ce_value, logit_range, best=None):
    """A reading whose cross-entropy over the temperature grid falls from ln(V) to ``best`` at a multiplier that moves
    with the step (a bound's loss is given by no one temperature)."""
    best = ce_value if best is None else best
    edge = 4 + step // 10
    curve = tuple(math.log(V) if k < edge else best for k in range(len(TEMPERATURE_GRID)))
    return LossReading(step, loss, ce_value, 0.0, 10.0, logit_range, curve)


def test_a_loss_pinned_above_the_data_while_the_logits_learn_is_a_bound():
    pinned = [_reading(50, 3.0, 2.0, 5.0), _reading(80, 2.97, 1.8, 5.8), _reading(100, 2.96, 1.6, 6.5)]
    verdict = loss_transform_verdict(pinned, V, unigram_entropy=2.5)
    assert verdict.code == "TFD233" and RULES["TFD233"].severity == "warning"
    assert verdict.evidence["width"] == pytest.approx(bound_width(2.96, V))
    assert math.log1p((V - 1) * math.exp(-verdict.evidence["width"])) == pytest.approx(2.96)
    # a loss the data alone could bring that low is no floor, logits at rest are no squash pushing them outwards: the
    # loss is still far above the logits, without a width
    at_rest = [_reading(50, 3.0, 2.0, 6.0), _reading(80, 2.97, 1.8, 6.1), _reading(100, 2.96, 1.6, 6.2)]
    for verdict in (loss_transform_verdict(pinned, V, 2.9), loss_transform_verdict(at_rest, V, 2.5)):
        assert verdict.code == "TFD233" and "width" not in verdict.evidence


def test_one_reading_or_agreement_says_nothing():
    assert loss_transform_verdict([_reading(100, 3.0, 2.0, 5.0)], V) is None
    agreeing = [_reading(50, 3.0, 2.99, 5.0), _reading(100, 2.5, 2.49, 6.0)]
    assert loss_transform_verdict(agreeing, V) is None


def test_readings_round_trip_through_plain_values():
    reading = dataclasses.replace(_reading(80, 2.97, 1.8, 5.8), supervised_share=0.9)
    assert LossReading.from_list(reading.to_list()) == reading
    assert LossReading.from_list(reading.to_list()[:7]).supervised_share != reading.supervised_share  # older state


def test_a_steady_smoothing_far_above_what_recipes_use_is_a_squash_not_label_smoothing():
    def smoothed(step, ce_value, e, uniform=6.0):
        edge = 4 + step // 10
        curve = tuple(math.log(V) if k < edge else ce_value for k in range(len(TEMPERATURE_GRID)))
        loss = (1 - e) * ce_value + e * uniform
        return LossReading(step, loss, ce_value, 0.0, uniform, 5.0 + step / 500, curve)

    capped = [smoothed(50, 2.7, 0.45), smoothed(80, 2.4, 0.47), smoothed(100, 2.2, 0.49)]  # EncoderLM, c = 0.75
    assert loss_transform_verdict(capped, V).code == "TFD233"
    named = loss_transform_verdict([smoothed(s, c, 0.1) for s, c in ((50, 2.7), (80, 2.4), (100, 2.2))], V)
    assert named.code == "TFD237" and named.severity == "info" and named.evidence["eps"] == pytest.approx(0.1)
