"""Host time the pack spends in its own hooks, per step, member by member (issue 25).

Usage::

    python benchmarks/hook_cost.py --steps 200 --preset always

Trains the benchmark model of ``benchmarks/overhead.py`` (4 layers, d_model 128, batch 16, one torch thread) under
``TFDebug(preset=...)`` and times, with ``time.perf_counter``, every member hook the pack calls and the pack's
shared reduction. Prints the mean milliseconds per step of each member (and in all), separately for the steps that
measure (``global_step % every_n_steps == 0``) and the steps that do not; the first ``--skip`` steps are left out.
A fixed cost is reported in milliseconds per step: the ratio of ``benchmarks/overhead.py`` depends on how long the
step is, this does not.
"""

from __future__ import annotations

import argparse
import functools
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch

from lightning_tfdebug import TFDebug
from lightning_tfdebug.core.guard import BATCH_HOOKS
from lightning_tfdebug.demo import TinyGPT, TinyTextDataModule
from lightning_tfdebug.pack import _overridden

KERNEL_ROW = "  of which: the fused gradient check (one pass over every gradient)"


class HookClock(pl.Callback):
    """Wraps, at set-up, every member hook of the pack (and its reduction) with a timer."""

    def __init__(self, pack: TFDebug, every_n_steps: int, by_hook: bool = False) -> None:
        self.pack = pack
        self.every = every_n_steps
        self.by_hook = by_hook  # one row per member and hook instead of one per member
        self.step = -1
        self.seconds: dict[tuple[int, str], float] = defaultdict(float)  # (step, member) -> seconds

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        pack = self.pack
        for hook, methods in pack._hooks.items():
            pack._hooks[hook] = tuple(self._timed(hook, m) for m in methods)
        # the per-batch hooks are looked up on the members when the pack builds its per-step tables (first batch)
        for member in pack.running.values():
            for hook in BATCH_HOOKS:
                if _overridden(member, hook):
                    setattr(member, hook, self._timed(hook, getattr(member, hook)))
        reduction = pack._reduction
        reduction.run = self._timed("reduction", reduction.run, owner="(shared reduction)")
        # the members' scalars, written to the loggers at the end of each hook call the pack forwards
        sink = pack._scalars
        sink.flush = self._timed("scalars", sink.flush, owner="(scalars written to the loggers)")
        # DeadActivation's forward hooks (measuring steps) run inside the forward, not in a Lightning hook: their
        # statistics, where nearly all their time goes, are timed through the method they call (restored in teardown)
        from lightning_tfdebug.functional.activations import LayerCounts

        self._add = LayerCounts.add
        if "DeadActivation" in pack.running:
            LayerCounts.add = self._timed("forward", self._add, owner="DeadActivation (forward hooks)")
        # the one pass over the gradients that must run on every step (device work on a GPU, host work here): timed
        # apart, inside NaNFirstFrame's row, so the host time around it can be read on its own
        from lightning_tfdebug.functional import finite  # NaNFirstFrame's StepFinite calls it from there

        self._flag = finite.grads_nonfinite_flag
        finite.grads_nonfinite_flag = self._timed("check", self._flag, owner=KERNEL_ROW)

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        from lightning_tfdebug.functional import finite
        from lightning_tfdebug.functional.activations import LayerCounts

        finite.grads_nonfinite_flag = self._flag
        LayerCounts.add = self._add

    def _timed(self, hook: str, method: Callable[..., Any], owner: str | None = None) -> Callable[..., Any]:
        name = owner or type(getattr(method, "__self__", method)).__name__
        if self.by_hook and owner is None:
            name = f"{name}.{hook}"

        @functools.wraps(method)
        def timed(*args: Any, **kwargs: Any) -> Any:
            if hook == "on_train_batch_start" and args:
                self.step = args[0].global_step
            start = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                self.seconds[(self.step, name)] += time.perf_counter() - start

        return timed


def _logger(kind: str, root: str) -> Any:
    """The Trainer's logger: TensorBoard (the pack's own, and the default), CSV, or none."""
    from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger

    if kind == "none":
        return False
    return TensorBoardLogger(root, name="bench") if kind == "tensorboard" else CSVLogger(root, name="bench")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--skip", type=int, default=10)
    parser.add_argument("--preset", default="always", choices=["always", "full"])
    parser.add_argument("--every-n-steps", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--n-layers", type=int, default=4)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--by-hook", action="store_true", help="one row per member and hook")
    parser.add_argument(
        "--logger", default="tensorboard", choices=["tensorboard", "csv", "none"], help="where the scalars go"
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    pack = TFDebug(preset=args.preset, every_n_steps=args.every_n_steps, summary=False, dashboard=False)
    clock = HookClock(pack, args.every_n_steps, by_hook=args.by_hook)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=args.steps,
        callbacks=[pack, clock],
        logger=_logger(args.logger, "/tmp/tfdebug-hook-cost"),
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        log_every_n_steps=args.every_n_steps,
        default_root_dir="/tmp/tfdebug-hook-cost",
    )
    model = TinyGPT(d_model=args.d_model, n_layers=args.n_layers, n_heads=4)
    trainer.fit(model, TinyTextDataModule(batch_size=args.batch_size))
    steps = range(args.skip, args.steps)
    measuring = [s for s in steps if s % args.every_n_steps == 0]
    other = [s for s in steps if s % args.every_n_steps]
    members = sorted({m for _, m in clock.seconds})
    rows = []
    for member in members:
        on = sum(clock.seconds.get((s, member), 0.0) for s in measuring) / max(1, len(measuring)) * 1e3
        off = sum(clock.seconds.get((s, member), 0.0) for s in other) / max(1, len(other)) * 1e3
        rows.append((member, on, off))
    rows.sort(key=lambda r: -r[2])
    print(f"TFDebug(preset={args.preset!r}), every_n_steps={args.every_n_steps}: host ms per step in the pack's hooks")
    width = max(22, *(len(r[0]) for r in rows))
    print(f"{'member':<{width}} {'measuring step':>15} {'other step':>11}")
    for member, on, off in rows:
        if on >= 0.0005 or off >= 0.0005:
            print(f"{member:<{width}} {on:>15.3f} {off:>11.3f}")
    total_on = sum(r[1] for r in rows if r[0] != KERNEL_ROW)  # the kernel's time is inside NaNFirstFrame's row
    total_off = sum(r[2] for r in rows if r[0] != KERNEL_ROW)
    mean = (total_on * len(measuring) + total_off * len(other)) / max(1, len(measuring) + len(other))
    print(f"{'all':<{width}} {total_on:>15.3f} {total_off:>11.3f}   mean over steps: {mean:.3f} ms")
    kernel = next((r for r in rows if r[0] == KERNEL_ROW), None)
    if kernel is not None:
        print(f"{'all but the gradient check':<{width}} {total_on - kernel[1]:>15.3f} {total_off - kernel[2]:>11.3f}")


if __name__ == "__main__":
    main()
