"""DeadActivation's rules ``TFD340``-``TFD344``: too many dead or saturated units, for how long, rising, or
activations that cannot be observed at all. Pure functions of host numbers."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from lightning_tfdebug.functional.evidence_chart import EvidenceChart
from lightning_tfdebug.functional.verdicts import Rule, Verdict
from lightning_tfdebug.primitives.tracking import Streak

CAUSES_DEAD = (
    "A dead unit outputs zero for every token and gets no gradient, so it never comes back. Usual causes: a "
    "learning rate too high (one large update pushes its weights or bias far negative), a large negative bias "
    "at init, or ReLU where GELU/SiLU/LeakyReLU would keep a gradient for negative inputs. Lower the LR or add "
    "warm-up, initialise biases at zero, or switch the activation."
)
CAUSES_SATURATED = (
    "Saturated units pass almost no gradient back. Usual causes: pre-activations too large (missing "
    "normalisation before the activation, init too large, LR too high), or tanh/sigmoid in a deep stack. "
    "Normalise the inputs of the layer, lower the LR or init scale, or use GELU/SiLU."
)


@dataclass(frozen=True)
class ActivationThresholds:
    """The callback's thresholds (see :class:`~lightning_tfdebug.DeadActivation`'s arguments)."""

    dead: float = 0.5
    saturation: float = 0.5
    patience: int = 2
    dead_rise: float = 0.35
    saturation_rise: float = 0.35
    saturation_grad: float = 0.01


@dataclass
class ActivationHistory:
    """What the decisions remember between measurements, per layer: plain host values, saved in checkpoints."""

    lowest_dead: dict[str, float] = field(default_factory=dict)
    last_dead: dict[str, float] = field(default_factory=dict)
    dead_streak: Streak = field(default_factory=Streak)
    rise_streak: Streak = field(default_factory=Streak)
    sat_streak: Streak = field(default_factory=Streak)
    lowest_sat: dict[str, float] = field(default_factory=dict)
    last_sat: dict[str, float] = field(default_factory=dict)
    sat_rise_streak: Streak = field(default_factory=Streak)

    def state_dict(self) -> dict[str, Any]:
        return {
            name: value.state_dict() if isinstance(value, Streak) else dict(value) for name, value in vars(self).items()
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for name, value in vars(self).items():
            if isinstance(value, Streak):
                value.load_state_dict(state.get(name, {}))
            else:
                setattr(self, name, {str(k): float(v) for k, v in state.get(name, {}).items()})


def climb(lowest: dict[str, float], last: dict[str, float], name: str, frac: float, rise: float) -> float | None:
    """Record ``frac`` for ``name``; return its lowest value so far if ``frac`` is at least ``rise`` above it and not
    falling back (dying or saturating units do not recover), else None."""
    low = min(lowest.get(name, frac), frac)
    previous = last.get(name, frac)
    lowest[name], last[name] = low, frac
    return low if frac - low >= rise and frac >= previous - 0.01 else None


def _listed(items: Iterable[str]) -> str:
    return ", ".join(list(items)[:10])


def decide_activations(
    fractions: Iterable[tuple[str, float | None, float | None]],
    history: ActivationHistory,
    limits: ActivationThresholds,
    step: int | None = None,
) -> list[Verdict]:
    """One measurement's verdicts (``TFD340`` dead, ``TFD341`` dead rising, ``TFD342`` saturated, ``TFD344``
    saturated rising), updating ``history``.

    Args:
        fractions: per layer that ran, ``(name, dead_fraction, saturated_fraction)``; None where the layer's kind has
            no such statistic (tanh/sigmoid count no zeros, ReLU does not saturate).
        history: the streaks and lowest values so far (updated in place).
        limits: thresholds, patience and rises.
        step: the step the fractions were measured at (the verdicts' step).
    """
    dead, rising, saturated, sat_rising = {}, {}, {}, {}
    for name, dead_frac, sat_frac in fractions:
        if dead_frac is not None:
            if history.dead_streak.update(name, dead_frac > limits.dead) >= limits.patience:
                dead[name] = dead_frac
            lowest = climb(history.lowest_dead, history.last_dead, name, dead_frac, limits.dead_rise)
            if history.rise_streak.update(name, lowest is not None) >= limits.patience:
                rising[name] = (lowest, dead_frac)
        if sat_frac is not None:
            if history.sat_streak.update(name, sat_frac > limits.saturation) >= limits.patience:
                saturated[name] = sat_frac
            lowest = climb(history.lowest_sat, history.last_sat, name, sat_frac, limits.saturation_rise)
            if history.sat_rise_streak.update(name, lowest is not None) >= limits.patience:
                sat_rising[name] = (lowest, sat_frac)
    verdicts = (
        dead_units(dead, limits, step),
        dying_units(rising, step),
        saturated_units(saturated, limits, step),
        saturating_units(sat_rising, step),
    )
    return [v for v in verdicts if v is not None]


TFD340 = Rule(
    "TFD340",
    "warning",
    "DeadActivation",
    title=("layers with more than `dead_threshold` dead units for `patience` measurements, named with their fractions"),
    headline="{count} layers with more than {threshold:.0%} dead units",
    chart=EvidenceChart(
        "Which layers' units died?",
        "fraction of units",
        logged=("dead_activation/dead_frac/<layer>",),
    ),
    trigger=(
        "a layer's dead-unit fraction (units zero for every token of the batch, on every rank) above "
        "`dead_threshold` for `patience` measurements"
    ),
    hint="lower the LR / add warm-up; zero-initialise biases before ReLU; use GELU/SiLU/LeakyReLU",
    reason="Measured, sustained: dead units no longer learn and the layer loses their capacity",
    message=(
        "{count} layer(s) have more than {threshold:.0%} dead units (zero for every token of the batch) for "
        "{patience} measurements: {listed}."
    ),
    details=(
        "A unit is one feature of the last dimension of an activation's output (every other dimension is tokens); it "
        "is dead when it was exactly zero for every token of the measured batch on every rank (alive on any rank is "
        "alive). TFD340 when a layer's dead fraction is above `dead_threshold` (default 0.5) on `patience` (default "
        "2) measurements in a row. About half the outputs of a healthy ReLU are zero (`zero_frac` near 0.5), but its "
        "units are not dead."
    ),
)


def dead_units(dead: Mapping[str, float], limits: ActivationThresholds, step: int | None = None) -> Verdict | None:
    """``TFD340`` for ``{name: dead_fraction}`` of the layers above ``limits.dead`` long enough; None if empty."""
    return _above(TFD340, "dead_frac", dead, limits.dead, limits, CAUSES_DEAD, step)


def _above(
    rule: Rule,
    stat: str,
    fractions: Mapping[str, float],
    threshold: float,
    limits: ActivationThresholds,
    hint: str,
    step: int | None,
) -> Verdict | None:
    if not fractions:
        return None
    return rule.verdict(
        {stat: dict(fractions), "threshold": threshold},
        hint=hint,
        step=step,
        count=len(fractions),
        patience=limits.patience,
        saturation_grad=limits.saturation_grad,
        listed=_listed(f"{n} ({f:.0%})" for n, f in fractions.items()),
    )


TFD341 = Rule(
    "TFD341",
    "warning",
    "DeadActivation",
    title=("the dead fraction of a layer is rising: `dead_rise` above its lowest value for `patience` measurements"),
    headline="the dead fraction is rising: {listed}",
    chart=EvidenceChart(
        "Is the dead fraction of a layer rising?",
        "fraction of units",
        logged=("dead_activation/dead_frac/<layer>",),
    ),
    trigger=(
        "a layer's dead-unit fraction risen by `dead_rise` above its lowest value, for `patience` measurements "
        "without falling back"
    ),
    hint=("units are dying during training: lower the LR, add warm-up or gradient clipping, switch the activation"),
    reason="Measured: units are dying during training, capacity the layer keeps losing",
    message="The dead-unit fraction is rising in {listed}: units are dying during training.",
    details=(
        "When a layer's dead fraction has risen by more than `dead_rise` (default 0.35) above the lowest value it had"
        " in this run, on `patience` (default 2) measurements in a row without falling back."
    ),
)


def dying_units(rising: Mapping[str, tuple[float, float]], step: int | None = None) -> Verdict | None:
    """``TFD341`` for ``{name: (lowest, now)}`` of the layers whose dead fraction climbed; None if empty."""
    return _rising(TFD341, "dead_frac", rising, CAUSES_DEAD, step)


def _rising(
    rule: Rule, stat: str, rising: Mapping[str, tuple[float, float]], hint: str, step: int | None
) -> Verdict | None:
    if not rising:
        return None
    return rule.verdict(
        {stat: {n: now for n, (_, now) in rising.items()}, "lowest": {n: lo for n, (lo, _) in rising.items()}},
        hint=hint,
        step=step,
        listed=_listed(f"{n} ({lo:.0%} -> {now:.0%})" for n, (lo, now) in rising.items()),
    )


TFD342 = Rule(
    "TFD342",
    "warning",
    "DeadActivation",
    title="layers with more than `saturation_threshold` saturated elements for `patience` measurements",
    headline="{count} layers with more than {threshold:.0%} saturated elements",
    chart=EvidenceChart(
        "Which layers saturate?",
        "fraction of elements",
        logged=("dead_activation/saturated_frac/<layer>",),
    ),
    trigger=(
        "a layer's saturated fraction (local gradient below `saturation_grad`: tanh/sigmoid near their bounds, "
        "GELU/SiLU/Mish deep in the negative tail) above `saturation_threshold` for `patience` measurements"
    ),
    hint="normalise the layer's input, shrink init or LR, prefer GELU/SiLU over tanh/sigmoid in deep stacks",
    reason="Measured, sustained: saturated units pass almost no gradient",
    message=(
        "{count} layer(s) have more than {threshold:.0%} saturated activations (local gradient below "
        "{saturation_grad:g}) for {patience} measurements: {listed}."
    ),
    details=(
        "An element is saturated when the activation's local derivative `|f'(x)|` is below `saturation_grad` (default"
        " 0.01) in a flat region: tanh and sigmoid read from the output (`1 - y²`, `y(1 - y)`, so `|y|` near its "
        "bound); GELU, SiLU and Mish read from the pre-activation, in the negative tail where the gradient has fallen"
        " under the threshold (below about -3.1 for GELU and -6.3 for SiLU at 0.01; GELU's zero derivative near -0.75"
        " is not counted). TFD342 when a layer's saturated fraction is above `saturation_threshold` (default 0.5) on "
        "`patience` (default 2) measurements in a row."
    ),
)


def saturated_units(
    saturated: Mapping[str, float], limits: ActivationThresholds, step: int | None = None
) -> Verdict | None:
    """``TFD342`` for ``{name: saturated_fraction}`` of the layers above ``limits.saturation`` long enough."""
    return _above(TFD342, "saturated_frac", saturated, limits.saturation, limits, CAUSES_SATURATED, step)


TFD344 = Rule(
    "TFD344",
    "warning",
    "DeadActivation",
    title=(
        "the saturated fraction of a layer is rising: `saturation_rise` above its lowest value for `patience` "
        "measurements"
    ),
    headline="the saturated fraction is rising: {listed}",
    chart=EvidenceChart(
        "Is the saturated fraction of a layer rising?",
        "fraction of elements",
        logged=("dead_activation/saturated_frac/<layer>",),
    ),
    trigger=(
        "a layer's saturated fraction risen by `saturation_rise` above its lowest value, for `patience` "
        "measurements without falling back"
    ),
    hint=(
        "pre-activations are growing: lower the LR, normalise the layer's input, add weight decay or clipping, "
        "prefer GELU/SiLU"
    ),
    reason="Measured: saturation is rising during training, so ever less gradient passes the layer",
    message=(
        "The saturated fraction is rising in {listed}: more and more units sit where their gradient is almost zero."
    ),
    details=(
        "When a layer's saturated fraction has risen by more than `saturation_rise` (default 0.35) above the lowest "
        "value it had in this run, on `patience` (default 2) measurements in a row without falling back."
    ),
)


def saturating_units(rising: Mapping[str, tuple[float, float]], step: int | None = None) -> Verdict | None:
    """``TFD344`` for ``{name: (lowest, now)}`` of the layers whose saturated fraction climbed; None if empty."""
    return _rising(TFD344, "saturated_frac", rising, CAUSES_SATURATED, step)


HINT_COMPILED = (
    "Run DeadActivation on an uncompiled model (e.g. a short debugging run without torch.compile), or compile only "
    "parts of the model that contain no activation you want measured."
)
HINT_UNHOOKED = (
    "Check that the activations are modules called in the training forward; for activations applied as functions, "
    "name the modules feeding them with `preactivations`."
)


def compiled_reason(compiled: bool) -> str | None:
    """Why nothing can be measured when torch.compile wraps the model or a submodule, else None."""
    if not compiled:
        return None
    return (
        "the model (or a submodule) is compiled with torch.compile, and compiled code ignores forward hooks added "
        "after compilation (or bakes in hooks present when it was traced), so activations cannot be observed."
    )


def no_layer_reason(found: int, layers: str | None) -> str | None:
    """Why nothing can be measured when the first measurement ``found`` no layer, else None."""
    if found:
        return None
    return (
        "no activation module (ReLU, GELU, SiLU, Tanh, Sigmoid, ...) "
        + (f"matching `layers={layers!r}` " if layers else "")
        + "is in the model and its submodules called no activation function (F.relu, F.gelu, F.silu, ...) "
        "during the training forward."
    )


def silent_layers_reason(ran: int, compiled: bool) -> str | None:
    """Why nothing can be measured when none of the hooked layers ``ran`` in a measured forward, else None."""
    if ran:
        return None
    return (
        "none of the hooked activation modules ran during the training forward"
        + (" (the model is compiled)" if compiled else "")
        + ", so activations cannot be observed."
    )


TFD343 = Rule(
    "TFD343",
    "info",
    "DeadActivation",
    title="activations cannot be observed (torch.compile, or no hooked module ran); the callback stands aside",
    trigger=(
        "activations cannot be observed: the model (or a submodule) is compiled with `torch.compile`, it has no "
        "activation module and its submodules called no activation function, or no hooked module ran in the "
        "training forward; DeadActivation stands aside"
    ),
    hint=(
        "measure in an uncompiled debugging run; name the inputs of activations written as arithmetic with "
        "`preactivations`"
    ),
    reason="The check stands aside (compiled or unhooked model); nothing was measured",
    message="DeadActivation cannot measure: {reason}",
)


def unobservable_verdict(reason: str | None, *, compiled: bool, step: int | None = None) -> Verdict | None:
    """``TFD343`` for one of the ``*_reason`` functions' ``reason`` (None: no verdict); ``compiled`` picks the hint."""
    if reason is None:
        return None
    return TFD343.verdict(
        {"compiled": compiled}, hint=HINT_COMPILED if compiled else HINT_UNHOOKED, step=step, reason=reason
    )


BLOCK = ("TFD340", "TFD349")
"""The codes reserved for DeadActivation's rules."""

RULES: tuple[Rule, ...] = (TFD340, TFD341, TFD342, TFD343, TFD344)
"""The rules decided in this module, in code order."""


COVERAGE: dict[str, tuple[str, ...]] = {
    "dead or saturated units": (
        "TFD340",
        "TFD341",
        "TFD342",
        "TFD343",
        "TFD344",
    ),
}
"""The rows of the run's Coverage table these rules answer: the check -> the codes that decide it."""
