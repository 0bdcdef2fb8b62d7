"""MemoryWatch's readings of the device and the process: the memory held on a measuring step, the memory the process
may use (CUDA: the device's free plus this process's reserved; CPU: the cgroup limit or the machine's memory), and
CUDA's allocator history. Host numbers out; the process readers of :mod:`lightning_tfdebug.core.host` are reused."""

from __future__ import annotations

import contextlib
import os
from typing import NamedTuple

import torch

from lightning_tfdebug.core.host import peak_rss_bytes, physical_memory_bytes, process_rss_bytes
from lightning_tfdebug.functional.memory_checks import size_text

#: The backends whose memory MemoryWatch can read.
READABLE = ("cuda", "cpu")

_CGROUP_FILES = ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes")


def cgroup_limit_bytes(files: tuple[str, ...] = _CGROUP_FILES) -> int | None:
    """The memory limit of this process's cgroup (v2 ``memory.max``, v1 ``memory.limit_in_bytes``), or None when
    there is none ("max", or v1's huge "unlimited" value) or it cannot be read."""
    for path in files:
        try:
            with open(path) as f:
                text = f.read().strip()
        except OSError:
            continue
        if text == "max" or not text.isdigit():
            return None
        value = int(text)
        return value if value < 2**60 else None  # v1 writes "unlimited" as a page-rounded 2**63
    return None


def cpu_limit_bytes() -> float:
    """What this process may use on the host: the smaller of its cgroup's limit and the machine's memory (0:
    unknown)."""
    limits = [v for v in (cgroup_limit_bytes(), physical_memory_bytes()) if v]
    return float(min(limits)) if limits else 0.0


class Reading(NamedTuple):
    """The memory of one measuring step (bytes). ``held``: CUDA, the allocator's peak so far; CPU, the resident set
    after the forward (the activations held for the backward). ``limit``: what the process may use; ``total``: the
    device's memory (CPU: the limit)."""

    held: float
    limit: float
    total: float


def cuda_reading(device: torch.device) -> Reading:
    """CUDA's allocator peak so far, and the memory this process may use: the device's free memory plus what its own
    allocator reserved (``cudaMemGetInfo``: a driver query, no device sync)."""
    free, total = torch.cuda.mem_get_info(device)
    reserved = torch.cuda.memory_reserved(device)
    return Reading(float(torch.cuda.max_memory_allocated(device)), float(free + reserved), float(total))


def resident_bytes() -> float:
    """The resident set of this process now (``/proc/self/statm``)."""
    return float(process_rss_bytes())


def held_now(device: torch.device) -> float:
    """The memory held now (CUDA: allocated; CPU: the resident set), for the base before the first batch."""
    if device.type == "cuda":
        return float(torch.cuda.memory_allocated(device))
    return float(process_rss_bytes())


def at_failure(device: torch.device) -> str:
    """One clause on the memory at the failure (host-side bookkeeping only: a CUDA context after an out-of-memory
    error still answers), or ""."""
    with contextlib.suppress(Exception):
        if device.type == "cuda":
            return (
                f" At the failure: {size_text(torch.cuda.memory_allocated(device))} allocated, peak "
                f"{size_text(torch.cuda.max_memory_allocated(device))}, "
                f"{size_text(torch.cuda.memory_reserved(device))} reserved."
            )
        if device.type == "cpu":
            return f" At the failure: peak resident set {size_text(peak_rss_bytes())}."
    return ""


# ------------------------------------------------------------------------------------------------- CUDA history
HISTORY_ENTRIES = 100_000
"""Allocator events kept by the memory history (PyTorch's own default)."""


def start_history() -> bool:
    """Start recording CUDA's allocator history (stacks of every allocation); False where this torch cannot."""
    record = getattr(torch.cuda.memory, "_record_memory_history", None)
    if record is None:
        return False
    record(max_entries=HISTORY_ENTRIES)
    return True


def stop_history() -> None:
    """Stop recording CUDA's allocator history."""
    with contextlib.suppress(Exception):
        torch.cuda.memory._record_memory_history(enabled=None)


def dump_history(directory: str) -> str | None:
    """Write the recorded history to ``<directory>/memory_snapshot.pickle``; its path, or None where it failed."""
    path = os.path.join(directory, "memory_snapshot.pickle")
    try:
        os.makedirs(directory, exist_ok=True)
        torch.cuda.memory._dump_snapshot(path)
    except Exception:
        return None
    return path


def viewer_command(path: str) -> str:
    """The one line that opens a snapshot in PyTorch's memory viewer."""
    return (
        f"python -m torch.cuda._memory_viz trace_plot {path} -o memory_trace.html (or drop the file on "
        "https://pytorch.org/memory_viz)"
    )
