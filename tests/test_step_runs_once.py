"""The user's ``training_step`` runs exactly once per micro-batch under every preset, with checkpoint saves, a resume
and gradient accumulation: the probes replay recorded model calls, never the step (a step with side effects, a
MoCo-style queue, an EMA, a counter or a metric updated in it, sees nothing extra)."""

from __future__ import annotations

from collections import Counter

import pytest
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_tfdebug import TFDebug
from lightning_tfdebug.demo import TinyGPT
from lightning_tfdebug.pack import PRESETS
from tests.helpers import SMALL, fit_tiny


class CountingGPT(TinyGPT):
    """Counts its ``training_step`` calls per (global step, batch index): the side effect a replay would repeat."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.calls: Counter[tuple[int, int]] = Counter()

    def training_step(self, batch, batch_idx):
        self.calls[self.trainer.global_step, batch_idx] += 1
        return super().training_step(batch, batch_idx)


@pytest.mark.parametrize("preset", PRESETS)
def test_training_step_runs_once_per_micro_batch(tmp_path, preset):
    model = CountingGPT(**SMALL)
    pack = TFDebug(preset=preset, summary=False, every_n_steps=2)
    saver = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=2, save_top_k=-1)
    trainer = fit_tiny(
        tmp_path / "fit", [pack, saver], model=model, max_steps=4, accumulate_grad_batches=2, enable_checkpointing=True
    )
    assert trainer.global_step == 4
    assert len(model.calls) == 8 and set(model.calls.values()) == {1}, model.calls  # 4 steps x 2 micro-batches
    # the probes did run: MaskProbe on the recorded call, LossAtInit on the recorded logits, CheckpointAudit's probe
    assert pack.members["MaskProbe"].last_report and pack.members["LossAtInit"].active
    # a resume from the step-2 checkpoint: the step still runs once per micro-batch
    resumed = CountingGPT(**SMALL)
    pack = TFDebug(preset=preset, summary=False, every_n_steps=2)
    fit_tiny(
        tmp_path / "resume", [pack], model=resumed, max_steps=6, accumulate_grad_batches=2,
        ckpt_path=str(tmp_path / "ckpt" / "epoch=0-step=2.ckpt"),
    )  # fmt: skip
    assert resumed.calls and set(resumed.calls.values()) == {1}, resumed.calls
    if preset == "full":  # the resume compared the replayed model call on the probe rows with the one at save time
        audit = pack.members["CheckpointAudit"]
        assert audit._probe_loss is not None and not [f for f in audit.findings if f.code == "TFD715"]
