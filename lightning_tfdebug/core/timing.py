"""Timing without a device sync: :class:`StepClock` marks on the device's stream, and the data loader's wait (one
:class:`FetchTimer` per fit loop, shared by every callback that reports data wait)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch


class StepClock:
    """Timestamps that cost no device sync when taken.

    On CUDA a mark is a recorded ``torch.cuda.Event`` (asynchronous, it times the device's stream); elsewhere it is
    ``time.perf_counter()``. :meth:`elapsed_ms` between two CUDA marks needs the later one to have completed: call
    :meth:`wait` on it once (the one deliberate sync of a measuring step) before reading several intervals.
    """

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda" and torch.cuda.is_available()

    def mark(self) -> Any:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def wait(self, mark: Any) -> None:
        if self.cuda:
            mark.synchronize()  # host sync: only on measuring steps, once, for all the intervals read after it

    def elapsed_ms(self, start: Any, end: Any) -> float:
        if self.cuda:
            return float(start.elapsed_time(end))
        return (end - start) * 1e3


class FetchTimer:
    """Adds up the wall time the training loop spends getting its next batch onto the device: the DataLoader's
    ``next()`` (timed around the fetcher's profiler hooks) and, with :meth:`batch_arrived`, the copy to the device.
    Several callbacks share one timer and read differences of :attr:`total_s`.
    """

    def __init__(self) -> None:
        self.total_s = 0.0
        self._t0: float | None = None
        self._fetched_at: float | None = None  # end of the last fetch not yet followed by a batch start
        self._inner_start: Callable[[], None] = lambda: None
        self._inner_stop: Callable[[], None] = lambda: None

    def start(self) -> None:
        self._t0 = time.perf_counter()
        self._inner_start()

    def stop(self) -> None:
        self._inner_stop()
        if self._t0 is not None:
            now = time.perf_counter()
            self.total_s += now - self._t0
            self._t0 = None
            self._fetched_at = now

    def batch_arrived(self) -> None:
        """Count the time from the end of the last fetch to now (device copy, transfer hooks); once per fetch."""
        if self._fetched_at is not None:
            self.total_s += time.perf_counter() - self._fetched_at
            self._fetched_at = None


def fetch_timer(trainer: pl.Trainer) -> FetchTimer | None:
    """The :class:`FetchTimer` on the fit loop's current data fetcher (installed on first use, and again when the
    loop re-assigns the fetcher's hooks at an epoch start), with the current batch's arrival counted; None when this
    Lightning version has no such hooks. Call it from ``on_train_batch_start``."""
    fetcher = getattr(getattr(trainer, "fit_loop", None), "_data_fetcher", None)
    if fetcher is None or not hasattr(fetcher, "_start_profiler") or not hasattr(fetcher, "_stop_profiler"):
        return None
    timer = getattr(fetcher, "_tfdebug_fetch_timer", None)
    if timer is None:
        timer = FetchTimer()
        fetcher._tfdebug_fetch_timer = timer
    if fetcher._start_profiler != timer.start:
        timer._inner_start, timer._inner_stop = fetcher._start_profiler, fetcher._stop_profiler
        fetcher._start_profiler, fetcher._stop_profiler = timer.start, timer.stop
    _mark_arrival_after_transfer(trainer, timer)
    timer.batch_arrived()  # the first batch (transferred before this was installed); a no-op afterwards
    return timer


def _mark_arrival_after_transfer(trainer: pl.Trainer, timer: FetchTimer) -> None:
    """Count a batch as arrived when the strategy has moved it to the device, not when a callback first sees it
    (the pack's own ``on_train_batch_start`` work is not data loading). One clock read per batch."""
    strategy = getattr(trainer, "strategy", None)
    if strategy is None or not callable(getattr(strategy, "batch_to_device", None)):
        return
    strategy.__dict__["_tfdebug_fetch_timer"] = timer
    if "_tfdebug_transfer_wrapped" in strategy.__dict__:
        return
    original = strategy.batch_to_device

    def batch_to_device(*args: object, **kwargs: object) -> object:
        out = original(*args, **kwargs)
        current = strategy.__dict__.get("_tfdebug_fetch_timer")
        if current is not None:
            current.batch_arrived()
        return out

    strategy.__dict__["batch_to_device"] = batch_to_device
    strategy.__dict__["_tfdebug_transfer_wrapped"] = True
