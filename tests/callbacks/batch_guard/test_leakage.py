"""BatchGuard's train/validation leakage check (TFD126, TFD127): rows of the validation and test loops that are rows the
model trained on, per row, across batch sizes and paddings, decided across ranks."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from pathlib import Path

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Subset

from lightning_tfdebug import BatchGuard, TFDebugWarning
from lightning_tfdebug.callbacks.batch_guard.leakage_checks import LeakageWatch
from lightning_tfdebug.callbacks.batch_guard.row_prints import informative, row_field, row_keys
from lightning_tfdebug.demo import TinyGPT, TinyTextDataModule
from lightning_tfdebug.primitives.batch import BatchKeys, StepBatch
from tests.helpers import make_trainer, run_distributed

TINY = dict(d_model=16, n_layers=1, n_heads=1)
PAD = 256


def padded(rows: list[list[int]], width: int, left: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.full((len(rows), width), PAD)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        at = slice(width - len(r), width) if left else slice(0, len(r))
        ids[i, at], mask[i, at] = torch.tensor(r), 1
    return ids, mask


# ------------------------------------------------------------------------------------------------ the row keys
def test_a_rows_key_ignores_its_padding_its_width_and_its_batch():
    a, b = list(range(10, 30)), list(range(40, 52))
    keys = {}
    for name, (rows, width, left) in {
        "right, 24": ([a, b], 24, False),
        "right, 64": ([b, a, b], 64, False),
        "left, 32": ([a], 32, True),
        "unpadded": ([a], 20, False),
    }.items():
        ids, mask = padded(rows, width, left)
        keys[name] = row_keys(ids, mask).tolist()
    assert keys["right, 24"][0] == keys["right, 64"][1] == keys["left, 32"][0] == keys["unpadded"][0]
    assert keys["right, 24"][1] == keys["right, 64"][0] == keys["right, 64"][2]
    assert keys["right, 24"][0] != keys["right, 24"][1]
    changed, _ = padded([[*a[:-1], 99], a[::-1]], 24)  # one token changed; the same tokens in another order
    assert all(k != keys["unpadded"][0] for k in row_keys(changed, torch.ones_like(changed)).tolist())


def test_rows_too_short_or_too_uniform_are_not_compared():
    rows = [
        list(range(10, 30)),  # a sentence: compared
        [],  # all padding
        [257, 258, 257, 258, 257, 258, 257, 258, 257, 258],  # special tokens only
        [7, 8, 9, 10, 11],  # short
        [5, 6, 5, 6, 5, 6, 5, 6, 5, 6, 5, 6],  # a short repeated pattern
    ]
    ids, mask = padded(rows, 24)
    assert informative(ids, mask).tolist() == [True, False, False, False, False]


def test_a_masked_lm_row_keeps_its_key_whatever_positions_are_masked():
    row = torch.arange(10, 34).unsqueeze(0)
    keys = []
    for masked in ([2, 5, 9], [1, 17]):
        ids, labels = row.clone(), torch.full_like(row, -100)
        labels[0, masked], ids[0, masked] = row[0, masked], 259  # BERT's recipe: the label keeps the original
        view = StepBatch({"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}, BatchKeys())
        found = row_field(view, None, -100, labels_aligned=True)
        keys.append(row_keys(found.rows, found.mask).tolist())
    assert keys[0] == keys[1]


# --------------------------------------------------------------------------------------------------- the rule
def _keys(n: int, offset: int = 0) -> np.ndarray:
    return np.arange(offset, offset + n, dtype=np.int64) * 7919 + 12345


def _train_places(n: int) -> np.ndarray:
    return np.stack([np.arange(n) // 8, np.arange(n) % 8, np.zeros(n)], 1).astype(np.int32)


def _val_places(n: int, loop_step: int = -1) -> np.ndarray:
    return np.stack([np.full(n, loop_step), np.zeros(n), np.arange(n) // 8, np.arange(n) % 8, np.zeros(n)], 1).astype(
        np.int32
    )


def test_natural_duplicates_below_the_share_are_silent_and_a_leak_is_named_with_its_first_pair():
    healthy = LeakageWatch()
    healthy.add_trained(_keys(1000), _train_places(1000))
    val = np.concatenate([_keys(96, offset=5000), _keys(4, offset=10)])  # 4 of 100 rows recur in the training data
    healthy.add_compared("validation", val, _val_places(100), np.ones(100, bool))
    assert healthy.verdict("validation", step=50) is None

    leak = LeakageWatch()
    # the validation rows come first (the sanity check), the training rows later: rows 30.. of the validation set
    val = np.concatenate([_keys(30, offset=5000), _keys(20, offset=300)])
    leak.add_compared("validation", val, _val_places(50), np.ones(50, bool))
    assert leak.verdict("validation", step=0) is None  # nothing trained yet
    leak.add_trained(_keys(1000), _train_places(1000))
    found = leak.verdict("validation", step=12)
    assert found is not None and found.code == "TFD126" and found.severity is None  # the rule's: error
    e = found.evidence
    assert (e["overlapping"], e["compared"], e["share"]) == (20, 50, 0.4)
    # the first overlapping validation row: row 6 of sanity batch 3 (row 30), trained at key offset 300: step 37, row 4
    assert (e["val_step"], e["val_batch_idx"], e["val_row"]) == (-1, 3, 6)
    assert (e["train_step"], e["train_row"]) == (300 // 8, 300 % 8)
    assert "40% of the validation rows compared (20 of 50)" in found.message
    assert "row 6 of sanity-check batch 3 (rank 0)" in found.message and "step 37" in found.message


def test_the_memory_bound_samples_both_sides_alike():
    watch = LeakageWatch(max_rows=256)
    watch.add_trained(_keys(2000), _train_places(2000))
    val = np.concatenate([_keys(500, offset=0), _keys(500, offset=9000)])  # half the rows trained on
    watch.add_compared("validation", val, _val_places(1000), np.ones(1000, bool))
    rows = watch.loops["validation"]
    assert len(watch.trained) <= 256 and watch.level > 0
    assert 0.3 < rows.matched.mean() < 0.7  # the share kept from the sampled rows: about a half
    assert watch.verdict("validation", step=1).evidence["sampling_bits"] == watch.level


# ------------------------------------------------------------------------------------------- real Trainers
class Recorder(pl.Callback):
    """The token rows of every training batch, by step (to check the pair a finding names)."""

    def __init__(self) -> None:
        self.rows: dict[int, list[list[int]]] = {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        ids, mask = batch["input_ids"], batch["attention_mask"]
        self.rows[trainer.global_step] = [r[m.bool()].tolist() for r, m in zip(ids, mask)]


class ValidatesOnTraining(TinyTextDataModule):
    """``val_dataloader`` (and ``test_dataloader``) read the training split, in order, ``val_batch_size`` rows a batch;
    ``shape``: ``"dict"`` as the training batches, ``"ids_only"`` the ids alone padded to a fixed width of 64."""

    def __init__(self, val_batch_size: int = 8, shape: str = "dict", held_out: bool = False, **kw) -> None:
        super().__init__(**kw)
        self.val_batch_size, self.shape, self.held_out = val_batch_size, shape, held_out

    def _collate(self, samples):
        if self.shape == "ids_only":
            ids, _ = padded(samples, 64)
            return {"tokens": ids}  # another structure: no mask, no labels, another key
        return self.collator(samples)

    def val_dataloader(self) -> DataLoader:
        data = self.val_set if self.held_out else self.train_set
        return DataLoader(data, batch_size=self.val_batch_size, collate_fn=self._collate)

    test_dataloader = val_dataloader


class EvaluatedGPT(TinyGPT):
    """TinyGPT with a test step, validating batches of ids alone (``tokens``) as well."""

    def validation_step(self, batch, batch_idx):
        ids = batch["input_ids"] if "input_ids" in batch else batch["tokens"]
        self.log("val/loss", self.loss(self(ids, batch.get("attention_mask")), batch.get("labels", ids)))

    test_step = validation_step


def fit(tmp_path, data, guard=None, recorder=None, **kwargs):
    guard = guard or BatchGuard()
    trainer = make_trainer(tmp_path, [guard, *([recorder] if recorder else [])], **{"max_steps": 14, **kwargs})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", TFDebugWarning)
        trainer.fit(EvaluatedGPT(**TINY), data)
    return trainer, guard


def test_validation_on_the_training_split_is_an_error_naming_the_share_and_the_first_pair(tmp_path):
    recorder = Recorder()
    data = ValidatesOnTraining(n_documents=120, batch_size=8)  # 14 training batches: one epoch
    _, guard = fit(tmp_path, data, recorder=recorder, limit_val_batches=2)
    [found] = [f for f in guard.findings if f.code == "TFD126"]
    e = found.evidence
    assert found.severity == "error" and e["overlapping"] >= 3 and e["share"] > 0.1
    assert f"{e['share']:.0%} of the validation rows compared ({e['overlapping']} of {e['compared']})" in found.message
    # the pair is real: the validation row (the sanity check reads the training split in order) is that training row
    assert e["val_step"] == -1 and e["val_batch_idx"] == 0  # the sanity check's first batch holds the first pair
    val_row = data.train_set[e["val_batch_idx"] * 8 + e["val_row"]]
    assert recorder.rows[e["train_step"]][e["train_row"]] == val_row
    assert f"row {e['val_row']} of sanity-check batch 0" in found.message
    assert found.step <= 14  # decided inside the run, on a checked step or at the end of training


def test_a_held_out_split_is_silent(tmp_path):
    data = ValidatesOnTraining(n_documents=160, batch_size=8, held_out=True)
    _, guard = fit(tmp_path, data, max_steps=19, limit_val_batches=1.0, val_check_interval=10)  # every training row
    assert [f.code for f in guard.findings if f.code in ("TFD126", "TFD127")] == []
    rows = guard._leak.watch.loops["validation"]
    assert len(rows) > 0 and len(guard._leak.watch.trained) >= 150  # it compared: the whole split, all trained rows
    assert guard.coverage["train/validation leakage"][0] == "verified"


def test_without_a_validation_loop_the_coverage_row_says_n_a(tmp_path):
    _, guard = fit(tmp_path, ValidatesOnTraining(n_documents=120, batch_size=8), max_steps=4, limit_val_batches=0)
    status, reason, _ = guard.coverage["train/validation leakage"]
    assert (status, reason) == ("n/a", "the run has no validation or test loop.")
    records = (tmp_path / "tb" / "version_0" / "tfdebug" / "coverage-rank0.jsonl").read_text()
    assert '"check": "train/validation leakage", "status": "n/a"' in records


def test_training_rows_reshuffled_into_batches_of_another_size_and_shape_are_caught(tmp_path):
    # the validation reads the training rows in order, 5 a batch, ids only padded to 64 under another key
    data = ValidatesOnTraining(val_batch_size=5, shape="ids_only", n_documents=120, batch_size=8)
    _, guard = fit(tmp_path, data, limit_val_batches=4, val_check_interval=10)
    [found] = [f for f in guard.findings if f.code == "TFD126"]
    # decided as soon as enough training rows were read: the sanity check's 2 batches of 5 rows were compared then
    assert found.evidence["compared"] == 10 and found.evidence["overlapping"] >= 3
    rows = guard._leak.watch.loops["validation"]
    assert len(rows) == 20 and rows.matched.sum() >= 15  # by the end: the validation run at step 10 too


def test_leakage_seen_only_by_the_sanity_check_is_caught_from_the_training_rows_read_after_it(tmp_path):
    # an epoch longer than the run: the only validation is the sanity check, before any training batch
    data = ValidatesOnTraining(n_documents=400, batch_size=8)
    _, guard = fit(tmp_path, data, max_steps=30, limit_val_batches=2)
    [found] = [f for f in guard.findings if f.code == "TFD126"]
    assert found.evidence["val_step"] == -1 and found.evidence["train_step"] >= 0
    assert len(guard._leak.watch.loops["validation"]) == 16  # the sanity check's two batches alone


def test_a_test_loop_on_training_rows_is_tfd127(tmp_path):
    data = ValidatesOnTraining(n_documents=120, batch_size=8, held_out=True)  # validation held out: silent
    trainer, guard = fit(tmp_path, data, limit_val_batches=2)
    data.held_out = False  # the test loop reads the training split
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.test(trainer.lightning_module, data.test_dataloader())
    assert [f.code for f in guard.findings if f.code in ("TFD126", "TFD127")] == ["TFD127"]
    [found] = [f for f in guard.findings if f.code == "TFD127"]
    assert "of the test rows compared" in found.message and "test batch 0 of the test run" in found.message


class CrossedShards(TinyTextDataModule):
    """Under DDP (``use_distributed_sampler=False``), each rank trains on its own half of the training split, in
    order, and validates on the other rank's half: every row a rank validates was trained on by the other rank, none
    by itself (the corpus's natural duplicates are dropped first)."""

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.train_set.samples = [list(s) for s in dict.fromkeys(tuple(s) for s in self.train_set.samples)]

    def _half(self, rank: int) -> Subset:
        return Subset(self.train_set, range(rank, len(self.train_set), 2))

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self._half(self.trainer.global_rank), batch_size=8, collate_fn=self.collator, drop_last=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self._half(1 - self.trainer.global_rank), batch_size=8, collate_fn=self.collator)


@pytest.mark.slow
@pytest.mark.ddp
def test_under_ddp_a_row_one_rank_validates_and_another_trained_on_counts(tmp_path):
    spec = {
        "strategy": "ddp",
        "data_class": "tests.callbacks.batch_guard.test_leakage:CrossedShards",
        "data": {"n_documents": 120, "batch_size": 8},
        "model": TINY,
        "trainer": {"max_steps": 7, "limit_val_batches": 2, "log_every_n_steps": 1, "use_distributed_sampler": False},
        "callbacks": [{"class_path": "lightning_tfdebug.BatchGuard"}],
    }
    results = run_distributed(tmp_path, spec, timeout=300)
    found = []
    for result in results:
        assert result["error"] is None, result["error"]
        [leak] = [f for f in result["findings"]["BatchGuard"] if f["code"] == "TFD126"]
        found.append(leak)
    e = found[0]["evidence"]
    assert e["val_rank"] != e["train_rank"]  # the pair crosses ranks: a rank-local check would see nothing
    assert e["overlapping"] == e["compared"] == 32  # both ranks' 2 validation batches, every row trained elsewhere
    assert all(f["evidence"] == e for f in found)  # every rank decided the same from the gathered rows


# ------------------------------------------------------------------------------------------- the preflight
APP = Path(__file__).resolve().parents[2] / "apps" / "encoder_cli.py"


def _check(tmp_path: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    root = str(APP.parents[2])
    env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
    tmp_path.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "lightning_tfdebug", "check", "--steps", "50", "--", sys.executable, str(APP), "fit"]
    cmd += [
        "--trainer.default_root_dir",
        str(tmp_path),
        "--trainer.accelerator=cpu",
        "--trainer.enable_progress_bar=false",
    ]
    return subprocess.run([*cmd, *extra], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_tfdebug_check_exits_1_on_a_validation_loader_that_reads_the_training_data(tmp_path):
    leaky = _check(tmp_path / "leak", "--data.val_from_train=true")
    assert leaky.returncode == 1, leaky.stdout[-3000:] + leaky.stderr[-3000:]
    assert "TFD126 error step" in leaky.stdout
    healthy = _check(tmp_path / "ok")  # the script's own held-out validation split
    assert healthy.returncode == 0, healthy.stdout[-3000:] + healthy.stderr[-3000:]
    assert "TFD126" not in healthy.stdout


def test_batches_without_token_ids_are_compared_on_their_first_field(tmp_path):
    from lightning.pytorch.demos.boring_classes import BoringModel, RandomDataset

    train = RandomDataset(32, 64)
    for name, val, expected in (("leak", train, ["TFD126"]), ("held_out", RandomDataset(32, 64), [])):
        guard = BatchGuard()
        trainer = make_trainer(tmp_path / name, [guard], max_steps=8, limit_val_batches=2)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer.fit(BoringModel(), DataLoader(train, batch_size=8, shuffle=True), DataLoader(val, batch_size=4))
        assert [f.code for f in guard.findings if f.code in ("TFD126", "TFD127")] == expected, name
        assert len(guard._leak.watch.loops["validation"]) == 8  # the sanity check's 2 batches of 4 float rows
