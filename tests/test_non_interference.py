"""The pack never changes the run it watches: with the same seed, dropout on and shuffled data, the weights after
training are bit-identical with no pack, with ``TFDebug()`` (the ``always`` preset) and with ``TFDebug(preset="full")``,
in one process and under DDP on two gloo ranks.

What could break it: a probe that draws from the global RNG (dropout masks and the sampler's shuffle would shift), a
forward in train mode outside the step (batch statistics, dropout), a hook that changes a tensor in place, a gradient
left behind by a probe's backward."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_tfdebug import TFDebug
from lightning_tfdebug.demo import TinyGPT, TinyTextDataModule
from tests.helpers import SMALL, fit_tiny, run_distributed

STEPS = 110


class DropoutGPT(TinyGPT):
    """TinyGPT with dropout on its embeddings: every training forward draws from the global RNG."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**{**SMALL, **kwargs})
        self.tok_emb.register_forward_hook(_dropout)


def _dropout(module: nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor:
    return F.dropout(output, p=0.1, training=module.training)


def digest(model: nn.Module) -> str:
    """A hash of every weight's bytes: equal only when the weights are bit-identical."""
    h = hashlib.sha256()
    for name, value in model.state_dict().items():
        h.update(name.encode())
        h.update(value.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def _fit(tmp_path: Path, callbacks: list) -> str:
    pl.seed_everything(0, workers=True)
    model = DropoutGPT()
    fit_tiny(tmp_path, callbacks, model, TinyTextDataModule(batch_size=8), max_steps=STEPS, log_every_n_steps=10)
    return digest(model)


def test_dropout_and_shuffling_make_the_run_depend_on_the_rng(tmp_path):
    """The control: the digest sees a different run (another seed), so equal digests below mean something."""
    first = _fit(tmp_path / "a", [])
    pl.seed_everything(1, workers=True)
    other = DropoutGPT()
    fit_tiny(tmp_path / "b", [], other, TinyTextDataModule(batch_size=8), max_steps=3)
    assert digest(other) != first


def test_the_weights_are_bit_identical_with_and_without_the_pack(tmp_path):
    plain = _fit(tmp_path / "plain", [])
    assert _fit(tmp_path / "again", []) == plain  # the run itself is deterministic
    always = TFDebug(summary=False)
    assert _fit(tmp_path / "always", [always]) == plain
    full = TFDebug(preset="full", summary=False)
    assert _fit(tmp_path / "full", [full]) == plain
    assert list(full.running) == list(always.running)  # every member, MaskProbe's probes among them
    assert always.members["CheckpointAudit"].reload is False and full.members["NaNFirstFrame"].mode == "eager"


def ddp_digest(trainer: pl.Trainer, model: nn.Module, callbacks: list) -> dict[str, Any]:
    return {"digest": digest(model)}


@pytest.mark.ddp
@pytest.mark.slow  # ~25 s: two DDP fits; the same promise in one process runs by default
def test_the_weights_are_bit_identical_with_and_without_the_pack_under_ddp(tmp_path):
    def run(name: str, callbacks: list[dict[str, Any]]) -> list[str]:
        spec = {
            "strategy": "ddp",
            "model_class": "tests.test_non_interference:DropoutGPT",
            "data": {"batch_size": 8},
            "trainer": {"max_steps": 40, "log_every_n_steps": 10},
            "callbacks": callbacks,
            "extra": "tests.test_non_interference:ddp_digest",
        }
        results = run_distributed(tmp_path / name, spec, timeout=300)
        assert all(r["error"] is None for r in results), [r["error"] for r in results]
        return [r["extra"]["digest"] for r in results]

    plain = run("plain", [])
    assert plain[0] == plain[1]  # DDP keeps the replicas equal
    pack = run("full", [{"class_path": "lightning_tfdebug.TFDebug", "init_args": {"preset": "full"}}])
    assert pack == plain
