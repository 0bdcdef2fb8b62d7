"""``TFD120``: the length distribution of the batches moved away from the early ones. A window of checked batches'
running sums is recorded (:meth:`LengthWindow.update`) apart from the decision (:func:`moved_lengths`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from lightning_tfdebug.functional.evidence_chart import EvidenceChart
from lightning_tfdebug.functional.verdicts import Rule, Verdict

TFD120 = Rule(
    "TFD120",
    "warning",
    "BatchGuard",
    title="the length distribution moved away from the early batches",
    headline="batch lengths moved: mean {window_mean:.1f} tokens against {reference_mean:.1f} early",
    chart=EvidenceChart(
        "Did the batch lengths move away from the early batches?",
        "tokens",
        logged=("batch_guard/length_mean",),
    ),
    trigger="a window's mean real length moved from the first window's by over `length_shift_tolerance` and one std",
    details=(
        "Every `length_window` (default 50) value-checked batches close a window of real lengths (attention mask "
        "sums); the first window is the reference. Fires when a later window's mean real length differs from the "
        "reference mean by more than `length_shift_tolerance` (default 0.5) of it and by more than the reference's "
        "standard deviation."
    ),
    hint=(
        "The data changed under the run: a new shard or source, a tokenizer swap, sorted or curriculum data, or a "
        "truncation setting that differs between files."
    ),
    reason="Measured in this run: later batches differ from the early ones (data sorted or grouped)",
    message=(
        "{where}: the mean sequence length of the last {size} checked batches is {window_mean:.1f}, against "
        "{reference_mean:.1f} (std {reference_std:.1f}) in the first ones."
    ),
)


def length_shift(reference_mean: float, reference_std: float, window_mean: float, tolerance: float) -> bool:
    """Whether a window's mean length moved from the reference by more than ``tolerance`` of it and one std."""
    if reference_mean <= 0:
        return False
    delta = abs(window_mean - reference_mean)
    return delta > tolerance * reference_mean and delta > reference_std


def moved_lengths(
    reference: Mapping[str, float], window_mean: float, tolerance: float, size: int, where: str
) -> Verdict | None:
    """``TFD120`` when a closed window's mean real length moved from the first window's ``reference`` (``{"mean",
    "std"}``) by over ``tolerance`` of it and one std."""
    if not length_shift(reference["mean"], reference["std"], window_mean, tolerance):
        return None
    evidence = {"window_mean": window_mean, "reference_mean": reference["mean"], "reference_std": reference["std"]}
    return TFD120.verdict(evidence, where=where, size=size)


@dataclass
class LengthSums:
    """The running sums of the real sequence lengths of one window of checked batches."""

    sequences: float = 0.0
    length_sum: float = 0.0
    length_sq_sum: float = 0.0
    batches: int = 0

    def add(self, s: Mapping[str, float]) -> None:
        """Count one batch's unpacked statistics."""
        self.sequences += s["sequences"]
        self.length_sum += s["length_sum"]
        self.length_sq_sum += s["length_sq_sum"]
        self.batches += 1

    def moments(self) -> tuple[float, float]:
        """The mean and the standard deviation of the window's real lengths."""
        mean = self.length_sum / max(self.sequences, 1.0)
        return mean, max(self.length_sq_sum / max(self.sequences, 1.0) - mean * mean, 0.0) ** 0.5

    def state(self) -> dict[str, float]:
        return asdict(self)

    @classmethod
    def load(cls, state: Any) -> LengthSums:
        """From :meth:`state`; a checkpoint written before the sums were named holds them as a list in the order of
        this class's fields."""
        if isinstance(state, (list, tuple)):
            state = dict(zip((f.name for f in fields(cls)), state))
        if not isinstance(state, Mapping):
            return cls()
        return cls(
            sequences=float(state.get("sequences", 0.0)),
            length_sum=float(state.get("length_sum", 0.0)),
            length_sq_sum=float(state.get("length_sq_sum", 0.0)),
            batches=int(state.get("batches", 0)),
        )


@dataclass
class LengthWindow:
    """``TFD120``'s memory: the real lengths of the current window of checked batches and the first window's."""

    size: int = 50
    tolerance: float = 0.5
    reference: dict[str, float] | None = None  # {"mean", "std"} of real lengths in the first window
    sums: LengthSums = field(default_factory=LengthSums)

    def update(self, s: Mapping[str, float]) -> float | None:
        """Record one batch; when its window closes, the window's mean (the first closed window becomes the
        reference), else None."""
        self.sums.add(s)
        if self.sums.batches < self.size:
            return None
        mean, std = self.sums.moments()
        self.sums = LengthSums()
        if self.reference is None:
            self.reference = {"mean": mean, "std": std}
            return None
        return mean

    def add(self, s: Mapping[str, float], where: str) -> Verdict | None:
        """Record one batch (:meth:`update`) and decide ``TFD120`` when its window closes."""
        mean = self.update(s)
        if mean is None or self.reference is None:
            return None
        return moved_lengths(self.reference, mean, self.tolerance, self.size, where)
