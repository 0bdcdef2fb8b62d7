"""LossAtInit's phase scheduler and its memory: which steps are armed (step 0, the compared steps, the check) and
what the run has read so far (:class:`LossRun`, the checkpointed state). It records; the deciding modules read it."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from lightning_tfdebug.callbacks.loss_at_init.readings import InitLoss, LossReading
from lightning_tfdebug.functional.loss import uniform_loss

MASKED_LM_CHECK_FACTOR = 5
"""Masked-LM objectives sit at the unigram entropy longer: their check runs this many times later."""


COMPARE_FRACTIONS = (0.5, 0.75)
"""Besides the check, the returned loss is compared with the recorded logits on the first measuring steps at or after
these fractions of the way to it ..."""


EARLY_COMPARE = (10, 20, 30, 40)
"""... and on these steps (before the check), with or without one: three compared steps by step 30 decide the family
of the returned loss and its floor inside a preflight's 50 steps (``tfdebug check``)."""


EARLY_DECISION = 3
"""The compared steps the family and floor decisions need before the check (the check decides with two)."""


def compare_steps(check_at: int | None, interval: int) -> tuple[int, ...]:
    """The compared steps before the check: :data:`EARLY_COMPARE`, and the measuring steps (multiples of ``interval``)
    at or after :data:`COMPARE_FRACTIONS` of the way to it (from steps alone: every rank compares on the same steps)."""
    if check_at is None:
        return EARLY_COMPARE
    steps = (-(-math.ceil(check_at * f) // interval) * interval for f in COMPARE_FRACTIONS)
    return tuple(sorted({s for s in (*steps, *EARLY_COMPARE) if 0 < s < check_at}))


READINGS = 8
"""Compared steps kept (checkpointed) for the decisions: the early ones, the fractions' and the check's."""


HISTORY = 64
"""Measured losses kept for the stall window."""


_RUN_FLAGS = ("init_done", "check_done", "masked_lm", "probabilities", "token_rows", "compare_aside")


@dataclass
class LossRun:
    """What LossAtInit has read over the run so far, and which steps it measures next (host values: its checkpointed
    state, :meth:`to_state` / :meth:`from_state`).

    Attributes:
        check_step: the configured step of the check (None: no check).
        check_at: the check's step: ``check_step``, or :data:`MASKED_LM_CHECK_FACTOR` times it for masked-LM labels.
        init_done, check_done: step 0 and the check were armed.
        init_copy_rate: the untrained model's copy rate (tied embeddings copy from the start); None: not measured.
        masked_lm: the labels are masked-LM labels (aligned with the logits; a later check).
        vocab: V, once known.
        probabilities: step 0 found probabilities (``TFD220``): the check's bounded-output floor is that finding's.
        token_rows: the labels are the batch's token rows (a loss-only wrapper): the measuring steps count those.
        history: ``(step, loss)`` of the measuring steps, for the stall window (the last :data:`HISTORY`).
        compared: the compared steps before the check that were armed.
        readings: the returned loss against the recorded logits on the compared steps and the check.
        compare_aside: the returned loss is no cross-entropy of the logits: no more compared steps or decisions on it.
        said: the codes the compared steps' decisions emitted (each once per run; the check does not repeat them).
    """

    check_step: int | None
    check_at: int | None
    init_done: bool = False
    check_done: bool = False
    init_copy_rate: float | None = None
    masked_lm: bool = False
    vocab: int | None = None
    probabilities: bool = False
    token_rows: bool = False
    compare_aside: bool = False
    history: list[tuple[int, float]] = field(default_factory=list)
    compared: list[int] = field(default_factory=list)
    readings: list[LossReading] = field(default_factory=list)
    said: list[str] = field(default_factory=list)

    def compare_steps(self, interval: int) -> tuple[int, ...]:
        return compare_steps(self.check_at, interval)

    def arm(self, step: int, interval: int) -> str | None:
        """The phase the first micro-batch of ``step`` is armed for, now marked as taken: ``"init"`` (step 0),
        ``"check"`` or ``"compare"``; None for any other step."""
        if step == 0 and not self.init_done:
            self.init_done = True
            return "init"
        if self.check_at is not None and step == self.check_at and not self.check_done:
            self.check_done = True
            return "check"
        if step in self.compare_steps(interval) and step not in self.compared and not self.compare_aside:
            self.compared.append(step)
            return "compare"
        return None

    def start(self, init: InitLoss) -> None:
        """Keep what step 0 showed: the copy rate, masked-LM labels (whose check moves later), probabilities."""
        if init.copy_rate is not None:
            self.init_copy_rate = init.copy_rate
        self.masked_lm = init.masked_lm
        if init.masked_lm and self.check_step is not None:
            self.check_at = MASKED_LM_CHECK_FACTOR * self.check_step
        self.probabilities = init.probabilities

    def check_moves(self, late_masked: bool, step: int) -> bool:
        """Record masked-LM labels recognised at the check of a run resumed without step 0's reading (``late_masked``:
        :func:`~lightning_tfdebug.callbacks.loss_at_init.readings.late_masked_lm` decided it); True when their check
        moved later (``MASKED_LM_CHECK_FACTOR * check_step``: nothing is judged at this step)."""
        if self.init_done or self.masked_lm or not late_masked:
            return False
        self.masked_lm = True
        later = MASKED_LM_CHECK_FACTOR * self.check_step if self.check_step is not None else None
        if later is None or step >= later:
            return False  # judged now, as a masked LM
        self.check_at, self.check_done = later, False
        return True

    def keep_loss(self, step: int, loss: float, unigram_entropy: float | None) -> dict[str, float]:
        """Keep a measured loss for the stall window; returns the finite ones of the dashboard's keys: the loss between
        its two baselines, ln(V) and the labels' unigram entropy (once known)."""
        self.history = [*self.history, (step, loss)][-HISTORY:]
        metrics = {"loss_at_init/loss": loss}
        if self.vocab is not None:
            metrics["loss_at_init/ln_vocab"] = uniform_loss(self.vocab)
        if unigram_entropy is not None:
            metrics["loss_at_init/unigram_entropy"] = unigram_entropy
        return {k: v for k, v in metrics.items() if math.isfinite(v)}

    def window(self, step: int) -> list[tuple[int, float]]:
        """The losses measured since half-way to the check at ``step`` (before it)."""
        return [(s, v) for s, v in self.history if s >= step // 2]

    def add_reading(self, reading: LossReading) -> None:
        self.readings = [*self.readings, reading][-READINGS:]

    def unsaid(self, codes: list[str]) -> list[str]:
        """The ``codes`` not said before, now marked as said."""
        fresh = [c for c in dict.fromkeys(codes) if c not in self.said]
        self.said = [*self.said, *fresh]
        return fresh

    def to_state(self) -> dict[str, Any]:
        state = {name: getattr(self, name) for name in (*_RUN_FLAGS, "init_copy_rate", "check_at", "vocab")}
        history = [list(point) for point in self.history]
        readings = [r.to_list() for r in self.readings]
        compared = {"compared": list(self.compared), "said": list(self.said)}
        return {**state, "history": history, **compared, "loss_readings": readings}

    @classmethod
    def from_state(cls, state: Mapping[str, Any], check_step: int | None, vocab: int | None = None) -> LossRun:
        """The run as :meth:`to_state` left it (missing entries: a fresh run's); ``vocab``: V if the state has none."""
        rate = state.get("init_copy_rate")
        return cls(
            check_step=check_step,
            check_at=state.get("check_at", check_step),
            init_copy_rate=float(rate) if rate is not None else None,
            vocab=state.get("vocab") or vocab,
            history=[(int(s), float(v)) for s, v in state.get("history", [])],
            compared=[int(s) for s in state.get("compared", [])],
            said=[str(c) for c in state.get("said", [])],
            readings=[LossReading.from_list(r) for r in state.get("loss_readings", [])],
            **{name: bool(state.get(name, False)) for name in _RUN_FLAGS},
        )
