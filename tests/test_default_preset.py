"""What a user gets by default: ``TFDebug()`` as the README's YAML configures it (``preset: always``) catches the
best-known transformer bugs on real fits, and a healthy run prints the pack's summary and nothing else from it."""

from __future__ import annotations

import logging
import warnings

import pytest
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_tfdebug import TFDebug, TFDebugWarning
from lightning_tfdebug.demo import TinyGPT, TinyTextDataModule
from tests.helpers import SMALL, fit_tiny, make_trainer


def readme_pack() -> TFDebug:
    """The README's YAML: preset always, on_finding warn, one override."""
    return TFDebug(preset="always", on_finding="warn", overrides={"GradNormMonitor": {"explosion_factor": 20}})


def found(pack: TFDebug) -> dict[str, str]:
    return {f.code: f.severity for f in pack.findings}


@pytest.mark.parametrize(
    "bug, code, severity",
    [
        ("no_causal_mask", "TFD201", "error"),  # a decoder that sees the future
        ("unshifted_labels", "TFD205", "error"),  # the target is the input token itself
    ],
)
def test_the_default_pack_flags_the_mask_and_target_bugs(tmp_path, bug, code, severity):
    pack = readme_pack()
    fit_tiny(tmp_path, [pack], TinyGPT(**SMALL, **{bug: True}), max_steps=3)
    assert found(pack).get(code) == severity, pack.findings


def test_the_default_pack_flags_a_run_whose_checkpoints_are_all_weights_only(tmp_path):
    pack = readme_pack()
    only_weights = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=2, save_weights_only=True)
    fit_tiny(tmp_path, [pack, only_weights], max_steps=4, enable_checkpointing=True)
    assert found(pack).get("TFD709") == "warning", pack.findings
    [finding] = [f for f in pack.findings if f.code == "TFD709"]
    assert finding.evidence["resumable"] is False
    assert pack.members["CheckpointAudit"].checked_files == []  # judged in memory: no file was read back


def test_a_healthy_run_prints_the_summary_and_nothing_else(tmp_path, capsys, caplog):
    pack = readme_pack()
    trainer = make_trainer(tmp_path, [pack], max_steps=12, log_every_n_steps=4)  # (fit_tiny silences our warnings)
    with warnings.catch_warnings(record=True) as caught, caplog.at_level(logging.INFO):
        warnings.simplefilter("always")
        trainer.fit(TinyGPT(**SMALL), TinyTextDataModule(batch_size=8))
    ours = [
        str(w.message)
        for w in caught
        if issubclass(w.category, TFDebugWarning) or "lightning_tfdebug" in str(w.filename)
    ]
    assert ours == []
    assert not [r.getMessage() for r in caplog.records if "lightning_tfdebug" in r.getMessage()]
    out = capsys.readouterr().out
    pack_lines = [line for line in out.splitlines() if "lightning_tfdebug" in line or "TFD" in line]
    assert pack_lines and pack_lines[0].startswith("lightning_tfdebug: 0 errors, 0 warnings"), out
    assert [f for f in pack.findings if f.severity != "info"] == []
