import math
import warnings

import pytest
import torch

from lightning_tfdebug.demo import IGNORE_INDEX, ByteTokenizer, TinyGPT, TinyTextDataModule, generate_corpus
from tests.helpers import make_trainer


def test_tokenizer_round_trip_and_specials():
    tok = ByteTokenizer()
    ids = tok.encode("héllo")
    assert ids[0] == tok.bos_id and ids[-1] == tok.eos_id
    assert tok.decode(ids) == "héllo"
    assert tok.decode([tok.bos_id, 104, tok.pad_id], skip_special=False) == "<bos>h<pad>"


def test_corpus_is_deterministic():
    assert generate_corpus(5, seed=1) == generate_corpus(5, seed=1) != generate_corpus(5, seed=2)


def test_healthy_batches_mask_padding_in_the_labels():
    batch = next(iter(TinyTextDataModule(batch_size=4).train_dataloader()))
    assert set(batch) == {"input_ids", "attention_mask", "labels"}
    assert (batch["labels"][batch["attention_mask"] == 0] == IGNORE_INDEX).all()
    assert (batch["labels"][batch["attention_mask"] == 1] == batch["input_ids"][batch["attention_mask"] == 1]).all()


@pytest.mark.parametrize(
    "flag, check",
    [
        ({"all_labels_ignored": True}, lambda b: (b["labels"] == IGNORE_INDEX).all()),
        ({"pad_labels_supervised": True}, lambda b: (b["labels"] == b["input_ids"]).all()),
        ({"long_batch_every": 1}, lambda b: b["input_ids"].shape[1] > 64),
        ({"bad_token_every": 1}, lambda b: b["input_ids"].max() >= ByteTokenizer.vocab_size),
        (
            {"dtype_drift_every": 1},
            lambda b: b["labels"].dtype == torch.int32 and b["attention_mask"].is_floating_point(),
        ),
        ({"squeeze_batch_every": 1}, lambda b: b["input_ids"].ndim == 1),
    ],
)
def test_batch_bug_flags_inject_what_they_say(flag, check):
    batch = next(iter(TinyTextDataModule(batch_size=4, **flag).train_dataloader()))
    assert check(batch)


def test_intermittent_flags_hit_only_every_kth_batch():
    loader = TinyTextDataModule(batch_size=2, long_batch_every=3).train_dataloader()
    widths = [b["input_ids"].shape[1] > 64 for _, b in zip(range(6), loader)]
    assert widths == [False, False, True, False, False, True]


def test_tiny_gpt_learns_the_corpus(tmp_path):
    model = TinyGPT(d_model=32, n_heads=2)
    trainer = make_trainer(tmp_path, [], max_steps=120, logger=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(model, TinyTextDataModule(batch_size=16))
    assert trainer.callback_metrics["train/loss"] < 0.6 * math.log(ByteTokenizer.vocab_size)


def test_model_bug_flags_change_the_model():
    ids = torch.randint(0, 256, (2, 10))
    probs = TinyGPT(d_model=16, n_heads=2, softmax_output=True)(ids)
    torch.testing.assert_close(probs.sum(-1), torch.ones(2, 10))
    causal, leaky = TinyGPT(d_model=16, n_heads=2), TinyGPT(d_model=16, n_heads=2, no_causal_mask=True)
    leaky.load_state_dict(causal.state_dict())
    changed = ids.clone()
    changed[:, -1] = (changed[:, -1] + 1) % 256
    assert torch.allclose(causal(ids)[:, 0], causal(changed)[:, 0])
    assert not torch.allclose(leaky(ids)[:, 0], leaky(changed)[:, 0])
    with pytest.raises(ValueError, match="not a module of TinyGPT"):
        TinyGPT(overflow_module="nope")


def test_demo_config_parses_with_lightning_cli():
    from pathlib import Path

    from lightning.pytorch.cli import LightningCLI

    config = Path(__file__).resolve().parents[2] / "examples" / "demo.yaml"
    cli = LightningCLI(TinyGPT, TinyTextDataModule, run=False, args=["--config", str(config)])
    packs = [c for c in cli.trainer.callbacks if type(c).__name__ == "TFDebug"]
    assert len(packs) == 1
    # preset "full": every member, with the demo's overrides applied
    assert {"GradNormMonitor", "UpdateRatio", "MaskProbe", "CheckpointAudit"} <= set(packs[0].members)
    assert packs[0].members["DeadActivation"].every_n_steps == 25
    assert cli.trainer.max_steps == 300
