"""The rows of the run's Coverage table a callback answers (:class:`Coverage`, mixed into every
:class:`~lightning_tfdebug.core.base.DebugCallback`): what was verified, what does not apply and what could not be
checked, written per rank to ``coverage-rank<r>.jsonl`` for the report, the end-of-fit summary and ``tfdebug check``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any, ClassVar

from lightning_tfdebug.core.io import append_line

#: The file, per rank, where each member records the rows of the run's Coverage table it answers (one JSON line per
#: change: ``member``, ``check``, ``status``, ``reason``, ``setting``, ``codes``, ``step``, ``rank``; the last line per
#: ``(member, check)`` wins). Read by the report, the end-of-fit summary and ``tfdebug check``.
COVERAGE_FILE = "coverage-rank{rank}.jsonl"

COVERAGE_STATUSES = ("verified", "n/a", "unknown")
"""What a member records for a Coverage row: it ran and found nothing, it does not apply (why), or it could not
check (why, and the setting that would let it). A finding with one of the row's codes makes it a finding."""


class Coverage:
    """A callback's answers for its rows of the Coverage table (declared in :attr:`COVERAGE`).

    Reads of the callback it is mixed into: ``_log_dir``, ``_rank``, ``tfdebug_dir``, ``_hook_trainer`` (the step),
    ``_aside_reason`` / ``_aside_setting`` (why it stood aside).
    """

    COVERAGE: ClassVar[Mapping[str, tuple[str, ...]]] = {}
    """The rows of the run's Coverage table this callback answers: the check's name -> the finding codes that decide
    it (a finding with one of them makes the row a finding). Each row is recorded with :meth:`cover`; a row never
    recorded by the end of the fit is recorded as not reached."""

    COVERAGE_WATCHED: ClassVar[frozenset[str]] = frozenset()
    """The rows of :attr:`COVERAGE` answered by watching the run: verified at the end of a fit the callback watched
    to the end (active, no failure of its own) unless recorded otherwise (:meth:`cover`, or a finding)."""

    coverage: dict[str, tuple[str, str | None, str | None]]
    _coverage_records: list[dict[str, Any]]
    _log_dir: str | None
    _rank: int
    _hook_trainer: Any
    _aside_reason: str | None
    _aside_setting: str | None
    tfdebug_dir: str

    def cover(self, check: str, status: str, reason: str | None = None, setting: str | None = None) -> None:
        """Record this callback's answer for one row of the run's Coverage table (a row of :attr:`COVERAGE`).

        Written to ``coverage-rank<r>.jsonl`` when it changes (never on a step that does not decide it). A row that
        found something needs no call: its finding's code marks it.

        Args:
            check: the row, a key of :attr:`COVERAGE`.
            status: ``"verified"`` (ran, found nothing), ``"n/a"`` (does not apply; ``reason`` says why) or
                ``"unknown"`` (could not check; ``reason`` says why, ``setting`` what would let it).
            reason: one sentence, or None for a verified row.
            setting: the argument or set-up that would let an unknown row be checked, or None.

        Raises:
            ValueError: on a status outside :data:`COVERAGE_STATUSES` or a row not declared in :attr:`COVERAGE`.
        """
        if status not in COVERAGE_STATUSES:
            allowed = ", ".join(repr(a) for a in COVERAGE_STATUSES)
            raise ValueError(f"`status` must be one of {allowed}; got {status!r}.")
        if check not in type(self).COVERAGE:
            raise ValueError(
                f"{type(self).__name__} declares no Coverage row {check!r} (COVERAGE: {list(self.COVERAGE)})."
            )
        entry = (status, reason, setting)
        if self.coverage.get(check) == entry:
            return  # unchanged: nothing written
        self.coverage[check] = entry
        step = getattr(self._hook_trainer, "global_step", None)
        codes = list(type(self).COVERAGE[check])
        self._coverage_records.append(
            {"member": type(self).__name__, "check": check, "status": status, "reason": reason, "setting": setting,
             "codes": codes, "step": step}
        )  # fmt: skip
        self._write_coverage()

    def _write_coverage(self) -> None:
        if self._log_dir is None:
            return  # set-up writes them once the log directory is known
        path = os.path.join(self.tfdebug_dir, COVERAGE_FILE.format(rank=self._rank))
        for record in self._coverage_records:
            append_line(path, json.dumps({**record, "rank": self._rank}, default=str))
        self._coverage_records.clear()

    def _close_coverage(self) -> None:
        """At the end of a fit, every declared row not yet answered: a watched row of a callback that watched to the
        end is verified; a callback that stood aside says why it could not check; any other row was not reached."""
        trainer = self._hook_trainer
        step = getattr(trainer, "global_step", None)
        for check in type(self).COVERAGE:
            if check in self.coverage:
                continue
            if self._aside_reason is not None:
                self.cover(check, "unknown", self._aside_reason, self._aside_setting)
            elif check in type(self).COVERAGE_WATCHED and step:
                self.cover(check, "verified")
            else:
                self.cover(check, "unknown", *self.not_reached(check, step))

    def not_reached(self, check: str, step: int | None) -> tuple[str, str | None]:
        """Why Coverage row ``check`` was never decided in a fit that ended at ``step``, and what would let it be
        (a callback whose rows need something particular says so)."""
        return f"the run ended at step {step} before this check decided.", "a longer run"
