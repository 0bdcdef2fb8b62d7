"""AttentionProbe on real fits: a broken attention scale flagged at step 0 on three families, their healthy
counterparts and the healthy matrix's families silent, fused attention recorded as a check aside."""

from __future__ import annotations

import csv
import json
import warnings

import pytest

from lightning_tfdebug import AttentionProbe
from lightning_tfdebug.demo import TinyGPT, TinyTextDataModule
from tests.bug_models import HandAttentionGPT, HFAttentionLM
from tests.helpers import SMALL, fit_tiny


def _asides(tmp_path) -> list[dict]:
    return [json.loads(line) for p in tmp_path.rglob("stood-aside-rank*.jsonl") for line in p.read_text().splitlines()]


def test_scores_multiplied_by_sqrt_d_are_flagged_at_step_0_and_other_steps_log_nothing(tmp_path):
    probe = AttentionProbe()
    fit_tiny(tmp_path, [probe], HandAttentionGPT("multiply"), max_steps=3)
    (finding,) = probe.findings
    assert finding.code == "TFD240" and finding.step == 0 and finding.severity == "warning"
    assert "blocks.0.attn" in finding.evidence["layers"] and "blocks.1.attn" in finding.evidence["layers"]
    assert finding.evidence["entropy"] < 0.5 * finding.evidence["uniform"] and finding.evidence["head_dim"] == 64
    rows = list(csv.DictReader((tmp_path / "csv" / "version_0" / "metrics.csv").open()))
    logged = {int(r["step"]) for r in rows if r.get("attention/entropy_min")}
    assert logged == {0}  # step 0 only


def test_fused_attention_stands_aside_recorded_and_says_nothing(tmp_path):
    probe = AttentionProbe()
    fit_tiny(tmp_path, [probe], TinyGPT(**SMALL), max_steps=2)
    assert probe.findings == [] and probe.active and probe.layers == []
    (aside,) = [a for a in _asides(tmp_path) if a["check"].startswith("AttentionProbe")]
    assert "fused" in aside["reason"] and "attn_implementation='eager'" in aside["setting"]


@pytest.mark.slow
@pytest.mark.parametrize(
    "build",
    [
        pytest.param(lambda: HandAttentionGPT("none", unit_qk=True), id="hand-no-scale"),
        pytest.param(lambda: HandAttentionGPT("multiply", unit_qk=True), id="hand-times-sqrt-d"),
        pytest.param(lambda: HFAttentionLM("gpt2", "none", unit_qk=True), id="gpt2-scale_attn_weights-off"),
        pytest.param(lambda: HFAttentionLM("llama", "none", unit_qk=True), id="llama-scaling-1"),
        pytest.param(lambda: HFAttentionLM("llama", "multiply"), id="llama-scaling-sqrt-d"),
    ],
)
def test_a_broken_scale_is_flagged_at_step_0(tmp_path, build):
    probe = AttentionProbe()
    fit_tiny(tmp_path, [probe], build(), max_steps=1)
    assert [(f.code, f.step) for f in probe.findings] == [("TFD240", 0)]


@pytest.mark.slow
@pytest.mark.parametrize(
    "build",
    [
        pytest.param(lambda: HandAttentionGPT("divide", unit_qk=True), id="hand-unit-qk"),
        pytest.param(lambda: HandAttentionGPT("divide"), id="hand"),
        pytest.param(lambda: HFAttentionLM("gpt2", "divide", unit_qk=True), id="gpt2-unit-qk"),
        pytest.param(lambda: HFAttentionLM("gpt2", "divide"), id="gpt2"),
        pytest.param(lambda: HFAttentionLM("llama", "divide", unit_qk=True), id="llama-unit-qk"),
        pytest.param(lambda: HFAttentionLM("llama", "divide"), id="llama"),
    ],
)
def test_the_healthy_counterparts_are_read_and_silent(tmp_path, build):
    probe = AttentionProbe()
    fit_tiny(tmp_path, [probe], build(), max_steps=1)
    assert probe.findings == [] and len(probe.layers) == 2
    assert all(layer.ratio > 0.75 for layer in probe.layers)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["encoder_lm", "gpt2", "llama", "bert_mlm", "t5", "bart", "gemma"])
def test_the_healthy_matrix_families_are_silent(tmp_path, family):
    """nn.TransformerEncoder (its attention asked for its weights), and HF models at their default attention."""
    from tests.healthy_models import build, data

    probe = AttentionProbe()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fit_tiny(tmp_path, [probe], build(family), data(family), max_steps=1)
    assert [f.format() for f in probe.findings] == []
    read = bool(probe.layers)
    aside = [a for a in _asides(tmp_path) if a["check"].startswith("AttentionProbe")]
    assert read or aside, "either read or recorded as a check aside"
    if family in ("encoder_lm", "gpt2"):  # nn.MultiheadAttention asked for its weights; GPT-2's eager attention
        assert len(probe.layers) == 2 and all(layer.ratio > 0.75 for layer in probe.layers)


def test_a_fit_resumed_after_step_0_is_not_judged(tmp_path):
    probe = AttentionProbe()
    trainer = fit_tiny(tmp_path / "first", [], HandAttentionGPT("multiply"), max_steps=2, enable_checkpointing=True)
    ckpt = next((tmp_path / "first").rglob("*.ckpt"))
    fit_tiny(tmp_path, [probe], HandAttentionGPT("multiply"), TinyTextDataModule(batch_size=8), max_steps=3,
             ckpt_path=str(ckpt))  # fmt: skip
    assert trainer.global_step == 2 and probe.findings == []
    assert any("resumed" in a["reason"] for a in _asides(tmp_path))


def test_trained_weights_are_not_judged(tmp_path):
    """A fit that starts from trained weights (a fine-tune: predictions far from uniform) has legitimately sharp
    attention: recorded as aside, never TFD240. Here the predictions are made confident by a large output layer."""
    import torch

    model = HandAttentionGPT("multiply")
    with torch.no_grad():
        model.head.weight.mul_(200.0)
    probe = AttentionProbe()
    fit_tiny(tmp_path, [probe], model, max_steps=1)
    assert probe.findings == [] and probe.layers  # read, not judged
    assert any("trained, not random" in a["reason"] for a in _asides(tmp_path))
