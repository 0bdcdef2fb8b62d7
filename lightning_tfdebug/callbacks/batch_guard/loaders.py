"""What an epoch's training data is, from the DataLoaders' host objects (no tensor is touched): a stream or a
map-style loader, its length, the Trainer's limit, whether it restores its position and reads in a fixed order.
The callback reads the loaders and the Trainer's settings and hands them here."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, NamedTuple

from torch.utils.data import DataLoader, DistributedSampler, IterableDataset, SequentialSampler


class EpochData(NamedTuple):
    """An epoch's training data (host metadata, read once per epoch).

    Attributes:
        stream: not a map-style DataLoader (no epochs of its own).
        loader_length: batches per epoch before any Trainer limit; None for a stream or several loaders.
        per_epoch: the batches the Trainer reads per epoch.
        setting: the Trainer limit in force (``"Trainer(overfit_batches=1)"``).
        stateful: every loader can restore its position (``state_dict``/``load_state_dict``).
        in_order: every loader reads in a fixed order (no shuffling).
    """

    stream: bool = False
    loader_length: int | None = None
    per_epoch: int | None = None
    setting: str | None = None
    stateful: bool = False
    in_order: bool = False


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


def _loader_length(loaders: Sequence[Any]) -> int | None:
    """Batches per epoch of the one training DataLoader over a map-style dataset, before any Trainer limit; None for
    a stream, several loaders or a loader without a length."""
    if len(loaders) != 1 or not _map_style(loaders[0]):
        return None
    try:
        return len(loaders[0])
    except TypeError:
        return None


def limit_setting(overfit_batches: Any, limit_train_batches: Any) -> str | None:
    """The Trainer setting that makes every epoch read the same subset of the data, when one is set."""
    if overfit_batches:
        return f"Trainer(overfit_batches={overfit_batches!r})"
    limit = limit_train_batches
    # an int is a number of batches (1 is one batch), a float a fraction of the epoch (1.0 is all of it)
    if limit is not None and (isinstance(limit, int) or limit < 1.0):
        return f"Trainer(limit_train_batches={limit!r})"
    return None


def epoch_data_of(loaders: Sequence[Any], per_epoch: Any, setting: str | None) -> EpochData:
    """The training data of the epoch that starts: a stream unless every loader is a DataLoader over a map-style
    dataset (which has epochs), the loader's length, the batches the Trainer reads per epoch (``per_epoch``: its
    ``num_training_batches``), its limit (``setting``: :func:`limit_setting`), and whether the loaders can restore
    their position and read in a fixed order."""
    return EpochData(
        stream=not all(_map_style(loader) for loader in loaders),
        loader_length=_loader_length(loaders),
        per_epoch=int(per_epoch) if isinstance(per_epoch, (int, float)) and math.isfinite(per_epoch) else None,
        setting=setting,
        stateful=all(_stateful(loader) for loader in loaders),
        in_order=all(_in_order(loader) for loader in loaders),
    )
