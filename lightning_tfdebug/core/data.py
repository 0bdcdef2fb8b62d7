"""What the Trainer trains on, from its host objects (no tensor is touched): the epoch's data loader, where the
special token ids may be read, and decoded examples of the training data written where the user reads them."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import lightning.pytorch as pl
from torch.utils.data import DataLoader, DistributedSampler, IterableDataset, SequentialSampler

from lightning_tfdebug.core.compat import is_lightning_instance
from lightning_tfdebug.core.io import write_text
from lightning_tfdebug.functional.batches import EpochData


def _loaders(trainer: pl.Trainer) -> list[Any]:
    loader = getattr(trainer.fit_loop, "_combined_loader", None)
    return getattr(loader, "flattened", None) or [trainer.train_dataloader]


def _map_style(loader: Any) -> bool:
    return isinstance(loader, DataLoader) and not isinstance(loader.dataset, IterableDataset)


def _stateful(loader: Any) -> bool:
    """Whether Lightning can restore the loader's position on resume (it has ``state_dict`` and
    ``load_state_dict``, as torchdata's ``StatefulDataLoader``)."""
    return callable(getattr(loader, "state_dict", None)) and callable(getattr(loader, "load_state_dict", None))


def _in_order(loader: Any) -> bool:
    """Whether the loader reads its dataset in the same order every epoch (no shuffling)."""
    sampler = getattr(getattr(loader, "batch_sampler", None), "sampler", None) or getattr(loader, "sampler", None)
    return isinstance(sampler, SequentialSampler) or (isinstance(sampler, DistributedSampler) and not sampler.shuffle)


def _loader_length(loaders: list[Any]) -> int | None:
    """Batches per epoch of the one training DataLoader over a map-style dataset, before any Trainer limit; None for
    a stream, several loaders or a loader without a length."""
    if len(loaders) != 1 or not _map_style(loaders[0]):
        return None
    try:
        return len(loaders[0])
    except TypeError:
        return None


def _limit_setting(trainer: pl.Trainer) -> str | None:
    """The Trainer setting that makes every epoch read the same subset of the data, when one is set."""
    overfit = getattr(trainer, "overfit_batches", 0)
    if overfit:
        return f"Trainer(overfit_batches={overfit!r})"
    limit = getattr(trainer, "limit_train_batches", 1.0)
    # an int is a number of batches (1 is one batch), a float a fraction of the epoch (1.0 is all of it)
    if limit is not None and (isinstance(limit, int) or limit < 1.0):
        return f"Trainer(limit_train_batches={limit!r})"
    return None


def epoch_data(trainer: pl.Trainer) -> EpochData:
    """The training data of the epoch that starts: a stream unless every loader is a DataLoader over a map-style
    dataset (which has epochs), the loader's length, the batches the Trainer reads per epoch, its limit, and whether
    the loaders can restore their position and read in a fixed order."""
    loaders = _loaders(trainer)
    per_epoch = trainer.num_training_batches
    return EpochData(
        stream=not all(_map_style(loader) for loader in loaders),
        loader_length=_loader_length(loaders),
        per_epoch=int(per_epoch) if isinstance(per_epoch, (int, float)) and math.isfinite(per_epoch) else None,
        setting=_limit_setting(trainer),
        stateful=all(_stateful(loader) for loader in loaders),
        in_order=all(_in_order(loader) for loader in loaders),
    )


def special_token_sources(trainer: pl.Trainer, pl_module: pl.LightningModule, tokenizer: Any) -> list[tuple[str, Any]]:
    """Where the special token ids may be read, most specific first: the ``tokenizer`` argument, a ``tokenizer``
    attribute of the DataModule, of the training DataLoader's collator (Hugging Face's data collators hold theirs) or
    of the LightningModule, then Hugging Face configs (and generation configs) of the model's modules."""
    sources: list[tuple[str, Any]] = [("`tokenizer`", tokenizer)]
    datamodule = getattr(trainer, "datamodule", None)
    sources.append(("the DataModule's tokenizer", getattr(datamodule, "tokenizer", None)))
    loaders = getattr(trainer, "train_dataloader", None)
    if isinstance(loaders, Mapping):
        loaders = list(loaders.values())
    for loader in loaders if isinstance(loaders, (list, tuple)) else [loaders]:
        collate = getattr(loader, "collate_fn", None)
        sources.append(("the training DataLoader's collator's tokenizer", getattr(collate, "tokenizer", None)))
    sources.append(("the LightningModule's tokenizer", getattr(pl_module, "tokenizer", None)))
    for name, module in pl_module.named_modules():
        for attr in ("config", "generation_config"):
            config = getattr(module, attr, None)
            if config is not None and hasattr(config, "eos_token_id"):
                sources.append((f"{name or type(module).__name__}.{attr}", config))
    return sources


def write_examples(trainer: pl.Trainer, path: str, lines: list[str], tag: str = "batch_guard/examples") -> None:
    """Decoded examples of the training data (markdown ``lines``): to TensorBoard text under ``tag`` (rank 0, either
    Lightning package) and to the file at ``path``."""
    if trainer.is_global_zero:
        body = "  \n".join(lines)  # markdown line breaks
        for logger in trainer.loggers:
            if is_lightning_instance(logger, "TensorBoardLogger"):
                logger.experiment.add_text(tag, body, global_step=trainer.global_step)
    write_text(path, "\n".join(lines) + "\n")
