"""AttentionProbe's rule ``TFD240``: attention far sharper than uniform on random weights, and the scale it implies.

Why a threshold of half the uniform entropy and a content spread of 2: with scores of standard deviation ``s`` over
``n`` keys, the entropy of the softmax is about ``ln n - s**2 / 2`` (while ``s**2 < 2 ln n``). Unit-variance ``q`` and
``k`` with the ``1/sqrt(d)`` scale give ``s`` about 1 (0.3 to 1 with common inits), so the entropy stays within half a
nat of uniform. Without the scale ``s`` grows by ``sqrt(d)``, with ``* sqrt(d)`` in its place by ``d``: at d = 64, 8
and 64 times, and the attention is nearly one-hot. Sharpness that comes from positions (ALiBi, T5's relative bias, a
local window) is the same for every batch row and is not counted in the content spread; very short sequences (fewer
than :data:`MIN_KEYS` keys on average) are not judged.

Example:
    >>> from lightning_tfdebug.functional.attention_checks import LayerEntropy, decide
    >>> sharp = LayerEntropy("h.0.attn", entropy=0.4, uniform=2.3, spread=9.0, keys=16.0, head_dim=64)
    >>> decide([sharp])[0].code
    'TFD240'
    >>> decide([LayerEntropy("h.0.attn", entropy=2.2, uniform=2.3, spread=0.5, keys=16.0, head_dim=64)])
    []
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from lightning_tfdebug.functional.evidence_chart import EvidenceChart
from lightning_tfdebug.functional.verdicts import Rule, Verdict
from lightning_tfdebug.primitives.keys import Key

BLOCK = ("TFD240", "TFD249")
"""The codes reserved for AttentionProbe's rules."""

KEYS: tuple[Key, ...] = (
    Key("attention/entropy_min", "step 0: lowest mean attention entropy of a layer", "nats", chart="attention"),
    Key(
        "attention/uniform",
        "step 0: the uniform entropy of that layer's mask (mean ln of unmasked keys)",
        "nats",
        chart="attention",
    ),
    Key(
        "attention/entropy_ratio_min",
        "step 0: lowest ratio of a layer's entropy to its uniform entropy",
        "",
        chart="attention",
    ),
    Key(
        "attention/spread_max",
        "step 0: largest content spread (std) of a layer's attention scores",
        "",
        chart="attention",
    ),
    Key("attention/layers", "step 0: attention layers read", "", chart="attention"),
    Key("attention/seconds", "step 0: wall time of the probe", "s", chart="attention"),
)
"""Every scalar AttentionProbe logs (at step 0 only): ``AttentionProbe.KEYS``."""


@dataclass(frozen=True)
class LayerEntropy:
    """One attention layer at init, on the host: mean entropy and the uniform entropy of its mask (nats), the content
    spread of its scores (None with one batch row), the mean unmasked keys per row and the head dimension if known."""

    layer: str
    entropy: float
    uniform: float
    spread: float | None
    keys: float
    head_dim: int | None = None

    @property
    def ratio(self) -> float:
        return self.entropy / self.uniform if self.uniform > 0 else 1.0


SHARP_RATIO = 0.5
"""A layer is sharp when its mean entropy is below this share of the uniform entropy of its mask."""
MIN_SPREAD = 2.0
"""... and the content spread of its scores is above this (about 1 with unit-variance q, k and the 1/sqrt(d) scale)."""
MIN_KEYS = 4.0
"""Layers attending to fewer keys than this on average are not judged (short sequences are legitimately sharp)."""
HEALTHY_SPREAD = 1.0
"""The largest content spread a correctly scaled layer shows at init (unit-variance q, k; smaller inits give less)."""

TFD240 = Rule(
    "TFD240",
    "warning",
    "AttentionProbe",
    title="attention far sharper than uniform on random weights (attention scale)",
    headline="attention far sharper than uniform at init ({layer}: entropy {entropy:.2f} of {uniform:.2f} nats)",
    chart=EvidenceChart("How sharp is attention on random weights?", "nats", bars=("entropy", "uniform")),
    trigger=(
        "at step 0 a layer's mean attention entropy is below half the entropy the same mask gives with uniform scores, "
        "and the content spread of its scores is above 2 (about 1 with the 1/sqrt(d) scale)"
    ),
    hint=(
        "Scale the attention scores by 1/sqrt(d) with d the head dimension: `scores = q @ k.transpose(-2, -1) / "
        "math.sqrt(d)` (or `* d ** -0.5`), not `* math.sqrt(d)`, and not left out; with Hugging Face models check "
        "`scale_attn_weights` / the attention module's `scaling`. `F.scaled_dot_product_attention` applies the right "
        "scale by default (`scale=None`)."
    ),
    reason=(
        "Measured: nearly one-hot attention at init passes almost no gradient to the other keys, so training starts "
        "slower and less stably; it does not corrupt results by itself"
    ),
    message=(
        "attention far sharper than uniform at init in {count} layer(s), first {layer}: entropy {entropy:.2f} nats "
        "against {uniform:.2f} for uniform attention over its unmasked keys ({keys:.1f} on average); score spread "
        "{spread:.1f}, {implied}"
    ),
)


def implied_scale(spread: float, head_dim: int | None) -> str:
    """What the content spread says of the scale: the spread a correctly scaled layer would show under each bug.

    A correctly scaled layer spreads at most about :data:`HEALTHY_SPREAD`; a missing 1/sqrt(d) multiplies the spread
    by sqrt(d), ``* sqrt(d)`` in place of ``/ sqrt(d)`` by d. When dividing by sqrt(d) still leaves more than a healthy
    spread, only the inverted scale (or a larger factor) explains it.
    """
    if head_dim is None:
        return (
            "more than a correctly scaled layer shows at init (about 1 at most): a missing 1/sqrt(d) multiplies the "
            "spread by sqrt(d), `* sqrt(d)` in place of `/ sqrt(d)` by d (head dimension not found)"
        )
    root = math.sqrt(head_dim)
    if spread / root > HEALTHY_SPREAD:
        return (
            f"{spread / root:.1f} even divided by sqrt(d) = {root:.0f} (d = {head_dim}), {spread / head_dim:.2f} "
            "divided by d: the scores are multiplied by sqrt(d) instead of divided (or scaled up more)"
        )
    return (
        f"which a correctly scaled layer would show as {spread / root:.2f} if the 1/sqrt(d) scale is missing (d = "
        f"{head_dim}), or {spread / head_dim:.2f} if the scores are multiplied by sqrt(d) instead of divided"
    )


def is_sharp(layer: LayerEntropy) -> bool:
    """Far sharper than uniform, from the content of the scores, over enough keys (see the module docstring)."""
    if layer.keys < MIN_KEYS or layer.spread is None or not math.isfinite(layer.entropy):
        return False
    return layer.ratio < SHARP_RATIO and layer.spread > MIN_SPREAD


FRESH_SHARE = 0.75
"""Weights count as random when the model's predictions at step 0 keep at least this share of ln(V) as entropy: a
fine-tune starting from trained weights (whose attention is legitimately sharp) predicts far below it."""


def is_fresh(prediction_entropy: float | None, vocab: int) -> bool:
    """Whether the step-0 predictions look like those of random weights (unknown: judged as fresh)."""
    return prediction_entropy is None or vocab < 2 or prediction_entropy >= FRESH_SHARE * math.log(vocab)


def decide(layers: Sequence[LayerEntropy]) -> list[Verdict]:
    """``TFD240`` naming the sharp layers (the sharpest first), or nothing."""
    sharp = sorted((layer for layer in layers if is_sharp(layer)), key=lambda layer: layer.ratio)
    if not sharp:
        return []
    first = sharp[0]
    assert first.spread is not None
    evidence = {
        "layer": first.layer,
        "layers": [layer.layer for layer in sharp],
        "count": len(sharp),
        "entropy": first.entropy,
        "uniform": first.uniform,
        "keys": first.keys,
        "spread": first.spread,
        "head_dim": first.head_dim,
    }
    implied = implied_scale(first.spread, first.head_dim)
    return [TFD240.verdict(evidence, key="attention/entropy_ratio_min", step=0, implied=implied)]


RULES: tuple[Rule, ...] = (TFD240,)
"""AttentionProbe's rules, in documentation order."""


COVERAGE: dict[str, tuple[str, ...]] = {
    "attention at init": ("TFD240",),
}
"""The rows of the run's Coverage table these rules answer: the check -> the codes that decide it."""
