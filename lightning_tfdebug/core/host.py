"""Readers of the host and the device: process memory, this process's CPU time and run-queue waits (``/proc``), a
fixed reference computation, ``torch.compile``'s counters and peak FLOP/s. Host numbers out, no device sync; the
decisions are in :mod:`lightning_tfdebug.functional.throughput_checks`.
"""

from __future__ import annotations

import math
import os
import resource
import sys
import time
import warnings
from collections.abc import Mapping
from typing import NamedTuple

import torch
from torch import Tensor

from lightning_tfdebug.functional.throughput import compute_precision, peak_flops_for


# ---------------------------------------------------------------------------------------------------- memory
def process_rss_bytes() -> int:
    """Resident set size of this process now (``/proc/self/statm``; the peak from ``getrusage`` elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):  # not Linux: fall back to the peak
        return peak_rss_bytes()


def peak_rss_bytes() -> int:
    """Peak resident set size of this process since it started."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if os.uname().sysname == "Darwin" else peak * 1024  # Linux reports KiB, macOS bytes


def physical_memory_bytes() -> int | None:
    """Total physical memory of the machine, or None if unknown."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (OSError, ValueError, AttributeError):
        return None


class MemoryReading(NamedTuple):
    """Bytes: CUDA's peak allocated, reserved and total memory; elsewhere the peak and current resident set and the
    machine's physical memory (0: unknown)."""

    peak: float
    reserved: float
    capacity: float


def memory_reading(device: torch.device) -> MemoryReading:
    """This process's :class:`MemoryReading` on ``device`` (CUDA: host-side allocator bookkeeping, no device sync)."""
    if device.type == "cuda":
        capacity = float(torch.cuda.get_device_properties(device).total_memory)
        return MemoryReading(
            float(torch.cuda.max_memory_allocated(device)), float(torch.cuda.memory_reserved(device)), capacity
        )
    return MemoryReading(float(peak_rss_bytes()), float(process_rss_bytes()), float(physical_memory_bytes() or 0))


# ---------------------------------------------------------------------------------------------------- CPU use
def thread_run_delays() -> dict[str, int] | None:
    """Nanoseconds each thread of this process has waited on a run queue (runnable, not running), by thread id, from
    ``/proc/self/task/<tid>/schedstat``; None where the kernel does not provide it. A few small file reads."""
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return None
    out: dict[str, int] = {}
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                out[tid] = int(f.read().split()[1])
        except (OSError, ValueError, IndexError):
            continue
    return out or None


class CpuWindow:
    """This process's CPU use over a window: ``start()`` opens it, ``stop()`` sets ``run_delay_s`` (seconds its threads
    were runnable but waited for a core; NaN without ``/proc``), ``own_cpu_s`` (CPU time, every thread) and
    ``wall_s``. Threads that ended during the window are lost; threads born in it count from zero."""

    def __init__(self) -> None:
        self._delays: dict[str, int] | None = None
        self._own_start = time.process_time()
        self._wall_start = time.perf_counter()
        self.run_delay_s = self.own_cpu_s = self.wall_s = math.nan

    def start(self) -> None:
        self._own_start, self._wall_start = time.process_time(), time.perf_counter()
        self._delays = thread_run_delays()

    def stop(self) -> None:
        self.own_cpu_s = time.process_time() - self._own_start
        self.wall_s = time.perf_counter() - self._wall_start
        now = thread_run_delays()
        self.run_delay_s = math.nan
        if self._delays is not None and now is not None:
            self.run_delay_s = sum(max(0, d - self._delays.get(tid, 0)) for tid, d in now.items()) / 1e9


_REFERENCE_BUFFERS: tuple[Tensor, ...] = ()


def thread_run_delay_ns() -> int | None:
    """Nanoseconds the calling thread has waited on a run queue (``/proc/thread-self/schedstat``), or None."""
    try:
        with open("/proc/thread-self/schedstat") as f:
            return int(f.read().split()[1])
    except (OSError, ValueError, IndexError):
        return None


def reference_work_ms(span_ms: float = 20.0, parallel: bool = False) -> float:
    """Wall milliseconds per round of a fixed CPU computation (two 192 x 192 float32 matrix products, one torch thread,
    for at least ``span_ms``), less the thread's run-queue wait where ``/proc`` has it: a machine whose cores got
    slower (steal, a lower clock) reads slower; the wait is the contention ratio's (left in, a 20 ms sample at a load
    of 17 on 2 cores read 1 to 7 ms a round; left out, 0.31 to 0.41 ms). Buffers: 0.4 MiB, once per process.

    ``parallel``: at the run's torch thread count, waits left in: what the machine gives a parallel region of the
    run now, threads spinning at its barriers while a peer waits for a core included (their CPU time then rises with
    the step time as if the run did more work)."""
    global _REFERENCE_BUFFERS
    if not _REFERENCE_BUFFERS:
        # CPU float32 whatever the defaults (`torch.set_default_device("cuda")` would time kernel launches only);
        # fixed values, and the user's generator left alone
        cpu = dict(device="cpu", dtype=torch.float32)
        generator = torch.Generator().manual_seed(0)
        a, b = (torch.randn(192, 192, generator=generator, **cpu) for _ in range(2))
        _REFERENCE_BUFFERS = (a, b, torch.empty(192, 192, **cpu))
    a, b, product = _REFERENCE_BUFFERS
    rounds = 0
    threads = torch.get_num_threads()
    if not parallel:
        torch.set_num_threads(1)  # one thread: its wait is the calling thread's, and no peer spins through it
    try:
        waited, start = (None if parallel else thread_run_delay_ns()), time.perf_counter()
        with torch.no_grad():
            while rounds < 2 or time.perf_counter() < start + span_ms / 1e3:
                torch.mm(a, b, out=product)
                torch.mm(b, a, out=product)
                rounds += 1
        wall, end_wait = time.perf_counter() - start, (None if parallel else thread_run_delay_ns())
    finally:
        torch.set_num_threads(threads)
    if waited is not None and end_wait is not None:
        wall -= (end_wait - waited) / 1e9
    return 1e3 * max(wall, 0.0) / rounds


# ---------------------------------------------------------------------------------------------------- compilation
def compile_counts() -> tuple[float, float]:
    """``(graphs compiled, recompile-limit hits)`` so far in this process by ``torch.compile``, from TorchDynamo's
    host-side counters, read without importing it (``(nan, nan)`` when nothing used ``torch.compile``)."""
    if "torch._dynamo.utils" not in sys.modules:
        return math.nan, math.nan
    counters = getattr(sys.modules["torch._dynamo.utils"], "counters", None)
    if not isinstance(counters, Mapping):
        return math.nan, math.nan
    stats = counters.get("stats") or {}
    gave_up = counters.get("unimplemented") or {}
    limits = ("recompile limit", "recompile_limit", "cache size limit", "cache_size_limit")
    hits = sum(n for reason, n in gave_up.items() if any(w in str(reason).split("\n")[0].lower() for w in limits))
    return float(stats.get("unique_graphs", 0)), float(hits)


class CompileWatch:
    """Graphs ``torch.compile`` compiled since the early window ended, and recompile-limit hits since :meth:`start`
    (its counters are process-wide)."""

    def __init__(self) -> None:
        self.graphs_ref: float | None = None  # graphs when the early window ended
        self.limit_ref = math.nan  # recompile-limit hits when training started

    def start(self) -> None:
        self.graphs_ref, self.limit_ref = None, compile_counts()[1]

    def since(self, early_window_done: bool) -> tuple[float, float]:
        """``(new graphs, limit hits)``; the graphs are nan until the early window is done, both where nothing
        compiled."""
        graphs, hits = compile_counts()
        if early_window_done and self.graphs_ref is None:
            self.graphs_ref = graphs
        new_graphs = graphs - self.graphs_ref if self.graphs_ref is not None else math.nan
        limit_hits = hits - self.limit_ref if hits == hits and self.limit_ref == self.limit_ref else math.nan
        return new_graphs, limit_hits


# ---------------------------------------------------------------------------------------------------- peak FLOPs
#: The dtype Lightning's table files each precision column of ours under (it has no fp8 column).
_LIGHTNING_DTYPES: dict[str, torch.dtype | str] = {
    "fp64": torch.float64,
    "fp32": torch.float32,
    "tf32": "tfloat32",
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
}


def lightning_peak_flops(device: torch.device, compute: str) -> float | None:
    """Lightning's dense peak FLOP/s of ``device`` for ``compute`` (``get_available_flops``, its unknown-chip warning
    silenced), or None. A chip without TF32 runs ``"tf32"`` as plain fp32."""
    from lightning.fabric.utilities.throughput import get_available_flops

    dtype = _LIGHTNING_DTYPES.get(compute)
    if dtype is None:
        return None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        flops = get_available_flops(device, dtype)
        if flops is None and compute == "tf32":
            flops = get_available_flops(device, torch.float32)
    return float(flops) if flops is not None else None


def device_peak_flops(device: torch.device, precision: str) -> float | None:
    """Peak dense FLOP/s of one CUDA ``device`` at the Trainer's ``precision`` (TF32 where torch allows it), from
    :data:`~lightning_tfdebug.functional.throughput.PEAK_FLOPS`, else Lightning's table; None when neither knows."""
    if device.type != "cuda":
        return None
    tf32 = torch.get_float32_matmul_precision() != "highest" or torch.backends.cuda.matmul.allow_tf32
    compute = compute_precision(precision, tf32)
    own = peak_flops_for(torch.cuda.get_device_name(device), compute)
    return own if own is not None else lightning_peak_flops(device, compute)
