"""MemoryWatch's rules ``TFD620``-``TFD621``: out of memory foreseen from the batch lengths, and explained when it
happens. Host numbers in, verdicts out; no Trainer, no I/O.

The forecast (:func:`forecast_verdict`) fits the memory a measuring step held against the token positions of its
batch (rows x padded width, :class:`MemoryFit`) and takes the fit to the longest batch the data can produce
(:func:`longest_possible_width`). The explanation (:func:`oom_verdict`) sets the failing batch beside the run's usual
(:class:`LengthTally`), splits the memory into weights, gradients, optimizer state and the rest, and ranks the
remedies by what those numbers show (:func:`ranked_remedies`).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from lightning_tfdebug.functional.evidence_chart import EvidenceChart
from lightning_tfdebug.functional.verdicts import Rule, Verdict

GIB = float(2**30)


FORECAST_CHECK = "out-of-memory forecast (TFD620)"
"""The name of the forecast in Coverage when it stands aside (a backend without memory statistics)."""


# ------------------------------------------------------------------------------------------------- what is an OOM
_OOM_TEXT = ("out of memory", "can't allocate memory", "cannot allocate memory", "failed to allocate")


def is_out_of_memory(exception: BaseException) -> bool:
    """Whether ``exception`` is an allocation failure: ``torch.OutOfMemoryError`` (CUDA, MPS, XPU), Python's
    ``MemoryError``, or a RuntimeError from an allocator (``DefaultCPUAllocator: can't allocate memory``)."""
    oom_type = getattr(torch, "OutOfMemoryError", None) or getattr(torch.cuda, "OutOfMemoryError", None)
    if (oom_type is not None and isinstance(exception, oom_type)) or isinstance(exception, MemoryError):
        return True
    return isinstance(exception, RuntimeError) and any(t in str(exception).lower() for t in _OOM_TEXT)


_CHECKPOINT_FRAMES = frozenset(
    {"save_checkpoint", "_save_checkpoint", "dump_checkpoint", "_save_topk_checkpoint", "_save_last_checkpoint"}
)
_PHASE_FRAMES = (
    ("validation", frozenset({"validation_step"})),
    ("testing", frozenset({"test_step"})),
    ("prediction", frozenset({"predict_step"})),
    ("the training step", frozenset({"training_step", "backward", "optimizer_step", "_run_optimization"})),
)


def failure_phase(function_names: Iterable[str], fallback: str) -> str:
    """Where an exception was raised, from the function names of its traceback (outermost first): checkpoint saving,
    validation, testing, prediction or the training step; ``fallback`` (from the Trainer's state) otherwise."""
    names = set(function_names)
    if names & _CHECKPOINT_FRAMES:
        return "checkpoint saving"
    for phase, frames in _PHASE_FRAMES:
        if names & frames:
            return phase
    return fallback


# ------------------------------------------------------------------------------------------------- the lengths seen
@dataclass
class LengthTally:
    """The shapes of the training batches seen (host ints from the batch's shape, no tensor data): how many token
    positions (rows x padded width) and how wide, by count."""

    positions: Counter[int] = field(default_factory=Counter)
    widths: Counter[int] = field(default_factory=Counter)
    most_rows: int = 0
    batches: int = 0

    def add(self, rows: int, width: int) -> None:
        self.positions[rows * width] += 1
        self.widths[width] += 1
        if rows > self.most_rows:
            self.most_rows = rows
        self.batches += 1

    @property
    def longest_width(self) -> int:
        return max(self.widths, default=0)

    @property
    def most_positions(self) -> int:
        return max(self.positions, default=0)

    def median_positions(self) -> float:
        """The median token positions per batch (nan before the first batch)."""
        return _median(self.positions)

    def state(self) -> dict[str, Any]:
        return {
            "positions": sorted(self.positions.items()),
            "widths": sorted(self.widths.items()),
            "most_rows": self.most_rows,
            "batches": self.batches,
        }

    @classmethod
    def load(cls, state: Mapping[str, Any] | None) -> LengthTally:
        state = state or {}
        return cls(
            Counter({int(k): int(v) for k, v in state.get("positions", [])}),
            Counter({int(k): int(v) for k, v in state.get("widths", [])}),
            int(state.get("most_rows", 0)),
            int(state.get("batches", 0)),
        )


def _median(counts: Counter[int]) -> float:
    total = sum(counts.values())
    if not total:
        return math.nan
    seen, middle = 0, (total - 1) / 2
    for value in sorted(counts):
        seen += counts[value]
        if seen > middle:
            return float(value)
    return float(max(counts))  # pragma: no cover - the loop always returns


CAPPED_HITS = 3
"""Batches at the longest width seen (and :data:`CAPPED_FRACTION` of them) that show the data stops there."""
CAPPED_FRACTION = 0.05
MIN_BATCHES = 8
"""Batches seen before the forecast goes beyond the longest width seen (the first few say little of the lengths)."""


def longest_possible_width(tally: LengthTally, context: int | None) -> int:
    """The widest batch the data can produce: the model's ``context`` limit, unless the batches show a shorter cap
    (every batch the same width: packed or padded to a fixed length; several at the longest width: truncated there),
    the limit is unknown, or too few batches were seen to tell."""
    longest = tally.longest_width
    if context is None or longest >= context or len(tally.widths) <= 1 or tally.batches < MIN_BATCHES:
        return longest
    if tally.widths[longest] >= max(CAPPED_HITS, CAPPED_FRACTION * tally.batches):
        return longest
    return context


# ------------------------------------------------------------------------------------------------- the fit
SPREAD = 1.25
"""The fit needs batches whose token positions differ by this factor at least."""


@dataclass(frozen=True)
class MemoryFit:
    """Memory as ``fixed + per_position x positions`` (bytes), through the latest reading ``(positions, held)``."""

    positions: float
    held: float
    per_position: float

    def at(self, positions: float) -> float:
        """The memory a batch of ``positions`` token positions would hold (bytes)."""
        return self.held + self.per_position * max(0.0, positions - self.positions)


def fit_memory(points: Sequence[tuple[float, float]], base: float | None) -> MemoryFit | None:
    """The fit of memory against positions through ``points`` ``(positions, bytes held)``, one per measuring step; None
    until two of them differ in positions by :data:`SPREAD`. The slope is the least-squares one, and no more than the
    latest reading above ``base`` (the memory before any batch: weights, gradients, optimizer state) per position: a
    reading's allocator noise never makes the forecast steeper than all of the memory above the base scaling with the
    batch."""
    if len(points) < 2:
        return None
    xs = [p for p, _ in points]
    if max(xs) < SPREAD * min(xs) or min(xs) <= 0:
        return None
    n = len(points)
    mean_x, mean_y = sum(xs) / n, sum(y for _, y in points) / n
    sxx = sum((x - mean_x) ** 2 for x in xs)
    slope = max(0.0, sum((x - mean_x) * (y - mean_y) for x, y in points) / sxx)
    widest = max(points)  # the reading of the largest batch measured
    if base is not None and widest[1] > base:
        slope = min(slope, (widest[1] - base) / widest[0])
    return MemoryFit(widest[0], widest[1], slope)


@dataclass(frozen=True)
class ForecastRow:
    """One rank's forecast of one measuring step, in the order its row travels in the step's reduction (bytes; -1:
    no forecast on that rank)."""

    forecast: float  # the memory the longest possible batch would hold
    limit: float  # the memory this process may use
    target_width: float  # the longest width the data can produce
    target_rows: float  # the most rows seen
    longest_width: float  # the longest width seen
    longest_held: float  # the memory the widest measured batch held


def forecast_row(fit: MemoryFit | None, tally: LengthTally, context: int | None, limit: float) -> ForecastRow:
    """This rank's :class:`ForecastRow`: the fit taken to the longest batch the data can produce."""
    if fit is None or limit <= 0:
        return ForecastRow(-1.0, limit, -1.0, -1.0, -1.0, -1.0)
    width = longest_possible_width(tally, context)
    rows = tally.most_rows
    return ForecastRow(fit.at(rows * width), limit, float(width), float(rows), float(tally.longest_width), fit.held)


TFD620 = Rule(
    "TFD620",
    "warning",
    "MemoryWatch",
    title="the longest batch the data can produce would not fit in memory",
    headline="the longest batch ({longest_width:,} tokens) would not fit in memory: {forecast}",
    chart=EvidenceChart(
        "Does the longest batch fit in memory?",
        "GiB",
        logged=("memory_watch/held_gib", "memory_watch/forecast_gib", "memory_watch/limit_gib"),
    ),
    trigger=(
        "the fit of memory against token positions per batch, taken to the longest batch the data can produce (the "
        "most rows seen x the context limit), exceeds the memory the process may use, on some rank"
    ),
    hint=(
        "Cap the lengths below that width (truncate, or a `max_length` in the collator), bucket them by length or "
        "give long batches fewer rows (a token-budget sampler); or a smaller micro-batch with "
        "`accumulate_grad_batches`, activation checkpointing, sharding"
    ),
    reason=(
        "Foreseen from the run's own measurements: the data can produce a batch whose memory, on the measured trend, "
        "exceeds what the device (or the process) has; the out-of-memory crash it leads to is the harm"
    ),
    message=(
        "Batches of {target_width:,} tokens a row ({target_rows:,} rows) would need ~{forecast} on rank {rank_list}; "
        "the {device} has {limit}; the longest so far was {longest_width:,} ({longest})."
    ),
)


def forecast_verdict(rows: Sequence[ForecastRow], device: str, step: int | None = None) -> Verdict | None:
    """``TFD620`` when, on some rank, the longest possible batch would hold more memory than the process may use; the
    ranks named, the worst one's numbers in the message."""
    over = [r for r, row in enumerate(rows) if row.forecast > 0 and row.forecast > row.limit]
    if not over:
        return None
    worst = max(over, key=lambda r: rows[r].forecast / rows[r].limit)
    row = rows[worst]
    evidence = {
        "ranks": over,
        "forecast_gib": row.forecast / GIB,
        "limit_gib": row.limit / GIB,
        "target_width": int(row.target_width),
        "target_rows": int(row.target_rows),
        "longest_width": int(row.longest_width),
        "longest_gib": row.longest_held / GIB,
    }
    return TFD620.verdict(
        evidence,
        step=step,
        key="forecast",
        device=device,
        rank_list=", ".join(map(str, over)),
        forecast=size_text(row.forecast),
        limit=size_text(row.limit),
        longest=size_text(row.longest_held),
    )


# ------------------------------------------------------------------------------------------------- the explanation
@dataclass(frozen=True)
class MemorySplit:
    """What held the memory (bytes): the training state's three parts, and the rest of a reading (``held``; nan when
    there was none: activations, workspace, the allocator's cache and, on CPU, the process itself)."""

    weights: float
    gradients: float
    optimizer: float
    held: float = math.nan
    total: float = math.nan  # the device's memory (CPU: what the process may use); nan: unknown

    @property
    def state(self) -> float:
        return self.weights + self.gradients + self.optimizer

    @property
    def rest(self) -> float:
        return max(0.0, self.held - self.state) if self.held == self.held else math.nan


def size_text(value: float) -> str:
    """Bytes as a reader says them: ``1.25 GiB``, ``168 MiB``, ``42 KiB``."""
    for unit, size in (("GiB", GIB), ("MiB", 2.0**20), ("KiB", 2.0**10)):
        if abs(value) >= size or unit == "KiB":
            return f"{value / size:.2f} {unit}" if unit == "GiB" else f"{value / size:.0f} {unit}"
    return ""  # pragma: no cover


def split_text(split: MemorySplit, when: str, device: str) -> str:
    """The sentence of the split: ``when`` says which reading (the last measuring step's, or none)."""
    weights, gradients, optimizer = (size_text(v) for v in (split.weights, split.gradients, split.optimizer))
    parts = f"weights {weights}, gradients {gradients}, optimizer state {optimizer}"
    if split.held == split.held:
        what = "activations and the process itself" if device == "process" else "activations, workspace, cache"
        parts += f", the rest ({what}) {size_text(split.rest)} of {size_text(split.held)}"
    else:
        parts += ", the rest unknown (no measuring step before the failure: from the parameter counts alone)"
    total = f"; the {device} has {size_text(split.total)}" if split.total == split.total and split.total > 0 else ""
    return f"Memory {when}: {parts}{total}."


def ranked_remedies(ratio: float, split: MemorySplit) -> list[tuple[str, float]]:
    """The remedies, most indicated first, each with its score: ``ratio`` (the failing batch's positions over the
    median's) points at the lengths; the activations' share of the memory at the smaller micro-batch and at activation
    checkpointing; the training state's share at sharding."""
    known = split.held == split.held and split.held > 0
    total = split.held if known else (split.total if split.total == split.total and split.total > 0 else math.nan)
    state_share = split.state / total if total == total and total > 0 else 0.0
    rest_share = split.rest / split.held if known else max(0.0, 1.0 - state_share) if total == total else 0.5
    against = f"this batch was {ratio:.1f}x the median" if ratio == ratio else "the batch's length is unknown"
    remedies = [
        (
            f"cap or bucket the lengths ({against}: truncate to a maximum length, sort samples into length buckets or "
            "use a token-budget sampler)",
            ratio - 1.0 if ratio == ratio else 0.0,
        ),
        (
            "a smaller micro-batch with `accumulate_grad_batches` (the memory beside the training state, activations "
            f"among it, was {rest_share:.0%})",
            rest_share,
        ),
        ("activation checkpointing (recompute each block's activations in the backward)", 0.9 * rest_share),
        (
            f"shard the training state (FSDP, ZeRO; it held {state_share:.0%}"
            + (", most of it optimizer state" if split.optimizer > split.weights + split.gradients else "")
            + ")",
            state_share,
        ),
    ]
    return sorted(remedies, key=lambda r: -r[1])


def batch_text(batch: FailingBatch, positions: int, median: float, longest: int, ratio: float) -> str:
    """The failing batch beside the usual, in one sentence."""
    if not positions:
        return "its batch's shape is unknown (no token ids or mask found in it)."
    text = f"its batch was {batch.rows} x {batch.width} ({positions:,} token positions)"
    if median != median or not batch.batches_before:
        return text + "; no training batch was seen before it."
    return f"{text}, against a median of {int(median):,} and a longest so far of {longest:,} ({ratio:.1f}x the median)."


@dataclass(frozen=True)
class FailingBatch:
    """The batch of the failure: its shape (rows, width; 0 when unknown) and where it was."""

    rows: int
    width: int
    phase: str
    where: str  # "batch 12 of epoch 0 (step 15)"
    longest_before: int = 0  # the most token positions of a training batch before this one
    batches_before: int = 0  # training batches seen before this one


TFD621 = Rule(
    "TFD621",
    "error",
    "MemoryWatch",
    title="out of memory, explained: the failing batch beside the usual, what held the memory, the remedies",
    headline=(
        "out of memory in {phase} on rank {rank}: a batch of {positions} positions, {ratio:.1f}x the usual",
        "out of memory in {phase} on rank {rank}",
    ),
    chart=EvidenceChart(
        "What held the memory when it ran out?",
        "GiB",
        bars=("weights_gib", "gradients_gib", "optimizer_gib", "held_gib", "total_gib"),
    ),
    trigger="the run raised an out-of-memory error (`torch.OutOfMemoryError`, a failed host allocation)",
    hint="The remedies in the message, first the one the numbers point at",
    reason="The run crashed: the harm is shown",
    message=("Out of memory in {phase} on rank {rank}, {where}: {batch_text} {split} {remedies}"),
)


def oom_verdict(
    batch: FailingBatch,
    tally: LengthTally,
    split: MemorySplit,
    *,
    rank: int,
    device: str,
    when: str,
    extra: str = "",
) -> Verdict:
    """``TFD621``: the failing batch beside the median and longest training batch so far, the memory's split, the
    remedies ranked; ``extra``: the memory snapshot and the repro bundle, when there are."""
    positions = batch.rows * batch.width
    median = tally.median_positions()
    ratio = positions / median if median == median and median > 0 and positions else math.nan
    remedies = ranked_remedies(ratio, split)
    if not (ratio == ratio and ratio >= 1.5):  # the lengths do not point at the batch: their remedy goes last
        remedies = [r for r in remedies if not r[0].startswith("cap")] + [r for r in remedies if r[0].startswith("cap")]
    text = "Remedies, most indicated first: " + "; ".join(f"({i}) {r}" for i, (r, _) in enumerate(remedies, 1)) + "."
    evidence = {
        "rank": rank,
        "rows": batch.rows,
        "width": batch.width,
        "positions": positions,
        "median": int(median) if median == median else 0,
        "longest": batch.longest_before,
        "ratio": ratio,
        "phase": batch.phase,
        "weights_gib": split.weights / GIB,
        "gradients_gib": split.gradients / GIB,
        "optimizer_gib": split.optimizer / GIB,
        "held_gib": split.held / GIB,
        "total_gib": split.total / GIB,
        "remedy_order": [r for r, _ in remedies],
    }
    return TFD621.verdict(
        evidence,
        where=batch.where,
        batch_text=batch_text(batch, positions, median, batch.longest_before, ratio),
        split=split_text(split, when, device),
        remedies=text + extra,
        key=f"oom:{batch.where}",
    )


BLOCK = ("TFD620", "TFD629")
"""The codes reserved for MemoryWatch's rules."""

RULES: tuple[Rule, ...] = (TFD620, TFD621)
"""The rules decided in this module, in code order."""


COVERAGE: dict[str, tuple[str, ...]] = {
    "memory": (
        "TFD620",
        "TFD621",
    ),
}
"""The rows of the run's Coverage table these rules answer: the check -> the codes that decide it."""
