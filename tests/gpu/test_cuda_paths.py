"""CUDA-only paths: fp16 with CUDA's GradScaler, FSDP1 flat parameters. Skipped without a GPU (run: pytest -m gpu)."""

import warnings

import pytest

from lightning_tfdebug import GradNormMonitor, UpdateRatio
from lightning_tfdebug.demo import TinyGPT, TinyTextDataModule
from tests.helpers import make_trainer
from tests.reference import ReferenceGradNorm, ReferenceUpdateRatio

pytestmark = pytest.mark.gpu
SMALL = dict(d_model=32, n_layers=2, n_heads=2)


def fit(tmp_path, callbacks, **kwargs):
    trainer = make_trainer(tmp_path, callbacks, accelerator="cuda", devices=1, **kwargs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(TinyGPT(**SMALL), TinyTextDataModule(batch_size=8))
    return trainer


def test_cuda_fp16_grad_scaler_norms_are_unscaled_and_exact(tmp_path):
    reference, monitor, ratio = ReferenceGradNorm(), GradNormMonitor(every_n_steps=1), UpdateRatio(every_n_steps=1)
    trainer = fit(tmp_path, [reference, monitor, ratio], max_steps=4, precision="16-mixed")
    assert trainer.callback_metrics["grad_norm/total"].item() == pytest.approx(reference.norms[3], rel=1e-4)
    assert trainer.callback_metrics["update_ratio/total"].item() > 0
    assert [f.code for f in monitor.findings + ratio.findings] == []


@pytest.mark.parametrize("use_orig_params", [True, False])
def test_fsdp1_flat_parameters_match_the_reference(tmp_path, use_orig_params):
    from lightning.pytorch.strategies import FSDPStrategy

    from lightning_tfdebug.demo.model import Block

    strategy = FSDPStrategy(auto_wrap_policy={Block}, use_orig_params=use_orig_params)
    reference, monitor = ReferenceUpdateRatio(), UpdateRatio(every_n_steps=1)
    grads, norms = ReferenceGradNorm(), GradNormMonitor(every_n_steps=1)
    trainer = fit(tmp_path, [reference, monitor, grads, norms], max_steps=3, strategy=strategy)
    assert trainer.callback_metrics["grad_norm/total"].item() == pytest.approx(grads.norms[2], rel=1e-4)
    assert trainer.callback_metrics["update_ratio/total"].item() == pytest.approx(reference.ratios[2], rel=1e-3)
