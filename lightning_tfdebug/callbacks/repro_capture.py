"""ReproCapture: records how a run was set up and, when training fails, a bundle that replays the failing step."""

from __future__ import annotations

import contextlib
import os
from typing import Any, Literal

import lightning.pytorch as pl
import torch

from lightning_tfdebug.core.base import DebugCallback, check_choice, check_number
from lightning_tfdebug.core.batch import step_rng_state
from lightning_tfdebug.core.io import write_failures
from lightning_tfdebug.core.step import step_state
from lightning_tfdebug.findings import OnFinding
from lightning_tfdebug.functional.memory_checks import is_out_of_memory
from lightning_tfdebug.functional.repro_checks import bundle_not_written, bundle_written
from lightning_tfdebug.primitives.tensors import DTensor
from lightning_tfdebug.repro.bundles import (
    capture_rng,
    class_path,
    holds_device_tensors,
    host_copy,
    host_rng_moved,
    run_first,
    run_info,
    share_host_copy,
    state_size_bytes,
    write_bundle,
    write_json_atomic,
)
from lightning_tfdebug.repro.replay import describe_exception

_PROBE_STEPS = 4  # the first batches of a fit (and measuring steps) check whether steps draw from Python/NumPy


class ReproCapture(DebugCallback):
    """Writes ``run.json`` at fit start and, on an exception during training, a bundle that replays the failing step.

    Rank 0 writes ``<log_dir>/tfdebug/run.json`` (seeds, versions, git commit, command line, the Trainer's set-up,
    hyper-parameters). On every training batch the callback keeps the batch and the RNG states, host-side with no
    device sync; it runs first among the callbacks, so it holds a batch that another one rejects. When an exception
    leaves ``trainer.fit``, each rank writes ``<log_dir>/tfdebug/repro/step<k>-rank<r>/``: the batch, the RNG states,
    the exception, the run set-up and, up to ``max_state_mb`` and unsharded, the model's, optimizers' and LR
    schedulers' states. Replay it with ``tfdebug replay <bundle> --config <LightningCLI config>`` or
    :func:`lightning_tfdebug.repro.replay`. The guide, ``docs/callbacks/repro_capture.md``, lists the bundle's files.

    Logged keys: none.

    Findings: ``TFD130`` (info) a bundle was written, with its path (for an out-of-memory error while MemoryWatch
    runs, its ``TFD621`` names the bundle instead); ``TFD131`` (warning) the bundle could not be written (the original
    exception still propagates unchanged).

    Args:
        on_finding: accepted for uniformity; ReproCapture's findings never stop or raise (the run is already failing).
        max_state_mb: largest model state (MB, as stored) saved into a bundle; 0 never saves it.
        capture_rng: keep the RNG states of every batch, to replay dropout and other random ops exactly (Python's and
            NumPy's only once a probed batch showed that the training step draws from them).
        capture_exceptions_outside_training: also write a bundle (without a batch) for exceptions raised outside a
            training batch (validation, data loading, hooks).
        copy_batch: ``"auto"`` queues a host copy of each CUDA batch (no host sync; it outlives a device-side assert)
            and keeps CPU batches by reference; ``"always"`` also clones CPU batches (for a ``training_step`` that edits
            its batch in place); ``"never"`` keeps only a reference.

    Raises:
        ValueError: on an argument outside its allowed range.
        TypeError: on a flag that is not a bool.

    Example:
        ```python
        trainer = Trainer(callbacks=[BatchGuard(), ReproCapture()])
        ```

        LightningCLI:

        ```yaml
        trainer:
          callbacks:
            - class_path: lightning_tfdebug.ReproCapture
              init_args:
                max_state_mb: 512
        ```
    """

    def __init__(
        self,
        on_finding: OnFinding = "warn",
        max_state_mb: float = 512.0,
        capture_rng: bool = True,
        capture_exceptions_outside_training: bool = True,
        copy_batch: Literal["auto", "always", "never"] = "auto",
    ) -> None:
        super().__init__(every_n_steps=None, on_finding=on_finding)
        check_number("max_state_mb", max_state_mb, low=0.0)
        for name, value in (
            ("capture_rng", capture_rng),
            ("capture_exceptions_outside_training", capture_exceptions_outside_training),
        ):
            if not isinstance(value, bool):
                raise TypeError(f"`{name}` must be True or False; got {value!r}.")
        check_choice("copy_batch", copy_batch, ("auto", "always", "never"))
        self.copy_batch = copy_batch
        self.max_state_mb = float(max_state_mb)
        self.capture_rng = capture_rng
        self.capture_exceptions_outside_training = capture_exceptions_outside_training
        self.bundles: list[str] = []
        self._batch: Any = None
        self._batch_type: type | None = None  # named (a string) only when a bundle is written
        self._after_step = False  # the step's forward and backward are done; its batch-end hooks are running
        self._batch_idx: int | None = None
        self._step: int | None = None
        self._epoch: int | None = None
        self._rng: dict[str, Any] | None = None
        self._run: dict[str, Any] = {}
        self._host_rng_used = False  # a step drew from Python's or NumPy's global generator: capture them too
        self._probed = 0  # batches checked for that so far
        self._probing = False

    @property
    def repro_dir(self) -> str:
        return os.path.join(self.tfdebug_dir, "repro")

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        if stage != "fit":
            return
        run_first(trainer, self)  # (inside TFDebug, the pack runs first)
        self._run = run_info(trainer, pl_module)  # once per fit: a `git rev-parse` subprocess, no device work
        if trainer.is_global_zero:
            write_json_atomic(os.path.join(self.tfdebug_dir, "run.json"), {**self._run, "log_dir": self._log_dir})

    # ------------------------------------------------------------------ every batch: references only
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._batch_type = type(batch)
        if self.copy_batch == "always" or (self.copy_batch == "auto" and holds_device_tensors(batch)):
            self._batch = host_copy(batch)  # CUDA tensors: queued non-blocking copies into pinned memory, no sync
            share_host_copy(trainer, batch, self._batch)  # BatchGuard reads it after a CUDA device-side assert
        else:
            self._batch = batch  # a reference: the copy to the host happens only if an exception comes
        self._batch_idx = batch_idx
        self._step = trainer.global_step
        self._epoch = trainer.current_epoch
        self._after_step = False
        if self.capture_rng:
            # torch's generators (dropout) every batch: small tensors copied as they are, no device sync. Python's and
            # NumPy's cost 10-40 us to convert, so they are read only once a probed batch showed the step uses them.
            self._probing = not self._host_rng_used and (self._probed < _PROBE_STEPS or self.should_measure(trainer))
            cpu = step_rng_state(trainer, batch, batch_idx)  # the batch's one copy, shared with NaNFirstFrame
            self._rng = capture_rng(host=self._host_rng_used or self._probing, cpu=cpu)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        # Keep the batch until the next one, validation or the end of the epoch: ReproCapture runs first, so a later
        # callback's `on_train_batch_end` (a NaN check that raises) still finds this step's batch in the bundle.
        self._after_step = True
        if self._probing and self._rng is not None:
            self._probing = False
            self._probed += 1
            self._host_rng_used = host_rng_moved(self._rng)  # host reads of the generators, on probed batches only

    def _forget_batch(self) -> None:
        self._batch, self._rng, self._after_step = None, None, False

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._forget_batch()

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._forget_batch()

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._forget_batch()

    # ------------------------------------------------------------------ failure
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        if not isinstance(exception, Exception):  # KeyboardInterrupt, SystemExit: not a bug to replay
            return
        in_batch = self._batch is not None
        if not in_batch and not self.capture_exceptions_outside_training:
            return
        try:
            path = self._write(trainer, pl_module, exception)
            if path is None:  # the file system refused; the writer warned once and recorded why
                refused = write_failures()
                raise OSError(refused[-1].error if refused else f"the file system refused {self.repro_dir}")
        except Exception as err:  # never mask the exception that is propagating
            error = f"{type(err).__name__}: {err}"
            key = f"{trainer.global_step}:{id(exception)}"
            verdict = bundle_not_written(type(exception).__name__, error, step=trainer.global_step, key=key)
            self.emit(trainer, verdict, synchronized=False)
            return
        finally:
            after_step = self._after_step
            self._forget_batch()
        self.bundles.append(path)
        shared = step_state(trainer)
        shared.repro_bundle = (id(exception), path)
        if shared.explains_oom and is_out_of_memory(exception):
            return  # MemoryWatch's error finding explains it and names this bundle: one line for one event
        verdict = bundle_written(
            path,
            type(exception).__name__,
            step=self._step if in_batch else trainer.global_step,
            rank=trainer.global_rank,
            in_batch=in_batch,
            batch_saved=os.path.exists(os.path.join(path, "batch.pt")),
            after_step=after_step,
        )
        self.emit(trainer, verdict, synchronized=False)

    def _write(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> str | None:
        in_batch = self._batch is not None
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            # Host sync, on failure only: let the queued non-blocking batch copy finish before it is read. After a
            # device-side assert this raises; the copy queued before the failing kernel has completed by then.
            with contextlib.suppress(Exception):
                torch.cuda.current_stream().synchronize()
        step = self._step if in_batch and self._step is not None else trainer.global_step
        meta: dict[str, Any] = {
            "batch_idx": self._batch_idx if in_batch else None,
            "epoch": self._epoch if in_batch else trainer.current_epoch,
            "world_size": trainer.world_size,
            "exception": describe_exception(exception),
            "in_training_batch": in_batch,
            "after_step": in_batch and self._after_step,
            "batch_type": class_path(self._batch_type) if in_batch and self._batch_type is not None else None,
            "run": self._run or run_info(trainer, pl_module),
        }
        model_state, reason = self._model_state(pl_module)
        meta["model_state"] = {
            "saved": model_state is not None,
            "reason": reason,
            "checkpoint": self._last_checkpoint(trainer),
        }
        training_state, training_reason = self._training_state(trainer, model_state is not None)
        meta["training_state"] = {"saved": training_state is not None, "reason": training_reason}
        return write_bundle(
            self.repro_dir,
            step=step,
            rank=trainer.global_rank,
            meta=meta,
            batch=self._batch if in_batch else None,
            rng=self._rng,
            model_state=model_state,
            training_state=training_state,
        )

    def _model_state(self, pl_module: pl.LightningModule) -> tuple[dict[str, Any] | None, str]:
        if self.max_state_mb <= 0:
            return None, "max_state_mb is 0"
        state = pl_module.state_dict()
        if any(isinstance(v, DTensor) for v in state.values()):
            # gathering shards would need a collective, which a failing rank cannot rely on
            return None, "the model is sharded (DTensor parameters); see the last checkpoint"
        size = state_size_bytes(state)
        if size > self.max_state_mb * 2**20:
            return None, f"state of {size / 2**20:.0f} MB exceeds max_state_mb={self.max_state_mb:g}"
        return state, f"{size / 2**20:.1f} MB"

    def _training_state(self, trainer: pl.Trainer, model_saved: bool) -> tuple[dict[str, Any] | None, str]:
        """The optimizers' and LR schedulers' states, saved when the model state is (same size and sharding limits):
        a replay that restores Adam's moments onto other weights would not be the failing step either."""
        if not model_saved:
            return None, "saved only with the model state"
        optimizers = [opt.state_dict() for opt in trainer.optimizers]
        tensors = [v for opt in optimizers for s in opt["state"].values() for v in s.values() if torch.is_tensor(v)]
        if any(isinstance(v, DTensor) for v in tensors):
            return None, "the optimizer state is sharded (DTensor); see the last checkpoint"
        size = sum(v.numel() * v.element_size() for v in tensors)
        if size > self.max_state_mb * 2**20:
            return None, f"optimizer state of {size / 2**20:.0f} MB exceeds max_state_mb={self.max_state_mb:g}"
        schedulers = [config.scheduler.state_dict() for config in trainer.lr_scheduler_configs]
        return {"optimizers": optimizers, "lr_schedulers": schedulers}, f"{size / 2**20:.1f} MB"

    @staticmethod
    def _last_checkpoint(trainer: pl.Trainer) -> str | None:
        for cb in trainer.checkpoint_callbacks:
            path = getattr(cb, "last_model_path", "") or getattr(cb, "best_model_path", "")
            if path:
                return os.path.abspath(path)
        return os.path.abspath(trainer.ckpt_path) if trainer.ckpt_path else None

    # ------------------------------------------------------------------ state
    @property
    def state_key(self) -> str:
        return self._generate_state_key(max_state_mb=self.max_state_mb)

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "bundles": list(self.bundles), "host_rng_used": self._host_rng_used}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self.bundles = list(state_dict.get("bundles", []))
        self._host_rng_used = bool(state_dict.get("host_rng_used", False))
