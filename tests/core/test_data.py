import lightning.pytorch as pl
import pytest
from lightning.pytorch.demos.boring_classes import BoringModel

from lightning_tfdebug.core.data import special_token_sources


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
