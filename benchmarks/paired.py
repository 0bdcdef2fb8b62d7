"""The pack's step-time cost from one run that turns it on and off in blocks of steps (a paired comparison).

Usage::

    python benchmarks/paired.py --case always --every-n-steps 50 --block 50 --blocks 24 --rounds 3
    python benchmarks/paired.py --case whole --every-n-steps 50 --block 50 --blocks 24 --rounds 3
    python benchmarks/paired.py --case always --every-n-steps 10 --block 10 --blocks 120 --rounds 3
    python benchmarks/paired.py --case always --exclude NaNFirstFrame --rounds 4

``benchmarks/overhead.py`` compares separate runs, seconds or minutes apart; on a shared machine the speed of the core
drifts over that time by more than the few percent to be measured (its row of a callback that does nothing reads
0.95-1.10 per round on a bad day). Here one fit alternates blocks of ``--block`` optimizer steps with the batch hooks
of the pack (``--case always`` or ``full``) or of the 13 callbacks on their own (``--case whole``, at their
defaults: their cadence is the Trainer's ``log_every_n_steps``, set to ``--every-n-steps``) called (on) and not
called (off); a block is a whole number of cadences, so an on-block holds its share of
measuring steps. Neighbouring blocks are seconds apart, so a drift hits both alike, and the ratio of the mean step
time of the on-blocks to that of the off-blocks is the cost. Every hook outside a training batch (set-up, fit start
and end, validation, checkpoints) is always called, so the members are set up and conclude as usual; in an off-block
they see no batch at all, as if the steps had not happened.

Printed per round: the mean step time of the on- and off-blocks (all steps, measuring steps included), their ratio
and difference (milliseconds per step), and the ratio's spread over pairs of neighbouring blocks. The first block
pair is dropped (allocator warm-up, LossAtInit's step-0 capture, MaskProbe's fit-start probe).
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger

from lightning_tfdebug import TFDebug
from lightning_tfdebug.core.guard import BATCH_HOOKS
from lightning_tfdebug.demo import TinyGPT, TinyTextDataModule


class Blocks(pl.Callback):
    """Calls the training-batch hooks of ``inner`` (callbacks, in order) only in the on-blocks (every other block,
    the first one on, so that the members' step-0 work happens where it would), every other hook always, and times
    every step."""

    def __init__(self, inner: list[pl.Callback], block: int) -> None:
        self.inner = inner
        self.block = block
        self.on = True
        self.times: list[tuple[int, bool, float]] = []  # (step, on, seconds from this batch's start to the next's)
        self._last: tuple[int, bool, float] | None = None
        self.gc_s = {True: 0.0, False: 0.0}  # seconds in Python's garbage collector, in the on- and off-blocks
        self._gc_start = 0.0

    def gc_callback(self, phase: str, info: dict[str, Any]) -> None:
        """Times every collection (``gc.callbacks``) and charges it to the block it happened in."""
        if phase == "start":
            self._gc_start = time.perf_counter()
        elif self._last is not None:
            self.gc_s[self.on] += time.perf_counter() - self._gc_start

    @property
    def state_key(self) -> str:
        return "Blocks[" + ",".join(c.state_key for c in self.inner) + "]"

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step == 2 * self.block:
            # Before the first kept step, in a dropped step's time: the set-up's garbage (and an earlier round's) is
            # collected now, not by a full collection that lands in whichever block reaches the collector's
            # threshold (about 0.2 s here, charged to one block of 50 steps).
            self._last = None  # neither block is charged for it
            gc.collect()
            self.gc_s = {True: 0.0, False: 0.0}  # from the first kept step on, as the step times
        now = time.perf_counter()
        if self._last is not None:
            step, on, start = self._last
            self.times.append((step, on, now - start))
        step = trainer.global_step
        self.on = (step // self.block) % 2 == 0
        self._last = (step, self.on, now)
        if self.on:
            for callback in self.inner:
                callback.on_train_batch_start(trainer, *args)


def _forward(hook: str, batch: bool):
    def call(self: Blocks, *args: Any, **kwargs: Any) -> Any:
        if batch and not self.on:
            return None
        results = [getattr(callback, hook)(*args, **kwargs) for callback in self.inner]
        return results[0] if len(results) == 1 else None

    call.__name__ = hook
    return call


for _hook, _value in vars(pl.Callback).items():
    hook_like = _hook.startswith("on_") or _hook in ("setup", "teardown")
    if callable(_value) and hook_like and _hook != "on_train_batch_start":
        setattr(Blocks, _hook, _forward(_hook, _hook in BATCH_HOOKS))


def _setup(self: Blocks, trainer: pl.Trainer, *args: Any, **kwargs: Any) -> None:
    for callback in self.inner:
        callback.setup(trainer, *args, **kwargs)
    # TFDebug moves itself to the front of trainer.callbacks (ReproCapture's batch is read first): here Blocks, first
    # in the list, calls it, so it must not be in the list itself (it would run in every block, twice in on-blocks)
    trainer.callbacks = [cb for cb in trainer.callbacks if all(cb is not c for c in self.inner)]


Blocks.setup = _setup  # type: ignore[method-assign]


def _callbacks(case: str, every_n_steps: int, exclude: list[str] | None = None) -> list[pl.Callback]:
    if case == "whole":  # the 13 callbacks on their own, at their defaults: overhead.py's whole-pack row
        from overhead import the_pack  # benchmarks/ is on sys.path: this script runs from it

        pack = the_pack()
        unknown = set(exclude or ()) - {type(cb).__name__ for cb in pack}
        if unknown:
            raise SystemExit(f"--exclude: not one of the 13 callbacks: {', '.join(sorted(unknown))}")
        return [cb for cb in pack if type(cb).__name__ not in (exclude or ())]
    return [TFDebug(preset=case, every_n_steps=every_n_steps, summary=False, dashboard=False, exclude=exclude)]


def one_round(args: argparse.Namespace, seed: int) -> dict[str, float]:
    torch.manual_seed(seed)
    blocks = Blocks(_callbacks(args.case, args.every_n_steps, args.exclude), args.block)
    root = "/tmp/tfdebug-paired"
    logger = TensorBoardLogger(root, name="bench") if args.logger == "tensorboard" else CSVLogger(root, name="bench")
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=args.block * args.blocks,
        callbacks=[blocks],
        logger=logger,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        log_every_n_steps=args.every_n_steps,
        default_root_dir=root,
    )
    model = TinyGPT(d_model=args.d_model, n_layers=args.n_layers, n_heads=4)
    gc.callbacks.append(blocks.gc_callback)
    try:
        trainer.fit(model, TinyTextDataModule(batch_size=args.batch_size))
    finally:
        gc.callbacks.remove(blocks.gc_callback)
    kept = [(s, on, t) for s, on, t in blocks.times if s >= 2 * args.block]  # the first on/off pair dropped
    on = [t for _, o, t in kept if o]
    off = [t for _, o, t in kept if not o]
    pairs = []  # each on-block against the off-block right after it
    for first in range(2 * args.block, args.block * args.blocks - args.block, 2 * args.block):
        a = [t for s, _, t in kept if first <= s < first + args.block]
        b = [t for s, _, t in kept if first + args.block <= s < first + 2 * args.block]
        if a and b:
            pairs.append(statistics.fmean(a) / statistics.fmean(b))
    return {
        "on_ms": statistics.fmean(on) * 1e3,
        "off_ms": statistics.fmean(off) * 1e3,
        "pair_lo": min(pairs),
        "pair_median": statistics.median(pairs),
        "pair_hi": max(pairs),
        "measuring_steps_on": float(sum(1 for s, o, _ in kept if o and s % args.every_n_steps == 0)),
        "gc_on_ms": blocks.gc_s[True] * 1e3 / max(1, len(on)),
        "gc_off_ms": blocks.gc_s[False] * 1e3 / max(1, len(off)),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--case", default="always", choices=["always", "full", "whole"], help="TFDebug's preset, or the 13 callbacks"
    )
    parser.add_argument("--every-n-steps", type=int, default=50)
    parser.add_argument(
        "--exclude", nargs="+", default=None, metavar="MEMBER", help="members left out (one member's share of the cost)"
    )
    parser.add_argument("--block", type=int, default=50, help="steps per block; a multiple of --every-n-steps")
    parser.add_argument("--blocks", type=int, default=24, help="blocks per round (half on, half off)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=6)
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--n-layers", type=int, default=4)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--logger", default="tensorboard", choices=["tensorboard", "csv"])
    args = parser.parse_args(argv)
    if args.block % args.every_n_steps:
        parser.error("--block must be a multiple of --every-n-steps (an on-block then holds whole cadences)")
    if args.blocks < 6 or args.blocks % 2:
        parser.error("--blocks must be even and at least 6")
    torch.set_num_threads(args.threads)
    results = [one_round(args, seed) for seed in range(args.rounds)]
    case = args.case + (f" without {', '.join(args.exclude)}" if args.exclude else "")
    print(
        f"\n{case} on/off in blocks of {args.block} steps, {args.blocks} blocks x "
        f"{args.rounds} rounds, every_n_steps {args.every_n_steps}, batch {args.batch_size}, d_model {args.d_model}, "
        f"{args.n_layers} layers, {args.threads} torch thread(s), {args.logger}, torch {torch.__version__}"
    )
    print(
        "| round | off: mean step (ms) | on: mean step (ms) | on - off (ms) | on / off | neighbouring pairs "
        "| garbage collector, off / on (ms per step) |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for i, r in enumerate(results):
        print(
            f"| {i + 1} | {r['off_ms']:.2f} | {r['on_ms']:.2f} | {r['on_ms'] - r['off_ms']:+.2f} | "
            f"{r['on_ms'] / r['off_ms']:.3f} | {r['pair_lo']:.3f}-{r['pair_hi']:.3f} (median {r['pair_median']:.3f}) "
            f"| {r['gc_off_ms']:.3f} / {r['gc_on_ms']:.3f} |"
        )
    on = statistics.fmean(r["on_ms"] for r in results)
    off = statistics.fmean(r["off_ms"] for r in results)
    print(f"| all | {off:.2f} | {on:.2f} | {on - off:+.2f} | {on / off:.3f} | |")


if __name__ == "__main__":
    main()
