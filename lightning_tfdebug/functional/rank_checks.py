"""PerRankLogger's arithmetic and rules ``TFD501``-``TFD505``: from every rank's :class:`RankRow` (reduced over
ranks, so every rank reaches the same verdicts) to the logged spreads and the findings. Host numbers only."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from lightning_tfdebug.functional.evidence_chart import EvidenceChart
from lightning_tfdebug.functional.throughput import (
    differing_ranks,
    loss_outliers,
    max_over_median,
    median_of_others,
)
from lightning_tfdebug.functional.verdicts import Rule, Verdict
from lightning_tfdebug.primitives.keys import Key
from lightning_tfdebug.primitives.tracking import Streak


@dataclass(frozen=True)
class RankRow:
    """One rank's numbers of one measuring step: its row in the step's reduction over ranks, in this order."""

    loss: float  # mean training loss of the rank's micro-batches (nan without a loss)
    has_loss: float  # 1.0 when the training step returned a loss, else 0.0
    step_time_ms: float  # wall time of the optimizer step, data loading excluded
    busy_ms: float  # the step outside backward passes
    dataloader_wait_ms: float  # getting the step's batches onto the device
    peak_memory_gib: float  # CUDA: peak allocated; CPU: peak resident set size
    fingerprint: float  # hash of the step's input ids (-1.0: no ids)
    checksum: float  # position-weighted total of the parameter and buffer checksums


LOGGED: tuple[str, ...] = ("loss", "step_time_ms", "busy_ms", "dataloader_wait_ms", "peak_memory_gib")
CHECKSUM_RTOL = 1e-6
#: Two primes below 2**16: a value's bucket is sent modulo each, so the sums over ranks stay exact in float64.
_PRIMES = (65521.0, 65519.0)
_SPECIAL = 1e10  # bucket codes of zero, nan, +inf and -inf: far from any bucket of a finite non-zero value
_LOSS_HINT = (
    "computes its loss differently (rank-dependent code in training_step), or runs different weights (see TFD502). "
    "Compare the ranks' files in tfdebug/."
)


def agreement_sums(values: Tensor, rtol: float = CHECKSUM_RTOL) -> Tensor:
    """Eight numbers per value whose sums over the ranks tell whether every rank holds the same value within about
    ``rtol`` (:func:`disagreeing`): a fixed payload whatever the world size. Device work, no host sync.

    Each value gets a bucket on a logarithmic grid of relative width ``log1p(rtol)`` and on the same grid shifted by
    half a bucket (sign, zero, nan and infinities have their own). Per grid and prime it sends ``h = bucket mod p``
    and ``h**2``: every rank holds the same ``h`` exactly when ``world * sum(h**2) == sum(h)**2`` (Cauchy-Schwarz).
    """
    x = values.detach().double().reshape(-1)
    u = torch.log(x.abs().clamp_min(1e-300)) / math.log1p(rtol)
    special = torch.full_like(x, _SPECIAL)
    special = torch.where(x.isnan(), special + 1, special)
    special = torch.where(x == math.inf, special + 2, special)
    special = torch.where(x == -math.inf, special + 3, special)
    plain = x.isfinite() & (x.abs() >= 1e-18)
    codes = []
    for shift in (0.0, 0.5):
        bucket = torch.where(plain, 2 * torch.floor(u + shift) + (x < 0).double(), special)
        for prime in _PRIMES:
            h = torch.remainder(bucket, prime)
            codes += [h, h * h]
    return torch.stack(codes, dim=1).reshape(-1)


def disagreeing(sums: Sequence[float], world: int) -> list[bool]:
    """From the sums over ``world`` ranks of :func:`agreement_sums`, per value: True when the ranks disagree (Python
    integers: exact however large ``sum(h)**2`` grows)."""
    sums = list(sums)
    # per value, grid and prime: every rank sent the same h exactly when world * sum(h**2) == sum(h)**2
    same = [world * int(squares) == int(total) ** 2 for total, squares in zip(sums[0::2], sums[1::2])]
    # the ranks agree when both primes agree on either grid
    return [not ((a and b) or (c and d)) for a, b, c, d in zip(same[0::4], same[1::4], same[2::4], same[3::4])]


def disagreeing_tensors(sums: Sequence[float], world: int, names: Sequence[str]) -> list[str]:
    """Names of the tensors whose checksums (:func:`~lightning_tfdebug.functional.throughput.parameter_checksums`:
    norms, then sums) the ranks disagree on, from the reduced :func:`agreement_sums`."""
    flags = disagreeing(sums, world)
    n = len(names)
    if not n:
        return []
    per_kind = [flags[k * n : (k + 1) * n] for k in range(len(flags) // n)]  # [norm flags, sum flags]
    return [name for name, *differ in zip(names, *per_kind) if any(differ)]


KEYS: tuple[Key, ...] = (
    Key("per_rank/loss/rank<rank>", "the rank's mean training loss", chart="loss: every rank"),
    Key(
        "per_rank/step_time_ms/rank<rank>",
        "the rank's step time (data loading excluded)",
        "ms",
        "step_time_ms: every rank",
    ),
    Key("per_rank/busy_ms/rank<rank>", "the rank's step time outside backward", "ms", "busy_ms: every rank"),
    Key(
        "per_rank/dataloader_wait_ms/rank<rank>",
        "the rank's wait for its batches",
        "ms",
        "dataloader_wait_ms: every rank",
    ),
    Key("per_rank/peak_memory_gib/rank<rank>", "the rank's peak memory", "GiB", "peak_memory_gib: every rank"),
    Key(
        "per_rank/step_time_ms/max_over_median",
        "slowest rank's step time / median (two ranks or more)",
        chart="spread over ranks",
    ),
    Key(
        "per_rank/busy_ms/max_over_median",
        "the same for busy time: the straggler signal under DDP",
        chart="spread over ranks",
    ),
    Key(
        "per_rank/dataloader_wait_ms/max_minus_median",
        "worst rank's data wait minus the median",
        "ms",
        "spread over ranks",
    ),
    Key("per_rank/loss/max_minus_min", "spread of the finite losses", chart="spread over ranks"),
    Key("per_rank/peak_memory_gib/max_over_median", "memory imbalance", chart="spread over ranks"),
)
"""PerRankLogger's ``KEYS``: what :func:`per_rank_metrics` returns (``<rank>``: the rank's number)."""


def per_rank_metrics(stats: Sequence[RankRow], log_per_rank: bool = True) -> dict[str, float]:
    """The ``per_rank/<stat>/rank<r>`` keys (with ``log_per_rank``) and, with two ranks or more, the spreads."""
    metrics: dict[str, float] = {}
    if log_per_rank:
        for r, s in enumerate(stats):
            for key in LOGGED:
                if key != "loss" or s.has_loss:
                    metrics[f"per_rank/{key}/rank{r}"] = getattr(s, key)
    if len(stats) > 1:
        column = {key: [getattr(s, key) for s in stats] for key in LOGGED}
        waits = column["dataloader_wait_ms"]
        metrics["per_rank/step_time_ms/max_over_median"] = max_over_median(column["step_time_ms"])
        metrics["per_rank/busy_ms/max_over_median"] = max_over_median(column["busy_ms"])
        metrics["per_rank/dataloader_wait_ms/max_minus_median"] = max(waits) - sorted(waits)[len(waits) // 2]
        metrics["per_rank/peak_memory_gib/max_over_median"] = max_over_median(column["peak_memory_gib"])
        losses = [s.loss for s in stats if s.has_loss and math.isfinite(s.loss)]
        if losses:
            metrics["per_rank/loss/max_minus_min"] = max(losses) - min(losses)
    return metrics


TFD501 = Rule(
    "TFD501",
    "warning",
    "PerRankLogger",
    title=(
        "identical batch fingerprints on different ranks for `patience` measurements: the data is not split (no "
        "distributed sampler)"
    ),
    headline="identical batches on different ranks ({identical}): the data is not split",
    trigger=(
        "two or more ranks trained on identical batches (equal fingerprints of the input ids) for `patience` "
        "measurements in a row"
    ),
    hint=(
        "Use a DistributedSampler: keep Trainer(use_distributed_sampler=True) (the default) or, with a custom "
        "sampler or IterableDataset, shard by trainer.global_rank / world_size yourself."
    ),
    reason="Loses work: every rank trains on the same batches, N x the compute for 1 x the data",
    message=(
        "Ranks {identical} trained on identical batches at {patience} measured steps in a row: the data is not split "
        "between ranks, so the job does N times the compute for the data of one."
    ),
    details=(
        "Compares hashes of the actual input ids, whatever produced them (a custom sampler, an `IterableDataset` that"
        " ignores the rank, `use_distributed_sampler=False`); one coincidence is not enough: identical fingerprints "
        "on two or more ranks on `patience` (default 3) measurements in a row."
    ),
)


TFD503 = Rule(
    "TFD503",
    "warning",
    "PerRankLogger",
    title=("a straggler: one rank's own work per step well above the other ranks' median, sustained; names the rank"),
    headline="straggler: rank {rank} takes {total:.1f} ms per step, {ratio:.1f}x the others' median",
    chart=EvidenceChart("Which rank does more work per step?", "ms", logged=("per_rank/busy_ms/rank<rank>",)),
    trigger=(
        "a rank's own work per step (outside backward, plus data wait) above `straggler_factor` x the other "
        "ranks' median and `straggler_min_ms` more, for `patience` measurements"
    ),
    hint=(
        "Check that rank's host (other processes, CPU frequency, thermal throttling), its data shard (slower "
        "samples, longer sequences), and per-rank code paths (logging or checkpointing on one rank inside the "
        "step). Compare tfdebug/rank<r>.jsonl files."
    ),
    reason="Measured: one rank is slower every step and the whole job waits for it",
    message=(
        "Rank {rank} is a straggler: its own work per step ({total:.1f} ms of compute outside backward plus data "
        "wait) is {ratio:.1f}x the other ranks' median ({others_median_ms:.1f} ms), for {patience} measurements in a "
        "row; every rank waits for it at each gradient all-reduce."
    ),
    details=(
        "Compares each rank's busy time outside backward plus its data-loading wait (not the whole step, which the "
        "collectives make equal) with the median of the other ranks, so one straggler among two ranks is still found:"
        " above `straggler_factor` (default 1.5) times that median and at least `straggler_min_ms` (default 10 ms) "
        "more, on `patience` (default 3) measurements. Under FSDP the ranks also wait for each other inside the "
        "forward's all-gathers, so a straggler shows only through delays before the step's first collective and "
        "through data loading."
    ),
)


TFD504 = Rule(
    "TFD504",
    "warning",
    "PerRankLogger",
    title=(
        "a rank's loss far from the median over ranks, sustained; with two ranks, the two losses far apart (both named)"
    ),
    headline="a rank's loss far from the others: {what}",
    chart=EvidenceChart("Do the ranks' losses agree?", "loss", logged=("per_rank/loss/rank<rank>",)),
    trigger=(
        "a rank's loss differs from the median over ranks by more than `loss_spread` of it (two ranks: the two "
        "losses by more than `loss_spread` of the smaller; both named), for `patience` measurements"
    ),
    hint=(
        "that rank sees different data, computes its loss differently (rank-dependent code) or runs different "
        "weights (see TFD502); compare the `rank<r>.jsonl` files"
    ),
    reason="Measured, sustained: one rank's loss is far from the others', so its data or its replica differs",
    message=("{what} for {patience} measurements in a row{tail}."),
    details=(
        "Compares the losses `training_step` returns with their median over all ranks, so one odd rank among three or"
        " more is named and the majority is not: a difference above `loss_spread` (default 0.5) of the median on "
        "`patience` (default 3) measurements. Two ranks have no majority: when their losses differ by more than "
        "`loss_spread` of the smaller, one finding names both. Non-finite losses are left to TFD505."
    ),
)


@dataclass
class RankDiagnosis:
    """PerRankLogger's findings, measurement after measurement (streaks kept across measurements)."""

    straggler_factor: float = 1.5
    straggler_min_ms: float = 10.0
    loss_spread: float = 0.5
    patience: int = 3
    streaks: Streak = field(default_factory=Streak)

    def update(self, stats: Sequence[RankRow], step: int, differing: Sequence[str] | None = None) -> list[Verdict]:
        """The verdicts of one measurement: ``stats`` every rank's row, ``differing`` the tensors whose checksums the
        ranks disagree on (:func:`disagreeing_tensors`; None: not compared)."""
        out: list[Verdict] = []
        nonfinite = nonfinite_loss_verdict(stats, step)
        if nonfinite is not None:
            out.append(nonfinite)
        if len(stats) < 2:
            return out
        out += self._batches(stats, step)
        if differing:
            out.append(parameters_verdict(stats, list(differing), step))
        out += self._stragglers(stats, step)
        out += self._losses(stats, step)
        return out

    def _batches(self, stats: Sequence[RankRow], step: int) -> list[Verdict]:
        """``TFD501``: ranks with equal batch fingerprints for ``patience`` measurements in a row."""
        prints = [s.fingerprint for s in stats]
        groups: dict[float, list[int]] = {}
        for r, fp in enumerate(prints):
            if fp >= 0:
                groups.setdefault(fp, []).append(r)
        same = [ranks for ranks in groups.values() if len(ranks) > 1]
        if self.streaks.update("identical_batches", bool(same)) < self.patience:
            return []
        evidence = {"identical_ranks": same, "fingerprints": prints}
        return [TFD501.verdict(evidence, step=step, identical=same[0], patience=self.patience)]

    def _stragglers(self, stats: Sequence[RankRow], step: int) -> list[Verdict]:
        """``TFD503``: a rank whose work outside backward plus data wait is far above the other ranks' median."""
        out: list[Verdict] = []
        totals = [s.busy_ms + s.dataloader_wait_ms for s in stats]
        for r, total in enumerate(totals):
            ref = median_of_others(totals, r)
            slow = total > self.straggler_factor * ref and total - ref > self.straggler_min_ms
            if self.streaks.update(f"straggler/rank{r}", slow) < self.patience:
                continue
            evidence = {
                "rank": r,
                "busy_ms": stats[r].busy_ms,
                "dataloader_wait_ms": stats[r].dataloader_wait_ms,
                "others_median_ms": ref,
            }
            text = {"total": total, "ratio": total / ref, "patience": self.patience}
            out.append(TFD503.verdict(evidence, key=f"rank{r}", step=step, **text))
        return out

    def _losses(self, stats: Sequence[RankRow], step: int) -> list[Verdict]:
        """``TFD504``: a rank's loss far from the others' (two ranks: both named, no majority)."""
        n = len(stats)
        losses = [s.loss if s.has_loss else math.nan for s in stats]
        far, reference = loss_outliers(losses, self.loss_spread)
        sustained = [r for r in range(n) if self.streaks.update(f"loss/rank{r}", r in far) >= self.patience]
        data = "sees different data (a corrupt shard, a different tokenizer or preprocessing)"
        if sustained and n == 2:
            what = f"The two ranks' losses ({losses[0]:.4g} and {losses[1]:.4g}) differ by more than "
            what += f"{self.loss_spread:.0%}"
            tail = "; with two ranks, which one is off cannot be told"
            text = {"what": what, "tail": tail, "patience": self.patience}
            evidence = {"ranks": sustained, "losses": losses}
            return [TFD504.verdict(evidence, hint=f"One rank {data} or {_LOSS_HINT}", key="pair", step=step, **text)]
        out: list[Verdict] = []
        for r in sustained:
            what = f"Rank {r}'s loss ({losses[r]:.4g}) is far from the median over ranks ({reference:.4g})"
            evidence = {"ranks": [r], "loss": losses[r], "median": reference, "losses": losses}
            text = {"what": what, "tail": "", "patience": self.patience}
            out.append(
                TFD504.verdict(evidence, hint=f"That rank {data}, {_LOSS_HINT}", key=f"rank{r}", step=step, **text)
            )
        return out

    def state_dict(self) -> dict[str, Any]:
        return self.streaks.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.streaks.load_state_dict(state)


TFD505 = Rule(
    "TFD505",
    "error",
    "PerRankLogger",
    title="a non-finite loss, naming the rank(s) that produced it",
    headline="non-finite loss on rank(s) {rank_list} at step {at_step}",
    trigger="a rank's training loss is inf/nan; names the rank(s)",
    hint=(
        "Look at that rank's batch (its fingerprint is in tfdebug/rank<r>.jsonl) and add NaNFirstFrame to find "
        "the first module that produced it. Under DDP the NaN reaches every rank with the next gradient "
        "all-reduce."
    ),
    reason="A non-finite loss on a rank poisons the averaged gradient on every rank: the run cannot continue",
    message=("Rank(s) {rank_list} produced a non-finite loss at step {at_step}{others}."),
    details=(
        "When a rank's training loss is inf or nan; names the rank(s) that produced it at the "
        "step they did (under DDP the NaN reaches every rank one step later, through the gradient all-reduce)."
    ),
)


def nonfinite_loss_verdict(stats: Sequence[RankRow], step: int) -> Verdict | None:
    """``TFD505``: the ranks whose loss is not finite, at once (no patience: the run cannot continue)."""
    nonfinite = [r for r, s in enumerate(stats) if s.has_loss and not math.isfinite(s.loss)]
    if not nonfinite:
        return None
    finite = [r for r in range(len(stats)) if r not in nonfinite]
    others = f" while rank(s) {', '.join(map(str, finite))} did not" if finite else ""
    evidence = {"ranks": nonfinite, "losses": [s.loss for s in stats]}
    return TFD505.verdict(evidence, step=step, rank_list=", ".join(map(str, nonfinite)), at_step=step, others=others)


TFD502 = Rule(
    "TFD502",
    "error",
    "PerRankLogger",
    title="parameter or buffer checksums differ between DDP replicas; names the ranks and the tensors",
    headline="replicas differ at step {at_step}: ranks {rank_list}, {count} tensors",
    trigger=(
        "parameter or buffer checksums (per-tensor norm and sum) differ between DDP replicas; names the ranks and"
        " tensors (not checked under sharded strategies; BatchNorm running statistics excluded)"
    ),
    hint=(
        "DDP only averages gradients, so a replica that changes a weight on its own (rank-dependent code in "
        "training_step or a hook, a different initialization without a seed, an optimizer step skipped on one "
        "rank) stays different for ever. Seed every rank the same before building the model, and make weight "
        "updates outside the optimizer identical on every rank."
    ),
    reason="Replicas whose weights differ are no longer one model: the ranks train different runs",
    message=(
        "Parameters or buffers differ between DDP replicas at step {at_step}: rank(s) {rank_list} disagree with the "
        "others on {count} tensor(s): {tensor_list}{more}."
    ),
    details=(
        "With `compare_parameters=True` (default), every parameter and buffer is compared across replicas "
        "(BatchNorm/InstanceNorm running statistics excepted: each replica updates them from its own batch). DDP "
        "replicas are bitwise equal, so any difference beyond a relative 1e-6 counts. The majority of ranks is the "
        "reference; ties go to the lowest rank; two NaN checksums compare equal, so replicas that all went non-finite"
        " together are not reported. Skipped under FSDP, FSDP2, DeepSpeed and `ModelParallelStrategy`, where ranks "
        "hold different shards by design."
    ),
)


def parameters_verdict(stats: Sequence[RankRow], tensors: list[str], step: int) -> Verdict:
    """``TFD502``: the ``tensors`` the replicas disagree on (from the reduced agreement sums), and the ranks that
    differ from the majority, named from each rank's weighted total checksum (exactly: replicas are equal)."""
    ranks = differing_ranks([[s.checksum] for s in stats], 0.0)
    evidence = {"ranks": ranks, "tensors": tensors[:50], "checksums": [s.checksum for s in stats]}
    text = {
        "at_step": step,
        "rank_list": ", ".join(map(str, ranks)),
        "count": len(tensors),
        "tensor_list": ", ".join(tensors[:5]),
        "more": " ..." * (len(tensors) > 5),
    }
    return TFD502.verdict(evidence, step=step, **text)


BLOCK = ("TFD501", "TFD519")
"""The codes reserved for PerRankLogger's rules."""

RULES: tuple[Rule, ...] = (TFD501, TFD502, TFD503, TFD504, TFD505)
"""The rules decided in this module, in code order."""


COVERAGE: dict[str, tuple[str, ...]] = {
    "ranks agree": (
        "TFD501",
        "TFD502",
        "TFD503",
        "TFD504",
        "TFD505",
    ),
}
"""The rows of the run's Coverage table these rules answer: the check -> the codes that decide it."""
