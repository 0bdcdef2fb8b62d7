"""NaNFirstFrame's replay and report: the step replayed under a
:class:`~lightning_tfdebug.functional.frames.FrameRecorder` with the RNG it started with, and the recorded frames
turned into the report (the layout of Hugging Face's ``DebugUnderflowOverflow``). Nothing here writes a file.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from lightning_tfdebug.functional.finite import flagged_ranks
from lightning_tfdebug.functional.frames import (
    LOSS_FRAME,
    Entry,
    Frame,
    FrameFlags,
    FrameRecorder,
    weight_ranges,
    window,
)

# -------------------------------------------------------------------- reports


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
