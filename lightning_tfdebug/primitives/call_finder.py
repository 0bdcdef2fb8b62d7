"""Finding the model among the calls a ``training_step`` made: :func:`find_model_call` reads the call that took the
token rows (where its ids, labels and mask sit, its logits) and :func:`model_kind` what the model is (pure; no
Trainer). The record itself is :mod:`lightning_tfdebug.primitives.calls`.

Example:
    >>> import torch
    >>> from lightning_tfdebug.primitives.calls import record_calls
    >>> model = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 10))
    >>> ids = torch.tensor([[1, 2, 3], [4, 5, 6]])
    >>> _, calls = record_calls(model, lambda: model(ids))
    >>> found = find_model_call(calls, ids, labels=ids)
    >>> found.kind, found.kind_source, found.shift, tuple(found.logits().shape)
    ('decoder', 'labels', 1, (2, 3, 10))
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from lightning_tfdebug.primitives.batch import LABELS_KEYS, MASK_KEYS, is_id_tensor, logits_of
from lightning_tfdebug.primitives.calls import (
    ROW_SLICES,
    ModelCall,
    ModelKind,
    Path,
    RecordedCall,
    TokenSlot,
    forward_parameters,
    read_logits,
    read_objective,
    relation_offset,
)

# ------------------------------------------------------------------------------------------------- finding the call
_Seq = tuple[Path, Tensor, bool]  # a token tensor of a call: (path, tensor, sequence-first)


@dataclass
class _Choice:
    call: RecordedCall
    seqs: list[_Seq]
    primary: Path | None
    columns: tuple[int, int | None]


def find_model_call(
    calls: Sequence[RecordedCall],
    input_ids: Tensor,
    attention_mask: Tensor | None = None,
    labels: Tensor | None = None,
    ignore_index: int = -100,
    model: nn.Module | None = None,
    kind: ModelKind | None = None,
) -> ModelCall | str:
    """The :class:`ModelCall` among ``calls`` that took the batch's token ids and returned logits, or why there is none.

    Which call is chosen: ``docs/callbacks/mask_probe.md`` (the recorded call). Every token tensor of the call is
    compared with ``labels`` (without labels, with the ids' next tokens) to read which carry them and at what offset.
    The kind is ``kind`` when given (``model_kind=``), else :func:`model_kind` (``model``: the LightningModule).
    Host syncs: recording steps only.
    """
    chosen = _choose(calls, input_ids)
    takes_ids = lambda c: any(is_id_tensor(t) and t.shape == input_ids.shape for _, t in c.leaves())  # noqa: E731
    if chosen is None and any(per_sequence_output(c.output, int(input_ids.shape[0])) and takes_ids(c) for c in calls):
        return (
            "the model's call returns one output per sequence ((batch, classes) logits): the per-position probes "
            "(causal mask, padding, label alignment, position tables) do not apply to it"
        )
    if chosen is None:
        names = ", ".join(sorted({type(c.module).__name__ for c in calls if c.depth == 0})) or "none"
        return (
            f"no call made in `training_step` takes the batch's token ids and returns logits (modules called: {names})"
        )
    call, (start, stop) = chosen.call, chosen.columns
    b = int(input_ids.shape[0])
    seq_first = next((sf for p, _, sf in chosen.seqs if p == chosen.primary), chosen.seqs[0][2])
    mask_path, inverted, mask_seq_first, opaque = _find_mask(
        call, None if attention_mask is None else attention_mask[:, start:stop]
    )
    seqs = [s for s in chosen.seqs if s[0] != mask_path]
    # the labels every slot is compared with: the batch's, else the ids' next tokens (virtual next-token labels)
    ref, base = _reference(input_ids, labels, b)
    shift = 0
    if labels is not None and chosen.primary is not None:
        shift = 1 if relation_offset(input_ids, ref, ignore_index, offsets=(0,)) == 0 else 0
    slots = [_slot(call, s, chosen.primary, ref, base, ignore_index) for s in seqs]
    found = ModelCall(
        call=call,
        kind="unknown",
        kind_source="",
        batch_size=b,
        slots=slots,
        ids_shift=shift,
        mask_path=mask_path,
        mask_inverted=inverted,
        mask_seq_first=mask_seq_first,
        mask_named=_names_a_mask(call),
        mask_opaque=opaque,
        out_seq_first=bool(seq_first),
        ignore_index=ignore_index,
        ids_start=start,
        ids_stop=stop,
        tensors=dict(call.leaves()),
    )
    found.kind, found.kind_source = (kind, "setting") if kind else model_kind(found, calls, model, input_ids, labels)
    return found


def per_sequence_output(output: Any, batch_size: int) -> bool:
    """Whether a call's logits are one row per sequence, ``(B, C)`` (a sequence classifier), not one per position."""
    logits = logits_of(output)
    return logits is not None and logits.ndim == 2 and int(logits.shape[0]) == batch_size


def _choose(calls: Sequence[RecordedCall], input_ids: Tensor) -> _Choice | None:
    """The call :func:`find_model_call` reads (see there); None when no call fits."""
    b, length = int(input_ids.shape[0]), int(input_ids.shape[1])
    top_id = int(input_ids.max()) if input_ids.numel() else -1  # host sync: recording steps only
    positional: _Choice | None = None  # takes the ids or a slice, one output per position it received
    other_length: _Choice | None = None  # takes the ids, outputs over other positions (a decoder's, a wrapper's)
    fallback: _Choice | None = None
    per_sequence: int | None = None  # the depth of a call that took the ids and returned one output per sequence
    for call in sorted(calls, key=lambda c: (c.depth, c.order)):
        if positional is not None or (per_sequence is not None and call.depth > per_sequence):
            break  # below a per-sequence model (a classifier's encoder) are hidden states, never its logits
        if isinstance(call.module, (nn.Embedding, nn.EmbeddingBag)):
            continue  # an embedding's output is hidden states, whatever its width
        seqs = [(p, t, sf) for p, t in call.leaves() if is_id_tensor(t) and (sf := _layout(t, b)) is not None]
        if not seqs:
            continue
        match = _ids_match(seqs, input_ids)
        seq_first = bool(match[1] if match is not None else seqs[0][2])
        if match is not None and per_sequence_output(call.output, b):
            per_sequence = call.depth
            continue
        logits = read_logits(call.output, b, seq_first)
        if logits is None or logits.shape[-1] <= top_id:
            continue  # no output, or one narrower than the token ids (an embedding's hidden states, not logits)
        if match is not None:
            path, _, columns = match
            received = length if columns == (0, None) else length - 1
            if logits.shape[1] == received:
                positional = _Choice(call, seqs, path, columns)
            elif columns == (0, None):
                other_length = other_length or _Choice(call, seqs, path, columns)
        elif call.depth == 0:
            fallback = fallback or _Choice(call, seqs, None, (0, None))
    # a wrapper fed the whole rows that returns the logits of rows[:, :-1] gives way to the inner call fed that slice
    if positional is not None and other_length is not None and other_length.call.depth < positional.call.depth:
        return positional if positional.columns != (0, None) else other_length
    return positional or other_length or fallback


def _layout(t: Tensor, batch_size: int) -> bool | None:
    """False when ``t`` is batch-first ``(B, T)``, True when sequence-first ``(T, B)``, None when neither."""
    if t.ndim != 2:
        return None
    if t.shape[0] == batch_size:
        return False
    if t.shape[1] == batch_size:
        return True
    return None


def _ids_match(seqs: list[_Seq], input_ids: Tensor) -> tuple[Path, bool, tuple[int, int | None]] | None:
    """``(path, seq_first, columns)`` of the call's tensor that is the batch's ids, or a slice of them (see
    :data:`ROW_SLICES`), preferring the whole ids; None when none is."""
    for columns in ROW_SLICES:
        if columns != (0, None) and input_ids.shape[1] < 3:
            break  # a slice of a row of two tokens says nothing
        part = input_ids[:, columns[0] : columns[1]]
        for p, t, sf in seqs:
            view = t.transpose(0, 1) if sf else t
            if view.shape == part.shape and bool(torch.equal(view.to(part.device).long(), part.long())):
                return p, sf, columns
    return None


def _find_mask(call: RecordedCall, call_mask: Tensor | None) -> tuple[Path | None, bool, bool, bool]:
    """``(path, inverted, seq_first, opaque)`` of the batch's attention mask in the call (as is or inverted, either
    layout); ``opaque``: none found, but an argument is named like a mask."""
    for p, t in call.leaves():
        if call_mask is None or t.ndim != 2:
            continue
        transposed = t.shape != call_mask.shape
        view = t.transpose(0, 1) if transposed else t
        if view.shape != call_mask.shape or (call.keyword(p) or "") in LABELS_KEYS:
            continue
        if torch.equal(view.to(call_mask.dtype), call_mask):
            return p, False, transposed, False
        if torch.equal(view.bool(), call_mask == 0):
            return p, True, transposed, False
    opaque = any((call.keyword(p) or "") in MASK_KEYS or str(p[-1]) in MASK_KEYS for p, _ in call.leaves())
    return None, False, False, opaque


def _reference(input_ids: Tensor, labels: Tensor | None, batch_size: int) -> tuple[Tensor, int]:
    """``(reference, base)``: the labels as ``(B, T)`` and 0, or without labels the ids (label t is id t+1) and 1."""
    if labels is not None and not labels.is_floating_point() and labels.numel() % batch_size == 0:
        return labels.reshape(batch_size, -1), 0
    return input_ids, 1


def _slot(call: RecordedCall, seq: _Seq, primary: Path | None, ref: Tensor, base: int, ignore_index: int) -> TokenSlot:
    path, t, seq_first = seq
    batch_first = t.transpose(0, 1) if seq_first else t
    offset = None
    if batch_first.shape[0] == ref.shape[0]:
        o = relation_offset(batch_first, ref, ignore_index)
        offset = None if o is None else o + base
    name = call.keyword(path) or ""
    return TokenSlot(
        path=path,
        name=call.describe(path),
        seq_first=seq_first,
        length=int(batch_first.shape[1]),
        offset=offset,
        primary=path == primary,
        label_like=name in LABELS_KEYS or str(path[-1]) in LABELS_KEYS,
    )


def _names_a_mask(call: RecordedCall) -> bool:
    params = forward_parameters(call.module)
    return any(name in params for name in MASK_KEYS) or any("mask" in name for name in params)


# ------------------------------------------------------------------------------------------------------ the kind
def _config_holder(*modules: nn.Module | None) -> nn.Module | None:
    """The first of ``modules``, else of the last one's submodules, holding a Hugging Face-style ``.config``."""
    seen = [m for m in modules if m is not None]
    if seen:
        seen += list(seen[-1].modules())
    for module in seen:
        config = getattr(module, "config", None)
        if config is not None and hasattr(config, "is_encoder_decoder"):
            return module
    return None


def model_kind(
    found: ModelCall | None,
    calls: Sequence[RecordedCall] = (),
    model: nn.Module | None = None,
    input_ids: Tensor | None = None,
    labels: Tensor | None = None,
) -> tuple[ModelKind, str]:
    """``(kind, source)``: what the model is and where that was read (the order: ``docs/callbacks/mask_probe.md``).
    Reading the labels' :class:`Objective` keeps it in ``found.objective`` (one host sync). ``found`` None reads
    ``model``'s config only."""
    holder = _config_holder(None if found is None else found.call.module, model)
    if holder is not None:
        config = holder.config
        if getattr(config, "is_encoder_decoder", False):
            return "encoder-decoder", "config"
        if getattr(config, "is_decoder", False):
            return "decoder", "config"
        name = type(holder).__name__
        if name.endswith(("ForCausalLM", "LMHeadModel")):
            return "decoder", "class name"
        if name.endswith("ForMaskedLM"):
            return "encoder", "class name"
    if found is None:
        return "unknown", ""
    if _has_decoder_input(found.call):
        return "encoder-decoder", "decoder_input_ids"
    if found.call.depth > 0 and not any(
        read_logits(c.output, found.batch_size) is not None for c in calls if c.depth == 0
    ):
        return "loss-only wrapper", "wrapper"
    if any(s.offset is not None and not s.primary and (not s.label_like or s.offset != 0) for s in found.slots):
        return "encoder-decoder", "decoder input"  # (labels passed for the loss carry them at offset 0)
    if found.objective is None and input_ids is not None and labels is not None and labels.shape == input_ids.shape:
        found.objective = read_objective(input_ids, labels, found.ignore_index)
    if found.objective is not None:
        return ("decoder" if found.objective.next_token else "encoder"), "labels"
    if found.sliced and found.primary is not None:
        return "decoder", "token rows"
    return "unknown", ""


def _has_decoder_input(call: RecordedCall) -> bool:
    """The forward takes ``decoder_input_ids`` (named, or passed), or returns an encoder's state (Hugging Face)."""
    if "decoder_input_ids" in forward_parameters(call.module):
        return True
    state = getattr(call.output, "encoder_last_hidden_state", None)
    return isinstance(state, Tensor) or any(call.keyword(p) == "decoder_input_ids" for p, _ in call.leaves())
