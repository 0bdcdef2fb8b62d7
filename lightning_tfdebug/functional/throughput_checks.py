"""ThroughputMonitor's arithmetic and decisions, host numbers only: every rank's :class:`ThroughputRow` (from the
step's one reduction) to the logged keys (:func:`throughput_metrics`) and the findings (:class:`ThroughputDiagnosis`,
which keeps the streaks). Every rank holds the same rows, so every rank reaches the same verdicts.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from lightning_tfdebug.functional.evidence_chart import EvidenceChart
from lightning_tfdebug.functional.verdicts import Rule, Verdict
from lightning_tfdebug.primitives.keys import Key
from lightning_tfdebug.primitives.tracking import Streak

GIB = float(2**30)


@dataclass(frozen=True)
class ThroughputRow:
    """One rank's numbers of one measuring window, in the order its row travels in the step's reduction (NaN:
    unknown)."""

    tokens: float  # real (non-padding) tokens
    positions: float  # token positions computed (padding included)
    samples: float  # sequences
    wall_s: float  # wall time of the window
    wait_s: float  # time spent waiting for the next batch
    step_ms: float  # median step time over the last `window` steps
    baseline_ms: float  # median step time of the early window (nan: not complete yet)
    peak: float  # peak memory, bytes (CUDA: allocated; CPU: resident set)
    reserved: float  # memory now, bytes (CUDA: reserved; CPU: resident set)
    capacity: float  # the device's (CPU: the machine's) memory, bytes (0: unknown)
    new_graphs: float  # graphs torch.compile compiled since the early window ended (nan before)
    limit_hits: float  # torch.compile recompile-limit hits since training started
    trimmed_positions: float  # positions had each batch been padded only to its longest row (mask span x rows)
    contention_ratio: float  # (CPU + run-queue wait) per CPU second over the early windows' (nan: no /proc)
    cpu_ratio: float  # this process's CPU time per step over the early windows' (nan: unknown)
    mean_ratio: float  # mean wall time per step over the median's steps, over the early windows' (nan: unknown)
    reference_ratio: float  # a fixed CPU computation's time now over the early windows' (nan: not timed)
    parallel_ratio: float  # the same at the run's thread count, run-queue waits left in (nan: not timed)


MOST_PADDING = 0.5
"""``TFD602`` is a warning once padding is most of the computed positions (removing it at least doubles throughput)."""


def padding_speedups(tokens: float, positions: float, trimmed: float) -> dict[str, float]:
    """The factors by which fewer positions are computed with ``packing`` (positions / real tokens) and with
    ``trim_to_longest`` padding (positions / trimmed positions): the step's speed-up where its time scales with the
    positions (the matmuls do; attention grows faster)."""
    packing = positions / tokens if tokens > 0 else math.inf
    trim = positions / trimmed if 0 < trimmed <= positions else 1.0
    return {"packing": packing, "trim_to_longest": trim}


EXPLAINS = 0.5
"""The machine explains a slowdown when the same work slowed by at least this share of the step time's rise."""
OWN_WORK = 0.9
"""More work per step raises the CPU time per step as much as the step time (1.0); contention raises it less
(spinning threads: measured 0.4 to 0.75 of the rise)."""
OWN_UTILIZATION = 1.25
"""A run taking more than this factor of its early CPU per second slowed itself: a slower machine cannot give more."""


def contended(row: ThroughputRow, regression_factor: float) -> bool:
    """Whether a slow rank's slowdown is the machine's: the same work got slower by at least :data:`EXPLAINS` of the
    step time's rise, or, where the CPU time per step rose less than :data:`OWN_WORK` of it, of the rise per unit of
    CPU work. Never when the run took more CPU per second than early on (:data:`OWN_UTILIZATION`), unless the fixed
    computation at the run's thread count slowed by :data:`EXPLAINS` of the rise itself: threads spinning at a
    parallel region's barrier while a peer waits for a core burn CPU as more work would."""
    base, step = row.baseline_ms, row.step_ms
    if not (base > 0 and step / base > regression_factor):
        return False
    # the mean, like with like: the reference and the waits are means too (the median moves in steps under slicing)
    ratio = row.mean_ratio if row.mean_ratio == row.mean_ratio else step / base
    if row.parallel_ratio - 1.0 >= EXPLAINS * (ratio - 1.0):  # NaN (not timed): not known, not shown
        return True
    if row.cpu_ratio / ratio > OWN_UTILIZATION:
        return False
    own_work = row.cpu_ratio - 1.0 >= OWN_WORK * (ratio - 1.0)  # NaN: not known, not shown
    if own_work and row.contention_ratio != row.contention_ratio:
        return False  # without /proc the reference's wall time carries the scheduler's luck: more work is the run's
    # the machine's slowdown: the larger of the reference's and the contention ratio, the latter where the extra time
    # was spent runnable (CPU + run-queue wait per step), not asleep
    machine = row.reference_ratio
    runnable = row.cpu_ratio * row.contention_ratio - 1.0 >= EXPLAINS * (ratio - 1.0)
    if runnable and not machine >= row.contention_ratio:  # a NaN reference (not timed) too
        machine = row.contention_ratio
    if machine - 1.0 >= EXPLAINS * (ratio - 1.0):
        return True
    # no more work per step: the machine need only explain the rise per unit of CPU work (spinning threads inflate it)
    per_work = ratio / row.cpu_ratio if row.cpu_ratio > 0 else ratio
    return not own_work and machine - 1.0 >= EXPLAINS * (per_work - 1.0)


KEYS: tuple[Key, ...] = (
    Key(
        "throughput/tokens_per_sec",
        "non-padding tokens per second, summed over all ranks, since the last measurement",
        "tokens/s",
        "tokens per second",
    ),
    Key(
        "throughput/tokens_per_sec_per_device",
        "the same divided by the number of ranks",
        "tokens/s",
        "tokens per second",
    ),
    Key("throughput/samples_per_sec", "samples (sequences) per second over all ranks", "samples/s"),
    Key(
        "throughput/step_time_ms",
        "median optimizer-step time over the last `window` steps (slowest rank)",
        "ms",
        "step time (ms)",
    ),
    Key(
        "throughput/padding_frac",
        "share of computed token positions that were padding (all ranks)",
        chart="data wait and padding (fraction)",
    ),
    Key(
        "throughput/dataloader_wait_frac",
        "share of wall time spent waiting for the next batch (worst rank)",
        chart="data wait and padding (fraction)",
    ),
    Key(
        "throughput/mfu",
        "model FLOPs utilization; only when the peak FLOP/s is known (`peak_flops`, or looked up for a CUDA device)",
        chart="model FLOPs utilisation",
    ),
    Key("memory/peak_allocated_gib", "CUDA: peak allocated memory; CPU: peak resident set size (worst rank)", "GiB"),
    Key(
        "memory/reserved_gib",
        "CUDA: memory reserved by the caching allocator; CPU: resident set size now (worst rank)",
        "GiB",
    ),
)
"""ThroughputMonitor's logged keys, what :func:`throughput_metrics` returns."""


def throughput_metrics(
    rows: Sequence[ThroughputRow], flops_per_token: float | None = None, peak_flops: float | None = None
) -> dict[str, float]:
    """The logged ``throughput/*`` and ``memory/*`` keys from every rank's row (sums over ranks for work, the worst
    rank for times and memory). ``throughput/mfu`` only when both ``flops_per_token`` and ``peak_flops`` are known."""
    n = len(rows)
    wall = max(r.wall_s for r in rows)
    tokens_total = sum(r.tokens for r in rows)
    positions_total = sum(r.positions for r in rows)
    tokens_per_sec = tokens_total / wall
    metrics: dict[str, float] = {
        "throughput/tokens_per_sec": tokens_per_sec,
        "throughput/tokens_per_sec_per_device": tokens_per_sec / n,
        "throughput/samples_per_sec": sum(r.samples for r in rows) / wall,
        "throughput/step_time_ms": max(r.step_ms for r in rows),
        "throughput/padding_frac": 1.0 - tokens_total / positions_total if positions_total else 0.0,
        "throughput/dataloader_wait_frac": max(min(1.0, r.wait_s / r.wall_s) for r in rows),
        "memory/peak_allocated_gib": max(r.peak for r in rows) / GIB,
        "memory/reserved_gib": max(r.reserved for r in rows) / GIB,
    }
    if flops_per_token is not None and peak_flops:
        metrics["throughput/mfu"] = flops_per_token * (tokens_per_sec / n) / peak_flops
    return metrics


# ---------------------------------------------------------------------------------------------------- the rules
TFD602 = Rule(
    "TFD602",
    "info",
    "ThroughputMonitor",
    title="padding waste: padding above `padding_threshold` of the token positions, sustained (a warning above half)",
    headline="padding waste: {padding_frac:.0%} of token positions are padding",
    chart=EvidenceChart(
        "Which share of the token positions is padding?",
        "fraction of positions",
        logged=("throughput/padding_frac",),
    ),
    trigger=(
        "padding above `padding_threshold` of the computed token positions for `patience` measurements; a warning "
        "when padding is most (> 50%) of them, with the speed-up packing and dynamic padding would give"
    ),
    hint=(
        "Group sequences of similar length (length-bucketed sampler), pad to the batch maximum rather than a "
        "fixed length, or pack several sequences per row."
    ),
    reason="An observation of padding; a warning when padding is most of the computed positions (compute lost)",
    message=(
        "{padding_frac:.0%} of the token positions computed were padding (threshold {threshold:.0%}) for {patience} "
        "measurements in a row: packing or length-bucketing would compute {speedup_packing:.1f}x fewer positions"
        "{trim}{consequence}"
    ),
    details=(
        "When padding is above `padding_threshold` (default 0.3) of the computed token positions on `patience` "
        "(default 3) measurements. Info up to half of the positions; a warning once padding is most of them, because "
        "it is then the largest speed problem of the run: the step computes every position, so removing the padding "
        "multiplies real tokens per second by about `positions / real tokens`. The evidence states two factors: "
        "`speedup_packing` (how many times fewer positions packing or length-bucketing would compute) and "
        "`speedup_trim_to_longest` (padding each batch only to its longest sequence, from the span of mask columns "
        "that hold a real token, counted on the device per micro-batch). Both assume the step time scales with the "
        "positions computed, as a transformer's matmuls do; attention grows faster, so for long rows the gain is "
        "larger."
    ),
)


def padding_verdict(
    padding: float, rows: Sequence[ThroughputRow], threshold: float, patience: int, step: int | None = None
) -> Verdict:
    """``TFD602`` for a sustained ``padding`` share (the streak is the caller's): info, a warning above
    :data:`MOST_PADDING`, with the speed-ups packing and padding to the longest row would give."""
    tokens = sum(r.tokens for r in rows)
    positions = sum(r.positions for r in rows)
    trimmed = sum(r.trimmed_positions for r in rows)
    gain = padding_speedups(tokens, positions, trimmed)
    most = padding > MOST_PADDING
    trim = ""
    if gain["trim_to_longest"] >= 1.1:
        trim = (
            f"; padding each batch only to its longest sequence instead of a fixed length alone would compute "
            f"{gain['trim_to_longest']:.1f}x fewer"
        )
    evidence = {
        "padding_frac": padding,
        "speedup_packing": gain["packing"],
        "speedup_trim_to_longest": gain["trim_to_longest"],
        "tokens": tokens,
        "positions": positions,
    }
    consequence = (
        ", the largest speed-up available to this run (real tokens per second scale with it)." if most else "."
    )
    return TFD602.verdict(
        evidence,
        severity="warning" if most else "info",
        step=step,
        threshold=threshold,
        patience=patience,
        trim=trim,
        consequence=consequence,
    )


TFD604 = Rule(
    "TFD604",
    "info",
    "ThroughputMonitor",
    title="memory above `memory_threshold` of the device's (or machine's) capacity",
    trigger="peak memory above `memory_threshold` of the device's capacity (CPU: the machine's physical memory)",
    hint=(
        "Lower the micro-batch size and use gradient accumulation, enable activation checkpointing, use bf16 "
        "mixed precision, or shard parameters and optimizer state (FSDP)."
    ),
    reason="An observation: memory near capacity is a risk, not harm (caching allocators keep what they reserved)",
    message=(
        "Memory use reached {memory_frac:.0%} of capacity on rank {rank} (threshold {threshold:.0%}); the run is "
        "close to out-of-memory."
    ),
    details=(
        "When the peak memory is above `memory_threshold` (default 0.92) of the device's capacity (on CPU, the "
        "machine's physical memory)."
    ),
)


def memory_verdict(
    rows: Sequence[ThroughputRow], peak_allocated_gib: float, threshold: float, step: int | None = None
) -> Verdict | None:
    """``TFD604`` when the worst rank's peak (or reserved) memory exceeds ``threshold`` of its capacity."""
    fractions = [max(r.peak, r.reserved) / r.capacity for r in rows if r.capacity > 0]
    if not fractions or not max(fractions) > threshold:
        return None
    frac = max(fractions)
    evidence = {"memory_frac": frac, "peak_allocated_gib": peak_allocated_gib}
    return TFD604.verdict(evidence, step=step, rank=fractions.index(frac), threshold=threshold)


TFD605 = Rule(
    "TFD605",
    "info",
    "ThroughputMonitor",
    title="the step time regressed as for TFD603, but the machine got slower, not the run",
    trigger=(
        "as TFD603, but the same work got slower: the larger of the rise of this process's run-queue wait per CPU "
        "second (`/proc/self/task/*/schedstat`, where the extra time was spent runnable) and of a fixed reference "
        "computation's time explains half the step time's rise, or, where the run's CPU time per step rose by less "
        "than 0.9x as much, half its rise per CPU second of work. Never when the run takes 1.25x its early CPU per "
        "second, nor, without `/proc`, when its CPU time per step rose with its step time, unless the same fixed "
        "computation at the run's thread count (waits left in) slowed by half the step time's rise itself: threads "
        "spinning while a peer waits for a core burn CPU as more work would"
    ),
    hint=(
        "Timings from a shared machine are not comparable over time; for benchmarks, use an idle machine or "
        "compare ratios measured in the same period."
    ),
    reason="The slowdown is the machine's (other processes took the cores, or the same work takes longer)",
    message=(
        "The median step time rose to {ratio_to_early:.2f}x the early steps' median while {cause}, so this is not "
        "reported as a slowdown of the run itself (TFD603)."
    ),
    details=(
        "The step time regressed as for TFD603, and the machine explains it, read over the same steps from: the "
        "contention ratio (this process's threads' CPU time plus run-queue wait, `/proc/self/task/*/schedstat`, per "
        "CPU second, against the early window's; it counts only where the extra step time was spent runnable, CPU "
        "time plus run-queue wait per step having risen by at least half as much); the CPU time per step "
        "(`time.process_time`); a reference computation (rounds of two 192 x 192 float32 matrix products on one torch"
        " thread for 20 ms, on the early window's measuring steps and again on a slow one, never on other steps, its "
        "run-queue wait taken off where `/proc` exists); and a parallel reference (the same rounds at the run's torch"
        " thread count, waits left in). The machine's slowdown is the larger of the contention ratio and the "
        "reference ratio; it explains the streak when it is at least half the mean step time's rise, or, where the "
        "run's CPU time per step rose by less than 0.9x as much as its step time, half the rise per unit of CPU work "
        "(step-time ratio over CPU-time ratio). A parallel reference that slowed by at least half the mean step "
        "time's rise explains it by itself (beside other jobs' multi-threaded torch processes: a T5 run 8.5x slower "
        "read 24x to 56x there, while the one-thread signals read 1.0x to 1.2x)."
    ),
)


def contended_verdict(ratio: float, row: ThroughputRow, step: int | None = None) -> Verdict:
    """``TFD605``: the slow streak's numbers, from the slow rank's row, and why they point at the machine."""
    evidence = {"ratio_to_early": ratio, **load_evidence(row)}
    parts = []
    if row.contention_ratio == row.contention_ratio:
        parts.append(f"this process waited {row.contention_ratio:.2f}x as long for a CPU core per second of work")
    if row.reference_ratio == row.reference_ratio:
        parts.append(f"a fixed reference computation ran {row.reference_ratio:.2f}x slower")
    if row.parallel_ratio == row.parallel_ratio:
        parts.append(f"{row.parallel_ratio:.2f}x slower at the run's thread count")
    cause = " and ".join(parts) + " than on the early steps: the machine itself got slower (other processes, steal)"
    return TFD605.verdict(evidence, step=step, cause=cause)


def load_evidence(row: ThroughputRow) -> dict[str, float]:
    """The readings that tell the machine's slowdown from the run's, as a finding's evidence (NaN: not measured)."""
    return {
        "contention_ratio": row.contention_ratio,
        "cpu_ratio": row.cpu_ratio,
        "reference_ratio": row.reference_ratio,
        "parallel_ratio": row.parallel_ratio,
    }


TFD607 = Rule(
    "TFD607",
    "warning",
    "ThroughputMonitor",
    title="`torch.compile` hit its recompile limit during training: that code now runs uncompiled",
    headline="torch.compile hit its recompile limit {limit_hits:.0f} times: that code runs uncompiled",
    trigger="`torch.compile` hit its recompile limit during training, so that code runs uncompiled",
    hint=(
        'Find what forces the recompilations (TORCH_LOGS="recompiles"): usually changing input shapes or Python '
        "values; pad to fixed buckets, mark dimensions dynamic, or raise torch._dynamo.config.recompile_limit "
        "only if the variants are few and worth compiling."
    ),
    reason="Measured: the code that hit the limit now runs uncompiled, slower than configured",
    message=(
        "torch.compile hit its recompile limit {limit_hits:.0f} time(s) during training: the code it gave up on now "
        "runs uncompiled, silently slower."
    ),
    details=(
        "When TorchDynamo's counters show a recompile-limit hit during training, after which that code runs uncompiled."
    ),
)


def compile_limit_verdict(rows: Sequence[ThroughputRow], step: int | None = None) -> Verdict | None:
    """``TFD607`` once any rank's ``torch.compile`` hit its recompile limit during training."""
    hits = max((r.limit_hits for r in rows if r.limit_hits == r.limit_hits), default=0.0)
    return TFD607.verdict({"limit_hits": hits}, step=step) if hits > 0 else None


TFD601 = Rule(
    "TFD601",
    "warning",
    "ThroughputMonitor",
    title="data-loading bound: the wait for the next batch above `wait_threshold` of wall time, sustained",
    headline="data-loading bound: the wait for batches is {dataloader_wait_frac:.0%} of wall time",
    chart=EvidenceChart(
        "Which share of the wall time waits for the next batch?",
        "fraction of wall time",
        logged=("throughput/dataloader_wait_frac",),
    ),
    trigger="the wait for the next batch above `wait_threshold` of wall time (worst rank) for `patience` measurements",
    hint=(
        "Raise DataLoader(num_workers=...), use pin_memory=True and persistent_workers=True, raise "
        "prefetch_factor, and move tokenization or heavy transforms out of __getitem__ (pre-tokenize)."
    ),
    reason="Measured: the run waits for data a large share of its time, compute paid for and idle",
    message=(
        "Training is data-loading bound: {dataloader_wait_frac:.0%} of wall time went to waiting for the next batch "
        "(threshold {threshold:.0%}) for {patience} measurements in a row."
    ),
    details=(
        "When the wait for the next batch is above `wait_threshold` (default 0.2) of wall time on the worst rank, on "
        "`patience` (default 3) measurements in a row."
    ),
)


TFD603 = Rule(
    "TFD603",
    "warning",
    "ThroughputMonitor",
    title="the median step time regressed to more than `regression_factor` x the early window, sustained",
    headline="step time regressed to {step_time_ms:.1f} ms, {ratio_to_early:.2f}x the early window",
    chart=EvidenceChart("Did the step time grow?", "ms", logged=("throughput/step_time_ms",)),
    trigger=(
        "the median and the mean step time over the last `window` steps above `regression_factor` x the early "
        "window's (after `skip_steps`, over `baseline_steps`), for `patience` measurements in a row that the "
        "machine does not explain (TFD605)"
    ),
    hint=(
        "Look for growth over time: a Python list or tensor kept across steps (retained graph, metrics "
        "accumulated with .append), rising sequence lengths, memory fragmentation, thermal throttling, or other "
        "jobs on the machine. Run with profile_steps=[a, b] early and late, and compare the tables."
    ),
    reason="Measured, sustained: the step time regressed against the run's own early steps",
    message=(
        "The median step time rose to {step_time_ms:.1f} ms, {ratio_to_early:.2f}x the early steps' median, for "
        "{patience} measurements in a row."
    ),
    details=(
        "The early window is `baseline_steps` (default 20) optimizer steps after the first `skip_steps` (default 5). "
        "TFD603 when both the median and the mean step time over the last `window` (default 50) steps are above "
        "`regression_factor` (default 1.5) times the early window's, on `patience` (default 3) measurements in a row,"
        " none of them explained by the machine (TFD605). The mean guards against a median that moves on its own on a"
        " time-sliced machine. Two guards keep a run's own slowdown TFD603 even when the machine is busy: the run "
        "takes more than 1.25x its early CPU per second of wall time (its own threads took the cores), or, without "
        "`/proc`, its CPU time per step rose as much as its step time. The early timings are saved with the "
        "callback's state, so a run resumed on a slower machine is recognised as the machine's."
    ),
)


TFD606 = Rule(
    "TFD606",
    "warning",
    "ThroughputMonitor",
    title="`torch.compile` keeps compiling new graphs after the early window, at each of `patience` measurements",
    headline="torch.compile keeps compiling: {new_graphs:.0f} new graphs after the early window",
    trigger="`torch.compile` compiled new graphs (TorchDynamo's counters) at each of `patience` measurements",
    hint=(
        "A guard of the compiled code changes every step: input shapes (pad to a few bucket lengths or let shapes "
        "be dynamic) or Python values passed in (the step number, a float, a dict with new keys). "
        'TORCH_LOGS="recompiles" prints the failing guard.'
    ),
    reason="Measured: recompiling keeps costing time after the early window",
    message=(
        "torch.compile is still compiling after the early window: {new_graphs:.0f} new graph(s) since then, more at "
        "each of the last {patience} measurements. Every recompilation stalls training."
    ),
    details=(
        "On measuring steps, TorchDynamo's own counters are read (host-side; nothing imported when nothing was "
        "compiled; process-wide, so only changes since this fit started count): TFD606 when new graphs were compiled "
        "after the early window at each of `patience` (default 3) measurements in a row."
    ),
)


@dataclass
class ThroughputDiagnosis:
    """The findings of ThroughputMonitor, measurement after measurement (``TFD601``-``TFD607``).

    ``TFD601``/``TFD602``/``TFD603``/``TFD606`` need ``patience`` measurements in a row; ``TFD605`` replaces
    ``TFD603`` when the machine explains the slow streak (:func:`contended`).
    """

    wait_threshold: float = 0.2
    padding_threshold: float = 0.3
    regression_factor: float = 1.5
    memory_threshold: float = 0.92
    patience: int = 3
    streaks: Streak = field(default_factory=Streak)
    contended_row: ThroughputRow | None = None  # the slow rank's row when the current streak was last contended
    graphs_prev: float = math.nan

    def _sustained(self, key: str, condition: bool) -> bool:
        return self.streaks.update(key, condition) >= self.patience

    def update(
        self, metrics: dict[str, float], rows: Sequence[ThroughputRow], step: int | None = None
    ) -> list[Verdict]:
        """The verdicts of one measurement (``metrics`` from :func:`throughput_metrics`, every rank's ``rows``)."""
        wait = metrics["throughput/dataloader_wait_frac"]
        out: list[Verdict | None] = []
        if self._sustained("wait", wait > self.wait_threshold):
            worst = max(range(len(rows)), key=lambda r: rows[r].wait_s / rows[r].wall_s)
            evidence = {
                "dataloader_wait_frac": wait,
                "worst_rank": worst,
                "tokens_per_sec": metrics["throughput/tokens_per_sec"],
            }
            out.append(TFD601.verdict(evidence, step=step, threshold=self.wait_threshold, patience=self.patience))
        padding = metrics["throughput/padding_frac"]
        if self._sustained("padding", padding > self.padding_threshold):
            out.append(padding_verdict(padding, rows, self.padding_threshold, self.patience, step))
        out.append(self._regression(metrics, rows, step))
        out.append(self._recompiling(rows, step))
        out.append(compile_limit_verdict(rows, step))
        out.append(memory_verdict(rows, metrics["memory/peak_allocated_gib"], self.memory_threshold, step))
        return [v for v in out if v is not None]

    def _regression(self, metrics: dict[str, float], rows: Sequence[ThroughputRow], step: int | None) -> Verdict | None:
        """``TFD603``, or ``TFD605`` when a measurement of the slow streak was contended (:func:`contended`)."""
        ratios = [r.step_ms / r.baseline_ms for r in rows if r.baseline_ms > 0]
        # a slowdown is lost time: the mean step time over the same steps must have risen too (NaN: not measured);
        # under time slicing the median alone moves when the steps split into slow and fast ones
        slow = [
            r
            for r in rows
            if r.baseline_ms > 0
            and r.step_ms / r.baseline_ms > self.regression_factor
            and not r.mean_ratio <= self.regression_factor
        ]
        ratio = max(ratios) if slow else math.nan
        is_contended = bool(slow) and all(contended(r, self.regression_factor) for r in slow)
        # TFD603 needs `patience` slow, uncontended measurements in a row; a streak contended at some point is TFD605
        regressed = self._sustained("regression", bool(slow) and not is_contended)
        slow_any = self._sustained("regression_any", bool(slow))
        if is_contended:
            self.contended_row = max(slow, key=lambda r: r.step_ms / r.baseline_ms)
        elif not slow:
            self.contended_row = None
        if slow_any and not regressed and self.contended_row is not None:
            return contended_verdict(ratio, self.contended_row, step)
        if not regressed:
            return None
        worst = max(slow, key=lambda r: r.step_ms / r.baseline_ms)
        evidence = {"step_time_ms": metrics["throughput/step_time_ms"], "ratio_to_early": ratio, **load_evidence(worst)}
        return TFD603.verdict(evidence, step=step, patience=self.patience)

    def _recompiling(self, rows: Sequence[ThroughputRow], step: int | None) -> Verdict | None:
        """``TFD606`` when ``torch.compile`` compiled new graphs at each of ``patience`` measurements in a row."""
        new = max((r.new_graphs for r in rows if r.new_graphs == r.new_graphs), default=math.nan)
        growing = new == new and self.graphs_prev == self.graphs_prev and new > self.graphs_prev
        if new == new:
            self.graphs_prev = new
        if not self._sustained("recompiling", growing):
            return None
        return TFD606.verdict({"new_graphs": new}, step=step, patience=self.patience)

    def state_dict(self) -> dict[str, Any]:
        return self.streaks.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.streaks.load_state_dict(state)


BLOCK = ("TFD601", "TFD619")
"""The codes reserved for ThroughputMonitor's rules."""

RULES: tuple[Rule, ...] = (TFD601, TFD602, TFD603, TFD604, TFD605, TFD606, TFD607)
"""The rules decided in this module, in code order."""


COVERAGE: dict[str, tuple[str, ...]] = {
    "throughput": (
        "TFD601",
        "TFD602",
        "TFD603",
        "TFD604",
        "TFD605",
        "TFD606",
        "TFD607",
    ),
}
"""The rows of the run's Coverage table these rules answer: the check -> the codes that decide it."""
