"""Readers of the host and the device's properties: process memory, the machine's CPU load and run-queue waits
(``/proc``), a fixed reference computation, ``torch.compile``'s counters and the device's peak FLOP/s.

Each reads the machine as it is now and returns host numbers; the decisions taken from them live in
:mod:`lightning_tfdebug.functional.throughput_checks`. File reads and clock reads only, no device sync.
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
    """Memory of one process in bytes: on CUDA the allocator's peak allocated and reserved memory and the device's
    total; elsewhere this process's peak and current resident set size and the machine's physical memory (0 when
    unknown)."""

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


# ---------------------------------------------------------------------------------------------------- CPU load
def contended_cores() -> float:
    """Other processes using this many more cores than early on make step times incomparable: half a core, or a
    tenth of a big machine (where background activity of half a core is noise)."""
    return max(0.5, 0.1 * (os.cpu_count() or 1))


def machine_busy_seconds() -> float | None:
    """CPU seconds all processes of the machine have spent busy since boot (``/proc/stat``), or None if unknown.

    Busy is user, nice, system, irq, softirq and steal time summed over every core; a file read, no device work.
    """
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
        ticks = os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, AttributeError):
        return None
    if not fields or fields[0] != "cpu" or len(fields) < 9:
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in fields[1:9])
    return (user + nice + system + irq + softirq + steal) / ticks


def thread_run_delays() -> dict[str, int] | None:
    """Nanoseconds each thread of this process has waited on a run queue (runnable, not running), by thread id.

    From ``/proc/self/task/<tid>/schedstat`` (its second field); None where the kernel does not provide it. A few
    small file reads, no device work.
    """
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


class OtherLoad:
    """CPU cores that other processes kept busy over a window: machine busy time minus this process's, per second.

    ``start()`` opens a window, ``cores()`` closes it and returns the rate (None where ``/proc/stat`` is missing);
    ``run_delay_s`` then holds the seconds this process's threads spent runnable but waiting for a core over the
    same window (NaN where ``/proc/<pid>/task/*/schedstat`` is missing). DataLoader workers are other processes too;
    what matters is the change against the run's own early windows.

    Other processes' use also rises when this one stops using the CPU (it sleeps, waits for I/O or a device): on a
    full machine they take the cores it leaves. Only a rise in this process's own run-queue wait says the others
    slowed it down. And on a machine whose cores were already all busy, more competitors cannot raise the others' use
    much (there is no core left to take), they shrink this process's share: its run-queue wait rises while the CPU
    time it spends per step stays what its work needs. ``own_cpu_s`` (this process's CPU time over the window, every
    thread) and ``wall_s`` are kept for that comparison.
    """

    def __init__(self) -> None:
        self._start: tuple[float, float, float] | None = None
        self._delays: dict[str, int] | None = None
        self._own_start = time.process_time()
        self._wall_start = time.perf_counter()
        self.run_delay_s: float = math.nan
        self.own_cpu_s: float = math.nan
        self.wall_s: float = math.nan

    def start(self) -> None:
        self._own_start, self._wall_start = time.process_time(), time.perf_counter()
        busy = machine_busy_seconds()
        self._start = None if busy is None else (time.perf_counter(), busy, time.process_time())
        self._delays = thread_run_delays()

    def cores(self) -> float | None:
        self.own_cpu_s = time.process_time() - self._own_start
        self.wall_s = time.perf_counter() - self._wall_start
        self.run_delay_s = math.nan
        now = thread_run_delays()
        if self._delays is not None and now is not None:
            # threads that ended during the window are lost; threads born in it count from zero
            self.run_delay_s = sum(max(0, d - self._delays.get(tid, 0)) for tid, d in now.items()) / 1e9
        if self._start is None:
            return None
        busy = machine_busy_seconds()
        wall0, busy0, own0 = self._start
        wall = time.perf_counter() - wall0
        if busy is None or wall <= 0:
            return None
        return max(0.0, (busy - busy0) - (time.process_time() - own0)) / wall


_REFERENCE_BUFFERS: tuple[Tensor, ...] = ()


def reference_work_ms(span_ms: float = 20.0) -> float:
    """Milliseconds this process takes now for a fixed piece of CPU work: rounds of two 192 x 192 float32 matrix
    products and a 4 MiB copy (about 0.3-0.5 ms a round on one thread of a 2024 server core, with the process's torch
    threads), repeated for at least ``span_ms`` of wall time (and at least twice); the mean wall time of a round.

    Timed on the early measuring steps and again when the step time rises, it tells a machine that got slower (a
    hypervisor taking the CPU, a lower clock, other processes on the cores or the memory bus: the same work takes
    longer) from a run that got slower by itself (the same work takes as long as before). The wall time over a span
    of rounds, not the fastest or the median round, and a span longer than a scheduler's time slices: a short timing
    often runs whole inside one slice. Measured on 2 cores: with four busy loops beside, the median round was as fast
    as on the idle machine and the mean 6 to 17x slower; with the process stopped for 8 ms out of every 16 (what
    steal looks like), a timing of 2.4 ms read 1.1x on a measuring step that was 2.9x slower. Host work only, no
    device; the buffers are made once per process (about 8.5 MiB) so that allocation is not timed.
    """
    global _REFERENCE_BUFFERS
    if not _REFERENCE_BUFFERS:
        # CPU float32 whatever the defaults (`torch.set_default_device("cuda")` would time kernel launches only);
        # fixed values, and the user's generator left alone
        cpu = dict(device="cpu", dtype=torch.float32)
        generator = torch.Generator().manual_seed(0)
        a, b = (torch.randn(192, 192, generator=generator, **cpu) for _ in range(2))
        source = torch.ones(1 << 20, **cpu)
        _REFERENCE_BUFFERS = (a, b, torch.empty(192, 192, **cpu), source, torch.empty_like(source))
    a, b, product, source, target = _REFERENCE_BUFFERS
    rounds = 0
    with torch.no_grad():
        start = time.perf_counter()
        end = start + span_ms / 1e3
        while rounds < 2 or time.perf_counter() < end:
            torch.mm(a, b, out=product)
            torch.mm(b, a, out=product)
            target.copy_(source)
            rounds += 1
        return 1e3 * (time.perf_counter() - start) / rounds


# ---------------------------------------------------------------------------------------------------- compilation
def compile_counts() -> tuple[float, float]:
    """``(graphs compiled, recompile-limit hits)`` so far in this process by ``torch.compile``.

    Host-side counters of TorchDynamo, read without importing it: ``(nan, nan)`` when nothing in the process has
    used ``torch.compile``. A hit of the recompile limit means the code object now runs without compilation.
    """
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
    """What ``torch.compile`` did during a fit: graphs compiled since the early window ended, and recompile-limit hits
    since training started (its counters are process-wide: only changes since :meth:`start` count)."""

    def __init__(self) -> None:
        self.graphs_ref: float | None = None  # graphs when the early window ended
        self.limit_ref = math.nan  # recompile-limit hits when training started

    def start(self) -> None:
        self.graphs_ref, self.limit_ref = None, compile_counts()[1]

    def since(self, early_window_done: bool) -> tuple[float, float]:
        """``(new graphs, limit hits)``: the graphs are nan until the early window is done (compiling during warm-up
        and the early window is expected); nan where nothing was compiled."""
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
    """Lightning's dense peak FLOP/s of ``device`` for ``compute``
    (:func:`lightning.fabric.utilities.throughput.get_available_flops`), or None where it does not know the chip or
    that precision. A chip without TF32 (Volta, Turing) runs ``"tf32"`` as plain fp32. Its warning for an unknown
    chip is not repeated: without a peak, MFU is simply not logged (``peak_flops`` gives one)."""
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
    """Peak dense FLOP/s of one CUDA ``device`` in the column of the Trainer's ``precision``, or None (not CUDA, or a
    chip neither table knows).

    TF32 counts when ``torch.set_float32_matmul_precision`` or ``torch.backends.cuda.matmul.allow_tf32`` allows it.
    :data:`~lightning_tfdebug.functional.throughput.PEAK_FLOPS` answers for what it holds (chips and precisions
    Lightning's table lacks or reads wrongly from the device name), Lightning's table for every other chip.
    """
    if device.type != "cuda":
        return None
    tf32 = torch.get_float32_matmul_precision() != "highest" or torch.backends.cuda.matmul.allow_tf32
    compute = compute_precision(precision, tf32)
    own = peak_flops_for(torch.cuda.get_device_name(device), compute)
    return own if own is not None else lightning_peak_flops(device, compute)
