"""The base every callback of the pack stands on: cadence (:meth:`DebugCallback.should_measure`), one host
transfer per measuring step (:meth:`~DebugCallback.to_host`), logging (:meth:`~DebugCallback.log_scalars`), findings
(:meth:`~DebugCallback.emit`) and standing aside (:meth:`~DebugCallback.stand_aside`)."""

from __future__ import annotations

import json
import os
import traceback
import warnings
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch import Tensor

from lightning_tfdebug.core.compat import Callback, is_lightning_instance
from lightning_tfdebug.core.coverage import COVERAGE_FILE, COVERAGE_STATUSES, Coverage  # noqa: F401
from lightning_tfdebug.core.guard import (  # noqa: F401  (the callbacks import them here)
    _HOOKS,
    TFDebugCallbackError,
    _guard,
    _run_as_hook,
    eager_model_calls,
    model_is_compiled,
)
from lightning_tfdebug.core.io import append_finding, append_line
from lightning_tfdebug.core.messages import pack_warning
from lightning_tfdebug.core.reduction import StepReduction
from lightning_tfdebug.core.scalars import ScalarSink, refused_scalars, write_scalars
from lightning_tfdebug.core.step import step_state
from lightning_tfdebug.findings import (
    ON_FINDING_CHOICES,
    Finding,
    OnFinding,
    TFDebugError,
    TFDebugWarning,
)
from lightning_tfdebug.functional.verdicts import Verdict
from lightning_tfdebug.primitives.keys import Key
from lightning_tfdebug.rules import rule

#: The file, per rank, where the checks that stood aside record themselves (one JSON line each); read by the report.
STOOD_ASIDE_FILE = "stood-aside-rank{rank}.jsonl"


@dataclass
class PackContext:
    """What :class:`~lightning_tfdebug.TFDebug` gives each member it holds: the whole pack/member protocol.

    Set once by the pack when it builds the member (:attr:`DebugCallback.pack`); a callback on its own has none.

    Attributes:
        scalar_sink: where the member's scalars of one forwarded hook call wait, to go out with every member's in one
            call per logger and step.
        reduction: the pack's one reduction over ranks per measuring step, while the pack runs this member; None
            while it does not (a copy listed in ``trainer.callbacks`` by hand runs instead).
        live_warnings: False in a preflight (``tfdebug check`` prints each finding once, in its report).
    """

    scalar_sink: ScalarSink
    reduction: StepReduction | None = None
    live_warnings: bool = True


def check_choice(name: str, value: Any, allowed: tuple[Any, ...]) -> None:
    """Raise a ValueError naming the allowed values when ``value`` is not one of them."""
    if value not in allowed:
        raise ValueError(f"`{name}` must be one of {', '.join(repr(a) for a in allowed)}; got {value!r}.")


def check_number(
    name: str,
    value: Any,
    *,
    low: float | None = None,
    high: float | None = None,
    low_inclusive: bool = True,
    integer: bool = False,
    optional: bool = False,
) -> None:
    """Raise a ValueError/TypeError with one clear sentence when ``value`` is not a number in the allowed range."""
    if value is None and optional:
        return
    kind = "an integer" if integer else "a number"
    if isinstance(value, bool) or not isinstance(value, int if integer else (int, float)):
        raise TypeError(f"`{name}` must be {kind}{' or None' if optional else ''}; got {value!r}.")
    if low is not None and (value < low or (value == low and not low_inclusive)):
        bound = ">=" if low_inclusive else ">"
        raise ValueError(f"`{name}` must be {bound} {low}; got {value!r}.")
    if high is not None and value > high:
        raise ValueError(f"`{name}` must be <= {high}; got {value!r}.")


CALLBACKS: dict[str, type[DebugCallback]] = {}
"""Every :class:`DebugCallback` subclass defined so far, by class name (the report reads their ``KEYS``)."""


class DebugCallback(Coverage, Callback):
    """Base class of the pack's callbacks.

    Args:
        every_n_steps: measure on optimizer steps where ``trainer.global_step % every_n_steps == 0``; ``None`` uses
            the Trainer's ``log_every_n_steps``.
        on_finding: what a warning- or error-level finding does. ``"warn"``: warn once per code (on rank 0) and
            keep training. ``"stop"``: every rank stops together after the current step. ``"raise"``: every rank
            raises :class:`~lightning_tfdebug.TFDebugError` at the same step. ``info`` findings never stop a run.

    Raises:
        ValueError: if ``every_n_steps`` is not a positive integer or ``on_finding`` is not one of the choices.
    """

    runs_collectives: ClassVar[bool] = True
    """Whether the hooks may run collectives; then a failure on one rank of several ends the run instead of a hang."""

    KEYS: ClassVar[tuple[Key, ...]] = ()
    """Every scalar the callback logs; its docs table, dashboard charts and scalar tests derive from it."""

    every_batch_hooks: ClassVar[frozenset[str]] = frozenset()
    """The batch hooks (:data:`BATCH_HOOKS`) needed on every batch whatever :meth:`busy_at` says (bookkeeping)."""

    # The state the guard reads around every hook, declared here with class-level defaults (so a hook that runs
    # before ``__init__`` has finished reads them too); nothing else of the protocol lives outside this class.
    pack: PackContext | None = None
    """What :class:`~lightning_tfdebug.TFDebug` gives this member (:class:`PackContext`); None on its own."""
    failure: dict[str, Any] | None = None
    """The callback's own first failure (``hook``, ``error``, ``step``, ``traceback``, ``everywhere``), else None."""
    _in_hook: bool = False  # inside a guarded hook (a hook calling another is guarded by the outer one)
    _hook_trainer: Any = None  # the Trainer of the hook running now (its step, if the callback stands aside)
    _busy_batch: bool = True  # on its own: whether this batch has work beyond `every_batch_hooks`
    _manual_optimization: bool = False  # every hook runs on every batch (one batch may step several times)
    _per_step_dispatch: bool = True  # on its own: skip batch hooks with no work on this step (False: run all)
    _logger_refused: bool = False  # a logger refused this callback's scalars once (warned once)

    @property
    def in_pack(self) -> bool:
        """Whether a :class:`~lightning_tfdebug.TFDebug` holds this callback (its summary then lists it)."""
        return self.pack is not None

    @property
    def live_warnings(self) -> bool:
        """False in a preflight: ``tfdebug check`` prints each finding once, in its report."""
        return self.pack.live_warnings if self.pack is not None else True

    @property
    def shared_reduction(self) -> StepReduction | None:
        """The pack's reduction while the pack runs this member, else None (it reduces on its own)."""
        return self.pack.reduction if self.pack is not None else None

    def busy_at(self, step: int) -> bool:
        """Whether the batches of optimizer step ``step`` have work for the batch hooks beyond
        :attr:`every_batch_hooks`; asked at each batch's start (by the pack, or the guard on its own). Must be True on
        every step the callback measures or arms on, and while something armed is in flight. Default: True."""
        return True

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int):
        """Nothing here; the guard still asks :meth:`busy_at` at each batch's start."""

    on_train_batch_start._tfdebug_noop = True  # type: ignore[attr-defined]  # the pack does not call it

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        CALLBACKS[cls.__name__] = cls
        for name in _HOOKS:  # the one guard: every hook a subclass defines, wrapped once, here
            hook = cls.__dict__.get(name)
            if callable(hook) and not getattr(hook, "_tfdebug_guarded", False):
                setattr(cls, name, _guard(name, hook))

    def __init__(self, every_n_steps: int | None = None, on_finding: OnFinding = "warn") -> None:
        super().__init__()
        check_number("every_n_steps", every_n_steps, low=1, integer=True, optional=True)
        check_choice("on_finding", on_finding, ON_FINDING_CHOICES)
        self.every_n_steps = every_n_steps
        self.on_finding = on_finding
        self.findings: list[Finding] = []
        self._interval = every_n_steps or 50
        self._log_dir: str | None = None
        self._rank = 0
        self._emitted: set[tuple[str, str | None]] = set()
        self._warned_codes: set[str] = set()
        self._pending_local: list[Finding] = []
        self._aside_reason: str | None = None
        self._aside_setting: str | None = None
        self._aside_step: int | None = None
        self._aside_recorded_in: str | None = None  # the log directory whose stood-aside-rank<r>.jsonl holds it
        self._aside_announced = False  # said once more at the end of fit (a callback on its own, not in the pack)
        self.checks_aside: dict[str, str] = {}  # one check of this callback that does not run -> why (and the setting)
        self._check_records: list[dict[str, Any]] = []  # their stood-aside records not yet written (no log dir yet)
        self.coverage: dict[str, tuple[str, str | None, str | None]] = {}  # row -> (status, reason, setting)
        self._coverage_records: list[dict[str, Any]] = []  # coverage lines not yet written (no log dir yet)
        self.failure = None

    # ------------------------------------------------------------------ lifecycle
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._interval = self.every_n_steps or max(1, int(trainer.log_every_n_steps))
        self._rank = trainer.global_rank
        # under manual optimization one batch may step the optimizer several times: every hook runs on every batch
        self._manual_optimization = not bool(getattr(pl_module, "automatic_optimization", True))
        # `trainer.log_dir` broadcasts from rank 0: a collective that every rank reaches here, once.
        self._log_dir = trainer.log_dir or trainer.default_root_dir
        self._aside_announced = False
        if self._aside_reason is not None and self.failure is None:
            self._record_aside()  # stood aside before the log directory was known, or in an earlier fit elsewhere
        self._write_check_records()
        self._write_coverage()
        shared = step_state(trainer)
        if not trainer.loggers and not shared.warned_no_logger:
            shared.warned_no_logger = True  # once per Trainer, not once per callback
            rank_zero_warn(
                "lightning_tfdebug: the Trainer has no logger, so metrics reach only `trainer.callback_metrics`; "
                f"findings are still written to {os.path.join(self._log_dir, 'tfdebug')}. Pass "
                "`logger=TensorBoardLogger(...)` to see the curves.",
                category=TFDebugWarning,
            )

    @property
    def active(self) -> bool:
        """False once the callback has stood aside (a set-up it cannot serve); hooks then return at once."""
        return self._aside_reason is None

    @property
    def stood_aside(self) -> dict[str, Any] | None:
        """Why this check did not run, or None while it runs: ``{"check", "reason", "setting", "step", "rank"}``
        (``setting``: what would let it run, or None)."""
        if self._aside_reason is None:
            return None
        return {
            "check": type(self).__name__,
            "reason": self._aside_reason,
            "setting": self._aside_setting,
            "step": self._aside_step,
            "rank": self._rank,
        }

    def stand_aside(self, reason: str, setting: str | None = None, *, warn: bool = False) -> None:
        """Stop doing anything for the rest of the run, and say why once. Never crashes training.

        Recorded in ``<log_dir>/tfdebug/stood-aside-rank<r>.jsonl`` (listed by the report and the end-of-run summary
        under "did not run"); nothing is printed during the run.

        Args:
            reason: one sentence: why the check cannot run.
            setting: the one argument or set-up that would let it run, e.g. ``"`labels_key`"``, ``"an uncompiled
                model (no torch.compile)"``; None when nothing would.
            warn: say it as a :class:`TFDebugWarning` instead: only for a real fault the user must see.
        """
        if self._aside_reason is not None:
            return
        self._aside_reason = reason
        self._aside_setting = setting
        # the step of the hook in progress (its trainer set by the guard)
        self._aside_step = getattr(self._hook_trainer, "global_step", None)
        if warn:
            text = f"{type(self).__name__} stands aside: {reason}"
            rank_zero_warn(text + (f" To let it run: {setting}." if setting else ""), category=TFDebugWarning)
        self._record_aside()

    def check_aside(self, check: str, reason: str, setting: str | None = None) -> None:
        """One check of this callback does not run while the others do: recorded once in
        ``stood-aside-rank<r>.jsonl`` as ``"<Class>: <check>"``; never printed during the run.

        Args:
            check: the check's name, e.g. ``"EOS supervision (TFD124)"``.
            reason: one sentence: why it cannot run.
            setting: the argument or set-up that would let it run, or None.
        """
        reason = reason if reason.rstrip().endswith((".", "!", "?")) else reason.rstrip() + "."  # one sentence
        if check in self.checks_aside:
            return
        self.checks_aside[check] = reason + (f" To let it run: {setting}." if setting else "")
        if check in type(self).COVERAGE:
            self.cover(check, "unknown", reason, setting)
        step = getattr(self._hook_trainer, "global_step", None)
        name = f"{type(self).__name__}: {check}"
        self._check_records.append({"check": name, "reason": reason, "setting": setting, "step": step})
        self._write_check_records()

    def _append_aside(self, record: Mapping[str, Any]) -> None:
        path = os.path.join(self.tfdebug_dir, STOOD_ASIDE_FILE.format(rank=self._rank))
        append_line(path, json.dumps(record, default=str))

    def _write_check_records(self) -> None:
        if self._log_dir is None:
            return  # set-up writes them once the log directory is known
        for record in self._check_records:
            self._append_aside({**record, "rank": self._rank})
        self._check_records.clear()

    def _record_aside(self) -> None:
        """Append this check's stand-aside record, once per log directory."""
        if self._log_dir is None or self._aside_recorded_in == self._log_dir:
            return  # set-up records it once the log directory is known
        self._aside_recorded_in = self._log_dir
        self._append_aside(self.stood_aside)

    def _announce_aside(self) -> None:
        """At the end of fit, one rank-0 info line for a callback on its own that stood aside."""
        if self._aside_reason is None or self._aside_announced or self.in_pack or self.failure is not None:
            return
        self._aside_announced = True
        setting = f"; to let it run: {self._aside_setting}" if self._aside_setting else ""
        rank_zero_info(f"lightning_tfdebug: {type(self).__name__} did not run: {self._aside_reason}{setting}")

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Nothing of its own: the guard around every ``on_fit_end`` says, once, that a check stood aside."""

    def callback_failed(self, hook: str, error: Exception, trainer: pl.Trainer | None) -> None:
        """Handle an exception from this callback's own code in ``hook`` (called by the guard around every hook).

        The first failure is reported once (traceback in ``<log_dir>/tfdebug/callback-errors-rank<r>.txt``, a
        :class:`TFDebugWarning`, ``self.failure``); the callback then stands aside, its clean-up hooks still running.

        Raises:
            TFDebugCallbackError: in a multi-process run where the callback cannot stand aside on every rank together
                (the other ranks would wait in its next collective).
        """
        text = "".join(traceback.format_exception(type(error), error, error.__traceback__))
        step = getattr(trainer, "global_step", None)
        rank = getattr(trainer, "global_rank", self._rank)
        if self.failure is not None:  # a clean-up hook failing after the first failure: reported already
            self.failure["later_errors"] = self.failure.get("later_errors", 0) + 1
            return
        self.failure = {"hook": hook, "error": f"{type(error).__name__}: {error}", "step": step, "traceback": text}
        self._aside_reason = self._aside_reason or f"its own code raised {type(error).__name__} in {hook}"
        path = os.path.join(self.tfdebug_dir, f"callback-errors-rank{rank}.txt")
        append_line(path, f"=== {type(self).__name__}.{hook} at step {step} (rank {rank})\n{text}")
        world = getattr(trainer, "world_size", 1) if trainer is not None else 1
        shared = self.shared_reduction
        collective = world > 1 and type(self).runs_collectives
        stand_in = collective and shared is not None and shared.can_stand_in(self)
        if collective and not stand_in:
            raise TFDebugCallbackError(
                f"{type(self).__name__}.{hook} failed on rank {rank} at step {step} with {type(error).__name__}: "
                f"{error}. In a run of {world} processes it cannot stand aside on this rank alone (the other ranks "
                f"would wait in its next collective), so the run ends here. Traceback: {path}. Remove "
                f"{type(self).__name__} from the callbacks to train without it, and please report the traceback."
            ) from error
        where = ""
        if stand_in:
            # Its only collective is the pack's shared reduction, whose layout for it is known: this rank sends zeros
            # in its place, flagged, at its next measuring step, and every rank stands it aside there together.
            self.failure["everywhere"] = False
            shared.stand_in_due = True
            where = ", on every rank from its next measuring step"
        warnings.warn(
            f"{type(self).__name__} failed in its own code ({hook} at step {step}, rank {rank}: "
            f"{type(error).__name__}: {error}) and stands aside for the rest of the run{where}; training continues. "
            f"Traceback: {path}.",
            category=TFDebugWarning,
            stacklevel=4,  # the frame that called the hook
        )

    def should_measure(self, trainer: pl.Trainer) -> bool:
        """Whether this optimizer step measures. Depends only on ``global_step``, so every rank agrees."""
        return self.active and not trainer.sanity_checking and trainer.global_step % self._interval == 0

    @property
    def tfdebug_dir(self) -> str:
        """``<trainer.log_dir>/tfdebug``: where reports and findings of this run go."""
        return os.path.join(self._log_dir or ".", "tfdebug")

    # ------------------------------------------------------------------ the step's reduction over ranks
    def reduce_then(
        self,
        trainer: pl.Trainer,
        then: Callable[[Any], None],
        device: torch.device,
        *,
        sums: Mapping[str, Any] | None = None,
        anys: Mapping[str, Any] | None = None,
        maxes: Mapping[str, Any] | None = None,
        rows: Mapping[str, Any] | None = None,
    ) -> None:
        """Declare this measuring step's statistics as named fields and call ``then(reduced)`` once they are reduced
        over the ranks.

        ``reduced`` is a :class:`~lightning_tfdebug.core.reduction.Reduced` read by the declared names
        (``reduced.sums["tokens"]``; ``sums`` added up, ``anys`` 1.0 where some rank set the flag, ``maxes`` the
        maximum, ``rows`` every rank's value). One collective: the pack's, after the hook, or the callback's own at
        once. Every rank must declare on the same steps with the same names and shapes.
        """
        from lightning_tfdebug.core.reduction import StepReduction, declaration

        declared = declaration(self, then, device, sums=sums, anys=anys, maxes=maxes, rows=rows)
        if self.shared_reduction is not None:
            self.shared_reduction.add(declared)
            return
        own = StepReduction()
        own.add(declared)
        own.run(trainer)

    def declares_at(self, step: int, stepped: bool) -> bool | None:
        """Whether this callback declares into the reduction at the end of the batch of optimizer step ``step``
        (``stepped``: the batch ended with an optimizer step), from its cadence alone; None without a cadence."""
        return None

    def failed_on_some_rank(self, trainer: pl.Trainer, ranks: int, hook: str) -> None:
        """This callback's own code failed on ``ranks`` rank(s): it stands aside on every rank at this step."""
        if self.failure is not None:  # the rank (or one of those) where it failed
            self.failure["everywhere"] = True
            return
        step = getattr(trainer, "global_step", None)
        self.failure = {
            "hook": hook,
            "error": f"its own code failed on {ranks} other rank(s)",
            "step": step,
            "traceback": "",
            "everywhere": True,
        }
        self._aside_reason = self._aside_reason or f"its own code failed on {ranks} other rank(s)"
        rank_zero_warn(
            f"{type(self).__name__} failed in its own code on {ranks} rank(s) (see callback-errors-rank<r>.txt) and "
            f"stands aside on every rank from step {step}; training continues.",
            category=TFDebugWarning,
        )

    def conclude(self, trainer: pl.Trainer, then: Callable[[Any], None], reduced: Any) -> None:
        """Run ``then(reduced)`` under the same guard as a hook (called by the step's reduction)."""
        if self.failure is not None:
            return
        if self._in_hook:  # on its own: inside the hook that declared, which guards it
            then(reduced)
            return
        # a failure here comes after the collective: every rank got its values
        _run_as_hook(self, "on_train_batch_end", trainer, lambda: then(reduced))

    # ------------------------------------------------------------------ metrics
    @staticmethod
    def to_host(values: Mapping[str, Tensor | float]) -> dict[str, float]:
        """Move every device scalar in ``values`` to the host with a single transfer (stacked, not one ``.item()``
        each): the callback's one deliberate host sync on a measuring step."""
        from lightning_tfdebug.core.reduction import host_fields

        scalars = {k: v.reshape(()) if isinstance(v, Tensor) else v for k, v in values.items()}
        return host_fields(scalars)  # host sync: one per measuring step, for all of this callback's statistics

    def log_scalars(self, trainer: pl.Trainer, metrics: Mapping[str, float], step: int | None = None) -> None:
        """Send host scalars to ``trainer.callback_metrics`` (every rank) and every logger (rank 0) at ``step``;
        inside the pack they go out with every member's, one call per logger and step."""
        if not metrics:
            return
        step = trainer.global_step if step is None else step
        sink = self.pack.scalar_sink if self.pack is not None else None
        if sink is not None and sink.open:
            sink.add(step, metrics)
            return
        values = {k: float(v) for k, v in metrics.items()}  # a value that is not a number fails here, in the hook
        try:
            write_scalars(trainer, values, step)
        except Exception as err:  # the logger's own failure: the callback goes on without those curves
            if not self._logger_refused:
                self._logger_refused = True
                warnings.warn(refused_scalars(type(self).__name__, step, err), TFDebugWarning, stacklevel=2)

    # ------------------------------------------------------------------ findings
    def emit(
        self,
        trainer: pl.Trainer,
        verdicts: Verdict | Iterable[Verdict | None] | None,
        *,
        synchronized: bool = True,
    ) -> list[Finding]:
        """Record the findings of rule verdicts and act on them as ``on_finding`` says (the one emit path).

        Args:
            trainer: the Trainer.
            verdicts: what rule functions returned (:meth:`~lightning_tfdebug.functional.verdicts.Rule.verdict`): one
                verdict, several, or None entries for rules that found nothing.
            synchronized: True when every rank reaches the same verdicts from the same reduced values; they are then
                acted on at once. False for verdicts only this rank reaches; they are acted on at the next
                :meth:`resolve_local_findings`, which all ranks call together.

        Returns:
            The findings recorded now (a ``(code, key)`` already recorded by this callback is not recorded again).

        Raises:
            KeyError: if a verdict's code is not registered.
            ValueError: if this callback is not the rule's source.
        """
        if verdicts is None or isinstance(verdicts, Verdict):
            verdicts = (verdicts,)
        found = []
        for verdict in verdicts:
            finding = None if verdict is None else self._record_verdict(trainer, verdict, synchronized)
            if finding is not None:
                found.append(finding)
        return found

    def _record_verdict(self, trainer: pl.Trainer, verdict: Verdict, synchronized: bool) -> Finding | None:
        registered = rule(verdict.code)
        if registered.source not in {cls.__name__ for cls in type(self).__mro__}:
            raise ValueError(f"{type(self).__name__} emitted {verdict.code}, which belongs to {registered.source}.")
        if (verdict.code, verdict.key) in self._emitted:
            return None
        self._emitted.add((verdict.code, verdict.key))
        severity = registered.severity if verdict.severity is None else verdict.severity
        finding = Finding(
            code=verdict.code,
            severity=severity,
            source=type(self).__name__,
            step=trainer.global_step if verdict.step is None else verdict.step,
            rank=trainer.global_rank,
            message=verdict.message,
            evidence=dict(verdict.evidence),
            hint=registered.hint if verdict.hint is None else verdict.hint,
            headline=verdict.headline,
        )
        self.findings.append(finding)
        append_finding(os.path.join(self.tfdebug_dir, f"findings-rank{trainer.global_rank}.jsonl"), finding)
        self._warn(finding, synchronized)
        if trainer.is_global_zero:
            self._log_text(trainer, finding)
        if severity == "info" or self.on_finding == "warn":
            return finding
        if synchronized:
            self._act(trainer, (finding,))
        else:
            self._pending_local.append(finding)
        return finding

    def resolve_local_findings(self, trainer: pl.Trainer) -> None:
        """Act on rank-local findings: every rank must call this at the same point of the same step.

        Collective: unless ``on_finding="warn"``, one boolean reduction tells every rank whether any rank holds a
        pending finding, so all stop or raise together.
        """
        if self.on_finding == "warn":
            self._pending_local.clear()
            return
        pending = tuple(self._pending_local)
        self._pending_local.clear()
        if trainer.strategy.reduce_boolean_decision(bool(pending), all=False):
            self._act(trainer, pending, elsewhere=not pending)

    def _act(self, trainer: pl.Trainer, findings: tuple[Finding, ...], elsewhere: bool = False) -> None:
        if self.on_finding == "stop":
            trainer.should_stop = True
            return
        if elsewhere:
            text = f"{type(self).__name__}: another rank raised a finding at step {trainer.global_step}; see its file."
        else:
            text = "\n".join(f.format() for f in findings)
        raise TFDebugError(text, findings)

    def _warn(self, finding: Finding, synchronized: bool) -> None:
        if finding.code in self._warned_codes or not self.live_warnings or finding.severity == "info":
            return  # info is an observation: the end-of-run summary and the report list it, nothing prints it now
        self._warned_codes.add(finding.code)
        if synchronized and finding.rank != 0:
            return  # every rank reached the same finding: rank 0 says it once
        # shown as "lightning_tfdebug: [TFD220] ERROR ...": the pack and the finding, not a line of our source
        pack_warning(finding.format(), TFDebugWarning)

    @staticmethod
    def _log_text(trainer: pl.Trainer, finding: Finding) -> None:
        for logger in trainer.loggers:
            if is_lightning_instance(logger, "TensorBoardLogger"):  # `lightning` or standalone `pytorch_lightning`
                # the headline first (what the text tab lists at a glance), then the whole finding
                body = f"**{finding.headline}**  \n" + finding.format().replace("\n", "  \n")  # markdown breaks
                logger.experiment.add_text(f"tfdebug/{finding.code}", body, global_step=finding.step)

    # ------------------------------------------------------------------ checkpoint state
    @property
    def state_key(self) -> str:
        """Key of this callback's state in checkpoints; differs between instances configured differently."""
        return self._generate_state_key(every_n_steps=self.every_n_steps, on_finding=self.on_finding)

    def state_dict(self) -> dict[str, Any]:
        return {"emitted": [list(k) for k in sorted(self._emitted, key=str)], "warned": sorted(self._warned_codes)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._emitted = {(c, k) for c, k in state_dict.get("emitted", [])}
        self._warned_codes = set(state_dict.get("warned", []))


for _name in _HOOKS & set(DebugCallback.__dict__):  # the base's own hooks (`setup`) are guarded the same way
    setattr(DebugCallback, _name, _guard(_name, DebugCallback.__dict__[_name]))
