"""Pure tensor math behind MaskProbe and CheckpointAudit: tolerances, logit differences, target alignment."""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor

from lightning_tfdebug.primitives.batch import IGNORE_INDEX
from lightning_tfdebug.primitives.calls import read_objective

Alignment = Literal["next", "current", "next_next", "unknown"]

# Relative tolerance of a probe's logit comparison, by the dtype the logits were computed in. A model that is truly
# causal gives bit-identical logits in fp32 (masked attention weights are exact zeros); the tolerance leaves room for
# kernels that reorder sums, and for the coarser rounding of half precision.
_RELATIVE_TOLERANCE = {torch.float64: 1e-7, torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 5e-3}


def relative_tolerance(dtype: torch.dtype) -> float:
    """The relative tolerance used for logits of ``dtype`` (fp8 and unknown dtypes get the bf16 one)."""
    return _RELATIVE_TOLERANCE.get(dtype, _RELATIVE_TOLERANCE[torch.bfloat16])


def logit_tolerance(reference: Tensor, compute_dtype: torch.dtype | None = None) -> Tensor:
    """Absolute tolerance for comparing logits against ``reference``: the relative tolerance of ``compute_dtype``
    (default: the logits' dtype) times the largest |logit|. A 0-d tensor on the device (no host sync)."""
    rtol = relative_tolerance(compute_dtype or reference.dtype)
    return reference.detach().float().abs().amax().clamp_min(1e-6) * rtol


def max_change(before: Tensor, after: Tensor, valid: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Largest absolute difference between two logit tensors ``(B, T, V)`` where ``valid`` ``(B, T)`` holds, and its
    ``(row, position)`` as a ``(2,)`` tensor; both stay on the device."""
    diff = (after.detach().float() - before.detach().float()).abs().amax(dim=-1)  # (B, T)
    if valid is not None:
        diff = torch.where(valid, diff, torch.zeros_like(diff))
    flat = diff.flatten().argmax()
    where = torch.stack([flat // diff.shape[1], flat % diff.shape[1]])
    return diff.flatten()[flat], where


def causal_valid_positions(batch: int, length: int, cut: int, device: torch.device) -> Tensor:
    """``(B, T)`` bool: the positions ``<= cut`` whose logits must not depend on tokens after ``cut``."""
    return (torch.arange(length, device=device) <= cut).expand(batch, length)


def alignment_losses(
    logits: Tensor, labels: Tensor, ignore_index: int = IGNORE_INDEX, offset: int = 0
) -> dict[str, Tensor]:
    """Mean cross-entropy of ``logits`` ``(B, L, V)`` against ``labels`` ``(B, T)``, position t against label t+1
    (``"shifted"``), t (``"unshifted"``) and t+2 (``"shifted2"``); NaN where no position has its label. The logits'
    position t stands at the labels' t + ``offset`` (a call fed the rows from that column on); the labels may run
    past the logits."""
    logits = logits.detach().float()
    labels = labels.long()
    length, available = logits.shape[1], labels.shape[1] - offset

    def loss(ahead: int) -> Tensor:
        n = min(length, available - ahead)
        if n < 1:
            return logits.new_tensor(float("nan"))
        target = labels[:, offset + ahead : offset + ahead + n]
        return F.cross_entropy(logits[:, :n].flatten(0, 1), target.flatten(), ignore_index=ignore_index)

    return {"shifted": loss(1), "unshifted": loss(0), "shifted2": loss(2)}


def labels_relation(
    input_ids: Tensor, labels: Tensor, ignore_index: int = IGNORE_INDEX
) -> Literal["inputs", "preshifted", "other"]:
    """How the supervised labels relate to the inputs: equal to them (``"inputs"``: the loss must shift), already
    shifted by one (``"preshifted"``: ``labels[t] == input_ids[t+1]``), or ``"other"``. One host sync: probe steps."""
    counts = read_objective(input_ids, labels, ignore_index)
    if counts.supervised == 0:
        return "other"
    if counts.same == counts.supervised:
        return "inputs"
    if counts.supervised_next > 0 and counts.following == counts.supervised_next:
        return "preshifted"
    return "other"


def classify_alignment(
    returned: float,
    shifted: float,
    unshifted: float,
    relation: str,
    rtol: float,
    shifted2: float = float("nan"),
) -> tuple[Alignment, str | None]:
    """Which target the module's loss trains position t to predict.

    Args:
        returned: the loss the module's ``training_step`` returned on the probe batch.
        shifted / unshifted / shifted2: the losses of the same logits under the alignments of
            :func:`alignment_losses` (``shifted2``: position t against label t+2; NaN to leave it out).
        relation: :func:`labels_relation` of the batch's labels to its inputs.
        rtol: relative tolerance of a match.

    Returns:
        ``(alignment, matched)``: ``"next"`` (correct for a causal LM), ``"current"`` (the model learns to copy its
        input), ``"next_next"`` (shifted twice: in the data and the loss, or twice in the loss), or ``"unknown"``
        when the loss matches no alignment or the matched one cannot be told apart from another; ``matched`` names
        the alignment the loss matched.
    """
    tol = rtol * max(1.0, abs(returned))
    if abs(shifted - unshifted) <= 4 * tol:
        return "unknown", None  # indistinguishable on this batch
    candidates = {"shifted": shifted, "unshifted": unshifted}
    if shifted2 == shifted2:
        candidates["shifted2"] = shifted2
    matches = [name for name, value in candidates.items() if abs(returned - value) <= tol]
    if len(matches) != 1:
        return "unknown", None
    matched = matches[0]
    if any(abs(candidates[matched] - v) <= 4 * tol for name, v in candidates.items() if name != matched):
        return "unknown", None  # the matched alignment is not distinguishable from another on this batch
    if relation == "inputs":
        return {"shifted": "next", "unshifted": "current", "shifted2": "next_next"}[matched], matched  # type: ignore[return-value]
    if relation == "preshifted":
        return {"shifted": "next_next", "unshifted": "next", "shifted2": "unknown"}[matched], matched  # type: ignore[return-value]
    return "unknown", matched


def padding_side(attention_mask: Tensor) -> Literal["right", "left", "none"]:
    """Which side a batch pads on, from its ``(B, T)`` attention mask (1 = real token). Host syncs."""
    mask = attention_mask.bool()
    if bool(mask.all()):
        return "none"
    pads_first, pads_last = bool((~mask[:, 0]).any()), bool((~mask[:, -1]).any())
    return "left" if pads_first and not pads_last else "right"


def other_ids(vocab: Tensor, current: Tensor, generator: torch.Generator | None = None) -> Tensor:
    """Ids of ``current``'s shape drawn from the sorted distinct ids ``vocab``, each different from ``current``'s
    where ``vocab`` holds two ids or more."""
    idx = torch.randint(0, vocab.numel(), tuple(current.shape), generator=generator, device="cpu").to(vocab.device)
    new, alt = vocab[idx], vocab[(idx + 1) % vocab.numel()]
    return torch.where(new == current, alt, new).to(current.dtype)


def replace_after(
    input_ids: Tensor, cut: int, generator: torch.Generator | None = None, vocab: Tensor | None = None
) -> Tensor:
    """A copy of ``input_ids`` whose tokens after position ``cut`` are :func:`other_ids` of ``vocab`` (default: the
    batch's distinct ids)."""
    out = input_ids.clone()
    vocab = torch.unique(input_ids) if vocab is None else vocab
    if out[:, cut + 1 :].numel() and vocab.numel() >= 2:
        out[:, cut + 1 :] = other_ids(vocab, input_ids[:, cut + 1 :], generator)
    return out


def relative_difference(a: float, b: float) -> float:
    """``|a - b| / max(1, |a|, |b|)``: how far two host scalars are apart."""
    return abs(a - b) / max(1.0, abs(a), abs(b))
