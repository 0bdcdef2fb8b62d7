"""``torch.profiler`` over optimizer steps ``[start, stop)`` (a trace and a table of the top operators), and the model
FLOPs of one real micro-batch (``FlopCounterMode``); on every other step, one comparison."""

from __future__ import annotations

import os
from typing import Any

from lightning.pytorch.utilities import rank_zero_info

from lightning_tfdebug.core.io import write_atomic, write_text


def check_profile_steps(profile_steps: Any) -> None:
    """Raise a ValueError unless ``profile_steps`` is ``[start, stop]`` with integers ``0 <= start < stop``, or None."""
    if profile_steps is None:
        return
    ok = (
        isinstance(profile_steps, (list, tuple))
        and len(profile_steps) == 2
        and all(isinstance(s, int) and not isinstance(s, bool) for s in profile_steps)
        and 0 <= profile_steps[0] < profile_steps[1]
    )
    if not ok:
        raise ValueError(
            f"`profile_steps` must be [start, stop] with integers 0 <= start < stop, or None; got {profile_steps!r}."
        )


class StepProfiler:
    """``torch.profiler`` over optimizer steps ``start <= step < stop`` (None: never), CPU and CUDA activity; then a
    Chrome trace and the ``row_limit`` top operators by self time, per rank."""

    def __init__(self, steps: tuple[int, int] | None, row_limit: int) -> None:
        self.steps = steps
        self.row_limit = row_limit
        self._running: Any = None

    def maybe_start(self, step: int, cuda: bool) -> None:
        """Start at the first optimizer step of the range (``step``: the one whose first micro-batch starts)."""
        if self.steps is None or self._running is not None or step != self.steps[0]:
            return
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]
        self._running = profile(activities=activities, record_shapes=True)
        self._running.__enter__()

    def maybe_stop(self, finished_step: int | None, out_dir: str, rank: int, cuda: bool) -> None:
        """Stop after the range's last step (``finished_step``: the step that just ended; None: now, the fit ends) and
        write ``rank<r>.pt.trace.json`` and ``rank<r>-top_ops.txt`` to ``out_dir``."""
        if self._running is None or self.steps is None:
            return
        if finished_step is not None and finished_step + 1 < self.steps[1]:
            return
        profiler, self._running = self._running, None
        profiler.__exit__(None, None, None)
        trace = os.path.join(out_dir, f"rank{rank}.pt.trace.json")
        written = write_atomic(trace, profiler.export_chrome_trace)  # False (warned once) if the disk refuses
        sort_by = "self_cuda_time_total" if cuda else "self_cpu_time_total"
        table = profiler.key_averages().table(sort_by=sort_by, row_limit=self.row_limit)
        top = os.path.join(out_dir, f"rank{rank}-top_ops.txt")
        header = f"optimizer steps {self.steps[0]} to {self.steps[1] - 1}, rank {rank}"
        if write_text(top, f"{header}\n{table}\n") and written:
            rank_zero_info(f"ThroughputMonitor: profile written to {trace} (Perfetto / TensorBoard) and {top}.")


class FlopCount:
    """FLOPs per token position that ``FlopCounterMode`` counts (matmuls, attention) while open on one micro-batch."""

    def __init__(self) -> None:
        self._counter: Any = None
        self._positions = 0

    @property
    def counting(self) -> bool:
        return self._counter is not None

    def start(self, positions: int) -> None:
        """Count from now on, for a micro-batch of ``positions`` token positions."""
        from torch.utils.flop_counter import FlopCounterMode

        self._counter = FlopCounterMode(display=False)
        self._counter.__enter__()
        self._positions = positions

    def stop(self) -> float | None:
        """Stop counting: FLOPs per token position, or None (not counting, or nothing counted)."""
        counter, self._counter = self._counter, None
        if counter is None:
            return None
        counter.__exit__(None, None, None)
        flops = counter.get_total_flops()
        return flops / self._positions if flops > 0 and self._positions > 0 else None
