"""MemoryWatch on real fits: an out-of-memory error explained beside the usual batch, a forecast before the failing
step on lengths growing toward the context limit, silence on healthy runs."""

from __future__ import annotations

import warnings
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch import Tensor
from torch.utils.data import DataLoader

from lightning_tfdebug import MemoryWatch, ReproCapture, TFDebug
from lightning_tfdebug.core.host import process_rss_bytes
from lightning_tfdebug.demo import TinyGPT
from lightning_tfdebug.demo.data import IGNORE_INDEX
from lightning_tfdebug.findings import read_findings
from tests.helpers import SMALL, make_trainer

CONTEXT = 64
ROWS = 8


class OutOfMemoryGPT(TinyGPT):
    """TinyGPT on a device "sized for the usual": a batch wider than ``fits_width`` raises ``torch.OutOfMemoryError``
    in its forward, as the allocator would; ``hold_per_position`` bytes per token position are held from the forward
    to the end of the batch (touched pages: the resident set grows with the batch, as activations do)."""

    def __init__(self, fits_width: int = CONTEXT, hold_per_position: int = 0, **kwargs: Any) -> None:
        super().__init__(**SMALL, context_length=CONTEXT, **kwargs)
        self.fits_width, self.hold_per_position = fits_width, hold_per_position
        self._held: Tensor | None = None

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        rows, width = input_ids.shape
        if width > self.fits_width:
            raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate {rows * width * 2**20} bytes.")
        if self.hold_per_position:
            self._held = torch.ones(rows * width * self.hold_per_position // 4)  # float32, every page touched
        return super().forward(input_ids, attention_mask)

    def on_train_batch_end(self, *args: Any) -> None:
        self._held = None


def width_batches(widths: list[int], rows: int = ROWS) -> DataLoader:
    """One dict batch per width, in order: rows of random ids, right-padded from a random length up to the width."""
    generator = torch.Generator().manual_seed(0)

    def batch(width: int) -> dict[str, Tensor]:
        ids = torch.randint(3, 200, (rows, width), generator=generator)
        lengths = torch.randint(max(1, width // 2), width + 1, (rows,), generator=generator)
        lengths[0] = width
        mask = (torch.arange(width)[None, :] < lengths[:, None]).long()
        labels = ids.masked_fill(mask == 0, IGNORE_INDEX)
        return {"input_ids": ids * mask, "attention_mask": mask, "labels": labels}

    return DataLoader([batch(w) for w in widths], batch_size=None)


def fit(tmp_path, callbacks: list, model: pl.LightningModule, widths: list[int], **kwargs: Any) -> Exception | None:
    trainer = make_trainer(tmp_path, callbacks, max_steps=len(widths), **kwargs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            trainer.fit(model, train_dataloaders=width_batches(widths))
        except Exception as err:  # the simulated out-of-memory error ends the run, after the pack has spoken
            return err
    return None


def codes(callback: Any) -> list[str]:
    return [f.code for f in callback.findings]


def test_an_out_of_memory_error_is_explained_beside_the_usual_batch(tmp_path):
    widths = [16] * 6 + [CONTEXT] + [16] * 3  # one batch four times the usual, on a device sized for the usual
    repro, watch = ReproCapture(), MemoryWatch(every_n_steps=2)
    error = fit(tmp_path, [repro, watch], OutOfMemoryGPT(fits_width=32), widths)
    assert isinstance(error, torch.OutOfMemoryError)
    [oom] = watch.findings
    assert (oom.code, oom.severity, oom.rank, oom.step) == ("TFD621", "error", 0, 6)
    ev = oom.evidence
    assert (ev["rows"], ev["width"], ev["positions"]) == (ROWS, CONTEXT, ROWS * CONTEXT)
    assert (ev["median"], ev["longest"], ev["ratio"]) == (ROWS * 16, ROWS * 16, 4.0)
    assert ev["phase"] == "the training step" and "batch 6 of epoch 0 (step 6)" in oom.message
    assert ev["remedy_order"][0].startswith("cap or bucket the lengths (this batch was 4.0x the median")
    # the memory of the last measuring step (4), split; the weights are the model's
    weights = sum(p.numel() * 4 for p in OutOfMemoryGPT().parameters())
    assert ev["weights_gib"] * 2**30 == weights and ev["gradients_gib"] * 2**30 == weights
    tensors = len(list(OutOfMemoryGPT().parameters()))
    assert 2 * weights <= ev["optimizer_gib"] * 2**30 <= 2 * weights + 8 * tensors  # AdamW's two moments and steps
    assert ev["held_gib"] > ev["weights_gib"] and "at the last measuring step (4)" in oom.message
    # one line for one event: ReproCapture's bundle is named in the error, not in an info line of its own
    assert codes(repro) == [] and len(repro.bundles) == 1 and repro.bundles[0] in oom.message
    on_disk = read_findings(str(tmp_path / "tb" / "version_0" / "tfdebug" / "findings-rank0.jsonl"))
    assert [f.code for f in on_disk] == ["TFD621"]


def test_without_a_measuring_step_the_explanation_comes_from_the_parameter_counts(tmp_path):
    watch = MemoryWatch(every_n_steps=1, memory_limit_bytes=2**30)
    error = fit(tmp_path, [watch], OutOfMemoryGPT(fits_width=32), [48, 16])  # the first batch fails
    assert isinstance(error, torch.OutOfMemoryError)
    [oom] = watch.findings
    assert oom.code == "TFD621" and oom.evidence["width"] == 48
    assert "the rest unknown (no measuring step before the failure" in oom.message
    assert "the process has 1.00 GiB" in oom.message and "no training batch was seen before it" in oom.message
    assert oom.evidence["weights_gib"] > 0 and oom.evidence["optimizer_gib"] == 0  # no optimizer step yet


def test_an_out_of_memory_error_in_validation_names_the_phase(tmp_path):
    class FailsInValidation(OutOfMemoryGPT):
        def validation_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
            raise torch.OutOfMemoryError("CUDA out of memory (validation)")

    watch = MemoryWatch(every_n_steps=1)
    trainer = make_trainer(tmp_path, [watch], max_steps=4, limit_val_batches=1, val_check_interval=2)
    with warnings.catch_warnings(), pytest.raises(torch.OutOfMemoryError):
        warnings.simplefilter("ignore")
        trainer.fit(FailsInValidation(), train_dataloaders=width_batches([16] * 4), val_dataloaders=width_batches([24]))
    [oom] = watch.findings
    assert oom.evidence["phase"] == "validation" and oom.evidence["width"] == 24
    assert "validation batch 0" in oom.message


def test_lengths_growing_toward_the_limit_are_foreseen_before_the_failing_step(tmp_path):
    """CPU: the resident set after the forward, against a limit set for the test once the first step is done (the
    run's memory then, plus what a 48-wide batch holds and 16 MiB); the 56-wide batch fails, the forecast for the
    64-wide batches the context allows comes before it."""
    hold = 2**19  # bytes held per token position: 8 x 8 positions hold 32 MiB (mmapped: freed back to the system)
    widths = [8, 8, 16, 16, 24, 24, 32, 32, 40, 40, 48, 56]
    watch = MemoryWatch(every_n_steps=1)

    class LimitAtStart(pl.Callback):  # the limit "the device has"
        def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
            if trainer.global_step == 1:
                watch.memory_limit_bytes = process_rss_bytes() + ROWS * 48 * hold + 16 * 2**20

    error = fit(tmp_path, [LimitAtStart(), watch], OutOfMemoryGPT(fits_width=48, hold_per_position=hold), widths)
    assert isinstance(error, torch.OutOfMemoryError)
    forecast = [f for f in watch.findings if f.code == "TFD620"]
    assert forecast, [f.format() for f in watch.findings]
    [first] = forecast
    assert first.severity == "warning" and first.step < widths.index(56)
    assert first.evidence["target_width"] == CONTEXT and first.evidence["target_rows"] == ROWS
    assert first.evidence["forecast_gib"] > first.evidence["limit_gib"] > first.evidence["longest_gib"]
    assert "Batches of 64 tokens a row (8 rows) would need" in first.message
    assert [f.code for f in watch.findings][-1] == "TFD621"


@pytest.mark.parametrize("pack", [False, True], ids=["alone", "pack"])
def test_a_healthy_run_with_headroom_is_silent(tmp_path, pack):
    """Widths that vary below the context, memory that grows with them, and a limit with headroom for the longest."""
    hold = 2**16  # 8 x 64 positions hold 32 MiB
    widths = [8, 24, 16, 32, 24, 40, 16, 48, 32, 24, 40, 16]
    watch = MemoryWatch(every_n_steps=1)
    callbacks: list = [TFDebug(overrides={"MemoryWatch": {"every_n_steps": 1}}, summary=False)] if pack else [watch]
    members = callbacks[0].members if pack else {"MemoryWatch": watch}

    class LimitAtStart(pl.Callback):
        def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            members["MemoryWatch"].memory_limit_bytes = process_rss_bytes() + 256 * 2**20

    error = fit(tmp_path, [LimitAtStart(), *callbacks], OutOfMemoryGPT(hold_per_position=hold), widths)
    assert error is None
    assert codes(members["MemoryWatch"]) == []
    assert members["MemoryWatch"].stood_aside is None and not members["MemoryWatch"].checks_aside


class RankOutOfMemoryGPT(TinyGPT):
    """Rank 1's training step raises ``torch.OutOfMemoryError`` at step 3 (its device filled); rank 0 is left waiting
    in the gradients' all-reduce until rank 1's process is gone."""

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        if self.trainer.global_rank == 1 and self.trainer.global_step == 3:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB.")
        return super().training_step(batch, batch_idx)


@pytest.mark.slow
@pytest.mark.ddp
def test_an_oom_on_one_rank_is_named_in_the_report_and_no_rank_hangs(tmp_path):
    from lightning_tfdebug.report import load_run, render_text
    from tests.helpers import run_distributed

    spec = {
        "strategy": "ddp",
        "model_class": "tests.callbacks.test_memory_watch:RankOutOfMemoryGPT",
        "model": SMALL,
        "data": {"batch_size": 4},
        "trainer": {"max_steps": 8},
        "callbacks": [{"class_path": "lightning_tfdebug.TFDebug", "init_args": {"every_n_steps": 1, "summary": False}}],
    }
    results = run_distributed(tmp_path, spec, timeout=300)  # a hang fails here
    assert results[1]["error"]["type"] == "OutOfMemoryError" and results[0]["error"] is not None
    [oom] = [f for f in results[1]["findings"]["TFDebug"] if f["code"] == "TFD621"]
    assert oom["rank"] == 1 and "on rank 1, batch 3 of epoch 0 (step 3)" in oom["message"]
    assert "at the last measuring step (2)" in oom["message"]  # measured under DDP, through the pack's reduction
    assert not [f for f in results[0]["findings"]["TFDebug"] if f["code"] == "TFD621"]  # rank 0 had no OOM
    report = render_text(load_run(str(tmp_path / "tb" / "version_0")), verbose=True)
    assert "TFD621" in report and "on rank 1, batch 3" in report


@pytest.mark.slow
@pytest.mark.parametrize("family", ["tinygpt", "encoder_lm", "gpt2", "bert_mlm", "t5"])
def test_healthy_families_on_a_tight_device_are_silent(tmp_path, family):
    """The healthy matrix's families, their own data (fixed widths, or widths that vary under a cap of 48 against a
    context of 64 to 512), on a "device" with 64 MiB above what the first step used: no forecast, nothing aside."""
    pytest.importorskip("transformers")
    from tests.healthy_models import build, data

    watch = MemoryWatch(every_n_steps=1)

    class LimitAfterFirstStep(pl.Callback):
        def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
            if trainer.global_step == 1 and watch.memory_limit_bytes is None:
                watch.memory_limit_bytes = process_rss_bytes() + 64 * 2**20

    trainer = make_trainer(tmp_path, [LimitAfterFirstStep(), watch], max_steps=30)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(build(family), data(family))
    assert codes(watch) == [] and not watch.checks_aside and watch.stood_aside is None
    assert watch._tally.batches >= 30  # it saw every batch


def test_tfdebug_check_records_the_cuda_history_and_the_always_preset_runs_it():
    assert TFDebug(preflight=True).members["MemoryWatch"].record_history is True
    assert TFDebug().members["MemoryWatch"].record_history is False
    with pytest.raises(TypeError, match="record_history"):
        MemoryWatch(record_history="yes")
    with pytest.raises(ValueError, match="memory_limit_bytes"):
        MemoryWatch(memory_limit_bytes=0)


def test_an_out_of_memory_error_while_saving_a_checkpoint_names_the_phase(tmp_path):
    from lightning.pytorch.callbacks import ModelCheckpoint

    class FailsToSave(OutOfMemoryGPT):
        def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
            raise torch.OutOfMemoryError("CUDA out of memory (gathering the state to save)")

    watch = MemoryWatch(every_n_steps=1)
    saver = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=3, save_top_k=-1)
    error = fit(tmp_path, [watch, saver], FailsToSave(), [16] * 6, enable_checkpointing=True)
    assert isinstance(error, torch.OutOfMemoryError)
    [oom] = watch.findings
    assert oom.evidence["phase"] == "checkpoint saving" and "Out of memory in checkpoint saving" in oom.message


class RankHungryGPT(TinyGPT):
    """Batches cut to widths growing toward the context (8, 8, 16, 16, ...); rank 1 holds 4 MiB per token position
    from the forward to the end of the batch (rank 0 nothing): only rank 1's device would not hold the widest batch."""

    def on_after_batch_transfer(self, batch: dict[str, Tensor], dataloader_idx: int) -> dict[str, Tensor]:
        width = min(CONTEXT, 8 * (1 + self.trainer.global_step // 2))
        return {k: v[:, :width] for k, v in batch.items()}

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        if self.trainer.global_rank == 1:
            self._held = torch.ones(input_ids.numel() * 2**20)  # 4 MiB of float32 per position
        return super().forward(input_ids, attention_mask)

    def on_train_batch_end(self, *args: Any) -> None:
        self._held = None


@pytest.mark.slow
@pytest.mark.ddp
def test_under_ddp_the_forecast_names_the_rank_that_would_not_fit(tmp_path):
    from tests.helpers import run_distributed

    watch = {"every_n_steps": 1, "memory_limit_bytes": 2**30}  # each rank's process may use 1 GiB
    spec = {
        "strategy": "ddp",
        "model_class": "tests.callbacks.test_memory_watch:RankHungryGPT",
        "model": SMALL,
        "data": {"batch_size": 4},
        "trainer": {"max_steps": 10},
        "callbacks": [{"class_path": "lightning_tfdebug.MemoryWatch", "init_args": watch}],
    }
    results = run_distributed(tmp_path, spec, timeout=300)
    for result in results:  # every rank reads every rank's row and reaches the same finding
        assert result["error"] is None
        [forecast] = result["findings"]["MemoryWatch"]
        assert forecast["code"] == "TFD620" and forecast["evidence"]["ranks"] == [1], forecast
        assert "on rank 1;" in forecast["message"] and forecast["evidence"]["target_width"] == CONTEXT
    assert results[0]["metrics"]["memory_watch/forecast_gib"] > 1.0
