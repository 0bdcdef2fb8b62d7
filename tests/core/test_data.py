import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.demos.boring_classes import BoringModel, RandomDataset
from lightning.pytorch.loggers import TensorBoardLogger
from torch.utils.data import DataLoader, IterableDataset

from lightning_tfdebug.core.data import epoch_data, special_token_sources, write_examples
from lightning_tfdebug.functional.batches import EpochData


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


def test_special_ids_are_looked_for_in_the_most_specific_place_first(tmp_path):
    transformers = pytest.importorskip("transformers")
    module = BoringModel()
    module.tokenizer = "module's"
    module.lm = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=20))
    trainer = pl.Trainer(logger=False, enable_progress_bar=False)
    sources = special_token_sources(trainer, module, tokenizer="given")
    names = [name for name, _ in sources]
    assert names[0] == "`tokenizer`" and sources[0][1] == "given"
    assert names.index("the LightningModule's tokenizer") < names.index("lm.config")
    assert dict(sources)["lm.config"].eos_token_id == module.lm.config.eos_token_id


def test_examples_go_to_the_file_and_to_tensorboard_text(tmp_path):
    logger = TensorBoardLogger(tmp_path, name="tb")
    trainer = pl.Trainer(logger=logger, enable_progress_bar=False)
    write_examples(trainer, str(tmp_path / "examples.md"), ["- row 0: `hello`", "- row 1: `world`"])
    assert (tmp_path / "examples.md").read_text() == "- row 0: `hello`\n- row 1: `world`\n"
    logger.experiment.flush()
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(logger.log_dir)
    events.Reload()
    assert "batch_guard/examples/text_summary" in events.Tags()["tensors"]
