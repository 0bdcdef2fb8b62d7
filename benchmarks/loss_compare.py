"""The cost of one LossAtInit compared step and of one family-and-floor fit (docs/callbacks/loss_at_init.md, "Cost").

A compared step scores the sampled rows of the logits at every temperature and soft-cap of the grids, a sigmoid and the
rows' range (:func:`~lightning_tfdebug.functional.loss.loss_transform_sums`, on the device, no host sync); the fit runs
on the host over the kept readings (:func:`~lightning_tfdebug.callbacks.loss_at_init.check.comparison_verdicts`).

    python benchmarks/loss_compare.py [--rows 768 --vocab 259] [--repeats 20] [--device cpu]

Prints the mean wall time of each (the device synchronised around each repeat), and the peak extra memory of the sums
on CUDA (``torch.cuda.max_memory_allocated``) or the size of their largest temporaries on the CPU.
"""

from __future__ import annotations

import argparse
import math
import time

import torch

from lightning_tfdebug.callbacks.loss_at_init.check import comparison_verdicts
from lightning_tfdebug.callbacks.loss_at_init.phases import READINGS, LossRun
from lightning_tfdebug.callbacks.loss_at_init.readings import LossSums, loss_reading
from lightning_tfdebug.functional.loss import TRANSFORM_SUMS, loss_transform_sums


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=768, help="label positions in the batch (default 6 x 128)")
    parser.add_argument("--vocab", type=int, default=259)
    parser.add_argument("--max-rows", type=int, default=2048, help="LossAtInit's max_rows")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    torch.set_num_threads(1)
    device = torch.device(args.device)
    g = torch.Generator().manual_seed(0)
    labels = torch.randint(0, args.vocab, (1, args.rows), generator=g).to(device)
    logits = (torch.randn(1, args.rows, args.vocab, generator=g) * 2.0).to(device)

    def sums() -> dict[str, torch.Tensor]:
        return loss_transform_sums(logits, labels, shift_labels=True, max_rows=args.max_rows, both_alignments=True)

    sums()  # warm-up
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    start = time.perf_counter()
    for _ in range(args.repeats):
        taken = sums()
        if device.type == "cuda":
            torch.cuda.synchronize()
    step_ms = (time.perf_counter() - start) / args.repeats * 1e3
    rows = min(args.rows - 1, args.max_rows)
    if device.type == "cuda":
        extra = torch.cuda.max_memory_allocated() - base
    else:  # the sampled rows, their log-probabilities and one chunk's transform at a time
        extra = (2 * rows * args.vocab + min(rows * args.vocab, 1 << 24)) * 4
    host = LossSums.from_host({k: float(taken[k]) for k in TRANSFORM_SUMS})
    run = LossRun(check_step=None, check_at=None, vocab=args.vocab)
    for k in range(READINGS):  # the most readings a run keeps
        run.add_reading(loss_reading(host, 1.2 * host.tx_ce_sum / host.tx_count, 10 * (k + 1)))
    start = time.perf_counter()
    fits = 200
    for _ in range(fits):
        comparison_verdicts(run, args.vocab, math.nan)
    fit_ms = (time.perf_counter() - start) / fits * 1e3
    print(
        f"{args.device}, {rows} rows x V={args.vocab}: a compared step's sums {step_ms:.1f} ms, "
        f"{extra / 2**20:.1f} MiB extra at peak; the family and floor fit over {READINGS} readings {fit_ms:.2f} ms"
    )


if __name__ == "__main__":
    main()
