"""ThroughputMonitor's token window: what it costs per micro-batch, against a ``torchmetrics.SumMetric``.

Usage::

    python benchmarks/count_window.py --updates 20000

1. Per micro-batch: ``CountWindow.add`` (an in-place ``add_`` into one float64 device scalar) against
   ``torchmetrics.SumMetric.update`` (float64, NaN check off: what the window used before issue 25); per measuring
   window: add + total for both. Mean time per call, one torch thread, the mask reduction that produces the count
   included in both (it is the same work).
2. Host syncs and collectives on a step that does not measure: counted by wrapping ``Tensor.item/tolist/cpu/
   __bool__`` and ``torch.distributed`` collectives during ``add``.
3. Cross-rank: collectives that torchmetrics' own ``sync()`` runs for one ``SumMetric`` (a 1-process gloo group),
   against the pack's one shared reduction per measuring step.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import torch
import torch.distributed as dist
from torchmetrics import SumMetric

from lightning_tfdebug.functional.throughput import CountWindow

SYNCS = ("item", "tolist", "cpu", "__bool__", "numpy")
COLLECTIVES = ("all_gather", "all_reduce", "all_gather_into_tensor", "broadcast", "barrier")


def per_call_us(fn, n: int) -> float:
    start = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - start) / n * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--updates", type=int, default=20000)
    parser.add_argument("--window", type=int, default=50, help="micro-batches per measuring window")
    args = parser.parse_args()
    torch.set_num_threads(1)
    mask = torch.ones(16, 256, dtype=torch.long)
    mask[:, 200:] = 0

    window = CountWindow()
    metric = SumMetric(nan_strategy="disable", sync_on_compute=False).set_dtype(torch.float64)
    add_new = per_call_us(lambda: window.add(mask.sum()), args.updates)
    add_old = per_call_us(lambda: metric.update(mask.sum()), args.updates)
    print(f"per micro-batch  CountWindow.add (in place) {add_new:7.2f} us   SumMetric.update {add_old:7.2f} us")
    window.total(torch.device("cpu"))
    metric.reset()

    def fill_new() -> torch.Tensor:
        for _ in range(args.window):
            window.add(mask.sum())
        return window.total(torch.device("cpu"))

    def fill_old() -> torch.Tensor:
        for _ in range(args.window):
            metric.update(mask.sum())
        total = metric.compute()
        metric.reset()
        return total

    reps = max(1, args.updates // args.window)
    new = per_call_us(fill_new, reps)
    old = per_call_us(fill_old, reps)
    print(f"per window of {args.window}: CountWindow add+total {new:8.1f} us   SumMetric update+compute {old:8.1f} us")
    assert fill_new().item() == fill_old().item()  # the same sum

    # 2. syncs and collectives in `add`
    calls: list[str] = []
    originals = {name: getattr(torch.Tensor, name) for name in SYNCS}
    dist_originals = {name: getattr(dist, name) for name in COLLECTIVES}

    def spy(name, fn):
        def wrapped(*a, **k):
            calls.append(name)
            return fn(*a, **k)

        return wrapped

    for name, fn in originals.items():
        setattr(torch.Tensor, name, spy(name, fn))
    for name, fn in dist_originals.items():
        setattr(dist, name, spy(name, fn))
    try:
        for _ in range(100):
            window.add(mask.sum())
    finally:
        for name, fn in originals.items():
            setattr(torch.Tensor, name, fn)
    print(f"host syncs or collectives in 100 CountWindow.add calls: {len(calls)} {sorted(set(calls))}")
    window.total(torch.device("cpu"))

    # 3. torchmetrics' own cross-rank sync
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", init_method=f"file://{os.path.join(tmp, 'pg')}", rank=0, world_size=1)
        try:
            metric = SumMetric(nan_strategy="disable").set_dtype(torch.float64)
            metric.update(mask.sum())
            calls.clear()
            metric.compute()  # sync_on_compute=True: torchmetrics gathers the state
            print(f"torchmetrics sync of one SumMetric: {len(calls)} collectives {calls}")
            print(
                "ThroughputMonitor's statistics travel in the pack's one shared reduction of a measuring step "
                "(core.reduction: one all_reduce for every member; torchmetrics' count above is per metric state)"
            )
        finally:
            for name, fn in dist_originals.items():
                setattr(dist, name, fn)
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
