"""CheckpointAudit: does a saved checkpoint hold everything a resume needs, and does a resume restore it?"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any, ClassVar

import lightning.pytorch as pl
from torch import Tensor

from lightning_tfdebug.callbacks.checkpoint_audit.capture import (
    PROBE_CHECK,
    batch_rows,
    probe_call_of,
    replay_probe_call,
)
from lightning_tfdebug.core.base import DebugCallback, check_number
from lightning_tfdebug.core.calls import StepRecording, record_step
from lightning_tfdebug.core.checkpoints import (
    DamagedCheckpoint,
    expectation,
    live_state,
    load_checkpoint,
    read_sharded,
    resumable_savers,
)
from lightning_tfdebug.findings import OnFinding
from lightning_tfdebug.functional import checkpoint_checks as checks
from lightning_tfdebug.functional import resume_checks
from lightning_tfdebug.functional.checkpoint_checks import COVERAGE as COVERAGE_ROWS
from lightning_tfdebug.functional.checkpoints import restored_state
from lightning_tfdebug.functional.verdicts import Verdict


class CheckpointAudit(DebugCallback):
    """Verifies each checkpoint file after it is written, and each resume against the checkpoint.

    After each save (rank 0, through the strategy's ``CheckpointIO``) the file must hold what the live objects say a
    resume needs: weights, optimizer, scheduler and GradScaler state, loop progress and callback state. On resume the
    live objects must match the checkpoint, and the model call `training_step` made on the first batch, replayed on
    a few of its rows, must give what it gave at save time.
    Nothing runs on steps without a save. The guide, ``docs/callbacks/checkpoint_audit.md``, has the details.

    Findings: ``TFD701`` weights missing, ``TFD702`` wrong shapes, ``TFD703`` optimizer state missing, ``TFD704``
    optimizer state incomplete, ``TFD705`` scheduler state missing, ``TFD706`` GradScaler state missing,
    ``TFD707`` loop progress missing, ``TFD708`` callback state missing, ``TFD709`` (info) not checked or
    weights-only (a warning when no checkpoint the run keeps can resume it), ``TFD710`` restored weights differ,
    ``TFD711`` optimizer step counts differ, ``TFD712`` learning rate differs,
    ``TFD713`` loss scale differs, ``TFD714`` global step differs, ``TFD715`` probe loss differs after resume,
    ``TFD716`` a checkpoint this run wrote is truncated, corrupt or incomplete.

    Logged keys: none (the audit is pass/fail; evidence goes into the findings).

    Args:
        every_n_steps: unused by the checks (they run at saves and resumes); kept for a uniform interface.
        on_finding: ``"warn"``, ``"stop"`` or ``"raise"``.
        probe_rows: rows of the first batch's model call kept as the probe (stored in the callback's state).
        loss_rtol: relative tolerance between the probe loss at save time and after resume.
        weight_rtol: relative tolerance of the weight checksums after resume.
        reload: read every file back and compare resumes with the checkpoint. ``False`` (the ``always`` preset) judges
            the dict each save writes, in memory (TFD701-TFD709); no probe call, no resume comparison (TFD710-TFD716).

    Raises:
        ValueError: on an argument outside its allowed range.

    Example:
        ```python
        trainer = Trainer(callbacks=[ModelCheckpoint(every_n_train_steps=500), CheckpointAudit()])
        ```

        LightningCLI:

        ```yaml
        trainer:
          callbacks:
            - class_path: lightning_tfdebug.CheckpointAudit
              init_args:
                probe_rows: 2
        ```
    """

    COVERAGE: ClassVar[Mapping[str, tuple[str, ...]]] = COVERAGE_ROWS  # declared beside the rules

    def __init__(
        self,
        every_n_steps: int | None = None,
        on_finding: OnFinding = "warn",
        probe_rows: int = 2,
        loss_rtol: float = 1e-3,
        weight_rtol: float = 1e-5,
        reload: bool = True,
    ) -> None:
        super().__init__(every_n_steps=every_n_steps, on_finding=on_finding)
        if not isinstance(reload, bool):
            raise ValueError(f"`reload` must be True or False, got {reload!r}.")
        self.reload = reload
        check_number("probe_rows", probe_rows, low=1, integer=True)
        check_number("loss_rtol", loss_rtol, low=0.0, low_inclusive=False, high=1.0)
        check_number("weight_rtol", weight_rtol, low=0.0, low_inclusive=False, high=1.0)
        self.probe_rows = probe_rows
        self.loss_rtol = float(loss_rtol)
        self.weight_rtol = float(weight_rtol)
        self._probe_call: dict[str, Any] | None = None  # the model call replayed at saves and resumes (host copies)
        self._recording: StepRecording | None = None  # the first batch's calls, until its forward is over
        self._probe_of: tuple[Any, int] = (None, 0)  # (batch, batch_idx) being recorded
        self._probe_taken = False  # the probe call is taken once per fit, even when it cannot be used
        self._probe_loss: float | None = None
        self._probe_loss_step: int | None = None
        self._expected: dict[str, Any] | None = None
        self._pending_files: list[tuple[str, dict[str, Any]]] = []
        self._sharded_due = False  # a sharded save happened; rank 0 checks its directory at the next batch end
        self._resolve_due = False
        self._verified_since_save = True
        self._full_saved = False  # a full (resumable) checkpoint of this run was read back
        self._io: Any = None
        self._restored: dict[str, Any] | None = None
        self.checked_files: list[str] = []

    @property
    def state_key(self) -> str:
        return self._generate_state_key(probe_rows=self.probe_rows)

    # ------------------------------------------------------------------ set-up
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        if stage == "fit":
            self._wrap_io(trainer)

    def _wrap_io(self, trainer: pl.Trainer) -> None:
        io = trainer.strategy.checkpoint_io
        if "save_checkpoint" in io.__dict__ and getattr(io.__dict__["save_checkpoint"], "_tfdebug", False):
            return
        original = io.save_checkpoint

        def save_checkpoint(checkpoint: dict[str, Any], path: Any, *args: Any, **kwargs: Any) -> Any:
            result = original(checkpoint, path, *args, **kwargs)
            expected = self._expected if self._expected is not None else {}
            self._expected = None
            if not self.reload:  # the dict the strategy just wrote, judged in memory: no file is read back
                self._verified_since_save = True
                self.cover("checkpoint resumable", "verified")
                self.emit(trainer, self._judge(trainer, checkpoint, os.fspath(path), expected), synchronized=False)
                return result
            self._pending_files.append((os.fspath(path), expected))
            self._verify_pending(trainer)
            return result

        save_checkpoint._tfdebug = True  # type: ignore[attr-defined]
        io.save_checkpoint = save_checkpoint
        self._io = io

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self._recording is not None:
            self._recording.done(self)
            self._recording = None
        if self._io is not None:
            self._io.__dict__.pop("save_checkpoint", None)
            self._io = None

    # ------------------------------------------------------------------ probe call and loss
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self._probe_taken or not self.active or not self.reload:
            return  # every step but the first: nothing
        self._probe_taken = True
        if self._probe_call is None:  # (a resumed fit keeps the probe call of its checkpoint)
            self._recording = record_step(trainer, pl_module, batch, self)  # the outermost calls only
            self._probe_of = (batch, batch_idx)

    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: Tensor) -> None:
        self._take_probe_call(trainer, pl_module)

    def _take_probe_call(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """The probe: the first model call of the first batch's real ``training_step`` (:func:`probe_call_of`)."""
        recording, self._recording = self._recording, None
        if recording is None:
            return
        (batch, batch_idx), self._probe_of = self._probe_of, (None, 0)
        try:
            found = probe_call_of(
                recording.calls(), pl_module, batch, batch_idx, batch_rows(trainer, batch), self.probe_rows
            )
        finally:
            recording.done(self)
        if isinstance(found, str):
            self.check_aside(PROBE_CHECK, found)
        else:
            self._probe_call = found

    def _loss_on_probe(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> float | None:
        """The probe replayed (:func:`replay_probe_call`); None when there is none or it cannot be replayed."""
        if self._probe_call is None:
            return None
        value = replay_probe_call(trainer, pl_module, self._probe_call)
        if isinstance(value, str):
            self.check_aside(PROBE_CHECK, value)
            self._probe_call = None
            return None
        return value

    # ------------------------------------------------------------------ save
    def on_save_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        if not self.active:
            return
        callbacks = checkpoint.get("callbacks", {})
        self._expected = expectation(trainer, pl_module, list(callbacks))
        self._resolve_due = True  # every rank runs this hook for every save
        self._verified_since_save = False
        loss = self._loss_on_probe(trainer, pl_module) if self.reload else None
        self._probe_loss, self._probe_loss_step = loss, trainer.global_step
        own = callbacks.get(self.state_key)
        if isinstance(own, dict):  # Lightning collected state_dict() before this hook: add the save-time loss
            own["probe_loss"] = loss
            own["probe_loss_step"] = trainer.global_step
            own["probe_call"] = self._probe_call
        strategy = type(trainer.strategy).__name__
        sharded = "ModelParallel" in strategy or getattr(trainer.strategy, "_state_dict_type", "full") == "sharded"
        if sharded and trainer.is_global_zero:  # the strategy writes the directory itself, without the CheckpointIO
            self._verified_since_save = True
            if self.reload:
                self._sharded_due = True  # its metadata is checked once the save has finished, at the next batch end
            else:
                verdicts = checks.content_problems(checkpoint, self._expected, "(sharded save)")
                self.emit(trainer, verdicts, synchronized=False)

    def _check_sharded(self, trainer: pl.Trainer) -> None:
        """Rank 0, after a sharded save: the distributed-checkpoint directory's metadata must list only shard files
        that exist and hold their items (no tensor is read)."""
        self._sharded_due = False
        callback = trainer.checkpoint_callback
        path = getattr(callback, "_last_checkpoint_saved", "") or getattr(callback, "last_model_path", "")
        if not path or not os.path.isdir(path):
            why = "the sharded checkpoint directory was not found"
            self.emit(trainer, checks.checkpoint_not_checked(path or "(sharded save)", why), synchronized=False)
            return
        verdicts = checks.sharded_problems(read_sharded(path))
        self.emit(trainer, verdicts, synchronized=False)
        if not verdicts:
            self.checked_files.append(path)

    def _verify_pending(self, trainer: pl.Trainer) -> None:
        still = []
        for path, expected in self._pending_files:
            if os.path.isdir(path):  # a sharded directory written through the CheckpointIO
                self.emit(trainer, checks.sharded_problems(read_sharded(path)), synchronized=False)
                self.checked_files.append(path)
            elif os.path.exists(path):
                self.emit(trainer, self._check_file(trainer, path, expected), synchronized=False)
            else:
                still.append((path, expected))  # an asynchronous writer has not finished yet
        self._pending_files = still

    def _check_file(self, trainer: pl.Trainer, path: str, expected: dict[str, Any]) -> list[Verdict]:
        """Open one file this run wrote and judge it against what it must hold (``expected``; empty: written without
        ``on_save_checkpoint``, a weights-only save)."""
        try:
            # weights_only first; a full unpickling only because this run wrote the file itself
            loaded, _ = load_checkpoint(path, written_by_this_run=True)
        except DamagedCheckpoint as damaged:
            return [damaged.verdict]
        except Exception as err:
            return [checks.unreadable_checkpoint(path, err)]
        self._verified_since_save = True
        self.checked_files.append(path)
        self.cover("checkpoint resumable", "verified")
        return self._judge(trainer, loaded, path, expected)

    def _judge(
        self, trainer: pl.Trainer, checkpoint: dict[str, Any], path: str, expected: dict[str, Any]
    ) -> list[Verdict]:
        """A checkpoint's contents against what it must hold; empty ``expected``: written without
        ``on_save_checkpoint``, a weights-only save; a dict without Lightning's ``state_dict`` that did not come
        through ``on_save_checkpoint`` either: another framework's, not judged (recorded once)."""
        if not expected and not isinstance(checkpoint.get("state_dict"), Mapping):
            self.check_aside(
                "resume check of checkpoints saved outside Lightning",
                f"a dict without Lightning's `state_dict` (keys: {', '.join(map(str, list(checkpoint)[:6]))}) went "
                "through the strategy's CheckpointIO without `Trainer.save_checkpoint`, so what it must hold is not "
                "known",
                "save through `Trainer.save_checkpoint` or a `ModelCheckpoint`",
            )
            return []
        if not expected:
            savers = trainer.checkpoint_callbacks
            return [checks.weights_only_checkpoint(path, resumable_savers(savers), self._full_saved, len(savers))]
        self._full_saved = True
        return checks.content_problems(checkpoint, expected, path)

    def _settle(self, trainer: pl.Trainer) -> None:
        """Verify files an asynchronous writer finished, then resolve rank-local findings on every rank together."""
        if self._pending_files:
            self._verify_pending(trainer)
        if self._sharded_due and trainer.is_global_zero:
            self._check_sharded(trainer)
        if not self._resolve_due:
            return
        self._resolve_due = False  # set on every rank by on_save_checkpoint, so all ranks arrive here together
        if trainer.is_global_zero and not self._verified_since_save and not self._pending_files:
            self._verified_since_save = True
            why = "it was written without going through the strategy's CheckpointIO"
            self.emit(trainer, checks.checkpoint_not_checked("(last save)", why), synchronized=False)
        self.resolve_local_findings(trainer)

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._take_probe_call(trainer, pl_module)  # no backward ran through Lightning (a manual step without it)
        if self.active:
            self._settle(trainer)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.active:
            self._settle(trainer)

    def not_reached(self, check: str, step: int | None) -> tuple[str, str | None]:
        return "no checkpoint was saved in this run.", "a `ModelCheckpoint` (or `trainer.save_checkpoint`) in the run"

    # ------------------------------------------------------------------ resume
    def on_load_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        if not self.active:
            return
        self.emit(trainer, resume_checks.load_problems(checkpoint))  # every rank loads the same checkpoint
        if self.reload:
            self._restored = restored_state(checkpoint)  # host sync: one checksum transfer per resume

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        restored, self._restored = self._restored, None
        if not self.active or restored is None:
            return
        live = live_state(trainer, pl_module, restored)  # host sync: one checksum transfer per resume
        verdicts: list[Verdict | None] = [*resume_checks.resume_problems(restored, live, self.weight_rtol)]
        now_loss = None if self._probe_loss is None else self._loss_on_probe(trainer, pl_module)
        if self._probe_loss is not None and now_loss is not None:
            verdicts.append(
                resume_checks.probe_loss_problem(self._probe_loss, now_loss, self._probe_loss_step, self.loss_rtol)
            )
        self.emit(trainer, verdicts, synchronized=False)
        self.resolve_local_findings(trainer)  # every rank resumes, so every rank reaches this point

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        return {
            **super().state_dict(),
            "probe_call": self._probe_call,
            "probe_loss": self._probe_loss,
            "probe_loss_step": self._probe_loss_step,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self._probe_call = state_dict.get("probe_call")  # (an older checkpoint's probe batch is not replayed)
        self._probe_loss = state_dict.get("probe_loss")
        self._probe_loss_step = state_dict.get("probe_loss_step")
