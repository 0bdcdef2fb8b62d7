"""Shared test helpers: small Trainers and real multi-process runs."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger

from lightning_tfdebug.demo import TinyGPT

ROOT = Path(__file__).resolve().parents[1]
DIST_SCRIPT = ROOT / "tests" / "scripts" / "dist_run.py"


def make_trainer(tmp_path: Path, callbacks: list, **kwargs: Any) -> pl.Trainer:
    """A CPU Trainer with a TensorBoard and a CSV logger writing under ``tmp_path``."""
    defaults: dict[str, Any] = dict(
        accelerator="cpu",
        devices=1,
        max_steps=20,
        logger=[TensorBoardLogger(tmp_path, name="tb", version=0), CSVLogger(tmp_path, name="csv", version=0)],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        log_every_n_steps=1,
        default_root_dir=tmp_path,
    )
    defaults.update(kwargs)
    return pl.Trainer(callbacks=callbacks, **defaults)


SMALL: dict[str, int] = dict(d_model=32, n_layers=2, n_heads=2)
"""The tiny transformer most tests train: two layers of width 32."""


def fit_tiny(
    tmp_path: Path, callbacks: list, model: pl.LightningModule | None = None, data: Any = None, **kwargs: Any
) -> pl.Trainer:
    """Fit ``model`` (default: a :data:`SMALL` TinyGPT) on ``data`` (default: the bundled corpus, batch 8).

    ``kwargs`` go to :func:`make_trainer`, except ``ckpt_path`` which goes to ``fit``. ``TFDebugWarning`` is silenced:
    tests read findings from the callbacks.
    """
    from lightning_tfdebug import TFDebugWarning
    from lightning_tfdebug.demo import TinyGPT, TinyTextDataModule

    ckpt_path = kwargs.pop("ckpt_path", None)
    trainer = make_trainer(tmp_path, callbacks, **kwargs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", TFDebugWarning)
        trainer.fit(
            model if model is not None else TinyGPT(**SMALL),
            data if data is not None else TinyTextDataModule(batch_size=8),
            ckpt_path=ckpt_path,
        )
    return trainer


def run_distributed(tmp_path: Path, spec: dict[str, Any], timeout: float = 240) -> list[dict[str, Any]]:
    """Run ``tests/scripts/dist_run.py`` with real gloo processes and return every rank's result dict.

    A hang fails the test through ``timeout`` (the process group is killed) instead of blocking the suite.
    """
    spec = {"devices": 2, **spec, "out": str(tmp_path)}
    tmp_path.mkdir(parents=True, exist_ok=True)
    spec_path = tmp_path / "spec.json"
    spec_path.write_text(json.dumps(spec))
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env.pop("LOCAL_RANK", None)
    proc = subprocess.Popen(
        [sys.executable, str(DIST_SCRIPT), str(spec_path)],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        output, _ = proc.communicate()
        raise AssertionError(f"distributed run hung for {timeout}s:\n{output.decode()[-4000:]}") from None
    text = output.decode()
    results = []
    for rank in range(spec["devices"]):
        path = tmp_path / f"result-rank{rank}.json"
        assert path.exists(), f"rank {rank} wrote no result (exit {proc.returncode}):\n{text[-4000:]}"
        results.append(json.loads(path.read_text()))
    return results


def read_scalars(event_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """All scalars in the TensorBoard event files under ``event_dir``: ``{tag: [(step, value), ...]}``."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(event_dir), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def read_csv_metrics(csv_dir: Path) -> list[dict[str, str]]:
    import csv

    with open(csv_dir / "metrics.csv") as f:
        return list(csv.DictReader(f))


# ------------------------------------------------------------------ batch types (the shared reading of core.batch)
@dataclasses.dataclass
class TokenBatch:
    """A dataclass batch, as some data pipelines yield."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    labels: torch.Tensor


class DataclassBatchGPT(TinyGPT):
    def on_after_batch_transfer(self, batch, dataloader_idx):
        return TokenBatch(batch["input_ids"], batch["attention_mask"], batch["labels"])

    def training_step(self, batch, batch_idx):
        return self.loss(self(batch.input_ids, batch.attention_mask), batch.labels)


class BatchEncodingGPT(TinyGPT):
    """Batches as Hugging Face ``BatchEncoding`` (what a tokenizer returns); TinyGPT indexes them like dicts."""

    def on_after_batch_transfer(self, batch, dataloader_idx):
        from transformers import BatchEncoding

        return BatchEncoding(dict(batch))


class BusyLoops(pl.Callback):
    """Other processes keeping ``per_core`` x the machine's cores busy (busy-loop subprocesses, at most 32): from the
    start of optimizer step ``at`` (0: at once, before the fit), until the fit ends. As a shared CI runner is."""

    def __init__(self, at: int = 0, per_core: int = 2) -> None:
        self.at, self.count = at, min(per_core * (os.cpu_count() or 2), 32)
        self.loops: list[subprocess.Popen] = []
        if at == 0:
            self.start()

    def start(self) -> None:
        if not self.loops:
            self.loops = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(self.count)]

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step >= self.at:
            self.start()

    def stop(self) -> None:
        for loop in self.loops:
            loop.kill()
            loop.wait()
        self.loops = []

    def teardown(self, trainer, pl_module, stage) -> None:
        self.stop()
