"""Command line: ``python -m lightning_tfdebug replay <bundle> --config <LightningCLI config>`` (also ``tfdebug``).

Exit status of ``replay``: 0 when the replayed step raised the recorded exception (same type and message), 1 when
it raised something else or nothing, 2 when the bundle or the config could not be used.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import warnings
from collections.abc import Sequence


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m lightning_tfdebug", description="lightning_tfdebug tools.")
    commands = parser.add_subparsers(dest="command", required=True)
    rep = commands.add_parser(
        "replay",
        help="replay the failing training step of a ReproCapture bundle",
        description="Rebuild the LightningModule, restore the saved state and RNG, run the failing training step on "
        "the saved batch and show the exception it raises.",
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
    return parser


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
        print(f"error: {err}", file=sys.stderr)
        return 2
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


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m lightning_tfdebug`` and the ``tfdebug`` console script."""
    args = _parser().parse_args(argv)
    if args.command == "replay":
        return replay_command(args)
    return 2  # pragma: no cover - argparse rejects unknown commands


if __name__ == "__main__":
    sys.exit(main())
