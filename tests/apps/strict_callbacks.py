"""Callbacks a user might list in a LightningCLI config, written for the tests of ``tfdebug check``."""

from __future__ import annotations

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback


class FullValidationOnly(Callback):
    """Refuses a Trainer that validates on part of the validation set (as a team's reporting callback might):
    it cannot be combined with ``tfdebug check``, which sets ``--trainer.limit_val_batches=2``."""

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if trainer.limit_val_batches != 1.0:
            raise ValueError(
                f"FullValidationOnly reports on the whole validation set; limit_val_batches is "
                f"{trainer.limit_val_batches}."
            )
