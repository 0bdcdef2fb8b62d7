"""What a decision rule returns: the finding it reached, as plain data, for the callback to emit.

The decisions of the pack (MaskProbe's tolerance checks, LossAtInit's reading of the first loss, CheckpointAudit's
checks of a saved file) are pure functions of host numbers and plain objects. They return :class:`Verdict` objects
instead of emitting, so each can be tested without a Trainer; the callback passes them to
:meth:`~lightning_tfdebug.core.base.DebugCallback.emit`, which adds the step, the rank and the rule's defaults.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from lightning_tfdebug.findings import Severity


@dataclass(frozen=True)
class Verdict:
    """A finding a decision reached: the registered ``code``, the message with the measured numbers, the evidence,
    and, only where the decision knows better than the rule, a ``hint`` and a ``severity`` (None: the rule's)."""

    code: str
    message: str
    evidence: dict[str, Any] = field(default_factory=dict)
    hint: str | None = None
    severity: Severity | None = None
