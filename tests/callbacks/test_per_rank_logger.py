import json
import math
import warnings

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_tfdebug import PerRankLogger
from lightning_tfdebug.demo import TinyGPT, TinyTextDataModule
from lightning_tfdebug.functional.batches import batch_fingerprint
from tests.helpers import SMALL, make_trainer, read_scalars, run_distributed
from tests.helpers import fit_tiny as fit


def records(tmp_path, rank=0):
    path = tmp_path / "tb" / "version_0" / "tfdebug" / f"rank{rank}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


class BatchReference(pl.Callback):
    """Independent record of every step's loss and input ids."""

    def __init__(self):
        self.losses, self.prints = {}, {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses[trainer.global_step - 1] = float(outputs["loss"])
        self.prints[trainer.global_step - 1] = int(batch_fingerprint(batch["input_ids"]))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"straggler_factor": 1.0}, "straggler_factor"),
        ({"straggler_min_ms": -1}, "straggler_min_ms"),
        ({"loss_spread": 0}, "loss_spread"),
        ({"patience": 0}, "patience"),
        ({"patience": 1.5}, "patience"),
        ({"on_finding": "explode"}, "on_finding"),
        ({"input_key": 1.5}, "input_key"),
        ({"mask_key": ""}, "mask_key"),
        ({"ignore_index": "-100"}, "ignore_index"),
    ],
)
def test_bad_arguments_fail_at_construction(kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        PerRankLogger(**kwargs)


def test_single_process_writes_its_file_and_logs_rank0_without_cross_rank_checks(tmp_path):
    reference, logger = BatchReference(), PerRankLogger(every_n_steps=3)
    fit(tmp_path, [reference, logger], max_steps=8)
    rows = records(tmp_path)
    assert [r["step"] for r in rows] == [0, 3, 6]
    for row in rows:
        assert row["rank"] == 0
        assert row["loss"] == pytest.approx(reference.losses[row["step"]], rel=1e-6)
        assert row["batch_fingerprint"] == reference.prints[row["step"]]
        assert row["step_time_ms"] >= row["busy_ms"] > 0
        assert row["dataloader_wait_ms"] >= 0 and row["peak_memory_gib"] > 0
    # the optimizer changes the weights, so the checksum moves from one measurement to the next
    assert len({r["param_checksum"] for r in rows}) == 3
    scalars = read_scalars(tmp_path / "tb" / "version_0")
    assert sorted(dict(scalars["per_rank/loss/rank0"])) == [0, 3, 6]
    assert "per_rank/busy_ms/rank0" in scalars
    assert not any(k.endswith("max_over_median") for k in scalars)  # no spreads with one rank
    assert logger.findings == []


class ChecksumReference(pl.Callback):
    """After PerRankLogger's hook of a measured batch: the file's ``param_checksum`` computed plainly, in float64, from
    the weights the optimizer step left (position-weighted per-tensor norms, then signed sums)."""

    def __init__(self, every):
        self.every, self.totals = every, {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        step = trainer.global_step - 1
        if step % self.every:
            return
        values = [p.detach().double() for p in pl_module.parameters()]
        checks = [torch.linalg.vector_norm(v) for v in values] + [v.sum() for v in values]
        self.totals[step] = float(sum((i + 1) * c for i, c in enumerate(checks)))


def test_single_process_checksum_is_kept_and_no_replica_comparison_is_built(tmp_path, monkeypatch):
    import lightning_tfdebug.callbacks.per_rank_logger as module

    built = []
    real = module.agreement_sums
    monkeypatch.setattr(module, "agreement_sums", lambda *a, **k: built.append(1) or real(*a, **k))
    logger, reference = PerRankLogger(every_n_steps=2), ChecksumReference(2)
    fit(tmp_path, [logger, reference], max_steps=5)
    rows = records(tmp_path)
    assert [r["step"] for r in rows] == [0, 2, 4]
    for row in rows:  # the documented column is still written, from this process's own weights
        assert row["param_checksum"] == pytest.approx(reference.totals[row["step"]], rel=1e-6)
    assert built == []  # one process: nothing to compare the checksums with, so no agreement sums are made


def test_non_finite_loss_names_the_rank(tmp_path):
    logger = PerRankLogger(every_n_steps=1)
    fit(tmp_path, [logger], model=TinyGPT(nan_on_rank=0, nan_at_step=2, **SMALL), max_steps=4)
    [finding] = [f for f in logger.findings if f.code == "TFD505"]
    assert finding.severity == "error" and finding.step == 2 and finding.evidence["ranks"] == [0]
    assert records(tmp_path)[2]["loss"] is None or math.isnan(records(tmp_path)[2]["loss"])


def test_state_is_saved_and_restored_on_resume(tmp_path):
    first = PerRankLogger(every_n_steps=1)
    first._diagnosis.streaks.update("straggler/rank1", True)  # as if rank 1 had been slow once
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True)
    fit(tmp_path, [first, ckpt], max_steps=3, enable_checkpointing=True)
    resumed = PerRankLogger(every_n_steps=1)
    trainer = make_trainer(tmp_path, [resumed], max_steps=4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(TinyGPT(**SMALL), TinyTextDataModule(batch_size=8), ckpt_path=str(tmp_path / "ckpt" / "last.ckpt"))
    assert resumed._diagnosis.streaks.counts["straggler/rank1"] == 1
    assert [r["step"] for r in records(tmp_path)][-1] == 3  # appended to the same file after resume


class BufferPerturber(pl.Callback):
    """Bug 17 on a buffer: rank 1 changes a plain buffer at step 3, after the forward (DDP re-broadcasts buffers at
    the next forward). Rank 1 also shifts a BatchNorm's running mean from step 0 on, as local batch statistics do:
    that difference is by design and must not be reported."""

    def setup(self, trainer, pl_module, stage):
        pl_module.register_buffer("probe", torch.arange(4.0))
        pl_module.bn_probe = torch.nn.BatchNorm1d(4, affine=False)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_rank == 1:
            with torch.no_grad():
                pl_module.bn_probe.running_mean.add_(0.1)
                if trainer.global_step - 1 == 3:
                    pl_module.probe.add_(1.0)


def _dist(tmp_path, model=None, trainer=None, strategy="ddp", before=(), **init_args):
    spec = {
        "strategy": strategy,
        "model": {**SMALL, **(model or {})},
        "data": {"batch_size": 8},
        "trainer": {"max_steps": 6, **(trainer or {})},
        "callbacks": [
            *({"class_path": c} for c in before),
            {"class_path": "lightning_tfdebug.PerRankLogger", "init_args": {"every_n_steps": 1, **init_args}},
        ],
    }
    results = run_distributed(tmp_path, spec)
    for r in results:
        assert r["error"] is None, r["error"]
    return results


def _codes(result):
    return [f["code"] for f in result["findings"]["PerRankLogger"]]


@pytest.mark.ddp
def test_ddp_without_a_distributed_sampler_and_a_replica_that_changes_a_weight_and_a_buffer(tmp_path):
    """Bug 16 (every rank trains on the same batches) and bug 17 (at step 3 rank 1 adds 0.5 to ln_f.weight and 1 to
    the buffer ``probe``; from step 0 on its BatchNorm running mean drifts, which is by design and not reported)."""
    results = _dist(
        tmp_path,
        model={"perturb_rank": 1, "perturb_at_step": 3},
        trainer={"use_distributed_sampler": False},
        before=["tests.callbacks.test_per_rank_logger.BufferPerturber"],
    )
    for r in results:  # synchronized findings: both ranks reach the same ones
        assert sorted(_codes(r)) == ["TFD501", "TFD502"]
        by_code = {f["code"]: f for f in r["findings"]["PerRankLogger"]}
        assert by_code["TFD501"]["evidence"]["identical_ranks"] == [[0, 1]]
        assert by_code["TFD502"]["step"] == 3 and by_code["TFD502"]["evidence"]["ranks"] == [1]
        assert by_code["TFD502"]["evidence"]["tensors"] == ["ln_f.weight", "probe"]
    prints = [[row["batch_fingerprint"] for row in records(tmp_path, rank)] for rank in (0, 1)]
    assert prints[0] == prints[1]


@pytest.mark.ddp
def test_ddp_straggler_rank_is_named(tmp_path):
    """Bug 18: rank 1 sleeps 0.2 s in every training step; rank 0 waits for it in the all-reduce."""
    results = _dist(tmp_path, model={"slow_rank": 1, "slow_rank_s": 0.2}, trainer={"max_steps": 5})
    for r in results:
        [finding] = r["findings"]["PerRankLogger"]
        assert finding["code"] == "TFD503" and finding["evidence"]["rank"] == 1
    # the whole-step times agree (rank 0 waits inside backward); the busy time shows who is slow
    steps = [[row["step_time_ms"] for row in records(tmp_path, rank)] for rank in (0, 1)]
    busy = [[row["busy_ms"] for row in records(tmp_path, rank)] for rank in (0, 1)]
    assert all(b1 > 150 > b0 for b0, b1 in zip(busy[0][1:], busy[1][1:]))
    assert all(s0 > 150 for s0 in steps[0][1:])
    assert results[0]["metrics"]["per_rank/busy_ms/max_over_median"] > 1.5


@pytest.mark.ddp
def test_fsdp2_skips_the_checksum_comparison(tmp_path):
    """Shards differ by design under FSDP2; the perturbed shard must not be reported as a diverged replica."""
    results = _dist(
        tmp_path, strategy="fsdp2", model={"perturb_rank": 1, "perturb_at_step": 1}, trainer={"max_steps": 3}
    )
    for r in results:
        assert "TFD502" not in _codes(r)
    assert [row["step"] for row in records(tmp_path, 1)] == [0, 1, 2]


class RankOneLossTimesThree(pl.Callback):
    """Rank-dependent code in the loss: rank 1 computes (and reports) three times the loss of the others."""

    def setup(self, trainer, pl_module, stage):
        if trainer.global_rank == 1:
            loss = pl_module.loss
            pl_module.loss = lambda logits, labels: 3 * loss(logits, labels)


@pytest.mark.ddp
def test_ddp_ranks_whose_losses_disagree_and_the_rank_that_went_non_finite(tmp_path):
    spec = {
        "strategy": "ddp",
        "model": {**SMALL, "nan_on_rank": 1, "nan_at_step": 4},
        "data": {"batch_size": 8},
        "trainer": {"max_steps": 5},
        "callbacks": [
            {"class_path": "tests.callbacks.test_per_rank_logger.RankOneLossTimesThree"},
            {"class_path": "lightning_tfdebug.PerRankLogger", "init_args": {"every_n_steps": 1}},
        ],
    }
    results = run_distributed(tmp_path, spec)
    for r in results:
        assert r["error"] is None, r["error"]
        by_code = {f["code"]: f for f in r["findings"]["PerRankLogger"]}
        assert sorted(by_code) == ["TFD504", "TFD505"]
        assert by_code["TFD504"]["step"] == 2 and by_code["TFD504"]["evidence"]["ranks"] == [0, 1]
        losses = by_code["TFD504"]["evidence"]["losses"]
        assert losses[1] == pytest.approx(3 * losses[0], rel=0.05)
        assert by_code["TFD505"]["step"] == 4 and by_code["TFD505"]["evidence"]["ranks"] == [1]


class RenamedIds(TinyGPT):
    def training_step(self, batch, batch_idx):
        return super().training_step({"input_ids": batch["ids_under_test"], "labels": batch["labels"]}, batch_idx)


@pytest.mark.parametrize("kind", ["dataclass", "encoding", "renamed"])
def test_the_fingerprint_reads_dataclass_batch_encoding_and_renamed_batches(tmp_path, kind):
    from tests.callbacks.batch_guard.test_callback import ReadsFields, typed_batches

    loader = typed_batches("encoding" if kind == "renamed" else kind)
    if kind == "renamed":  # the ids under a name no reader guesses, pointed at with input_key
        renamed = [{"ids_under_test": b["input_ids"], "labels": b["labels"]} for b in loader]
        loader = torch.utils.data.DataLoader(renamed, batch_size=None)
    logger = PerRankLogger(input_key="ids_under_test" if kind == "renamed" else None)
    trainer = make_trainer(tmp_path, [logger], max_steps=4)
    model = RenamedIds(**SMALL) if kind == "renamed" else ReadsFields(**SMALL)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(model, train_dataloaders=loader)
    expected = [int(batch_fingerprint(b["input_ids"])) for b in typed_batches("encoding")]
    assert [row["batch_fingerprint"] for row in records(tmp_path)] == expected
