"""Step-time overhead of each callback against a plain run, all in one process.

Usage::

    python benchmarks/overhead.py --steps 200 --repeats 5
    python benchmarks/overhead.py --only "whole pack" "design card" --steps 300 --repeats 7

Every case trains the tiny transformer (4 layers, d_model 128 by default) for ``--steps`` optimizer steps, one torch
thread, ``log_every_n_steps=10`` (so the callbacks' default cadence measures every 10th step), a TensorBoard logger
(``--logger csv`` for the CSV logger of the tables before issue 25's fourth session). Each round runs every
case once, in a new random order, so slow phases of a noisy machine hit every case alike. A run's step time is the
**mean** over its steps, measuring steps included (the first ``--skip`` steps, compilation and allocator warm-up,
are dropped); the median would hide exactly the steps that cost. The table prints each case's mean step time
(median over rounds), its ratio to its baseline, and the range of the per-round ratios (each round's ratio taken
against the baseline run of the same round). The same three figures follow for the process's CPU time over the same
steps: on a shared machine a step's wall time also holds the moments another tenant had the core, which CPU time
leaves out, so the CPU columns resolve a smaller cost. The row of a callback that does nothing is the noise floor.

Later issues add their cases to ``CASES`` (one ``Case`` per row).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger

from lightning_tfdebug.demo import TinyGPT, TinyTextDataModule


@dataclass
class Case:
    """One row of the table.

    Attributes:
        name: row label.
        callbacks: builds the callbacks for one run (called once per repeat).
        baseline: name of the case this row's ratio is taken against.
        trainer_kwargs: extra ``Trainer`` arguments (precision plugins, clipping, ...).
        model_kwargs: extra ``TinyGPT`` arguments.
        prepare: called with the model before ``fit`` (to attach a third-party tool); may return a cleanup function.
    """

    name: str
    callbacks: Callable[[], list[pl.Callback]] = list
    baseline: str = "plain"
    trainer_kwargs: dict[str, Any] = field(default_factory=dict)
    model_kwargs: dict[str, Any] = field(default_factory=dict)
    prepare: Callable[[TinyGPT], Callable[[], None] | None] | None = None


class StepTimer(pl.Callback):
    """Wall time between consecutive batch starts (the whole step, data loading included), and the process's CPU time
    over the same span: on a shared machine a step's wall time also holds the time other tenants had the core, its CPU
    time does not (the data loads in this process: the demo's ``num_workers`` is 0)."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.cpu_times: list[float] = []
        self._last: tuple[float, float] | None = None

    def on_train_batch_start(self, *args: Any) -> None:
        now = (time.perf_counter(), time.process_time())
        if self._last is not None:
            self.times.append(now[0] - self._last[0])
            self.cpu_times.append(now[1] - self._last[1])
        self._last = now


class NoOp(pl.Callback):
    """A callback that does nothing: its row is the noise floor of the table (it should read 1.000)."""


class GradNormRecipe(pl.Callback):
    """What users write today: Lightning's ``grad_norm`` utility logged every step."""

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        from lightning.pytorch.utilities import grad_norm

        pl_module.log_dict(grad_norm(pl_module, norm_type=2))


def _gnm(**kw: Any) -> Callable[[], list[pl.Callback]]:
    def build() -> list[pl.Callback]:
        from lightning_tfdebug import GradNormMonitor

        return [GradNormMonitor(**kw)]

    return build


def _update_ratio(**kw: Any) -> Callable[[], list[pl.Callback]]:
    def build() -> list[pl.Callback]:
        from lightning_tfdebug import UpdateRatio

        return [UpdateRatio(**kw)]

    return build


def the_pack() -> list[pl.Callback]:
    """Every callback of the pack at its defaults (the pack's one list of members), as a user who turns them all on
    would."""
    from lightning_tfdebug.pack import MEMBERS

    return [cls() for cls in MEMBERS.values()]


def design_card() -> list[pl.Callback]:
    """The eight callbacks of the design card at their defaults."""
    import lightning_tfdebug as tfd

    return [
        tfd.GradNormMonitor(),
        tfd.UpdateRatio(),
        tfd.DeadActivation(),
        tfd.LossAtInit(),
        tfd.NaNFirstFrame(),
        tfd.ScalerWatch(),
        tfd.PerRankLogger(),
        tfd.ThroughputMonitor(),
    ]


def _tfdebug(preset: str) -> Callable[[], list[pl.Callback]]:
    def build() -> list[pl.Callback]:
        from lightning_tfdebug import TFDebug

        return [TFDebug(preset=preset, summary=False)]

    return build


CASES: list[Case] = [
    Case("plain"),
    Case("plain + a callback that does nothing (the noise floor)", lambda: [NoOp()]),
    # --- issue 14: the one entry ---
    Case("TFDebug(preset='always')", _tfdebug("always")),
    Case("TFDebug(preset='full')", _tfdebug("full")),
    # --- issue 13: the whole pack ---
    Case("whole pack (every callback, defaults)", the_pack),
    Case("design card (8 callbacks, defaults)", design_card),
    # --- issue 2: foundation ---
    Case("GradNormMonitor (default cadence)", _gnm()),
    Case("GradNormMonitor (every step)", _gnm(every_n_steps=1)),
    Case("grad_norm recipe (every step)", lambda: [GradNormRecipe()]),
    Case("UpdateRatio (default cadence)", _update_ratio()),
    Case("UpdateRatio (every step)", _update_ratio(every_n_steps=1)),
    # --- issue 3: numerics ---
    Case("NaNFirstFrame (lazy)", lambda: [__import__("lightning_tfdebug").NaNFirstFrame()]),
    Case("NaNFirstFrame (eager)", lambda: [__import__("lightning_tfdebug").NaNFirstFrame(mode="eager")]),
    Case(  # Hugging Face's hooks on every module; the cleanup removes them by identity (it keeps no handles)
        "HF DebugUnderflowOverflow",
        prepare=lambda model: (
            lambda debug: (
                lambda: [
                    module._forward_hooks.pop(key)
                    for module in model.modules()
                    for key, hook in list(module._forward_hooks.items())
                    if getattr(hook, "__self__", None) is debug
                ]
            )
        )(__import__("transformers.debug_utils", fromlist=["x"]).DebugUnderflowOverflow(model)),
    ),
    Case(
        "torch.autograd.detect_anomaly",
        prepare=lambda model: (
            torch.autograd.set_detect_anomaly(True),
            lambda: torch.autograd.set_detect_anomaly(False),
        )[1],
    ),
    # fp16 with a real GradScaler on CPU (Lightning turns precision="16-mixed" into bf16 there); one plugin per case
    Case(
        "plain (fp16)",
        trainer_kwargs={
            "plugins": [
                __import__("lightning.pytorch.plugins.precision", fromlist=["x"]).MixedPrecision(
                    "16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu")
                )
            ]
        },
    ),
    Case(
        "ScalerWatch (default cadence, fp16)",
        lambda: [__import__("lightning_tfdebug").ScalerWatch()],
        baseline="plain (fp16)",
        trainer_kwargs={
            "plugins": [
                __import__("lightning.pytorch.plugins.precision", fromlist=["x"]).MixedPrecision(
                    "16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu")
                )
            ]
        },
    ),
    Case(
        "ScalerWatch (every step, fp16)",
        lambda: [__import__("lightning_tfdebug").ScalerWatch(every_n_steps=1)],
        baseline="plain (fp16)",
        trainer_kwargs={
            "plugins": [
                __import__("lightning.pytorch.plugins.precision", fromlist=["x"]).MixedPrecision(
                    "16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu")
                )
            ]
        },
    ),
    # --- issue 4: activations and loss at init ---
    Case("DeadActivation (default cadence)", lambda: [__import__("lightning_tfdebug").DeadActivation()]),
    Case("DeadActivation (every step)", lambda: [__import__("lightning_tfdebug").DeadActivation(every_n_steps=1)]),
    Case("LossAtInit (default)", lambda: [__import__("lightning_tfdebug").LossAtInit()]),
    # --- issue 5: throughput and ranks ---
    Case("ThroughputMonitor (default cadence)", lambda: [__import__("lightning_tfdebug").ThroughputMonitor()]),
    Case(
        "ThroughputMonitor (every step)", lambda: [__import__("lightning_tfdebug").ThroughputMonitor(every_n_steps=1)]
    ),
    Case(
        "Lightning ThroughputMonitor",
        lambda: [
            __import__("lightning.pytorch.callbacks", fromlist=["ThroughputMonitor"]).ThroughputMonitor(
                batch_size_fn=lambda batch: batch["input_ids"].shape[0],
                length_fn=lambda batch: batch["input_ids"].shape[1],
            )
        ],
    ),
    Case("PerRankLogger (default cadence)", lambda: [__import__("lightning_tfdebug").PerRankLogger()]),
    Case("PerRankLogger (every step)", lambda: [__import__("lightning_tfdebug").PerRankLogger(every_n_steps=1)]),
    # --- issue 6: batches and repro ---
    Case("BatchGuard (values every step)", lambda: [__import__("lightning_tfdebug").BatchGuard()]),
    Case(
        "BatchGuard (values every 10 steps)",
        lambda: [__import__("lightning_tfdebug").BatchGuard(check_values_every_n_steps=10)],
    ),
    Case(
        "BatchGuard (structure only)",
        lambda: [__import__("lightning_tfdebug").BatchGuard(check_values_every_n_steps=10**9)],
    ),
    Case("ReproCapture (default)", lambda: [__import__("lightning_tfdebug").ReproCapture()]),
    # --- issue 46: a rank that hangs ---
    Case("StallWatchdog (default)", lambda: [__import__("lightning_tfdebug").StallWatchdog()]),
    # --- issue 7: masks, optimizer, checkpoints ---
    Case("MaskProbe (fit start only)", lambda: [__import__("lightning_tfdebug").MaskProbe()]),
    Case("OptimizerAudit (default cadence)", lambda: [__import__("lightning_tfdebug").OptimizerAudit()]),
    Case("OptimizerAudit (every step)", lambda: [__import__("lightning_tfdebug").OptimizerAudit(every_n_steps=1)]),
    Case(
        "plain + ModelCheckpoint (every 50 steps)",
        lambda: [
            __import__("lightning.pytorch.callbacks", fromlist=["x"]).ModelCheckpoint(
                dirpath=__import__("tempfile").mkdtemp(prefix="tfd-bench-"), every_n_train_steps=50, save_top_k=-1
            )
        ],
        trainer_kwargs={"enable_checkpointing": True},
    ),
    Case(
        "CheckpointAudit + ModelCheckpoint (every 50 steps)",
        lambda: [
            __import__("lightning_tfdebug").CheckpointAudit(),
            __import__("lightning.pytorch.callbacks", fromlist=["x"]).ModelCheckpoint(
                dirpath=__import__("tempfile").mkdtemp(prefix="tfd-bench-"), every_n_train_steps=50, save_top_k=-1
            ),
        ],
        baseline="plain + ModelCheckpoint (every 50 steps)",
        trainer_kwargs={"enable_checkpointing": True},
    ),
    # --- issue 47: out of memory ---
    Case("MemoryWatch (default cadence)", lambda: [__import__("lightning_tfdebug").MemoryWatch()]),
    Case("MemoryWatch (every step)", lambda: [__import__("lightning_tfdebug").MemoryWatch(every_n_steps=1)]),
    # --- issue 45: loss spikes (judged on every step; alone it reads its flag itself, in the pack NaNFirstFrame does)
    Case("SpikeGuard (default)", lambda: [__import__("lightning_tfdebug").SpikeGuard()]),
    Case(
        "NaNFirstFrame + SpikeGuard (the flag in one read)",
        lambda: [__import__("lightning_tfdebug").NaNFirstFrame(), __import__("lightning_tfdebug").SpikeGuard()],
    ),
    # --- issue 44: attention at init (step 0 only; TinyGPT's SDPA written out so that AttentionProbe reads it) ---
    Case("plain (hand-written attention)", prepare=lambda model: _hand_attention(model)),
    Case(
        "AttentionProbe (hand-written attention)",
        lambda: [__import__("lightning_tfdebug").AttentionProbe()],
        baseline="plain (hand-written attention)",
        prepare=lambda model: _hand_attention(model),
    ),
]


def _hand_attention(model: TinyGPT) -> None:
    """TinyGPT's attention as a softmax over scaled scores (the same math as its SDPA call), so that it can be read."""
    import math
    import types

    def forward(self: Any, x: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = (z.view(b, t, self.n_heads, c // self.n_heads).transpose(1, 2) for z in self.qkv(x).split(c, dim=2))
        allowed = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        if attention_mask is not None:
            allowed = (allowed & attention_mask.bool()[:, None, None, :]) | torch.eye(t, dtype=torch.bool)
        scores = (q @ k.transpose(-2, -1) / math.sqrt(c // self.n_heads)).masked_fill(~allowed, float("-inf"))
        return self.proj((scores.softmax(-1) @ v).transpose(1, 2).reshape(b, t, c))

    for module in model.modules():
        if hasattr(module, "qkv") and hasattr(module, "n_heads"):
            module.forward = types.MethodType(forward, module)


def run_case(case: Case, args: argparse.Namespace, log_dir: str) -> tuple[list[float], list[float]]:
    torch.manual_seed(0)
    model = TinyGPT(d_model=args.d_model, n_layers=args.n_layers, **case.model_kwargs)
    cleanup = case.prepare(model) if case.prepare else None
    timer = StepTimer()
    kwargs: dict[str, Any] = dict(
        accelerator=args.accelerator,
        devices=1,
        max_steps=args.steps,
        logger=(TensorBoardLogger if args.logger == "tensorboard" else CSVLogger)(log_dir, name="bench"),
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        log_every_n_steps=args.log_every_n_steps,
    )
    kwargs.update(case.trainer_kwargs)
    trainer = pl.Trainer(callbacks=[timer, *case.callbacks()], **kwargs)
    try:
        trainer.fit(model, TinyTextDataModule(batch_size=args.batch_size))
    finally:
        if cleanup:
            cleanup()
    return timer.times[args.skip :], timer.cpu_times[args.skip :]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=5, help="rounds; each runs every case once, random order")
    parser.add_argument("--skip", type=int, default=10, help="steps dropped at the start of each run")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--n-layers", type=int, default=4)
    parser.add_argument("--log-every-n-steps", type=int, default=10)
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (pinned)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the case order")
    parser.add_argument("--only", nargs="*", help="substrings: run only matching cases (and their baselines)")
    parser.add_argument("--log-dir", default="benchmarks/results")
    parser.add_argument(
        "--logger",
        default="tensorboard",
        choices=["tensorboard", "csv"],
        help="every case's logger (TensorBoard, the pack's own; CSV, the setting before issue 25's fourth session)",
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    cases = CASES
    if args.only:
        wanted = {c.name for c in CASES if any(s in c.name for s in args.only)}
        wanted |= {c.baseline for c in CASES if c.name in wanted}
        cases = [c for c in CASES if c.name in wanted]
    order = random.Random(args.seed)
    means: dict[str, list[float]] = {c.name: [] for c in cases}
    cpu_means: dict[str, list[float]] = {c.name: [] for c in cases}
    for _ in range(args.repeats):
        for case in order.sample(cases, len(cases)):
            times, cpu_times = run_case(case, args, args.log_dir)
            means[case.name].append(statistics.fmean(times))
            cpu_means[case.name].append(statistics.fmean(cpu_times))

    print(
        f"\n{args.steps} steps x {args.repeats} rounds (random order), batch {args.batch_size}, "
        f"d_model {args.d_model}, "
        f"{args.n_layers} layers, log_every_n_steps {args.log_every_n_steps}, {args.threads} torch thread(s), "
        f"{args.accelerator}, torch {torch.__version__}"
    )
    print(
        f"| {'case':<60} | {'mean step (ms)':>14} | {'ratio':>6} | {'per-round ratios':>16} "
        f"| {'CPU ms':>7} | {'CPU ratio':>9} | {'per-round':>11} |"
    )
    print(f"|{'-' * 62}|{'-' * 16}|{'-' * 8}|{'-' * 18}|{'-' * 9}|{'-' * 11}|{'-' * 13}|")
    for case in cases:
        cells = []
        for table in (means, cpu_means):
            mine, base = table[case.name], table[case.baseline]
            rounds = [m / b for m, b in zip(mine, base)]
            ratio = statistics.median(mine) / statistics.median(base)
            cells.append((statistics.median(mine) * 1e3, ratio, f"{min(rounds):.3f}-{max(rounds):.3f}"))
        (wall, ratio, spread), (cpu, cpu_ratio, cpu_spread) = cells
        print(
            f"| {case.name:<60} | {wall:>14.2f} | {ratio:>6.3f} | {spread:>16} "
            f"| {cpu:>7.2f} | {cpu_ratio:>9.3f} | {cpu_spread:>11} |"
        )


if __name__ == "__main__":
    main()
