"""The pack under the standalone ``pytorch_lightning`` package, as many users still ``import pytorch_lightning as pl``.

A user's model, Trainer and logger all come from ``pytorch_lightning`` here (none from ``lightning.pytorch``); the
findings must reach that package's TensorBoard logger as text, and its ``LightningCLI`` must build the callbacks from
YAML class paths. Also: the pack's warnings name the pack and the finding, not a line of the pack's source.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

import lightning_tfdebug as tfd
from lightning_tfdebug.core.compat import is_lightning_instance, is_lightning_subclass, overrides
from lightning_tfdebug.demo import ByteTokenizer
from lightning_tfdebug.demo.data import Collator, TextDataset, generate_corpus

ptl = pytest.importorskip("pytorch_lightning")
from pytorch_lightning.loggers import TensorBoardLogger  # noqa: E402

VOCAB = ByteTokenizer.vocab_size
CONTEXT = 32


class StandaloneLM(ptl.LightningModule):
    """A small causal LM written against ``pytorch_lightning`` only, fed the demo's dict batches."""

    def __init__(self, d_model: int = 32, lr: float = 2e-3) -> None:
        super().__init__()
        self.lr = lr
        self.embed = nn.Embedding(VOCAB, d_model)
        self.pos = nn.Embedding(CONTEXT, d_model)
        layer = nn.TransformerEncoderLayer(d_model, 2, 2 * d_model, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 1, enable_nested_tensor=False)
        self.head = nn.Linear(d_model, VOCAB)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        t = input_ids.shape[1]
        h = self.embed(input_ids) + self.pos(torch.arange(t, device=input_ids.device))
        causal = nn.Transformer.generate_square_subsequent_mask(t, device=input_ids.device)
        return self.head(self.encoder(h, mask=causal, is_causal=True))

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        logits = self(batch["input_ids"])
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), batch["labels"][:, 1:].reshape(-1))
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


def loader(pad_labels_supervised: bool = True) -> DataLoader:
    """The demo corpus; ``pad_labels_supervised`` is bug 3 (padding positions trained on), which BatchGuard names."""
    tok = ByteTokenizer()
    data = TextDataset(generate_corpus(200, seed=0), tok, CONTEXT)
    return DataLoader(
        data, batch_size=8, collate_fn=Collator(tok, CONTEXT, pad_labels_supervised=pad_labels_supervised)
    )


class StandaloneData(ptl.LightningDataModule):
    def __init__(self, pad_labels_supervised: bool = True) -> None:
        super().__init__()
        self.pad_labels_supervised = pad_labels_supervised

    def train_dataloader(self) -> DataLoader:
        return loader(self.pad_labels_supervised)


def read_texts(event_dir: Path) -> dict[str, list[str]]:
    """Every TensorBoard text summary of the pack under ``event_dir``: ``{tag: [markdown, ...]}`` (``add_text``'s tag,
    without the ``/text_summary`` that TensorBoard appends)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(event_dir), size_guidance={"tensors": 0})
    acc.Reload()
    return {
        tag.removesuffix("/text_summary"): [b"".join(e.tensor_proto.string_val).decode() for e in acc.Tensors(tag)]
        for tag in acc.Tags()["tensors"]
        if tag.startswith(("tfdebug/", "batch_guard/"))
    }


def standalone_trainer(tmp_path: Path, callbacks: list, max_steps: int = 4) -> ptl.Trainer:
    """A ``pytorch_lightning.Trainer`` on the CPU with that package's own ``TensorBoardLogger``."""
    return ptl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=max_steps,
        logger=TensorBoardLogger(tmp_path, name="tb", version=0),
        callbacks=callbacks,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        log_every_n_steps=1,
        default_root_dir=tmp_path,
    )


def test_findings_and_decoded_examples_reach_pytorch_lightning_tensorboard_as_text(tmp_path):
    guard = tfd.BatchGuard(tokenizer="lightning_tfdebug.demo.ByteTokenizer", decode_examples=2)
    monitor = tfd.GradNormMonitor()
    trainer = standalone_trainer(tmp_path, [guard, monitor])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", tfd.TFDebugWarning)
        trainer.fit(StandaloneLM(), loader())
    assert trainer.global_step == 4
    assert "TFD115" in {f.code for f in guard.findings}  # padding supervised: found under pytorch_lightning too
    texts = read_texts(tmp_path / "tb" / "version_0")
    assert "tfdebug/TFD115" in texts, f"no finding text in the event file; text tags: {sorted(texts)}"
    assert texts["tfdebug/TFD115"][0].startswith("**TFD115 warning step 0") and "[TFD115]" in texts["tfdebug/TFD115"][0]
    assert "BatchGuard" in texts["tfdebug/TFD115"][0]
    examples = texts.get("batch_guard/examples", [])
    assert examples and "rank 0" in examples[0]  # the decoded first batch, next to the findings
    scalars = trainer.callback_metrics
    assert "grad_norm/total" in scalars and torch.isfinite(scalars["grad_norm/total"])


def test_the_one_entry_pack_under_pytorch_lightning(tmp_path):
    pack_class = getattr(tfd, "TFDebug", None)
    if pack_class is None:
        pytest.skip("lightning_tfdebug.TFDebug (the one-entry pack) is not in this checkout yet")
    trainer = standalone_trainer(tmp_path, [pack_class()])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", tfd.TFDebugWarning)
        trainer.fit(StandaloneLM(), loader())
    texts = read_texts(tmp_path / "tb" / "version_0")
    assert "tfdebug/TFD115" in texts, f"text tags: {sorted(texts)}"


def test_pytorch_lightning_cli_builds_the_callbacks_from_class_paths(tmp_path, monkeypatch):
    from pytorch_lightning.cli import LightningCLI

    monkeypatch.setattr("sys.argv", ["train.py"])  # the config comes from `args`, not from pytest's command line

    config = {
        "trainer": {
            "accelerator": "cpu",
            "devices": 1,
            "max_steps": 3,
            "log_every_n_steps": 1,
            "enable_progress_bar": False,
            "enable_checkpointing": False,
            "enable_model_summary": False,
            "default_root_dir": str(tmp_path),
            "logger": {
                "class_path": "pytorch_lightning.loggers.TensorBoardLogger",
                "init_args": {"save_dir": str(tmp_path), "name": "cli", "version": 0},
            },
            "callbacks": [
                {"class_path": "lightning_tfdebug.BatchGuard", "init_args": {"every_n_steps": 1}},
                {"class_path": "lightning_tfdebug.ThroughputMonitor", "init_args": {"every_n_steps": 2}},
            ],
        },
        "model": {"d_model": 32},
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", tfd.TFDebugWarning)
        cli = LightningCLI(StandaloneLM, StandaloneData, args={"fit": config}, save_config_kwargs={"overwrite": True})
    callbacks = {type(c).__name__: c for c in cli.trainer.callbacks}
    assert isinstance(callbacks["BatchGuard"], tfd.BatchGuard)
    assert cli.trainer.global_step == 3
    texts = read_texts(tmp_path / "cli" / "version_0")
    assert "tfdebug/TFD115" in texts, f"text tags: {sorted(texts)}"
    assert "throughput/tokens_per_sec" in cli.trainer.callback_metrics


def test_lightning_classes_are_matched_in_either_package(tmp_path):
    import lightning.pytorch as lpl
    from lightning.pytorch.loggers import TensorBoardLogger as UnifiedTensorBoardLogger

    for logger in (TensorBoardLogger(tmp_path), UnifiedTensorBoardLogger(tmp_path)):
        assert is_lightning_instance(logger, "TensorBoardLogger")
        assert not is_lightning_instance(logger, "CSVLogger")

    class MyLogger(TensorBoardLogger):  # a user's subclass counts as well
        pass

    assert is_lightning_instance(MyLogger(tmp_path), "TensorBoardLogger")
    assert is_lightning_subclass(StandaloneLM, "LightningModule")
    assert is_lightning_subclass(lpl.LightningModule, "LightningModule")
    assert not is_lightning_subclass(nn.Linear, "LightningModule")

    class TensorBoardLogger2(nn.Module):  # same name outside Lightning: not a Lightning class
        pass

    TensorBoardLogger2.__name__ = "TensorBoardLogger"
    assert not is_lightning_instance(TensorBoardLogger2(), "TensorBoardLogger")
    # the pack's callbacks are callbacks of both packages: both Trainers and both LightningCLIs accept them
    assert isinstance(tfd.BatchGuard(), ptl.Callback) and isinstance(tfd.BatchGuard(), lpl.Callback)
    # GradNormMonitor counts clipping only through Lightning's own `clip_grad_by_norm`, of either package
    from lightning.pytorch.plugins.precision import Precision as UnifiedPrecision
    from pytorch_lightning.plugins.precision import Precision as StandalonePrecision

    assert not overrides(StandalonePrecision(), "Precision", "clip_grad_by_norm")
    assert not overrides(UnifiedPrecision(), "Precision", "clip_grad_by_norm")

    class OwnClipping(StandalonePrecision):
        def clip_grad_by_norm(self, optimizer, clip_val):  # pragma: no cover - never called
            pass

    assert overrides(OwnClipping(), "Precision", "clip_grad_by_norm")


def test_warnings_name_the_pack_and_the_finding_and_filter_by_category(tmp_path):
    guard = tfd.BatchGuard()
    trainer = standalone_trainer(tmp_path, [guard], max_steps=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(StandaloneLM(), loader())
    ours = [w for w in caught if issubclass(w.category, tfd.TFDebugWarning) and "[TFD115]" in str(w.message)]
    assert len(ours) == 1
    shown = warnings.formatwarning(ours[0].message, ours[0].category, ours[0].filename, ours[0].lineno, ours[0].line)
    assert shown.startswith("lightning_tfdebug: [TFD115] WARNING from BatchGuard at step 0"), shown
    assert "base.py" not in shown and "lightning_tfdebug/" not in shown
    # other warnings keep their usual rendering (file:line: Category: message)
    other = warnings.formatwarning("plain", UserWarning, "/x/y.py", 3)
    assert other.startswith("/x/y.py:3: UserWarning: plain")

    guard = tfd.BatchGuard()
    trainer = standalone_trainer(tmp_path / "quiet", [guard], max_steps=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warnings.filterwarnings("ignore", category=tfd.TFDebugWarning)
        trainer.fit(StandaloneLM(), loader())
    assert "TFD115" in {f.code for f in guard.findings}  # still found and written
    assert not [w for w in caught if issubclass(w.category, tfd.TFDebugWarning)]


def test_throughput_token_window_sums_exactly_without_sync():
    """ThroughputMonitor's running token sum (an in-place float64 add): the same total as torchmetrics' SumMetric
    and a plain sum, and no host sync or collective on the micro-batches between measurements."""
    from torch.overrides import TorchFunctionMode
    from torchmetrics import SumMetric

    from lightning_tfdebug.functional.throughput import CountWindow

    window = CountWindow()
    masks = [torch.randint(0, 2, (4, 16)) for _ in range(7)]
    seen: list[str] = []

    class Spy(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            seen.append(getattr(func, "__name__", str(func)))
            return func(*args, **(kwargs or {}))

    with Spy():
        for m in masks:
            window.add(m.sum())
        window.add(5)  # a host count (from shapes) stays on the host
    assert not {"item", "tolist", "__bool__", "cpu", "numpy"} & set(seen), sorted(set(seen))
    expected = sum(int(m.sum()) for m in masks) + 5
    total = window.total(torch.device("cpu"))
    assert total.dtype == torch.float64 and total.item() == expected
    metric = SumMetric(nan_strategy="disable").set_dtype(torch.float64)
    for m in masks:
        metric.update(m.sum())
    assert metric.compute().item() + 5 == total.item()
    assert window.total(torch.device("cpu")).item() == 0  # the next window starts empty
