"""What the step's one recording of the model calls costs (``lightning_tfdebug.core.calls.record_step``).

Usage::

    python benchmarks/recording.py --steps 400 --rounds 3 --batch-size 6

Trains the benchmark model of ``benchmarks/overhead.py`` (the bundled TinyGPT, 4 layers, ``d_model`` 128, one torch
thread) in one fit where every other step is recorded as the members record a step: a forward pre-hook and hook on
every module, the calls that take token ids kept (MaskProbe's, LossAtInit's and AttentionProbe's ``want``), read
before backward (the hooks go then) and let go after the step. Recorded and plain steps alternate, so both see the
same machine. Prints, per round, the mean step time of each (wall time from batch start to batch end, backward and
optimizer step included), their difference in milliseconds and ratio, and the bytes the recording holds from the
forward until it is let go (every distinct tensor storage among the kept calls' arguments and outputs; most are the
activations autograd keeps anyway, so this bounds the extra memory from above).

Members record only some steps (MaskProbe: 0 and its retries and order checks at 100, 200, 500; LossAtInit: 0, the
compared steps 10-40 and its check at 50, 75, 100; AttentionProbe, SpikeGuard and CheckpointAudit: the first batch):
about ten steps per fit, whatever its length.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import lightning.pytorch as pl
import torch

from lightning_tfdebug.core.calls import record_step
from lightning_tfdebug.demo import TinyGPT, TinyTextDataModule
from lightning_tfdebug.primitives.calls import takes_tokens


def held_bytes(calls: list[Any]) -> int:
    """Bytes of every distinct storage among the recorded calls' tensors (arguments and outputs)."""
    seen: dict[int, int] = {}
    for call in calls:
        for _, t in call.leaves():
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        out = call.output
        for t in out if isinstance(out, tuple) else (out,):
            if isinstance(t, torch.Tensor):
                seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())


class EveryOtherStep(pl.Callback):
    """Records the odd steps (from ``skip``) as a member does, and times every step from batch start to batch end."""

    def __init__(self, skip: int) -> None:
        self.skip = skip
        self.times: dict[bool, list[float]] = {True: [], False: []}
        self.bytes: list[int] = []
        self._recording: Any = None
        self._start = 0.0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._start = time.perf_counter()
        if trainer.global_step % 2 == 1:
            self._recording = record_step(trainer, pl_module, batch, self, takes_tokens)

    def on_before_backward(self, trainer, pl_module, loss):
        if self._recording is not None:
            calls = self._recording.calls()  # the first reader stops the hooks
            if trainer.global_step >= self.skip:
                self.bytes.append(held_bytes(calls))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        recorded = self._recording is not None
        if recorded:
            self._recording.done(self)
            self._recording = None
        if trainer.global_step > self.skip:  # global_step has moved on: this was step global_step - 1
            self.times[recorded].append(time.perf_counter() - self._start)


def one_round(args: argparse.Namespace) -> EveryOtherStep:
    clock = EveryOtherStep(args.skip)
    model = TinyGPT(d_model=args.d_model, n_layers=args.n_layers)
    trainer = pl.Trainer(
        max_steps=args.steps,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[clock],
    )
    trainer.fit(model, TinyTextDataModule(batch_size=args.batch_size))
    return clock


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--skip", type=int, default=20, help="steps dropped at the start of each round")
    parser.add_argument("--batch-size", type=int, default=6)
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--n-layers", type=int, default=4)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (pinned)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    pl.seed_everything(0, verbose=False)
    print("| round | plain ms | recorded ms | difference ms | ratio | bytes held while recorded |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in range(args.rounds):
        clock = one_round(args)
        plain = 1e3 * statistics.fmean(clock.times[False])
        recorded = 1e3 * statistics.fmean(clock.times[True])
        held = statistics.median(clock.bytes) if clock.bytes else 0
        row = (f"{plain:.2f}", f"{recorded:.2f}", f"{recorded - plain:+.2f}", f"{recorded / plain:.3f}", f"{held:,.0f}")
        print(f"| {r} | {' | '.join(row)} |")


if __name__ == "__main__":
    main()
