"""MaskProbe's model kind measured, not read from the labels: with ``causal=None`` and labels that ask for no
next-token objective, a perturbation tells a causal model from a bidirectional one, and the labels are judged against
that kind (``TFD210`` at warning: a causal LM whose labels are neither its inputs nor its next inputs; ``TFD212``: a
bidirectional model, an encoder's objective).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from lightning_tfdebug.callbacks.mask_probe.alignment_checks import TFD210, decide_objective
from lightning_tfdebug.functional.probes import causal_valid_positions, logit_tolerance, max_change, replace_after
from lightning_tfdebug.functional.verdicts import Verdict
from lightning_tfdebug.primitives.calls import Objective

MATCH_FRACTION = 0.5
"""A relation of the labels to some inputs is named when it holds at this fraction of the supervised positions or more
(the share :attr:`~lightning_tfdebug.primitives.calls.Objective.next_token` asks of a next-token objective)."""


@dataclass(frozen=True)
class KindMeasure:
    """The kind measured by perturbation (host numbers): the tokens after position ``cut`` of the probe rows replaced,
    how far the outputs at and before ``cut`` moved.

    Attributes:
        causal: True: they did not move (a causal model); False: they moved; None: not measured (``why``).
        change: the largest logit change at positions ``<= cut``.
        tolerance: the comparison's tolerance: fp32's relative tolerance times the largest |logit|, in every dtype.
        noise: how far a second pass of the same tokens moved the outputs (beyond ``tolerance``: not measured).
        cut: the last position that must not see the replaced tokens.
        length: the probe rows' length.
        width: the outputs' last dimension (the vocabulary of a language-model head).
        why: why the kind was not measured.
    """

    causal: bool | None
    change: float = float("nan")
    tolerance: float = float("nan")
    noise: float = float("nan")
    cut: int = 0
    length: int = 0
    width: int = 0
    why: str = ""

    def said(self) -> str:
        """The measurement in words."""
        if self.causal is None:
            return f"the kind could not be measured ({self.why}), so it is read from the labels"
        tolerance = f"tolerance {self.tolerance:.2g}"
        moved = (
            f"left the outputs at and before it unchanged (largest change {self.change:.3g}, {tolerance})"
            if self.causal
            else f"moved the outputs at and before it by {self.change:.3g} ({tolerance})"
        )
        kind = "causal" if self.causal else "bidirectional"
        return f"the model is {kind}: replacing the tokens after position {self.cut} of {self.length} {moved}"


def measure_kind(
    logits: Callable[[Tensor, Tensor], Tensor], ids: Tensor, generator: torch.Generator, pool: Tensor
) -> KindMeasure:
    """The kind of the model behind ``logits(ids, mask)``, on the probe rows ``ids``: the same tokens twice (an eval
    forward must repeat), then the tokens after the middle replaced by other ids of ``pool``. Causal when the outputs
    at and before the middle stay within fp32's tolerance whatever the compute dtype (masked attention weights are
    exact zeros): a bidirectional model at init in bf16 moves them by less than bf16's tolerance, but not by that
    little. Host sync: one, at the first probe of a fit with ``causal=None`` and labels that are not next-token
    labels."""
    b, t = ids.shape
    if t < 4:
        return KindMeasure(None, why=f"the probe rows hold {t} tokens, fewer than 4")
    cut = t // 2 - 1
    ones = torch.ones_like(ids)
    base = logits(ids, ones)
    noise = max_change(base, logits(ids, ones))[0]
    changed = logits(replace_after(ids, cut, generator, pool), ones)
    change = max_change(base, changed, causal_valid_positions(b, t, cut, ids.device))[0]
    tolerance = logit_tolerance(base, torch.float32)  # fp32's, in every dtype: a causal model's outputs stay exact
    values = torch.stack([change.float(), tolerance.float(), noise.float()]).tolist()  # host sync: once per fit
    change_, tolerance_, noise_ = (float(v) for v in values)
    width = int(base.shape[-1])
    if not noise_ <= tolerance_:  # (NaN too) a forward that does not repeat cannot tell the kind
        return KindMeasure(None, change_, tolerance_, noise_, cut, t, width, why="the eval forward does not repeat")
    return KindMeasure(change_ <= tolerance_, change_, tolerance_, noise_, cut, t, width)


# ------------------------------------------------------------------------------------------------ the labels' relation
RELATIONS: dict[str, str] = {
    "own": "the inputs at their position",
    "next": "the next inputs",
    "previous_row": "the previous sample's inputs",
    "previous_row_next": "the previous sample's next inputs",
    "next_row": "the next sample's inputs",
    "next_row_next": "the next sample's next inputs",
}
"""What each measured relation of :func:`label_relations` compares the labels with."""


def label_relations(input_ids: Tensor, labels: Tensor, ignore_index: int) -> dict[str, float]:
    """The fraction of supervised labels equal to each comparison of :data:`RELATIONS`: the sample's own inputs at
    shift 0 and 1, and its neighbours' along the batch (the rows rolled by one either way) at shift 0 and 1. Host
    sync: one (on the probe that measures the kind)."""
    supervised = labels != ignore_index
    counts = [supervised.sum(), supervised[:, :-1].sum()]
    for ids in (input_ids, input_ids.roll(1, 0), input_ids.roll(-1, 0)):  # its own row, the previous, the next
        counts.append(((labels == ids) & supervised).sum())
        counts.append(((labels[:, :-1] == ids[:, 1:]) & supervised[:, :-1]).sum())
    n, n_next, *matches = (float(c) for c in torch.stack(counts).tolist())
    names = ("own", "next", "previous_row", "previous_row_next", "next_row", "next_row_next")
    single_row = input_ids.shape[0] < 2  # a row rolled onto itself is no neighbour
    return {
        name: 0.0 if (single_row and "row" in name) else m / max(n_next if name.endswith("next") else n, 1.0)
        for name, m in zip(names, matches)
    }


def covers_vocabulary(
    width: int, input_ids: Tensor, labels: Tensor, ignore_index: int, model: nn.Module | None
) -> bool:
    """Whether outputs ``width`` wide are over the input vocabulary (a language-model head), not a few classes (a
    token classifier): wider than every input id and label, and at least as wide as the model's token embedding (the
    smallest ``nn.Embedding`` with more rows than the largest id), when it has one. Host sync: the largest ids."""
    supervised = labels[labels != ignore_index]
    top = int(torch.stack([input_ids.max(), supervised.max() if supervised.numel() else input_ids.max()]).max())
    if width <= top:
        return False
    tables = [m.num_embeddings for m in (model.modules() if model is not None else ()) if isinstance(m, nn.Embedding)]
    token_rows = min((rows for rows in tables if rows > top), default=None)
    return token_rows is None or width >= token_rows


# ---------------------------------------------------------------------------------------------------------- decision
@dataclass(frozen=True)
class KindJudgement:
    """What the measured kind makes of the labels: the verdict, whether the model is causal, and why label alignment
    does not apply (None: it applies, or a finding answers it)."""

    verdict: Verdict | None
    causal: bool
    not_applicable: str | None = None


def judge_labels(
    measured: KindMeasure, objective: Objective, relations: dict[str, float], over_vocabulary: bool
) -> KindJudgement:
    """The labels (``objective``: not a next-token objective) judged against the ``measured`` kind: a causal model over
    the input vocabulary gets ``TFD210`` at warning, naming the relation measured; a causal token classifier nothing;
    a bidirectional or unmeasured model ``TFD212`` (an encoder's objective)."""
    if not measured.causal:
        return KindJudgement(decide_objective(objective, measured=measured.said()), causal=False)
    if not over_vocabulary:
        why = (
            f"the model is causal but its {measured.width} outputs per position are not over the input vocabulary (a "
            "token classifier): its labels are classes, not tokens."
        )
        return KindJudgement(None, causal=True, not_applicable=why)
    best = max(RELATIONS, key=lambda name: relations[name])
    found = (
        f"they are {RELATIONS[best]} ({relations[best]:.0%} of the supervised positions)"
        if relations[best] >= MATCH_FRACTION
        else f"they match no sample's inputs at shift 0 or 1 (best: {RELATIONS[best]}, {relations[best]:.0%})"
    )
    detail = (
        f"{measured.said()}, and its outputs are over the input vocabulary ({measured.width} wide), but its labels "
        f"equal neither the inputs ({relations['own']:.0%} of the supervised positions; the model or its loss "
        f"shifts them) nor the next inputs ({relations['next']:.0%}; shifted in the data): {found}. A causal LM "
        "trained on them learns no next token"
    )
    evidence = {
        **{f"labels_{name}": relations[name] for name in RELATIONS},
        "causal_max_change": measured.change,
        "causal_tolerance": measured.tolerance,
        "vocab_width": measured.width,
    }
    hint = (
        "Give each sample its own labels: equal to its input_ids (padding as -100) when the model or the loss shifts "
        "them (Hugging Face causal LMs do), or input_ids shifted by one when the loss does not. Look for labels "
        "rolled, shuffled, sorted or truncated apart from the inputs in the collator or the dataset. If the model "
        "is meant to predict something else per token, set `causal=True` and `check_targets=False`."
    )
    verdict = TFD210.verdict(
        evidence, severity="warning", hint=hint, state="wrong", detail=detail, misaligned=found.split(" (")[0]
    )
    return KindJudgement(verdict, causal=True)


def judge(
    session: Any, input_ids: Tensor, labels: Tensor, objective: Objective, model: nn.Module | None
) -> KindJudgement:
    """The kind measured on ``session``'s probe rows (a :class:`~.probes.MaskProbes` under ``no_grad``, the model in
    eval mode) and the batch's ``labels`` judged against it (:func:`judge_labels`). Host syncs: a few, once per fit."""
    found = session.found
    if found is not None and found.primary is None:
        measured = KindMeasure(None, why="the call takes tensors made from the token ids, not the ids")
    else:
        ids = session.rows(session.columns(input_ids))
        measured = measure_kind(session.logits, ids, session.generator, session.pool)
    if not measured.causal:
        return judge_labels(measured, objective, {}, over_vocabulary=False)
    relations = label_relations(input_ids, labels, session.ignore_index)
    over = covers_vocabulary(measured.width, input_ids, labels, session.ignore_index, model)
    return judge_labels(measured, objective, relations, over)
