"""Where the special token ids of a run may be read, from the Trainer's host objects (no tensor is touched): shared
by BatchGuard and MaskProbe."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import lightning.pytorch as pl


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
