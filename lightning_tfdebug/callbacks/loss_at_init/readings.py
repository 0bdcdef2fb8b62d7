"""LossAtInit's readings: host floats read, by name, from the reduced sums of
:func:`~lightning_tfdebug.functional.loss.step_sums` (step 0, the check, the compared steps)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from lightning_tfdebug.functional.loss import CAP_GRID, OTHER_ALIGNMENT, TEMPERATURE_GRID, uniform_loss

MASKED_LM_SHARE = 0.5
"""Masked-LM labels: one input token (the mask) fills at least this share of the supervised positions ..."""


MASKED_LM_SUPERVISED = 0.5
"""... and at most this fraction of the label positions is supervised (BERT masks 15%)."""


NORMALIZED_ROWS = 0.99
"""Fraction of sampled rows that must be probabilities (or log-probabilities) for TFD220 (TFD221)."""


_OTHER_FIELDS = ("ce_sum", "ce_count", "own_ce_sum", "rolled_ce_sum", "rolled_count", "floor_sum", "range_sum")
_OTHER_FIELDS += ("range_sq_sum", "floor_count")
"""The sums also taken under the other label alignment (:data:`~lightning_tfdebug.functional.loss.OTHER_ALIGNMENT`)."""


@dataclass(frozen=True)
class LossSums:
    """One measured step's payload across ranks, read by name: the sums LossAtInit declares to ``reduce_then`` (every
    rank's added; :data:`~lightning_tfdebug.functional.loss.PHASE_SUMS` of the step's phase, the returned loss, its
    count, the ranks that could read the logits), on the host. A sum the phase does not take reads 0.

    Built in one place, :meth:`from_host`; the fields are the declared names (``tx_beta_<k>``, ``tx_cap_<k>``: the
    tuples ``tx_beta``, ``tx_cap``; ``other_<name>``: the sum under the other alignment).
    """

    # every step: the loss training_step returned (summed over the ranks that returned one), and on how many ranks
    loss_sum: float = 0.0
    loss_n: float = 0.0
    ok: float = 0.0  # ranks that found the logits and labels
    unigram_entropy: float = math.nan  # the labels' unigram entropy, once counted (from the reduced label counts)
    # step 0 (INIT_SUMS) and the check (CHECK_SUMS), under the configured alignment
    ce_sum: float = 0.0
    ce_count: float = 0.0
    var_sum: float = 0.0
    rows: float = 0.0
    prob_rows: float = 0.0
    logprob_rows: float = 0.0
    supervised: float = 0.0
    positions: float = 0.0
    label_rows: float = 0.0
    copies: float = 0.0
    repeats: float = 0.0
    count: float = 0.0
    mask_share_top: float = 0.0
    mask_share_count: float = 0.0
    own_ce_sum: float = 0.0
    rolled_ce_sum: float = 0.0
    rolled_count: float = 0.0
    floor_sum: float = 0.0
    range_sum: float = 0.0
    range_sq_sum: float = 0.0
    floor_count: float = 0.0
    own_match: float = 0.0
    rolled_match: float = 0.0
    match_count: float = 0.0
    # the same under the other alignment
    other_ce_sum: float = 0.0
    other_ce_count: float = 0.0
    other_own_ce_sum: float = 0.0
    other_rolled_ce_sum: float = 0.0
    other_rolled_count: float = 0.0
    other_floor_sum: float = 0.0
    other_range_sum: float = 0.0
    other_range_sq_sum: float = 0.0
    other_floor_count: float = 0.0
    # the check of a run resumed without step 0's reading (LATE_SUMS)
    late_mask_top: float = 0.0
    late_mask_count: float = 0.0
    late_supervised: float = 0.0
    late_positions: float = 0.0
    seq_labels: float = 0.0  # the check: ranks whose labels are one per sequence
    # the compared steps and the check (TRANSFORM_SUMS)
    tx_ce_sum: float = 0.0
    tx_ce_sq_sum: float = 0.0
    tx_count: float = 0.0
    tx_total: float = 0.0
    tx_positions: float = 0.0
    tx_uniform_sum: float = 0.0
    tx_range_sum: float = 0.0
    tx_range_sq_sum: float = 0.0
    tx_floor_sum: float = 0.0
    tx_sigmoid_sum: float = 0.0
    tx_conf_sum: float = 0.0  # the rows' cross-entropy under the configured alignment, and their number
    tx_conf_count: float = 0.0
    tx_beta: tuple[float, ...] = ()  # per TEMPERATURE_GRID multiplier; () when not taken
    tx_cap: tuple[float, ...] = ()  # per CAP_GRID cap; () when not taken

    @classmethod
    def from_host(cls, values: Mapping[str, float]) -> LossSums:
        """The reading of the reduced sums on the host, by their declared names; a name that is not a field raises
        (a sum added to ``step_sums`` without its field here would otherwise be dropped unread)."""
        grids = {"tx_beta": len(TEMPERATURE_GRID), "tx_cap": len(CAP_GRID)}
        plain = {k: float(v) for k, v in values.items() if not k.startswith(tuple(f"{g}_" for g in grids))}
        unknown = set(plain) - {f.name for f in dataclasses.fields(cls)} | (set(plain) & set(grids))
        if unknown:
            raise KeyError(f"LossSums has no field for the declared sums {sorted(unknown)}")
        tuples = {g: tuple(float(values[f"{g}_{k}"]) for k in range(n)) for g, n in grids.items() if f"{g}_0" in values}
        return cls(**plain, **tuples)

    def follow_other(self) -> LossSums:
        """The sums of the other alignment under the plain names (and none left under the other's)."""
        swapped = {name: getattr(self, OTHER_ALIGNMENT + name) for name in _OTHER_FIELDS}
        return dataclasses.replace(self, **swapped, **{OTHER_ALIGNMENT + name: 0.0 for name in _OTHER_FIELDS})

    def with_loss(self, loss: float) -> LossSums:
        """The same sums with ``loss`` as the one returned loss."""
        return dataclasses.replace(self, loss_sum=loss, loss_n=1.0)


def _mean(total: float, count: float, default: float = float("nan")) -> float:
    return total / count if count else default


def returned_loss(host: LossSums) -> float:
    """The loss ``training_step`` returned, averaged over the ranks that returned one (``loss_sum`` / ``loss_n``);
    NaN when none did."""
    return _mean(host.loss_sum, host.loss_n)


@dataclass(frozen=True)
class InitLoss:
    """The first step's loss and outputs, from the reduced sums (host floats)."""

    observed: float  # the loss training_step returned (averaged over ranks), else the recomputed one
    expected: float  # ln(V)
    recomputed: float  # cross-entropy of the captured logits against the labels
    logit_std: float  # root mean of the per-row variances across the vocabulary
    supervised_frac: float
    copy_rate: float | None  # argmax == current input token, None when not measured
    probability_rows: float  # fraction of sampled rows that are probabilities
    log_probability_rows: float
    supervised: float  # labels that are not ignore_index, over every rank
    positions: float  # label positions, over every rank
    label_rows: float  # sequences, over every rank
    vocab: int
    repeat_rate: float | None = None  # the data repeats a token (inputs[t] == inputs[t + 1]); None when not measured
    mask_share: float | None = None  # share of supervised positions holding the most common input token
    kind: str = "unknown"  # model_kind's: an encoder-decoder's copy rate reads its decoder input

    @property
    def masked_lm(self) -> bool:
        """Masked-LM labels: a few positions supervised, and most of their inputs one token (the mask)."""
        return (
            self.mask_share is not None
            and self.mask_share >= MASKED_LM_SHARE
            and 0 < self.supervised_frac <= MASKED_LM_SUPERVISED
        )

    @property
    def probabilities(self) -> bool:
        """The outputs are probabilities (``TFD220``): the check's bounded-output floor is then that finding's."""
        return self.probability_rows >= NORMALIZED_ROWS

    def metrics(self) -> dict[str, float]:
        """The logged keys of step 0."""
        out = {
            "loss_at_init/observed": self.observed,
            "loss_at_init/expected": self.expected,
            "loss_at_init/recomputed": self.recomputed,
            "loss_at_init/logit_std": self.logit_std,
            "loss_at_init/supervised_frac": self.supervised_frac,
        }
        if self.copy_rate is not None:
            out["loss_at_init/copy_rate"] = self.copy_rate
        return out


def follow_returned_loss(host: LossSums, observed: float) -> tuple[LossSums, bool]:
    """The sums of the label alignment (``t`` or ``t + 1``) whose recomputed cross-entropy is closer to the returned
    loss: ``shift_labels`` can only assume who shifts the labels, the returned loss says it (a trained model's
    logits give its loss only under the right one). ``host`` holds both (:data:`OTHER_ALIGNMENT`).

    Returns the values with the matching alignment's sums under the plain names, and whether that is the other one.
    """
    out = dataclasses.replace(host, **{OTHER_ALIGNMENT + name: 0.0 for name in _OTHER_FIELDS})
    count, other_count = host.ce_count, host.other_ce_count
    if not (count and other_count and math.isfinite(observed)):
        return out, False
    configured = host.ce_sum / count
    other = host.other_ce_sum / other_count
    if not (math.isfinite(other) and abs(observed - other) < abs(observed - configured)):
        return out, False
    return host.follow_other(), True


def summarize_init(host: LossSums, vocab: int, kind: str = "unknown") -> InitLoss:
    """:class:`InitLoss` from step 0's reduced sums and the returned loss (``loss_sum`` / ``loss_n``)."""
    recomputed = _mean(host.ce_sum, host.ce_count)
    rows = max(host.rows, 1.0)
    return InitLoss(
        observed=_mean(host.loss_sum, host.loss_n, recomputed),
        expected=uniform_loss(vocab),
        recomputed=recomputed,
        logit_std=math.sqrt(max(host.var_sum, 0.0) / rows),
        supervised_frac=_mean(host.supervised, host.positions, 0.0),
        copy_rate=_mean(host.copies, host.count) if host.count else None,
        probability_rows=host.prob_rows / rows,
        log_probability_rows=host.logprob_rows / rows,
        supervised=host.supervised,
        positions=host.positions,
        label_rows=host.label_rows,
        vocab=vocab,
        repeat_rate=_mean(host.repeats, host.count) if host.count else None,
        mask_share=_mean(host.mask_share_top, host.mask_share_count) if host.mask_share_count else None,
        kind=kind,
    )


def late_masked_lm(host: LossSums) -> bool:
    """Masked-LM labels, read at the check of a run resumed without step 0's reading (:data:`LATE_SUMS`)."""
    if not host.late_mask_count or not host.late_positions:
        return False
    share = host.late_mask_top / host.late_mask_count
    supervised = host.late_supervised / host.late_positions
    return share >= MASKED_LM_SHARE and 0 < supervised <= MASKED_LM_SUPERVISED


@dataclass(frozen=True)
class CheckReading:
    """The check's measurements under the alignment the returned loss follows (host floats; NaN: not measured)."""

    loss: float  # the loss training_step returned (averaged over ranks), else the recomputed one
    recomputed: float  # the logits' own cross-entropy
    expected: float  # ln(V)
    copy_rate: float = math.nan  # argmax == current input token
    repeat_rate: float = math.nan  # the data repeats a token
    own_loss: float = math.nan  # cross-entropy against the sample's own labels, where the rolled ones are supervised
    rolled_loss: float = math.nan  # ... against the labels rolled by one sample along the batch
    floor: float = math.nan  # mean of ln(1 + (V-1) e^-w), w a row's logit range
    logit_range: float = math.nan  # mean of w
    range_spread: float = math.nan  # standard deviation of w over its mean
    own_match: float = math.nan  # share of supervised labels repeating their own inputs (masked LM: on their masks)
    rolled_match: float = math.nan  # ... the neighbour's inputs
    copy_positions: float = 0.0  # positions the copy rate counted
    rolled_rows: float = 0.0  # rows the rolled loss counted
    floor_rows: float = 0.0  # rows the floor counted
    per_sequence: bool = False  # every rank's labels are one per sequence (a classifier's)

    def metrics(self) -> dict[str, float]:
        """The logged keys of the check (what it measured)."""
        out = {"loss_at_init/check_loss": self.loss}
        if self.copy_positions:
            out["loss_at_init/copy_rate"] = self.copy_rate
        if self.rolled_rows:
            out["loss_at_init/rolled_loss"] = self.rolled_loss
        if self.floor_rows:
            out["loss_at_init/loss_floor"] = self.floor
        return out


def check_reading(host: LossSums, vocab: int) -> CheckReading:
    """:class:`CheckReading` from the check's reduced sums, under the alignment :func:`follow_returned_loss` chose."""
    recomputed = _mean(host.ce_sum, host.ce_count)
    count, rolled, floor, matched = host.count, host.rolled_count, host.floor_count, host.match_count
    logit_range, spread = _mean(host.range_sum, floor), math.nan
    if floor:
        spread_sq = host.range_sq_sum / floor - logit_range**2
        spread = math.sqrt(max(spread_sq, 0.0)) / logit_range if logit_range > 0 else math.nan
    return CheckReading(
        loss=_mean(host.loss_sum, host.loss_n, recomputed),
        recomputed=recomputed,
        expected=uniform_loss(vocab),
        copy_rate=_mean(host.copies, count),
        repeat_rate=_mean(host.repeats, count),
        own_loss=_mean(host.own_ce_sum, rolled),
        rolled_loss=_mean(host.rolled_ce_sum, rolled),
        floor=_mean(host.floor_sum, floor),
        logit_range=logit_range,
        range_spread=spread,
        own_match=_mean(host.own_match, matched),
        rolled_match=_mean(host.rolled_match, matched),
        copy_positions=count,
        rolled_rows=rolled,
        floor_rows=floor,
        per_sequence=0 < host.seq_labels >= host.ok,
    )


@dataclass(frozen=True)
class LossReading:
    """One compared step: the loss ``training_step`` returned and what the recorded logits give (host floats)."""

    step: int
    loss: float  # the returned loss (averaged over ranks, undivided by Lightning's accumulation)
    ce: float  # the logits' own cross-entropy (sampled rows)
    ce_error: float  # standard error of ``ce`` as a sample's mean (0 when every row was taken)
    uniform: float  # the logits' cross-entropy against a uniform target
    logit_range: float  # mean over rows of max - min
    beta_ce: tuple[float, ...]  # cross-entropy of b * logits for b in TEMPERATURE_GRID
    supervised_share: float = float("nan")  # supervised label positions over all of them, in the whole batch
    cap_ce: tuple[float, ...] = ()  # cross-entropy of c * tanh(logits / c) for c in CAP_GRID
    range_spread: float = float("nan")  # standard deviation of the rows' ranges over their mean
    floor: float = float("nan")  # mean over rows of ln(1 + (V-1) e^-w), w the row's range
    sigmoid_ce: float = float("nan")  # cross-entropy of sigmoid(logits)
    configured_ce: float = float("nan")  # the logits' cross-entropy under the configured alignment (`shift_labels`)

    def to_list(self) -> list[Any]:
        return [list(v) if isinstance(v, tuple) else v for v in dataclasses.astuple(self)]

    @classmethod
    def from_list(cls, value: Sequence[Any]) -> LossReading:
        step, loss, ce, error, uniform, logit_range, betas, *rest = value
        numbers = (float(v) for v in (loss, ce, error, uniform, logit_range))
        share = float(rest[0]) if rest else math.nan
        caps = tuple(float(c) for c in rest[1]) if len(rest) > 1 else ()
        later = [float(v) for v in rest[2:5]]  # range spread, floor, sigmoid: absent from older checkpoints
        configured = [float(v) for v in rest[5:6]]
        return cls(int(step), *numbers, tuple(float(b) for b in betas), share, caps, *later, *configured)

    @property
    def best(self) -> float:
        """The lowest cross-entropy of the logits at any temperature of the grid."""
        return min((v for v in self.beta_ce if math.isfinite(v)), default=self.ce)

    def temperatures(self) -> list[float]:
        """The multipliers ``b`` (``1/T``) at which the logits' cross-entropy equals the returned loss, interpolated
        in ``ln b`` between the grid's points (a convex curve in ``b``: at most two)."""
        return _roots(TEMPERATURE_GRID, self.beta_ce, self.loss)


def _roots(grid: Sequence[float], values: Sequence[float], target: float) -> list[float]:
    """Where the curve ``values`` over ``grid`` crosses ``target``, interpolated in the grid's logarithm."""
    out: list[float] = []
    for k in range(len(values) - 1):
        a, b = values[k] - target, values[k + 1] - target
        if not (math.isfinite(a) and math.isfinite(b)) or a * b > 0 or a == b:
            continue
        lo, hi = math.log(grid[k]), math.log(grid[k + 1])
        root = math.exp(lo + a / (a - b) * (hi - lo))
        if not out or abs(math.log(root / out[-1])) > 1e-6:
            out.append(root)
    return out


def _at(grid: Sequence[float], values: Sequence[float], x: float) -> float:
    """The curve ``values`` over ``grid`` at ``x``, interpolated in the grid's logarithm (nan outside the grid)."""
    for k in range(len(values) - 1):
        if grid[k] <= x <= grid[k + 1]:
            t = math.log(x / grid[k]) / math.log(grid[k + 1] / grid[k])
            return values[k] + t * (values[k + 1] - values[k])
    return math.nan


def loss_reading(host: LossSums, loss: float, step: int) -> LossReading | None:
    """:class:`LossReading` from the reduced sums of :func:`~lightning_tfdebug.functional.loss.loss_transform_sums`;
    None when no row was supervised or no loss was returned."""
    n, total = host.tx_count, host.tx_total
    if not n or not math.isfinite(loss):
        return None
    ce, width = host.tx_ce_sum / n, host.tx_range_sum / n
    spread = math.sqrt(max(host.tx_range_sq_sum / n - width**2, 0.0)) / width if width > 0 else math.nan
    variance = max(host.tx_ce_sq_sum / n - ce**2, 0.0)
    sampled = max(1.0 - n / total, 0.0) if total else 0.0  # finite population: no error when every row was taken
    return LossReading(
        step=step,
        loss=loss,
        ce=ce,
        ce_error=math.sqrt(variance / n * sampled),
        uniform=host.tx_uniform_sum / n,
        logit_range=width,
        beta_ce=tuple(v / n for v in host.tx_beta),
        supervised_share=total / host.tx_positions if host.tx_positions else float("nan"),
        cap_ce=tuple(v / n for v in host.tx_cap),
        range_spread=spread,
        floor=host.tx_floor_sum / n,
        sigmoid_ce=host.tx_sigmoid_sum / n,
        configured_ce=host.tx_conf_sum / host.tx_conf_count if host.tx_conf_count else math.nan,
    )


@dataclass
class Collected:
    """What one measured step found on this rank, kept (small) from the backward to the end of the batch."""

    reason: str  # why the logits or labels cannot be read ("" when they were)
    ok: bool
    vocab: int
    device: torch.device
    shifted: bool = False  # the logits were scored against the next position's label
    stats: dict[str, Tensor] = field(default_factory=dict)  # the phase's sums (device scalars)
    labels: Tensor | None = None  # for the label counts; released with the rest at the end of the batch
