"""How the pack's scalars reach the loggers (issue 25): one write per logger and step, one TensorBoard event per step
for a plain ``TensorBoardLogger``, the same values every logger sees, and a failing logger that costs only curves."""

from __future__ import annotations

import csv
import math
import warnings
from collections import Counter
from pathlib import Path

import pytest
from lightning.pytorch.loggers import CSVLogger, Logger, TensorBoardLogger
from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

import lightning_tfdebug as tfd
from lightning_tfdebug.demo import TinyGPT, TinyTextDataModule
from lightning_tfdebug.pack import MEMBERS
from lightning_tfdebug.primitives.keys import declared
from tests.helpers import SMALL, fit_tiny, make_trainer, read_scalars

KEYS = tuple(key for member in MEMBERS.values() for key in member.KEYS)
_OURS = tuple(sorted({key.section + "/" for key in KEYS}))  # every section a member declares


def _csv_scalars(path: Path) -> dict[str, dict[int, float]]:
    """``{tag: {step: value}}`` from a CSVLogger's metrics file (empty cells are keys logged at other rows)."""
    out: dict[str, dict[int, float]] = {}
    with open(path) as f:
        for row in csv.DictReader(f):
            step = int(row["step"])
            for key, value in row.items():
                if key != "step" and value != "":
                    out.setdefault(key, {})[step] = float(value)
    return out


def _events_per_step(event_dir: Path) -> Counter[int]:
    """How many events with a summary the event files under ``event_dir`` hold at each step, for the pack's tags."""
    counts: Counter[int] = Counter()
    for path in event_dir.rglob("events.out.tfevents.*"):
        for event in EventFileLoader(str(path)).Load():
            if event.HasField("summary") and any(v.tag.startswith(_OURS) for v in event.summary.value):
                counts[event.step] += 1
    return counts


def test_the_pack_writes_one_tensorboard_event_per_hook_call_with_the_values_every_logger_sees(tmp_path):
    """TensorBoard gets each measuring step's scalars in a few events (not one per scalar), and holds for every tag
    and step exactly the value the CSV logger got and, for the last step, the value in ``callback_metrics``."""
    pack = tfd.TFDebug(preset="always", every_n_steps=5, summary=False)
    trainer = fit_tiny(tmp_path, [pack], max_steps=16)
    tb = read_scalars(tmp_path / "tb" / "version_0")
    ours = {tag: points for tag, points in tb.items() if tag.startswith(_OURS)}
    assert any(t.startswith("grad_norm/") for t in ours) and any(t.startswith("update_ratio/") for t in ours)
    assert any(t.startswith("dead_activation/") for t in ours)
    for tag in (t for t in ours if t.startswith("grad_norm/")):
        assert [step for step, _ in ours[tag]] == [0, 5, 10, 15], tag
    per_step = _events_per_step(tmp_path / "tb")
    # one event per hook call that logs (batch start, before backward: MaskProbe's probes on the recorded call, before
    # the optimizer step, batch end); was one per scalar (~45)
    assert per_step and max(per_step.values()) <= 4, per_step
    csv_values = _csv_scalars(tmp_path / "csv" / "version_0" / "metrics.csv")
    for tag, points in ours.items():
        for step, value in points:
            expected = csv_values[tag][step]
            # TensorBoard keeps a float32 (`simple_value`), as `add_scalar` does; the CSV keeps the float64
            both_nan = math.isnan(value) and math.isnan(expected)
            assert both_nan or math.isclose(value, expected, rel_tol=1e-6, abs_tol=1e-30), (tag, step, value, expected)
        last_step, last_value = points[-1]
        if tag in trainer.callback_metrics and last_step == max(csv_values[tag]):
            assert math.isclose(float(trainer.callback_metrics[tag]), last_value, rel_tol=1e-6, abs_tol=1e-30)


def test_a_tensorboard_logger_with_a_prefix_gets_its_own_log_metrics_and_its_prefix(tmp_path):
    """A prefix (or a subclass) is left to the logger's own method, which applies it."""
    logger = TensorBoardLogger(tmp_path, name="tb", version=0, prefix="run")
    monitor = tfd.GradNormMonitor(every_n_steps=2)
    fit_tiny(tmp_path, [monitor], logger=logger, max_steps=4)
    tags = read_scalars(tmp_path / "tb" / "version_0")
    assert any(t.startswith("run-grad_norm/") for t in tags), sorted(tags)
    assert not any(t.startswith("grad_norm/") for t in tags)


class _RefusingLogger(Logger):
    """A logger whose ``log_metrics`` always raises (a full disk, a lost connection)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    @property
    def name(self) -> str:
        return "refusing"

    @property
    def version(self) -> int:
        return 0

    def log_hyperparams(self, *args, **kwargs) -> None:
        pass

    def log_metrics(self, metrics, step=None) -> None:
        self.calls += 1
        if any(key.startswith(_OURS) for key in metrics):
            raise OSError("no space left on device")


@pytest.mark.parametrize("alone", [False, True], ids=["pack", "alone"])
def test_a_logger_that_refuses_the_scalars_costs_curves_not_findings(tmp_path, alone):
    """A logger whose ``log_metrics`` raises is warned about once; the callbacks keep working and the bug (the head
    left out of the optimizer) is still found, inside the pack and by a callback used on its own; the other logger
    still gets its curves."""
    refusing = _RefusingLogger()
    callbacks = [tfd.UpdateRatio(every_n_steps=2)] if alone else [tfd.TFDebug(preset="always", every_n_steps=2)]
    logger = [refusing, CSVLogger(tmp_path, name="csv", version=0)]
    trainer = make_trainer(tmp_path, callbacks, logger=logger, max_steps=12)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(TinyGPT(head_not_in_optimizer=True, **SMALL), TinyTextDataModule(batch_size=8))
    members = [callbacks[0]] if alone else list(callbacks[0].running.values())
    codes = {f.code for m in members for f in m.findings}
    assert refusing.calls > 0
    refusals = [w for w in caught if "refused" in str(w.message) and "scalars" in str(w.message)]
    assert len(refusals) == 1, [str(w.message) for w in caught]
    assert all(m.failure is None for m in members), [(m, m.failure) for m in members if m.failure]
    assert codes & {"TFD312", "TFD320"}, sorted(codes)  # the head left out of the optimizer is still found
    assert any(k.startswith("update_ratio/") for k in _csv_scalars(tmp_path / "csv" / "version_0" / "metrics.csv"))


def test_every_key_the_pack_logs_is_declared_by_its_member(tmp_path):
    """The logged-key schema is the contract: every scalar of the pack's sections matches a key its member declares
    in ``KEYS`` (from which the docs tables and the dashboard are derived), and each section belongs to one member."""
    pack = tfd.TFDebug(preset="full", every_n_steps=2, summary=False)
    fit_tiny(tmp_path, [pack], max_steps=6)
    tags = [tag for tag in read_scalars(tmp_path / "tb" / "version_0") if tag.startswith(_OURS)]
    assert len(tags) > 20
    undeclared = [tag for tag in tags if declared(KEYS, tag) is None]
    assert not undeclared, f"logged but not declared in any member's KEYS: {undeclared}"
    owners: dict[str, set[str]] = {}
    for name, member in MEMBERS.items():
        for key in member.KEYS:
            owners.setdefault(key.section, set()).add(name)
    assert all(len(names) == 1 for names in owners.values()), owners
