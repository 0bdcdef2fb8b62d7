"""ThroughputMonitor: real tokens per second over all ranks, step time, padding, data-loading stalls, MFU, memory."""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict
from functools import partial
from typing import Any, ClassVar

import lightning.pytorch as pl
import torch

from lightning_tfdebug.core.base import DebugCallback, check_number
from lightning_tfdebug.core.batch import step_batch
from lightning_tfdebug.core.host import CompileWatch, CpuWindow, device_peak_flops, memory_reading, reference_work_ms
from lightning_tfdebug.core.model import import_object
from lightning_tfdebug.core.profiling import FlopCount, StepProfiler, check_profile_steps
from lightning_tfdebug.core.reduction import Reduced, row_fields
from lightning_tfdebug.core.timing import FetchTimer, StepClock, fetch_timer
from lightning_tfdebug.findings import OnFinding
from lightning_tfdebug.functional import throughput_checks
from lightning_tfdebug.functional.throughput import MachineLoad, StepTimes, WindowCounts, batch_counts
from lightning_tfdebug.functional.throughput_checks import COVERAGE as COVERAGE_ROWS
from lightning_tfdebug.functional.throughput_checks import ThroughputDiagnosis, ThroughputRow, throughput_metrics
from lightning_tfdebug.primitives.batch import IGNORE_INDEX, BatchKeys
from lightning_tfdebug.primitives.keys import Key


def resolve_length_fn(length_fn: str | Callable[[Any], Any] | None) -> Callable[[Any], Any] | None:
    """Import ``"package.module.function"`` (or ``"package.module:function"``); callables pass through."""
    if length_fn is None or callable(length_fn):
        return length_fn
    if not isinstance(length_fn, str) or not length_fn.strip():
        raise TypeError(f"`length_fn` must be an import path 'module.function', a callable or None; got {length_fn!r}.")
    try:
        fn = import_object(length_fn)
    except (ImportError, AttributeError) as err:
        raise ValueError(f"`length_fn` {length_fn!r} could not be imported: {err}.") from err
    except ValueError:  # no module part: not an import path
        fn = None
    if not callable(fn):
        raise ValueError(f"`length_fn` must name a function as 'module.function'; got {length_fn!r}.")
    return fn


class ThroughputMonitor(DebugCallback):
    r"""Measures how fast training really goes, over all ranks, and says why it is slow.

    Counts real (non-padding) tokens of every micro-batch on every rank and the wait for each batch; on measuring
    steps one row per rank goes into the step's one reduction over ranks, so throughput is the sum over ranks. No
    device sync on other steps: step times come from CUDA events (host clock on CPU).

    Logged keys: :attr:`KEYS`, tabled in ``docs/callbacks/throughput_monitor.md``. Findings (``docs/findings.md``):
    ``TFD601`` data-loading bound, ``TFD602`` padding waste, ``TFD603`` step time regressed against the early steps,
    ``TFD604`` memory close to capacity, ``TFD605`` (info) the machine got slower, not the run, ``TFD606``
    ``torch.compile`` still compiling, ``TFD607`` its recompile limit hit.

    Args:
        every_n_steps: measure when ``global_step % every_n_steps == 0``; default: the Trainer's
            ``log_every_n_steps``. Throughput covers every step since the previous measurement.
        on_finding: ``"warn"``, ``"stop"`` or ``"raise"`` (see :class:`~lightning_tfdebug.DebugCallback`).
        window: number of recent optimizer steps the median step time is taken over.
        length_fn: import path (``"my_pkg.data.count_tokens"``) or callable returning the number of real tokens of
            a batch (an int or a device tensor). Default: the attention mask's non-zero entries (counted once per
            step for the whole pack, on the device), else the size of the ids.
        peak_flops: peak FLOP/s of one device for MFU; default: looked up from the device name and precision in
            Lightning's table and ours (CUDA only; on CPU no MFU is logged unless this is given).
        measure_flops: count model FLOPs once (with ``torch.utils.flop_counter.FlopCounterMode`` around one real
            training step, step 1) when a peak is known.
        wait_threshold: ``TFD601`` when the data-loading wait exceeds this share of wall time ...
        padding_threshold: ``TFD602`` when padding exceeds this share of token positions ...
        regression_factor: ``TFD603`` when the median step time exceeds this multiple of the early steps' median ...
        patience: ... for this many measurements in a row.
        skip_steps: optimizer steps ignored at the start (warm-up, compilation) before the early window begins.
        baseline_steps: optimizer steps forming the early window ``TFD603`` compares against.
        memory_threshold: ``TFD604`` when peak memory exceeds this share of the device's (or machine's) capacity.
        profile_steps: ``[start, stop]``: run ``torch.profiler`` over optimizer steps ``start <= step < stop`` and
            write a trace and a table of the top operators to ``<log_dir>/tfdebug/profile/``.
        profile_row_limit: rows of the top-operators table.
        input_key: where the batch's token ids are, as for every callback of the pack
            (:mod:`lightning_tfdebug.core.batch`); ``None`` finds them by their usual names (``input_ids``,
            ``attention_mask`` ...) or, in a tuple batch, by position. Dict, tuple, dataclass and Hugging Face
            ``BatchEncoding`` batches are read alike.
        mask_key: where the attention mask (1 = real token) is; given and found as ``input_key``.
        labels_key: where the labels are; given and found as ``input_key``.
        ignore_index: the label value the loss ignores; ``None`` is PyTorch's and Hugging Face's -100.

    Raises:
        ValueError: on an argument outside its allowed range.

    Example:
        ```python
        trainer = Trainer(callbacks=[ThroughputMonitor(every_n_steps=50, profile_steps=[100, 105])])
        ```

        LightningCLI:

        ```yaml
        trainer:
          callbacks:
            - class_path: lightning_tfdebug.ThroughputMonitor
              init_args:
                every_n_steps: 50
                profile_steps: [100, 105]
        ```
    """

    COVERAGE: ClassVar[Mapping[str, tuple[str, ...]]] = COVERAGE_ROWS  # declared beside the rules
    COVERAGE_WATCHED: ClassVar[frozenset[str]] = frozenset(COVERAGE)  # verified by watching the whole fit

    KEYS: ClassVar[tuple[Key, ...]] = throughput_checks.KEYS  # what `throughput_metrics` computes, declared beside it

    def __init__(
        self,
        every_n_steps: int | None = None,
        on_finding: OnFinding = "warn",
        window: int = 50,
        length_fn: str | Callable[[Any], Any] | None = None,
        peak_flops: float | None = None,
        measure_flops: bool = True,
        wait_threshold: float = 0.2,
        padding_threshold: float = 0.3,
        regression_factor: float = 1.5,
        patience: int = 3,
        skip_steps: int = 5,
        baseline_steps: int = 20,
        memory_threshold: float = 0.92,
        profile_steps: tuple[int, int] | None = None,
        profile_row_limit: int = 25,
        input_key: str | int | None = None,
        mask_key: str | int | None = None,
        labels_key: str | int | None = None,
        ignore_index: int | None = None,
    ) -> None:
        super().__init__(every_n_steps=every_n_steps, on_finding=on_finding)
        check_number("ignore_index", ignore_index, integer=True, optional=True)
        # raises a TypeError naming the argument when a key is not a string, a tuple position or None
        self._batch_keys = BatchKeys(
            input_key, mask_key, labels_key, ignore_index=IGNORE_INDEX if ignore_index is None else ignore_index
        )
        self.input_key, self.mask_key, self.labels_key = input_key, mask_key, labels_key
        self.ignore_index = self._batch_keys.ignore_index
        check_number("window", window, low=1, integer=True)
        check_number("peak_flops", peak_flops, low=0, low_inclusive=False, optional=True)
        for name, share in (("wait_threshold", wait_threshold), ("padding_threshold", padding_threshold)):
            check_number(name, share, low=0.0, high=1.0, low_inclusive=False)
        check_number("regression_factor", regression_factor, low=1.0, low_inclusive=False)
        check_number("patience", patience, low=1, integer=True)
        check_number("skip_steps", skip_steps, low=0, integer=True)
        check_number("baseline_steps", baseline_steps, low=1, integer=True)
        check_number("memory_threshold", memory_threshold, low=0.0, high=1.0, low_inclusive=False)
        check_number("profile_row_limit", profile_row_limit, low=1, integer=True)
        check_profile_steps(profile_steps)
        if not isinstance(measure_flops, bool):
            raise TypeError(f"`measure_flops` must be True or False; got {measure_flops!r}.")
        self.window, self.length_fn, self._length_fn = window, length_fn, resolve_length_fn(length_fn)
        self.peak_flops = float(peak_flops) if peak_flops is not None else None
        self.measure_flops = measure_flops
        self.wait_threshold, self.padding_threshold = float(wait_threshold), float(padding_threshold)
        self.regression_factor, self.patience = float(regression_factor), patience
        self.skip_steps, self.baseline_steps = skip_steps, baseline_steps
        self.memory_threshold = float(memory_threshold)
        self.profile_steps = tuple(profile_steps) if profile_steps is not None else None
        self.profile_row_limit = profile_row_limit
        thresholds = (self.wait_threshold, self.padding_threshold, self.regression_factor, self.memory_threshold)
        self._diagnosis = ThroughputDiagnosis(*thresholds, patience)
        self._times = StepTimes(window, skip_steps, baseline_steps)  # the median's steps and the early window's
        self._load = MachineLoad(window)  # the machine's load during the early window and over the median's steps
        self.flops_per_token: float | None = None  # model FLOPs per computed token position (measured once)
        self._peak: float | None = None
        self._reset_timing()

    @property
    def state_key(self) -> str:
        return self._generate_state_key(every_n_steps=self.every_n_steps)

    def _reset_timing(self) -> None:
        self._clock: StepClock | None = None
        self._window_start: float | None = None  # host time the current measuring window began
        self._prev_end: float | None = None  # host time the previous batch ended (after this callback's work)
        self._wait_s = 0.0
        self._counts = WindowCounts()  # the window's real tokens (on the device, no sync), positions and samples
        self._step_marks: list[Any] = []  # clock marks at optimizer-step ends since the last measurement
        self._last_mark: Any = None
        self._pause_ms = 0.0  # validation time to take off the next step time
        self._step_at_start = -1
        self._measuring = False
        self._flops = FlopCount()
        self._profiler = StepProfiler(self.profile_steps, self.profile_row_limit)
        self._val_start: float | None = None
        self._timer: FetchTimer | None = None
        self._fetch_seen: float | None = None  # the fetch timer's total at the start of the window
        self._cpu = CpuWindow()  # this process's CPU time and run-queue wait over the current window
        self._load.windows.clear()  # the windows since the median's oldest step: this fit's
        self._compile = CompileWatch()  # torch.compile's graphs and recompile-limit hits during this fit
        self._diagnosis.graphs_prev = math.nan

    # ------------------------------------------------------------------ set-up
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        self._reset_timing()
        # the device's name and the precision in use: host reads, once
        self._peak = self.peak_flops or device_peak_flops(trainer.strategy.root_device, trainer.precision)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._clock = StepClock(trainer.strategy.root_device)
        self._compile.start()  # torch.compile's counters are process-wide: this fit's starting point
        self._diagnosis.graphs_prev = math.nan

    # ------------------------------------------------------------------ every batch (hot path: host clock reads,
    # one device reduction of the attention mask, no sync, no collective)
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if not self.active or self._clock is None:
            return
        now = time.perf_counter()
        timer = fetch_timer(trainer)
        if timer is not None:
            if self._fetch_seen is None:
                self._fetch_seen = timer.total_s
        elif self._prev_end is not None:  # no fetcher hooks: the whole gap between batches counts as waiting
            self._wait_s += now - self._prev_end
        self._timer = timer
        if self._window_start is None:
            self._window_start = now
            self._last_mark = self._clock.mark()
            self._cpu.start()
        step = trainer.global_step
        first_micro_batch = step != self._step_at_start
        self._step_at_start = step
        if first_micro_batch:
            self._measuring = self.should_measure(trainer)
            self._profiler.maybe_start(step, trainer.strategy.root_device.type == "cuda")
        view = step_batch(trainer, batch, self._batch_keys)  # the step's shared reading and token count
        tokens, positions, samples = batch_counts(view, self._length_fn)
        # The padding span (how much shorter the batch would be, padded only to its longest row) is a ratio sampled
        # on the measuring step's micro-batches, not 6 kernels on every batch: TFD602's trim factor is a property of
        # the data pipeline (collation, fixed length), the same on every batch it builds.
        self._counts.add(tokens, positions, samples, view.attention_mask, sample=self._measuring)
        wanted = self.measure_flops and self.flops_per_token is None and self._peak is not None
        if wanted and not self._flops.counting and step >= 1 and first_micro_batch and positions > 0:
            self._flops.start(positions)  # this one real micro-batch's matmul/attention FLOPs: forward, backward, step

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if not self.active or self._clock is None:
            return
        now = time.perf_counter()
        self._stop_flop_count()
        stepped = trainer.global_step != self._step_at_start
        if stepped:
            mark = self._clock.mark()
            self._step_marks.append(mark)
            self._times.seen += 1
            self._stop_profiler(trainer, self._step_at_start)
            if self._measuring:
                self._clock.wait(mark)  # CUDA: one sync, on measuring steps only, so the window ends on the device
                now = time.perf_counter()
                with torch.no_grad():
                    self._measure(trainer, now)
                self._window_start = now
                self._cpu.start()
        self._prev_end = time.perf_counter()

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not trainer.sanity_checking:
            self._val_start = time.perf_counter()

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._val_start is None:
            return
        paused = time.perf_counter() - self._val_start
        self._val_start = None
        # validation is not training time: shift the clocks so neither the wait nor the window counts it
        if self._prev_end is not None:
            self._prev_end += paused
        if self._window_start is not None:
            self._window_start += paused
        self._pause_ms += paused * 1e3

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self.teardown(trainer, pl_module, "fit")

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._stop_flop_count()
        self._stop_profiler(trainer, None)
        self._timer = None  # it wraps the fit loop's data fetcher: no reference to the Trainer outlives the fit

    def _stop_flop_count(self) -> None:
        per_position = self._flops.stop()
        if per_position is not None:
            self.flops_per_token = per_position

    def _stop_profiler(self, trainer: pl.Trainer, finished_step: int | None) -> None:
        out = os.path.join(self.tfdebug_dir, "profile")
        self._profiler.maybe_stop(finished_step, out, trainer.global_rank, trainer.strategy.root_device.type == "cuda")

    # ------------------------------------------------------------------ measuring
    def declares_at(self, step: int, stepped: bool) -> bool:
        """It declares its row at the end of every measuring step's last batch (cadence from ``global_step``)."""
        return stepped and step % self._interval == 0

    def _step_times_since_last(self) -> list[float]:
        clock = self._clock
        assert clock is not None
        times = []
        previous = self._last_mark
        for mark in self._step_marks:
            if previous is not None:
                times.append(max(0.0, clock.elapsed_ms(previous, mark) - self._pause_ms))
                self._pause_ms = 0.0
            previous = mark
        self._last_mark = previous
        self._step_marks = []
        return times

    def _measure(self, trainer: pl.Trainer, now: float) -> None:
        step = self._step_at_start
        times = self._step_times_since_last()
        early = self._times.add(times)  # this window's steps are part of the early window
        cpu = self._cpu
        cpu.stop()  # file reads: this process's threads' schedstat
        load = self._load.update(len(times), early, cpu.run_delay_s, cpu.own_cpu_s, cpu.wall_s)
        new_graphs, limit_hits = self._compile.since(self._times.ready)  # host-side counters
        step_ms, baseline_ms = self._times.median(), self._times.baseline.median() if self._times.ready else math.nan
        started = time.perf_counter()
        slow = self._times.ready and step_ms > self.regression_factor * self._times.baseline.median()
        # deliberate host work (2 x 20 ms), on the early window's measuring steps and on slow ones only
        reference_ratio = self._load.reference_ratio(early, slow, reference_work_ms)
        parallel = partial(reference_work_ms, parallel=True)
        parallel_ratio = self._load.reference_ratio(early, slow, parallel, parallel=True)
        # the monitor's time: off the next step time; the window's wall time (throughput) keeps it, as every callback's
        self._pause_ms += 1e3 * (time.perf_counter() - started)
        device = trainer.strategy.root_device
        if self._timer is not None and self._fetch_seen is not None:
            self._wait_s += self._timer.total_s - self._fetch_seen
            self._fetch_seen = self._timer.total_s
        row = {
            **self._counts.take(device),  # tokens, positions, samples, trimmed_positions (device scalars: no sync)
            **memory_reading(device)._asdict(),  # peak, reserved, capacity: allocator bookkeeping or /proc, no sync
            **asdict(load),  # contention_ratio, cpu_ratio, mean_ratio
            "wall_s": max(now - (self._window_start or now), 1e-9),
            "wait_s": self._wait_s,
            "step_ms": step_ms,
            "baseline_ms": baseline_ms,
            "new_graphs": new_graphs,
            "limit_hits": limit_hits,
            "reference_ratio": reference_ratio,
            "parallel_ratio": parallel_ratio,
        }
        self._wait_s = 0.0
        # every rank's row, into the step's one reduction over ranks (the pack's shared collective)
        declared = row_fields(ThroughputRow, row)  # in the order ThroughputRow declares, the same on every rank
        self.reduce_then(trainer, lambda reduced: self._conclude(trainer, reduced, step), device, rows=declared)

    def _conclude(self, trainer: pl.Trainer, reduced: Reduced, step: int) -> None:
        rows = [ThroughputRow(**r) for r in reduced.host().per_rank()]  # host sync: the one transfer of this step
        metrics = throughput_metrics(rows, self.flops_per_token, self._peak)
        self.log_scalars(trainer, metrics, step=step)
        # every value behind a verdict comes from the reduced table, so every rank reaches the same (synchronized)
        self.emit(trainer, self._diagnosis.update(metrics, rows, step))

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        return {
            **super().state_dict(),
            "streaks": self._diagnosis.state_dict(),
            "baseline": self._times.baseline.state_dict(),
            **self._load.state_dict(),  # the early windows' load and reference timings
            "steps_seen": self._times.seen,
            "flops_per_token": self.flops_per_token,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self._diagnosis.load_state_dict(state_dict.get("streaks", {}))
        self._times.baseline.load_state_dict(state_dict.get("baseline", {}))
        self._load.load_state_dict(state_dict)
        self._times.seen = int(state_dict.get("steps_seen", 0))
        self.flops_per_token = state_dict.get("flops_per_token")
