"""Demo: train the tiny transformer with every lightning_tfdebug callback, from a LightningCLI config.

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

from lightning_tfdebug import read_findings
from lightning_tfdebug.demo import TinyGPT, TinyTextDataModule


def summarize(log_dir: str) -> None:
    """Print where the logs and findings are, the findings themselves, and how to open TensorBoard."""
    tfdebug = Path(log_dir) / "tfdebug"
    files = sorted(tfdebug.glob("findings-rank*.jsonl")) if tfdebug.exists() else []
    findings = [f for path in files for f in read_findings(path)]
    print("\n" + "=" * 78)
    print(f"TensorBoard logs : {log_dir}")
    print(f"tfdebug reports  : {tfdebug}")
    if findings:
        print(f"{len(findings)} finding(s):")
        for finding in findings:
            print(
                f"  [{finding.code}] {finding.severity:<7} step {finding.step:>4}  {finding.source}: {finding.message}"
            )
    else:
        print("No findings: the pack saw nothing wrong with this run.")
    root = Path(log_dir).parent.parent if Path(log_dir).name.startswith("version_") else Path(log_dir)
    shown = os.path.relpath(root) if root.resolve().is_relative_to(Path.cwd()) else str(root)
    print(f"Open the dashboards with:  tensorboard --logdir {shown}")
    print("=" * 78)


def main() -> None:
    cli = LightningCLI(TinyGPT, TinyTextDataModule, save_config_kwargs={"overwrite": True})
    if cli.trainer.is_global_zero and cli.trainer.log_dir:
        summarize(cli.trainer.log_dir)


if __name__ == "__main__":
    main()
