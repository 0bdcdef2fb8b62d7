"""MemoryWatch: out of memory foreseen from the batch lengths before it happens, and explained when it does."""

from __future__ import annotations

import dataclasses
import os
import traceback
import warnings
from collections.abc import Mapping
from typing import Any, ClassVar

import lightning.pytorch as pl
import torch

from lightning_tfdebug.core import device_memory
from lightning_tfdebug.core.base import DebugCallback, TFDebugWarning, check_number
from lightning_tfdebug.core.batch import step_batch
from lightning_tfdebug.core.model import find_context_length
from lightning_tfdebug.core.reduction import Reduced
from lightning_tfdebug.core.step import step_state
from lightning_tfdebug.findings import OnFinding
from lightning_tfdebug.functional import memory_checks as checks
from lightning_tfdebug.functional.memory import training_state_split
from lightning_tfdebug.functional.memory_checks import COVERAGE as COVERAGE_ROWS
from lightning_tfdebug.primitives.batch import BatchKeys, read_batch
from lightning_tfdebug.primitives.keys import Key

_DEVICE_NAMES = {"cuda": "device", "cpu": "process"}


def _shape(fields: Any) -> tuple[int, int]:
    """``(rows, padded width)`` of a batch's token ids (else its mask), from the shape alone; ``(0, 0)`` if neither."""
    source = fields.input_ids if isinstance(fields.input_ids, torch.Tensor) else fields.attention_mask
    if not isinstance(source, torch.Tensor) or source.ndim == 0:
        return 0, 0
    return (int(source.shape[0]), int(source.shape[-1])) if source.ndim >= 2 else (1, int(source.shape[0]))


class MemoryWatch(DebugCallback):
    """Foresees an out-of-memory failure from the lengths the data can produce, and explains one when it happens.

    Every training batch: its shape (rows x padded width, host metadata of the batch view the pack reads once per
    step). Measuring steps: the memory held (CUDA: the allocator's peak so far, against the widest batch so far; CPU:
    the resident set after the forward, against that batch) is fitted against token positions, and the fit is taken to
    the longest batch the data can produce (the most rows seen x the model's context limit, unless the batches show a
    shorter cap). When that batch would not fit in what the process may use, ``TFD620`` says so before the run fails,
    naming the ranks. On an out-of-memory error (any phase, any rank), ``TFD621`` sets the failing batch beside the
    run's median and longest, splits the memory of the last measuring step into weights, gradients, optimizer state
    and the rest, and ranks the remedies; with ``record_history`` on CUDA the allocator's history goes into the repro
    bundle with the command that opens it. Details: ``docs/callbacks/memory_watch.md``.

    Logged keys: :attr:`KEYS`. Findings: ``TFD620`` (warning), ``TFD621`` (error), the rules of
    :mod:`lightning_tfdebug.functional.memory_checks`.

    Args:
        every_n_steps: measure every this many optimizer steps; default: the Trainer's ``log_every_n_steps``.
        on_finding: ``"warn"``, ``"stop"`` or ``"raise"`` for the forecast (the explanation comes as the run fails).
        input_key: where the token ids are (a key, a dotted path, a tuple index); ``None`` finds them by name.
        mask_key: where the attention mask is, when the batch has no token ids; likewise.
        max_length: the longest row the model accepts; ``None`` reads the context limit from the model.
        memory_limit_bytes: the memory the process may use, in bytes; ``None`` reads it (CUDA: the device's free memory
            plus this process's reserved; CPU: the cgroup limit or the machine's memory, shared by the processes of
            the node).
        record_history: on CUDA, record the allocator's history from the start of fit and write its snapshot into
            the repro bundle on an out-of-memory error (``tfdebug check`` turns it on).

    Raises:
        ValueError: on an argument outside its allowed range.
        TypeError: on a flag that is not a bool.

    Example:
        ```python
        trainer = Trainer(callbacks=[MemoryWatch(record_history=True)])
        ```

        LightningCLI:

        ```yaml
        trainer:
          callbacks:
            - class_path: lightning_tfdebug.MemoryWatch
              init_args:
                every_n_steps: 50
                record_history: false
        ```
    """

    COVERAGE: ClassVar[Mapping[str, tuple[str, ...]]] = COVERAGE_ROWS  # declared beside the rules
    COVERAGE_WATCHED: ClassVar[frozenset[str]] = frozenset(COVERAGE)  # verified by watching the whole fit

    KEYS: ClassVar[tuple[Key, ...]] = (
        Key("memory_watch/held_gib", "memory the widest measured batch held (worst rank)", "GiB", "memory forecast"),
        Key(
            "memory_watch/forecast_gib",
            "memory the longest batch the data can produce would hold, on the fit (worst rank)",
            "GiB",
            "memory forecast",
        ),
        Key("memory_watch/limit_gib", "memory the process may use (smallest rank)", "GiB", "memory forecast"),
    )
    every_batch_hooks: ClassVar[frozenset[str]] = frozenset({"on_train_batch_start"})

    def __init__(
        self,
        every_n_steps: int | None = None,
        on_finding: OnFinding = "warn",
        input_key: str | int | None = None,
        mask_key: str | int | None = None,
        max_length: int | None = None,
        memory_limit_bytes: int | None = None,
        record_history: bool = False,
    ) -> None:
        super().__init__(every_n_steps=every_n_steps, on_finding=on_finding)
        check_number("max_length", max_length, low=1, integer=True, optional=True)
        check_number("memory_limit_bytes", memory_limit_bytes, low=1, integer=True, optional=True)
        if not isinstance(record_history, bool):
            raise TypeError(f"`record_history` must be True or False; got {record_history!r}.")
        self._keys = BatchKeys(input_key, mask_key)  # raises a TypeError naming a key that is not one
        self.input_key, self.mask_key, self.max_length = input_key, mask_key, max_length
        self.memory_limit_bytes, self.record_history = memory_limit_bytes, record_history
        self._tally = checks.LengthTally()
        self._points: dict[int, float] = {}  # token positions -> the most memory a measured batch of them held
        self._context: int | None = max_length
        self._device = torch.device("cpu")
        self._forecast = True  # False where the backend has no memory statistics (Coverage says why)
        self._recording = False
        self._base_start = float("nan")  # memory held before the first batch (the weights)
        self._last_split: checks.MemorySplit | None = None
        self._last_step: int | None = None
        self._train_batch: tuple[Any, int, int, int, int, int] | None = None  # batch, idx, step, epoch, rows, width
        self._eval_batch: tuple[Any, int] | None = None
        self._step_at_start = -1
        self._held_cpu = float("nan")
        self._cpu_limit = 0.0
        self._longest_before = 0

    @property
    def state_key(self) -> str:
        return self._generate_state_key(every_n_steps=self.every_n_steps, input_key=self.input_key)

    # ------------------------------------------------------------------ set-up
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        if stage != "fit":
            return
        step_state(trainer).explains_oom = True  # ReproCapture leaves the out-of-memory line to TFD621
        # a new fit: its own lengths (a resumed fit loads them after set-up) and its own memory readings
        self._tally, self._points, self._last_split = checks.LengthTally(), {}, None
        self._device = trainer.strategy.root_device
        if self.max_length is None:
            self._context = find_context_length(pl_module)[0]
        self._forecast = self._device.type in device_memory.READABLE
        if self._device.type == "cpu":  # the node's memory, shared by its processes (cgroup files, once per fit)
            self._cpu_limit = device_memory.cpu_limit_bytes() / max(1, int(getattr(trainer, "num_devices", 1) or 1))
        if not self._forecast:
            self.check_aside(
                checks.FORECAST_CHECK,
                f"the {self._device.type} backend has no memory statistics MemoryWatch can read (CUDA and CPU only)",
            )
        if self.record_history and self._device.type == "cuda" and not self._recording:
            self._recording = device_memory.start_history()

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._forecast:
            self._base_start = device_memory.held_now(self._device)  # the weights, before any batch

    def busy_at(self, step: int) -> bool:
        return self._forecast and step % self._interval == 0

    def declares_at(self, step: int, stepped: bool) -> bool:
        """It declares its row at the end of every measuring step's last batch (cadence from ``global_step``)."""
        return self._forecast and stepped and step % self._interval == 0

    # ------------------------------------------------------------------ every batch: its shape (host metadata)
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if trainer.sanity_checking:
            return
        step = trainer.global_step
        rows, width = _shape(step_batch(trainer, batch, self._keys).fields)  # the step's shared view of the batch
        self._longest_before = self._tally.most_positions
        if rows:
            self._tally.add(rows, width)
        self._train_batch = (batch, batch_idx, step, trainer.current_epoch, rows, width)  # a reference, no copy
        self._step_at_start = step

    # ------------------------------------------------------------------ measuring steps
    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor) -> None:
        if self._device.type == "cpu" and self.should_measure(trainer) and self._forecast:
            self._held_cpu = device_memory.resident_bytes()  # the activations are held now: one /proc read

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        step = self._step_at_start
        if trainer.global_step == step or not self._forecast or step % self._interval or not self.active:
            return  # the optimizer did not step (accumulating), or not a measuring step
        reading = self._reading(trainer)
        weights, gradients, optimizer = training_state_split(pl_module.parameters(), trainer.optimizers)
        self._last_split = checks.MemorySplit(weights, gradients, optimizer, reading.held, reading.total)
        self._last_step = step
        rows, width = (self._train_batch or (None,) * 6)[4:6]
        positions = self._tally.most_positions if self._device.type == "cuda" else (rows or 0) * (width or 0)
        if step >= 1 and positions and reading.held == reading.held:  # from step 1: the optimizer state exists
            self._points[positions] = max(reading.held, self._points.get(positions, 0.0))
        base = self._base_start + gradients + optimizer if self._base_start == self._base_start else None
        fit = checks.fit_memory(sorted(self._points.items()), base)
        row = checks.forecast_row(fit, self._tally, self._context, reading.limit)
        # every rank's row, into the step's one reduction over ranks (the pack's shared collective)
        self.reduce_then(
            trainer, lambda reduced: self._conclude(trainer, reduced, step), self._device, rows=dataclasses.asdict(row)
        )

    def _reading(self, trainer: pl.Trainer) -> device_memory.Reading:
        if self._device.type == "cuda":
            reading = device_memory.cuda_reading(self._device)  # allocator bookkeeping and a driver query, no sync
        else:  # the resident set read after the forward; the host's limit read once, at set-up
            reading = device_memory.Reading(self._held_cpu, self._cpu_limit, self._cpu_limit)
        if self.memory_limit_bytes is not None:
            reading = reading._replace(limit=float(self.memory_limit_bytes), total=float(self.memory_limit_bytes))
        return reading

    def _conclude(self, trainer: pl.Trainer, reduced: Reduced, step: int) -> None:
        # host sync: the one of this measuring step
        rows = [checks.ForecastRow(**r) for r in reduced.host().per_rank()]
        forecasts = [r for r in rows if r.forecast > 0]
        metrics = {"memory_watch/limit_gib": min(r.limit for r in rows) / checks.GIB}
        if forecasts:
            metrics["memory_watch/forecast_gib"] = max(r.forecast for r in forecasts) / checks.GIB
            metrics["memory_watch/held_gib"] = max(r.longest_held for r in forecasts) / checks.GIB
        self.log_scalars(trainer, metrics, step=step)
        self.emit(trainer, checks.forecast_verdict(rows, _DEVICE_NAMES.get(self._device.type, "device"), step))

    # ------------------------------------------------------------------ evaluation batches: a reference only
    def on_validation_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, *args: Any):
        self._eval_batch = (batch, int(args[0]) if args else 0)

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._eval_batch = None

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._train_batch = None

    # ------------------------------------------------------------------ failure
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        if not checks.is_out_of_memory(exception):
            return
        try:
            self._explain(trainer, pl_module, exception)
        except Exception as err:  # never mask the exception that is propagating, nor end the other ranks' run
            text = f"MemoryWatch could not explain the {type(exception).__name__}: {type(err).__name__}: {err}"
            warnings.warn(text, TFDebugWarning, stacklevel=2)

    def _explain(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        names = [frame.name for frame in traceback.extract_tb(exception.__traceback__)]
        phase = checks.failure_phase(names, self._phase_of(trainer))
        batch = self._failing_batch(trainer, phase)
        split, when = self._split_at_failure(trainer, pl_module)
        device = _DEVICE_NAMES.get(self._device.type, "device")
        extra = device_memory.at_failure(self._device) + self._bundle_text(trainer, exception)
        verdict = checks.oom_verdict(
            batch, self._tally, split, rank=trainer.global_rank, device=device, when=when, extra=extra
        )
        self.emit(trainer, verdict, synchronized=False)  # rank-local, written to this rank's file; never raised here

    @staticmethod
    def _phase_of(trainer: pl.Trainer) -> str:
        if trainer.sanity_checking:
            return "the sanity check (validation)"
        if trainer.validating or getattr(trainer.state.stage, "value", "") == "validate":
            return "validation"
        return "the training step" if trainer.training else "the run"

    def _failing_batch(self, trainer: pl.Trainer, phase: str) -> checks.FailingBatch:
        if phase in ("validation", "the sanity check (validation)") and self._eval_batch is not None:
            batch, idx = self._eval_batch
            rows, width = _shape(read_batch(batch, self._keys))  # on failure only: host metadata
            where = f"validation batch {idx} (step {trainer.global_step})"
            return checks.FailingBatch(rows, width, phase, where, self._tally.most_positions, self._tally.batches)
        if self._train_batch is None:
            return checks.FailingBatch(0, 0, phase, f"step {trainer.global_step} (no training batch in flight)")
        _, idx, step, epoch, rows, width = self._train_batch
        where = f"batch {idx} of epoch {epoch} (step {step})"
        return checks.FailingBatch(rows, width, phase, where, self._longest_before, self._tally.batches - bool(rows))

    def _split_at_failure(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> tuple[checks.MemorySplit, str]:
        if self._last_split is not None:
            return self._last_split, f"at the last measuring step ({self._last_step})"
        # no measuring step before the failure: the training state from the parameter counts alone
        weights, gradients, optimizer = training_state_split(pl_module.parameters(), trainer.optimizers)
        total = float(self.memory_limit_bytes or 0) or self._total()
        return checks.MemorySplit(weights, gradients, optimizer, float("nan"), total), "from the parameter counts"

    def _total(self) -> float:
        try:
            if self._device.type == "cuda":
                return float(torch.cuda.get_device_properties(self._device).total_memory)
            return device_memory.cpu_limit_bytes() if self._device.type == "cpu" else float("nan")
        except Exception:
            return float("nan")

    def _bundle_text(self, trainer: pl.Trainer, exception: BaseException) -> str:
        """The repro bundle ReproCapture wrote for this failure, and the memory snapshot written into it."""
        shared = step_state(trainer).repro_bundle
        bundle = shared[1] if shared is not None and shared[0] == id(exception) else None
        text = ""
        if self._recording:
            where = bundle or os.path.join(self.tfdebug_dir, f"memory-step{trainer.global_step}-rank{self._rank}")
            path = device_memory.dump_history(where)
            if path is not None:
                text += f" Memory history: {path}; open it with {device_memory.viewer_command(path)}."
        if bundle is not None:
            text += f" Repro bundle: {bundle} (replay: python -m lightning_tfdebug replay {bundle} --config <config>)."
        return text

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self._recording:
            device_memory.stop_history()
            self._recording = False
        self._train_batch = self._eval_batch = None

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        # the lengths seen are the data's and carry over a resume; the memory readings are this process's and do not
        return {**super().state_dict(), "lengths": self._tally.state()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self._tally = checks.LengthTally.load(state_dict.get("lengths"))
