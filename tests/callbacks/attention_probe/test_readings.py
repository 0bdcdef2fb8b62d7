"""AttentionProbe's pure parts: the per-layer reading of a softmax and the TFD240 decision, on constructed scores."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from lightning_tfdebug.callbacks.attention_probe.readings import AttentionCapture, find_head_dim, measure
from lightning_tfdebug.functional.attention_checks import LayerEntropy, decide, implied_scale


def _host(r) -> LayerEntropy:
    spread = None if r.spread is None else float(r.spread)
    return LayerEntropy(r.layer, float(r.entropy), float(r.uniform), spread, float(r.keys), r.head_dim)


def _causal(scores: torch.Tensor) -> torch.Tensor:
    t = scores.shape[-1]
    return scores.masked_fill(~torch.ones(t, t, dtype=torch.bool).tril(), float("-inf"))


def test_uniform_scores_under_a_causal_mask_have_the_uniform_entropy_of_that_mask():
    scores = _causal(torch.zeros(2, 2, 8, 8))
    r = _host(measure("l", scores.softmax(-1), scores, None))
    expected = sum(math.log(n) for n in range(1, 9)) / 8  # row t attends to t + 1 keys
    assert math.isclose(r.uniform, expected, rel_tol=1e-5) and math.isclose(r.entropy, expected, rel_tol=1e-5)
    assert r.keys == 4.5 and r.spread is not None and r.spread < 1e-5


def test_padding_keys_and_fully_masked_rows_are_left_out():
    scores = torch.zeros(2, 1, 4, 6)
    scores[1, :, :, 3:] = torch.finfo(torch.float32).min  # the second row's last three keys are padding
    r = _host(measure("l", scores.softmax(-1), scores, None))
    assert math.isclose(r.uniform, (math.log(6) + math.log(3)) / 2, rel_tol=1e-5)
    probs = F.pad(torch.full((1, 1, 3, 4), 0.25), (0, 0, 0, 1))  # a last query row that attends nowhere (all zero)
    assert math.isclose(float(measure("l", probs, None, None).uniform), math.log(4), rel_tol=1e-5)


def test_content_scaled_scores_are_flagged_and_the_scale_is_named():
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(4, 2, 32, 64, generator=g), torch.randn(4, 2, 32, 64, generator=g)
    layers = {}
    for name, factor in (("divide", 64**-0.5), ("none", 1.0), ("multiply", 64**0.5)):
        scores = _causal(q @ k.transpose(-2, -1) * factor)
        layers[name] = _host(measure(name, scores.softmax(-1), scores, 64))
    assert 0.7 < layers["divide"].spread < 1.3 and layers["divide"].ratio > 0.75  # unit variance: spread about 1
    assert decide([layers["divide"]]) == []
    for name in ("none", "multiply"):
        (verdict,) = decide([layers["divide"], layers[name]])
        assert verdict.code == "TFD240" and verdict.evidence["layers"] == [name]
    assert "multiplied by sqrt(d) instead of divided (or scaled up more)" in decide([layers["multiply"]])[0].message
    assert "0.9" in implied_scale(layers["none"].spread, 64) or "1.0" in implied_scale(layers["none"].spread, 64)


def test_sharpness_from_positions_alone_is_not_flagged():
    """ALiBi-like: a bias of -slope * distance, the same for every batch row, makes attention sharp without content."""
    g = torch.Generator().manual_seed(0)
    t = 32
    distance = (torch.arange(t)[:, None] - torch.arange(t)[None, :]).float()
    content = (torch.randn(4, 2, 64, t, generator=g).transpose(-2, -1) @ torch.randn(4, 2, 64, t, generator=g)) / 8
    scores = _causal(content - 2.0 * distance.clamp_min(0))
    r = _host(measure("alibi", scores.softmax(-1), scores, 64))
    assert r.ratio < 0.5 and r.spread < 1.3  # sharp, but its content spread is that of a correctly scaled layer
    assert decide([r]) == []


def test_very_short_sequences_are_not_judged():
    g = torch.Generator().manual_seed(0)
    scores = _causal(torch.randn(4, 2, 3, 3, generator=g) * 50)
    assert decide([_host(measure("short", scores.softmax(-1), scores, 64))]) == []


def test_the_capture_reads_attention_softmaxes_and_records_fused_attention():
    class TwoKinds(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.head_dim = 8

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            probs = F.softmax(x @ x.transpose(-2, -1), dim=-1)  # (B, H, T, T): read
            torch.softmax(x.sum(1), dim=-1)  # (B, T, D): not attention
            return F.scaled_dot_product_attention(x, x, x) + probs @ x  # fused: recorded

    module = TwoKinds()
    capture = AttentionCapture(lambda: ("block", module), batch_size=2, inside_mha=lambda: False)
    with capture:
        module(torch.randn(2, 2, 5, 8))
    assert [r.layer for r in capture.readings] == ["block"] and capture.readings[0].head_dim == 8
    assert capture.fused == ["block"]
    assert find_head_dim(nn.MultiheadAttention(32, 4)) == 8
