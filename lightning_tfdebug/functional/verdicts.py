"""One shape for every detector: a :class:`Rule` (a finding code with its text) and the :class:`Verdict` it returns.

Every finding is decided by a rule function in ``functional/<area>_checks.py`` (a *reading* in, verdicts out) beside
its :class:`Rule`; :mod:`lightning_tfdebug.rules` builds the registry from those modules, and the callback hands the
verdicts to :meth:`~lightning_tfdebug.core.base.DebugCallback.emit` (see ``docs/architecture.md``).

Example:
    >>> rule = Rule("TFD301", "warning", "GradNormMonitor", title="t", trigger="t", hint="h", reason="r",
    ...             message="the norm rose {factor:.1f}x")
    >>> rule.verdict({"factor": 12.04}).message
    'the norm rose 12.0x'
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from lightning_tfdebug.findings import HEADLINE_LIMIT, SEVERITIES, Severity, check_code
from lightning_tfdebug.functional.evidence_chart import EvidenceChart


@dataclass(frozen=True)
class Verdict:
    """A finding a rule reached, as plain data. ``hint``/``severity``: None for the rule's; ``key``: a finding is
    recorded once per ``(code, key)`` per callback; ``step``: the step of the evidence (None: when emitted)."""

    code: str
    message: str
    evidence: dict[str, Any] = field(default_factory=dict)
    hint: str | None = None
    severity: Severity | None = None
    key: str | None = None
    step: int | None = None
    headline: str = ""


@dataclass(frozen=True)
class Rule:
    """One finding code and everything said about it.

    Attributes:
        code: the stable identifier, ``TFD`` + area digit + two digits.
        severity: the default severity; a rule function may escalate it when its evidence shows more harm.
        source: the class name of the callback that measures what the rule decides.
        title: a few words saying what is wrong (the callback page's table).
        trigger: the measured condition that raises it.
        hint: what to do; a verdict with a more specific hint carries its own.
        reason: why the rule has its severity (``docs/severity.md``).
        message: the finding's sentence, a :meth:`str.format` template filled from the evidence and the text fields
            passed to :meth:`verdict`.
        details: the exact conditions and thresholds under which the rule fires (markdown), for the generated rule
            reference in ``docs/findings.md``; empty when ``trigger`` already says it all.
        headline: what the finding's one-line headline says after its code, severity, step and ranks: the title in a
            few words with its one or two deciding numbers, a :meth:`str.format` template filled like ``message``;
            several templates: the first that the finding's fields fill. Empty, or none filled: the ``title``.
        chart: what the report draws to show the finding (:class:`EvidenceChart`); None: the training loss around its
            step.
    """

    code: str
    severity: Severity
    source: str
    title: str
    trigger: str
    hint: str
    reason: str = ""  # required (checked below); a default only so that it can follow `hint` as a keyword
    message: str = ""
    details: str = ""
    headline: str | tuple[str, ...] = ""
    chart: EvidenceChart | None = None

    def __post_init__(self) -> None:
        check_code(self.code)
        if self.severity not in SEVERITIES:
            raise ValueError(f"Rule {self.code}: severity must be one of {SEVERITIES}, got {self.severity!r}.")
        for name in ("source", "title", "trigger", "hint", "reason"):
            if not getattr(self, name).strip():
                raise ValueError(f"Rule {self.code}: `{name}` must not be empty.")

    def verdict(
        self,
        evidence: Mapping[str, Any] | None = None,
        *,
        severity: Severity | None = None,
        hint: str | None = None,
        key: str | None = None,
        step: int | None = None,
        message: str | None = None,
        **text: Any,
    ) -> Verdict:
        """This rule's verdict. The message is the rule's template filled from ``evidence`` and ``text`` (words
        computed for the sentence only, such as a list of names), unless ``message`` is given.

        Raises:
            ValueError: if the rule has no template and no ``message`` is given, or the template names a field that
                neither ``evidence`` nor ``text`` holds.
        """
        evidence = dict(evidence or {})
        if message is None:
            if not self.message:
                raise ValueError(f"Rule {self.code} has no message template; pass `message`.")
            try:
                message = self.message.format(**evidence, **text)
            except (KeyError, IndexError) as err:
                raise ValueError(f"Rule {self.code}: its message template needs {err}, which was not given.") from None
        if severity is not None and severity not in SEVERITIES:
            raise ValueError(f"Rule {self.code}: severity must be one of {SEVERITIES}, got {severity!r}.")
        headline = self.headline_for(evidence, **text)
        return Verdict(
            self.code, message, evidence, hint=hint, severity=severity, key=key, step=step, headline=headline
        )

    def headline_for(self, evidence: Mapping[str, Any], **text: Any) -> str:
        """What the headline says of a finding with ``evidence`` (and the verdict's ``text``): the first of the rule's
        ``headline`` templates that these fields fill, else its ``title``; at most
        :data:`~lightning_tfdebug.findings.HEADLINE_LIMIT` characters."""
        templates = (self.headline,) if isinstance(self.headline, str) else self.headline
        for template in templates:
            if not template:
                continue
            try:
                return _cut(template.format(**evidence, **text))
            except (KeyError, IndexError, ValueError, TypeError, AttributeError):  # a field absent or not a number
                continue
        return _cut(self.title)


def _cut(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= HEADLINE_LIMIT else text[: HEADLINE_LIMIT - 3] + "..."
