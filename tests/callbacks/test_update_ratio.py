import json
import math

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.precision import MixedPrecision
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_tfdebug import GradNormMonitor, NaNFirstFrame, TFDebug, UpdateRatio
from lightning_tfdebug.demo import TinyGPT, TinyTextDataModule
from lightning_tfdebug.demo.data import generate_corpus
from tests.helpers import SMALL, make_trainer, read_csv_metrics, read_scalars, run_distributed
from tests.helpers import fit_tiny as fit
from tests.reference import ReferenceUpdateRatio


def codes(callback):
    return sorted({f.code for f in callback.findings})


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"low": 0.0}, "`low` must be > 0"),
        ({"low": 0.5, "high": 0.1}, "`low` must be below `high`"),
        ({"patience": 0}, "patience"),
        ({"decayed_lr_fraction": 1.5}, "decayed_lr_fraction"),
        ({"every_n_steps": 0}, "every_n_steps"),
        ({"growth_limit": 1.0}, "growth_limit"),
        ({"growth_window": 0}, "growth_window"),
    ],
)
def test_bad_arguments_fail_at_construction(kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        UpdateRatio(**kwargs)


def test_ratio_matches_a_plain_reference_and_reaches_the_loggers(tmp_path):
    reference, monitor = ReferenceUpdateRatio(), UpdateRatio(every_n_steps=2)
    fit(tmp_path, [reference, monitor], max_steps=7)
    scalars = read_scalars(tmp_path / "tb" / "version_0")
    logged = dict(scalars["update_ratio/total"])
    assert sorted(logged) == [0, 2, 4, 6]  # logged at the step whose update it measures
    for step, value in logged.items():
        assert value == pytest.approx(reference.ratios[step], rel=1e-4)
    for key in (
        "update_ratio/blocks.0",
        "update_ratio/head",
        "update_ratio/param_norm/total",
        "update_ratio/param_norm/embeddings",
    ):
        assert key in scalars
    rows = [r for r in read_csv_metrics(tmp_path / "csv" / "version_0") if r.get("update_ratio/total")]
    assert [int(r["step"]) for r in rows] == [0, 2, 4, 6]


class LossRecorder(pl.Callback):
    """The loss each batch returned, read on the host (a test's plain reference); and, after UpdateRatio's hook of the
    same batch, how many loss tensors it holds."""

    def __init__(self, monitor: UpdateRatio) -> None:
        self.monitor = monitor
        self.losses: list[float] = []
        self.held: list[int] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(float(outputs["loss"]))
        self.held.append(len(self.monitor._loss_list))


@pytest.mark.parametrize("every, steps", [(3, 10), (100, 101)])  # short intervals; one longer than the held losses
def test_mean_loss_of_each_interval_matches_the_losses_returned(tmp_path, every, steps):
    monitor = UpdateRatio(every_n_steps=every, patience=10)
    recorder = LossRecorder(monitor)
    fit(tmp_path, [monitor, recorder], max_steps=steps)
    measured = list(range(0, steps, every))
    assert [step for step, _ in monitor._memory.losses] == measured
    # the interval of a measurement: the batches since the previous one's, its own included
    starts = [0] + [m + 1 for m in measured[:-1]]
    for (step, mean), start in zip(monitor._memory.losses, starts):
        expected = sum(recorder.losses[start : step + 1]) / (step + 1 - start)
        assert mean == pytest.approx(expected, rel=1e-6)
    assert max(recorder.held) <= 64  # held as tensors, bounded: folded into one device sum past 64 batches
    assert max(recorder.held) == min(every - 1, 63)


def test_ratio_of_bf16_weights_matches_a_plain_reference(tmp_path):
    # the fp32 snapshot of bf16 weights, and the change taken in place against the bf16 weights after the step
    reference, monitor = ReferenceUpdateRatio(), UpdateRatio(every_n_steps=2)
    fit(tmp_path, [reference, monitor], max_steps=5, precision="bf16-true")
    logged = dict(read_scalars(tmp_path / "tb" / "version_0")["update_ratio/total"])
    assert sorted(logged) == [0, 2, 4]
    for step, value in logged.items():
        assert value > 0
        assert value == pytest.approx(reference.ratios[step], rel=1e-3)


def test_healthy_runs_stay_inside_the_band(tmp_path):
    for lr in (3e-4, 3e-3):
        monitor = UpdateRatio(every_n_steps=10)
        fit(tmp_path / str(lr), [monitor], model=TinyGPT(lr=lr, **SMALL), max_steps=120)
        assert codes(monitor) == [], lr


def test_learning_rate_100x_too_low(tmp_path):  # bug 11
    monitor = UpdateRatio(every_n_steps=10)
    fit(tmp_path, [monitor], model=TinyGPT(lr=1e-5, **SMALL), max_steps=80)
    [finding] = monitor.findings
    assert finding.code == "TFD310" and finding.evidence["lr"] == pytest.approx(1e-5)


def test_no_low_finding_while_a_schedule_decays_the_lr(tmp_path):
    class Decaying(TinyGPT):
        def configure_optimizers(self):
            opt = torch.optim.AdamW(self.parameters(), lr=1e-3)
            return {
                "optimizer": opt,
                "lr_scheduler": {"scheduler": torch.optim.lr_scheduler.ExponentialLR(opt, 0.8), "interval": "step"},
            }

    monitor = UpdateRatio(every_n_steps=5)
    fit(tmp_path, [monitor], model=Decaying(**SMALL), max_steps=80)
    assert "TFD310" not in codes(monitor)


def test_learning_rate_100x_too_high_without_warmup(tmp_path):  # bug 12
    monitor = UpdateRatio(every_n_steps=10)
    fit(tmp_path, [monitor], model=TinyGPT(lr=0.1, warmup_steps=0, **SMALL), max_steps=11)
    [finding] = [f for f in monitor.findings if f.code == "TFD311"]
    assert finding.step == 0 and finding.evidence["update_ratio"] > 0.3


def test_learning_rate_100x_too_high_behind_a_warmup_shows_as_weight_growth(tmp_path):  # bug 12, warmed up
    # The warm-up keeps every single step's ratio modest while the weights inflate: TFD313 sees the growth.
    monitor = UpdateRatio(every_n_steps=5)
    fit(tmp_path, [monitor], model=TinyGPT(lr=0.2, warmup_steps=20, **SMALL), max_steps=41)
    [finding] = [f for f in monitor.findings if f.code == "TFD313" and f.severity == "warning"]  # with harm beside it
    assert finding.evidence["median_growth"] > 2.0 and finding.evidence["harm"]
    assert finding.evidence["to_step"] - finding.evidence["from_step"] <= monitor.growth_window
    assert set(finding.evidence["growth"]) >= {"blocks.0", "blocks.1"}

    healthy = UpdateRatio(every_n_steps=5)
    fit(tmp_path / "healthy", [healthy], model=TinyGPT(lr=2e-3, warmup_steps=20, **SMALL), max_steps=41)
    assert "TFD313" not in codes(healthy)


def test_weight_decay_far_too_strong_shows_as_weights_shrinking(tmp_path):
    # AdamW shrinks weights by lr x weight_decay per step: 3e-3 x 10 halves them every ~23 steps without gradients.
    # Decay on every tensor (decay_norms): in this small model the undecayed norm weights would carry most of a
    # block's norm.
    monitor = UpdateRatio(every_n_steps=5)
    model = TinyGPT(lr=3e-3, weight_decay=10.0, decay_norms=True, warmup_steps=5, **SMALL)
    fit(tmp_path, [monitor], model=model, max_steps=51)
    [finding] = [f for f in monitor.findings if f.code == "TFD314"]
    assert finding.evidence["median_growth"] < 0.5
    assert finding.evidence["lr_times_weight_decay"] == pytest.approx(3e-2)
    assert finding.evidence["to_step"] - finding.evidence["from_step"] <= monitor.growth_window
    assert "weight_decay" in finding.hint
    # the usual 0.1, and a strong 1.0 on every tensor, are not
    for wd in (0.1, 1.0):
        healthy = UpdateRatio(every_n_steps=5)
        model = TinyGPT(lr=3e-3, weight_decay=wd, decay_norms=True, warmup_steps=5, **SMALL)
        fit(tmp_path / f"wd{wd}", [healthy], model=model, max_steps=51)
        assert "TFD314" not in codes(healthy), wd


def test_growth_from_near_zero_groups_is_not_judged(tmp_path):
    # A zero-initialised group grows "infinitely" under any LR; only groups of real size count.
    class ZeroHead(TinyGPT):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            torch.nn.init.zeros_(self.head.weight)

    monitor = UpdateRatio(every_n_steps=5, groups={"head": r"^head\.", "body": r"^(?!head\.)"})
    fit(tmp_path, [monitor], model=ZeroHead(lr=3e-3, **SMALL), max_steps=60)
    first, last = monitor._memory.norms[0][1], monitor._memory.norms[-1][1]
    assert last["head"] / first["head"] > 2.0  # it did grow, and would decide a median of two groups
    assert "TFD313" not in codes(monitor)


def test_a_group_left_out_of_the_optimizer(tmp_path):  # bug 10
    monitor = UpdateRatio(every_n_steps=2)
    fit(tmp_path, [monitor], model=TinyGPT(head_not_in_optimizer=True, **SMALL), max_steps=7)
    [finding] = [f for f in monitor.findings if f.code == "TFD312"]
    assert finding.evidence["groups"] == ["head"]


class NormGainLM(pl.LightningModule):
    """Embedding, RMSNorm (gains at 1.0), head; AdamW over every parameter, or with the head left out."""

    def __init__(self, lr: float, head_in_optimizer: bool = True):
        super().__init__()
        self.lr, self.head_in_optimizer = lr, head_in_optimizer
        self.embed = nn.Embedding(64, 32)
        self.norm = nn.RMSNorm(32)
        self.head = nn.Linear(32, 64)

    def training_step(self, batch, batch_idx):
        inputs, targets = batch
        return F.cross_entropy(self.head(self.norm(self.embed(inputs))).reshape(-1, 64), targets.reshape(-1))

    def configure_optimizers(self):
        params = [p for n, p in self.named_parameters() if self.head_in_optimizer or not n.startswith("head.")]
        return torch.optim.AdamW(params, lr=self.lr)


def random_tokens():
    rows = torch.randint(0, 64, (256, 17), generator=torch.Generator().manual_seed(0))
    return DataLoader(TensorDataset(rows[:, :-1], rows[:, 1:]), batch_size=16)


NORM_GROUPS = {"norm": r"^norm\.", "head": r"^head\.", "embed": r"^embed\."}


def test_norm_gains_the_optimizer_steps_below_their_float_spacing_are_not_left_out_of_it(tmp_path):  # issue: row 34
    # AdamW moves each element by about the LR, 1e-8, below half the fp32 spacing at 1.0 (6e-8): the gains round back
    # to 1.0 at every step, while the embedding and the head (rms ~1 and ~0.1) do change
    torch.manual_seed(0)
    monitor = UpdateRatio(every_n_steps=2, groups=NORM_GROUPS)
    fit(tmp_path, [monitor], model=NormGainLM(lr=1e-8), data=random_tokens(), max_steps=24)
    assert "TFD312" not in codes(monitor), [f.format() for f in monitor.findings]
    [finding] = [f for f in monitor.findings if f.code == "TFD310"][:1]
    rounded = finding.evidence["groups_below_resolution"]
    assert list(rounded) == ["norm"] and rounded["norm"]["expected_step"] == pytest.approx(1e-8)
    assert rounded["norm"]["half_spacing"] == pytest.approx(torch.finfo(torch.float32).eps / 2, rel=1e-3)
    assert "round back" in finding.message


def test_a_head_left_out_of_the_optimizer_is_still_named_at_a_learning_rate_below_the_float_spacing(tmp_path):
    torch.manual_seed(0)
    monitor = UpdateRatio(every_n_steps=2, groups=NORM_GROUPS)
    fit(tmp_path, [monitor], model=NormGainLM(lr=1e-8, head_in_optimizer=False), data=random_tokens(), max_steps=24)
    findings = [f for f in monitor.findings if f.code == "TFD312"]
    assert findings and all(f.evidence["groups"] == ["head"] for f in findings)
    assert "in none of the optimizer's param groups" in findings[0].message


class OverflowOnce(TinyGPT):
    """Pushes one step's activations past the fp16 range, so the GradScaler skips that step."""

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        return loss * 1e30 if self.trainer.global_step == 2 else loss


def test_a_step_skipped_by_the_grad_scaler_is_not_a_zero_update(tmp_path):
    monitor = UpdateRatio(every_n_steps=1, patience=1)
    plugin = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))
    fit(tmp_path, [monitor], model=OverflowOnce(**SMALL), max_steps=5, plugins=[plugin])
    logged = dict(read_scalars(tmp_path / "tb" / "version_0")["update_ratio/total"])
    assert monitor.skipped_measurements == 1
    assert 2 not in logged and {0, 1, 3, 4} <= set(logged)
    assert "TFD312" not in codes(monitor)


class NaNFromStep2(TinyGPT):
    """A loss that turns NaN from step 2 on: NaNFirstFrame skips every optimizer step after that."""

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        return loss * float("nan") if self.trainer.global_step >= 2 else loss


def test_steps_nan_first_frame_skipped_are_not_tiny_updates(tmp_path):
    """Beside NaNFirstFrame, a step it skipped applied nothing: no update to judge, so no "LR too low" (TFD310) on a
    run whose real fault is the NaN."""
    monitor = UpdateRatio(every_n_steps=1, patience=2)
    guard = NaNFirstFrame(max_reports=1)
    fit(tmp_path, [guard, monitor], model=NaNFromStep2(**SMALL), max_steps=8)
    assert guard.skipped_steps == 6 and "TFD401" in codes(guard)
    assert monitor.skipped_measurements == 6
    assert not {"TFD310", "TFD312"} & set(codes(monitor)), [f.format() for f in monitor.findings]
    assert set(dict(read_scalars(tmp_path / "tb" / "version_0")["update_ratio/total"])) == {0, 1}


def test_state_is_saved_and_restored_on_resume(tmp_path):
    first = UpdateRatio(every_n_steps=1)
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True)
    fit(tmp_path, [first, ckpt], max_steps=4, enable_checkpointing=True)
    resumed = UpdateRatio(every_n_steps=1)
    trainer = make_trainer(tmp_path, [resumed], max_steps=5)
    trainer.fit(TinyGPT(**SMALL), TinyTextDataModule(batch_size=8), ckpt_path=str(tmp_path / "ckpt" / "last.ckpt"))
    assert resumed._memory.peak_lr >= first._memory.peak_lr > 0
    assert list(resumed._memory.recent_lr)[:2] == list(first._memory.recent_lr)[-2:]
    assert [entry[0] for entry in resumed._memory.norms][:4] == [entry[0] for entry in first._memory.norms]


def test_built_from_lightning_cli_yaml(tmp_path):
    from lightning.pytorch.cli import LightningCLI

    config = tmp_path / "config.yaml"
    config.write_text(
        "trainer:\n  callbacks:\n    - class_path: lightning_tfdebug.UpdateRatio\n"
        "      init_args: {every_n_steps: 5, low: 1.0e-4, high: 0.5, group_depth: 2}\n"
    )
    cli = LightningCLI(TinyGPT, TinyTextDataModule, run=False, args=["--config", str(config)])
    [monitor] = [c for c in cli.trainer.callbacks if isinstance(c, UpdateRatio)]
    assert (monitor.every_n_steps, monitor.low, monitor.high, monitor.group_depth) == (5, 1e-4, 0.5, 2)


@pytest.mark.ddp
@pytest.mark.parametrize(
    "strategy, packed",
    [
        pytest.param("ddp", False, id="ddp-alone"),
        pytest.param("fsdp2", True, id="fsdp2-in_the_pack"),
        pytest.param("ddp", True, id="ddp-in_the_pack", marks=pytest.mark.slow),  # ~12 s each
        pytest.param("fsdp2", False, id="fsdp2-alone", marks=pytest.mark.slow),
    ],
)
def test_distributed_ratio_matches_the_unsharded_reference(tmp_path, strategy, packed):
    """On its own it reduces its own declaration; in the pack it declares into the pack's one reduction of the step.
    Either way the replicated (DDP) norms are divided by the world size and the sharded (FSDP2) ones add up."""
    monitor = (
        {"class_path": "lightning_tfdebug.TFDebug", "init_args": {"every_n_steps": 1}}
        if packed
        else {"class_path": "lightning_tfdebug.UpdateRatio", "init_args": {"every_n_steps": 1}}
    )
    spec = {
        "strategy": strategy,
        "model": SMALL,
        "data": {"batch_size": 4},
        "trainer": {"max_steps": 4},
        "callbacks": [{"class_path": "tests.reference.ReferenceUpdateRatio"}, monitor],
        "extra": "tests.reference:reference_results",
    }
    results = run_distributed(tmp_path, spec)
    for r in results:
        assert r["error"] is None, r["error"]
        assert r["metrics"]["update_ratio/total"] == pytest.approx(r["extra"]["update_ratio"]["3"], rel=1e-4)
        # the norm itself too: a replicated sum left undivided by the world size would not change the ratio
        assert r["metrics"]["update_ratio/param_norm/total"] == pytest.approx(r["extra"]["param_norm"]["3"], rel=1e-4)
        found = r["findings"]["TFDebug" if packed else "UpdateRatio"]
        assert [f for f in found if f["source"] == "UpdateRatio"] == []


@pytest.mark.ddp
def test_a_snapshot_in_parts_under_fsdp2_agrees_on_every_rank(tmp_path):
    """Every rank snapshots the same part on the same step (planned from global sizes), so the reduced sums of the
    shards are the groups' norms; the weight norms, measured on every step, match the unsharded reference."""
    monitor = {
        "class_path": "lightning_tfdebug.UpdateRatio",
        "init_args": {"every_n_steps": 1, "memory_budget_mb": 0.05},
    }
    spec = {
        "strategy": "fsdp2",
        "model": SMALL,
        "data": {"batch_size": 4},
        "trainer": {"max_steps": 4},
        "callbacks": [{"class_path": "tests.reference.ReferenceUpdateRatio"}, monitor],
        "extra": "tests.reference:reference_results",
    }
    results = run_distributed(tmp_path, spec)
    for r in results:
        assert r["error"] is None, r["error"]
        assert r["metrics"]["update_ratio/param_norm/total"] == pytest.approx(r["extra"]["param_norm"]["3"], rel=1e-4)
        assert r["metrics"]["update_ratio/head"] > 0  # step 3 measures the fourth part: the head alone
    ratios = [{k: v for k, v in r["metrics"].items() if k.startswith("update_ratio/")} for r in results]
    assert len(ratios[0]) > 10 and all(rank == ratios[0] for rank in ratios)


class DefaultInitLM(pl.LightningModule):
    """A 3-layer causal transformer LM left at PyTorch's default initialisation (embeddings N(0, 1), Linear layers
    Kaiming-uniform): its untrained logits depend on the input, so its loss varies from batch to batch by more than
    an untrained std-0.02 model's. V = 128 (ASCII). Not one of the families the learning reading was tuned on."""

    def __init__(self, lr: float) -> None:
        super().__init__()
        self.lr = lr
        self.embed = nn.Embedding(128, 64)
        self.pos = nn.Embedding(32, 64)
        layer = nn.TransformerEncoderLayer(64, 4, 128, dropout=0.0, batch_first=True)
        self.blocks = nn.TransformerEncoder(layer, 3, enable_nested_tensor=False)
        self.head = nn.Linear(64, 128)

    def forward(self, tokens):
        t = tokens.shape[1]
        mask = nn.Transformer.generate_square_subsequent_mask(t)
        x = self.embed(tokens) + self.pos(torch.arange(t))
        return self.head(self.blocks(x, mask=mask, is_causal=True))

    def training_step(self, batch, batch_idx):
        inputs, targets = batch
        logits = self(inputs)
        return F.cross_entropy(logits.reshape(-1, 128), targets.reshape(-1))

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


def ascii_pairs():
    """``(inputs, targets)`` rows of 33 ASCII bytes (every id below 128) of the generated corpus's sentences."""
    stream = torch.tensor(list(" ".join(generate_corpus(400, seed=3)).encode("ascii")))
    rows = stream[: len(stream) // 33 * 33].view(-1, 33)
    return DataLoader(TensorDataset(rows[:, :-1], rows[:, 1:]), batch_size=16, shuffle=True)


def fit_default_init(tmp_path, model, steps=200):
    pack = [GradNormMonitor(), UpdateRatio()]
    fit(tmp_path, pack, model=model, data=ascii_pairs(), max_steps=steps, log_every_n_steps=50)
    return pack[1]


def test_an_untrained_model_with_default_init_at_a_learning_rate_that_moves_nothing(tmp_path):  # issue 22, run 1
    torch.manual_seed(0)
    monitor = fit_default_init(tmp_path, DefaultInitLM(lr=1e-8))
    [finding] = [f for f in monitor.findings if f.code == "TFD310"]
    evidence = finding.evidence
    assert evidence["ln_vocab"] == pytest.approx(math.log(128))
    # the loss starts near ln(V) (a little below it at this init) and stays there: no progress towards the unigram
    # entropy, which a fine-tune's first loss has all but reached
    assert abs(evidence["progress_first"]) < 0.2 and abs(evidence["progress_latest"]) < 0.2
    assert evidence["unigram_entropy"] < 0.8 * math.log(128)
    assert "has not learned" in finding.message


def test_a_fine_tune_of_the_same_model_at_a_fine_tuning_learning_rate_is_not_a_learning_rate_too_low(tmp_path):
    torch.manual_seed(0)
    model = DefaultInitLM(lr=2e-3)
    fit(tmp_path / "pretrain", [], model=model, data=ascii_pairs(), max_steps=60, logger=False)
    model.lr = 1e-5  # a cautious fine-tuning LR: updates far below the band, and the loss barely moves
    monitor = fit_default_init(tmp_path / "finetune", model)
    assert "TFD310" not in codes(monitor), [f.format() for f in monitor.findings]
    # what held it back: the run starts most of the way down from ln(V) to the labels' unigram entropy
    assert monitor._memory.first_loss < 0.6 * math.log(128)


# ------------------------------------------------------------------------------------------------- the memory budget
def stood_aside(tmp_path):
    path = tmp_path / "tb" / "version_0" / "tfdebug" / "stood-aside-rank0.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@pytest.mark.parametrize("budget", [0, -1.0, math.nan, "64", True])
def test_a_bad_memory_budget_fails_at_construction_naming_it(budget):
    with pytest.raises((ValueError, TypeError), match="memory_budget_mb"):
        UpdateRatio(memory_budget_mb=budget)
    with pytest.raises((ValueError, TypeError), match="memory_budget_mb"):
        TFDebug(memory_budget_mb=budget)


def test_the_pack_passes_its_memory_budget_to_update_ratio():
    assert TFDebug(memory_budget_mb=8).members["UpdateRatio"].memory_budget_mb == 8.0
    assert TFDebug().members["UpdateRatio"].memory_budget_mb is None


def test_a_snapshot_over_the_memory_budget_is_taken_in_parts_that_cover_every_group(tmp_path):
    # SMALL TinyGPT: groups of 41, 51, 51, 0.3 and 33 kB; at 0.05 MiB (52 kB) four parts, each group once in four steps
    runs = {}
    for name, budget in (("whole", None), ("parts", 0.05)):
        pl.seed_everything(0)
        monitor = UpdateRatio(every_n_steps=1, memory_budget_mb=budget)
        fit(tmp_path / name, [monitor], model=TinyGPT(**SMALL), max_steps=8)
        runs[name] = read_scalars(tmp_path / name / "tb" / "version_0")
    whole, parts = runs["whole"], runs["parts"]
    for group in ("embeddings", "blocks.0", "blocks.1", "other", "head"):
        steps = [step for step, _ in parts[f"update_ratio/{group}"]]
        assert len(steps) == 2 and steps[1] - steps[0] == 4, (group, steps)
        for step, value in parts[f"update_ratio/{group}"]:  # the same ratio as the whole snapshot's at that step
            assert value == pytest.approx(dict(whole[f"update_ratio/{group}"])[step], rel=1e-5)
        assert [step for step, _ in parts[f"update_ratio/param_norm/{group}"]] == list(range(8))  # every step
    assert [step for step, _ in parts["update_ratio/total"]] == list(range(8))
    [record] = stood_aside(tmp_path / "parts")  # recorded once, not printed
    assert record["check"] == "UpdateRatio: update ratio of every group on every measuring step"
    assert "once every 4 measuring steps" in record["reason"] and record["setting"] == "`memory_budget_mb` >= 0.2"
    assert stood_aside(tmp_path / "whole") == []


def test_a_budget_too_small_for_most_groups_measures_those_that_fit_and_names_the_others(tmp_path):
    monitor = UpdateRatio(every_n_steps=1, memory_budget_mb=0.001)  # 1 kB: only `other` (the final LayerNorm) fits
    fit(tmp_path, [monitor], max_steps=4)
    scalars = read_scalars(tmp_path / "tb" / "version_0")
    ratios = {k for k in scalars if k.startswith("update_ratio/") and "/param_norm/" not in k and "/band/" not in k}
    assert ratios == {"update_ratio/total", "update_ratio/other"} and monitor.active
    [record] = stood_aside(tmp_path)
    assert record["check"] == "UpdateRatio: update ratio of embeddings, blocks.0, blocks.1, head"
    assert "never measured" in record["reason"]


def test_a_group_left_out_of_the_optimizer_is_named_when_measured_in_parts(tmp_path):  # bug 10, head alone in a part
    monitor = UpdateRatio(every_n_steps=1, memory_budget_mb=0.05)
    fit(tmp_path, [monitor], model=TinyGPT(head_not_in_optimizer=True, **SMALL), max_steps=13)
    findings = [f for f in monitor.findings if f.code == "TFD312"]
    assert findings and findings[0].evidence["groups"] == ["head"] and findings[0].step == 11
