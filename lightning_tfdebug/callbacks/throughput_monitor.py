"""ThroughputMonitor: real tokens per second over all ranks, step time, padding, data-loading stalls, MFU, memory."""

from __future__ import annotations

import math
import os
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_info
from torch import Tensor

from lightning_tfdebug.core.base import DebugCallback, check_number
from lightning_tfdebug.core.batch import IGNORE_INDEX, BatchKeys, step_batch
from lightning_tfdebug.core.io import write_atomic, write_text
from lightning_tfdebug.core.model import import_object
from lightning_tfdebug.core.timing import FetchTimer, fetch_timer
from lightning_tfdebug.core.tracking import RunningWindow
from lightning_tfdebug.findings import OnFinding
from lightning_tfdebug.functional.throughput import (
    CountWindow,
    OtherLoad,
    StepClock,
    batch_counts,
    compile_counts,
    compute_precision,
    peak_flops_for,
    peak_rss_bytes,
    physical_memory_bytes,
    process_rss_bytes,
    reference_work_ms,
)
from lightning_tfdebug.functional.throughput_checks import ThroughputDiagnosis, rows_to_stats, throughput_metrics
from lightning_tfdebug.functional.verdicts import Verdict


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


def _span_rates(windows: deque[tuple[int, float, float, float, float]]) -> tuple[float, float, float]:
    """Over the measuring windows kept: run-queue wait (ms) and own CPU time (ms) per step, and the cores other
    processes kept busy. Windows whose reading is missing (NaN) are left out of that rate; NaN when none has it."""

    def rate(value: int, per: int, scale: float) -> float:
        kept = [(w[value], w[per]) for w in windows if w[value] == w[value] and w[per] == w[per]]
        total = sum(p for _, p in kept)
        return scale * sum(v for v, _ in kept) / total if kept and total > 0 else math.nan

    return rate(1, 0, 1e3), rate(2, 0, 1e3), rate(3, 4, 1.0)


_SPAN_WEIGHTS: dict[tuple[int, torch.device], Tensor] = {}  # per mask width and device: rows [index, width - index]


def _trimmed_positions(mask: Tensor | None, positions: int) -> Tensor | int:
    """Positions of a batch padded only to its longest row: rows x the span of columns holding a real token. A device
    tensor (no sync) when the batch has a 2-D attention mask, else ``positions``.

    On the micro-batches of measuring steps, in few kernels: the columns holding a real token, times a cached
    ``(2, width)`` table whose rows are ``index`` and ``width - index``; the row maxima are the last real column and
    ``width - first``, so the span is their sum minus ``width - 1`` (clamped at 0 for a mask without any real token)."""
    if mask is None or mask.ndim != 2 or mask.numel() == 0:
        return positions
    width = mask.shape[1]
    key = (width, mask.device)
    weights = _SPAN_WEIGHTS.get(key)
    if weights is None:
        index = torch.arange(width, device=mask.device)
        weights = _SPAN_WEIGHTS.setdefault(key, torch.stack([index, width - index]))
    with torch.no_grad():
        ends = (weights * mask.any(0)).amax(1)  # [last real column, width - first real column]; zeros if none
        return (ends.sum() - (width - 1)).clamp_(min=0) * mask.shape[0]


class ThroughputMonitor(DebugCallback):
    r"""Measures how fast training really goes, over all ranks, and says why it is slow.

    Counts real (non-padding) tokens of every micro-batch on every rank, times the wall clock between measuring
    steps, and on measuring steps declares one packed row per rank into the step's one reduction over ranks (one
    collective, shared by the whole pack inside :class:`~lightning_tfdebug.TFDebug`) so the logged throughput is the
    sum over ranks, not rank 0's number times the world size. Time spent waiting for the next batch (data
    loading, collation, host-to-device copy) is measured between batches. No device sync on other steps: per-step
    times come from CUDA events (host clock on CPU), and a measuring step waits once for the last event.

    Logged keys (on measuring steps, at the step that was measured):

    | key | meaning |
    | --- | --- |
    | `throughput/tokens_per_sec` | non-padding tokens per second, summed over all ranks, since the last measurement |
    | `throughput/tokens_per_sec_per_device` | the same divided by the number of ranks |
    | `throughput/samples_per_sec` | samples (sequences) per second over all ranks |
    | `throughput/step_time_ms` | median optimizer-step time over the last `window` steps (slowest rank) |
    | `throughput/padding_frac` | share of computed token positions that were padding |
    | `throughput/dataloader_wait_frac` | share of wall time spent waiting for the next batch (worst rank) |
    | `throughput/mfu` | model FLOPs utilization; only when the peak FLOP/s is known (table or `peak_flops`) |
    | `memory/peak_allocated_gib` | CUDA: peak allocated memory; CPU: peak resident set size (worst rank) |
    | `memory/reserved_gib` | CUDA: memory reserved by the caching allocator; CPU: resident set size now (worst rank) |

    Findings: ``TFD601`` data-loading bound, ``TFD602`` padding waste (info; a warning when most computed positions
    are padding, with the speed-up packing or dynamic padding would give), ``TFD603`` step time regressed against the
    early steps, ``TFD604`` memory close to capacity, ``TFD605`` (info) the step time regressed while other
    processes loaded the machine's CPUs and this process waited for cores (Linux, from ``/proc/stat`` and its
    threads' ``schedstat``), or while a fixed reference computation (20 ms of host work, timed on the early
    measuring steps and again on a slow one) slowed as much: the machine got slower, so it is not blamed on the run,
    ``TFD606`` ``torch.compile`` still compiling new graphs after the early window, ``TFD607`` its recompile limit
    hit (that code runs uncompiled) (see ``docs/findings.md``).

    Args:
        every_n_steps: measure when ``global_step % every_n_steps == 0``; default: the Trainer's
            ``log_every_n_steps``. Throughput covers every step since the previous measurement.
        on_finding: ``"warn"``, ``"stop"`` or ``"raise"`` (see :class:`~lightning_tfdebug.DebugCallback`).
        window: number of recent optimizer steps the median step time is taken over.
        length_fn: import path (``"my_pkg.data.count_tokens"``) or callable returning the number of real tokens of
            a batch (an int or a device tensor). Default: the attention mask's non-zero entries (counted once per
            step for the whole pack, on the device), else the size of the ids.
        peak_flops: peak FLOP/s of one device for MFU; default: looked up from the device name and precision
            (CUDA only; on CPU no MFU is logged unless this is given).
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
        check_number("wait_threshold", wait_threshold, low=0.0, high=1.0, low_inclusive=False)
        check_number("padding_threshold", padding_threshold, low=0.0, high=1.0, low_inclusive=False)
        check_number("regression_factor", regression_factor, low=1.0, low_inclusive=False)
        check_number("patience", patience, low=1, integer=True)
        check_number("skip_steps", skip_steps, low=0, integer=True)
        check_number("baseline_steps", baseline_steps, low=1, integer=True)
        check_number("memory_threshold", memory_threshold, low=0.0, high=1.0, low_inclusive=False)
        check_number("profile_row_limit", profile_row_limit, low=1, integer=True)
        if profile_steps is not None:
            ok = (
                isinstance(profile_steps, (list, tuple))
                and len(profile_steps) == 2
                and all(isinstance(s, int) and not isinstance(s, bool) for s in profile_steps)
                and 0 <= profile_steps[0] < profile_steps[1]
            )
            if not ok:
                raise ValueError(
                    f"`profile_steps` must be [start, stop] with integers 0 <= start < stop, or None; got "
                    f"{profile_steps!r}."
                )
        self.window = window
        self.length_fn = length_fn
        self._length_fn = resolve_length_fn(length_fn)
        self.peak_flops = float(peak_flops) if peak_flops is not None else None
        if not isinstance(measure_flops, bool):
            raise TypeError(f"`measure_flops` must be True or False; got {measure_flops!r}.")
        self.measure_flops = measure_flops
        self.wait_threshold = float(wait_threshold)
        self.padding_threshold = float(padding_threshold)
        self.regression_factor = float(regression_factor)
        self.patience = patience
        self.skip_steps = skip_steps
        self.baseline_steps = baseline_steps
        self.memory_threshold = float(memory_threshold)
        self.profile_steps = tuple(profile_steps) if profile_steps is not None else None
        self.profile_row_limit = profile_row_limit

        self._diagnosis = ThroughputDiagnosis(
            self.wait_threshold, self.padding_threshold, self.regression_factor, self.memory_threshold, patience
        )
        self._baseline = RunningWindow(baseline_steps)  # step times (ms) of the early window; full = ready
        self._step_times: deque[float] = deque(maxlen=window)
        self._steps_seen = 0
        self._other_base = RunningWindow(16)  # other processes' CPU cores during the early window
        self._delay_base = RunningWindow(16)  # run-queue wait per step (ms) during the early window
        self._cpu_base = RunningWindow(16)  # this process's CPU time per step (ms) during the early window
        self._wall_base = RunningWindow(16)  # wall time per step (ms) of the early windows: their mean step time
        self._reference_base = RunningWindow(16)  # ms of `reference_work_ms` on the early measuring steps
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
        self._tokens = CountWindow()  # real tokens of the window (device counts added in place, no sync)
        # positions had each batch been padded only to its longest row, over the micro-batches of measuring steps
        # (a sample: see `on_train_batch_start`), and the positions of those same micro-batches
        self._trimmed = CountWindow()
        self._sampled_positions = 0
        self._positions = 0
        self._samples = 0
        self._step_marks: list[Any] = []  # clock marks at optimizer-step ends since the last measurement
        self._last_mark: Any = None
        self._pause_ms = 0.0  # validation time to take off the next step time
        self._reference_s = 0.0  # the reference computation's time on this measuring step (see `_measure`)
        self._step_at_start = -1
        self._measuring = False
        self._flop_counter: Any = None
        self._flop_positions = 0
        self._profiler: Any = None
        self._val_start: float | None = None
        self._timer: FetchTimer | None = None
        self._fetch_seen: float | None = None  # the fetch timer's total at the start of the window
        self._other = OtherLoad()  # other processes' CPU use over the current window
        # per measuring window since the step-time median's oldest step: (steps, run-queue wait s, own CPU s, other
        # processes' core-seconds, wall s), so that contention is judged over the steps the median is taken over
        self._load_windows: deque[tuple[int, float, float, float, float]] = deque()
        self._graphs_ref: float | None = None  # torch.compile graphs when the early window ended
        self._limit_ref = math.nan  # recompile-limit hits when training started
        self._diagnosis.graphs_prev = math.nan

    # ------------------------------------------------------------------ set-up
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        self._reset_timing()
        device = trainer.strategy.root_device
        self._peak = self.peak_flops
        if self._peak is None and device.type == "cuda":
            tf32 = torch.get_float32_matmul_precision() != "highest" or torch.backends.cuda.matmul.allow_tf32
            self._peak = peak_flops_for(torch.cuda.get_device_name(device), compute_precision(trainer.precision, tf32))

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._clock = StepClock(trainer.strategy.root_device)
        # torch.compile's counters are process-wide: keep this fit's starting point
        self._graphs_ref, self._limit_ref = None, compile_counts()[1]
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
            self._other.start()
        step = trainer.global_step
        first_micro_batch = step != self._step_at_start
        self._step_at_start = step
        if first_micro_batch:
            self._measuring = self.should_measure(trainer)
            self._maybe_start_profiler(trainer, step)
        view = step_batch(trainer, batch, self._batch_keys)  # the step's shared reading and token count
        tokens, positions, samples = batch_counts(view, self._length_fn)
        self._tokens.add(tokens)  # in place on the device: no sync, no collective
        if self._measuring:
            # The padding span (how much shorter the batch would be, padded only to its longest row) is a ratio
            # sampled on the measuring step's micro-batches, not 6 kernels on every batch: TFD602's trim factor is
            # a property of the data pipeline (collation, fixed length), the same on every batch it builds.
            self._trimmed.add(_trimmed_positions(view.attention_mask, positions))
            self._sampled_positions += positions
        self._positions += positions
        self._samples += samples
        if (
            self.flops_per_token is None
            and self._flop_counter is None
            and self.measure_flops
            and self._peak is not None
            and step >= 1
            and first_micro_batch
            and positions > 0
        ):
            from torch.utils.flop_counter import FlopCounterMode

            # counts the matmul/attention FLOPs of this one real micro-batch: forward, backward, optimizer step
            self._flop_counter = FlopCounterMode(display=False)
            self._flop_counter.__enter__()
            self._flop_positions = positions

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if not self.active or self._clock is None:
            return
        now = time.perf_counter()
        self._stop_flop_counter()
        stepped = trainer.global_step != self._step_at_start
        if stepped:
            mark = self._clock.mark()
            self._step_marks.append(mark)
            self._steps_seen += 1
            self._maybe_stop_profiler(trainer, self._step_at_start)
            if self._measuring:
                self._clock.wait(mark)  # CUDA: one sync, on measuring steps only, so the window ends on the device
                now = time.perf_counter()
                with torch.no_grad():
                    self._measure(trainer, now)
                self._window_start = now
                # The reference computation's time is the monitor's: the next step time does not count it (a probe
                # of the run's own step time), the window's wall time does (throughput is what the run really got,
                # every callback's work included, as the independent counts in the tests measure it)
                self._pause_ms += self._reference_s * 1e3
                self._reference_s = 0.0
                self._other.start()
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
        self._stop_flop_counter()
        self._maybe_stop_profiler(trainer, None)

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._stop_flop_counter()
        self._maybe_stop_profiler(trainer, None)

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

    def _memory(self, trainer: pl.Trainer) -> tuple[float, float, float]:
        device = trainer.strategy.root_device
        if device.type == "cuda":
            # allocator counters are host-side bookkeeping: no device sync
            capacity = torch.cuda.get_device_properties(device).total_memory
            return torch.cuda.max_memory_allocated(device), torch.cuda.memory_reserved(device), capacity
        return float(peak_rss_bytes()), float(process_rss_bytes()), float(physical_memory_bytes() or 0)

    def _measure(self, trainer: pl.Trainer, now: float) -> None:
        step = self._step_at_start
        times = self._step_times_since_last()
        for t in times:
            self._step_times.append(t)
        skipped = self._steps_seen - len(times)
        in_baseline = len(self._baseline)
        for i, t in enumerate(times):
            if skipped + i >= self.skip_steps and len(self._baseline) < self.baseline_steps:
                self._baseline.add(t)
        baseline_ready = len(self._baseline) >= self.baseline_steps
        other = self._other.cores()  # file reads: /proc/stat and this process's threads' schedstat
        load = self._other
        delay = load.run_delay_s * 1e3 / len(times) if times else math.nan  # ms per step
        cpu = load.own_cpu_s * 1e3 / len(times) if times else math.nan  # ms per step
        if len(self._baseline) > in_baseline:  # this window's steps are part of the early window
            if other is not None:
                self._other_base.add(other)
            if delay == delay:
                self._delay_base.add(delay)
            self._cpu_base.add(cpu)
            self._wall_base.add(load.wall_s * 1e3 / len(times) if times else math.nan)
        # The step time is a median over the last `window` steps, and one measuring window is a handful of steps of
        # a few ms each: on a shared machine its readings are noise. Contention is judged over the same steps as the
        # median (the windows since its oldest step), not over the last window alone.
        if times:
            other_seconds = other * load.wall_s if other is not None else math.nan
            self._load_windows.append((len(times), load.run_delay_s, load.own_cpu_s, other_seconds, load.wall_s))
        while self._load_windows and sum(w[0] for w in self._load_windows) - self._load_windows[0][0] >= self.window:
            self._load_windows.popleft()
        span_delay, span_cpu, span_other = _span_rates(self._load_windows)
        steps_in_span = sum(w[0] for w in self._load_windows)
        span_wall = 1e3 * sum(w[4] for w in self._load_windows) / steps_in_span if steps_in_span else math.nan
        wall_base = self._wall_base.median() if len(self._wall_base) else math.nan
        mean_ratio = span_wall / wall_base if wall_base > 0 else math.nan
        delay_rise = span_delay - self._delay_base.median() if len(self._delay_base) else math.nan
        cpu_ratio = (
            span_cpu / self._cpu_base.median() if len(self._cpu_base) and self._cpu_base.median() > 0 else math.nan
        )
        # against the quietest early window: a passing spike during the early window must not hide later load
        quiet = min(self._other_base.values, default=math.nan)
        other_extra = span_other - quiet
        graphs, hits = compile_counts()  # host-side counters
        if baseline_ready and self._graphs_ref is None:
            self._graphs_ref = graphs  # compiling during warm-up and the early window is expected
        new_graphs = graphs - self._graphs_ref if self._graphs_ref is not None else math.nan
        limit_hits = hits - self._limit_ref if hits == hits and self._limit_ref == self._limit_ref else math.nan
        step_ms = sorted(self._step_times)[len(self._step_times) // 2] if self._step_times else float("nan")
        reference_ratio = math.nan
        started = time.perf_counter()
        slow = baseline_ready and step_ms > self.regression_factor * self._baseline.median()
        if len(self._baseline) > in_baseline:
            # Deliberate host work (20 ms) on the measuring steps whose steps form the early window, and no others:
            # how long a fixed computation takes on this machine while the early step times are taken (one timing
            # at the default cadence, a one-time cost of the fit)
            self._reference_base.add(reference_work_ms())
        elif slow and len(self._reference_base):
            # A slow measurement: the same computation again (20 ms of host work, only while the step time is up).
            # Slower by as much as the step, the machine got slower; as fast as before, the run did.
            reference_ratio = reference_work_ms() / self._reference_base.median()
        self._reference_s = time.perf_counter() - started  # the monitor's time, not the run's: off the next step time
        peak, reserved, capacity = self._memory(trainer)
        if self._timer is not None and self._fetch_seen is not None:
            self._wait_s += self._timer.total_s - self._fetch_seen
            self._fetch_seen = self._timer.total_s
        wall = max(now - (self._window_start or now), 1e-9)

        device = trainer.strategy.root_device
        host = torch.tensor(
            [
                float(self._positions),
                float(self._samples),
                wall,
                self._wait_s,
                step_ms,
                self._baseline.median() if baseline_ready else float("nan"),
                peak,
                reserved,
                capacity,
                other_extra,
                new_graphs,
                limit_hits,
                delay_rise,
            ],
            dtype=torch.float64,
        )
        tokens = self._tokens.total(device)  # device scalars, no sync; the windows start again
        trimmed = self._trimmed.total(device)  # of the sampled micro-batches: scaled to the window's positions
        if self._sampled_positions > 0:
            trimmed = trimmed * (self._positions / self._sampled_positions)
        else:
            trimmed = torch.full((), float(self._positions), dtype=torch.float64, device=device)
        self._sampled_positions = 0
        cpu_slot = torch.tensor([cpu_ratio, mean_ratio, reference_ratio], dtype=torch.float64, device=device)
        packed = torch.cat([tokens.reshape(1), host.to(device), trimmed.reshape(1), cpu_slot])
        self._positions, self._samples, self._wait_s = 0, 0, 0.0
        # Every rank's row (sums, worst ranks and medians are taken from the table): declared into the step's one
        # reduction over ranks (the pack's shared collective; on its own, one collective of its own).
        self.reduce_then(trainer, lambda reduced: self._conclude(trainer, reduced.rows, step), device, rows=packed)

    def _conclude(self, trainer: pl.Trainer, table: Tensor, step: int) -> None:
        rows = table.tolist()  # host sync: the one transfer of this measuring step
        stats = rows_to_stats(rows)
        metrics = throughput_metrics(stats, self.flops_per_token, self._peak)
        self.log_scalars(trainer, metrics, step=step)
        self._emit(trainer, self._diagnosis.update(metrics, stats), step)

    # ------------------------------------------------------------------ findings
    def _emit(self, trainer: pl.Trainer, verdicts: list[Verdict], step: int) -> None:
        # every value behind a verdict comes from the reduced table, so every rank reaches the same (synchronized)
        for v in verdicts:
            self.emit_code(trainer, v.code, v.message, v.evidence, severity=v.severity, hint=v.hint, step=step)

    # ------------------------------------------------------------------ FLOPs and profiling
    def _stop_flop_counter(self) -> None:
        counter, self._flop_counter = self._flop_counter, None
        if counter is None:
            return
        counter.__exit__(None, None, None)
        flops = counter.get_total_flops()
        if flops > 0 and self._flop_positions > 0:
            self.flops_per_token = flops / self._flop_positions

    def _maybe_start_profiler(self, trainer: pl.Trainer, step: int) -> None:
        if self.profile_steps is None or self._profiler is not None or step != self.profile_steps[0]:
            return
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU]
        if trainer.strategy.root_device.type == "cuda":
            activities.append(ProfilerActivity.CUDA)
        self._profiler = profile(activities=activities, record_shapes=True)
        self._profiler.__enter__()

    def _maybe_stop_profiler(self, trainer: pl.Trainer, finished_step: int | None) -> None:
        if self._profiler is None or self.profile_steps is None:
            return
        if finished_step is not None and finished_step + 1 < self.profile_steps[1]:
            return
        profiler, self._profiler = self._profiler, None
        profiler.__exit__(None, None, None)
        out = os.path.join(self.tfdebug_dir, "profile")
        rank = trainer.global_rank
        trace = os.path.join(out, f"rank{rank}.pt.trace.json")
        written = write_atomic(trace, profiler.export_chrome_trace)  # False (warned once) if the disk refuses
        cuda = trainer.strategy.root_device.type == "cuda"
        sort_by = "self_cuda_time_total" if cuda else "self_cpu_time_total"
        table = profiler.key_averages().table(sort_by=sort_by, row_limit=self.profile_row_limit)
        top = os.path.join(out, f"rank{rank}-top_ops.txt")
        header = f"optimizer steps {self.profile_steps[0]} to {self.profile_steps[1] - 1}, rank {rank}"
        if write_text(top, f"{header}\n{table}\n") and written:
            rank_zero_info(f"ThroughputMonitor: profile written to {trace} (Perfetto / TensorBoard) and {top}.")

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        return {
            **super().state_dict(),
            "streaks": self._diagnosis.state_dict(),
            "baseline": self._baseline.state_dict(),
            "other_baseline": self._other_base.state_dict(),
            "delay_baseline": self._delay_base.state_dict(),
            "cpu_baseline": self._cpu_base.state_dict(),
            "wall_baseline": self._wall_base.state_dict(),
            "reference_baseline": self._reference_base.state_dict(),
            "steps_seen": self._steps_seen,
            "flops_per_token": self.flops_per_token,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self._diagnosis.load_state_dict(state_dict.get("streaks", {}))
        self._baseline.load_state_dict(state_dict.get("baseline", {}))
        self._other_base.load_state_dict(state_dict.get("other_baseline", {}))
        self._delay_base.load_state_dict(state_dict.get("delay_baseline", {}))
        self._cpu_base.load_state_dict(state_dict.get("cpu_baseline", {}))
        self._wall_base.load_state_dict(state_dict.get("wall_baseline", {}))
        # timed on the machine that saved it: a run resumed on a slower machine is recognised as the machine's
        self._reference_base.load_state_dict(state_dict.get("reference_baseline", {}))
        self._steps_seen = int(state_dict.get("steps_seen", 0))
        self.flops_per_token = state_dict.get("flops_per_token")
