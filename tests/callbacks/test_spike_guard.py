"""SpikeGuard: a corrupt batch is flagged on its step naming its rows, replayed from its bundle, skipped bit-exactly on
request; healthy runs stay silent; the flag adds no host read next to NaNFirstFrame."""

from __future__ import annotations

import math
import warnings
from collections import Counter
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from torch.overrides import TorchFunctionMode

from lightning_tfdebug import NaNFirstFrame, SpikeGuard, TFDebug, TFDebugWarning
from lightning_tfdebug.__main__ import main as tfdebug_main
from lightning_tfdebug.demo import TinyGPT
from lightning_tfdebug.functional.spike_checks import RobustBaseline, carriers, log_value, restart_reason, spike_flag
from tests.helpers import SMALL, fit_tiny, make_trainer

SPIKE_STEP, ROWS = 40, (2, 5)


class CorruptRows(pl.Callback):
    """At optimizer step ``step``, overwrite ``rows`` of the batch with random byte ids (labels follow the ids)."""

    def __init__(self, step: int = SPIKE_STEP, rows: tuple[int, ...] = ROWS, key: str = "input_ids") -> None:
        self.step, self.rows, self.key = step, rows, key

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step != self.step:
            return
        g = torch.Generator().manual_seed(0)
        for r in self.rows:
            batch[self.key][r] = torch.randint(0, 256, batch[self.key][r].shape, generator=g)
            if "labels" in batch:
                batch["labels"][r] = batch[self.key][r]


class Snapshots(pl.Callback):
    """The weights and the optimizer state at the start of steps ``steps`` (copies)."""

    def __init__(self, steps: tuple[int, ...]) -> None:
        self.steps, self.taken = steps, {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step in self.steps:
            weights = {k: v.detach().clone() for k, v in pl_module.state_dict().items()}
            opt = trainer.optimizers[0].state_dict()["state"]
            state = {(i, k): v.clone() if torch.is_tensor(v) else v for i, s in opt.items() for k, v in s.items()}
            self.taken[trainer.global_step] = (weights, state)


def _fit(tmp_path: Path, callbacks: list, steps: int = 60) -> pl.Trainer:
    return fit_tiny(tmp_path, callbacks, model=TinyGPT(**SMALL, lr=3e-3), max_steps=steps)


# ------------------------------------------------------------------------------------------------------------ pure
def test_the_baseline_follows_a_falling_noisy_loss_without_a_flag_and_flags_a_jump():
    torch.manual_seed(0)
    base = RobustBaseline()
    flags = []
    for t in range(300):
        loss = 3.0 * math.exp(-t / 80) + 1.0 + 0.15 * torch.randn(()).abs().item()  # small-batch noise, skewed up
        x = log_value(torch.tensor(loss))
        flag = spike_flag(base, x, 6.0, 1.3) if base.seen >= 20 else None
        base.update(x, None if flag is None else flag.logical_not())
        flags.append(bool(flag) if flag is not None else False)
    assert not any(flags)
    jump = log_value(torch.tensor(2.5 * math.exp(float(base.mean))))
    assert bool(spike_flag(base, jump, 6.0, 1.3))
    before = float(base.mean)
    base.update(jump, torch.tensor(False))  # a flagged step does not feed the baseline
    assert float(base.mean) == before


def test_carriers_and_restarts():
    assert carriers([1.0, 1.1, 7.8, 0.9, 1.2, 7.7, 1.0, 1.05]) == [2, 5]
    assert carriers([1.0, 1.01, 0.99, 1.02]) == [3]  # nothing stands out: the one largest row
    assert restart_reason(1e-3, 1e-4, 64, 64, 1.5) is not None
    assert restart_reason(2e-4, 1e-4, 64, 64, 1.5, warming_up=True) is None  # a warm-up, not a restart
    assert restart_reason(1e-3, 1e-3, 128, 64, 1.5) is not None
    assert restart_reason(1e-3, 1e-3, 60, 64, 1.5) is None  # padding to the longest row


# ------------------------------------------------------------------------------------------------------- real fits
@pytest.mark.slow
def test_a_corrupt_batch_is_skipped_bit_exactly_named_and_replayed(tmp_path, capsys):
    guard = SpikeGuard(on_spike="skip")
    snaps = Snapshots((SPIKE_STEP, SPIKE_STEP + 1))
    trainer = _fit(tmp_path, [CorruptRows(), guard, snaps])
    assert guard.spike_steps == [SPIKE_STEP] and guard.skipped_steps == 1
    assert trainer.global_step == 60  # the run went on
    (finding,) = [f for f in guard.findings if f.code == "TFD530"]
    assert finding.evidence["rows"] == list(ROWS) or sorted(finding.evidence["rows"]) == sorted(ROWS)
    assert finding.evidence["skipped"] and "row 2" in finding.message and "row 5" in finding.message
    before, after = snaps.taken[SPIKE_STEP], snaps.taken[SPIKE_STEP + 1]
    for k, v in before[0].items():
        assert torch.equal(v, after[0][k]), k
    assert before[1].keys() == after[1].keys()
    for k, v in before[1].items():
        assert torch.equal(v, after[1][k]) if torch.is_tensor(v) else v == after[1][k], k
    # the bundle: replay reproduces the per-sample losses
    (bundle,) = guard.bundles
    assert Path(bundle).name == f"step{SPIKE_STEP}-rank0"
    capsys.readouterr()
    assert tfdebug_main(["replay", bundle]) == 0
    out = capsys.readouterr().out
    assert "reproduced" in out and out.count("<- named") == 2


@pytest.mark.slow
def test_in_the_pack_the_flag_travels_in_nan_first_frames_read_and_warns(tmp_path):
    pack = TFDebug()
    trainer = _fit(tmp_path, [CorruptRows(), pack])
    codes = [(f.code, f.step) for f in pack.findings]
    assert ("TFD530", SPIKE_STEP) in codes
    guard = pack.members["SpikeGuard"]
    assert guard.spike_steps == [SPIKE_STEP] and guard.skipped_steps == 0 and trainer.global_step == 60


class _Reads(TorchFunctionMode):
    """Counts host reads (``.item()``, ``.tolist()``) per optimizer step of the whole fit."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter = Counter()
        self.trainer = None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in ("item", "tolist") and self.trainer is not None:
            self.counts[self.trainer.global_step] += 1
        return func(*args, **(kwargs or {}))


class _Bind(pl.Callback):
    def __init__(self, reads: _Reads) -> None:
        self.reads = reads

    def on_train_start(self, trainer, pl_module):
        self.reads.trainer = trainer


@pytest.mark.slow
def test_no_extra_host_read_next_to_nan_first_frame(tmp_path):
    counts = []
    for i, extra in enumerate(([], [SpikeGuard(warmup_steps=5)])):
        reads = _Reads()
        with reads:
            fit_tiny(tmp_path / str(i), [_Bind(reads), NaNFirstFrame(), *extra], max_steps=25)
        counts.append(reads.counts)
    steps = range(1, 24)
    assert all(counts[0][s] >= 1 for s in steps)  # NaNFirstFrame's one read per step is seen
    assert [counts[1][s] for s in steps] == [counts[0][s] for s in steps]


@pytest.mark.slow
@pytest.mark.parametrize("family", ["tinygpt", "encoder_lm", "gpt2", "bert_mlm"])
def test_healthy_small_batch_runs_are_silent(tmp_path, family):
    from tests.healthy_models import build, data

    guard = SpikeGuard(warmup_steps=10)
    trainer = make_trainer(tmp_path, [guard], max_steps=80)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", TFDebugWarning)
        trainer.fit(build(family), data(family, batch_size=2))
    assert guard.spike_steps == [] and guard.findings == []
    assert guard.stood_aside is None or family == "encoder_lm"


# --------------------------------------------------------------------------------------------------------- DDP
class BitExact(pl.Callback):
    """Whether the weights and the optimizer state after SpikeGuard's first skipped step equal those before it."""

    def __init__(self) -> None:
        self.prev = None
        self.skipped_before = 0
        self.equal: bool | None = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        guard = next(c for c in trainer.callbacks if isinstance(c, SpikeGuard))
        now = Snapshots((trainer.global_step,))
        now.on_train_batch_start(trainer, pl_module, batch, batch_idx)
        (w1, s1) = now.taken[trainer.global_step]
        if self.equal is None and guard.skipped_steps > self.skipped_before and self.prev is not None:
            w0, s0 = self.prev
            same_w = all(torch.equal(v, w1[k]) for k, v in w0.items())
            same_s = s0.keys() == s1.keys() and all(
                torch.equal(v, s1[k]) if torch.is_tensor(v) else v == s1[k] for k, v in s0.items()
            )
            self.equal = same_w and same_s
        self.skipped_before, self.prev = guard.skipped_steps, (w1, s1)


class Trace(pl.Callback):
    def __init__(self) -> None:
        self.rows = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        g = next(c for c in trainer.callbacks if isinstance(c, SpikeGuard))
        if g._x is not None and 30 <= trainer.global_step <= 44:
            self.rows.append((trainer.global_step, round(float(g._x), 3), round(float(g._baseline.mean), 3)))


class CorruptOnRankZero(CorruptRows):
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_rank == 0:
            super().on_train_batch_start(trainer, pl_module, batch, batch_idx)


class CorruptEveryRank(CorruptRows):
    """The same rows corrupted on every rank (the all-reduced gradient carries the whole excess)."""


def ddp_result(trainer, model, callbacks) -> dict:
    guard = next(c for c in callbacks if isinstance(c, SpikeGuard))
    exact = next(c for c in callbacks if isinstance(c, BitExact))
    return {
        "spikes": guard.spike_steps,
        "skipped": guard.skipped_steps,
        "equal": exact.equal,
        "rows": [f.evidence.get("rows") for f in guard.findings if f.code == "TFD530"],
        "weights": float(sum(p.detach().double().sum() for p in model.parameters())),
        "why": [next(c for c in callbacks if isinstance(c, Trace)).rows],
    }


@pytest.mark.slow
@pytest.mark.ddp
def test_under_ddp_every_rank_skips_the_same_step_bit_exactly(tmp_path):
    from tests.helpers import run_distributed

    here = "tests.callbacks.test_spike_guard"
    spec = {
        "strategy": "ddp",
        "model": {**SMALL, "lr": 3e-3},
        "trainer": {"max_steps": 50},
        "callbacks": [
            {"class_path": f"{here}.CorruptEveryRank"},
            {"class_path": "lightning_tfdebug.SpikeGuard", "init_args": {"on_spike": "skip"}},
            {"class_path": f"{here}.BitExact"},
            {"class_path": f"{here}.Trace"},
        ],
        "extra": f"{here}:ddp_result",
    }
    results = run_distributed(tmp_path, spec, timeout=400)
    assert all(r["error"] is None for r in results), results
    extra = [r["extra"] for r in results]
    # the ranks agree, from the all-reduced gradients (which step: see the known gap in the report / docs Limits)
    assert extra[0]["spikes"] == extra[1]["spikes"] and extra[0]["spikes"], extra
    assert SPIKE_STEP <= extra[0]["spikes"][0] <= SPIKE_STEP + 1
    assert all(e["equal"] is True for e in extra)  # the first skipped step left weights and optimizer state exact
    assert extra[0]["weights"] == extra[1]["weights"]  # the replicas stayed identical
