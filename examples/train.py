"""Demo: train the tiny transformer with the whole lightning_tfdebug pack (one `TFDebug` entry), from LightningCLI.

    python examples/train.py fit --config examples/demo.yaml

Inject a bug from the command line to see the pack find it, e.g. ``--model.lr 1e-5`` (learning rate 100x too
low), ``--model.head_not_in_optimizer true`` or ``--data.pad_labels_supervised true``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from lightning.pytorch.cli import LightningCLI

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from lightning_tfdebug.demo import TinyGPT, TinyTextDataModule


def where(log_dir: str) -> None:
    """Say where the logs are and how to open the dashboard (the pack itself printed the findings)."""
    root = Path(log_dir).parent.parent if Path(log_dir).name.startswith("version_") else Path(log_dir)
    shown = os.path.relpath(root) if root.resolve().is_relative_to(Path.cwd()) else str(root)
    print(f"  dashboard (CUSTOM SCALARS tab): tensorboard --logdir {shown}")


def main() -> None:
    cli = LightningCLI(TinyGPT, TinyTextDataModule, save_config_kwargs={"overwrite": True})
    if cli.trainer.is_global_zero and cli.trainer.log_dir:
        where(cli.trainer.log_dir)


if __name__ == "__main__":
    main()
