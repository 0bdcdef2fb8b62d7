"""LossAtInit's tensor math: sums and counts on the device (no host sync), so a caller can add them over ranks.

``shift_labels=True``: the logits at position ``t`` are scored against the label at ``t + 1`` (causal LMs that shift
internally, ``labels == input_ids``); ``False``: logits and labels are aligned position by position.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor


def uniform_loss(vocab_size: int) -> float:
    """Cross-entropy of a uniform prediction over ``vocab_size`` classes, ``ln(V)`` (label smoothing or not).

    Raises:
        ValueError: when ``vocab_size`` is below 2.
    """
    if vocab_size < 2:
        raise ValueError(f"`vocab_size` must be >= 2; got {vocab_size}.")
    return math.log(vocab_size)


def align(logits: Tensor, labels: Tensor, shift_labels: bool, ignore_index: int = -100) -> tuple[Tensor, Tensor]:
    """Rows ``(N, V)`` of logits (a view when contiguous) and the ``(N,)`` labels each is scored against; with
    ``shift_labels`` the label at ``t + 1``, and ``ignore_index`` for each sequence's last position.

    Raises:
        ValueError: when the shapes do not fit (``logits.shape[:-1]`` must equal ``labels.shape``, with a time
            dimension when ``shift_labels``).
    """
    if tuple(logits.shape[:-1]) != tuple(labels.shape):
        raise ValueError(
            f"labels of shape {tuple(labels.shape)} do not match logits of shape {tuple(logits.shape)} "
            "(expected labels shaped like the logits without their last dimension)"
        )
    if shift_labels:
        if logits.ndim < 3:
            raise ValueError(
                f"`shift_labels=True` needs logits with a time dimension (batch, time, vocab); got shape "
                f"{tuple(logits.shape)}"
            )
        shifted = torch.full_like(labels, ignore_index)
        shifted[..., :-1] = labels[..., 1:]
        labels = shifted
    return logits.reshape(-1, logits.shape[-1]), labels.reshape(-1)


def sample_rows(n_rows: int, max_rows: int, device: torch.device, period: int = 1) -> Tensor:
    """Evenly strided row indices, at most ``max_rows`` of ``n_rows`` (from shapes: no sync); the stride is coprime
    with ``period`` (the sequence length) so the sample covers every position of a sequence."""
    stride = max(1, math.ceil(n_rows / max_rows))
    if stride > 1:
        while math.gcd(stride, period) != 1:
            stride += 1
    return torch.arange(0, n_rows, stride, device=device)


def _sampled(
    logits: Tensor, labels: Tensor, shift_labels: bool, ignore_index: int, max_rows: int
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The sampled rows (float), their targets, every row's target and the sample's indices, under one alignment."""
    rows, targets = align(logits.detach(), labels.detach(), shift_labels, ignore_index)
    idx = sample_rows(rows.shape[0], max_rows, rows.device, period=labels.shape[-1] if labels.ndim > 1 else 1)
    x = rows.index_select(0, idx).float()
    return x, targets.index_select(0, idx).to(x.device), targets, idx


def _picked(values: Tensor, target: Tensor, mask: Tensor) -> Tensor:
    """Each row's value at its target (0 where ``mask`` is False)."""
    safe = torch.where(mask, target, torch.zeros_like(target)).long()
    return values.gather(-1, safe[:, None]).squeeze(-1)


def init_loss_sums(
    logits: Tensor,
    labels: Tensor,
    *,
    shift_labels: bool = True,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    max_rows: int = 2048,
    atol: float = 1e-3,
) -> dict[str, Tensor]:
    """Sums and counts that describe the model's outputs and the loss they give (float device scalars).

    ``ce_sum``/``ce_count``: cross-entropy (with ``label_smoothing``) over the sampled supervised rows; ``var_sum``/
    ``rows``: the rows' variances across the vocabulary; ``prob_rows``/``logprob_rows``: rows that are probabilities
    / log-probabilities (within ``atol`` x 10); ``supervised``/``positions``: supervised and all label positions of
    the whole batch; ``label_rows``: its sequences.
    """
    x, t, targets, _ = _sampled(logits, labels, shift_labels, ignore_index, max_rows)
    mask = t != ignore_index
    logp = x.log_softmax(-1)
    nll = -_picked(logp, t.clamp(max=x.shape[-1] - 1), mask & (t >= 0))
    ce = (1.0 - label_smoothing) * nll + label_smoothing * (-logp.mean(-1))
    tol = atol * 10
    is_prob = (x.amin(-1) >= -atol) & ((x.sum(-1) - 1.0).abs() <= tol)
    is_logprob = (x.amax(-1) <= atol) & (x.logsumexp(-1).abs() <= tol) & ~is_prob
    f32 = torch.float32
    return {
        "ce_sum": torch.where(mask, ce, torch.zeros_like(ce)).sum(dtype=f32),
        "ce_count": mask.sum(dtype=f32),
        "var_sum": x.var(-1, unbiased=False).sum(dtype=f32) if x.shape[-1] > 1 else x.new_zeros(()),
        "rows": torch.tensor(float(x.shape[0]), device=x.device),
        "prob_rows": is_prob.sum(dtype=f32),
        "logprob_rows": is_logprob.sum(dtype=f32),
        "supervised": (targets != ignore_index).sum(dtype=f32),
        "positions": torch.tensor(float(targets.numel()), device=x.device),
        "label_rows": torch.tensor(float(labels.shape[0] if labels.ndim > 1 else 1), device=x.device),
    }


def copy_sums(
    logits: Tensor,
    inputs: Tensor,
    supervised: Tensor | None = None,
    *,
    max_rows: int = 4096,
) -> dict[str, Tensor]:
    """How often the argmax at position ``t`` is the *current* input token (a model trained on unshifted labels
    copies its input), and how often the data repeats a token (``inputs[t] == inputs[t + 1]``, the base rate).

    Args:
        logits: ``(batch, time, vocab)``.
        inputs: ``(batch, time)`` input token ids.
        supervised: optional ``(batch, time)`` bool mask of positions to count (e.g. not padding); position
            ``t`` counts when ``supervised[t]`` holds.
        max_rows: positions sampled (evenly strided).

    Returns:
        ``copies`` (argmax == inputs[t]), ``repeats`` (inputs[t] == inputs[t+1]), ``count`` (positions counted).
    """
    if logits.ndim != 3 or tuple(inputs.shape) != tuple(logits.shape[:2]):
        raise ValueError(
            f"inputs of shape {tuple(inputs.shape)} do not match logits of shape {tuple(logits.shape)} "
            "(expected (batch, time) and (batch, time, vocab))"
        )
    b, t, v = logits.shape
    flat = logits.detach().reshape(-1, v)  # a view when contiguous: the sample is taken before any copy
    idx = sample_rows(b * t, max_rows, flat.device, period=t)
    pred = flat.index_select(0, idx).argmax(-1)
    ids = inputs.reshape(-1).to(flat.device)
    current, nxt = ids.index_select(0, idx), ids.index_select(0, (idx + 1).clamp(max=b * t - 1))
    mask = (idx % t) != t - 1  # the last position has no next token (a mask, not a filter: no sync)
    if supervised is not None:
        mask = mask & supervised.reshape(-1).to(flat.device).index_select(0, idx).bool()
    f32 = torch.float32
    return {
        "copies": ((pred == current) & mask).sum(dtype=f32),
        "repeats": ((current == nxt) & mask).sum(dtype=f32),
        "count": mask.sum(dtype=f32),
    }


def label_counts(labels: Tensor, vocab_size: int, ignore_index: int = -100) -> Tensor:
    """How often each class in ``[0, vocab_size)`` occurs among the supervised labels: a float count vector (a
    scatter-add into a fixed size, not ``bincount``: no host sync)."""
    flat = labels.detach().reshape(-1)
    keep = (flat != ignore_index) & (flat >= 0) & (flat < vocab_size)
    index = torch.where(keep, flat, torch.zeros_like(flat)).long()
    counts = torch.zeros(vocab_size, dtype=torch.float32, device=flat.device)
    return counts.scatter_add_(0, index, keep.float())


def unigram_entropy(counts: Tensor) -> Tensor:
    """Entropy (nats) of the label distribution ``counts`` describe, the loss of a model that learned the classes'
    frequencies only; with the Miller-Madow correction ``(K - 1) / 2N``. A device scalar; NaN when nothing counted."""
    counts = counts.float()
    total = counts.sum()
    p = counts / total.clamp(min=1.0)
    plug_in = -(p * torch.where(p > 0, p.log(), torch.zeros_like(p))).sum()
    seen = (counts > 0).sum().float()
    value = plug_in + (seen - 1.0).clamp(min=0.0) / (2.0 * total.clamp(min=1.0))
    return torch.where(total > 0, value, torch.full_like(value, float("nan")))


def masked_input_sums(inputs: Tensor, labels: Tensor, vocab_size: int, ignore_index: int = -100) -> dict[str, Tensor]:
    """``mask_share_top``: the count of the most common input token at supervised positions, ``mask_share_count``:
    those positions. A ratio near 1 (BERT: 80% ``[MASK]``) recognises masked-LM labels."""
    if tuple(inputs.shape) != tuple(labels.shape):
        zero = torch.zeros((), device=labels.device)
        return {"mask_share_top": zero, "mask_share_count": zero}
    supervised = labels.detach() != ignore_index
    ids = torch.where(supervised, inputs.detach().to(labels.device), torch.full_like(labels, ignore_index))
    counts = label_counts(ids, vocab_size, ignore_index)
    return {"mask_share_top": counts.max(), "mask_share_count": supervised.sum(dtype=torch.float32)}


def rolled_label_sums(
    logits: Tensor,
    labels: Tensor,
    *,
    shift_labels: bool = True,
    ignore_index: int = -100,
    max_rows: int = 2048,
) -> dict[str, Tensor]:
    """Cross-entropy against the batch's own labels and against labels rolled by one sample, over the sampled rows
    where both are supervised (``rolled_count``): a model that uses its context predicts its own labels better. A
    batch of one sample has no neighbour: the counts are then 0."""
    zero = torch.zeros((), device=logits.device)
    if labels.shape[0] < 2:
        return {"own_ce_sum": zero, "rolled_ce_sum": zero, "rolled_count": zero}
    x, own, _, idx = _sampled(logits, labels, shift_labels, ignore_index, max_rows)
    _, rolled = align(logits.detach(), labels.detach().roll(1, 0), shift_labels, ignore_index)
    rolled = rolled.index_select(0, idx).to(x.device)
    mask = (own != ignore_index) & (rolled != ignore_index) & (own < x.shape[-1]) & (rolled < x.shape[-1])
    mask &= (own >= 0) & (rolled >= 0)
    logp = x.log_softmax(-1)

    def nll(target: Tensor) -> Tensor:
        return torch.where(mask, -_picked(logp, target, mask), torch.zeros_like(x[:, 0])).sum()

    return {"own_ce_sum": nll(own), "rolled_ce_sum": nll(rolled), "rolled_count": mask.sum(dtype=torch.float32)}


def label_input_match_sums(labels: Tensor, inputs: Tensor, ignore_index: int = -100) -> dict[str, Tensor]:
    """How often a supervised label repeats its own sample's input token (``own_match``, the better of the aligned
    and the shifted-by-one alignment) and the neighbouring sample's (``rolled_match``); ``match_count``: supervised
    positions."""
    zero = torch.zeros((), device=labels.device)
    if labels.ndim != 2 or tuple(inputs.shape) != tuple(labels.shape) or labels.shape[0] < 2 or labels.shape[1] < 2:
        return {"own_match": zero, "rolled_match": zero, "match_count": zero}
    labels = labels.detach()
    inputs = inputs.detach().to(labels.device)
    supervised = (labels != ignore_index)[:, :-1]
    f32 = torch.float32

    def best(ids: Tensor) -> Tensor:
        same = ((labels[:, :-1] == ids[:, :-1]) & supervised).sum(dtype=f32)
        nxt = ((labels[:, :-1] == ids[:, 1:]) & supervised).sum(dtype=f32)
        return torch.maximum(same, nxt)

    own, rolled = best(inputs), best(inputs.roll(1, 0))
    return {"own_match": own, "rolled_match": rolled, "match_count": supervised.sum(dtype=f32)}


def bounded_floor_sums(
    logits: Tensor,
    labels: Tensor,
    *,
    shift_labels: bool = True,
    ignore_index: int = -100,
    max_rows: int = 2048,
) -> dict[str, Tensor]:
    """The lowest cross-entropy the logits' own range allows, ``ln(1 + (V - 1) e^-w)`` for a row of range ``w``,
    over the sampled supervised rows: ``floor_sum``, ``range_sum``, ``range_sq_sum`` and ``floor_count``."""
    x, t, _, _ = _sampled(logits, labels, shift_labels, ignore_index, max_rows)
    mask = t != ignore_index
    width = x.amax(-1) - x.amin(-1)
    floor = torch.log1p((x.shape[-1] - 1) * torch.exp(-width))
    zeros = torch.zeros_like(width)
    return {
        "floor_sum": torch.where(mask, floor, zeros).sum(),
        "range_sum": torch.where(mask, width, zeros).sum(),
        "range_sq_sum": torch.where(mask, width.square(), zeros).sum(),
        "floor_count": mask.sum(dtype=torch.float32),
    }


TEMPERATURE_GRID: tuple[float, ...] = tuple(2.0 ** (k / 4) for k in range(-16, 17))
"""Multipliers ``b`` of the logits (``b = 1/T``) at which :func:`loss_transform_sums` takes the cross-entropy:
``1/16`` to ``16`` in steps of ``2^(1/4)``."""
CAP_GRID: tuple[float, ...] = tuple(2.0 ** (k / 2) for k in range(-4, 9))
"""Soft-caps ``c`` at which :func:`loss_transform_sums` takes the cross-entropy of ``c * tanh(logits / c)``: ``1/4`` to
``16`` in steps of ``2^(1/2)`` (a bound in the step is told from a temperature by which of the two fits the loss; a
tanh pass costs about three of a temperature's, and this spacing still fits a cap 10-100x closer than a temperature)."""


def loss_transform_sums(
    logits: Tensor,
    labels: Tensor,
    *,
    shift_labels: bool = True,
    ignore_index: int = -100,
    max_rows: int = 2048,
    both_alignments: bool = False,
) -> dict[str, Tensor]:
    """The logits' own cross-entropy and simple transforms of it, to hold the returned loss against (float sums over
    the sampled supervised rows):

    * ``tx_ce_sum``, ``tx_ce_sq_sum``, ``tx_count``: the rows' cross-entropy, its square and their number;
      ``tx_total``: supervised rows in the whole batch; ``tx_positions``: its label positions;
    * ``tx_uniform_sum``: the cross-entropy against a uniform target (label smoothing ``e``: ``(1 - e) ce + e U``);
    * ``tx_range_sum``, ``tx_range_sq_sum``: the logits' range ``w`` and its square; ``tx_floor_sum``: the floor
      ``ln(1 + (V - 1) e^-w)`` of that range; ``tx_sigmoid_sum``: the cross-entropy of ``sigmoid(logits)``;
    * ``tx_beta_<k>``: the cross-entropy of ``TEMPERATURE_GRID[k] * logits``; ``tx_cap_<k>``: that of
      ``c * tanh(logits / c)`` for ``c = CAP_GRID[k]``;
    * ``tx_other``: 1 when the other alignment was taken (``both_alignments``: the one of lower cross-entropy,
      decided on the device); ``tx_conf_sum``, ``tx_conf_count``: the cross-entropy under the configured one.
    """
    x, t, targets, idx = _sampled(logits, labels, shift_labels, ignore_index, max_rows)
    logp = x.log_softmax(-1)
    f32 = torch.float32

    def nll(target: Tensor) -> tuple[Tensor, Tensor]:
        mask = (target != ignore_index) & (target >= 0) & (target < x.shape[-1])
        return -_picked(logp, target, mask), mask

    total = (targets != ignore_index).sum(dtype=f32)
    other = torch.zeros((), device=x.device)
    conf_ce, conf_mask = nll(t)  # the configured alignment's, kept whichever is scored below
    configured = {"tx_conf_sum": conf_ce[conf_mask].sum(), "tx_conf_count": conf_mask.sum(dtype=f32)}
    if both_alignments:
        _, other_targets = align(logits.detach(), labels.detach(), not shift_labels, ignore_index)
        t_other = other_targets.index_select(0, idx).to(x.device)
        (ce, mask), (ce_other, mask_other) = nll(t), nll(t_other)
        mean = torch.where(mask, ce, 0.0).sum() / mask.sum().clamp(min=1)
        mean_other = torch.where(mask_other, ce_other, 0.0).sum() / mask_other.sum().clamp(min=1)
        other = (mean_other < mean).to(f32)
        t = torch.where(other.bool(), t_other, t)
        total = torch.where(other.bool(), (other_targets != ignore_index).sum(dtype=f32), total)
    ce, mask = nll(t)
    zeros = torch.zeros_like(ce)
    picked = _picked(x, t, mask)
    out = {
        "tx_ce_sum": torch.where(mask, ce, zeros).sum(),
        "tx_ce_sq_sum": torch.where(mask, ce.square(), zeros).sum(),
        "tx_count": mask.sum(dtype=f32),
        "tx_total": total,
        "tx_positions": torch.tensor(float(targets.numel()), device=x.device),
        "tx_uniform_sum": torch.where(mask, -logp.mean(-1), zeros).sum(),
        "tx_other": other,
        **configured,
    }
    width = x.amax(-1) - x.amin(-1)
    out["tx_range_sum"] = torch.where(mask, width, zeros).sum()
    out["tx_range_sq_sum"] = torch.where(mask, width.square(), zeros).sum()
    out["tx_floor_sum"] = torch.where(mask, torch.log1p((x.shape[-1] - 1) * torch.exp(-width)), zeros).sum()
    # one pass over the sampled rows per multiplier and per cap, in chunks of at most 2^24 values (64 MB of float32)
    chunk = max(1, (1 << 24) // x.shape[-1])

    def summed(transform) -> Tensor:
        parts = [
            torch.where(
                mask[i : i + chunk],
                torch.logsumexp(transform(x[i : i + chunk]), -1) - transform(picked[i : i + chunk]),
                0.0,
            ).sum()
            for i in range(0, x.shape[0], chunk)
        ]
        return torch.stack(parts).sum() if parts else zeros.sum()

    for k, beta in enumerate(TEMPERATURE_GRID):
        out[f"tx_beta_{k}"] = summed(lambda v, b=beta: v * b)
    for k, cap in enumerate(CAP_GRID):
        out[f"tx_cap_{k}"] = summed(lambda v, c=cap: (v / c).tanh_().mul_(c))  # one temporary, as b * v
    out["tx_sigmoid_sum"] = summed(torch.sigmoid)  # a bound of width 1 that no cap c * tanh(v / c) is
    return out


# ---------------------------------------------------------------------------------------- one measured step's sums
OTHER_ALIGNMENT = "other_"
"""Prefix of the sums taken under the other label alignment (shifted by one position, or not)."""
INIT_SUMS = (
    *("ce_sum", "ce_count", "var_sum", "rows", "prob_rows", "logprob_rows", "supervised", "positions", "label_rows"),
    *("copies", "repeats", "count", "mask_share_top", "mask_share_count"),
    *(OTHER_ALIGNMENT + key for key in ("ce_sum", "ce_count")),
)
"""The sums :func:`step_sums` takes at step 0, in the order they are reduced."""
_ALIGNED = ("ce_sum", "ce_count", "own_ce_sum", "rolled_ce_sum", "rolled_count", "floor_sum", "range_sum")
LATE_SUMS = ("late_mask_top", "late_mask_count", "late_supervised", "late_positions")
"""At the check of a run whose step 0 was not seen (resumed from a checkpoint written without it): what step 0 would
have read to tell masked-LM labels (:func:`masked_input_sums` and the supervised share)."""
CHECK_SUMS = (
    *_ALIGNED,
    *("copies", "repeats", "count", "own_match", "rolled_match", "match_count", "range_sq_sum", "floor_count"),
    *(OTHER_ALIGNMENT + key for key in (*_ALIGNED, "range_sq_sum", "floor_count")),
    *LATE_SUMS,
    "seq_labels",
)
"""The sums :func:`step_sums` takes at the check, besides :data:`TRANSFORM_SUMS`."""
TRANSFORM_SUMS = (
    *("tx_ce_sum", "tx_ce_sq_sum", "tx_count", "tx_total", "tx_positions", "tx_uniform_sum", "tx_range_sum"),
    *("tx_range_sq_sum", "tx_floor_sum", "tx_sigmoid_sum", "tx_conf_sum", "tx_conf_count"),
    *(f"tx_beta_{k}" for k in range(len(TEMPERATURE_GRID))),
    *(f"tx_cap_{k}" for k in range(len(CAP_GRID))),
)
"""The sums of :func:`loss_transform_sums` reduced on the compared steps (the check's and the two before it)."""
PHASE_SUMS = {"init": INIT_SUMS, "compare": TRANSFORM_SUMS, "check": (*CHECK_SUMS, *TRANSFORM_SUMS)}
"""The sums :func:`step_sums` takes in each phase, in the order they are reduced."""


def step_sums(
    phase: str,
    logits: Tensor,
    labels: Tensor,
    inputs: Tensor | None,
    *,
    shift_labels: bool,
    vocab_size: int,
    masked_lm: bool = False,
    inputs_are_ids: bool = True,
    late: bool = False,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    max_rows: int = 2048,
) -> dict[str, Tensor]:
    """Every sum LossAtInit reduces on one measured step (:data:`PHASE_SUMS`), on the device (no sync).

    ``shift_labels``: the alignment to score; where either is possible (a time dimension, not ``masked_lm``) the sums
    that tell which one the returned loss follows are taken under the other too (:data:`OTHER_ALIGNMENT`).
    ``inputs``: token ids shaped like the labels, else ignored; ``inputs_are_ids``: not the labels standing in for
    them; ``late``: step 0 was not seen (:data:`LATE_SUMS`).
    """
    options: dict[str, Any] = {"ignore_index": ignore_index, "max_rows": max_rows}
    both = logits.ndim >= 3 and not masked_lm
    ids = inputs if inputs is not None and tuple(inputs.shape) == tuple(labels.shape) else None
    out: dict[str, Tensor] = {}
    if phase == "init":
        out = init_loss_sums(logits, labels, shift_labels=shift_labels, label_smoothing=label_smoothing, **options)
        if both:
            other = init_loss_sums(
                logits, labels, shift_labels=not shift_labels, label_smoothing=label_smoothing, **options
            )
            out.update({OTHER_ALIGNMENT + k: other[k] for k in ("ce_sum", "ce_count")})
        if ids is not None:  # masked-LM labels: most supervised inputs are one token (the mask)
            out.update(masked_input_sums(ids, labels, vocab_size, ignore_index))
    elif phase == "check":
        out = _check_sums(logits, labels, shift_labels, both, label_smoothing, options)
        # one label per sequence (a classifier's (B,) labels beside (B, C) logits): from the shapes, no sync
        per_sequence = labels.ndim == 1 and logits.ndim == 2 and labels.shape[0] == logits.shape[0] > 1
        out["seq_labels"] = torch.tensor(float(per_sequence), device=logits.device)
        if ids is not None and inputs_are_ids:
            out.update(_label_relation_sums(ids, labels, vocab_size, ignore_index, masked_lm))
        if ids is not None and late:
            out.update(_late_sums(ids, labels, vocab_size, ignore_index))
    if phase in ("compare", "check"):  # the returned loss against these logits (and transforms of them)
        out.update(loss_transform_sums(logits, labels, shift_labels=shift_labels, both_alignments=both, **options))
    # the copy rate at init too: with tied input/output embeddings an untrained model already predicts its current
    # token, and only a rise from there says the model learned to copy
    if phase != "compare" and ids is not None and logits.ndim == 3 and tuple(ids.shape) == tuple(logits.shape[:2]):
        out.update(copy_sums(logits, ids, labels != ignore_index, max_rows=max_rows))
    return out


def _check_sums(
    logits: Tensor, labels: Tensor, shift: bool, both: bool, label_smoothing: float, options: dict[str, Any]
) -> dict[str, Tensor]:
    """The check's sums under each possible alignment: the logits' cross-entropy, against the own and the rolled
    labels (:func:`rolled_label_sums`), and the floor of their range (:func:`bounded_floor_sums`)."""
    out: dict[str, Tensor] = {}
    for prefix, shifted in (("", shift), (OTHER_ALIGNMENT, not shift)) if both else (("", shift),):
        ce = init_loss_sums(logits, labels, shift_labels=shifted, label_smoothing=label_smoothing, **options)
        sums = {"ce_sum": ce["ce_sum"], "ce_count": ce["ce_count"]}
        sums.update(rolled_label_sums(logits, labels, shift_labels=shifted, **options))
        sums.update(bounded_floor_sums(logits, labels, shift_labels=shifted, **options))
        out.update({prefix + k: v for k, v in sums.items()})
    return out


def _label_relation_sums(
    inputs: Tensor, labels: Tensor, vocab_size: int, ignore_index: int, masked_lm: bool
) -> dict[str, Tensor]:
    """Whether the labels belong to their own inputs or a neighbour's (:func:`label_input_match_sums`). Masked-LM
    labels never repeat their inputs (the input there is the mask): they belong to their own inputs when their
    supervised positions are where those inputs hold the mask token."""
    if not masked_lm:
        return label_input_match_sums(labels, inputs, ignore_index)
    own = masked_input_sums(inputs, labels, vocab_size, ignore_index)
    rolled = masked_input_sums(inputs.roll(1, 0), labels, vocab_size, ignore_index)
    return {
        "own_match": own["mask_share_top"],
        "rolled_match": rolled["mask_share_top"],
        "match_count": own["mask_share_count"],
    }


def _late_sums(inputs: Tensor, labels: Tensor, vocab_size: int, ignore_index: int) -> dict[str, Tensor]:
    """:data:`LATE_SUMS`: step 0 unseen, its masked-LM reading is taken at the check instead."""
    late = masked_input_sums(inputs, labels, vocab_size, ignore_index)
    return {
        "late_mask_top": late["mask_share_top"],
        "late_mask_count": late["mask_share_count"],
        "late_supervised": (labels != ignore_index).sum(dtype=torch.float32),
        "late_positions": torch.tensor(float(labels.numel()), device=labels.device),
    }


UNIGRAM_BATCHES = 8
"""The labels' unigram entropy is counted over this many measured batches (every rank's), then kept."""


class LabelFrequencies:
    """The supervised labels' class counts over the first ``batches`` measured batches (on the device, no sync),
    travelling in the step's one reduction (:attr:`payload`), and their unigram entropy once reduced
    (:meth:`receive`); then only the entropy is kept."""

    def __init__(self, batches: int = UNIGRAM_BATCHES) -> None:
        self.batches = batches
        self.restore(None)

    def restore(self, entropy: float | None) -> None:
        """Start again, or from an entropy measured before (a resumed run: nothing more is counted)."""
        self.entropy = entropy  # nats, of the labels counted over every rank; None until known
        self.counts: Tensor | None = None  # this rank's counts so far
        self.counted = self.batches if entropy is not None else 0

    @property
    def done(self) -> bool:
        """The entropy is known and the counts are let go."""
        return self.entropy is not None and self.counts is None

    @property
    def payload(self) -> Tensor | None:
        """The counts to add up over the ranks, or None when nothing is being counted."""
        return self.counts if self.counted > 0 else None

    def add(self, labels: Tensor | None, vocab_size: int | None, device: torch.device, ignore_index: int) -> None:
        """Count one measured batch's supervised labels, until ``batches`` were counted (once the vocabulary size is
        known; a batch without integer labels counts as one with none)."""
        if vocab_size is None or self.counted >= self.batches or self.done:
            return
        self.counted += 1
        if self.counts is None:
            self.counts = torch.zeros(vocab_size, device=device)
        if labels is not None and not labels.is_floating_point():
            self.counts += label_counts(labels.to(device), vocab_size, ignore_index)

    def receive(self, entropy: float) -> None:
        """The entropy of the counts reduced so far (NaN: nothing counted yet); the counts go once all are in."""
        if not math.isfinite(entropy):
            return
        self.entropy = entropy
        if self.counted >= self.batches:
            self.counts = None
