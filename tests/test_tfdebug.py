"""TFDebug, the one-entry pack: presets, shared settings, overrides, checkpoint state, dashboard and summary."""

from __future__ import annotations

import inspect
import warnings

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


def test_the_always_preset_leaves_out_the_members_that_rerun_the_model(tmp_path):
    pack = TFDebug()
    assert set(MEMBERS) - set(pack.members) == {"MaskProbe", "CheckpointAudit"}
    assert pack.members["NaNFirstFrame"].mode == "lazy"
    fit_tiny(tmp_path, [pack], max_steps=12, log_every_n_steps=4)
    scalars = read_scalars(tmp_path / "tb" / "version_0")
    for member, section in SECTIONS.items():
        if member in pack.members:
            assert any(tag.startswith(section) for tag in scalars), member
    assert not any(tag.startswith("mask_probe/") for tag in scalars)
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
        ({"overrides": {"MaskProbe": {}}}, ValueError, r"configures MaskProbe, which the pack does not run"),
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
    assert layout["tfdebug: ranks"]["step_time_ms: every rank"] == ["Multiline", [r"per_rank/step_time_ms/rank\d+"]]


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
    layout = dashboard_layout(["GradNormMonitor"])
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
