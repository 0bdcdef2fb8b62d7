"""MaskProbe's probes and decisions, without a Trainer: how to call the model, the inputs each probe builds, and the
rule that turns each probe's measured numbers into a finding.

The probe constructions return tensors (no host sync); the ``decide_*`` functions take host floats (after the
callback's one transfer per probing step) and return a :class:`~lightning_tfdebug.functional.verdicts.Verdict` or
None. The tensor comparisons themselves (tolerances, largest logit change, alignment losses) are in
:mod:`lightning_tfdebug.functional.probes`.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor, nn

from lightning_tfdebug.core.batch import MASK_KEYS, is_id_tensor
from lightning_tfdebug.functional.probes import classify_alignment, padding_side, random_ids_like
from lightning_tfdebug.functional.verdicts import Verdict

ALIGNMENT_RETRY_STEPS = (1, 5, 20, 50, 100, 200, 500)
ORDER_STEPS = (100, 200, 500)
"""Steps at which the token-order check runs until it decides. Not before step 100: attention of a freshly initialised
model is nearly uniform, so its outputs hardly depend on token order even when positions reach it."""
"""Steps at which a target-alignment check that could not decide yet (losses of the two alignments too close on a
freshly initialised model) is tried again. Fixed, so every rank tries at the same steps."""

# Relative tolerance of "the loss training_step returned equals the loss recomputed from the same logits".
_ALIGN_RTOL = {torch.float64: 1e-9, torch.float32: 2e-5}
_ALIGN_RTOL_HALF = 1e-3


# ------------------------------------------------------------------------------------------------- calling the model
@dataclass(frozen=True)
class ModelCaller:
    """How to call the model with ``(input_ids, attention_mask)``: ``call`` does it; ``takes_mask`` says whether
    the mask reaches the model; ``mask_named`` whether the forward names a mask argument (not only ``**kwargs``)."""

    call: Callable[[Tensor, Tensor | None], Any]
    takes_mask: bool
    mask_named: bool


def build_caller(
    module: nn.Module,
    forward_fn: Callable[..., Any] | None = None,
    input_key: str | None = None,
    mask_key: str | None = None,
) -> ModelCaller | str:
    """A :class:`ModelCaller` for ``module``, or a sentence saying why it cannot be called.

    With ``forward_fn``, ``forward_fn(module, input_ids, attention_mask)``. Otherwise from ``module.forward``'s
    signature: the ids by keyword (``input_key`` when the forward names it, else ``input_ids``; any name under
    ``**kwargs``), else as the first positional argument; the mask by the first of ``mask_key`` and the usual mask
    names (:data:`~lightning_tfdebug.core.batch.MASK_KEYS`) that the forward names, or as ``mask_key`` (default
    ``attention_mask``) under ``**kwargs``.
    """
    if forward_fn is not None:
        fn = forward_fn
        return ModelCaller(lambda ids, mask: fn(module, ids, mask), takes_mask=True, mask_named=True)
    try:
        params = inspect.signature(module.forward).parameters
    except (TypeError, ValueError):
        return "the signature of `forward` cannot be read; set `forward_fn`."
    var_kw = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    names = (mask_key, *MASK_KEYS) if mask_key is not None else MASK_KEYS
    mask_name = next((n for n in names if n in params), None)
    mask_named = mask_name is not None
    if mask_name is None and var_kw:
        mask_name = mask_key or "attention_mask"
    takes_mask = mask_name is not None
    if (input_key is not None and input_key in params) or "input_ids" in params or var_kw:
        id_name = input_key if input_key is not None and (input_key in params or var_kw) else "input_ids"

        def call_kw(ids: Tensor, mask: Tensor | None) -> Any:
            kwargs: dict[str, Any] = {id_name: ids}
            if mask_name is not None and mask is not None:
                kwargs[mask_name] = mask
            return module(**kwargs)

        return ModelCaller(call_kw, takes_mask, mask_named)
    positional = [
        p
        for p in params.values()
        if p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    ]
    if positional:

        def call_pos(ids: Tensor, mask: Tensor | None) -> Any:
            if mask_name is not None and mask is not None:
                return module(ids, **{mask_name: mask})
            return module(ids)

        return ModelCaller(call_pos, takes_mask, mask_named)
    return "`forward` takes neither `input_ids` by keyword nor the ids positionally; set `forward_fn`."


# ----------------------------------------------------------------------------------------------------- the objective
def no_token_ids_reason(leaves: dict[str, Any], input_key: str | int | None) -> str:
    """Why the batch gives the token probes no ids, in the words of what it holds (``leaves``: the batch's leaves by
    path, from :func:`~lightning_tfdebug.core.batch.flatten_batch`)."""
    tensors = {path: value for path, value in leaves.items() if isinstance(value, Tensor)}

    def named(path: str) -> str:
        return f"`{path}`" if path else "the batch itself"

    described = ", ".join(
        f"{named(path)} {str(t.dtype).replace('torch.', '')} {tuple(t.shape)}" for path, t in list(tensors.items())[:4]
    )
    if input_key is not None:
        return (
            f"`input_key={input_key!r}` names no 2-D integer tensor of the batch (it holds "
            f"{described or 'no tensor'}); the token probes need the token ids."
        )
    if tensors and not any(is_id_tensor(t) for t in tensors.values()):
        return (
            f"the batch holds no integer tensor, only {described} (embeddings or features fed to the model "
            "directly?): the token probes perturb token ids, and there are none to perturb."
        )
    return (
        f"the batch holds no 2-D integer token ids by name or position (it holds {described or 'no tensor'}); "
        "the token probes need them."
    )


def objective_counts(input_ids: Tensor, labels: Tensor, ignore_index: int) -> Tensor:
    """``(4,)`` device tensor: supervised labels, labels equal to their input, labels equal to the next input, and
    supervised labels that have a next input. Read by :func:`decide_objective` after one host transfer."""
    supervised = labels != ignore_index
    same = ((labels == input_ids) & supervised).sum()
    following = ((labels[:, :-1] == input_ids[:, 1:]) & supervised[:, :-1]).sum()
    return torch.stack([supervised.sum(), same, following, supervised[:, :-1].sum()])


def decide_objective(
    supervised: float, same: float, following: float, supervised_next: float, label_positions: int
) -> Verdict | None:
    """Decoder (None) or encoder (``TFD212``), from what the labels ask the model to predict (:func:`objective_counts`).

    Labels equal to the inputs (shifted inside the model) or to the next inputs (shifted in the data) at half or
    more of the supervised positions are a next-token objective; anything else is masked-LM or denoising.
    """
    if supervised == 0 or same >= 0.5 * supervised or following >= 0.5 * max(supervised_next, 1.0):
        return None
    same_frac, next_frac = same / supervised, following / max(supervised_next, 1.0)
    return Verdict(
        "TFD212",
        f"Treated as an encoder: at the supervised positions the labels equal the inputs {same_frac:.0%} of the "
        f"time and the next inputs {next_frac:.0%} (a next-token objective has one of them near 100%), so the "
        "objective is masked-LM or denoising. Causality and target alignment are not checked.",
        {"same_frac": same_frac, "next_frac": next_frac, "supervised_frac": supervised / max(label_positions, 1)},
    )


# ------------------------------------------------------------------------------------------------ probe constructions
def causal_cut(length: int) -> int:
    """The last position whose logits must not move when the tokens after it are replaced (the middle)."""
    return length // 2 - 1


def masked_block(input_ids: Tensor, generator: torch.Generator) -> tuple[Tensor, Tensor, int] | None:
    """``(mask, other_ids, k)``: a mask hiding a block of ``k`` (a quarter of the) positions after the first, and a
    copy of the ids whose masked positions hold other ids. None when the sequence is too short to keep 2 real
    positions.

    Position 0 stays real so that no query has every key masked (a fully masked softmax row is NaN in many
    implementations, and would leak into later layers whatever the mask does); with a causal model the real positions
    after the block are the ones that test the mask.
    """
    b, t = input_ids.shape
    k = max(1, t // 4)
    if t - k < 2:
        return None
    mask = torch.ones_like(input_ids)
    mask[:, 1 : 1 + k] = 0
    other = input_ids.clone()
    other[:, 1 : 1 + k] = random_ids_like(input_ids, (b, k), generator)
    return mask, other, k


def probe_padding_side(setting: Literal["auto", "right", "left"], attention_mask: Tensor | None) -> str:
    """The side to add padding on: ``setting``, or with ``"auto"`` the side the batch pads (right when it does not
    pad or has no mask). Host sync when it reads the mask (probe step only)."""
    if setting != "auto":
        return setting
    detected = padding_side(attention_mask) if attention_mask is not None else "none"
    return "left" if detected == "left" else "right"


def padding_extra(length: int, context_limit: int | None) -> tuple[int, int]:
    """``(length, extra)``: the padding to add (a quarter of the positions) and the sequence length cut so that the
    padded sequence stays within ``context_limit``. A length under 2 means there is no room for the probe."""
    extra = max(1, length // 4)
    if context_limit is not None and length + extra > context_limit:
        length = context_limit - extra
    return length, extra


def add_padding(
    input_ids: Tensor, real: Tensor, side: str, extra: int, generator: torch.Generator
) -> tuple[Tensor, Tensor, slice]:
    """``(ids, mask, keep)``: ``extra`` padding positions (random ids, mask 0) added on ``side``; ``keep`` selects the
    original positions in the longer sequence's time dimension."""
    pad_ids = random_ids_like(input_ids, (input_ids.shape[0], extra), generator)
    pad_mask = torch.zeros_like(pad_ids)
    t = input_ids.shape[1]
    if side == "right":
        return torch.cat([input_ids, pad_ids], 1), torch.cat([real, pad_mask], 1), slice(0, t)
    return torch.cat([pad_ids, input_ids], 1), torch.cat([pad_mask, real], 1), slice(extra, extra + t)


def long_row(row: Tensor, length: int) -> Tensor:
    """``row`` ``(1, T)`` repeated to at least ``length`` tokens (the context-limit probes cut it)."""
    return row.repeat(1, -(-length // row.shape[1]))


# ------------------------------------------------------------------------------------------------------- decisions
def _beyond(change: float, tolerance: float) -> bool:
    return not change <= tolerance  # also NaN


def decide_repeat(change: float, row: int, position: int, tolerance: float) -> Verdict | None:
    """``TFD213`` when two eval-mode forwards of the same tokens differ beyond the tolerance."""
    if not _beyond(change, tolerance):
        return None
    return Verdict(
        "TFD213",
        f"The model is not a function of its input in eval mode: the same tokens twice gave logits that differ by "
        f"{change:.3g} at position {position} (row {row}; tolerance {tolerance:.2g}). The other MaskProbe checks are "
        "skipped: they would measure this noise.",
        {"max_change": change, "position": position, "row": row, "tolerance": tolerance},
    )


def decide_causal(change: float, row: int, position: int, cut: int, length: int, tolerance: float) -> Verdict | None:
    """``TFD201`` when replacing the tokens after ``cut`` moved a logit at or before it beyond the tolerance."""
    if not _beyond(change, tolerance):
        return None
    return Verdict(
        "TFD201",
        f"Future tokens change past logits: replacing the tokens after position {cut} of a {length}-token sequence "
        f"changed the logits at position {position} (row {row}) by {change:.3g} (tolerance {tolerance:.2g}).",
        {"max_change": change, "position": position, "cut": cut, "tolerance": tolerance},
    )


def decide_padding(change: float, position: int, masked: int, tolerance: float) -> Verdict | None:
    """``TFD202`` when changing the ids under the mask moved a real token's logits beyond the tolerance."""
    if not _beyond(change, tolerance):
        return None
    return Verdict(
        "TFD202",
        f"Tokens under the attention mask change real tokens' logits: changing the ids at the {masked} masked "
        f"positions moved the logits at position {position} by {change:.3g} (tolerance {tolerance:.2g}).",
        {"max_change": change, "position": position, "tolerance": tolerance},
    )


def decide_pad_side(change: float, position: int, side: str, extra: int, tolerance: float) -> Verdict | None:
    """``TFD203`` when adding ``extra`` padding positions on ``side`` moved a real token's logits."""
    if not _beyond(change, tolerance):
        return None
    return Verdict(
        "TFD203",
        f"Logits of real tokens depend on the amount of padding: adding {extra} padding tokens on the {side} moved "
        f"the logits at real position {position} by {change:.3g} (tolerance {tolerance:.2g}).",
        {"max_change": change, "side": side, "extra": extra, "tolerance": tolerance},
    )


def decide_kv_cache(change: float, first_position: int, tolerance: float) -> Verdict | None:
    """``TFD209`` when incremental decoding's logits differ from the full forward's beyond the tolerance."""
    if not _beyond(change, tolerance):
        return None
    return Verdict(
        "TFD209",
        f"Incremental decoding disagrees with the full forward: logits differ by up to {change:.3g}, first at position "
        f"{first_position} (tolerance {tolerance:.2g}).",
        {"max_change": change, "first_position": first_position},
    )


def unpadded_mask_verdict(mask_key: str | None) -> Verdict:
    """``TFD204``: the batch pads but the model is called without a mask."""
    return Verdict(
        "TFD204",
        "The batch is padded (its attention mask has zeros) but the model is called without a mask, so attention "
        "cannot ignore the padding.",
        {"mask_key": mask_key},
    )


def context_failure_verdict(limit: int, error: BaseException) -> Verdict:
    """``TFD207``: the model fails on a sequence of its own context limit."""
    return Verdict(
        "TFD207",
        f"The model fails on a sequence of {limit} tokens, its context limit: {type(error).__name__}: {error}",
        {"context_limit": limit},
    )


def context_limit_verdict(limit: int, source: str = "") -> Verdict:
    """``TFD208`` (info): the context limit, where it was read, and that a sequence of that length runs.

    Nothing longer is ever sent to the model: past its limit a model fails natively (an inductor kernel aborts the
    process, CUDA raises a device-side assert), which no handler can catch."""
    where = f" (read from {source})" if source else ""
    return Verdict(
        "TFD208",
        f"Context limit: {limit} tokens{where}; a sequence of {limit} tokens runs. Longer batches must be cut or "
        "chunked before the forward.",
        {"context_limit": limit, "source": source},
    )


def alignment_rtol(logits_dtype: torch.dtype, loss_dtype: torch.dtype | None = None) -> float:
    """Relative tolerance of "the returned loss equals the loss recomputed from the same logits". A loss computed in
    bf16/fp16 carries a few units of that dtype's rounding."""
    rtol = _ALIGN_RTOL.get(logits_dtype, _ALIGN_RTOL_HALF)
    if loss_dtype is not None and loss_dtype.is_floating_point:
        rtol = max(rtol, 4 * torch.finfo(loss_dtype).eps)
    return rtol


def decide_alignment(
    returned: float,
    shifted: float,
    unshifted: float,
    shifted2: float,
    relation: str,
    rtol: float,
    last_try: bool,
) -> tuple[bool, Verdict | None]:
    """``(decided, verdict)`` of the target-alignment check from the losses of
    :func:`~lightning_tfdebug.functional.probes.alignment_losses`.

    ``TFD205``: the loss scores position t against token t (the model learns to copy). ``TFD206``: against token t+2
    (labels shifted twice). ``TFD210`` (info): the alignments differ but the loss matches none (label smoothing,
    auxiliary terms), or ``last_try`` came without a decision. ``decided`` is False while the losses are too close to
    tell the alignments apart (try again later).
    """
    alignment, matched = classify_alignment(returned, shifted, unshifted, relation, rtol, shifted2)
    evidence = {
        "loss_returned": returned,
        "loss_shifted": shifted,
        "loss_unshifted": unshifted,
        "loss_shifted2": shifted2,
        "labels_relation": relation,
    }
    if alignment == "current":
        return True, Verdict(
            "TFD205",
            f"Labels are not shifted: the loss training_step returned ({returned:.6g}) is the loss of position t "
            f"against token t ({unshifted:.6g}), not against token t+1 ({shifted:.6g}). A causal model trained this "
            "way learns to copy its input.",
            evidence,
        )
    if alignment == "next_next":
        where = (
            "the data already holds next-token labels and the loss shifts them again"
            if relation == "preshifted"
            else "the batch's labels equal its inputs and training_step shifts them twice (by hand, then again inside "
            "the model or the loss)"
        )
        two_ahead, one_ahead = (shifted, unshifted) if relation == "preshifted" else (shifted2, shifted)
        return True, Verdict(
            "TFD206",
            f"Labels are shifted twice: {where}, so position t is trained on token t+2 (returned {returned:.6g}, two "
            f"tokens ahead {two_ahead:.6g}, next token {one_ahead:.6g}).",
            evidence,
        )
    if alignment == "next" or matched is not None:  # correct, or labels unrelated to inputs (seq2seq)
        return True, None
    if abs(shifted - unshifted) > 4 * rtol * max(1.0, abs(returned)) or last_try:
        # the alignments differ but the loss matches neither (label smoothing, auxiliary terms, dropout)
        return True, Verdict(
            "TFD210",
            f"Target alignment undetermined: the loss training_step returned ({returned:.6g}) matches neither the "
            f"shifted ({shifted:.6g}) nor the unshifted ({unshifted:.6g}) cross-entropy of the logits.",
            evidence,
            hint=(
                "Expected with label smoothing, auxiliary losses or a loss over other outputs; otherwise check "
                "`labels_key` and `ignore_index`."
            ),
        )
    return False, None


# --------------------------------------------------------------------------------------------------------- token order
def order_probe_position(attention_mask: Tensor | None, length: int) -> int | None:
    """The position whose output the token-order check reads: the last one real in every probe row (right padding),
    None when the rows pad on the left or fewer than 4 positions are real everywhere. Host sync: probe steps only."""
    if attention_mask is None:
        return length - 1 if length >= 4 else None
    real = attention_mask.bool()
    if not bool(real[:, 0].all()):
        return None
    prefix = real.long().cumprod(dim=1).sum(dim=1)  # leading real positions per row
    p = int(prefix.min()) - 1
    return p if p >= 3 else None


def reorder_prefix(input_ids: Tensor, position: int) -> Tensor:
    """A copy of ``input_ids`` whose tokens before ``position`` are in reverse order (the token at it and after it
    unchanged)."""
    out = input_ids.clone()
    out[:, :position] = input_ids[:, :position].flip(1)
    return out


def decide_order(
    order_change: float, content_change: float, position: int, tolerance: float, step: int, last_try: bool
) -> tuple[bool, Verdict | None]:
    """``(decided, verdict)`` of the token-order check: ``TFD215`` when reversing the tokens before ``position`` left
    its output unchanged while replacing them moved it by far more than the tolerance: the model reads which tokens
    came before, not where. Decided without a finding as soon as order clearly matters."""
    if order_change > 10 * tolerance:
        return True, None
    if step < ORDER_STEPS[0] or not content_change > 100 * tolerance:
        return last_try, None
    if order_change > tolerance:
        return last_try, None
    return True, Verdict(
        "TFD215",
        f"The model ignores token order: reversing the {position} tokens before position {position} left its output "
        f"unchanged (largest change {order_change:.3g}, tolerance {tolerance:.2g}) while replacing them moved it by "
        f"{content_change:.3g}. No position information reaches the attention.",
        {
            "order_change": order_change,
            "content_change": content_change,
            "position": position,
            "tolerance": tolerance,
            "step": step,
        },
    )
