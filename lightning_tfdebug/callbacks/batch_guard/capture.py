"""What BatchGuard takes from the run besides the training batch: the training data of an epoch, the first batch's
decoded examples, and the rows of the validation and test loops read back and gathered across ranks for the leakage
check (``TFD126``, ``TFD127``)."""

from __future__ import annotations

import os
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor

from lightning_tfdebug.callbacks.batch_guard import readings
from lightning_tfdebug.callbacks.batch_guard.leakage_rows import LeakageRows
from lightning_tfdebug.callbacks.batch_guard.loaders import EpochData, epoch_data_of, limit_setting
from lightning_tfdebug.core.base import TFDebugWarning
from lightning_tfdebug.core.compat import is_lightning_instance
from lightning_tfdebug.core.data import special_token_sources
from lightning_tfdebug.core.io import write_text
from lightning_tfdebug.core.model import find_context_length, find_vocab_size
from lightning_tfdebug.core.reduction import gather_records, host_fields
from lightning_tfdebug.functional.special_ids import learn_special_ids
from lightning_tfdebug.functional.verdicts import Verdict


def epoch_data(trainer: pl.Trainer) -> EpochData:
    """The training data of the epoch that starts (host metadata: the loaders and the Trainer's limits)."""
    combined = getattr(trainer.fit_loop, "_combined_loader", None)
    loaders = getattr(combined, "flattened", None) or [trainer.train_dataloader]
    setting = limit_setting(getattr(trainer, "overfit_batches", 0), getattr(trainer, "limit_train_batches", 1.0))
    return epoch_data_of(loaders, trainer.num_training_batches, setting)


def model_limits(
    pl_module: pl.LightningModule, vocab: int | None, context: int | None
) -> tuple[int | None, int | None]:
    """The vocabulary size and the context length: as given, else read from the model (a warning for one not found:
    the checks that need it are off)."""
    if vocab is None:
        vocab, where = find_vocab_size(pl_module)
        if vocab is None:
            warning = f"BatchGuard: {where}; token-id and label range checks are off. Pass `vocab_size`."
            rank_zero_warn(warning, category=TFDebugWarning)
    if context is None:
        context, where = find_context_length(pl_module)
        if context is None:
            warning = f"BatchGuard: {where}; the sequence-length check is off. Pass `max_length`."
            rank_zero_warn(warning, category=TFDebugWarning)
    return vocab, context


def log_examples(
    trainer: pl.Trainer, tfdebug_dir: str, tokenizer: Any, examples: tuple[Tensor, Tensor | None, int], ignore: int
) -> None:
    """The first rows of ``examples`` (ids, labels, how many) decoded, to TensorBoard text and the run's directory."""
    rows, label_rows = readings.example_rows(*examples)  # host sync: once per fit
    try:
        lines = readings.decoded_examples(tokenizer, rows, label_rows, ignore, trainer.global_rank)
    except Exception as err:  # a tokenizer that cannot decode must not break training
        rank_zero_warn(f"BatchGuard: tokenizer.decode failed ({err}); no decoded examples.", category=TFDebugWarning)
        return
    if trainer.is_global_zero:  # to TensorBoard text (rank 0, either Lightning package)
        for logger in (lg for lg in trainer.loggers if is_lightning_instance(lg, "TensorBoardLogger")):
            logger.experiment.add_text("batch_guard/examples", "  \n".join(lines), global_step=trainer.global_step)
    write_text(os.path.join(tfdebug_dir, f"batch_examples-rank{trainer.global_rank}.md"), "\n".join(lines) + "\n")


def learn_pad_ids(leak: LeakageRows, trainer: pl.Trainer, pl_module: pl.LightningModule, tokenizer: Any) -> None:
    """The run's padding ids, read once per fit (host attributes of the tokenizer, DataModule, collator or model
    config), for the rows of batches without an attention mask."""
    if leak.pad_ids is None:
        leak.pad_ids = learn_special_ids(special_token_sources(trainer, pl_module, tokenizer)).pad


def leakage_verdicts(leak: LeakageRows, step: int, exchange: bool = True) -> list[Verdict | None]:
    """Read the pending rows, file them in the watch and decide each loop that read rows.

    ``exchange`` (at the end of a validation or test run and of training, on every rank together): every pending row
    in one transfer, and every rank's rows gathered, so every rank reaches the same verdicts. Without it (a checked
    training step in one process): the rows already read, no transfer and no collective.
    """
    if exchange:
        rows, fields = leak.device_fields()
        leak.read(rows, host_fields(fields) if fields else {})  # host sync: once per loop's end, off the training step
        # collective under DDP (one all_gather_object of host arrays; none in one process), at the loops' ends only
        everyone = gather_records(leak.outbox())
    else:
        everyone = [leak.outbox()]
    leak.merge(everyone)
    return [leak.watch.verdict(loop, step) for loop in sorted(leak.loops)]
