"""CUDA paths of MemoryWatch: a real out-of-memory error explained with the allocator's history in the bundle, and
the forecast from the allocator's peak. Skipped without a GPU (run:
``pytest -m gpu tests/gpu/test_memory_watch_gpu.py``).
"""

from __future__ import annotations

import os
import pickle
import warnings
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch import Tensor

from lightning_tfdebug import MemoryWatch, ReproCapture
from tests.callbacks.test_memory_watch import CONTEXT, ROWS, OutOfMemoryGPT, width_batches
from tests.helpers import make_trainer

pytestmark = pytest.mark.gpu


class DeviceHungryGPT(OutOfMemoryGPT):
    """Holds ``hold_per_position`` bytes of device memory per token position from the forward to the end of the batch;
    a batch wider than ``fits_width`` asks the allocator for more than the device has (a real OutOfMemoryError)."""

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        rows, width = input_ids.shape
        if width > self.fits_width:
            total = torch.cuda.get_device_properties(input_ids.device).total_memory
            self._held = torch.empty(2 * total, dtype=torch.uint8, device=input_ids.device)  # raises
        if self.hold_per_position:
            self._held = torch.ones(rows * width * self.hold_per_position // 4, device=input_ids.device)
        return super(OutOfMemoryGPT, self).forward(input_ids, attention_mask)


def fit(tmp_path, callbacks: list, model: pl.LightningModule, widths: list[int]) -> Exception | None:
    trainer = make_trainer(tmp_path, callbacks, accelerator="cuda", devices=1, max_steps=len(widths))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            trainer.fit(model, train_dataloaders=width_batches(widths))
        except Exception as err:
            return err
    return None


def test_a_real_cuda_oom_is_explained_with_the_memory_history_in_the_bundle(tmp_path):
    repro, watch = ReproCapture(), MemoryWatch(every_n_steps=2, record_history=True)
    error = fit(tmp_path, [repro, watch], DeviceHungryGPT(fits_width=32), [16] * 6 + [CONTEXT, 16])
    assert isinstance(error, torch.OutOfMemoryError)
    [oom] = watch.findings
    assert oom.code == "TFD621" and oom.evidence["width"] == CONTEXT and oom.evidence["ratio"] == 4.0
    total = torch.cuda.get_device_properties(0).total_memory
    assert oom.evidence["total_gib"] * 2**30 <= total and "the device has" in oom.message
    assert "At the failure:" in oom.message and "allocated, peak" in oom.message
    [bundle] = repro.bundles
    snapshot = os.path.join(bundle, "memory_snapshot.pickle")
    assert os.path.exists(snapshot) and "torch.cuda._memory_viz trace_plot" in oom.message
    with open(snapshot, "rb") as f:
        assert pickle.load(f)["device_traces"]  # the allocator's events, as the viewer reads them
    assert not watch._recording  # stopped at teardown


def test_the_forecast_from_the_allocator_peak_comes_before_the_failing_step(tmp_path):
    hold = 2**22  # 4 MiB of device memory per token position: 8 x 64 positions hold 2 GiB
    widths = [8, 8, 16, 16, 24, 24, 32, 32, 40, 40, 48, 56]
    watch = MemoryWatch(every_n_steps=1)

    class LimitAfterFirstStep(pl.Callback):
        def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
            if trainer.global_step == 1:
                peak = torch.cuda.max_memory_allocated()
                watch.memory_limit_bytes = peak + ROWS * 48 * hold + 64 * 2**20

    model = DeviceHungryGPT(fits_width=48, hold_per_position=hold)
    error = fit(tmp_path, [LimitAfterFirstStep(), watch], model, widths)
    assert isinstance(error, torch.OutOfMemoryError)
    forecast = [f for f in watch.findings if f.code == "TFD620"]
    assert forecast and forecast[0].step < widths.index(56), [f.format() for f in watch.findings]
    assert forecast[0].evidence["target_width"] == CONTEXT
    assert "the device has" in forecast[0].message
