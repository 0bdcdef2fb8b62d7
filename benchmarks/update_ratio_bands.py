"""Measure update:weight ratios of healthy and mis-set runs, to derive UpdateRatio's default band.

Usage::

    python benchmarks/update_ratio_bands.py            # tiny transformer, several learning rates
    python benchmarks/update_ratio_bands.py --gpt2     # also a GPT-2-small-shaped model (124M parameters, slow on CPU)

Prints, per run, the ``update_ratio/total`` values UpdateRatio logged (every 10 steps), their minimum and maximum
after the warm-up, and the findings raised. The band ``low=3e-4``/``high=0.3`` must hold every healthy run inside
and flag the 100x-off ones. Results are in ``docs/callbacks/update_ratio.md``.
"""

from __future__ import annotations

import argparse
import tempfile

import lightning.pytorch as pl
import torch

from lightning_tfdebug import UpdateRatio
from lightning_tfdebug.demo import TinyGPT, TinyTextDataModule


class _Ratios(pl.Callback):
    def __init__(self) -> None:
        self.values: list[float] = []

    def on_train_batch_end(self, trainer: pl.Trainer, *args: object) -> None:
        value = trainer.callback_metrics.get("update_ratio/total")
        if value is not None and (not self.values or float(value) != self.values[-1]):
            self.values.append(float(value))


def run(label: str, steps: int, every: int, batch_size: int, **model_kwargs: object) -> None:
    torch.manual_seed(0)
    ratios, callback = _Ratios(), UpdateRatio(every_n_steps=every)
    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        callbacks=[callback, ratios],
        default_root_dir=tempfile.mkdtemp(),
    )
    trainer.fit(TinyGPT(**model_kwargs), TinyTextDataModule(batch_size=batch_size, context_length=64))
    after_warmup = ratios.values[2:] or ratios.values
    codes = sorted({f.code for f in callback.findings})
    shown = ", ".join(f"{v:.2g}" for v in ratios.values)
    print(f"{label:<40} min {min(after_warmup):.2e}  max {max(ratios.values):.2e}  findings {codes}  [{shown}]")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--gpt2", action="store_true", help="also run a GPT-2-small-shaped model")
    parser.add_argument("--steps", type=int, default=300)
    args = parser.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    for lr in (3e-4, 1e-3, 3e-3):
        run(f"tiny, AdamW lr={lr:g} (healthy)", args.steps, 10, 16, lr=lr)
    run("tiny, lr=1e-5 (100x too low)", args.steps, 10, 16, lr=1e-5)
    run("tiny, lr=0.1, no warm-up (100x too high)", args.steps, 10, 16, lr=0.1, warmup_steps=0)
    if args.gpt2:
        gpt2 = dict(vocab_size=50257, d_model=768, n_layers=12, n_heads=12, context_length=64)
        run("GPT-2-small shape, lr=6e-4 (healthy)", 40, 5, 4, lr=6e-4, warmup_steps=10, **gpt2)
        run("GPT-2-small shape, lr=6e-6 (100x too low)", 40, 5, 4, lr=6e-6, warmup_steps=10, **gpt2)


if __name__ == "__main__":
    main()
