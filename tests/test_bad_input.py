"""Bad input, everywhere: every public constructor (every callback and the one-entry pack) gets a value of the wrong
type for every typed argument, and every numeric argument a value out of any sane range, and must answer with one
clear message naming the argument and what was given (issue 16, item 7).

Built from the constructors' own signatures, so a new argument is covered the day it is added."""

from __future__ import annotations

import inspect
import types
import typing

import pytest

import lightning_tfdebug
from lightning_tfdebug.core.base import DebugCallback


def public_constructors() -> list[type]:
    classes = [getattr(lightning_tfdebug, n) for n in lightning_tfdebug.__all__]
    found = [c for c in classes if isinstance(c, type) and issubclass(c, DebugCallback) and c is not DebugCallback]
    try:
        from lightning_tfdebug.pack import TFDebug

        found.append(TFDebug)
    except ImportError:  # pragma: no cover - the pack is part of the package
        pass
    return found


WRONG_TYPE = object()  # no argument of the pack accepts an arbitrary object, except those typed Any


def _kinds(cls: type, name: str) -> set[type]:
    hints = typing.get_type_hints(cls.__init__)
    hint = hints.get(name, typing.Any)
    out: set[type] = set()
    stack = [hint]
    while stack:
        h = stack.pop()
        origin = typing.get_origin(h)
        if origin in (typing.Union, types.UnionType):
            stack.extend(typing.get_args(h))
        elif origin is typing.Literal:
            out.add(typing.Literal)
        elif h is typing.Any or origin is not None:
            out.add(object)  # containers, callables, Any: not a simple type
        elif isinstance(h, type):
            out.add(h)
    return out


def cases() -> list[tuple[type, str, object]]:
    rows = []
    for cls in public_constructors():
        for name, param in inspect.signature(cls.__init__).parameters.items():
            if name == "self" or param.kind in (param.VAR_KEYWORD, param.VAR_POSITIONAL):
                continue
            kinds = _kinds(cls, name)
            if object in kinds or not kinds:
                continue  # Any, callables, mappings: checked by their own tests
            rows.append((cls, name, WRONG_TYPE))
            if kinds & {int, float} and bool not in kinds:
                rows.append((cls, name, -(10**9)))  # out of range for every count, rate, size and threshold
    return rows


def _id(row) -> str:
    cls, name, value = row
    return f"{cls.__name__}-{name}-{'object' if value is WRONG_TYPE else value}"


@pytest.mark.parametrize("row", cases(), ids=_id)
def test_every_constructor_names_the_argument_and_the_value(row):
    cls, name, value = row
    if value is not WRONG_TYPE and name in {"ignore_index", "input_key", "mask_key", "labels_key"}:
        pytest.skip(f"{name}: any integer is a valid value")
    with pytest.raises((TypeError, ValueError)) as info:
        cls(**{name: value})
    message = str(info.value)
    assert f"`{name}`" in message or name in message, message
    shown = repr(value) if value is not WRONG_TYPE else "object at"
    assert shown in message, message
    assert "must" in message or "one of" in message, message


def test_the_table_covers_every_constructor():
    names = {cls.__name__ for cls, _, _ in cases()}
    assert {c.__name__ for c in public_constructors()} <= names
    assert "TFDebug" in names and len(names) >= 14


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
