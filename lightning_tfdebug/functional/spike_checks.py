"""SpikeGuard's decisions and rules ``TFD530``-``TFD531``: a robust device-side baseline of a log-scale quantity (the
training loss, or the all-reduced gradient norm under several ranks), the per-step spike decision as a device flag,
and the verdicts from a spike's attribution.

Pure: tensors and host numbers in, device flags and verdicts out. The callback
(:mod:`lightning_tfdebug.callbacks.spike_guard`) owns the hooks, the replay and the bundle.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from lightning_tfdebug.functional.evidence_chart import TRAINING_LOSS, EvidenceChart
from lightning_tfdebug.functional.verdicts import Rule, Verdict

LOG_FLOOR = 1e-12
"""Values are compared in log space; a non-positive value is clamped here (and never flagged)."""


@dataclass
class RobustBaseline:
    """A running robust baseline of a log-scale value, held on the device: an exponential mean and an exponential mean
    absolute deviation, fed with the value clipped at ``clip`` deviations above the mean (a spike does not move it)
    and never fed on a flagged step. Host state: how many steps it has seen (no device read).

    Args:
        alpha: the mean's EMA weight of a new step (fast: a falling loss must not leave it behind); the first
            ``1 / alpha`` steps are averaged.
        dev_alpha: the deviation's EMA weight (slower: one noisy step does not move it much).
        clip: feed at most ``mean + clip * deviation``.
        dev_floor: the least deviation (log units) a z-score divides by: a flat loss is not "infinitely" spiky.
    """

    alpha: float = 0.3
    dev_alpha: float = 0.1
    clip: float = 3.0
    dev_floor: float = 0.02
    seen: int = 0
    mean: Tensor | None = None
    dev: Tensor | None = None

    def reset(self) -> None:
        self.seen, self.mean, self.dev = 0, None, None

    def z_and_excess(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """``(z, excess)`` of log-value ``x``: robust z-score and log-ratio above the mean (device scalars)."""
        assert self.mean is not None and self.dev is not None
        excess = x - self.mean
        return excess / self.dev.clamp_min(self.dev_floor), excess

    def update(self, x: Tensor, keep: Tensor | None) -> None:
        """Feed log-value ``x`` unless ``keep`` (a device bool) is False or ``x`` is not finite. No host sync."""
        x = x.detach().float().reshape(())
        if self.mean is None or self.dev is None:
            self.mean = torch.where(torch.isfinite(x), x, torch.zeros_like(x))
            self.dev = torch.zeros_like(x)
            self.seen = 1
            return
        a = max(self.alpha, 1.0 / (self.seen + 1))
        fed = torch.minimum(x, self.mean + self.clip * self.dev.clamp_min(self.dev_floor))
        new_mean = self.mean + a * (fed - self.mean)
        b = max(self.dev_alpha, 1.0 / (self.seen + 1))
        new_dev = self.dev + b * ((fed - self.mean).abs() - self.dev)
        ok = torch.isfinite(x)
        if keep is not None:
            ok = ok & keep
        self.mean = torch.where(ok, new_mean, self.mean)
        self.dev = torch.where(ok, new_dev, self.dev)
        self.seen += 1


def log_value(value: Tensor) -> Tensor:
    """``log(value)`` as a float32 0-d tensor (clamped at :data:`LOG_FLOOR`)."""
    return value.detach().float().reshape(()).clamp_min(LOG_FLOOR).log()


def spike_flag(baseline: RobustBaseline, x: Tensor, threshold: float, min_ratio: float) -> Tensor:
    """Device bool: log-value ``x`` is a spike against ``baseline`` (finite, ``threshold`` robust deviations and
    ``log(min_ratio)`` above its mean). The caller arms it only once the baseline has enough history."""
    z, excess = baseline.z_and_excess(x)
    return torch.isfinite(x) & (z > threshold) & (excess > math.log(min_ratio))


# ---------------------------------------------------------------------------------------------- host-side arming
def restart_reason(
    lr: float | None,
    last_lr: float | None,
    length: int | None,
    base_length: int | None,
    restart_ratio: float,
    warming_up: bool = False,
) -> str | None:
    """Why the baseline must start again at this step (host numbers only), or None.

    An LR restart: the LR rose more than ``restart_ratio`` times in one step from a non-zero LR, not while it was
    already rising (``warming_up``: a warm-up). A planned change of sequence length: a length outside
    ``[1/1.5, 1.5]`` times the length the baseline was built on (padding to the longest row varies less).
    """
    if not warming_up and lr is not None and last_lr is not None and last_lr > 0 and lr > restart_ratio * last_lr:
        return f"the LR rose from {last_lr:.3g} to {lr:.3g} in one step (a restart)"
    if length is not None and base_length is not None and not (base_length / 1.5 <= length <= base_length * 1.5):
        return f"the sequence length changed from {base_length} to {length}"
    return None


@dataclass
class LrTrack:
    """The LR as the steps went (host floats from the optimizer's param groups, no device read)."""

    last_lr: float | None = None
    max_lr: float = 0.0
    last_rise: int = -1
    rises: int = 0

    def add(self, step: int, lr: float | None) -> None:
        if lr is None:
            return
        if self.last_lr is not None and lr > self.last_lr:
            self.last_rise, self.rises = step, self.rises + 1
        self.max_lr = max(self.max_lr, lr)
        self.last_lr = lr

    def warming(self, step: int) -> bool:
        """The LR has not yet changed, or rose on the last step (a warm-up, not a restart)."""
        return self.rises == 0 or self.last_rise == step - 1

    def at_peak(self, step: int, lr: float | None) -> bool:
        """The LR rose over a warm-up of at least 5 steps, and ``step`` is at its peak, within 10% of the warm-up
        length after it."""
        if lr is None or self.rises < 5 or lr < 0.95 * self.max_lr:
            return False
        return step - self.last_rise <= max(2, self.rises // 10)


# ---------------------------------------------------------------------------------------------- attribution
@dataclass
class SampleStats:
    """One sample of a spiking batch: its loss and what its tokens look like."""

    row: int
    loss: float
    excess: float
    dataset_index: int | None = None
    length: int | None = None
    distinct_ids: int | None = None
    repeated_share: float | None = None
    ids_out_of_range: int | None = None

    def describe(self) -> str:
        where = f"row {self.row}" + (f" (dataset index {self.dataset_index})" if self.dataset_index is not None else "")
        parts = [f"loss {self.loss:.3g} (+{self.excess:.3g})"]
        if self.length is not None:
            parts.append(f"{self.length} tokens")
        if self.distinct_ids is not None:
            parts.append(f"{self.distinct_ids} distinct ids")
        if self.repeated_share is not None:
            parts.append(f"{self.repeated_share:.0%} repeated")
        if self.ids_out_of_range:
            parts.append(f"{self.ids_out_of_range} ids outside the usual range")
        return f"{where}: " + ", ".join(parts)


def carriers(losses: Sequence[float], min_excess: float = 0.5, spread: float = 5.0) -> list[int]:
    """The rows whose loss carries the excess: above ``median + max(min_excess, spread * 1.4826 * MAD)``, largest
    first; when none stands out (the whole batch rose), the one largest row."""
    if not losses:
        return []
    ordered = sorted(losses)
    n = len(ordered)
    median = ordered[n // 2] if n % 2 else 0.5 * (ordered[n // 2 - 1] + ordered[n // 2])
    mad = sorted(abs(v - median) for v in losses)[n // 2]
    cut = median + max(min_excess, spread * 1.4826 * mad)
    rows = sorted((i for i, v in enumerate(losses) if v > cut), key=lambda i: -losses[i])
    return rows or [max(range(n), key=lambda i: losses[i])]


def median_of(values: Sequence[float]) -> float:
    ordered = sorted(values)
    n = len(ordered)
    if not n:
        return float("nan")
    return ordered[n // 2] if n % 2 else 0.5 * (ordered[n // 2 - 1] + ordered[n // 2])


@dataclass
class SpikeReading:
    """A spike step as read on the host."""

    step: int
    value_name: str
    value: float
    baseline: float
    lr: float | None
    samples: list[SampleStats] = field(default_factory=list)
    excess_share: float | None = None
    groups: list[tuple[str, float]] = field(default_factory=list)
    at_lr_peak: bool = False
    skipped: bool = False
    bundle: str | None = None
    attribution_error: str | None = None


TFD530 = Rule(
    "TFD530",
    "warning",
    "SpikeGuard",
    title="a loss spike: the step, the samples that carry the excess loss, and a bundle to replay it",
    headline="a loss spike at step {step}: {value_name} {value:.4g}, {ratio:.2f}x its baseline {baseline:.4g}",
    chart=EvidenceChart(
        "Where did the loss spike against its baseline?",
        "loss",
        logged=(TRAINING_LOSS,),
        lines=("baseline", "value"),
        window=40,
    ),
    trigger=(
        "the step's log-loss (one process) or log total gradient norm (several ranks: the all-reduced gradients) rose "
        "more than `threshold` robust deviations and more than `min_ratio` times above its running baseline, after "
        "`warmup_steps` steps of history"
    ),
    hint=(
        "Open the spike bundle and look at the named samples: corrupt or repeated text, ids outside the vocabulary "
        "the run usually sees, or unusually long rows. Filter them out of the data, or run with "
        '`SpikeGuard(on_spike="skip")` to leave the weights untouched on such a step. '
        "`python -m lightning_tfdebug replay <bundle>` reproduces the per-sample losses."
    ),
    reason="Measured: one step's update was computed from a loss far outside the run's own range",
    message=(
        "Loss spike at step {step}: {value_name} {value:.4g} against a baseline of {baseline:.4g} ({ratio:.2f}x, "
        "LR {lr:.3g}). {samples}{action} Bundle: {bundle}"
    ),
)


def spike_verdict(r: SpikeReading) -> Verdict:
    """TFD530 for a spike, with its attribution, and the most specific hint the evidence allows."""
    if r.samples:
        named = "; ".join(s.describe() for s in r.samples[:4])
        share = f" ({r.excess_share:.0%} of the batch's excess loss)" if r.excess_share is not None else ""
        samples = f"Carried by {named}{share}."
    else:
        samples = f"No per-sample attribution ({r.attribution_error or 'no replayable model call'})."
    action = " The optimizer step was skipped." if r.skipped else ""
    hint = None
    if r.at_lr_peak:
        hint = (
            "The spike came at the peak of the LR schedule, just after warm-up: the warm-up is likely too short for "
            "this LR. Lengthen the warm-up (or lower the peak LR), then check the named samples."
        )
    elif r.groups:
        name = r.groups[0][0]
        hint = (
            f"The gradient of `{name}` grew most on this step: if it keeps growing before spikes, its attention logits "
            "are likely growing (add qk-norm) or the output logits are (add a z-loss or lower the LR); then check the "
            "named samples."
        )
    ratio = math.exp(r.value - r.baseline) if r.value_name.startswith("log") else r.value / max(r.baseline, 1e-12)
    evidence: dict[str, Any] = {
        "step": r.step,
        "value_name": r.value_name.removeprefix("log "),
        "value": math.exp(r.value) if r.value_name.startswith("log") else r.value,
        "baseline": math.exp(r.baseline) if r.value_name.startswith("log") else r.baseline,
        "ratio": ratio,
        "lr": r.lr if r.lr is not None else float("nan"),
        "rows": [s.row for s in r.samples],
        "dataset_indices": [s.dataset_index for s in r.samples],
        "skipped": r.skipped,
        "bundle": r.bundle,
        "groups": [g for g, _ in r.groups[:3]],
    }
    return TFD530.verdict(evidence, key=f"step{r.step}", step=r.step, hint=hint, samples=samples, action=action)


TFD531 = Rule(
    "TFD531",
    "error",
    "SpikeGuard",
    title="loss spikes that repeat, or a loss that does not come back to its baseline",
    headline="{count} loss spikes that repeat, or a loss that does not come back ({steps})",
    chart=EvidenceChart("Does the loss come back after its spikes?", "loss", logged=(TRAINING_LOSS,)),
    trigger="`max_spikes` spikes within `spike_window` steps, or `max_skips` spiking steps in a row",
    hint=(
        "A run that spikes again and again is unstable, not unlucky: lower the peak LR or lengthen the warm-up, add "
        "gradient clipping, and check the attention logits (qk-norm) and the output logits (z-loss). Skipping more "
        "steps will not make it recover; resume from the checkpoint before the first spike."
    ),
    reason="Measured: the loss left its range and stayed out, or kept leaving it; the run is diverging",
    message="{count} loss spikes {where} (steps {steps}); {tail}",
)


def repeat_verdict(
    steps: Sequence[int], window: int, max_spikes: int, run_of_skips: int, max_skips: int
) -> Verdict | None:
    """TFD531 when ``max_spikes`` spikes fell within ``window`` steps, or ``max_skips`` spiking steps came in a row."""
    if max_skips and run_of_skips >= max_skips:
        tail = (
            f"{run_of_skips} steps in a row were skipped (max_skips={max_skips}): the loss does not recover; stopping."
        )
        recent = list(steps)[-run_of_skips:]
        return TFD531.verdict(
            {"count": run_of_skips, "steps": recent}, key="no-recovery", step=recent[-1], where="in a row", tail=tail
        )
    if not steps:
        return None
    last = steps[-1]
    recent = [s for s in steps if s > last - window]
    if len(recent) < max_spikes:
        return None
    tail = "the loss keeps leaving its range."
    return TFD531.verdict(
        {"count": len(recent), "steps": recent}, key="repeat", step=last, where=f"within {window} steps", tail=tail
    )


BLOCK = ("TFD530", "TFD539")

RULES = (TFD530, TFD531)


COVERAGE: dict[str, tuple[str, ...]] = {
    "loss spikes": (
        "TFD530",
        "TFD531",
    ),
}
"""The rows of the run's Coverage table these rules answer: the check -> the codes that decide it."""
