"""Readers of the host (core/host.py): process memory, the machine's load, the reference computation, torch.compile's
counters and the device's peak FLOP/s (Lightning's table first where it knows the chip, ours for what it lacks)."""

import math
import os
import sys
import time
import types

import pytest
import torch

from lightning_tfdebug.core import host


def test_process_memory_and_the_cpu_reading():
    assert host.process_rss_bytes() > 10 * 2**20
    assert host.peak_rss_bytes() >= host.process_rss_bytes() * 0.5
    reading = host.memory_reading(torch.device("cpu"))
    assert reading.peak == host.peak_rss_bytes() or reading.peak >= reading.reserved * 0.5
    assert reading.capacity == float(host.physical_memory_bytes() or 0) and reading.capacity > reading.reserved
    assert set(reading._asdict()) == {"peak", "reserved", "capacity"}


@pytest.mark.skipif(not os.path.exists("/proc/self/task"), reason="reads /proc")
def test_the_cpu_window_reads_this_process_cpu_time_and_run_queue_waits():
    delays = host.thread_run_delays()
    assert delays and all(isinstance(v, int) and v >= 0 for v in delays.values())
    window = host.CpuWindow()
    window.start()
    end = time.perf_counter() + 0.05
    while time.perf_counter() < end:  # this process busy
        pass
    window.stop()
    assert window.own_cpu_s > 0 and window.wall_s >= 0.05 and window.run_delay_s >= 0


def test_the_reference_computation_spans_its_time_on_the_cpu_and_leaves_the_users_generator_alone():
    state = torch.get_rng_state()
    threads = torch.get_num_threads()
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)  # a user's default: the reference stays CPU float32, comparable over a fit
    try:
        start = time.perf_counter()
        per_round = host.reference_work_ms(span_ms=5.0)
        spent_ms = (time.perf_counter() - start) * 1e3
    finally:
        torch.set_default_dtype(default)
    assert torch.equal(torch.get_rng_state(), state)
    assert spent_ms >= 5.0 and 0 < per_round <= spent_ms / 2  # two rounds at least, and the mean of the rounds
    assert all(b.device.type == "cpu" and b.dtype == torch.float32 for b in host._REFERENCE_BUFFERS)
    assert sum(b.numel() * 4 for b in host._REFERENCE_BUFFERS) < 2**19  # 0.4 MiB, once per process
    assert torch.get_num_threads() == threads  # one thread while it runs, the user's count restored


def test_the_parallel_reference_runs_at_the_runs_thread_count_with_its_waits(monkeypatch):
    seen = []
    real_mm = torch.mm

    def mm(*args, **kwargs):
        seen.append(torch.get_num_threads())
        return real_mm(*args, **kwargs)

    monkeypatch.setattr(torch, "mm", mm)
    monkeypatch.setattr(host, "thread_run_delay_ns", lambda: pytest.fail("the parallel reference keeps its waits"))
    threads = torch.get_num_threads()
    assert host.reference_work_ms(span_ms=2.0, parallel=True) > 0
    assert seen and set(seen) == {threads} and torch.get_num_threads() == threads


def test_compile_watch_counts_graphs_after_the_early_window_and_limit_hits_since_the_start(monkeypatch):
    counters = {"stats": {"unique_graphs": 3}, "unimplemented": {"cache_size_limit reached\nat f": 1}}
    monkeypatch.setitem(sys.modules, "torch._dynamo.utils", types.SimpleNamespace(counters=counters))
    assert host.compile_counts() == (3.0, 1.0)
    watch = host.CompileWatch()
    watch.start()  # one hit before this fit: not its own
    new_graphs, hits = watch.since(False)
    assert math.isnan(new_graphs) and hits == 0.0  # graphs compiled during the early window are expected
    counters["stats"]["unique_graphs"] = 5
    assert watch.since(True) == (0.0, 0.0)  # the early window ends: counted from here
    counters["stats"]["unique_graphs"] = 7
    counters["unimplemented"]["recompile_limit hit"] = 2
    assert watch.since(True) == (2.0, 2.0)
    monkeypatch.delitem(sys.modules, "torch._dynamo.utils")
    assert all(math.isnan(v) for v in host.compile_counts())  # nothing compiled in this process


@pytest.mark.parametrize(
    "name, precision, tf32, expected",
    [
        ("NVIDIA H100 80GB HBM3", "bf16-mixed", False, 989.4e12),  # Lightning's
        ("NVIDIA H100 PCIe", "bf16-mixed", False, 756e12),  # Lightning's
        ("NVIDIA A100-SXM4-80GB", "32-true", True, 156e12),  # Lightning's, TF32 allowed
        ("NVIDIA A10G", "16-mixed", False, 125e12),  # Lightning's
        ("NVIDIA L4", "bf16-mixed", False, 121e12),  # Lightning's
        ("Tesla V100-SXM2-16GB", "32-true", True, 15.7e12),  # Lightning's; no TF32 on Volta: plain fp32
        ("Tesla T4", "bf16-mixed", False, None),  # no bf16 on Turing
        ("NVIDIA H100 NVL", "16-mixed", False, 835e12),  # ours: Lightning's figure is for a pair of boards
        ("NVIDIA H100 80GB HBM3", "transformer-engine", False, 1979e12),  # ours: Lightning has no fp8 column
        ("NVIDIA H200", "32-true", True, 495e12),  # ours: Lightning's H200 names do not match
        ("NVIDIA L40S", "bf16-mixed", False, 362e12),  # ours: Lightning reads it as an L4
        ("Some Unknown Accelerator", "bf16-mixed", False, None),
    ],
)
def test_device_peak_flops_asks_lightning_where_it_knows_the_chip(monkeypatch, name, precision, tf32, expected):
    # The real thing needs that CUDA device: its name (and, for fp32, its generation) stand in for it here
    import lightning.fabric.accelerators.cuda as lightning_cuda

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    monkeypatch.setattr(lightning_cuda, "_is_ampere_or_later", lambda device=None: "V100" not in name)
    monkeypatch.setattr(torch, "get_float32_matmul_precision", lambda: "high" if tf32 else "highest")
    assert host.device_peak_flops(torch.device("cuda", 0), precision) == expected


def test_device_peak_flops_is_none_off_cuda():
    assert host.device_peak_flops(torch.device("cpu"), "bf16-mixed") is None
    assert host.lightning_peak_flops(torch.device("cpu"), "fp8") is None  # no such column in Lightning's table
