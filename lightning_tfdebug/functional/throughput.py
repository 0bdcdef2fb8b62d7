"""Pure helpers for throughput and per-rank statistics: token counts, batch fingerprints, parameter checksums,
peak FLOPs of common accelerators, process memory and cross-rank spreads.

Tensor helpers keep their results on the batch's device (no host sync); the caller moves them to the host once per
measuring step. Nothing here needs a Trainer.
"""

from __future__ import annotations

import math
import os
import resource
import statistics
import sys
import time
import zlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from lightning_tfdebug.core.batch import StepBatch, host_array
from lightning_tfdebug.functional.norms import per_tensor_norms

_HASH_MODULUS = 2_147_483_647  # 2**31 - 1: a fingerprint fits exactly in a float64 slot of a packed collective
_HASH_MULTIPLIER = 1_103_515_245


# ---------------------------------------------------------------------------------------------------- batches
def batch_counts(view: StepBatch, length_fn: Callable[[Any], Any] | None = None) -> tuple[Tensor | int, int, int]:
    """Token counts of one batch, read from its shared :class:`~lightning_tfdebug.core.batch.StepBatch`, no host sync.

    Returns ``(tokens, positions, samples)``: ``tokens`` are the real (non-padding) tokens, a device tensor when they
    come from the attention mask (the step's one shared count) or from ``length_fn``, else the host int
    ``positions``; ``positions`` is the number of token positions computed (batch x sequence length, padding
    included) and ``samples`` the batch size, both read from shapes (host metadata). A batch with neither ids nor a
    mask (features only) counts its first tensor's shape.

    Precedence: ``length_fn(batch)`` (an int or a tensor), then the attention mask, then the ids' shape.
    """
    positions, samples = view.positions, view.samples
    if view.input_ids is None and view.attention_mask is None:
        first = next((v for v in view.fields.leaves.values() if isinstance(v, Tensor)), None)
        if first is None:
            return 0, 0, 0
        positions, samples = int(first.numel()), int(first.shape[0]) if first.ndim >= 2 else 1
        if length_fn is None:
            return positions, positions, samples
    if length_fn is not None:
        tokens = length_fn(view.batch)
        return tokens, positions if positions else int(tokens), samples
    return view.tokens(), positions, samples


#: per length and device: the position weights of the fingerprint, and the constant its sum adds
_WEIGHTS: dict[tuple[int, torch.device], tuple[Tensor, int]] = {}


def _fingerprint_weights(numel: int, device: torch.device) -> tuple[Tensor, int]:
    key = (numel, device)
    found = _WEIGHTS.get(key)
    if found is None:
        if len(_WEIGHTS) > 64:  # many distinct lengths (unpadded batches): keep the cache small
            _WEIGHTS.clear()
        positions = torch.arange(1, numel + 1, device=device, dtype=torch.int64)
        weights = (positions * _HASH_MULTIPLIER + 12345) % _HASH_MODULUS
        # sum((x + 1) * w) + n == sum(x * w) + (sum(w) + n): the constant part, computed once (host read, cached)
        found = _WEIGHTS[key] = (weights, int(weights.sum()) + numel)
    return found


def host_fingerprint(ids: Tensor) -> int | None:
    """The fingerprint of a CPU tensor, read on the host: the CRC-32 of its bytes, in ``[0, 2**31 - 1)``; None when
    ``ids`` is not a CPU tensor NumPy can read (then :func:`batch_fingerprint` hashes it on its device).

    A CPU batch is host memory already, so hashing its bytes needs no torch kernel: about half the host time of the
    device formula's four kernels on the hot path, where BatchGuard fingerprints every batch. Equal values of one dtype
    give equal fingerprints, as on a device; the two formulas give different numbers, and a run uses one of them (its
    batches are on one kind of device), so its fingerprints compare with each other, across steps and ranks.
    """
    array = host_array(ids)
    if array is None:
        return None
    if not array.flags.c_contiguous:
        array = array.copy()  # a strided view: its elements in order (the CRC reads one contiguous buffer)
    return zlib.crc32(array) % _HASH_MODULUS


def batch_fingerprint(ids: Tensor) -> Tensor:
    """A cheap, order-sensitive hash of a tensor's values as an int64 scalar in ``[0, 2**31 - 1)``: on the host for
    a CPU tensor (:func:`host_fingerprint`), else computed on its device (no sync).

    Two equal tensors always give the same value; different ones collide with probability about 1 in 2**31. Floating
    tensors are hashed through their bit pattern. On a device: three kernels on integer ids, a weighted sum with
    cached position weights, a cached constant added, the remainder.
    """
    host = host_fingerprint(ids.detach())
    if host is not None:
        return torch.tensor(host)
    return device_fingerprint(ids)


def device_fingerprint(ids: Tensor) -> Tensor:
    """The fingerprint of :func:`batch_fingerprint` computed by torch kernels on ``ids``' device (any device)."""
    flat = ids.detach().reshape(-1)
    if flat.is_floating_point():
        bits = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.int8}[flat.element_size()]
        flat = flat.contiguous().view(bits)
    flat = flat.to(torch.int64)
    weights, constant = _fingerprint_weights(flat.numel(), flat.device)
    # int64 products and sums may wrap around: harmless for a hash, and identical on every rank
    return ((flat * weights).sum() + constant) % _HASH_MODULUS


def combine_fingerprints(a: Tensor | None, b: Tensor) -> Tensor:
    """Fold fingerprint ``b`` into ``a`` (order-sensitive), for the micro-batches of one optimizer step."""
    if a is None:
        return b
    return (a * 31 + b) % _HASH_MODULUS


def parameter_checksums(tensors: Sequence[Tensor]) -> Tensor:
    """Two numbers per tensor, in float64 on the tensors' device: ``[l2 norms..., signed sums...]`` (length ``2n``).

    Replicas that agree give equal values (DDP replicas are bitwise equal, so the values are too). The norm catches
    changes of magnitude, the signed sum catches sign flips and shifts that keep the norm. Integer and boolean
    tensors (buffers such as step counters) are compared through their float64 values. The norms come from one fused
    ``_foreach_norm`` per dtype; the sums are one small reduction per tensor, so call this on measuring steps only.
    """
    if not tensors:
        return torch.zeros(0, dtype=torch.float64)
    values = [t.detach() for t in tensors]
    device = values[0].device
    # fp32/fp16/bf16 tensors: fused norms accumulated in fp32, no copies; float64 and integer tensors in float64
    narrow = [i for i, v in enumerate(values) if v.is_floating_point() and v.dtype != torch.float64]
    narrow_set = set(narrow)
    wide = [i for i in range(len(values)) if i not in narrow_set]
    if not wide:  # the usual case, every tensor fp32/bf16/fp16: the fused norms are the vector, no scatter
        norms = per_tensor_norms(values).to(device=device, dtype=torch.float64)
    else:
        norms = torch.zeros(len(values), dtype=torch.float64, device=device)
        if narrow:
            narrow_norms = per_tensor_norms([values[i] for i in narrow])
            norms[torch.tensor(narrow, device=device)] = narrow_norms.to(device=device, dtype=torch.float64)
        wide_norms = torch._foreach_norm([values[i].double() for i in wide], 2)
        norms[torch.tensor(wide, device=device)] = torch.stack([n.to(device) for n in wide_norms])
    sums = [v.sum(dtype=torch.float64) for v in values]
    sums = torch.stack(sums if all(t.device == device for t in sums) else [t.to(device) for t in sums])
    return torch.cat([norms, sums])


# ---------------------------------------------------------------------------------------------------- spreads
def max_over_median(values: Sequence[float]) -> float:
    """``max / median`` of finite values (1.0 for a single value; nan when the median is not positive)."""
    finite = [v for v in values if v == v and abs(v) != float("inf")]
    if not finite:
        return float("nan")
    median = statistics.median(finite)
    return max(finite) / median if median > 0 else float("nan")


def median_of_others(values: Sequence[float], index: int) -> float:
    """Median of every value except ``values[index]`` (the reference a rank is compared with)."""
    others = [v for i, v in enumerate(values) if i != index and v == v]
    return statistics.median(others) if others else float("nan")


def _close(x: float, y: float, rtol: float) -> bool:
    """Equal within ``rtol``; two NaNs count as equal (replicas that both went non-finite agree), NaN and a number
    do not."""
    if x == y:
        return True
    if x != x or y != y:
        return x != x and y != y
    return abs(x - y) <= rtol * max(abs(x), abs(y), 1e-12)


def loss_outliers(losses: Sequence[float], spread: float) -> tuple[list[int], float]:
    """Ranks whose loss is far from the others', and the reference it was judged against.

    With three ranks or more the reference is the median of all finite losses, and a rank is far when
    ``|loss - median| > spread * |median|``: one odd rank among many is named, the majority is not. With two ranks
    there is no majority: when ``|a - b| > spread * min(|a|, |b|)`` both are returned (they disagree; which one is off
    cannot be told) with the smaller loss as the reference. Non-finite losses are left out (see TFD505).
    """
    finite = [(r, v) for r, v in enumerate(losses) if math.isfinite(v)]
    if len(finite) < 2:
        return [], float("nan")
    if len(finite) == 2:
        (ra, a), (rb, b) = finite
        low = min(abs(a), abs(b))
        return ([ra, rb] if abs(a - b) > spread * max(low, 1e-12) else []), min(a, b, key=abs)
    median = statistics.median(v for _, v in finite)
    return [r for r, v in finite if abs(v - median) > spread * max(abs(median), 1e-12)], median


def differing_ranks(values: Sequence[Sequence[float]], rtol: float = 1e-6) -> list[int]:
    """Ranks whose checksum vector differs from the most common one (ties go to the lowest rank's vector).

    ``values[r]`` is rank ``r``'s vector of per-tensor checksums.
    """
    if len(values) < 2:
        return []

    def same(a: Sequence[float], b: Sequence[float]) -> bool:
        return all(_close(x, y, rtol) for x, y in zip(a, b))

    groups: list[list[int]] = []
    for r, vec in enumerate(values):
        for group in groups:
            if same(values[group[0]], vec):
                group.append(r)
                break
        else:
            groups.append([r])
    majority = max(groups, key=len)  # max keeps the first of equally large groups: the one holding the lowest rank
    return sorted(r for g in groups if g is not majority for r in g)


def differing_tensors(values: Sequence[Sequence[float]], names: Sequence[str], rtol: float = 1e-6) -> list[str]:
    """Names of the tensors whose checksum is not the same on every rank.

    ``values[r]`` is rank ``r``'s checksum vector; it may hold several blocks of ``len(names)`` values (as
    :func:`parameter_checksums` returns: norms, then sums); a tensor differs when any of its values does.
    """
    n = len(names)
    if not n or not values:
        return []
    out = []
    for i, name in enumerate(names):
        for j in range(i, len(values[0]), n):
            column = [v[j] for v in values]
            ref = column[0]
            if not all(_close(x, ref, rtol) for x in column[1:]):
                out.append(name)
                break
    return out


# ---------------------------------------------------------------------------------------------------- windows
class CountWindow:
    """Running sum of a per-micro-batch count over one measuring window, kept where the count lives.

    Counts arrive as host ints (read from shapes) or as device tensors (read from an attention mask, or returned by a
    ``length_fn``). Device counts are added in place into one float64 scalar on their device (``add_``: one kernel,
    no host sync, no collective); host counts stay a Python number. :meth:`total` returns both as one device scalar,
    still without a sync, and starts the next window. The cross-rank sum is the pack's one reduction per measuring
    step, not a per-state sync of a metric object.

    Why not a ``torchmetrics.SumMetric`` (what this was until issue 25): its ``update`` costs about 21 us of host
    time per call against 2-4 us for the in-place add (``benchmarks/count_window.py``), and ThroughputMonitor adds
    two counts on every micro-batch, the hot path the pack must barely touch.
    """

    def __init__(self) -> None:
        self._device_sum: Tensor | None = None
        self._host_sum = 0.0

    def add(self, count: Tensor | int | float) -> None:
        if isinstance(count, Tensor):
            count = count.detach()
            if self._device_sum is None or self._device_sum.device != count.device:
                start = self._device_sum.to(count.device) if self._device_sum is not None else None
                self._device_sum = torch.zeros((), dtype=torch.float64, device=count.device)
                if start is not None:
                    self._device_sum.add_(start)
            self._device_sum.add_(count.reshape(()))  # in place on the device: no sync, no collective
        else:
            self._host_sum += float(count)

    def total(self, device: torch.device) -> Tensor:
        """The window's sum as a float64 scalar on ``device`` (no sync); then the window starts again empty."""
        total = torch.full((), self._host_sum, dtype=torch.float64, device=device)  # a fill: no host-to-device copy
        if self._device_sum is not None:
            total = total + self._device_sum.to(device=device)
            self._device_sum = None
        self._host_sum = 0.0
        return total


# ---------------------------------------------------------------------------------------------------- timing
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


def physical_memory_bytes() -> int | None:
    """Total physical memory of the machine, or None if unknown."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (OSError, ValueError, AttributeError):
        return None


# ---------------------------------------------------------------------------------------------------- peak FLOPs
# Dense (no structured sparsity) peak FLOP/s per device, from the vendors' data sheets. Keys: "fp64", "fp32" (plain
# fp32 matmul), "tf32" (fp32 matmul on tensor cores, when torch allows TF32), "bf16", "fp16", "fp8".
PEAK_FLOPS: dict[str, dict[str, float]] = {
    "h200 nvl": {"fp64": 30e12, "fp32": 60e12, "tf32": 418e12, "bf16": 835e12, "fp16": 835e12, "fp8": 1671e12},
    "h200": {"fp64": 34e12, "fp32": 67e12, "tf32": 495e12, "bf16": 989e12, "fp16": 989e12, "fp8": 1979e12},
    "gh200": {"fp64": 34e12, "fp32": 67e12, "tf32": 495e12, "bf16": 989e12, "fp16": 989e12, "fp8": 1979e12},
    "h100 nvl": {"fp64": 30e12, "fp32": 60e12, "tf32": 418e12, "bf16": 835e12, "fp16": 835e12, "fp8": 1671e12},
    "h100 pcie": {"fp64": 26e12, "fp32": 51e12, "tf32": 378e12, "bf16": 756e12, "fp16": 756e12, "fp8": 1513e12},
    "h100": {"fp64": 34e12, "fp32": 67e12, "tf32": 495e12, "bf16": 989e12, "fp16": 989e12, "fp8": 1979e12},
    "h800": {"fp32": 67e12, "tf32": 495e12, "bf16": 989e12, "fp16": 989e12, "fp8": 1979e12},
    "a100": {"fp64": 9.7e12, "fp32": 19.5e12, "tf32": 156e12, "bf16": 312e12, "fp16": 312e12},
    "a800": {"fp64": 9.7e12, "fp32": 19.5e12, "tf32": 156e12, "bf16": 312e12, "fp16": 312e12},
    "a10g": {"fp32": 31.2e12, "tf32": 62.5e12, "bf16": 125e12, "fp16": 125e12},
    "a10": {"fp32": 31.2e12, "tf32": 62.5e12, "bf16": 125e12, "fp16": 125e12},
    "l40s": {"fp32": 91.6e12, "tf32": 183e12, "bf16": 362e12, "fp16": 362e12, "fp8": 733e12},
    "l40": {"fp32": 90.5e12, "tf32": 90.5e12, "bf16": 181e12, "fp16": 181e12, "fp8": 362e12},
    "l4": {"fp32": 30.3e12, "tf32": 60e12, "bf16": 121e12, "fp16": 121e12, "fp8": 242e12},
    "v100": {"fp64": 7.8e12, "fp32": 15.7e12, "fp16": 125e12},
    "t4": {"fp32": 8.1e12, "fp16": 65e12},
    "rtx 4090": {"fp32": 82.6e12, "tf32": 82.6e12, "bf16": 165.2e12, "fp16": 165.2e12},
    "rtx 3090": {"fp32": 35.6e12, "tf32": 35.6e12, "bf16": 71e12, "fp16": 71e12},
    "mi300x": {"fp64": 163.4e12, "fp32": 163.4e12, "tf32": 653.7e12, "bf16": 1307.4e12, "fp16": 1307.4e12},
    "mi250x": {"fp64": 95.7e12, "fp32": 95.7e12, "bf16": 383e12, "fp16": 383e12},
}


def peak_flops_for(device_name: str, compute: str) -> float | None:
    """Peak dense FLOP/s of the accelerator called ``device_name`` for ``compute`` (``"fp32"``, ``"tf32"``,
    ``"bf16"``, ``"fp16"``, ``"fp8"``, ``"fp64"``), or None when the chip or that precision is not in the table.

    Names are matched case-insensitively as substrings, most specific first (``"NVIDIA H100 80GB HBM3"`` -> ``h100``,
    ``"NVIDIA H100 PCIe"`` -> ``h100 pcie``).
    """
    name = device_name.lower()
    for chip in sorted(PEAK_FLOPS, key=len, reverse=True):
        words = chip.split()
        if all(w in name for w in words):
            table = PEAK_FLOPS[chip]
            if compute == "tf32" and "tf32" not in table:
                compute = "fp32"
            return table.get(compute)
    return None


def compute_precision(precision: str, tf32_allowed: bool) -> str:
    """Which column of :data:`PEAK_FLOPS` a Trainer ``precision`` string runs its matmuls in."""
    p = str(precision)
    if "bf16" in p:
        return "bf16"
    if p.startswith("16"):
        return "fp16"
    if "transformer-engine" in p or "fp8" in p:
        return "fp8"
    if p.startswith("64"):
        return "fp64"
    return "tf32" if tf32_allowed else "fp32"
