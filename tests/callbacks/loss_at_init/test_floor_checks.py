"""Loss floors and label smoothing (issue 44): the floor math against closed forms and the losses it bounds, the fits
on readings of real logits, and real Trainers on TinyGPT deciding inside a preflight's 50 steps."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from lightning_tfdebug import LossAtInit
from lightning_tfdebug.callbacks.loss_at_init.floor_checks import (
    FLOOR_BINDS,
    cap_floor,
    floor_verdict,
    model_bound,
    smoothing_fit,
    smoothing_floor,
    width_floor,
)
from lightning_tfdebug.callbacks.loss_at_init.readings import LossSums, loss_reading
from lightning_tfdebug.callbacks.loss_at_init.transform_checks import loss_transform_verdict, not_cross_entropy
from lightning_tfdebug.functional.loss import TRANSFORM_SUMS, loss_transform_sums
from lightning_tfdebug.rules import RULES
from tests.floor_models import SmoothedTinyGPT
from tests.helpers import make_trainer

V = 128


# ------------------------------------------------------------------------------------------------- the closed forms
def test_a_cap_floor_is_the_loss_of_the_best_capped_prediction():
    for c in (0.5, 1.0, 3.0):
        closed = -math.log(math.exp(c) / (math.exp(c) + (V - 1) * math.exp(-c)))
        assert cap_floor(c, V) == pytest.approx(closed)
        best = torch.full((1, V), -c)
        best[0, 0] = c  # the right class at the cap, every other at its bottom
        assert float(F.cross_entropy(best, torch.tensor([0]))) == pytest.approx(closed, rel=1e-5)
    assert cap_floor(1.0, V) == pytest.approx(2.90, abs=0.01)  # the cap of 1 over 128 classes
    assert cap_floor(30.0, 256_000) < 1e-12  # Gemma's cap binds nothing
    assert width_floor(2.0, V) == pytest.approx(cap_floor(1.0, V))


def test_a_smoothing_floor_is_the_entropy_of_the_smoothed_target_and_no_prediction_beats_it():
    for eps in (0.1, 0.5, 0.9):
        target = torch.full((V,), eps / V)
        target[0] += 1.0 - eps
        entropy = float(-(target * target.log()).sum())
        assert smoothing_floor(eps, V) == pytest.approx(entropy, rel=1e-6)
        at_floor = F.cross_entropy(target.log()[None], torch.tensor([0]), label_smoothing=eps)
        assert float(at_floor) == pytest.approx(entropy, rel=1e-5)  # predicting the smoothed target reaches it
        sharper = F.cross_entropy((3.0 * target.log())[None], torch.tensor([0]), label_smoothing=eps)
        assert float(sharper) > entropy  # and a more confident prediction pays for it
    assert smoothing_floor(0.9, V) == pytest.approx(4.67, abs=0.01)  # the 0.9 over 128 classes
    assert smoothing_floor(0.9, V) > FLOOR_BINDS * math.log(V) > smoothing_floor(0.1, V)
    assert smoothing_floor(0.0, V) == 0.0


# -------------------------------------------------------------------------------------- fits on real logits' readings
def readings(logits_per_step, labels, loss, steps=(10, 20, 30, 40)):
    out = []
    for step, logits in zip(steps, logits_per_step):
        taken = loss_transform_sums(logits, labels, shift_labels=False)
        sums = LossSums.from_host({k: float(taken[k]) for k in TRANSFORM_SUMS})  # what the callback declares
        out.append(loss_reading(sums, float(loss(logits, labels)), step))
    return out


def trained(sharpness, bound=None, seed=0):
    """Logits of a model putting weight on the label, more the sharper; ``bound``: a tanh cap inside the forward."""
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, V, (4, 16), generator=g)
    noise = torch.randn(4, 16, V, generator=g)
    logits = sharpness * (4.0 * F.one_hot(labels, V) - 1.0) + 0.5 * noise
    return (bound * torch.tanh(logits / bound) if bound else logits), labels


def ce(logits, labels, **kwargs):
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), **kwargs)


@pytest.mark.parametrize("eps, severity, binds", [(0.1, "info", False), (0.9, "warning", True)])
def test_label_smoothing_is_fitted_named_and_its_floor_binds_above_half_of_ln_v(eps, severity, binds):
    labels = trained(0.0)[1]
    points = readings([trained(s)[0] for s in (0.3, 0.6, 0.9, 1.2)], labels, lambda x, y: ce(x, y, label_smoothing=eps))
    assert smoothing_fit(points)[0] == pytest.approx(eps, rel=1e-4)
    family = loss_transform_verdict(points, V)
    assert family.code == "TFD237" and family.severity == severity and f"eps = {eps:.3g}" in family.message
    floor = floor_verdict(points, V, family)
    if not binds:
        assert floor is None
        return
    assert floor.code == "TFD236" and RULES["TFD236"].severity == "error"
    assert floor.evidence["floor"] == pytest.approx(smoothing_floor(eps, V))
    share = floor.evidence["floor_share_of_ln_vocab"]
    assert share == pytest.approx(smoothing_floor(eps, V) / math.log(V)) and f"{share:.0%} of ln(V)" in floor.message


@pytest.mark.parametrize("kind", ["sigmoid", "cap 1"])
def test_a_bound_in_the_step_is_fitted_and_its_floor_binds(kind):
    squash = (lambda x: x.sigmoid()) if kind == "sigmoid" else (lambda x: torch.tanh(x))
    labels = trained(0.0)[1]
    points = readings([trained(s)[0] for s in (0.3, 0.6, 0.9, 1.2)], labels, lambda x, y: ce(squash(x), y))
    family = loss_transform_verdict(points, V)
    assert family.code == "TFD233"
    floor = floor_verdict(points, V, family)
    expected = width_floor(1.0, V) if kind == "sigmoid" else cap_floor(1.0, V)
    assert floor.code == "TFD236" and floor.evidence["floor"] == pytest.approx(expected)
    assert floor.evidence["floor_share_of_loss"] == pytest.approx(expected / points[-1].loss)


def test_a_cap_inside_the_forward_is_read_from_the_logits_own_range_and_a_healthy_run_is_not():
    labels = trained(0.0)[1]
    capped = readings([trained(s, bound=1.0)[0] for s in (0.3, 0.6, 0.9, 1.2)], labels, ce)
    assert loss_transform_verdict(capped, V) is None  # the returned loss is these logits' cross-entropy
    floor = floor_verdict(capped, V, None)
    assert floor.code == "TFD236" and "inside the forward" in floor.message
    assert cap_floor(1.0, V) <= floor.evidence["floor"] <= 1.05 * cap_floor(1.0, V)  # the range nears 2c
    assert floor_verdict(capped, V, None, probabilities=True) is None  # probabilities: TFD220's
    growing = readings([trained(s)[0] for s in (0.3, 0.6, 0.9, 1.2)], labels, ce)
    assert model_bound(growing, math.log(V)) is None and floor_verdict(growing, V, None) is None
    gemma = readings([trained(s, bound=30.0)[0] for s in (0.3, 0.6, 0.9, 1.2)], labels, ce)
    assert floor_verdict(gemma, V, loss_transform_verdict(gemma, V)) is None


def test_a_loss_that_is_no_cross_entropy_of_the_logits_is_told_from_a_scaled_one():
    labels = trained(0.0)[1]
    steps = [trained(s)[0] for s in (0.3, 0.6, 0.9)]  # not yet near-certain: their best loss is far above 0
    contrastive = readings(steps, labels, lambda x, y: F.mse_loss(x[:, :, :4], torch.zeros_like(x[:, :, :4])) * 0.01)
    assert not_cross_entropy(contrastive)
    for healthy in (ce, lambda x, y: ce(x, y) / 8, lambda x, y: ce(x, y, label_smoothing=0.1)):
        assert not not_cross_entropy(readings(steps, labels, healthy))


# ------------------------------------------------------------------------------------------------- real Trainers
def _fit(tmp_path, module, steps=41):
    callback = LossAtInit(check_step=None)  # as `tfdebug check` runs it
    trainer = make_trainer(tmp_path, [callback], max_steps=steps, log_every_n_steps=2)
    trainer.fit(module, _data())
    return callback


def _data():
    from lightning_tfdebug.demo import TinyTextDataModule

    return TinyTextDataModule(batch_size=8)


def test_label_smoothing_far_too_large_is_an_error_by_step_30_and_the_usual_one_is_named(tmp_path):
    torch.manual_seed(0)
    wrong = _fit(tmp_path / "wrong", SmoothedTinyGPT(0.9), steps=31)
    said = {f.code: f for f in wrong.findings}
    assert said["TFD236"].severity == "error" and said["TFD236"].step == 30
    assert said["TFD237"].severity == "warning" and "eps = 0.9" in said["TFD237"].message
    torch.manual_seed(0)
    usual = _fit(tmp_path / "usual", SmoothedTinyGPT(0.1), steps=31)
    assert [(f.code, f.severity) for f in usual.findings] == [("TFD237", "info")]
    assert "eps = 0.1" in usual.findings[0].message


class ContrastiveTinyGPT(SmoothedTinyGPT):
    """A step whose loss is an InfoNCE between each sample's mean logits and its shuffled-token view: no
    cross-entropy of the logits against the labels."""

    def training_step(self, batch, batch_idx):
        ids = batch["input_ids"]
        a = F.normalize(self(ids).mean(1), dim=-1)
        b = F.normalize(self(ids.flip(1)).mean(1), dim=-1)
        return F.cross_entropy(a @ b.T / 0.1, torch.arange(len(ids)))


def test_a_loss_that_is_no_cross_entropy_of_the_logits_stands_the_comparison_aside_once(tmp_path):
    torch.manual_seed(0)
    callback = _fit(tmp_path, ContrastiveTinyGPT(0.0), steps=41)
    assert not [f for f in callback.findings if f.code in ("TFD233", "TFD234", "TFD235", "TFD236", "TFD237")]
    [check] = [c for c in callback.checks_aside if "cross-entropy" in c]
    assert "no cross-entropy" in callback.checks_aside[check]
    assert callback._run.compared == [10, 20]  # no compared step after it stood aside
    written = (tmp_path / "tb" / "version_0" / "tfdebug" / "stood-aside-rank0.jsonl").read_text().splitlines()
    [record] = [json.loads(line) for line in written if "cross-entropy" in line]
    # recorded when step 20's reading comes back, at the end of its batch (after its optimizer step: 21)
    assert record["check"] == f"LossAtInit: {check}" and record["step"] in (20, 21)


# --------------------------------------------------------------------------------------------- tfdebug check
ROOT = Path(__file__).resolve().parents[3]


def _check(tmp_path: Path, bug: str, *options: str) -> subprocess.CompletedProcess:
    """``tfdebug check`` (the console script, its default 50 steps) on the floor app with ``--model.bug``."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    tfdebug = Path(sys.executable).with_name("tfdebug")
    app = ROOT / "tests" / "apps" / "floor_cli.py"
    cmd = [str(tfdebug), "check", *options, "--", sys.executable, str(app), "fit", f"--model.bug={bug}"]
    cmd += [
        "--trainer.default_root_dir",
        str(tmp_path),
        "--trainer.accelerator=cpu",
        "--trainer.enable_progress_bar=false",
    ]
    return subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600)


@pytest.mark.slow
@pytest.mark.parametrize("bug", ["sigmoid", "softcap1", "smoothing"])
def test_tfdebug_check_exits_1_on_a_floor_that_binds_inside_its_50_steps(tmp_path, bug):
    done = _check(tmp_path, bug)
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-3000:]
    assert "TFD236 error step" in done.stdout, done.stdout[-3000:]


@pytest.mark.slow
def test_tfdebug_check_names_the_usual_label_smoothing_without_failing(tmp_path):
    done = _check(tmp_path, "smoothing_ok")
    assert "TFD236" not in done.stdout and "TFD237" in done.stdout, done.stdout[-3000:]
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


def test_an_early_comparison_waits_for_logits_that_move():
    """Logits that barely train (LR far too low): a constant gap between the returned loss and their cross-entropy
    fits label smoothing as well as anything, so the early steps decide nothing; logits that train decide."""
    from lightning_tfdebug.callbacks.loss_at_init.check import early_findings
    from lightning_tfdebug.callbacks.loss_at_init.phases import LossRun

    labels = trained(0.0)[1]
    smoothed = lambda x, y: ce(x, y, label_smoothing=0.9)  # noqa: E731
    flat = LossRun(check_step=100, check_at=100)
    for point in readings([trained(s)[0] for s in (0.30, 0.301, 0.302)], labels, smoothed, steps=(10, 20, 30)):
        flat.add_reading(point)
    assert early_findings(flat, V, None) == []
    moving = LossRun(check_step=100, check_at=100)
    for point in readings([trained(s)[0] for s in (0.3, 0.6, 0.9)], labels, smoothed, steps=(10, 20, 30)):
        moving.add_reading(point)
    assert {v.code for v in early_findings(moving, V, None)} == {"TFD236", "TFD237"}


@pytest.mark.slow
def test_tfdebug_check_exits_1_on_attention_that_cannot_attend_at_init(tmp_path):
    """Issue 44's attention at init through the same preflight: a warning (TFD240), so the gate is `--fail-on warning`
    (the README's preflight)."""
    done = _check(tmp_path, "attention_multiply", "--fail-on", "warning")
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-3000:]
    assert "TFD240 warning step 0" in done.stdout, done.stdout[-3000:]
