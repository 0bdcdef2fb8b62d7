"""CUDA paths of NaNFirstFrame and ScalerWatch: fp16 with CUDA's own GradScaler (``precision="16-mixed"``).

Skipped without a GPU (run: ``pytest -m gpu tests/gpu/test_numerics_gpu.py``).
"""

import json
import warnings
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch

from lightning_tfdebug import NaNFirstFrame, ScalerWatch, TFDebugWarning
from lightning_tfdebug.demo import TinyGPT, TinyTextDataModule
from tests.helpers import make_trainer, read_scalars

pytestmark = pytest.mark.gpu
SMALL = dict(d_model=64, n_layers=2, n_heads=4)
OVERFLOW = dict(SMALL, overflow_module="blocks.0.mlp.fc")  # bug 15: that output x 1e5 overflows fp16


class WeightsAtStart(pl.Callback):
    def __init__(self):
        self.weights = {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.weights[trainer.global_step] = {n: p.detach().clone() for n, p in pl_module.named_parameters()}


def fit(tmp_path, callbacks, model, **kwargs):
    trainer = make_trainer(tmp_path, callbacks, accelerator="cuda", devices=1, precision="16-mixed", **kwargs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", TFDebugWarning)
        trainer.fit(model, TinyTextDataModule(batch_size=16))
    return trainer


@pytest.mark.parametrize("mode", ["lazy", "eager"])
def test_cuda_fp16_overflow_is_named_and_the_step_not_applied(tmp_path, mode):
    snaps, nff = WeightsAtStart(), NaNFirstFrame(mode=mode, on_finding="stop")
    model = TinyGPT(**OVERFLOW)
    trainer = fit(tmp_path, [snaps, nff], model, max_steps=10)
    assert type(trainer.precision_plugin.scaler).__name__ == "GradScaler"
    [finding] = nff.findings
    assert finding.code == "TFD401" and finding.evidence["module"] == "blocks.0.mlp.fc"
    for name, p in model.named_parameters():
        assert torch.equal(p.detach(), snaps.weights[finding.step][name]), name
    report = json.loads(Path(finding.evidence["report_json"]).read_text())
    assert report["precision"] == "16-mixed" and report["first_forward"]["module"] == "blocks.0.mlp.fc"


def test_cuda_grad_scaler_overflow_collapses_the_scale(tmp_path):
    watch = ScalerWatch(every_n_steps=1, window=20, min_steps=8)
    fit(tmp_path, [watch], TinyGPT(**OVERFLOW), max_steps=20)
    scale = dict(read_scalars(tmp_path / "tb" / "version_0")["scaler/scale"])
    assert scale[19] < scale[0] / 1000 and watch.skipped_total >= 17
    assert {"TFD411", "TFD412"} <= {f.code for f in watch.findings}


def test_cuda_healthy_fp16_run_raises_nothing(tmp_path):
    nff, watch = NaNFirstFrame(), ScalerWatch(every_n_steps=5, min_steps=5)
    fit(tmp_path, [nff, watch], TinyGPT(**SMALL), max_steps=20)
    assert nff.findings == [] and nff.skipped_steps == 0
    assert watch.findings == [] and watch.skipped_total <= 2
