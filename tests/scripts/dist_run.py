"""Run one fit of the tiny transformer under a real multi-process strategy, for the distributed tests.

Usage: ``python tests/scripts/dist_run.py <spec.json>``. Lightning's script launcher re-runs this file once per
extra rank, so every rank reads the same spec. The spec says:

* ``strategy``: ``"ddp"`` or ``"fsdp2"`` (``ModelParallelStrategy(data_parallel_size=N, tensor_parallel_size=1)``,
  with ``fully_shard`` applied in ``TinyGPT.configure_model``);
* ``devices``: number of processes (gloo, CPU);
* ``callbacks``: list of ``{"class_path": ..., "init_args": {...}}``;
* ``model`` / ``data`` / ``trainer``: keyword arguments for ``TinyGPT``, ``TinyTextDataModule`` and ``Trainer``;
* ``model_class`` (optional): ``"module:Class"``, a ``TinyGPT`` subclass to build instead;
* ``data_class`` (optional): ``"module:Class"``, a ``TinyTextDataModule`` subclass to build instead;
* ``ckpt_path`` (optional): a checkpoint to resume from, passed to ``trainer.fit``;
* ``out``: a directory; every rank writes ``result-rank<r>.json`` with each callback's findings and the
  ``trainer.callback_metrics`` as floats, plus ``error`` if the fit raised.
"""

import importlib
import json
import os
import sys
import traceback

import lightning.pytorch as pl
import torch
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger

from lightning_tfdebug.demo import TinyGPT, TinyTextDataModule


def build(spec_item):
    module, _, name = spec_item["class_path"].rpartition(".")
    return getattr(importlib.import_module(module), name)(**spec_item.get("init_args", {}))


def main() -> None:
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    torch.manual_seed(spec.get("seed", 0))
    torch.set_num_threads(1)
    callbacks = [build(c) for c in spec.get("callbacks", [])]
    if spec["strategy"] == "fsdp2":
        from lightning.pytorch.strategies import ModelParallelStrategy

        strategy = ModelParallelStrategy(data_parallel_size=spec["devices"], tensor_parallel_size=1)
    else:
        strategy = spec["strategy"]
    out = spec["out"]
    loggers = [TensorBoardLogger(out, name="tb", version=0), CSVLogger(out, name="csv", version=0)]
    trainer_kwargs = dict(
        accelerator="cpu",
        devices=spec["devices"],
        strategy=strategy,
        max_steps=8,
        logger=loggers,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        log_every_n_steps=1,
    )
    trainer_kwargs.update(spec.get("trainer", {}))
    trainer = pl.Trainer(callbacks=callbacks, **trainer_kwargs)
    model_class = TinyGPT
    if spec.get("model_class"):
        module, _, name = spec["model_class"].partition(":")
        model_class = getattr(importlib.import_module(module), name)
    model = model_class(**spec.get("model", {}))
    data_class = TinyTextDataModule
    if spec.get("data_class"):
        module, _, name = spec["data_class"].partition(":")
        data_class = getattr(importlib.import_module(module), name)
    data = data_class(**spec.get("data", {}))
    error = None
    try:
        trainer.fit(model, data, ckpt_path=spec.get("ckpt_path"))
    except Exception as err:  # recorded for the test to assert on
        error = {"type": type(err).__name__, "message": str(err), "traceback": traceback.format_exc()}
    result = {
        "rank": trainer.global_rank,
        "global_step": trainer.global_step,
        "log_dir": trainer.log_dir if error is None else None,
        "metrics": {k: float(v) for k, v in trainer.callback_metrics.items()},
        "findings": {type(c).__name__: [f.to_dict() for f in getattr(c, "findings", [])] for c in callbacks},
        "error": error,
    }
    extra = spec.get("extra")
    if extra:  # a function `module:function(trainer, model, callbacks) -> dict` adds test-specific results
        module, _, name = extra.partition(":")
        result["extra"] = getattr(importlib.import_module(module), name)(trainer, model, callbacks)
    with open(os.path.join(out, f"result-rank{trainer.global_rank}.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
