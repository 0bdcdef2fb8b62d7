"""Command line ``tfdebug`` (also ``python -m lightning_tfdebug``): ``report``, ``check`` and ``replay``; each
command's ``--help`` says what it does and what its exit status means; ``--version`` prints the package's version."""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import subprocess
import sys
import tempfile
import warnings
from collections.abc import Callable, Sequence

from lightning_tfdebug import __version__
from lightning_tfdebug.report import FAIL_ON, FORMATS


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m lightning_tfdebug", description="lightning_tfdebug tools.")
    parser.add_argument("--version", action="version", version=f"lightning-tfdebug {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    rep = commands.add_parser(
        "replay",
        help="replay the failing step of a ReproCapture bundle, or the per-sample losses of a SpikeGuard bundle",
        description="Rebuild the LightningModule, restore the saved state and RNG, run the failing training step on "
        "the saved batch and show the exception it raises. A SpikeGuard bundle (tfdebug/spikes/step<k>-rank<r>): "
        "re-run its model call and compare the per-sample losses (0: they match). Exit status: 0 when it raised the "
        "recorded exception (same type and message), 1 when it raised another or none, 2 when the bundle or the "
        "config cannot be used.",
    )
    rep.add_argument(
        "bundle",
        help="a bundle directory (.../tfdebug/repro/step<k>-rank<r>), or a log directory: its newest bundle is used",
    )
    rep.add_argument("--config", help="the run's LightningCLI YAML (its `model` section builds the module)")
    rep.add_argument("--model-class", help="class path of the module when the config's model has no class_path")
    rep.add_argument("--accelerator", help="default: the run's if available here, else cpu")
    rep.add_argument("--precision", help="default: the run's (16-mixed becomes 32-true on the CPU)")
    rep.add_argument("--fresh-weights", action="store_true", help="do not load the saved model state")

    report = commands.add_parser(
        "report",
        help="report a run's findings, merged over ranks and callbacks",
        description="Merge the findings of every rank and callback of a run, sort them by severity and print them. "
        "Exit status: 0 when nothing is at or above --fail-on, 1 otherwise, 2 when LOG_DIR cannot be read.",
    )
    report.add_argument("log_dir", help="a run's log directory (version_N), its tfdebug/ folder, or a folder of runs")
    _report_options(report)

    check = commands.add_parser(
        "check",
        help="run your LightningCLI training command for a few steps with the full pack, then report",
        description="Preflight: run the given LightningCLI `fit` command for --steps steps with "
        "TFDebug(preset='full') added through LightningCLI's own arguments (checkpoint callbacks save nothing, "
        "validation is limited to 2 batches), then print the report. Exit status as for `report`; 2 when the "
        "command is not a LightningCLI fit or did not start.",
        usage="%(prog)s [--steps N] [--dir DIR] [--fail-on LEVEL] [--format FMT] [--output FILE] -- COMMAND ...",
    )
    check.add_argument("--steps", type=_positive_int, default=50, help="optimizer steps to run (default 50)")
    check.add_argument(
        "--dir",
        default="tfdebug-check",
        help="where the preflight writes its logs and findings (default ./tfdebug-check): never the run series the "
        "configured logger will use",
    )
    _report_options(check)
    check.add_argument("cmd", nargs=argparse.REMAINDER, help="the training command, after `--`")
    return parser


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive integer; got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer; got {text!r}")
    return value


def _report_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--format", choices=FORMATS, default="text", help="output format (default text)")
    parser.add_argument(
        "--output", help="write the report to this file (default: standard output; html: <log_dir>/tfdebug/report.html)"
    )
    parser.add_argument(
        "--fail-on",
        choices=FAIL_ON,
        default="error",
        help="exit 1 when a finding is at or above this severity (default error; unverified: an error, or a Coverage "
        "row that could not be checked; never: always exit 0)",
    )
    parser.add_argument(
        "--verbose",
        action="store_true",
        help="text: every finding's message, evidence and hint under its headline (markdown and html carry them)",
    )


def _error(message: str) -> int:
    """Say ``message`` on standard error and return the exit status of a command that could not do its work."""
    print(f"error: {message}", file=sys.stderr)
    return 2


def _emit_report(run, args: argparse.Namespace) -> int:  # type: ignore[no-untyped-def]
    from lightning_tfdebug.report import exit_status, render, summary_line

    text = render(run, args.format, args.fail_on, verbose=args.verbose)
    output = args.output
    if output is None and args.format == "html":
        output = os.path.join(run.tfdebug_dir, "report.html")
    if output is None:
        sys.stdout.write(text)
    else:
        from lightning_tfdebug.core.io import write_failures, write_text

        if not write_text(output, text, warn=False):  # the one writer: atomic, no half-written report
            return _error(f"cannot write the report to {output}: {write_failures()[-1].error}")
        print(summary_line(run))
        print(f"Report: {output}")
    return exit_status(run.merged, args.fail_on, run.coverage)


def report_command(args: argparse.Namespace) -> int:
    from lightning_tfdebug.report import load_run

    try:
        run = load_run(args.log_dir)
    except (OSError, ValueError) as err:
        return _error(f"cannot read {args.log_dir}: {err}")
    return _emit_report(run, args)


_OTHER_SUBCOMMANDS = ("validate", "test", "predict")


def check_command(args: argparse.Namespace) -> int:
    from lightning_tfdebug.pack import CHECK_RESULT_ENV
    from lightning_tfdebug.report import load_run

    cmd = list(args.cmd)
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    if not cmd:
        return _error("give the training command after `--`, e.g. tfdebug check -- python train.py fit --config c.yaml")
    if "fit" not in cmd:
        other = next((c for c in cmd if c in _OTHER_SUBCOMMANDS), None)
        said = f"runs `{other}`" if other else "has no `fit` subcommand"
        return _error(
            f"the command {said}. tfdebug check runs a LightningCLI `fit` (the pack watches training), e.g. "
            "`tfdebug check -- python train.py fit --config config.yaml`. A script built with "
            "LightningCLI(..., run=False) or without LightningCLI cannot take the pack from the command line: add "
            "`lightning_tfdebug.TFDebug(preset='full')` to its Trainer's callbacks instead."
        )
    if cmd[0] in ("python", "python3"):
        # A bare `python`: the interpreter tfdebug itself runs in, which has the pack and its dependencies (the one
        # on PATH may be another, e.g. when tfdebug is called as `.venv/bin/tfdebug` without activating the venv).
        cmd = [sys.executable, *cmd[1:]]
    every = max(1, args.steps // 25)
    added = [
        "--trainer.callbacks+=lightning_tfdebug.TFDebug",
        "--trainer.callbacks.preset=full",
        "--trainer.callbacks.preflight=true",
        f"--trainer.callbacks.every_n_steps={every}",
        f"--trainer.max_steps={args.steps}",
        "--trainer.limit_val_batches=2",
        # the preflight's own logger and root: the configured logger's series (runs/<name>/version_N) stays the real
        # runs', so `tfdebug report runs/<name>` after a preflight still reads the newest real run
        "--trainer.logger=lightning.pytorch.loggers.TensorBoardLogger",
        f"--trainer.logger.init_args.save_dir={os.path.abspath(args.dir)}",
        "--trainer.logger.init_args.name=preflight",
        f"--trainer.default_root_dir={os.path.abspath(args.dir)}",
    ]
    fd, result = tempfile.mkstemp(prefix="tfdebug-check-", suffix=".json")
    os.close(fd)
    os.remove(result)  # the pack writes it once the run has started: its absence means it never did
    env = {**os.environ, CHECK_RESULT_ENV: result}
    print(f"tfdebug check: {' '.join(cmd)}  (+ {' '.join(added)})", flush=True)
    try:
        proc = subprocess.Popen([*cmd, *added], env=env, stderr=subprocess.PIPE)
    except OSError as err:
        return _error(f"cannot run {cmd[0]!r}: {err}")
    try:
        held = _relay_stderr(proc, started=lambda: bool(_read_result(result).get("log_dir")))
        rc = proc.wait()
        started = _read_result(result)
    finally:
        if os.path.exists(result):
            os.remove(result)
    log_dir = started.get("log_dir")
    if not log_dir:
        print(_not_started(rc, started, held), file=sys.stderr)
        return 2
    try:
        run = load_run(log_dir)
    except (OSError, ValueError) as err:
        return _error(f"cannot read the run's output in {log_dir}: {err}")
    status = _emit_report(run, args)
    print(f"tfdebug check: the preflight's logs and findings are in {log_dir}")
    if rc != 0:
        print(f"tfdebug check: the training command failed (exit status {rc}); see its error above.", file=sys.stderr)
        return max(status, 1)
    return status


def _read_result(path: str) -> dict:  # type: ignore[type-arg]
    """What the preflight pack wrote for ``tfdebug check``: its log directory once it started, or who refused the run
    (``refused_by``, ``error``); empty when it wrote nothing."""
    try:
        with open(path, encoding="utf-8") as f:
            return dict(json.load(f))
    except (OSError, ValueError, TypeError):
        return {}


def _relay_stderr(proc: subprocess.Popen, started: Callable[[], bool]) -> list[str]:  # type: ignore[type-arg]
    """Copy the command's standard error to ours as it comes, except a traceback printed before the pack started
    (the command refusing the preflight, which :func:`_not_started` says in one sentence): those lines are returned."""
    held: list[str] = []
    assert proc.stderr is not None
    for raw in iter(proc.stderr.readline, b""):
        line = raw.decode(errors="replace")
        if held or (line.startswith("Traceback (most recent call last)") and not started()):
            if started():  # the pack started after all: what was held back is the run's own output
                sys.stderr.write("".join(held))
                held = []
            else:
                held.append(line)
                continue
        sys.stderr.write(line)
        sys.stderr.flush()
    return held


def _last_exception(lines: Sequence[str]) -> str | None:
    """``Type: message`` of the last traceback in ``lines`` (its first line), or None."""
    starts = [i for i, line in enumerate(lines) if line.startswith("Traceback (most recent call last)")]
    if not starts:
        return None
    for line in lines[starts[-1] + 1 :]:
        if line.strip() and not line[0].isspace():
            text = line.strip()
            return text if len(text) <= 600 else text[:597] + "..."
    return None


_DUPLICATE_KEY = re.compile(r"more than one stateful callback of type `([^`]+)`")


def _not_started(rc: int, started: dict, held: Sequence[str]) -> str:  # type: ignore[type-arg]
    """One message for a command that stopped before the pack started, naming the callback and the reason if known."""
    error = started.get("error") or _last_exception(held)
    hidden = " (its traceback is not shown: run the command without `tfdebug check` to see it)" if held else ""
    if started.get("refused_by"):
        return (
            f"error: the callback {started['refused_by']} stopped the preflight run before the pack started: "
            f"{(error or '').rstrip('.')}{hidden}. tfdebug check adds the pack and sets --trainer.max_steps and "
            "--trainer.limit_val_batches; a callback that cannot run with them cannot be preflighted as configured."
        )
    duplicate = _DUPLICATE_KEY.search(error or "")
    if duplicate:
        name = duplicate.group(1)
        why = (
            " Your config already holds a TFDebug with `preflight: true` and the same members, so the one tfdebug "
            "check adds has the same state key: remove `preflight: true` from the config."
            if name == "TFDebug"
            else ""
        )
        return f"error: Lightning refused the Trainer: two {name} callbacks have the same state key.{why}{hidden}"
    if error:
        return f"error: the command stopped before the pack started: {error.rstrip('.')}{hidden}."
    return (
        f"error: the command exited with status {rc} before the pack started. tfdebug check needs a script that "
        "builds a LightningCLI and runs `fit` (the arguments it adds are LightningCLI's own "
        "`--trainer.callbacks+=...`); see the command's own error above."
    )


def replay_command(args: argparse.Namespace) -> int:
    from lightning_tfdebug.repro import BUNDLE_META, BundleError, build_module, find_bundles, load_bundle, replay

    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)  # no "GPU available" banners for one step

    try:
        path = args.bundle
        if os.path.isdir(path) and not os.path.isfile(os.path.join(path, BUNDLE_META)):
            found = find_bundles(path)
            if found:
                path = str(found[-1])
                print(f"Found  : {len(found)} bundle(s) under {args.bundle}; replaying the newest")
        bundle = load_bundle(path)
        run = bundle.meta.get("run") or {}
        model_class = args.model_class or run.get("model_class")
        if bundle.meta.get("kind") == "spike":
            return _replay_spike(bundle, args, model_class, run)
        print(f"Bundle : {bundle.path}")
        print(
            f"Failed : step {bundle.meta.get('step')}, batch {bundle.meta.get('batch_idx')}, rank "
            f"{bundle.meta.get('rank')} of {bundle.meta.get('world_size')}"
        )
        print(f"Raised : {bundle.exception.get('type')}: {bundle.exception.get('message')}")
        source = args.config or "the hyper-parameters saved in the bundle"
        print(f"Module : {model_class} built from {source}")
        module = build_module(args.config, model_class=model_class, hparams=run.get("hparams"))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            result = replay(
                bundle,
                module,
                accelerator=args.accelerator,
                precision=args.precision,
                load_state=not args.fresh_weights,
            )
    except BundleError as err:
        return _error(str(err))
    for note in result.notes:
        print(f"Note   : {note}")
    if result.exception is None:
        print("Replay : the step ran without an exception; the failure did not reproduce.")
        return 1
    print("\n" + result.traceback.rstrip())
    if result.reproduced:
        print("\nReplay : reproduced: same exception type and message as the recorded run.")
        return 0
    print(f"\nReplay : a different exception than the recorded {result.expected_type}: {result.expected_message}")
    return 1


def _replay_spike(bundle, args: argparse.Namespace, model_class: str | None, run: dict) -> int:  # type: ignore[no-untyped-def,type-arg]
    """A SpikeGuard bundle: re-run its model call and compare the per-sample losses with the recorded ones. Exit
    status 0 when they agree (relative 1e-4), 1 when they do not (``BundleError``: the caller's 2)."""
    from lightning_tfdebug.repro import build_module, replay_spike

    meta = bundle.meta
    print(f"Bundle : {bundle.path}")
    print(
        f"Spike  : step {meta.get('step')}, batch {meta.get('batch_idx')}, rank {meta.get('rank')}, LR {meta.get('lr')}"
    )
    print(f"Module : {model_class} built from {args.config or 'the hyper-parameters saved in the bundle'}")
    module = build_module(args.config, model_class=model_class, hparams=run.get("hparams"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        now, recorded, notes = replay_spike(bundle, module, load_state=not args.fresh_weights)
    for note in notes:
        print(f"Note   : {note}")
    worst = max((abs(a - b) / max(abs(b), 1e-6) for a, b in zip(now, recorded)), default=0.0)
    for row, (a, b) in enumerate(zip(now, recorded)):
        mark = "  <- named" if row in (meta.get("rows") or []) else ""
        print(f"row {row:>4}: loss {a:.6g} (recorded {b:.6g}){mark}")
    if len(now) == len(recorded) and worst <= 1e-4:
        print("\nReplay : reproduced: the per-sample losses match the recorded ones.")
        return 0
    print(f"\nReplay : the per-sample losses differ from the recorded ones (largest relative difference {worst:.3g}).")
    return 1


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m lightning_tfdebug`` and the ``tfdebug`` console script."""
    args = _parser().parse_args(argv)
    commands = {"replay": replay_command, "report": report_command, "check": check_command}
    return commands[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
