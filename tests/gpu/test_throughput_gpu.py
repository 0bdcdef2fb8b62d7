"""CUDA paths of ThroughputMonitor and PerRankLogger: event timing, no sync on other steps, memory and MFU.

Skipped without a GPU (run: ``pytest -m gpu tests/gpu/test_throughput_gpu.py``).
"""

import time
import warnings

import lightning.pytorch as pl
import pytest
import torch

from lightning_tfdebug import PerRankLogger, ThroughputMonitor
from lightning_tfdebug.core.host import device_peak_flops
from lightning_tfdebug.demo import TinyGPT, TinyTextDataModule
from tests.helpers import make_trainer, read_scalars

pytestmark = pytest.mark.gpu
SMALL = dict(d_model=64, n_layers=2, n_heads=4)


def fit(tmp_path, callbacks, **kwargs):
    trainer = make_trainer(tmp_path, callbacks, accelerator="cuda", devices=1, **kwargs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(TinyGPT(**SMALL), TinyTextDataModule(batch_size=16))
    return trainer


class SyncedReference(pl.Callback):
    """Independent count of real tokens, with a device sync and a host stamp at every optimizer-step end."""

    def __init__(self):
        self.tokens, self.ends, self.cumulative = 0, {}, {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.step = trainer.global_step
        self.tokens += int(batch["attention_mask"].sum())

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step != self.step:
            torch.cuda.synchronize()
            self.ends[self.step] = time.perf_counter()
            self.cumulative[self.step] = self.tokens


class SyncGuard(pl.Callback):
    """Turns CUDA's sync debug mode to "error" around the callbacks between ``Arm`` and ``Disarm`` on steps that do
    not measure, so any host sync there raises."""

    def __init__(self, arm: bool, every: int):
        self.arm, self.every, self.armed = arm, every, 0

    def _set(self, trainer, step):
        if self.arm and step % self.every != 0:
            torch.cuda.set_sync_debug_mode("error")
            self.armed += 1
        else:
            torch.cuda.set_sync_debug_mode("default")

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.step = trainer.global_step
        self._set(trainer, self.step)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self._set(trainer, self.step)

    def teardown(self, trainer, pl_module, stage):
        torch.cuda.set_sync_debug_mode("default")


def test_no_host_sync_on_steps_that_do_not_measure(tmp_path):
    arm = SyncGuard(True, 5)
    callbacks = [arm, ThroughputMonitor(every_n_steps=5), PerRankLogger(every_n_steps=5), SyncGuard(False, 5)]
    trainer = fit(tmp_path, callbacks, max_steps=12)
    assert trainer.global_step == 12 and arm.armed >= 16


def test_cuda_tokens_per_sec_memory_and_mfu(tmp_path):
    reference, monitor = SyncedReference(), ThroughputMonitor(every_n_steps=5)
    fit(tmp_path, [reference, monitor], max_steps=16, precision="bf16-mixed")
    scalars = read_scalars(tmp_path / "tb" / "version_0")
    tps = dict(scalars["throughput/tokens_per_sec"])
    tokens = reference.cumulative[15] - reference.cumulative[10]
    seconds = reference.ends[15] - reference.ends[10]
    assert tps[15] == pytest.approx(tokens / seconds, rel=0.05)
    peak = device_peak_flops(torch.device("cuda", torch.cuda.current_device()), "bf16-mixed")
    if peak is None:
        pytest.skip(f"{torch.cuda.get_device_name()} is in neither peak-FLOPs table (Lightning's, ours)")
    mfu = dict(scalars["throughput/mfu"])[15]
    assert 0 < mfu < 1
    assert mfu == pytest.approx(monitor.flops_per_token * tps[15] / peak, rel=1e-4)
    peak_gib = dict(scalars["memory/peak_allocated_gib"])[15]
    assert 0 < peak_gib <= dict(scalars["memory/reserved_gib"])[15] + 1e-9
    step_ms = dict(scalars["throughput/step_time_ms"])[15]
    assert 0 < step_ms < 1e3 * seconds  # a median step is shorter than the five-step window
    print(
        f"\nGPU {torch.cuda.get_device_name()}: tokens/s {tps[15]:.0f} (reference {tokens / seconds:.0f}), "
        f"step {step_ms:.2f} ms, MFU {mfu:.4f}, peak {peak_gib:.3f} GiB, FLOPs/token {monitor.flops_per_token:.3g}"
    )
