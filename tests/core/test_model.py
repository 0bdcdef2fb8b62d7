import lightning.pytorch as pl
import pytest
import torch
from torch import nn

from lightning_tfdebug.core.model import (
    find_context_length,
    find_vocab_size,
    import_object,
    in_training_step,
    load_tokenizer,
    quiet_training_step,
)
from lightning_tfdebug.demo import TinyGPT


def test_vocab_and_context_are_read_from_the_embeddings_and_position_tables_never_from_a_position_table():
    class LM(nn.Module):
        def __init__(self):
            super().__init__()
            self.wpe = nn.Embedding(64, 16)  # a position table wider than the vocabulary: never the vocabulary
            self.token_type_embeddings = nn.Embedding(2, 16)
            self.tok = nn.Embedding(50, 16)
            self.head = nn.Linear(16, 50)

    assert find_vocab_size(LM()) == (50, "embedding 'tok' (rows equal the output head's width)")
    assert find_context_length(LM()) == (64, "position embedding 'wpe'")
    vocab, where = find_vocab_size(nn.Linear(3, 3))
    assert vocab is None and "no input embedding" in where

    class Learned(nn.Module):
        def __init__(self):
            super().__init__()
            self.pos_emb = nn.Parameter(torch.zeros(1, 24, 8))
            self.only = nn.Embedding(30, 8)  # the only token table, head tied through F.linear

    assert find_vocab_size(Learned())[0] == 30
    assert find_context_length(Learned()) == (24, "position parameter 'pos_emb' (1, 24, 8)")


def test_a_hugging_face_config_and_the_module_hyper_parameters_give_the_context():
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=77, n_positions=40)
    model = transformers.GPT2LMHeadModel(config)
    assert find_vocab_size(model) == (77, "GPT2LMHeadModel.get_input_embeddings()")
    assert find_context_length(model)[0] == 40

    class Hparams(pl.LightningModule):
        def __init__(self, block_size: int = 12):
            super().__init__()
            self.save_hyperparameters()

    assert find_context_length(Hparams()) == (12, "hparams['block_size']")


def test_import_paths_and_tokenizers_are_checked_with_a_clear_error():
    assert import_object("os.path:join") is import_object("os.path.join")
    with pytest.raises(ValueError, match="expected an import path"):
        import_object("nodots")
    assert load_tokenizer(None) is None
    tokenizer = load_tokenizer("lightning_tfdebug.demo.data:ByteTokenizer")
    assert callable(tokenizer.decode)
    with pytest.raises(ValueError, match="not an importable"):
        load_tokenizer("no.such.module:Tok")
    with pytest.raises(ValueError, match="must have a `decode` method"):
        load_tokenizer(object())


def test_a_replayed_training_step_logs_nothing_and_leaves_the_schedule_where_it_was(tmp_path):
    class Stepping(TinyGPT):
        logged: list = []

        def training_step(self, batch, batch_idx):
            self.log("probe", 1.0)
            self.lr_schedulers().step()  # a schedule stepped by hand inside the step
            return super().training_step(batch, batch_idx)

        def configure_optimizers(self):
            optimizer = torch.optim.SGD(self.parameters(), lr=1.0)
            return {"optimizer": optimizer, "lr_scheduler": torch.optim.lr_scheduler.StepLR(optimizer, 1, 0.5)}

    from lightning_tfdebug.demo import TinyTextDataModule

    module = Stepping(vocab_size=259, d_model=16, n_heads=2, n_layers=1, context_length=16)
    trainer = pl.Trainer(
        max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False, default_root_dir=tmp_path
    )
    trainer.fit(module, TinyTextDataModule(context_length=16, batch_size=2))
    batch = next(iter(trainer.train_dataloader))
    lr, epoch = trainer.optimizers[0].param_groups[0]["lr"], trainer.lr_scheduler_configs[0].scheduler.last_epoch
    with torch.no_grad():
        loss = quiet_training_step(module, batch, 0)
    assert torch.isfinite(loss)
    assert trainer.optimizers[0].param_groups[0]["lr"] == lr
    assert trainer.lr_scheduler_configs[0].scheduler.last_epoch == epoch
    assert "log" not in module.__dict__  # the silencer is gone: the module's own `log` is back


def test_a_forward_counts_inside_training_step_only():
    module = pl.LightningModule()
    assert in_training_step(module) and in_training_step(None)  # no name: every forward counts
    module._current_fx_name = "on_train_batch_start"
    assert not in_training_step(module)
    module._current_fx_name = "training_step"
    assert in_training_step(module)
