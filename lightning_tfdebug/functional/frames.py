"""Frames: per-module abs-min / abs-max records of a forward and backward pass, kept on the device.

A *frame* is one module call: its name, its class, and the abs-min/abs-max of every floating-point tensor among its
inputs and outputs (backward frames: of the gradient reaching each output). :class:`FrameRecorder` records them
(replays), :class:`FrameFlags` keeps one output sum per call (every step, eager mode), and :func:`nan_report` turns a
replay into NaNFirstFrame's report (the layout of Hugging Face's ``DebugUnderflowOverflow``). Nothing here writes a
file.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from lightning_tfdebug.functional.finite import flagged_ranks
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
                    "abs_min": _num(e.abs_min),
                    "abs_max": _num(e.abs_max),
                    "fp16_headroom": _num(room["fp16"]),
                    "bf16_headroom": _num(room["bf16"]),
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


# -------------------------------------------------------------------- reports
def _num(x: float | None) -> float | str | None:
    if x is None:
        return None
    return x if math.isfinite(x) else str(x)


def _fmt(x: float | None) -> str:
    if x is None:
        return "-"
    if math.isinf(x) and x > 0:
        return "inf"
    return f"{x:.2e}"


def format_frames(title: str, frames: list[Frame]) -> list[str]:
    """Lines of a frame table: one header line per frame, then one line per tensor."""
    lines = [title, f"{'abs min':>10} {'abs max':>10} {'fp16 room':>10} {'bf16 room':>10}  dtype     metadata"]
    for frame in frames:
        mark = "" if frame.finite else "   <-- non-finite"
        lines.append(f"[{frame.index}] {frame.module} {frame.module_type}{mark}")
        for e in frame.entries:
            room = e.headroom()
            lines.append(
                f"{_fmt(e.abs_min):>10} {_fmt(e.abs_max):>10} {_fmt(room['fp16']):>10} {_fmt(room['bf16']):>10}  "
                f"{e.dtype:<9} {e.label}"
            )
    return lines


def rng_state(device: torch.device, cpu: Tensor | None = None) -> dict[str, Any]:
    """The CPU's (``cpu``: a state already taken) and ``device``'s generator states; host copies, no device sync."""
    state: dict[str, Any] = {"cpu": torch.get_rng_state() if cpu is None else cpu}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)  # a host copy of the generator's seed and offset
    return state


def set_rng_state(state: Mapping[str, Any], device: torch.device) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


def replay_frames(
    model: nn.Module,
    device: torch.device,
    micro_batches: Sequence[tuple[Any, int, Mapping[str, Any]]],
    run_step: Callable[[Any, int], Tensor | None],
    params: Sequence[Tensor],
    *,
    flags: bool = False,
    scale: Callable[[Tensor], Tensor] | None = None,
) -> tuple[FrameRecorder, FrameFlags | None, str | None]:
    """Run a step's micro-batches again, each from its RNG state (:func:`rng_state`), with frame hooks attached.

    Args:
        model: the module whose frames are recorded.
        device: its device (whose generator is restored with the CPU's).
        micro_batches: ``(batch, batch_idx, rng_state)`` per micro-batch, in order.
        run_step: the forward of one micro-batch, returning its loss (None: nothing to backward).
        params: the parameters whose ``.grad`` the replay's backward must not touch: their gradients are set aside
            and put back afterwards, and the replay's dropped.
        flags: also record the output sums of :class:`FrameFlags` (eager mode), to tell a float32 overflow of finite
            values (the sums overflow again) from a non-finite value the replay does not reproduce.
        scale: applied to each loss before its backward (a GradScaler's ``scale``).

    Returns:
        ``(recorder, flags or None, error)``: ``error`` is the replay's exception as text (None when it ran through);
        the hooks are removed and the RNG states put back either way.
    """
    recorder = FrameRecorder(model, backward=True)
    replay_flags = FrameFlags(model) if flags else None
    saved, grads, error = rng_state(device), [p.grad for p in params], None
    for p in params:
        p.grad = None
    try:
        with recorder, replay_flags if replay_flags is not None else contextlib.nullcontext():
            for batch, batch_idx, rng in list(micro_batches):
                set_rng_state(rng, device)
                loss = run_step(batch, batch_idx)
                if loss is None:
                    continue
                recorder.record_value(LOSS_FRAME, "loss", loss)
                if replay_flags is not None:
                    replay_flags.record_value(LOSS_FRAME, "loss", loss)
                if scale is not None:
                    loss = scale(loss)
                if loss.requires_grad:
                    loss.backward()
    except Exception as err:  # the report says the replay failed; the caller decides what the run does
        error = f"{type(err).__name__}: {err}"
    finally:
        set_rng_state(saved, device)
        for p, g in zip(params, grads):
            p.grad = g
    return recorder, replay_flags, error


def report_section(recorder: FrameRecorder, phase: str, max_frames: int) -> tuple[int | None, list[Frame]]:
    """The first non-finite frame of ``phase`` (or None) and the last ``max_frames`` frames up to it (or up to the end),
    forward frames led by their module's own weights. Host reads, report time only."""
    first = recorder.first_nonfinite(phase)
    n = recorder.count(phase)
    start, stop = window(first, max_frames) if first is not None else (max(0, n - max_frames), n)
    frames = recorder.frames(phase, start, stop)
    if phase == "forward":
        cache: dict[str, list[Entry]] = {}
        for frame in frames:
            if frame.module not in cache:
                module = recorder.module_of(frame.module)
                cache[frame.module] = weight_ranges(module) if module is not None else []
            frame.entries[:0] = cache[frame.module]
    return first, frames


def _named(first: int | None, frames: list[Frame]) -> dict[str, Any] | None:
    """The report's description of the replay's frame at position ``first``, or None."""
    if first is None:
        return None
    frame = next(f for f in frames if f.index == first)
    bad = next((e.label for e in frame.entries if not e.finite), None)
    return {"module": frame.module, "module_type": frame.module_type, "index": first, "tensor": bad, "source": "replay"}


def first_forward(
    replayed: dict[str, Any] | None,
    step_first: tuple[int, str, str, str] | None,
    error: str | None,
    replay_flags: FrameFlags | None,
) -> tuple[dict[str, Any] | None, bool | None, bool]:
    """``(first non-finite forward frame, reproduced, overflow)``.

    Lazy mode (no ``step_first``): the replay's frame. Eager mode: named from this step's flags; ``reproduced``: the
    replay saw one too; ``overflow``: it did not, and its sums overflow again over finite values (no frame).
    """
    if step_first is None:
        return replayed, None, False
    _, module, module_type, label = step_first
    reproduced = replayed is not None
    if not reproduced and error is None and replay_flags is not None and replay_flags.first_nonfinite():
        return None, reproduced, True
    index = replayed["index"] if replayed is not None and replayed["module"] == module else None
    return (
        {"module": module, "module_type": module_type, "index": index, "tensor": label, "source": "step"},
        reproduced,
        False,
    )


def nan_report(
    recorder: FrameRecorder,
    header: Mapping[str, Any],
    rows: Sequence[Sequence[float]],
    max_frames: int,
    *,
    error: str | None = None,
    step_first: tuple[int, str, str, str] | None = None,
    replay_flags: FrameFlags | None = None,
) -> tuple[dict[str, Any], list[str]]:
    """NaNFirstFrame's report of a bad step: the summary (``header``: step, batch, rank... first) and its text lines.

    Args:
        recorder: the replay's frames.
        header: ``step``, ``batch_idx``, ``micro_batches``, ``rank``, ``world_size``, ``precision``, ``mode``.
        rows: every rank's flags by name (``loss``, ``grad``, ``frame``; see ``functional.finite.flag_fields``).
        max_frames: frames shown per direction.
        error: the replay's error, if it failed.
        step_first, replay_flags: eager mode, see :func:`first_forward`.
    """
    first_fwd, fwd = report_section(recorder, "forward", max_frames)
    first_bwd, bwd = report_section(recorder, "backward", max_frames)
    replayed = _named(first_fwd, fwd)
    forward, reproduced, overflow = first_forward(replayed, step_first, error, replay_flags)
    row, (bad_ranks, frame_ranks) = rows[header["rank"]], flagged_ranks(rows)
    summary: dict[str, Any] = {
        **header,
        "loss_nonfinite": bool(row["loss"] > 0),
        "grad_nonfinite": bool(row["grad"] > 0),
        "nonfinite_ranks": bad_ranks,
        "frame_nonfinite_ranks": frame_ranks,
        "first_forward": forward,
        "first_backward": _named(first_bwd, bwd),
        "replay_first_forward": replayed,
        "replay_reproduced": reproduced,
        "flag_was_sum_overflow": overflow,
        "frames_recorded": {"forward": recorder.count("forward"), "backward": recorder.count("backward")},
        "replay_error": error,
        "forward_frames": [f.to_dict() for f in fwd],
        "backward_frames": [f.to_dict() for f in bwd],
    }
    return summary, report_lines(summary, fwd, bwd)


def report_lines(summary: Mapping[str, Any], fwd: list[Frame], bwd: list[Frame]) -> list[str]:
    """The text of a report: what was found, then the forward and the backward frame tables."""
    s, ff, fb, replayed = summary, summary["first_forward"], summary["first_backward"], summary["replay_first_forward"]
    lines = [
        f"NaNFirstFrame report: step {s['step']}, batch {s['batch_idx']}, rank {s['rank']} of {s['world_size']}, "
        f"precision {s['precision']}, mode {s['mode']}",
        f"non-finite loss or gradients on rank(s): {s['nonfinite_ranks'] or 'none'}; "
        f"non-finite module outputs on rank(s): {s['frame_nonfinite_ranks'] or 'none'}",
        "first non-finite forward frame on this rank: "
        + (f"{ff['module']} ({ff['module_type']}), {ff['tensor']}" if ff else "none"),
        "first non-finite gradient on this rank reached the output of: "
        + (f"{fb['module']} ({fb['module_type']})" if fb else "none"),
    ]
    if s["replay_reproduced"] is False and not s["flag_was_sum_overflow"]:
        lines.append(
            "the first forward frame is named from this step's output sums: the replay did not reproduce the "
            "non-finite value (a nondeterministic inf/nan); the frames below are the replay's"
        )
    elif s["replay_reproduced"] and replayed is not None and ff is not None and replayed["module"] != ff["module"]:
        lines.append(f"the replay's first non-finite forward frame differs: {replayed['module']}")
    if s["flag_was_sum_overflow"]:
        lines.append(
            "this step's flagged output sum overflowed float32 while every value was finite (exact abs ranges "
            "of the replay): no inf/nan"
        )
    if s["replay_error"]:
        lines.append(f"the replay failed: {s['replay_error']}")
    lines.append("")
    lines += format_frames(f"Last {len(fwd)} forward frames (call order):", fwd)
    lines.append("")
    lines += format_frames(f"Last {len(bwd)} backward frames (order gradients arrived):", bwd)
    return lines
