"""Frames: per-module abs-min / abs-max records of a forward and backward pass, kept on the device.

A *frame* is one module call: its name, its class, and the abs-min/abs-max of every floating-point tensor among its
inputs and outputs (backward frames: of the gradient reaching each output). :class:`FrameRecorder` records them
(replays), :class:`FrameFlags` keeps one output sum per call (every step, eager mode);
:mod:`~lightning_tfdebug.functional.frame_reports` replays a step and turns the frames into NaNFirstFrame's report.
Nothing here writes a file.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from lightning_tfdebug.primitives.tensors import clean_param_name, local_tensor

FP16_MAX = float(torch.finfo(torch.float16).max)
BF16_MAX = float(torch.finfo(torch.bfloat16).max)
_INF = float("inf")
LOSS_FRAME = "training_step"
"""The pseudo-module under which the loss ``training_step`` returned is recorded: a frame of its own."""


def iter_float_tensors(obj: Any, label: str, _depth: int = 0) -> Iterator[tuple[str, Tensor]]:
    """Yield ``(label, tensor)`` for every non-empty floating-point tensor nested in ``obj`` (tuples, lists, dicts,
    dataclasses, named tuples: ``output[0]``, ``output['logits']``, ``output.hidden``)."""
    if _depth > 6:
        return
    if isinstance(obj, Tensor):
        if (obj.is_floating_point() or obj.is_complex()) and obj.numel() > 0:
            yield label, obj
    elif isinstance(obj, dict):
        for key, value in obj.items():
            yield from iter_float_tensors(value, f"{label}[{key!r}]", _depth + 1)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            yield from iter_float_tensors(getattr(obj, f.name, None), f"{label}.{f.name}", _depth + 1)
    elif isinstance(obj, tuple) and hasattr(obj, "_fields"):  # named tuple
        for name in obj._fields:
            yield from iter_float_tensors(getattr(obj, name), f"{label}.{name}", _depth + 1)
    elif isinstance(obj, (tuple, list)):
        for i, value in enumerate(obj):
            yield from iter_float_tensors(value, f"{label}[{i}]", _depth + 1)


def abs_range(tensor: Tensor) -> tuple[Tensor, Tensor]:
    """``(abs_min, abs_max)`` of a tensor as 0-d float32 device tensors (nan and inf propagate); no host sync.

    ``torch.linalg.vector_norm(ord=+-inf)`` would avoid the ``abs`` copy but is about 20x slower on CPU.
    """
    t = local_tensor(tensor.detach()).abs()  # memory: a copy of the tensor (at a replay or a report, not a step)
    low, high = torch.aminmax(t)
    return low.float(), high.float()


def json_number(x: float | None) -> float | str | None:
    """``x`` as JSON can hold it: a finite float as is, inf/nan as a string, None as None."""
    if x is None:
        return None
    return x if math.isfinite(x) else str(x)


@dataclass
class Entry:
    """One tensor of a frame, on the host."""

    label: str
    dtype: str
    abs_min: float
    abs_max: float

    @property
    def finite(self) -> bool:
        return math.isfinite(self.abs_max) and math.isfinite(self.abs_min)

    def headroom(self) -> dict[str, float | None]:
        """How many times ``abs_max`` could still grow before overflowing fp16 and bf16 (``None`` if not finite)."""
        if not self.finite:
            return {"fp16": None, "bf16": None}
        if self.abs_max == 0:
            return {"fp16": _INF, "bf16": _INF}
        return {"fp16": FP16_MAX / self.abs_max, "bf16": BF16_MAX / self.abs_max}


@dataclass
class Frame:
    """One module call (forward) or one gradient reaching a module's output (backward), on the host."""

    index: int
    phase: str
    module: str
    module_type: str
    entries: list[Entry] = field(default_factory=list)

    @property
    def finite(self) -> bool:
        return all(e.finite for e in self.entries)

    def to_dict(self) -> dict[str, Any]:
        entries = []
        for e in self.entries:
            room = e.headroom()
            entries.append(
                {
                    "label": e.label,
                    "dtype": e.dtype,
                    "abs_min": json_number(e.abs_min),
                    "abs_max": json_number(e.abs_max),
                    "fp16_headroom": json_number(room["fp16"]),
                    "bf16_headroom": json_number(room["bf16"]),
                }
            )
        fields = ("index", "phase", "module", "module_type", "finite")
        return {**{name: getattr(self, name) for name in fields}, "entries": entries}


@dataclass
class _Record:
    """A frame while it is still on the device."""

    phase: str
    module: int  # index into FrameRecorder.names
    labels: list[str]
    dtypes: list[str]
    stats: list[Tensor]  # 2 * len(labels) 0-d tensors: abs_min, abs_max per entry


_TASK_ID = getattr(torch._C, "_current_graph_task_id", None)


def _graph_task_running() -> bool:
    """True inside the autograd engine, e.g. while activation checkpointing recomputes a forward."""
    return _TASK_ID is not None and _TASK_ID() != -1


def _stacked(values: list[Tensor]) -> Tensor:
    """0-d tensors stacked on the device of the first."""
    device = values[0].device
    return torch.stack([v if v.device == device else v.to(device) for v in values])


def _first_nonfinite(values: list[Tensor]) -> int | None:
    """Index of the first of ``values`` (0-d device tensors) that is inf or nan, or None. One host read."""
    if not values:
        return None
    flags = torch.isfinite(_stacked(values)).logical_not_()
    found, entry = torch.stack([flags.any().float(), flags.int().argmax().float()]).tolist()  # host sync (one)
    return int(entry) if found else None


class _ModuleHooks:
    """What :class:`FrameRecorder` and :class:`FrameFlags` share: the submodules' clean names, one forward hook on
    each (:meth:`_hook`; a context manager), and extra names for values that are not modules (the loss)."""

    def __init__(self, model: nn.Module, max_records: int) -> None:
        self.max_records = max_records
        self.names: list[str] = []
        self.types: list[str] = []
        self.modules: list[nn.Module] = []
        for name, module in model.named_modules():
            self.names.append(clean_param_name(name) or "<root>")
            self.types.append(type(module).__name__)
            self.modules.append(module)
        self.enabled = True
        self._handles: list[Any] = []
        self._extra_names: dict[str, int] = {}

    def _hook(self, index: int) -> Any:
        raise NotImplementedError

    def attach(self) -> Any:
        if not self._handles:
            self._handles = [m.register_forward_hook(self._hook(i)) for i, m in enumerate(self.modules)]
        return self

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def __enter__(self) -> Any:
        return self.attach()

    def __exit__(self, *exc: Any) -> None:
        self.detach()

    def _extra_index(self, name: str) -> int:
        """The index of a named value that is not a module (added once, with type ``-``)."""
        if name not in self._extra_names:
            self._extra_names[name] = len(self.names)
            self.names.append(name)
            self.types.append("-")
            self.modules.append(nn.Module())
        return self._extra_names[name]


class FrameRecorder(_ModuleHooks):
    """Attach forward (and optionally gradient) hooks to every submodule and record frames on the device.

    Args:
        model: the root module; submodules are named by `clean_param_name` (wrapper segments dropped).
        backward: also record the gradient reaching each module output (tensor hooks registered in the forward hook).
        max_records: stop recording after this many frames in one pass (a safety bound for huge models).

    Use as a context manager, or :meth:`attach` / :meth:`detach` (idempotent; call it in a ``finally``). Calls made
    inside the autograd engine (activation-checkpoint recomputation) and while :attr:`enabled` is False are skipped.
    """

    def __init__(self, model: nn.Module, backward: bool = True, max_records: int = 100_000) -> None:
        super().__init__(model, max_records)
        self.model = model
        self.backward = backward
        self.records: list[_Record] = []

    def _hook(self, index: int) -> Any:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            if not self.enabled or len(self.records) >= self.max_records or _graph_task_running():
                return
            with torch.no_grad():
                self._record("forward", index, [("input", args), ("output", output)])
            if self.backward and torch.is_grad_enabled():
                for label, tensor in iter_float_tensors(output, "output"):
                    if tensor.requires_grad:
                        tensor.register_hook(self._grad_hook(index, label))

        return hook

    def _grad_hook(self, index: int, label: str) -> Any:
        def hook(grad: Tensor) -> None:
            if self.enabled and len(self.records) < self.max_records:
                with torch.no_grad():
                    self._record("backward", index, [(f"grad {label}", grad)])

        return hook

    def _record(self, phase: str, index: int, groups: list[tuple[str, Any]]) -> None:
        labels, dtypes, stats = [], [], []
        for prefix, obj in groups:
            for label, tensor in iter_float_tensors(obj, prefix):
                lo, hi = abs_range(tensor)
                labels.append(label)
                dtypes.append(str(tensor.dtype).replace("torch.", ""))
                stats.extend((lo, hi))
        if labels:
            self.records.append(_Record(phase, index, labels, dtypes, stats))

    def record_value(self, name: str, label: str, value: Any, phase: str = "forward") -> None:
        """Record a frame for something that is not a module (e.g. the loss ``training_step`` returned)."""
        index = self._extra_index(name)
        with torch.no_grad():
            self._record(phase, index, [(label, value)])

    def clear(self) -> None:
        self.records.clear()

    def first_nonfinite(self, phase: str) -> int | None:
        """Position (among frames of ``phase``) of the first frame holding inf or nan, or None. One host read."""
        records = [r for r in self.records if r.phase == phase]
        entry = _first_nonfinite([s for r in records for s in r.stats[1::2]])  # a nan shows in the max too
        if entry is None:
            return None
        seen = 0
        for position, r in enumerate(records):
            seen += len(r.labels)
            if entry < seen:
                return position
        return None

    def frames(self, phase: str, start: int = 0, stop: int | None = None) -> list[Frame]:
        """Frames of ``phase`` in ``[start, stop)`` moved to the host (one transfer)."""
        records = [r for r in self.records if r.phase == phase][start:stop]
        if not records:
            return []
        flat = _stacked([s for r in records for s in r.stats]).tolist()  # host sync
        out, k = [], 0
        for offset, r in enumerate(records):
            entries = []
            for label, dtype in zip(r.labels, r.dtypes):
                entries.append(Entry(label, dtype, flat[k], flat[k + 1]))
                k += 2
            out.append(Frame(start + offset, phase, self.names[r.module], self.types[r.module], entries))
        return out

    def count(self, phase: str) -> int:
        return sum(1 for r in self.records if r.phase == phase)

    def module_of(self, name: str) -> nn.Module | None:
        try:
            return self.modules[self.names.index(name)]
        except ValueError:
            return None


def output_sum(tensor: Tensor) -> Tensor:
    """``tensor``'s float32 sum in one kernel: non-finite when it holds inf or nan (or, never in a healthy run,
    when finite values sum past ~3.4e38; confirm a flag with exact abs ranges)."""
    t = tensor.detach()
    if type(t) is not Tensor:
        t = local_tensor(t)
    if t.is_complex():
        t = torch.view_as_real(t)
    # memory: none for fp32, and none on CUDA (which converts fp16/bf16 as it reads); the CPU kernel converts a bf16 or
    # fp16 output to fp32 first, one output at a time
    return t.sum(dtype=torch.float32)


class FrameFlags(_ModuleHooks):
    """The cheap every-step counterpart of :class:`FrameRecorder`: one :func:`output_sum` per floating-point module
    output (one kernel each, no host sync), no inputs, no gradient hooks, at most ``max_records`` per pass.

    :meth:`nonfinite` turns a pass into one device flag; :meth:`first_nonfinite` names the first flagged call with one
    host read. Skips what :class:`FrameRecorder` skips.
    """

    def __init__(self, model: nn.Module, max_records: int = 100_000) -> None:
        super().__init__(model, max_records)
        self.indices: list[int] = []  # module index per entry
        self.labels: list[str] = []  # tensor label per entry
        self.sums: list[Tensor] = []  # output_sum per entry

    def _hook(self, index: int) -> Any:
        indices, labels, sums = self.indices, self.labels, self.sums
        tensor_type, float32 = Tensor, torch.float32

        def hook(module: nn.Module, args: Any, output: Any) -> None:
            # the path every call of every module takes on every step: as few Python calls and torch ops as possible
            if not self.enabled or len(sums) >= self.max_records or (_TASK_ID is not None and _TASK_ID() != -1):
                return
            if type(output) is tensor_type and output.is_floating_point():  # the common case, inlined
                indices.append(index)
                labels.append("output")
                sums.append(output.detach().sum(dtype=float32))
                return
            for label, tensor in iter_float_tensors(output, "output"):
                indices.append(index)
                labels.append(label)
                sums.append(output_sum(tensor))

        return hook

    def record_value(self, name: str, label: str, value: Any) -> None:
        """Record an entry for something that is not a module (e.g. the loss ``training_step`` returned)."""
        if not self.enabled:
            return
        index = self._extra_index(name)
        for lab, tensor in iter_float_tensors(value, label):
            self.indices.append(index)
            self.labels.append(lab)
            self.sums.append(output_sum(tensor))

    def clear(self) -> None:
        self.indices.clear()
        self.labels.clear()
        self.sums.clear()

    def count(self) -> int:
        return len(self.sums)

    def nonfinite(self) -> Tensor | None:
        """1.0 when some recorded sum is inf or nan, else 0.0; a device scalar, no host sync (None if empty)."""
        if not self.sums:
            return None
        return torch.isfinite(_stacked(self.sums)).logical_not_().any().float()

    def first_nonfinite(self) -> tuple[int, str, str, str] | None:
        """``(entry position, module name, module type, tensor label)`` of the first non-finite sum, or None; one
        host read (report time only)."""
        i = _first_nonfinite(self.sums)
        if i is None:
            return None
        module = self.indices[i]
        return i, self.names[module], self.types[module], self.labels[i]


def weight_ranges(module: nn.Module) -> list[Entry]:
    """Abs-min/abs-max of a module's own floating-point parameters (local shards under FSDP2), on the host."""
    params = [(n, p) for n, p in module.named_parameters(recurse=False) if p.is_floating_point() and p.numel() > 0]
    params = [(n, p) for n, p in params if local_tensor(p).numel() > 0]
    if not params:
        return []
    stats = torch.stack([s for _, p in params for s in abs_range(p)]).tolist()  # host sync, report time only
    return [
        Entry(n, str(p.dtype).replace("torch.", ""), stats[2 * i], stats[2 * i + 1]) for i, (n, p) in enumerate(params)
    ]


def window(first: int, max_frames: int) -> tuple[int, int]:
    """``[start, stop)`` of the ring of the last ``max_frames`` frames ending with frame ``first``."""
    return max(0, first - max_frames + 1), first + 1
