"""`tfdebug report` and `tfdebug check`: merged findings, formats, exit codes, pictures, preflight of a script."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from lightning_tfdebug import GradNormMonitor, TFDebug
from lightning_tfdebug.__main__ import main
from lightning_tfdebug.demo import TinyGPT
from lightning_tfdebug.findings import Finding
from lightning_tfdebug.report import exit_status, load_run, merge_findings, render
from tests.helpers import SMALL, fit_tiny

ROOT = Path(__file__).resolve().parents[1]
APP = ROOT / "tests" / "apps" / "encoder_cli.py"


def finding(code: str, severity: str, rank: int, step: int = 3, message: str = "same words") -> Finding:
    return Finding(code=code, severity=severity, source="GradNormMonitor", step=step, rank=rank, message=message)


def write_findings(tfdebug_dir: Path, rank: int, findings: list[Finding]) -> None:
    tfdebug_dir.mkdir(parents=True, exist_ok=True)
    with open(tfdebug_dir / f"findings-rank{rank}.jsonl", "a", encoding="utf-8") as f:
        f.writelines(x.to_json() + "\n" for x in findings)


def test_identical_findings_of_several_ranks_are_one_line_sorted_by_severity(tmp_path):
    run_dir = tmp_path / "lightning_logs" / "version_0"
    write_findings(run_dir / "tfdebug", 0, [finding("TFD301", "warning", 0), finding("TFD305", "info", 0, step=1)])
    write_findings(run_dir / "tfdebug", 1, [finding("TFD301", "warning", 1, step=5), finding("TFD302", "error", 1)])
    run = load_run(tmp_path)  # a folder above the run: the run is found under it
    assert run.log_dir == str(run_dir)
    merged = run.merged
    assert [(m.code, m.ranks) for m in merged] == [("TFD302", (1,)), ("TFD301", (0, 1)), ("TFD305", (0,))]
    assert merged[1].steps == (3, 5) and merged[1].step == 3
    assert exit_status(merged, "error") == 1 and exit_status(merge_findings(run.findings[:1]), "error") == 0
    assert exit_status(merge_findings(run.findings[:1]), "warning") == 1 and exit_status(merged, "never") == 0


def test_the_report_command_formats_and_exit_codes(tmp_path, capsys):
    run_dir = tmp_path / "version_0"
    write_findings(run_dir / "tfdebug", 0, [finding("TFD301", "warning", 0)])
    write_findings(run_dir / "tfdebug", 1, [finding("TFD301", "warning", 1)])
    assert main(["report", str(run_dir)]) == 0  # a warning is below the default --fail-on error
    text = capsys.readouterr().out
    # one headline per finding (no evidence here: the rule's title), the message on request
    assert "TFD301 warning step 3 ranks 0,1: explosion: total above `explosion_factor` x running median\n" in text
    assert "same words" not in text
    assert f"lightning_tfdebug: 0 errors, 1 warning, 0 info ({run_dir})\n" in text
    assert text.rstrip().endswith(f"tfdebug report {run_dir} --verbose")
    assert main(["report", str(run_dir), "--verbose"]) == 0
    assert "        GradNormMonitor: same words" in capsys.readouterr().out
    assert main(["report", str(run_dir), "--fail-on", "warning", "--format", "json"]) == 1
    data = json.loads(capsys.readouterr().out)
    assert data["summary"] == {"error": 0, "warning": 1, "info": 0} and data["findings"][0]["ranks"] == [0, 1]
    assert data["findings"][0]["headline"].startswith("TFD301 warning step 3 ranks 0,1: ")
    assert data["exit_status"] == 1
    assert main(["report", str(run_dir / "tfdebug"), "--format", "markdown"]) == 0
    markdown = capsys.readouterr().out
    assert "- [TFD301 warning step 3 ranks 0,1: explosion: total above" in markdown
    assert "GradNormMonitor: same words" in markdown  # the details carry the message
    out = tmp_path / "r.md"
    assert main(["report", str(run_dir), "--format", "markdown", "--output", str(out)]) == 0
    assert out.read_text().startswith("# lightning_tfdebug report")


@pytest.mark.parametrize("where", ["missing", "empty", "file"])
def test_a_directory_that_cannot_be_read_exits_2(tmp_path, capsys, where):
    target = tmp_path / "x"
    if where == "empty":
        target.mkdir()
    elif where == "file":
        target.write_text("not a directory")
    assert main(["report", str(target)]) == 2
    assert "error: cannot read" in capsys.readouterr().err


def test_a_healthy_run_reports_0_and_a_buggy_run_1_with_pictures_and_the_report_names_it(tmp_path, capsys):
    healthy = TFDebug(every_n_steps=2)
    fit_tiny(tmp_path / "ok", [healthy], max_steps=10)
    assert main(["report", str(tmp_path / "ok")]) == 0
    capsys.readouterr()
    from tests.test_report_page import check_page, decoded, evidence_figures

    healthy_run = load_run(tmp_path / "ok")
    healthy_page = render(healthy_run, "html")
    page = check_page(healthy_page, healthy_run.merged)  # the overview, Coverage, the ranks; no empty chart
    assert page.figures[0]["caption"].startswith("Overview: `train/loss`") and "Not drawn" not in decoded(healthy_page)
    assert "<table class='coverage'>" in healthy_page and "<h2>Ranks</h2>" in healthy_page
    rows = {(r.member, r.check): r.status for r in healthy_run.coverage}  # every rank's coverage-rank<r>.jsonl
    assert rows[("MaskProbe", "causal mask")] == "verified" and "finding" not in rows.values()
    # 10 steps: LossAtInit's checks at step 100 were not reached, so an unverified preflight fails
    assert rows[("LossAtInit", "loss leaves the uniform level")] == "unknown"
    assert main(["report", str(tmp_path / "ok"), "--fail-on", "unverified"]) == 1
    assert "? LossAtInit: loss leaves the uniform level (could not check: " in capsys.readouterr().out

    buggy = TFDebug(every_n_steps=2)
    fit_tiny(tmp_path / "bug", [buggy], TinyGPT(head_not_in_optimizer=True, **SMALL), max_steps=12)
    assert "TFD312" in {f.code for f in buggy.findings}
    summary = capsys.readouterr().out  # the pack's own end-of-fit summary names it, in one line
    assert "  TFD312 error step " in summary and "did not change (not in the optimizer): head" in summary
    assert "full report: tfdebug report" in summary and "Group(s) head" not in summary  # the message: on request
    html_file = tmp_path / "report.html"
    assert main(["report", str(tmp_path / "bug"), "--format", "html", "--output", str(html_file)]) == 1
    run = load_run(tmp_path / "bug")
    page = check_page(html_file.read_text(), run.merged)  # one evidence chart per warning and error, alt texts
    assert {m.code for m in run.merged if m.severity != "info"} >= {"TFD312"}
    assert any("TFD312" in f["caption"] for f in evidence_figures(page))
    assert [r.found for r in run.coverage if r.status == "finding"] == [("TFD312",), ("TFD320",)]
    assert any(f["class"] == "series" for f in page.figures)  # every series by unit, behind the fold
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    texts = [  # TensorBoard's text tab: the headlines on one card at the end of fit
        value.tensor.string_val[0].decode()
        for path in (tmp_path / "bug" / "tb" / "version_0").glob("events.out.tfevents.*")
        for event in EventFileLoader(str(path)).Load()
        for value in event.summary.value
        if value.tag.startswith("tfdebug/headlines")
    ]
    assert len(texts) == 1 and f"- {run.merged[0].headline}" in texts[0], texts


def _check(tmp_path: Path, *extra: str, steps: int = 16) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    tmp_path.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "lightning_tfdebug", "check", "--steps", str(steps), "--"]
    cmd += [sys.executable, str(APP), "fit", "--trainer.default_root_dir", str(tmp_path), "--trainer.accelerator=cpu"]
    cmd += ["--trainer.enable_progress_bar=false", *extra]
    return subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=400)


@pytest.mark.slow
@pytest.mark.ci  # a 20-30 s subprocess fit: in CI's ci lane, out of the default run's 8 minutes
def test_check_on_a_users_lightningcli_script_exits_0_when_healthy_and_1_on_a_bug(tmp_path):
    mine = ["--trainer.logger=lightning.pytorch.loggers.TensorBoardLogger", "--trainer.logger.init_args.save_dir=runs"]
    healthy = _check(tmp_path / "ok", *mine, "--trainer.logger.init_args.name=mine")
    assert healthy.returncode == 0, healthy.stdout[-3000:] + healthy.stderr[-3000:]
    from lightning_tfdebug.pack import MEMBERS

    assert f"preset full, {len(MEMBERS)} members, step 16" in healthy.stdout
    assert not list((tmp_path / "ok").rglob("*.ckpt"))  # checkpointing was off for the trial run
    # the preflight keeps to itself: the configured logger's series gets no version, the preflight's dir is named
    assert not (tmp_path / "ok" / "runs").exists()
    own = tmp_path / "ok" / "tfdebug-check" / "preflight" / "version_0"
    assert (own / "tfdebug" / "pack.json").is_file()
    assert f"the preflight's logs and findings are in {own}" in healthy.stdout

    buggy = _check(tmp_path / "bug", "--model.bug=head_frozen", steps=8)  # UpdateRatio names the frozen head by step 8
    assert buggy.returncode == 1, buggy.stdout[-3000:] + buggy.stderr[-3000:]
    assert "TFD312 error step" in buggy.stdout
    # each finding once on the terminal: the check's report, not a live warning and the pack's summary as well
    said = buggy.stdout + buggy.stderr  # the headline once; its code again only in its Coverage row
    assert said.count("TFD312 error") == 1 and "[TFD312]" not in said, said
    assert said.count("TFD312") == 2 and "(finding TFD312)" in said, said


def test_check_explains_a_command_it_cannot_run(tmp_path, capsys):
    assert main(["check", "--", sys.executable, str(APP), "validate"]) == 2
    assert "runs `validate`" in capsys.readouterr().err
    assert main(["check", "--"]) == 2
    assert "give the training command after `--`" in capsys.readouterr().err
    not_a_cli = tmp_path / "plain.py"
    not_a_cli.write_text("import sys\nprint('training without LightningCLI', sys.argv[1:])\n")
    assert main(["check", "--steps", "3", "--", sys.executable, str(not_a_cli), "fit"]) == 2
    assert "before the pack started" in capsys.readouterr().err
    with pytest.raises(SystemExit) as bad:
        main(["check", "--steps", "0", "--", "python", "x.py", "fit"])
    assert bad.value.code == 2


# ------------------------------------------------------------------ checks that did not run (issue 15, part 3)
class TupleBatchGPT(TinyGPT):
    """Batches as ``(input_ids, labels)`` tuples: with ``labels_key="targets"`` LossAtInit cannot find its labels."""

    def on_after_batch_transfer(self, batch, dataloader_idx):
        return (batch["input_ids"], batch["labels"])

    def training_step(self, batch, batch_idx):
        input_ids, labels = batch
        return self.loss(self(input_ids), labels)


class FrozenGPT(TinyGPT):
    """No trainable parameter: GradNormMonitor has no gradient to measure."""

    def configure_optimizers(self):
        return torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)

    def training_step(self, batch, batch_idx):
        return (self(batch["input_ids"]).sum() * 0).requires_grad_()


def fit_recording(tmp_path: Path, callbacks: list, model, caplog, **kwargs) -> list[str]:
    """Fit; return the TFDebugWarnings' texts. Info logs land in ``caplog``."""
    from lightning_tfdebug import TFDebugWarning
    from lightning_tfdebug.demo import TinyTextDataModule
    from tests.helpers import make_trainer

    trainer = make_trainer(tmp_path, callbacks, **kwargs)
    with warnings.catch_warnings(record=True) as caught, caplog.at_level(logging.INFO):
        warnings.simplefilter("always", TFDebugWarning)
        trainer.fit(model, TinyTextDataModule(batch_size=4))
    return [str(w.message) for w in caught if issubclass(w.category, TFDebugWarning)]


def test_a_standalone_callback_that_stands_aside_is_listed_with_its_setting_and_is_no_warning(tmp_path, caplog, capsys):
    monitor = GradNormMonitor(every_n_steps=1)
    frozen = FrozenGPT(d_model=16, n_layers=1, n_heads=2)
    frozen.requires_grad_(False)
    warned = fit_recording(tmp_path, [monitor], frozen, caplog, max_steps=3)
    assert not monitor.active and not any("GradNormMonitor" in w for w in warned), warned
    said = [r.getMessage() for r in caplog.records if "GradNormMonitor" in r.getMessage()]
    # nothing said while the run goes on; one line at the end of fit (the summary of a callback on its own)
    assert not any("stands aside" in m for m in said), said
    assert sum("GradNormMonitor did not run: the model has no trainable parameters" in m for m in said) == 1, said
    assert all(r.levelno == logging.INFO for r in caplog.records if "GradNormMonitor" in r.getMessage())
    record = json.loads((tmp_path / "tb" / "version_0" / "tfdebug" / "stood-aside-rank0.jsonl").read_text())
    assert record["check"] == "GradNormMonitor" and record["setting"].startswith("a model with trainable parameters")
    assert record["rank"] == 0 and record["step"] == 0
    capsys.readouterr()

    run_dir = str(tmp_path / "tb" / "version_0")
    assert main(["report", run_dir]) == 0  # a check that did not run is not a finding: nothing fails
    text = capsys.readouterr().out
    assert "Checks that did not run (not findings; what would let each run):" in text
    assert "  GradNormMonitor: the model has no trainable parameters" in text
    assert "To let it run: a model with trainable parameters (`requires_grad=True`)." in text
    assert "1 check did not run" in text
    assert main(["report", run_dir, "--format", "json"]) == 0
    [entry] = json.loads(capsys.readouterr().out)["did_not_run"]
    assert entry["check"] == "GradNormMonitor" and entry["ranks"] == [0]
    assert entry["setting"] == "a model with trainable parameters (`requires_grad=True`)"
    assert "no trainable parameters" in entry["reason"]
    assert main(["report", run_dir, "--format", "markdown"]) == 0
    markdown = capsys.readouterr().out
    assert "## Checks that did not run" in markdown
    assert "| GradNormMonitor | 0 | the model has no trainable parameters" in markdown
    assert "| a model with trainable parameters (`requires_grad=True`) |" in markdown
    html_file = tmp_path / "r.html"
    assert main(["report", run_dir, "--format", "html", "--output", str(html_file)]) == 0
    assert "To let it run: a model with trainable parameters" in html_file.read_text()


def test_the_pack_summary_has_a_did_not_run_block_and_the_report_merges_it(tmp_path, caplog, capsys):
    pack = TFDebug(labels_key="targets", every_n_steps=1, exclude=["MaskProbe"])  # one member that stands aside
    warned = fit_recording(tmp_path, [pack], TupleBatchGPT(**SMALL), caplog, max_steps=3)
    assert not pack.members["LossAtInit"].active
    assert not any("stands aside" in w or "did not run" in w for w in warned), warned
    # the pack's members are listed by the pack's summary, not each by a line of its own at the end of fit
    assert not any("LossAtInit" in r.getMessage() for r in caplog.records)  # nothing during the run either
    summary = capsys.readouterr().out
    block = summary[summary.index("  did not run (not findings; what would let each run):") :]
    assert "    LossAtInit: the batch is a tuple of 2 items, which has no tensor at 'targets'" in block
    assert "To let it run: `labels_key`." in block
    # one check of BatchGuard stands aside too (it counts EOS among integer token labels), listed the same way
    assert "    BatchGuard: EOS supervision (TFD124): the batches have no integer token labels" in block
    # and AttentionProbe cannot read TinyGPT's fused attention: said, not silent (by its Coverage row, once)
    assert "AttentionProbe: attention at init (could not check: attention is fused" in summary
    assert "AttentionProbe: attention at init: attention is fused" not in block
    assert "; 3 checks did not run" in summary
    run = load_run(tmp_path / "tb" / "version_0")
    # pack.json's list and the member's own record are one entry
    kept = [e for e in run.did_not_run if not e.check.startswith("AttentionProbe")]
    entry, eos = sorted(kept, key=lambda e: e.check != "LossAtInit")
    assert (entry.check, entry.setting, entry.ranks) == ("LossAtInit", "`labels_key`", (0,))
    assert eos.check == "BatchGuard: EOS supervision (TFD124)" and eos.setting == "`labels_key`"
    assert run.pack["stood_aside"]["LossAtInit"]["setting"] == "`labels_key`"


def test_did_not_run_merges_the_ranks_and_reads_older_pack_files(tmp_path):
    from lightning_tfdebug.report import merge_stood_aside

    tfdebug = tmp_path / "version_0" / "tfdebug"
    tfdebug.mkdir(parents=True)
    record = {"check": "DeadActivation", "reason": "compiled.", "setting": "an uncompiled model", "step": 0}
    for rank in (0, 1):
        (tfdebug / f"stood-aside-rank{rank}.jsonl").write_text(json.dumps({**record, "rank": rank}) + "\n{cut")
    (tfdebug / "pack.json").write_text(json.dumps({"stood_aside": {"LossAtInit": "no labels."}}))  # the older form
    run = load_run(tmp_path)
    assert [(e.check, e.ranks, e.setting) for e in run.did_not_run] == [
        ("DeadActivation", (0, 1), "an uncompiled model"),
        ("LossAtInit", (0,), None),
    ]
    assert run.stood_aside == {"DeadActivation": "compiled.", "LossAtInit": "no labels."}
    assert merge_stood_aside([]) == []
