"""MaskProbe's order probes on models that read no token ids or return one output per sequence: the recorded model
call replayed with its positions permuted (can the model see order?) and a late position replaced (causal or
bidirectional?), the harm of an order-blind model decided from its labels and its loss (``TFD215`` at warning or error,
``TFD218`` as info). Real Trainers on the tiny families of ``tests/kind_models.py``; the rule's severities on readings.
"""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from torch import Tensor, nn

from lightning_tfdebug import MaskProbe
from lightning_tfdebug.callbacks.mask_probe.order_any import probe_order
from lightning_tfdebug.callbacks.mask_probe.order_checks import LossTrend, OrderSeenReading, decide_order_blind
from lightning_tfdebug.primitives.calls import RecordedCall
from tests.bug_models import kind_loader, kind_module
from tests.callbacks.torch_calls import TorchCalls
from tests.helpers import fit_tiny
from tests.kind_models import WIDTH, FloatTokenEncoder, _encoder


def _fit(tmp_path, family: str, steps: int, module=None, **bugs) -> MaskProbe:
    probe = MaskProbe()
    model = module if module is not None else kind_module(family, **bugs)()
    fit_tiny(tmp_path, [probe], model=model, data=kind_loader(family)(), max_steps=steps)
    return probe


def _order(probe: MaskProbe) -> list:
    return [f for f in probe.findings if f.code in ("TFD215", "TFD218")]


def test_float_features_without_positions_on_labels_that_need_order(tmp_path):
    """No position table, labels ``(symbol + position) mod 16``: a row holds one symbol at two positions with two
    labels. After three steps the loss cannot be judged yet, so the labels alone make it a warning."""
    probe = _fit(tmp_path, "float_encoder", 3, positions=False)
    [blind] = _order(probe)
    assert (blind.code, blind.severity, blind.step) == ("TFD215", "warning", 2)
    assert blind.evidence["order_change"] <= blind.evidence["tolerance"] < blind.evidence["content_change"]
    assert blind.evidence["labels_need_order"] and "permuted its outputs alike" in blind.message
    assert "holds the same inputs at positions" in blind.message and "loss" not in blind.message
    assert probe.coverage["causal mask"][0] == "n/a" and "bidirectional" in probe.coverage["causal mask"][1]


def test_a_model_that_sees_order_is_verified_and_its_kind_measured(tmp_path):
    probe = _fit(tmp_path, "float_encoder", 1)
    assert _order(probe) == [] and [f for f in probe.findings if f.severity != "info"] == []
    assert probe.coverage["positions and order"] == ("verified", None, None)
    assert "measured bidirectional" in probe.coverage["causal mask"][1]
    assert probe.coverage["label alignment"][0] == "n/a"  # bidirectional: no next-token labels to align
    assert probe.coverage["padding"][0] == "unknown"  # no token ids: the padding probe could not run, said so


def test_a_set_model_is_order_blind_by_design_and_said_as_info(tmp_path):
    """Mean-pooled, no positions, one label per set: no label needs order; the fit is too short to judge the loss."""
    probe = _fit(tmp_path, "set_max", 2)
    [blind] = _order(probe)
    assert (blind.code, blind.severity) == ("TFD218", "info")
    assert "left its outputs unchanged" in blind.message and "no per-position labels" in blind.message
    assert probe.coverage["positions and order"] == ("verified", None, None)
    status, reason, _ = probe.coverage["label alignment"]  # one output per set: no positions to align
    assert status == "n/a" and "one output per sequence" in reason


def test_a_set_model_that_trains_is_info_also_under_gradient_accumulation(tmp_path):
    """30 steps of two micro-batches: the losses of the first 5 steps and of the 10 up to the last one (29) tell a
    loss that fell, so the order-blind set model is only described (TFD218)."""
    probe = MaskProbe()
    model, data = kind_module("set_max")(), kind_loader("set_max")()
    fit_tiny(tmp_path, [probe], model=model, data=data, max_steps=30, accumulate_grad_batches=2)
    [blind] = _order(probe)
    assert (blind.code, blind.severity, blind.step) == ("TFD218", "info", 29)
    assert blind.evidence["loss_late"] < 0.9 * blind.evidence["loss_early"] and "Its loss fell" in blind.message


def test_images_have_no_sequence_axis_to_permute(tmp_path):
    probe = _fit(tmp_path, "vit", 1)
    status, reason, _ = probe.coverage["positions and order"]
    assert status == "n/a" and "no sequence" in reason and _order(probe) == []
    for row in ("causal mask", "padding", "label alignment", "target leak into the inputs"):  # nothing per position
        assert probe.coverage[row][0] == "n/a" and "takes no sequence" in probe.coverage[row][1]


class CausalFloatEncoder(FloatTokenEncoder):
    """The float-feature encoder with a causal mask: each position reads itself and the positions before it."""

    def forward(self, features: Tensor) -> Tensor:
        h = self.inp(features) + self.pos[: features.shape[1]]
        mask = nn.Transformer.generate_square_subsequent_mask(features.shape[1])
        return self.out(self.encoder(h, mask=mask, is_causal=True))


def test_a_causal_model_without_token_ids_is_measured_causal(tmp_path):
    probe = _fit(tmp_path, "float_encoder", 1, module=CausalFloatEncoder())
    assert probe.coverage["causal mask"] == ("verified", None, None)
    assert probe.coverage["positions and order"] == ("verified", None, None)


class ZeroPositions(FloatTokenEncoder):
    """A position table initialised to zeros: order-blind at the first step, it sees order once it has learned."""

    def __init__(self) -> None:
        super().__init__(lr=3e-2)
        self.pos = nn.Parameter(torch.zeros(16, WIDTH))


def test_order_blind_at_init_is_probed_again_at_the_decision_step(tmp_path):
    """Blind at step 0 only: the decision step's probe sees order, so nothing is said and the row is verified."""
    probe = _fit(tmp_path, "float_encoder", 12, module=ZeroPositions())
    assert _order(probe) == []
    assert probe.coverage["positions and order"] == ("verified", None, None)


def test_only_the_watched_steps_cost_anything(tmp_path):
    """An order-blind model: the probe at step 0, its loss added on the device at the first five steps and the ten
    up to the decision step (the last, 29), probed again there; nothing on the steps between."""
    calls = TorchCalls()
    fit_tiny(
        tmp_path, calls.around(MaskProbe()), model=kind_module("set_max")(), data=kind_loader("set_max")(), max_steps=30
    )
    assert set(calls.counts) == set(range(5)) | set(range(20, 30))


def _reading(labels: bool | None) -> OrderSeenReading:
    return OrderSeenReading(1e-7, 0.5, 1e-4, True, 16, 14, "features (16, 16, 16)", labels, (0, 2, 9))


@pytest.mark.parametrize(
    "labels, trend, expected",
    [
        (True, LossTrend(2.8, 2.78, 5, 10, 100), ("TFD215", "error")),  # labels need order, the loss stays
        (True, LossTrend(2.8, 1.0, 5, 10, 100), ("TFD215", "warning")),  # labels need order, the loss fell
        (True, None, ("TFD215", "warning")),  # labels alone
        (None, LossTrend(1.39, 1.39, 5, 10, 100), ("TFD215", "warning")),  # the loss alone
        (None, LossTrend(2.6, 0.1, 5, 10, 100), ("TFD218", "info")),  # a set model that trains
        (False, LossTrend(2.6, 2.6, 5, 10, 10), ("TFD218", "info")),  # too short to judge the loss
    ],
)
def test_the_severity_follows_the_harm(labels, trend, expected):
    verdict = decide_order_blind(_reading(labels), trend)
    assert (verdict.code, verdict.severity or "info") == expected


@pytest.mark.slow
@pytest.mark.ci
@pytest.mark.ddp
def test_ddp_ranks_decide_an_order_blind_model_together(tmp_path):
    """Two gloo ranks, ``on_finding="raise"``: the sequence classifier without positions is order-blind and its loss
    stays at ln 4; every rank decides at the same step (the last, 29) and raises there together, none hangs. (Its
    model call sits inside the step Lightning routes through the module under DDP: read one level in.)"""
    from tests.helpers import run_distributed

    spec = {
        "strategy": "ddp",
        "model_class": "tests.kind_models:SeqClassifier",
        "model": {"positions": False},
        "data_class": "tests.kind_models:kind_data",
        "data": {"family": "bert_cls"},
        "trainer": {"max_steps": 30},
        "callbacks": [{"class_path": "lightning_tfdebug.MaskProbe", "init_args": {"on_finding": "raise"}}],
    }
    results = run_distributed(tmp_path, spec, timeout=300)
    for result in results:
        assert result["error"] is not None and result["error"]["type"] == "TFDebugError", result["error"]
        found = [f for f in result["findings"]["MaskProbe"] if f["code"] == "TFD215"]
        assert [(f["severity"], f["step"]) for f in found] == [("warning", 29)] and result["global_step"] == 30


class LastRealToken(nn.Module):
    """No positions; reads the last real token of each row (a mask of 1s, right padding), as a GPT classifier pools."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp, self.encoder, self.head = nn.Linear(8, WIDTH), _encoder(1), nn.Linear(WIDTH, 3)

    def forward(self, features: Tensor, attention_mask: Tensor) -> Tensor:
        h = self.encoder(self.inp(features), src_key_padding_mask=attention_mask == 0)
        last = attention_mask.sum(1) - 1
        return self.head(h[torch.arange(len(h)), last])


def test_padded_rows_keep_their_padding_and_their_last_real_token_in_place():
    """Right padding of various lengths: the positions that move are real in every row and none is a row's last real
    token, so a model without positions that pools the last real token reads as order-blind."""
    features = torch.randn(4, 12, 8)
    mask = torch.ones(4, 12, dtype=torch.long)
    mask[1, 9:], mask[2, 7:] = 0, 0
    model = LastRealToken().eval()
    with torch.no_grad():
        call = RecordedCall(model, (features, mask), {}, None)
        [reading], why_not = probe_order(call, 4, None, -100)
    assert why_not is None and not reading.per_position
    assert reading.free == 5  # 1 to 5 of 0-11: not 0 and 11 (first, last), 6 (row 2's last real), 7-10 (padded)
    assert reading.blind is True and float(reading.order_change) <= float(reading.tolerance)


class StopAt(pl.Callback):
    """Stops the fit after optimizer step ``step`` (as EarlyStopping or ``max_time`` would)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step >= self.step:
            trainer.should_stop = True


@pytest.mark.parametrize(
    "family, bugs, code, severity",
    [("float_encoder", {"positions": False}, "TFD215", "warning"), ("set_max", {}, "TFD218", "info")],
)
def test_a_fit_stopped_before_the_decision_step_decides_with_what_it_read(tmp_path, family, bugs, code, severity):
    """Planned for 200 steps (decision at step 100), stopped after 20: decided at the fit's end from the first probe's
    reading and the labels, without a loss trend (its late window was never read)."""
    probe = MaskProbe()
    model, data = kind_module(family, **bugs)(), kind_loader(family)()
    fit_tiny(tmp_path, [probe, StopAt(20)], model=model, data=data, max_steps=200)
    [blind] = _order(probe)
    assert (blind.code, blind.severity, blind.step) == (code, severity, 19)
    assert "loss_late" not in blind.evidence  # no trend claimed from an early window alone
    assert probe.coverage["positions and order"][0] == "verified"
