"""End to end: an intermittent bug crashes a run at step k, ReproCapture writes a bundle, replay shows the error."""

import os
import random
import subprocess
import sys
import tempfile
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import yaml

from lightning_tfdebug import ReproCapture, TFDebugWarning
from lightning_tfdebug.__main__ import main
from lightning_tfdebug.demo import TinyGPT, TinyTextDataModule
from lightning_tfdebug.repro import load_bundle, replay, replay_with_config
from tests.helpers import ROOT, make_trainer

SMALL = dict(d_model=32, n_layers=2, n_heads=2)


def crash(tmp_path, model, data, max_steps=12, **trainer_kwargs):
    capture = ReproCapture()
    trainer = make_trainer(tmp_path, [capture], max_steps=max_steps, **trainer_kwargs)
    with pytest.raises(Exception) as info, warnings.catch_warnings():
        warnings.simplefilter("ignore", TFDebugWarning)
        trainer.fit(model, data)
    assert len(capture.bundles) == 1
    return info.value, capture.bundles[0]


def write_config(tmp_path, model_kwargs):
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump({"seed_everything": 0, "model": model_kwargs, "data": {"batch_size": 8}}))
    return path


@pytest.mark.parametrize(
    "flag, step",
    [({"long_batch_every": 5}, 4), ({"bad_token_every": 4}, 3), ({"squeeze_batch_every": 6}, 5)],
    ids=["row4-long", "row5-bad-token", "row6-squeezed"],
)
def test_intermittent_crash_replays_with_the_same_exception(tmp_path, flag, step, monkeypatch):
    error, bundle = crash(tmp_path, TinyGPT(**SMALL), TinyTextDataModule(batch_size=8, **flag))
    assert bundle.endswith(f"step{step}-rank0")
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = replay_with_config(bundle, write_config(tmp_path, SMALL))
    assert type(result.exception) is type(error) and str(result.exception) == str(error)
    assert result.reproduced and result.notes == []
    assert list(scratch.iterdir()) == []  # the replay's scratch directory is gone


class RandomFailure(TinyGPT):
    """Fails at step 3 with a message that depends on every RNG, the weights and the step counter."""

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        if self.trainer.global_step == 3:
            drop = F.dropout(torch.ones(64), 0.5, training=True)
            raise RuntimeError(
                f"step {self.trainer.global_step} torch {torch.rand(()).item():.8f} python {random.random():.8f} "
                f"numpy {np.random.rand():.8f} dropout {drop.nonzero().flatten().tolist()} "
                f"weights {self.head.weight.double().sum().item():.12f} loss {loss.item():.8f}"
            )
        return loss


def test_replay_restores_rng_weights_and_step_and_would_notice_if_not(tmp_path):
    error, bundle = crash(tmp_path, RandomFailure(**SMALL), TinyTextDataModule(batch_size=8))
    assert "step 3 " in str(error)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = replay(bundle, RandomFailure(**SMALL))
        assert result.reproduced, f"{result.exception} != {error}"
        # the same check fails when the weights or the RNG are not restored: the test can tell
        fresh = replay(bundle, RandomFailure(**SMALL), load_state=False)
        assert isinstance(fresh.exception, RuntimeError) and not fresh.reproduced
        loaded = load_bundle(bundle)
        loaded.rng = None
        no_rng = replay(loaded, RandomFailure(**SMALL))
        assert isinstance(no_rng.exception, RuntimeError) and not no_rng.reproduced
        assert any("no RNG states" in note for note in no_rng.notes)


class DrawsEveryStep(TinyGPT):
    """Draws from Python's and NumPy's generators on every step (random masking), fails at step 7 with the draws."""

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        draws = f"python {random.random():.8f} numpy {np.random.rand():.8f} torch {torch.rand(()).item():.8f}"
        if self.trainer.global_step == 7:
            raise RuntimeError(f"step 7 {draws}")
        return loss


class TorchOnly(TinyGPT):
    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        if self.trainer.global_step == 7:
            raise RuntimeError(f"step 7 torch {torch.rand(()).item():.8f}")
        return loss


def test_host_generators_are_captured_between_measuring_steps_only_when_steps_use_them(tmp_path):
    # step 7 is not a measuring step (every 5): the first probed batches decide what is captured there
    error, bundle = crash(tmp_path / "host", DrawsEveryStep(**SMALL), TinyTextDataModule(batch_size=8), **EVERY_5)
    assert "rng_python" in load_bundle(bundle).meta and "rng_numpy" in load_bundle(bundle).meta
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = replay(bundle, DrawsEveryStep(**SMALL))
    assert result.reproduced, f"{result.exception} != {error}"

    error, bundle = crash(tmp_path / "torch", TorchOnly(**SMALL), TinyTextDataModule(batch_size=8), **EVERY_5)
    assert "rng_python" not in load_bundle(bundle).meta  # never converted: no step drew from Python or NumPy
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = replay(bundle, TorchOnly(**SMALL))
    assert result.reproduced, f"{result.exception} != {error}"
    assert any("were not captured" in note for note in result.notes)


EVERY_5 = {"log_every_n_steps": 5}


def test_cli_replays_a_lightning_cli_run(tmp_path, capsys):
    from lightning.pytorch.cli import LightningCLI

    config = {
        "seed_everything": 0,
        "trainer": {
            "accelerator": "cpu",
            "max_steps": 10,
            "enable_progress_bar": False,
            "enable_model_summary": False,
            "enable_checkpointing": False,
            "limit_val_batches": 0,
            "logger": {
                "class_path": "lightning.pytorch.loggers.TensorBoardLogger",
                "init_args": {"save_dir": str(tmp_path), "name": "cli", "version": 0},
            },
            "callbacks": [{"class_path": "lightning_tfdebug.ReproCapture"}],
        },
        "model": {**SMALL, "lr": 3e-3},
        "data": {"batch_size": 8, "bad_token_every": 5},
    }
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    with pytest.raises(IndexError) as info, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        LightningCLI(TinyGPT, TinyTextDataModule, args=["fit", "--config", str(path)], save_config_kwargs=False)
    bundle = tmp_path / "cli" / "version_0" / "tfdebug" / "repro" / "step4-rank0"
    assert load_bundle(bundle).meta["run"]["hparams"]["lr"] == 3e-3

    assert main(["replay", str(bundle), "--config", str(path)]) == 0
    out = capsys.readouterr().out
    assert f"IndexError: {info.value}" in out and "reproduced" in out and "step 4" in out
    # `python -m lightning_tfdebug` is the same entry point; the saved hyper-parameters suffice without a config
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-m", "lightning_tfdebug", "replay", str(bundle)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "reproduced: same exception type and message" in proc.stdout
    # the log directory is enough: its newest bundle is replayed
    assert main(["replay", str(tmp_path / "cli" / "version_0"), "--config", str(path)]) == 0
    assert "1 bundle(s) under" in capsys.readouterr().out


def test_a_batch_batchguard_rejects_is_captured_and_replays_to_the_model_error(tmp_path):
    from lightning_tfdebug import BatchGuard, TFDebugError

    capture = ReproCapture()
    guard = BatchGuard(on_finding="raise")
    trainer = make_trainer(tmp_path, [guard, capture], max_steps=8)  # capture listed last: it moves itself first
    with pytest.raises(TFDebugError, match="TFD110"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(TinyGPT(**SMALL), TinyTextDataModule(batch_size=8, bad_token_every=3))
    assert trainer.callbacks[0] is capture
    (bundle,) = capture.bundles
    loaded = load_bundle(bundle)
    assert loaded.meta["in_training_batch"] and loaded.batch["input_ids"][0, 1] == 262
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = replay(loaded, TinyGPT(**SMALL))
    # the guard stopped the run before the forward; the replay shows the crash it prevented
    assert isinstance(result.exception, IndexError) and not result.reproduced
    assert any("TFDebugError" in note for note in result.notes)


def test_cli_errors_are_one_clear_line(tmp_path, capsys):
    assert main(["replay", str(tmp_path)]) == 2
    assert "is not a repro bundle" in capsys.readouterr().err


def test_build_module_reads_the_config_shapes_lightning_cli_writes(tmp_path):
    from lightning_tfdebug.repro import BundleError, build_module

    nested = tmp_path / "nested.yaml"  # `python main.py --config nested.yaml`: sections under the subcommand
    nested.write_text(
        yaml.safe_dump(
            {
                "fit": {
                    "model": {
                        "class_path": "lightning_tfdebug.demo.TinyGPT",
                        "init_args": {**SMALL, "context_length": 48},
                    }
                }
            }
        )
    )
    assert build_module(nested).pos_emb.num_embeddings == 48
    no_model = tmp_path / "trainer-only.yaml"  # no model section: the hyper-parameters saved in the bundle
    no_model.write_text(yaml.safe_dump({"trainer": {"max_steps": 3}}))
    saved = {**SMALL, "context_length": 40, "_instantiator": "lightning.pytorch.cli.instantiate_module"}
    model = build_module(no_model, model_class="lightning_tfdebug.demo.TinyGPT", hparams=saved)
    assert model.pos_emb.num_embeddings == 40
    with pytest.raises(BundleError, match="Cannot read the config"):
        build_module(tmp_path / "missing.yaml")
    with pytest.raises(BundleError, match="not a LightningModule"):  # a tampered bundle naming another class
        build_module(None, model_class="subprocess.Popen", hparams={"args": "touch PWNED"})
    with pytest.raises(BundleError, match="Could not build the model"):
        build_module(None, model_class="lightning_tfdebug.demo.TinyGPT", hparams={"no_such_argument": 1})


def test_cli_says_when_the_failure_does_not_reproduce(tmp_path, capsys):
    _, bundle = crash(tmp_path, TinyGPT(**SMALL), TinyTextDataModule(batch_size=8, bad_token_every=3))
    config = write_config(tmp_path, {**SMALL, "vocab_size": 512})  # a model whose vocabulary holds the bad token
    # the saved weights do not fit that model: one clear line, not a load_state_dict traceback
    assert main(["replay", bundle, "--config", str(config)]) == 2
    assert "does not fit the module built for the replay" in capsys.readouterr().err
    assert main(["replay", bundle, "--config", str(config), "--fresh-weights"]) == 1
    assert "did not reproduce" in capsys.readouterr().out


class HFLanguageModel(TinyGPT.__mro__[1]):  # a LightningModule around a Hugging Face GPT-2 (no download)
    def __init__(self):
        super().__init__()
        from transformers import GPT2Config, GPT2LMHeadModel

        config = GPT2Config(
            vocab_size=300, n_positions=48, n_embd=32, n_layer=1, n_head=2, bos_token_id=0, eos_token_id=0
        )
        self.lm = GPT2LMHeadModel(config)

    def training_step(self, batch, batch_idx):
        return self.lm(**batch).loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def test_a_model_nobody_here_wrote_replays_too(tmp_path):
    # the demo data are 64 tokens wide, longer than this GPT-2's 48 positions: it fails on the first long batch
    error, bundle = crash(tmp_path, HFLanguageModel(), TinyTextDataModule(batch_size=4, context_length=64))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = replay(bundle, HFLanguageModel())
    assert result.reproduced, f"{result.exception!r} != {error!r}"


def test_a_shape_error_in_a_parameter_position_table_replays(tmp_path):
    from tests.callbacks.batch_guard.test_callback import MinGPTStyle

    data = TinyTextDataModule(batch_size=4, context_length=30, long_batch_every=3)  # batch 2 is 38 wide
    error, bundle = crash(tmp_path, MinGPTStyle(block_size=37), data, max_steps=6)
    assert isinstance(error, RuntimeError) and "must match" in str(error) and bundle.endswith("step2-rank0")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = replay(bundle, MinGPTStyle(block_size=37))
    assert result.reproduced, f"{result.exception!r} != {error!r}"
