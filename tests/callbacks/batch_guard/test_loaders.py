import lightning.pytorch as pl
import torch
from lightning.pytorch.demos.boring_classes import BoringModel, RandomDataset
from torch.utils.data import DataLoader, IterableDataset

from lightning_tfdebug.callbacks.batch_guard.callback import epoch_data
from lightning_tfdebug.callbacks.batch_guard.loaders import EpochData


class Stream(IterableDataset):
    def __iter__(self):
        return iter(torch.randn(8, 32))


class Reads(pl.Callback):
    def on_train_epoch_start(self, trainer, pl_module):
        self.data = epoch_data(trainer)


def read(tmp_path, loader, **trainer) -> EpochData:
    reads = Reads()
    pl.Trainer(
        default_root_dir=tmp_path,
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[reads],
        **trainer,
    ).fit(BoringModel(), loader)
    return reads.data


def test_the_epoch_data_says_stream_length_batches_read_and_the_limit_in_force(tmp_path):
    loader = DataLoader(RandomDataset(32, 10), batch_size=2)
    whole = read(tmp_path, loader)
    assert whole == EpochData(stream=False, loader_length=5, per_epoch=5, setting=None, stateful=False, in_order=True)
    limited = read(tmp_path, loader, limit_train_batches=2)
    assert (limited.loader_length, limited.per_epoch, limited.setting) == (5, 2, "Trainer(limit_train_batches=2)")
    assert not read(tmp_path, DataLoader(RandomDataset(32, 10), batch_size=2, shuffle=True)).in_order
    assert read(tmp_path, loader, limit_train_batches=0.5).setting == "Trainer(limit_train_batches=0.5)"
    assert read(tmp_path, DataLoader(Stream(), batch_size=2)).stream
