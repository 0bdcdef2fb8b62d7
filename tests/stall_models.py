"""Runs that hang, for StallWatchdog's tests (``tests/callbacks/test_stall_watchdog.py``): a rank that blocks in its
training step, a rank-zero-only barrier, a DataLoader worker that blocks, and healthy runs with phases that take long
(validation, checkpoint writes, a long first step). Each run is launched as a subprocess the test can kill."""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import lightning.pytorch as pl
import torch

from lightning_tfdebug.demo import TinyGPT


def _block(seconds: float | None) -> None:
    """Block the calling thread: ``seconds`` (None: for ever, as a deadlock would)."""
    if seconds is None:
        threading.Event().wait()  # never set: a lock nobody releases
    else:
        time.sleep(seconds)


class StallTinyGPT(TinyGPT):
    """TinyGPT whose ``training_step`` blocks on rank ``stall_rank`` at optimizer step ``stall_at_step`` for
    ``stall_s`` seconds (None: for ever), after writing ``stalled-rank<r>.txt`` (the wall time) to ``marker_dir``.
    ``first_step_s``: every rank's first step takes this long (a compile warm-up's stand-in)."""

    def __init__(
        self,
        stall_rank: int | None = None,
        stall_at_step: int = 3,
        stall_s: float | None = None,
        first_step_s: float = 0.0,
        marker_dir: str | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.stall_rank, self.stall_at_step, self.stall_s = stall_rank, stall_at_step, stall_s
        self.first_step_s, self.marker_dir = first_step_s, marker_dir
        self._first_done = False

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        if self.first_step_s and not self._first_done:
            self._first_done = True
            time.sleep(self.first_step_s)
        if self.global_rank == self.stall_rank and self.global_step == self.stall_at_step:
            if self.marker_dir:
                with open(os.path.join(self.marker_dir, f"stalled-rank{self.global_rank}.txt"), "w") as f:
                    f.write(str(time.time()))
            _block(self.stall_s)
        return super().training_step(batch, batch_idx)


class SlowPhasesGPT(TinyGPT):
    """TinyGPT whose validation batches take ``val_batch_s`` seconds each."""

    def __init__(self, val_batch_s: float = 0.0, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.val_batch_s = val_batch_s

    def validation_step(self, batch: Any, batch_idx: int) -> Any:
        if not self.trainer.sanity_checking:
            time.sleep(self.val_batch_s)
        return super().validation_step(batch, batch_idx)


class SlowCheckpointWrite(pl.Callback):
    """Makes every checkpoint write take ``seconds`` longer (a slow or remote file system): ``torch.save`` blocks."""

    def __init__(self, seconds: float = 5.0) -> None:
        self.seconds = seconds

    def on_save_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: Any) -> None:
        time.sleep(self.seconds)


class RankZeroBarrier(pl.Callback):
    """A barrier inside a rank-zero-only branch, at the end of optimizer step ``at_step``: the other ranks go on to
    the next step's gradient all-reduce, and the job hangs."""

    def __init__(self, at_step: int = 3) -> None:
        self.at_step = at_step

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if trainer.is_global_zero and trainer.global_step == self.at_step:
            torch.distributed.barrier()


class _StallingItems(torch.utils.data.Dataset):
    """``dataset`` whose ``at_item``-th fetched sample (counted per process: a DataLoader worker) blocks ``seconds``."""

    def __init__(self, dataset: Any, at_item: int, seconds: float) -> None:
        self.dataset, self.at_item, self.seconds, self.fetched = dataset, at_item, seconds, 0

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> Any:
        self.fetched += 1
        if self.fetched == self.at_item:
            time.sleep(self.seconds)
        return self.dataset[index]


def stalling_worker_data(at_item: int, seconds: float, **kwargs: Any) -> Any:
    """The bundled data module, read by one DataLoader worker whose ``at_item``-th sample blocks ``seconds``."""
    from lightning_tfdebug.demo import TinyTextDataModule

    data = TinyTextDataModule(num_workers=1, **kwargs)
    data.train_set = _StallingItems(data.train_set, at_item, seconds)
    return data


class StallStep:
    """A mixin for the bug matrix's families (``tests/bug_models.py``): ``training_step`` blocks for ever on rank
    ``stall_rank`` at optimizer step ``stall_at_step`` (bug-zoo row 48, a stuck data source inside the step)."""

    def __init__(self, stall_rank: int | None = None, stall_at_step: int = 3, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.stall_rank, self.stall_at_step = stall_rank, stall_at_step

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        if self.global_rank == self.stall_rank and self.global_step == self.stall_at_step:
            _block(None)
        return super().training_step(batch, batch_idx)


def _families() -> dict[str, type]:
    from tests.bug_models import BugEncoderLM, BugHFLM, BugTinyGPT

    return {
        "StallEncoderLM": type("StallEncoderLM", (StallStep, BugEncoderLM), {"__module__": __name__}),
        "StallHFLM": type("StallHFLM", (StallStep, BugHFLM), {"__module__": __name__}),
        "StallBugTinyGPT": type("StallBugTinyGPT", (StallStep, BugTinyGPT), {"__module__": __name__}),
    }


def __getattr__(name: str) -> type:  # the families import transformers: only when a test names one
    families = _families()
    if name in families:
        globals().update(families)
        return families[name]
    raise AttributeError(name)


class RecompilingGPT(TinyGPT):
    """TinyGPT whose forward is compiled (inductor); from optimizer step ``shorter_from`` its batches are cut to
    ``shorter_length`` tokens, so Dynamo compiles again in the middle of the run (not in the first step)."""

    def __init__(self, shorter_from: int = 4, shorter_length: int = 40, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.shorter_from, self.shorter_length = shorter_from, shorter_length
        self.forward = torch.compile(self.forward)

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        if self.global_step >= self.shorter_from:
            batch = {k: v[:, : self.shorter_length] for k, v in batch.items()}
        return super().training_step(batch, batch_idx)


def store_keys_left(trainer: Any, model: Any, callbacks: list) -> dict[str, Any]:
    """For ``tests/scripts/dist_run.py``'s ``extra``: after the fit, whether this rank's StallWatchdog record is still
    in the default store, and whether its thread still runs."""
    from torch.distributed.distributed_c10d import _get_default_store

    from lightning_tfdebug.core.watchdog import STORE_PREFIX

    watchdogs = [c for c in callbacks if type(c).__name__ == "StallWatchdog"]
    keys = [f"{STORE_PREFIX}/{n}/rank{trainer.global_rank}" for n in range(1, 4)]
    return {
        "keys_left": [k for k in keys if _get_default_store().check([k])],
        "threads": [t.name for t in threading.enumerate() if t.name == "tfdebug-stall-watchdog"],
        "watchdog": [w.watchdog is not None for w in watchdogs],
    }
