"""A LightningCLI training script for the tests: the bundled TinyGPT whose ``training_step`` may put a floor under its
loss, for ``tfdebug check`` to catch inside its 50 steps (issue 44).

``--model.bug``: ``none``; ``sigmoid`` (the loss of ``logits.sigmoid()``); ``softcap1`` (of ``tanh(logits)``, a
soft-cap of 1); ``smoothing`` (``label_smoothing=0.9``, meant 0.1); ``smoothing_ok`` (``label_smoothing=0.1``);
``attention_multiply`` (a hand-written attention whose scores are multiplied by sqrt(d) instead of divided, q and k
of unit variance at init: bug-zoo row 45, AttentionProbe's TFD240).

    python tests/apps/floor_cli.py fit --trainer.max_steps 50 [--model.bug sigmoid]
"""

from __future__ import annotations

import inspect
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from lightning.pytorch.cli import LightningCLI

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout, when not installed

from lightning_tfdebug.demo import TinyGPT, TinyTextDataModule

SMOOTHING = {"smoothing": 0.9, "smoothing_ok": 0.1}


class FloorGPT(TinyGPT):
    def __init__(self, bug: str = "none", d_model: int = 32, n_layers: int = 2, n_heads: int = 2, lr: float = 2e-3):
        super().__init__(d_model=d_model, n_layers=n_layers, n_heads=n_heads, lr=lr, warmup_steps=10)
        # save_hyperparameters in TinyGPT reads this frame's arguments: add TinyGPT's own (its optimizer reads them)
        own = inspect.signature(TinyGPT.__init__).parameters.values()
        self.hparams.update({p.name: p.default for p in own if p.default is not p.empty and p.name not in self.hparams})
        self.hparams.update(warmup_steps=10)
        self.bug = bug
        if bug == "attention_multiply":
            import types

            from torch import nn

            from tests.bug_models import _hand_attention

            for module in self.modules():
                if hasattr(module, "qkv") and hasattr(module, "n_heads"):
                    module.scale_mode = "multiply"
                    module.forward = types.MethodType(_hand_attention, module)
                    nn.init.normal_(module.qkv.weight, std=d_model**-0.5)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        logits = self(batch["input_ids"], batch.get("attention_mask"))[:, :-1]
        if self.bug == "sigmoid":
            logits = logits.sigmoid()
        elif self.bug == "softcap1":
            logits = torch.tanh(logits)
        labels = batch["labels"][:, 1:]
        eps = SMOOTHING.get(self.bug, 0.0)
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100, label_smoothing=eps)
        self.log("train_loss", loss)
        return loss


if __name__ == "__main__":
    LightningCLI(FloorGPT, TinyTextDataModule, save_config_kwargs={"overwrite": True})
