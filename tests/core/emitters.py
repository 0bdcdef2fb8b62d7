"""Minimal DebugCallback subclasses used to test the shared findings machinery (importable by dist_run.py)."""

from __future__ import annotations

from typing import Any

from lightning_tfdebug import DebugCallback
from lightning_tfdebug.rules import Rule, register_rule

STEP_RULE, LOCAL_RULE = (
    register_rule(
        Rule(
            code,
            "warning",
            source,
            title="test rule",
            trigger="a test asks for it",
            hint="none",
            reason="a test's own rule",
            message=message,
        )
    )
    for code, source, message in (
        ("TFD399", "StepEmitter", "test finding."),
        ("TFD398", "RankLocalEmitter", "only this rank saw it."),
    )
)


class StepEmitter(DebugCallback):
    """Emits one finding (the same on every rank) at ``at_step``."""

    def __init__(self, at_step: int = 3, severity: str = "warning", **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.at_step = at_step
        self.severity = severity

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self.at_step:
            self.emit(trainer, STEP_RULE.verdict({"step": trainer.global_step}, severity=self.severity))


class RankLocalEmitter(DebugCallback):
    """Emits a rank-local finding on ``rank`` at ``at_step``; every rank resolves after every batch."""

    def __init__(self, rank: int = 1, at_step: int = 3, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.rank = rank
        self.at_step = at_step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_rank == self.rank and trainer.global_step == self.at_step:
            self.emit(trainer, LOCAL_RULE.verdict(severity="error"), synchronized=False)
        self.resolve_local_findings(trainer)  # every rank, every batch: the collective runs in lockstep
