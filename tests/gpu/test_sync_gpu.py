"""Host syncs of the pack per step on CUDA (issue 25), counted with ``torch.cuda.set_sync_debug_mode("warn")``.

On a step that does not measure, ``TFDebug(preset="always")`` may read one flag (NaNFirstFrame's decision to skip a
non-finite step before ``optimizer.step()``) and nothing else; measuring steps may sync (they read their statistics
once). Skipped without a GPU (run: ``pytest -m gpu``).
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch

from lightning_tfdebug import TFDebug
from lightning_tfdebug.demo import TinyGPT, TinyTextDataModule
from tests.helpers import make_trainer

pytestmark = pytest.mark.gpu
SMALL = dict(d_model=32, n_layers=2, n_heads=2)
EVERY = 5


def _origin() -> str:
    """The innermost frame of the pack that led to the warning being raised, else ``other``."""
    frame = sys._getframe(1)
    while frame is not None:
        if "/lightning_tfdebug/" in frame.f_code.co_filename:
            return f"{Path(frame.f_code.co_filename).name}:{frame.f_code.co_name}"
        frame = frame.f_back
    return "other"


class SyncCounter(pl.Callback):
    """Files every CUDA sync warning under the optimizer step in progress, with the pack's frame that caused it."""

    def __init__(self) -> None:
        self.step = "setup"
        self.syncs: dict[object, list[str]] = {}
        self._show = None

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._show = warnings.showwarning

        def show(message, category, *args, **kwargs):
            if "synchroniz" in str(message):
                self.syncs.setdefault(self.step, []).append(_origin())

        warnings.showwarning = show
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.step = trainer.global_step

    def on_train_end(self, trainer, pl_module) -> None:
        torch.cuda.set_sync_debug_mode("default")
        warnings.showwarning = self._show
        self.step = "end"


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_a_step_that_does_not_measure_reads_one_flag_at_most(tmp_path, precision):
    pack = TFDebug(preset="always", every_n_steps=EVERY, summary=False, dashboard=False)
    counter = SyncCounter()
    trainer = make_trainer(tmp_path, [counter, pack], accelerator="cuda", devices=1, max_steps=16, precision=precision)
    trainer.fit(TinyGPT(**SMALL), TinyTextDataModule(batch_size=8))
    for step in range(1, 16):
        if step % EVERY == 0 or step in pack.members["LossAtInit"]._compare_steps():
            continue
        ours = [origin for origin in counter.syncs.get(step, []) if origin != "other"]
        print(step, ours)
        assert len(ours) <= 1 and all(o.startswith("nan_first_frame.py") for o in ours), (step, ours)
