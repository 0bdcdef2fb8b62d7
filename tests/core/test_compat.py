import lightning.pytorch as pl
import pytest
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger

from lightning_tfdebug.core.compat import Callback, is_lightning_instance, is_lightning_subclass, overrides


def test_a_lightning_class_is_matched_by_name_in_either_package(tmp_path):
    assert is_lightning_instance(TensorBoardLogger(tmp_path), "TensorBoardLogger")
    assert not is_lightning_instance(CSVLogger(tmp_path), "TensorBoardLogger")
    assert is_lightning_subclass(pl.LightningModule, "LightningModule")
    assert not is_lightning_subclass("not a class", "LightningModule")

    class TensorBoardLoggerLookalike:  # the name alone, outside Lightning, is not enough
        pass

    assert not is_lightning_instance(TensorBoardLoggerLookalike(), "TensorBoardLogger")
    standalone = pytest.importorskip("pytorch_lightning")
    assert is_lightning_instance(standalone.loggers.TensorBoardLogger(tmp_path), "TensorBoardLogger")
    assert issubclass(Callback, standalone.Callback) and issubclass(Callback, pl.Callback)


def test_overrides_tells_a_replaced_hook_and_assumes_nothing_of_a_foreign_class():
    class Plain(pl.LightningModule):
        pass

    class Custom(pl.LightningModule):
        def on_after_batch_transfer(self, batch, dataloader_idx):
            return batch

    assert not overrides(Plain(), "LightningModule", "on_after_batch_transfer")
    assert overrides(Custom(), "LightningModule", "on_after_batch_transfer")
    assert overrides(object(), "LightningModule", "on_after_batch_transfer")
