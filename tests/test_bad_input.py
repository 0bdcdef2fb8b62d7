"""Bad input on the command line: every option of `tfdebug report` and `tfdebug check` given a wrong value answers with
one clear message naming the option and what was given, and exit status 2, never a traceback.

Every constructor's bad arguments are the contract suite's (`tests/test_contract.py`), derived from the signatures."""

from __future__ import annotations

import pytest


# ---------------------------------------------------------- the command line: `tfdebug report` and `tfdebug check`
def _cli(argv: list[str], capsys) -> tuple[int, str]:
    """Run the command line in this process; return (exit status, everything it printed)."""
    from lightning_tfdebug.__main__ import main

    try:
        status = main(argv)
    except SystemExit as exit_:  # argparse's own errors
        status = exit_.code
    out = capsys.readouterr()
    return status, out.out + out.err


def _a_run(tmp_path) -> str:
    """The smallest run the report can read: one findings file."""
    from lightning_tfdebug.core.io import append_finding
    from lightning_tfdebug.findings import Finding

    run = tmp_path / "run"
    append_finding(
        str(run / "tfdebug" / "findings-rank0.jsonl"),
        Finding("TFD399", "warning", "StepEmitter", 1, 0, "a finding", {}, ""),
    )
    return str(run)


# (argv, what the message must name: the argument, and the value given; allowed values where there is a list)
CLI_CASES = [
    (["report", "{run}", "--format", "pdf"], ["--format", "'pdf'", "text", "html"]),
    (["report", "{run}", "--format"], ["--format", "expected one argument"]),
    (["report", "{run}", "--fail-on", "sometimes"], ["--fail-on", "'sometimes'", "warning", "never"]),
    (["report", "{tmp}/no-such-dir"], ["no-such-dir", "not a directory"]),
    (["report", "{tmp}/a-file"], ["a-file", "not a directory"]),
    (["report", "{tmp}/empty"], ["empty", "no lightning_tfdebug output"]),
    (["report", "{run}", "--output", "{tmp}/a-file/report.txt"], ["cannot write the report", "a-file/report.txt"]),
    (["report"], ["log_dir", "required"]),
    (["report", "{run}", "--colour"], ["unrecognized arguments: --colour"]),
    (["check", "--steps", "0", "--", "python", "train.py", "fit"], ["--steps", "positive integer", "'0'"]),
    (["check", "--steps", "-3", "--", "python", "train.py", "fit"], ["--steps", "positive integer", "'-3'"]),
    (["check", "--steps", "1.5", "--", "python", "train.py", "fit"], ["--steps", "positive integer", "'1.5'"]),
    (["check", "--steps", "many", "--", "python", "train.py", "fit"], ["--steps", "positive integer", "'many'"]),
    (["check", "--format", "pdf", "--", "python", "train.py", "fit"], ["--format", "'pdf'", "markdown"]),
    (["check", "--fail-on", "always", "--", "python", "train.py", "fit"], ["--fail-on", "'always'", "error"]),
    (["check"], ["give the training command after `--`"]),
    (["check", "--", "python", "train.py", "validate"], ["runs `validate`", "LightningCLI `fit`"]),
    (["check", "--", "python", "train.py"], ["has no `fit` subcommand"]),
    (["check", "--", "{tmp}/no-such-program", "fit"], ["cannot run", "no-such-program"]),
    (["frobnicate"], ["invalid choice: 'frobnicate'", "report", "check"]),
]


@pytest.mark.parametrize("argv, named", CLI_CASES, ids=lambda v: " ".join(v) if isinstance(v, list) else None)
def test_every_command_line_option_says_what_was_wrong_and_exits_2(tmp_path, capsys, argv, named):
    (tmp_path / "a-file").write_text("not a directory")
    (tmp_path / "empty").mkdir()
    run = _a_run(tmp_path)
    argv = [a.format(run=run, tmp=tmp_path) for a in argv]
    status, output = _cli(argv, capsys)
    assert status == 2, (status, output)
    for text in named:
        assert text in output, f"{text!r} not in:\n{output}"
    assert "Traceback" not in output


def test_a_bad_option_from_the_real_console_prints_no_traceback(tmp_path):
    """The installed entry point, in its own process: one usage line and one error line, exit status 2."""
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-m", "lightning_tfdebug", "report", str(tmp_path), "--fail-on", "sometimes"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr and "--fail-on" in proc.stderr and "'sometimes'" in proc.stderr
