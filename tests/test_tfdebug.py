"""TFDebug, the one-entry pack: presets, shared settings, overrides, checkpoint state, dashboard and summary."""

from __future__ import annotations

import inspect
import json
import os
import re
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import yaml

import lightning_tfdebug as tfd
from lightning_tfdebug import TFDebug, TFDebugWarning
from lightning_tfdebug.dashboard import dashboard_layout, read_dashboard
from lightning_tfdebug.demo import TinyGPT, TinyTextDataModule
from lightning_tfdebug.pack import MEMBERS, PRESET_MEMBERS
from lightning_tfdebug.report import load_run
from lightning_tfdebug.rules import RULES
from tests.helpers import SMALL, fit_tiny, make_trainer, read_scalars, run_distributed

# The TensorBoard section each member writes on a healthy run of the tiny transformer.
SECTIONS = {
    "GradNormMonitor": "grad_norm/",
    "UpdateRatio": "update_ratio/",
    "DeadActivation": "dead_activation/",
    "ThroughputMonitor": "throughput/",
    "PerRankLogger": "per_rank/",
    "BatchGuard": "batch_guard/",
    "OptimizerAudit": "optimizer_audit/lr/",
    "LossAtInit": "loss_at_init/",
    "MaskProbe": "mask_probe/",
}


def problems(pack: TFDebug) -> list[str]:
    return [f"{f.code} {f.source}: {f.message}" for f in pack.findings if f.severity != "info"]


def test_the_full_preset_runs_every_member_once_and_says_so_at_the_end(tmp_path, capsys):
    pack = TFDebug(preset="full", every_n_steps=5)
    fit_tiny(tmp_path, [pack], max_steps=30, log_every_n_steps=5, enable_checkpointing=True, limit_val_batches=2)
    assert list(pack.running) == list(MEMBERS) == list(PRESET_MEMBERS["full"])
    assert pack.members["NaNFirstFrame"].mode == "eager"  # the preset's own setting
    takes = [n for n, cls in MEMBERS.items() if "every_n_steps" in inspect.signature(cls).parameters]
    assert len(takes) >= 9 and all(pack.members[n].every_n_steps == 5 for n in takes)
    scalars = read_scalars(tmp_path / "tb" / "version_0")
    for member, section in SECTIONS.items():
        assert any(tag.startswith(section) for tag in scalars), f"{member} logged nothing under {section}"
    assert {"TFD410"} <= {f.code for f in pack.findings}  # ScalerWatch ran: 32-bit has no scaler to watch
    assert (tmp_path / "tb" / "version_0" / "tfdebug" / "run.json").exists()  # ReproCapture ran
    audit = pack.members["CheckpointAudit"]
    assert audit._probe_loss is not None  # CheckpointAudit saw the checkpoint saved at the end of the epoch
    for finding in pack.findings:
        assert RULES[finding.code].source == finding.source
    assert problems(pack) == []
    out = capsys.readouterr().out
    assert "lightning_tfdebug: 0 errors, 0 warnings" in out and "tfdebug report" in out
    run = load_run(tmp_path / "tb")
    assert run.pack is not None and run.pack["running"] == list(MEMBERS) and run.pack["stood_aside"] == {}


def test_the_always_preset_runs_every_member_at_the_cost_of_a_run_that_stays_on(tmp_path):
    pack = TFDebug()
    assert list(pack.members) == list(MEMBERS)
    assert pack.members["NaNFirstFrame"].mode == "lazy"
    assert pack.members["CheckpointAudit"].reload is False  # judges each save in memory; `full` reads files back
    assert TFDebug(preset="full").members["CheckpointAudit"].reload is True
    fit_tiny(tmp_path, [pack], max_steps=12, log_every_n_steps=4)
    scalars = read_scalars(tmp_path / "tb" / "version_0")
    for member, section in SECTIONS.items():
        if member in pack.members:
            assert any(tag.startswith(section) for tag in scalars), member
    assert problems(pack) == []


def test_shared_settings_reach_every_member_that_takes_them_and_overrides_win():
    pack = TFDebug(
        preset="full",
        input_key="tokens",
        ignore_index=-1,
        on_finding="stop",
        exclude=["dead_activation"],
        include=[],
        overrides={"GradNormMonitor": {"explosion_factor": 20.0}, "batch_guard": {"input_key": "ids"}},
    )
    assert "DeadActivation" not in pack.members
    assert pack.members["GradNormMonitor"].explosion_factor == 20.0
    assert all(m.on_finding == "stop" for m in pack.members.values())
    assert pack.members["MaskProbe"]._keys.input_key == "tokens"
    assert pack.members["BatchGuard"]._batch_keys.input_key == "ids"  # the override beats the shared setting
    assert pack.members["LossAtInit"]._keys.ignore_index == -1


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"preset": "everything"}, ValueError, r"`preset` must be one of 'always', 'full'; got 'everything'"),
        ({"exclude": ["GradNorm"]}, ValueError, r"`exclude` names an unknown member 'GradNorm'; the members are"),
        ({"include": "MaskProbe"}, TypeError, r"`include` must be a list of member names; got 'MaskProbe'"),
        ({"overrides": {"GradNormMonitor": {"nope": 1}}}, TypeError, r"GradNormMonitor takes no argument 'nope'"),
        (
            {"exclude": ["MaskProbe"], "overrides": {"MaskProbe": {}}},
            ValueError,
            r"configures MaskProbe, which the pack does not run",
        ),
        ({"overrides": {"UpdateRatio": {"low": -1.0}}}, ValueError, r"TFDebug member UpdateRatio: `low`"),
        ({"overrides": ["UpdateRatio"]}, TypeError, r"`overrides` must map member names"),
        ({"every_n_steps": 0}, ValueError, r"`every_n_steps` must be >= 1; got 0"),
        ({"vocab_size": "big"}, TypeError, r"`vocab_size` must be an integer or None; got 'big'"),
        ({"summary": "yes"}, TypeError, r"`summary` must be True or False; got 'yes'"),
        ({"on_finding": "explode"}, ValueError, r"`on_finding` must be one of"),
    ],
)
def test_bad_arguments_fail_at_once_naming_the_argument(kwargs, error, match):
    with pytest.raises(error, match=match):
        TFDebug(**kwargs)


def test_a_member_also_listed_by_hand_runs_once_and_the_pack_says_so_once(tmp_path):
    mine = tfd.GradNormMonitor(every_n_steps=2)
    pack = TFDebug(every_n_steps=2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = make_trainer(tmp_path, [pack, mine], max_steps=6)
        trainer.fit(TinyGPT(**SMALL), TinyTextDataModule(batch_size=8))
    assert pack.by_hand == ["GradNormMonitor"] and "GradNormMonitor" not in pack.running
    assert pack.members["GradNormMonitor"]._log_dir is None  # the pack's copy never ran, not even its setup
    notes = [w for w in caught if issubclass(w.category, TFDebugWarning) and "also listed" in str(w.message)]
    assert len(notes) == 1 and "GradNormMonitor" in str(notes[0].message)
    assert "grad_norm/total" in trainer.callback_metrics  # the hand-listed one ran


def test_a_second_pack_stands_aside_and_a_preflight_pack_wins(tmp_path):
    first, preflight = TFDebug(summary=False), TFDebug(preset="full", preflight=True, summary=False)
    fit_tiny(tmp_path, [first, preflight], max_steps=3)
    assert first.idle and first.running == {} and first.findings == []
    assert not preflight.idle and list(preflight.running) == list(MEMBERS)


def test_members_state_is_saved_with_the_checkpoint_and_restored_on_resume(tmp_path):
    pack = TFDebug(preset="full", every_n_steps=2, summary=False)
    fit_tiny(tmp_path / "a", [pack], max_steps=8, enable_checkpointing=True, limit_val_batches=1)
    [ckpt] = (tmp_path / "a").rglob("*.ckpt")
    saved = torch.load(ckpt, weights_only=False)["callbacks"][pack.state_key]
    assert set(saved["members"]) == set(MEMBERS)
    assert saved["members"]["CheckpointAudit"]["probe_loss"] is not None  # taken after the member's save hook
    emitted = pack.members["ScalerWatch"]._emitted
    assert emitted  # TFD410 at step 0

    resumed = TFDebug(preset="full", every_n_steps=2, summary=False)
    fit_tiny(tmp_path / "b", [resumed], max_steps=10, ckpt_path=str(ckpt), limit_val_batches=1)
    assert resumed.members["ScalerWatch"]._emitted >= emitted
    assert problems(resumed) == []


def test_the_dashboard_layout_is_read_back_from_the_event_file(tmp_path):
    pack = TFDebug(preset="full", every_n_steps=2, summary=False)
    fit_tiny(tmp_path, [pack], max_steps=4)
    layout = read_dashboard(str(tmp_path / "tb" / "version_0"))
    groups = pack.members["UpdateRatio"]._layout.groups.group_names  # as UpdateRatio found them while training
    assert layout == dashboard_layout(MEMBERS, groups) and "blocks.0" in groups
    grads = layout["tfdebug: gradients and updates"]
    assert grads["update ratio: blocks.0"] == [
        "Margin",
        ["update_ratio/blocks.0", "update_ratio/band/low", "update_ratio/band/high"],
    ]
    scalars = read_scalars(tmp_path / "tb" / "version_0")
    for charts in layout.values():  # every margin chart names series the run logged
        for kind, tags in charts.values():
            if kind == "Margin":
                assert all(tag in scalars for tag in tags), tags
    for charts in layout.values():  # every series the run logged is drawn on the chart its key declares
        for kind, patterns in charts.values():
            if kind == "Multiline":
                assert all(re.compile(p) for p in patterns)
    drawn = {
        tag
        for charts in layout.values()
        for kind, patterns in charts.values()
        if kind == "Multiline"
        for tag in scalars
        if any(re.search(p, tag) for p in patterns)
    }
    for tag in ("grad_norm/total", "grad_norm/blocks.0", "update_ratio/blocks.0", "per_rank/step_time_ms/rank0"):
        assert tag in drawn, tag
    assert not any(re.search(p, "grad_norm/total") for p in grads["gradient norm per block"][1])


def test_the_pack_from_a_lightningcli_yaml(tmp_path):
    from lightning.pytorch.cli import LightningCLI

    from tests.apps.encoder_cli import EncoderLM, RunsData

    config = {
        "trainer": {
            "accelerator": "cpu",
            "max_steps": 6,
            "log_every_n_steps": 2,
            "enable_progress_bar": False,
            "enable_checkpointing": False,
            "limit_val_batches": 0,
            "default_root_dir": str(tmp_path),
            "callbacks": [
                {
                    "class_path": "lightning_tfdebug.TFDebug",
                    "init_args": {
                        "preset": "full",
                        "input_key": "input_ids",
                        "exclude": ["CheckpointAudit"],
                        "overrides": {"GradNormMonitor": {"explosion_factor": 25.0}},
                    },
                }
            ],
        }
    }
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", TFDebugWarning)
        cli = LightningCLI(EncoderLM, RunsData, args=["fit", "--config", str(path)], save_config_callback=None)
    [pack] = [cb for cb in cli.trainer.callbacks if isinstance(cb, TFDebug)]
    assert list(pack.running) == [n for n in MEMBERS if n != "CheckpointAudit"]
    assert pack.members["GradNormMonitor"].explosion_factor == 25.0
    assert "grad_norm/total" in cli.trainer.callback_metrics and "update_ratio/total" in cli.trainer.callback_metrics
    assert problems(pack) == []


@pytest.mark.ddp
def test_two_ranks_report_one_line_per_finding_with_the_rank_list(tmp_path):
    spec = {
        "strategy": "ddp",
        "callbacks": [{"class_path": "lightning_tfdebug.TFDebug", "init_args": {"every_n_steps": 4}}],
        "trainer": {"max_steps": 8},
        "model": SMALL,
    }
    results = run_distributed(tmp_path, spec)
    assert all(r["error"] is None for r in results)
    run = load_run(results[0]["log_dir"])
    assert run.ranks == [0, 1]
    [scaler] = [m for m in run.merged if m.code == "TFD410"]
    assert scaler.ranks == (0, 1)  # the same finding on both ranks: one line
    assert not [m for m in run.merged if m.severity != "info"]


def test_layout_keeps_only_the_charts_of_members_that_run():
    layout = dashboard_layout({"GradNormMonitor": MEMBERS["GradNormMonitor"]})
    assert list(layout) == ["tfdebug: gradients and updates"]
    assert set(layout["tfdebug: gradients and updates"]) == {
        "gradient norm per block",
        "gradient norm: total, clipped and non-finite",
    }


def test_the_demo_config_uses_the_one_entry_with_every_member():
    from pathlib import Path

    config = yaml.safe_load((Path(__file__).parents[1] / "examples" / "demo.yaml").read_text())
    [entry] = config["trainer"]["callbacks"]
    assert entry["class_path"] == "lightning_tfdebug.TFDebug"
    pack = TFDebug(**{**entry["init_args"], "tokenizer": None})
    assert list(pack.members) == list(MEMBERS)


@pytest.mark.ddp
def test_a_member_that_stands_aside_on_every_rank_is_one_did_not_run_entry_with_the_rank_list(tmp_path):
    spec = {
        "strategy": "ddp",
        "model_class": "tests.test_report:TupleBatchGPT",
        "callbacks": [
            {"class_path": "lightning_tfdebug.TFDebug", "init_args": {"every_n_steps": 2, "labels_key": "targets"}}
        ],
        "trainer": {"max_steps": 4},
        "model": SMALL,
        "data": {"batch_size": 4},
    }
    results = run_distributed(tmp_path, spec)
    assert all(r["error"] is None for r in results)
    run = load_run(results[0]["log_dir"])
    assert {p.name for p in (tmp_path / "tb" / "version_0" / "tfdebug").glob("stood-aside-rank*.jsonl")} == {
        "stood-aside-rank0.jsonl",
        "stood-aside-rank1.jsonl",
    }
    [entry] = [e for e in run.did_not_run if e.check == "LossAtInit"]
    assert entry.ranks == (0, 1) and entry.setting == "`labels_key`"
    from lightning_tfdebug.report import render_text

    assert "  LossAtInit (ranks 0,1): the batch is a tuple of 2 items" in render_text(run)


# ------------------------------------------------------------------ tfdebug check on any config (issue 23)
ROOT = Path(__file__).resolve().parents[1]
APP = ROOT / "tests" / "apps" / "encoder_cli.py"


def _check_with_config(tmp_path: Path, callbacks: list, *extra: str, steps: int = 8) -> subprocess.CompletedProcess:
    """``tfdebug check`` (the console script) on the test app with a YAML config holding ``callbacks``."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump({"trainer": {"callbacks": callbacks, "enable_progress_bar": False}}))
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    tfdebug = Path(sys.executable).with_name("tfdebug")
    cmd = [str(tfdebug), "check", "--steps", str(steps), "--", sys.executable, str(APP), "fit", "--config", str(config)]
    cmd += ["--trainer.default_root_dir", str(tmp_path), "--trainer.accelerator=cpu", *extra]
    return subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=400)


@pytest.mark.slow
@pytest.mark.ci  # a 20-30 s subprocess fit: in CI's ci lane, out of the default run's 8 minutes
def test_check_runs_a_bare_python_with_the_interpreter_tfdebug_runs_in(tmp_path):
    """The README's line as printed, `tfdebug check -- python ...`, called as `.venv/bin/tfdebug` without the venv
    on PATH: `python` there is another interpreter (here: none at all), so the command would fail with "No module
    named lightning". tfdebug check runs a bare `python` with its own interpreter instead."""
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump({"trainer": {"enable_progress_bar": False}}))
    empty = tmp_path / "bin"
    empty.mkdir()
    env = {**os.environ, "PATH": str(empty), "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    tfdebug = Path(sys.executable).with_name("tfdebug")
    cmd = [str(tfdebug), "check", "--steps", "4", "--", "python", str(APP), "fit", "--config", str(config)]
    cmd += ["--trainer.default_root_dir", str(tmp_path), "--trainer.accelerator=cpu"]
    done = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=400)
    assert done.returncode in (0, 1), done.stdout[-2000:] + done.stderr[-2000:]  # it ran: 0 clean, 1 findings
    # the interpreter it ran is this one (the same file: a venv reached through a symlink prints its other path)
    ran = re.search(r"tfdebug check: (\S+) ", done.stdout)
    assert ran is not None and os.path.samefile(ran.group(1), sys.executable), done.stdout[-2000:]
    assert _pack_json(tmp_path)["running"]


def _pack_json(tmp_path: Path) -> dict:
    [path] = tmp_path.rglob("tfdebug/pack.json")
    return json.loads(path.read_text())


def _checkpoints(every_n_train_steps: int = 2) -> list[dict]:
    return [
        {"class_path": "lightning.pytorch.callbacks.ModelCheckpoint", "init_args": {"monitor": "val_loss"}},
        {
            "class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
            "init_args": {"every_n_train_steps": every_n_train_steps, "save_top_k": -1, "filename": "every-{step}"},
        },
    ]


STOOD_ASIDE = "the preflight pack (tfdebug check) runs instead of the configured TFDebug(preset='full')"


@pytest.mark.slow  # ~13 s: a `tfdebug check` subprocess; the README preflight line runs by default
def test_check_on_a_config_holding_a_full_pack_and_two_checkpoints_runs_one_pack_with_its_settings(tmp_path):
    """The README's situation (a config that already holds TFDebug(preset="full")): Lightning used to refuse the
    Trainer (two callbacks with one state key, exit 2). Now the preflight pack runs, with the configured pack's batch
    settings, exclude and overrides, and the configured one says once that it stands aside."""
    pack = {
        "class_path": "lightning_tfdebug.TFDebug",
        "init_args": {
            "preset": "full",
            "every_n_steps": 50,
            "input_key": "input_ids",
            "exclude": ["DeadActivation"],
            "overrides": {"GradNormMonitor": {"explosion_factor": 25.0}, "LossAtInit": {"check_step": 4}},
        },
    }
    done = _check_with_config(tmp_path, [pack, *_checkpoints()], "--model.lr=2e-3")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert done.stderr.count(STOOD_ASIDE) == 1, done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    info = _pack_json(tmp_path)
    assert info["running"] == [n for n in MEMBERS if n != "DeadActivation"]  # the configured exclude holds
    assert info["settings"]["input_key"] == "input_ids" and info["settings"]["every_n_steps"] == 1  # 8 // 25 -> 1
    assert not list(tmp_path.rglob("*.ckpt"))  # both checkpoint callbacks saved nothing in the trial run
    assert "preset full, 12 members, step 8" in done.stdout


@pytest.mark.slow
@pytest.mark.ci  # a 20-30 s subprocess fit: in CI's ci lane, out of the default run's 8 minutes
def test_check_on_an_always_pack_and_members_listed_by_hand_reports_the_bug_and_exits_1(tmp_path):
    callbacks = [
        {"class_path": "lightning_tfdebug.TFDebug", "init_args": {"preset": "always"}},
        {"class_path": "lightning_tfdebug.GradNormMonitor", "init_args": {"every_n_steps": 2}},
        *_checkpoints(every_n_train_steps=3),
    ]
    done = _check_with_config(tmp_path, callbacks, "--model.bug=head_frozen")
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-3000:]
    assert "TFD312 error step" in done.stdout and "head" in done.stdout
    assert "the configured TFDebug(preset='always')" in done.stderr
    info = _pack_json(tmp_path)
    assert info["by_hand"] == ["GradNormMonitor"] and "GradNormMonitor" not in info["running"]
    assert "MaskProbe" in info["running"]  # the preflight's preset (full), not the configured one's
    assert not list(tmp_path.rglob("*.ckpt"))


def test_check_names_the_callback_that_refuses_the_preflight_in_one_message_and_exits_2(tmp_path):
    refuses = {"class_path": "tests.apps.strict_callbacks.FullValidationOnly"}
    done = _check_with_config(tmp_path, [refuses], steps=3)
    assert done.returncode == 2, done.stdout[-3000:] + done.stderr[-3000:]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    [line] = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert "the callback FullValidationOnly stopped the preflight run" in line
    assert "limit_val_batches is 2" in line  # the callback's own reason


def test_check_on_a_config_that_already_holds_a_preflight_pack_says_why_it_cannot_add_one(tmp_path):
    same = {"class_path": "lightning_tfdebug.TFDebug", "init_args": {"preset": "full", "preflight": True}}
    done = _check_with_config(tmp_path, [same], steps=3)
    assert done.returncode == 2, done.stdout[-3000:] + done.stderr[-3000:]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    [line] = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert "two TFDebug callbacks have the same state key" in line and "remove `preflight: true`" in line


def test_a_preflight_pack_has_its_own_state_key():
    assert TFDebug(preset="full").state_key != TFDebug(preset="full", preflight=True).state_key
    assert TFDebug(preset="full").state_key == TFDebug(preset="full", every_n_steps=3).state_key  # resumes still load


@pytest.mark.slow
def test_the_readme_preflight_line_exits_1_on_the_demo_with_the_head_left_out_naming_it(tmp_path):
    """The README's preflight line, from a copy of the examples, with the documented bug flag (the healthy line runs
    as written in tests/test_docs_commands.py)."""
    shutil.copytree(ROOT / "examples", tmp_path / "examples")
    tfdebug = Path(sys.executable).with_name("tfdebug")
    cmd = [str(tfdebug), "check", "--", sys.executable, "examples/train.py", "fit", "--config", "examples/demo.yaml"]
    done = subprocess.run(
        [*cmd, "--model.head_not_in_optimizer", "true"], cwd=tmp_path, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-3000:]
    assert "TFD312 error step" in done.stdout and "(not in the optimizer): head" in done.stdout
    assert done.stderr.count(STOOD_ASIDE) == 1


def test_a_preflight_pack_takes_over_the_configured_packs_view_of_the_batch_but_not_its_cadence(tmp_path):
    configured = TFDebug(
        preset="always",
        every_n_steps=50,
        on_finding="raise",
        input_key="input_ids",
        exclude=["DeadActivation"],
        overrides={"GradNormMonitor": {"explosion_factor": 25.0}, "LossAtInit": {"check_step": 2}},
        summary=False,
    )
    preflight = TFDebug(preset="full", preflight=True, every_n_steps=1, summary=False)
    fit_tiny(tmp_path, [configured, preflight], max_steps=3)
    assert configured.idle and not preflight.idle
    assert "DeadActivation" not in preflight.running and "MaskProbe" in preflight.running
    members = preflight.members
    assert members["GradNormMonitor"].explosion_factor == 25.0  # the configured override
    assert members["LossAtInit"].check_step is None  # the preflight's own setting wins over the configured one
    assert members["MaskProbe"]._keys.input_key == "input_ids"  # the configured batch reading
    assert all(m.on_finding == "warn" for m in members.values())  # the preflight's, not the configured "raise"
    assert members["GradNormMonitor"].every_n_steps == 1
