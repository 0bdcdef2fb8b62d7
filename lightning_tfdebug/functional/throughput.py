"""Pure helpers for throughput and per-rank statistics: token counts, the padding span, parameter checksums,
cross-rank spreads, the run's CPU use against its early windows, and peak FLOPs Lightning's table lacks.

Tensor helpers keep their results on the batch's device (no host sync). The readers of the machine are in
:mod:`lightning_tfdebug.core.host`.
"""

from __future__ import annotations

import math
import re
import statistics
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from lightning_tfdebug.functional.memory import chunked_sums
from lightning_tfdebug.functional.norms import per_tensor_norms
from lightning_tfdebug.primitives.batch import StepBatch
from lightning_tfdebug.primitives.tracking import RunningWindow


# ---------------------------------------------------------------------------------------------------- batches
def batch_counts(view: StepBatch, length_fn: Callable[[Any], Any] | None = None) -> tuple[Tensor | int, int, int]:
    """``(tokens, positions, samples)`` of one batch, from its shared
    :class:`~lightning_tfdebug.primitives.batch.StepBatch`, no host sync.

    ``tokens``: real tokens from ``length_fn(batch)``, else the attention mask (a device tensor), else the ids'
    shape; ``positions`` (padding included) and ``samples`` from shapes. A batch with neither ids nor a mask counts
    its first tensor's shape.
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


def parameter_checksums(tensors: Sequence[Tensor]) -> Tensor:
    """``[l2 norms..., signed sums...]`` of the tensors, float64 on their device (length ``2n``).

    Equal replicas give equal values; the norm catches changes of magnitude, the sum sign flips and shifts. Integer
    and boolean tensors count through their float64 values. One fused ``_foreach_norm`` per dtype and one small
    reduction per tensor: measuring steps only.
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
    # memory: one 2 MiB float64 buffer per device, not a float64 copy of each tensor (chunked_sums)
    sums = chunked_sums(values).to(device)
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
    """Equal within ``rtol``; two NaNs are equal (replicas that both went non-finite agree)."""
    if x == y:
        return True
    if x != x or y != y:
        return x != x and y != y
    return abs(x - y) <= rtol * max(abs(x), abs(y), 1e-12)


def loss_outliers(losses: Sequence[float], spread: float) -> tuple[list[int], float]:
    """Ranks whose loss is far from the others', and the reference it was judged against.

    Three ranks or more: far when ``|loss - median| > spread * |median|``. Two ranks: both when
    ``|a - b| > spread * min(|a|, |b|)`` (which one is off cannot be told), the smaller loss the reference.
    Non-finite losses are left out (TFD505).
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
    """Ranks whose checksum vector (``values[r]``) differs from the most common one (ties: the lowest rank's)."""
    groups: list[list[int]] = []  # ranks with equal vectors, each group named by its first rank
    for r, vec in enumerate(values):
        group = next((g for g in groups if all(_close(x, y, rtol) for x, y in zip(values[g[0]], vec))), None)
        if group is None:
            groups.append([r])
        else:
            group.append(r)
    if len(groups) < 2:
        return []
    majority = max(groups, key=len)  # max keeps the first of equally large groups: the one holding the lowest rank
    return sorted(r for g in groups if g is not majority for r in g)


# ---------------------------------------------------------------------------------------------------- windows
class CountWindow:
    """Running sum of a per-micro-batch count over one measuring window, kept where the count lives.

    Device counts are added in place into one float64 scalar on their device (one kernel, no sync); host counts stay
    a Python number. Not a ``torchmetrics.SumMetric``: its ``update`` costs about 21 us of host time against 2-4 us
    (``benchmarks/count_window.py``), on every micro-batch.
    """

    def __init__(self) -> None:
        self._device_sum: Tensor | None = None
        self._host_sum = 0.0

    def add(self, count: Tensor | int | float) -> None:
        if isinstance(count, Tensor):
            count = count.detach()
            if self._device_sum is None:
                self._device_sum = torch.zeros((), dtype=torch.float64, device=count.device)
            elif self._device_sum.device != count.device:
                self._device_sum = self._device_sum.to(count.device)
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


_SPAN_WEIGHTS: dict[tuple[int, torch.device], Tensor] = {}  # per mask width and device: rows [index, width - index]


def trimmed_positions(mask: Tensor | None, positions: int) -> Tensor | int:
    """Positions of a batch padded only to its longest row: rows x the span of columns holding a real token (a device
    tensor, no sync, for a 2-D attention mask; else ``positions``).

    The columns holding a real token times a cached ``(2, width)`` table of ``index`` and ``width - index``: the
    maxima are the last real column and ``width - first``; the span is their sum minus ``width - 1``."""
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


class WindowCounts:
    """The token counts of one measuring window: real tokens (no sync), positions and samples, and the trimmed
    positions sampled on the micro-batches passed with ``sample=True``, scaled to the window's positions."""

    def __init__(self) -> None:
        self.tokens, self.trimmed = CountWindow(), CountWindow()
        self.sampled = self.positions = self.samples = 0  # sampled: positions of the sampled micro-batches

    def add(self, tokens: Tensor | int, positions: int, samples: int, mask: Tensor | None, sample: bool) -> None:
        self.tokens.add(tokens)  # in place on the device: no sync, no collective
        if sample:
            self.trimmed.add(trimmed_positions(mask, positions))
            self.sampled += positions
        self.positions += positions
        self.samples += samples

    def take(self, device: torch.device) -> dict[str, Tensor | float]:
        """The window's ``tokens``, ``positions``, ``samples`` and ``trimmed_positions`` (device scalars or host
        numbers, no sync); the next window starts empty."""
        tokens, trimmed = self.tokens.total(device), self.trimmed.total(device)
        scaled = trimmed * (self.positions / self.sampled) if self.sampled > 0 else float(self.positions)
        out = {"tokens": tokens, "positions": self.positions, "samples": self.samples, "trimmed_positions": scaled}
        self.sampled = self.positions = self.samples = 0
        return out


class StepTimes:
    """Optimizer-step times (ms): the last ``window`` steps, and the early window (``baseline_steps`` steps after the
    first ``skip_steps``)."""

    def __init__(self, window: int, skip_steps: int, baseline_steps: int) -> None:
        self.recent: deque[float] = deque(maxlen=window)
        self.baseline = RunningWindow(baseline_steps)  # step times of the early window; full = ready
        self.skip_steps, self.baseline_steps = skip_steps, baseline_steps
        self.seen = 0  # optimizer steps ended so far (counted by the caller at each step's end)

    def add(self, times: Sequence[float]) -> bool:
        """Add the times of the last ``len(times)`` steps seen; True when some joined the early window."""
        skipped = self.seen - len(times)
        in_baseline = len(self.baseline)
        for i, t in enumerate(times):
            self.recent.append(t)
            if skipped + i >= self.skip_steps and len(self.baseline) < self.baseline_steps:
                self.baseline.add(t)
        return len(self.baseline) > in_baseline

    @property
    def ready(self) -> bool:
        """Whether the early window is complete."""
        return len(self.baseline) >= self.baseline_steps

    def median(self) -> float:
        """The median over the last ``window`` steps (the upper one of an even count; nan before any)."""
        return sorted(self.recent)[len(self.recent) // 2] if self.recent else float("nan")


# ---------------------------------------------------------------------------------------------------- machine load
@dataclass(frozen=True)
class LoadReading:
    """The run's CPU use over the median's steps against the early windows' (``ThroughputRow`` fields; NaN: unknown)."""

    contention_ratio: float  # (CPU time + run-queue wait) per CPU second of its threads, over the early windows
    cpu_ratio: float  # this process's CPU time per step over the early windows'
    mean_ratio: float  # mean wall time per step over the median's steps, over the early windows'


def _ratio(now: float, early: RunningWindow) -> float:
    base = early.median()  # NaN while empty
    return now / base if base > 0 else math.nan


class MachineLoad:
    """How the run used the CPU in its early windows and over the median's steps (the windows since its oldest step:
    one window of a few steps is noise on a shared machine), from :class:`~lightning_tfdebug.core.host.CpuWindow`
    readings; and the reference computation's early times."""

    def __init__(self, window: int) -> None:
        self.window = window
        self.contention_base = RunningWindow(16)  # (CPU + run-queue wait) / CPU of the early windows
        self.cpu_base = RunningWindow(16)  # this process's CPU time per step (ms) during the early window
        self.wall_base = RunningWindow(16)  # wall time per step (ms) of the early windows
        self.reference_base = RunningWindow(16)  # ms of `core.host.reference_work_ms` on the early measuring steps
        self.parallel_base = RunningWindow(16)  # the same at the run's thread count, waits left in
        # per measuring window since the median's oldest step: (steps, run-queue wait s, own CPU s, wall s)
        self.windows: deque[tuple[int, float, float, float]] = deque()

    def update(self, steps: int, early: bool, run_delay_s: float, own_cpu_s: float, wall_s: float) -> LoadReading:
        """Add one measuring window of ``steps`` steps (``early``: they joined the early window); read the span."""
        if steps:
            self.windows.append((steps, run_delay_s, own_cpu_s, wall_s))
            if early:
                self.cpu_base.add(own_cpu_s * 1e3 / steps)
                self.wall_base.add(wall_s * 1e3 / steps)
                if run_delay_s == run_delay_s and own_cpu_s > 0:
                    self.contention_base.add(1.0 + run_delay_s / own_cpu_s)
        while self.windows and sum(w[0] for w in self.windows) - self.windows[0][0] >= self.window:
            self.windows.popleft()
        span_steps, delay, cpu, wall = (sum(w[i] for w in self.windows) for i in range(4))
        if not span_steps:
            return LoadReading(math.nan, math.nan, math.nan)
        contention = 1.0 + delay / cpu if cpu > 0 else math.nan  # NaN without /proc (the waits are NaN)
        return LoadReading(
            _ratio(contention, self.contention_base),
            _ratio(cpu * 1e3 / span_steps, self.cpu_base),
            _ratio(wall * 1e3 / span_steps, self.wall_base),
        )

    def reference_ratio(
        self, early: bool, slow: bool, time_reference: Callable[[], float], parallel: bool = False
    ) -> float:
        """``time_reference()`` now over its early times, timed on ``early`` and ``slow`` measuring steps only (nan:
        not timed now); ``parallel``: the reference at the run's thread count, against its own early times."""
        base = self.parallel_base if parallel else self.reference_base
        if early:
            base.add(time_reference())
        elif slow and len(base):
            return time_reference() / base.median()
        return math.nan

    _STATE = {
        "contention_baseline": "contention_base",
        "cpu_baseline": "cpu_base",
        "wall_baseline": "wall_base",
        # timed on the machine that saved it: a run resumed on a slower machine is recognised as the machine's
        "reference_baseline": "reference_base",
        "parallel_baseline": "parallel_base",
    }

    def state_dict(self) -> dict[str, Any]:
        return {key: getattr(self, name).state_dict() for key, name in self._STATE.items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key, name in self._STATE.items():
            getattr(self, name).load_state_dict(state.get(key, {}))


# ---------------------------------------------------------------------------------------------------- peak FLOPs
# Dense peak FLOP/s per device (vendors' data sheets) where Lightning's `get_available_flops` is missing or wrong: its
# H200 entries match no CUDA name and are sparse, its "h100 nvl" is a pair of boards, it reads "L40S" as an L4, it
# lists GeForce bf16/fp16 at the fp32 rate, and it has no H800, A800, A10, AMD Instinct or fp8.
PEAK_FLOPS: dict[str, dict[str, float]] = {
    "h200 nvl": {"fp64": 30e12, "fp32": 60e12, "tf32": 418e12, "bf16": 835e12, "fp16": 835e12, "fp8": 1671e12},
    "h200": {"fp64": 34e12, "fp32": 67e12, "tf32": 495e12, "bf16": 989e12, "fp16": 989e12, "fp8": 1979e12},
    "gh200": {"fp64": 34e12, "fp32": 67e12, "tf32": 495e12, "bf16": 989e12, "fp16": 989e12, "fp8": 1979e12},
    "h100 nvl": {"fp64": 30e12, "fp32": 60e12, "tf32": 418e12, "bf16": 835e12, "fp16": 835e12, "fp8": 1671e12},
    "h100 pcie": {"fp8": 1513e12},
    "h100": {"fp8": 1979e12},
    "h800": {"fp32": 67e12, "tf32": 495e12, "bf16": 989e12, "fp16": 989e12, "fp8": 1979e12},
    "a800": {"fp64": 9.7e12, "fp32": 19.5e12, "tf32": 156e12, "bf16": 312e12, "fp16": 312e12},
    "a10": {"fp32": 31.2e12, "tf32": 62.5e12, "bf16": 125e12, "fp16": 125e12},
    "l40s": {"fp32": 91.6e12, "tf32": 183e12, "bf16": 362e12, "fp16": 362e12, "fp8": 733e12},
    "l40": {"fp8": 362e12},
    "l4": {"fp8": 242e12},
    "rtx 4090": {"fp32": 82.6e12, "tf32": 82.6e12, "bf16": 165.2e12, "fp16": 165.2e12},
    "rtx 3090": {"fp32": 35.6e12, "tf32": 35.6e12, "bf16": 71e12, "fp16": 71e12},
    "mi300x": {"fp64": 163.4e12, "fp32": 163.4e12, "tf32": 653.7e12, "bf16": 1307.4e12, "fp16": 1307.4e12},
    "mi250x": {"fp64": 95.7e12, "fp32": 95.7e12, "bf16": 383e12, "fp16": 383e12},
}


def peak_flops_for(device_name: str, compute: str) -> float | None:
    """Peak dense FLOP/s of ``device_name`` for ``compute`` (``"fp32"``, ``"tf32"``, ``"bf16"``, ``"fp16"``,
    ``"fp8"``, ``"fp64"``) from :data:`PEAK_FLOPS`, or None. Whole words, case-insensitive, most specific first
    (``"NVIDIA A10"`` -> ``a10``, ``"NVIDIA A100-SXM4-80GB"`` no entry); without TF32, ``"tf32"`` is fp32.
    """
    name = device_name.lower()
    for chip in sorted(PEAK_FLOPS, key=len, reverse=True):
        if all(re.search(rf"\b{re.escape(word)}\b", name) for word in chip.split()):
            table = PEAK_FLOPS[chip]
            if compute == "tf32" and "tf32" not in table:
                compute = "fp32"
            return table.get(compute)
    return None


def compute_precision(precision: str, tf32_allowed: bool) -> str:
    """Which precision column (of :data:`PEAK_FLOPS` and Lightning's table) a Trainer ``precision`` string runs its
    matmuls in."""
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
