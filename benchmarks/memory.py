"""Peak extra memory of the pack, of each preset and of each member alone, each configuration in its own process.

Usage::

    python benchmarks/memory.py                          # every configuration, at both model sizes
    python benchmarks/memory.py --quick                  # plain, the presets, UpdateRatio and PerRankLogger
    python benchmarks/memory.py --sizes large --configs plain "TFDebug()" UpdateRatio --repeats 3

Every configuration trains the tiny transformer (``small``: d_model 128, 4 layers, 0.9M parameters; ``large``:
d_model 512, 8 layers, 25.5M parameters, fp32 weights 102 MB) with AdamW for ``--steps`` optimizer steps at
``log_every_n_steps=10`` (the members' default cadence measures every 10th step), a CSV logger, one torch thread, in
a new Python process of its own, so one configuration's allocations cannot lower or raise another's peak. A process
reports its peak resident set (``resource.getrusage(RUSAGE_SELF).ru_maxrss``) and, on a GPU, the peak of
``torch.cuda.max_memory_allocated`` over ``fit``. The table gives each configuration's peak minus the plain run's (the
smallest of ``--repeats`` processes each, as allocator noise only ever adds), in MiB and in bytes per trainable
parameter, beside the budget a measuring step may add by default (``max(2% of the training state, 32 MiB)``, the
state being weights, gradients and AdamW's two moments: 16 bytes per parameter).

The batch is small (2 sequences of 64 tokens) on purpose: a peak is the largest moment of the run, and the members
allocate after the backward pass, when the activations are freed; with larger batches the activations' peak hides
what the members add, which then shows only once the model is large against its activations (as runs sized to their
device are). Peak RSS moves by a few MiB between identical processes (the allocator's arenas): differences under about
6 MiB are noise. The peak also counts what the allocator keeps after a free: temporaries of many different sizes
(one float64 copy per parameter tensor) leave holes that later ones do not fit, and the resident set grows by far
more than the largest of them. Run it with ``PYTHONPATH`` pointing at another checkout to measure that one
(``--label`` names it).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from typing import Any

SIZES: dict[str, dict[str, int]] = {
    "small": {"d_model": 128, "n_layers": 4, "n_heads": 4},
    "large": {"d_model": 512, "n_layers": 8, "n_heads": 8},
}
MEMBER_NAMES = (
    "ReproCapture",
    "BatchGuard",
    "MaskProbe",
    "LossAtInit",
    "NaNFirstFrame",
    "GradNormMonitor",
    "ScalerWatch",
    "UpdateRatio",
    "OptimizerAudit",
    "DeadActivation",
    "ThroughputMonitor",
    "PerRankLogger",
    "CheckpointAudit",
)
PRESETS = ("TFDebug()", 'TFDebug(preset="full")')
QUICK = ("plain", *PRESETS, "UpdateRatio", "PerRankLogger")
RESULT = "memory-result: "


def callbacks_of(config: str) -> list[Any]:
    """The callbacks of one configuration: none, a preset, or one member alone at its defaults."""
    import lightning_tfdebug as tfd

    if config == "plain":
        return []
    if config == "TFDebug()":
        return [tfd.TFDebug(summary=False)]
    if config == 'TFDebug(preset="full")':
        return [tfd.TFDebug(preset="full", summary=False)]
    return [getattr(tfd, config)()]


def child(config: str, size: str, steps: int, batch_size: int) -> dict[str, Any]:
    """Train once with ``config`` and return its peaks (run in a process of its own)."""
    import resource
    import warnings

    import lightning.pytorch as pl
    import torch
    from lightning.pytorch.loggers import CSVLogger

    from lightning_tfdebug.demo import TinyGPT, TinyTextDataModule

    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    pl.seed_everything(0, verbose=False)
    model = TinyGPT(**SIZES[size])
    data = TinyTextDataModule(batch_size=batch_size)
    cuda = torch.cuda.is_available()
    with tempfile.TemporaryDirectory() as root:
        trainer = pl.Trainer(
            accelerator="gpu" if cuda else "cpu",
            devices=1,
            max_steps=steps,
            log_every_n_steps=10,
            logger=CSVLogger(root, name="csv"),
            callbacks=callbacks_of(config),
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            limit_val_batches=0,
            default_root_dir=root,
        )
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        trainer.fit(model, data)
        cuda_peak = torch.cuda.max_memory_allocated() if cuda else None
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)
    params = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return {"rss": rss, "cuda": cuda_peak, "params": params}


def run(config: str, size: str, steps: int, batch_size: int) -> dict[str, Any]:
    command = [sys.executable, __file__, "--child", config, "--sizes", size, "--steps", str(steps)]
    command += ["--batch-size", str(batch_size)]
    done = subprocess.run(command, capture_output=True, text=True, env=os.environ.copy())
    if done.returncode:
        raise RuntimeError(f"{config} at {size} failed:\n{done.stderr[-3000:]}")
    [line] = [line for line in done.stdout.splitlines() if line.startswith(RESULT)]
    return json.loads(line[len(RESULT) :])


def mib(n: float) -> str:
    return f"{n / 2**20:+.1f}" if n else "0.0"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES))
    parser.add_argument("--configs", nargs="+", default=None, help="plain, presets, member names (default: all)")
    parser.add_argument("--quick", action="store_true", help=f"only {', '.join(QUICK)}")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=1, help="processes per configuration (the smallest peak wins)")
    parser.add_argument("--jobs", type=int, default=1, help="processes at a time")
    parser.add_argument("--label", default="", help="a name for the checkout measured, printed above the table")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        print(RESULT + json.dumps(child(args.child, args.sizes[0], args.steps, args.batch_size)), flush=True)
        return
    configs = list(args.configs or (QUICK if args.quick else ("plain", *PRESETS, *MEMBER_NAMES)))
    if "plain" not in configs:
        configs.insert(0, "plain")
    import lightning_tfdebug

    print(f"# {args.label or 'checkout'}: {os.path.dirname(lightning_tfdebug.__file__)}", flush=True)
    for size in args.sizes:
        jobs = [(c, size, args.steps, args.batch_size) for c in configs for _ in range(args.repeats)]
        with ThreadPoolExecutor(args.jobs) as pool:  # each job is a process of its own; its peak is its own
            results = list(pool.map(lambda job: run(*job), jobs))
        peaks = {c: [r for (name, *_), r in zip(jobs, results) if name == c] for c in configs}
        best = {c: min(runs, key=lambda r: r["rss"]) for c, runs in peaks.items()}
        plain, params = best["plain"], best["plain"]["params"]
        budget = max(0.02 * 16 * params, 32 * 2**20)
        gpu = plain["cuda"] is not None
        print(f"\n{size}: {params / 1e6:.2f}M parameters, default budget {budget / 2**20:.1f} MiB")
        print(
            "| configuration | peak RSS (MiB) | vs plain (MiB) | bytes/param |"
            + (" CUDA peak vs plain (MiB) |" if gpu else "")
        )
        print("| --- | --- | --- | --- |" + (" --- |" if gpu else ""))
        for config in configs:
            r = best[config]
            extra = r["rss"] - plain["rss"]
            spread = max(x["rss"] for x in peaks[config]) - r["rss"]
            row = f"| {config} | {r['rss'] / 2**20:,.0f}" + (f" (+{spread / 2**20:.0f})" if spread else "")
            row += f" | {mib(extra)} | {extra / params:+.2f} |"
            if gpu:
                row += f" {mib(r['cuda'] - plain['cuda'])} |"
            print(row, flush=True)


if __name__ == "__main__":
    main()
