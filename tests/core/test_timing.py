"""Timing without a device sync (core/timing.py): the step clock."""

import time

import torch

from lightning_tfdebug.core.timing import StepClock


def test_step_clock_on_cpu_reads_the_host_clock():
    clock = StepClock(torch.device("cpu"))
    start = clock.mark()
    time.sleep(0.01)
    end = clock.mark()
    clock.wait(end)  # no-op on CPU
    assert not clock.cuda and clock.elapsed_ms(start, end) >= 9.0
