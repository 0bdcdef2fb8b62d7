"""StallWatchdog: the rank that hangs, named with where it is stuck, while the job still hangs."""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from typing import Any, ClassVar, Literal

import lightning.pytorch as pl

from lightning_tfdebug.core.base import DebugCallback, check_choice, check_number
from lightning_tfdebug.core.io import append_line
from lightning_tfdebug.core.watchdog import Stall, Watchdog, default_store, say_now
from lightning_tfdebug.findings import OnFinding
from lightning_tfdebug.functional.stall_checks import COVERAGE as COVERAGE_ROWS
from lightning_tfdebug.functional.stall_checks import stall_verdicts

OnStall = Literal["warn", "abort"]
ON_STALL_CHOICES: tuple[str, ...] = ("warn", "abort")

ABORT_GRACE_S = 3.0
"""Under ``on_stall="abort"``, how long a rank that has reported waits before it ends: the store lives in rank 0's
process, and the other ranks read it when they report."""

_fits = 0  # fits started in this process: every rank runs the same fits, so the count keys the store alike


class StallWatchdog(DebugCallback):
    r"""A daemon thread on every rank that names a rank which stopped making progress, while the job still hangs.

    The training loop's hooks only record the step and the phase (one tuple assignment: no sync, no collective, no
    lock). When no hook has run for ``stall_after`` seconds, the thread writes the Python stacks of every thread of its
    process to ``<log_dir>/tfdebug/stall-rank<r>.txt``, appends (and syncs) a finding to
    ``findings-rank<r>.jsonl`` and prints it to standard error, so ``tfdebug report`` shows it after the job is killed.
    Under ``torch.distributed`` each rank publishes its step, phase and what it waits in to the default process
    group's key-value store (its own client, 5-second timeout), so any rank's finding names the ranks behind, their
    step and phase, and where the others wait ("backward, where DDP's gradient all-reduce waits for every rank"). A
    store that cannot be reached: the rank still dumps its own stacks, and the finding says the others could not be
    read. Details in ``docs/callbacks/stall_watchdog.md``; how to read a report: ``docs/stall-report.md``.

    Phases that may take minutes are allowed generously, whatever ``stall_after`` is: the set-up, an epoch's start
    (DataLoader workers starting) and the first step (10 min), a stack inside ``torch.compile`` (30 min), one
    validation batch or the sanity check (10 min), a checkpoint write (15 min), a profiled step (10 min).

    Logged keys: none. Findings: ``TFD520`` a rank made no progress for ``stall_after`` seconds (the rank behind, its
    step, phase and frame; where the others wait), ``TFD521`` the ranks wait in different collectives.

    Args:
        stall_after: seconds without progress before the watchdog fires; ``None`` (default): from the run's own batch
            times, at least 90 s (20 median batches, 3 of the slowest), so on sub-second steps it fires within two
            minutes, before the usual collective timeouts.
        on_stall: ``"warn"`` (default): report and let the job hang on (the scheduler or the collective timeout ends
            it); ``"abort"``: after the report, end the process with ``abort_exit_code`` so a scheduler restarts it.
        abort_exit_code: the exit status of ``on_stall="abort"`` (default 75, ``EX_TEMPFAIL``: try again).
        on_finding: what a finding does besides being written (see :class:`~lightning_tfdebug.DebugCallback`); the
            stall finding itself is written from the watchdog thread whatever this says, since the job is stuck.

    Raises:
        ValueError: on a ``stall_after`` that is not positive, an unknown ``on_stall``, or an exit code outside 1-255.
        TypeError: on a ``stall_after`` or ``abort_exit_code`` that is not a number.

    Example:
        ```python
        trainer = Trainer(strategy="ddp", devices=8, callbacks=[StallWatchdog(on_stall="abort")])
        ```

        LightningCLI:

        ```yaml
        trainer:
          callbacks:
            - class_path: lightning_tfdebug.StallWatchdog
              init_args:
                stall_after: 300
                on_stall: warn
        ```
    """

    runs_collectives: ClassVar[bool] = False  # no collective of its own: a failure stands aside on its own rank
    #: three beats per batch: its start, backward, its end (the stack tells the rest: the optimizer step, a hook)
    every_batch_hooks = frozenset({"on_train_batch_start", "on_before_backward", "on_train_batch_end"})

    COVERAGE: ClassVar[Mapping[str, tuple[str, ...]]] = COVERAGE_ROWS  # declared beside the rules
    COVERAGE_WATCHED: ClassVar[frozenset[str]] = frozenset(COVERAGE)  # verified by watching the whole fit

    def __init__(
        self,
        stall_after: float | None = None,
        on_stall: OnStall = "warn",
        abort_exit_code: int = 75,
        on_finding: OnFinding = "warn",
    ) -> None:
        super().__init__(on_finding=on_finding)
        check_number("stall_after", stall_after, low=0.0, low_inclusive=False, optional=True)
        check_choice("on_stall", on_stall, ON_STALL_CHOICES)
        check_number("abort_exit_code", abort_exit_code, low=1, high=255, integer=True)
        self.stall_after = None if stall_after is None else float(stall_after)
        self.on_stall = on_stall
        self.abort_exit_code = abort_exit_code
        self._watchdog: Watchdog | None = None
        self._trainer: pl.Trainer | None = None
        self._first_step: int | None = None
        self._batch_started = 0.0

    @property
    def state_key(self) -> str:
        return self._generate_state_key(stall_after=self.stall_after, on_stall=self.on_stall)

    def busy_at(self, step: int) -> bool:
        """No measuring step: the batch hooks it needs run every batch (:attr:`every_batch_hooks`)."""
        return False

    @property
    def watchdog(self) -> Watchdog | None:
        """The running watchdog (None outside ``fit``)."""
        return self._watchdog

    # ------------------------------------------------------------------ lifecycle
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        self._stop()
        if stage != "fit":
            return
        global _fits
        _fits += 1
        world = int(getattr(trainer, "world_size", 1) or 1)
        self._trainer = trainer
        self._first_step = None
        self._watchdog = Watchdog(
            trainer.global_rank,
            world,
            self._report,
            stall_after=self.stall_after,
            store=default_store if world > 1 else None,
            run_key=str(_fits),
        )
        self._watchdog.start()

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._stop()

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._stop()

    def _stop(self) -> None:
        watchdog, self._watchdog = self._watchdog, None
        if watchdog is not None:
            watchdog.stop()
        self._trainer = None

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_watchdog"] = None  # a thread is not copied (LightningCLI, spawn launchers): a copy starts its own
        state["_trainer"] = None
        return state

    # ------------------------------------------------------------------ the beats (the hot path: one assignment each)
    def _mark(self, trainer: pl.Trainer, phase: str) -> None:
        watchdog = self._watchdog
        if watchdog is not None:
            watchdog.beat = (watchdog.beat[0] + 1, trainer.global_step, phase, time.monotonic())

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._mark(trainer, "fit start")

    def on_sanity_check_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._mark(trainer, "sanity check")

    def on_sanity_check_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._mark(trainer, "waiting for the first batch")

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._mark(trainer, "waiting for the first batch")

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, idx: int) -> None:
        if self._first_step is None:
            self._first_step = trainer.global_step
        first = trainer.global_step == self._first_step
        self._mark(trainer, "first training step" if first else "training step")
        self._batch_started = time.monotonic()

    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: Any) -> None:
        watchdog = self._watchdog
        if watchdog is not None:  # the step of the batch's start: no property read on the hot path
            count, step, _, _ = watchdog.beat
            watchdog.beat = (count + 1, step, "backward", time.monotonic())

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, idx: int
    ) -> None:
        watchdog = self._watchdog
        if watchdog is not None:
            watchdog.batch_s = time.monotonic() - self._batch_started  # host arithmetic: the default's step times
            self._mark(trainer, "between batches")

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._mark(trainer, "sanity check" if trainer.sanity_checking else "validation")

    def on_validation_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        self._mark(trainer, "sanity check" if trainer.sanity_checking else "validation")

    def on_validation_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        self._mark(trainer, "sanity check" if trainer.sanity_checking else "validation")

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._mark(trainer, "after validation")

    def on_save_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: Any) -> None:
        self._mark(trainer, "checkpoint save")

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._mark(trainer, "epoch start")

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._mark(trainer, "epoch end")

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._mark(trainer, "fit end")

    # ------------------------------------------------------------------ the report (on the watchdog thread)
    def _report(self, stall: Stall) -> None:
        trainer = self._trainer
        if trainer is None:
            return
        rank = stall.own.rank
        stacks_path = os.path.join(self.tfdebug_dir, f"stall-rank{rank}.txt")
        header = (
            f"=== rank {rank}: no progress for {stall.own.idle_s:.1f} s at step {stall.own.step} ({stall.own.phase});"
            f" stall_after {stall.stall_after:.1f} s; pid {os.getpid()}; {time.strftime('%Y-%m-%d %H:%M:%S')}\n"
        )
        append_line(stacks_path, header + stall.stacks + "\n")
        verdicts = stall_verdicts(
            stall.own, stall.others, int(getattr(trainer, "world_size", 1) or 1), stacks_path, stall.unreadable
        )
        self._warned_codes.update(v.code for v in verdicts)  # said below on stderr, on every rank, at once
        for finding in self.emit(trainer, verdicts, synchronized=False):
            say_now("lightning_tfdebug: " + finding.format())
        if self.on_stall == "abort":
            say_now(f"lightning_tfdebug: StallWatchdog ends rank {rank} with exit status {self.abort_exit_code}.")
            if stall.others is not None:  # the other ranks fire about now: leave them the store (rank 0 serves it)
                time.sleep(ABORT_GRACE_S)
            os._exit(self.abort_exit_code)
