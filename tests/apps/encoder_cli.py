"""A LightningCLI training script written for the tests, not by the pack's authors: `tfdebug check` must work on it.

A causal ``nn.TransformerEncoder`` language model on dict batches of random token runs. ``--model.bug head_frozen``
leaves the output head out of the optimizer (the head gets gradients but never changes: an error-level finding).

    python tests/apps/encoder_cli.py fit --trainer.max_steps 40 [--model.bug head_frozen]
"""

from __future__ import annotations

import sys
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.cli import LightningCLI
from torch import nn
from torch.utils.data import DataLoader, Dataset

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout, when not installed


class Runs(Dataset):
    """Sequences that repeat a short random pattern: learnable from context."""

    def __init__(self, n: int = 512, length: int = 24, vocab: int = 48, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        period = torch.randint(2, 6, (n,), generator=g)
        patterns = torch.randint(0, vocab, (n, 6), generator=g)
        idx = torch.arange(length)
        self.ids = torch.stack([patterns[i, idx % period[i]] for i in range(n)])

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class RunsData(pl.LightningDataModule):
    def __init__(self, batch_size: int = 16, val_from_train: bool = False) -> None:
        super().__init__()
        self.batch_size, self.val_from_train = batch_size, val_from_train

    def train_dataloader(self) -> DataLoader:
        return DataLoader(Runs(), batch_size=self.batch_size, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        # --data.val_from_train true: the validation reads the training runs (a leak BatchGuard flags as TFD126)
        return DataLoader(Runs() if self.val_from_train else Runs(n=64, seed=1), batch_size=self.batch_size)


class EncoderLM(pl.LightningModule):
    def __init__(self, vocab: int = 48, d_model: int = 32, layers: int = 2, lr: float = 3e-3, bug: str = "none"):
        super().__init__()
        self.save_hyperparameters()
        self.embed = nn.Embedding(vocab, d_model)
        self.pos = nn.Parameter(torch.randn(64, d_model) * 0.02)
        layer = nn.TransformerEncoderLayer(d_model, 4, 4 * d_model, dropout=0.0, batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d_model, vocab)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        t = input_ids.shape[1]
        mask = nn.Transformer.generate_square_subsequent_mask(t, device=input_ids.device)
        return self.head(self.encoder(self.embed(input_ids) + self.pos[:t], mask=mask, is_causal=True))

    def _loss(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        logits = self(batch["input_ids"])
        return nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), batch["labels"][:, 1:].flatten())

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        self.log("val_loss", self._loss(batch))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        frozen = self.hparams.bug == "head_frozen"
        named = [(n, p) for n, p in self.named_parameters() if not (frozen and n.startswith("head"))]
        decay = [p for n, p in named if p.ndim >= 2 and n != "pos"]  # no decay on norms, biases, positions
        rest = [p for n, p in named if not (p.ndim >= 2 and n != "pos")]
        groups = [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}]
        return torch.optim.AdamW(groups, lr=self.hparams.lr)


if __name__ == "__main__":
    LightningCLI(EncoderLM, RunsData, save_config_kwargs={"overwrite": True})
