"""OptimizerAudit's measured decisions, without a Trainer: host floats only.

Weight decay on one-dimensional parameters (norm gains, biases) is a lint (``TFD324``, info): published recipes build
``AdamW(model.parameters(), weight_decay=...)`` over every parameter, and at their decay values and run lengths
nothing measurable happens to those parameters. It is a warning once the run shows the harm: the decayed 1-D
parameters' norm falls against its own first measured value, by more than :data:`SHRINK` of it, and the decay itself
accounts for at least :data:`DECAY_SHARE` of that fall (gradients also move norm gains, up or down; a fall the decay
could not have caused is the loss's doing).
"""

from __future__ import annotations

import math
from typing import Any

from lightning_tfdebug.functional.verdicts import Verdict

SHRINK = 0.1
"""``TFD324`` as a warning when the decayed 1-D parameters' norm fell by more than this fraction of its first measured
value. Measured (TinyGPT, ``AdamW(model.parameters())``, 120 steps, 10-step warm-up): the recipes' decay
(``weight_decay`` 0.01 to 0.1 at lr 3e-4 to 2e-3) leaves that norm 1% to 3% *above* its first value; decay 1.0 at lr
3e-3 takes it 20% below, 3.0 takes it 50% below."""
DECAY_SHARE = 0.5
"""... and the decay alone would have shrunk the norm by at least this share of the measured fall:
``1 - exp(-sum of lr * weight_decay over the steps)`` (without gradients, decoupled decay multiplies every decayed
weight by ``1 - lr * weight_decay`` per step)."""


def decay_shrinkage(exposure: float) -> float:
    """The fraction of their norm that decoupled decay alone takes from weights over steps whose ``lr *
    weight_decay`` add up to ``exposure``."""
    return 1.0 - math.exp(-max(exposure, 0.0))


def decayed_norms_shrink(
    first: tuple[int, float], latest: tuple[int, float], exposure: float, evidence: dict[str, Any]
) -> Verdict | None:
    """``TFD324`` (warning): the decayed 1-D parameters' norm (``(step, norm)`` at the first and the latest
    measurement) fell by more than :data:`SHRINK`, and the decay's ``exposure`` (``sum lr * weight_decay`` between
    them) accounts for :data:`DECAY_SHARE` of the fall. None otherwise."""
    (first_step, first_norm), (step, norm) = first, latest
    if not (math.isfinite(first_norm) and math.isfinite(norm) and first_norm > 0 and step > first_step):
        return None
    fall = 1.0 - norm / first_norm
    by_decay = decay_shrinkage(exposure)
    if fall <= SHRINK or by_decay < DECAY_SHARE * fall:
        return None
    return Verdict(
        "TFD324",
        f"Weight decay is shrinking the one-dimensional parameters (norm gains, biases): their norm fell from "
        f"{first_norm:.4g} at step {first_step} to {norm:.4g} at step {step} ({fall:.1%}), and the decay alone takes "
        f"{by_decay:.1%} over those steps (lr x weight_decay adds up to {exposure:.3g}). Norm gains pulled towards 0 "
        "scale every normalised activation down.",
        {
            **evidence,
            "first_step": first_step,
            "first_norm": first_norm,
            "step": step,
            "norm": norm,
            "fall": fall,
            "decay_exposure": exposure,
            "decay_shrinkage": by_decay,
        },
        severity="warning",
    )
