"""Probing a model through the call its ``training_step`` really makes: the
:class:`~lightning_tfdebug.core.calls.ModelCall` that :func:`~lightning_tfdebug.core.calls.find_model_call` reads.

The probes re-issue the recorded call with perturbed token tensors ("slots") and read the logits back as
``(batch, time, vocab)``, whatever layout the model returns: ``(B, T, V)``, flattened ``(B*T, V)``, sequence-first
``(T, B, V)``, inside tuples, dicts or model outputs.

The labels fix what a leak is. Output position ``p`` is trained on label ``p + shift`` (``shift`` is 1 when the
labels equal the ids, so the model or its loss shifts them; 0 when the data holds next-token labels, or for a
decoder's own targets). A slot whose position ``t`` carries label ``t - offset`` must not reach output ``p`` from any
position ``t >= p + shift + offset``: the decoder input of an encoder-decoder that is the labels themselves
(``offset`` 0, ``shift`` 0) leaks each position's own label, and an encoder that sees the whole text of a language
model leaks the next token. Slots unrelated to the labels (a translation's source) are not perturbed: an encoder
may see all of them.

Token rows without labels: a batch that is one integer tensor ``(B, T+1)`` (or a tuple whose first item is one) is
sliced inside the step or the model (``x, y = rows[:, :-1], rows[:, 1:]``). The chosen call may take the rows
themselves or a slice of them without the last or the first column (:attr:`~lightning_tfdebug.core.calls.ModelCall.
ids_start`), so the probes perturb the call's own tokens and the alignment of its outputs with the next tokens is read
against the whole row.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from lightning_tfdebug.core.batch import MASK_KEYS, logits_of
from lightning_tfdebug.core.calls import ModelCall, Path, TableUse, TokenSlot, read_logits
from lightning_tfdebug.functional.mask_checks import (
    LeakReading,
    LeakSummary,
    PositionTable,
    PositionTablesReading,
    Reading,
    RepeatReading,
)
from lightning_tfdebug.functional.probes import causal_valid_positions, logit_tolerance, max_change


class CallError(RuntimeError):
    """The model could not be called the way MaskProbe tried, or did not return logits."""


# -------------------------------------------------------------------------------------- calling the model by signature
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


def caller_logits(caller: ModelCaller, input_ids: Tensor, attention_mask: Tensor | None) -> Tensor:
    """The logits ``(B, T, V)`` of ``caller`` on ``input_ids`` (the mask only when it reaches the model).

    Raises:
        CallError: when the output holds no logits of that shape.
    """
    logits = logits_of(caller.call(input_ids, attention_mask if caller.takes_mask else None))
    if logits is None or logits.ndim != 3 or tuple(logits.shape[:2]) != tuple(input_ids.shape):
        shape = None if logits is None else tuple(logits.shape)
        raise CallError(f"the model's output is not logits of shape (batch, time, vocab) (got {shape})")
    return logits


# ------------------------------------------------------------------------------------------------- re-issuing the call
def call_vocab(found: ModelCall, input_ids: Tensor) -> Tensor:
    """The distinct token ids the batch and the call's token tensors hold (never ``ignore_index`` or a negative id),
    sorted: the ids a probe draws replacements from."""
    values = [input_ids.flatten()] + [found.tensors[s.path].flatten() for s in found.slots]
    vocab = torch.unique(torch.cat([v.to(input_ids.device, input_ids.dtype) for v in values]))
    vocab = vocab[vocab != found.ignore_index]
    return vocab[vocab >= 0]


def random_ids(vocab: Tensor, shape: tuple[int, ...], generator: torch.Generator) -> Tensor:
    """Ids of ``shape`` drawn from ``vocab`` with ``generator`` (on the CPU, then moved to ``vocab``'s device)."""
    idx = torch.randint(0, vocab.numel(), shape, generator=generator, device="cpu").to(vocab.device)
    return vocab[idx]


def run_call(found: ModelCall, changes: dict[Path, Tensor], rows: int | None = None) -> Tensor:
    """Call again with the slots at ``changes`` replaced (batch-first ``(b, t)`` tensors, converted to each slot's
    layout), every other batch-shaped tensor cut to ``rows``; returns the logits ``(b, T_out, V)``.

    Raises:
        ValueError: when the call returns no logits for the probe's rows.
    """
    b = rows or found.batch_size
    replacements: dict[Path, Tensor] = {}
    for path, value in found.tensors.items():
        slot = next((s for s in found.slots if s.path == path), None)
        if path in changes:
            new = changes[path]
            transposed = slot.seq_first if slot is not None else path == found.mask_path and found.mask_seq_first
            if transposed:
                new = new.transpose(0, 1)
            replacements[path] = new.to(value.dtype) if path == found.mask_path else new
        elif b != found.batch_size:
            axis = 1 if slot is not None and slot.seq_first else 0
            if value.ndim > axis and value.shape[axis] == found.batch_size:
                replacements[path] = value.narrow(axis, 0, b)
    logits = read_logits(found.call.call(replacements), b, found.out_seq_first)
    if logits is None:
        raise ValueError("the recorded call did not return logits for the probe's rows")
    return logits


def call_logits(
    found: ModelCall, vocab: Tensor, input_ids: Tensor, attention_mask: Tensor | None, generator: torch.Generator
) -> Tensor:
    """The recorded call with its token ids (and mask) replaced by ``input_ids`` (and ``attention_mask``); the
    call's other token tensors of the ids' length follow (cut to the same rows and length, or extended with ids from
    ``vocab``). The probes' logits function for a recorded call."""
    primary = found.primary
    assert primary is not None
    b, t = input_ids.shape
    changes: dict[Path, Tensor] = {primary.path: input_ids}
    if found.mask_path is not None and attention_mask is not None:
        changes[found.mask_path] = found.mask_value(attention_mask)
    for slot in found.slots:
        if slot.primary or slot.length != primary.length:
            continue
        companion = found.batch_first(slot)[:b, :t].contiguous()
        if companion.shape[1] < t:
            extra = random_ids(vocab, (b, t - companion.shape[1]), generator).to(companion.dtype)
            companion = torch.cat([companion, extra], 1)
        changes[slot.path] = companion
    return run_call(found, changes, rows=b)


def perturb_from(
    found: ModelCall, vocab: Tensor, slot: TokenSlot, start: int, rows: int, generator: torch.Generator
) -> Tensor | None:
    """The slot's first ``rows`` rows (batch-first) with every supervised position from ``start`` on replaced by
    another id; None when there is nothing to replace."""
    original = found.batch_first(slot)[:rows]
    if start >= original.shape[1] or vocab.numel() < 2:
        return None
    out = original.clone()
    tail = out[:, start:]
    new = random_ids(vocab, tuple(tail.shape), generator).to(tail.dtype)
    alt = vocab[(torch.searchsorted(vocab, new.to(vocab.dtype)) + 1) % vocab.numel()]
    new = torch.where(new == tail, alt.to(tail.dtype), new)
    keep = tail == found.ignore_index
    out[:, start:] = torch.where(keep, tail, new)
    return out


# ------------------------------------------------------------------------------------------------------------ leaks
def measure_leaks(found: ModelCall, vocab: Tensor, rows: int, generator: torch.Generator) -> list[Reading]:
    """Through the recorded call: the repeat check, then for each argument that carries the labels, its tokens
    replaced from the first position an output at or before the middle must not see, and those outputs compared.
    Returns the repeat reading, one leak reading per argument, and their summary."""
    base = run_call(found, {}, rows=rows)
    tolerance = logit_tolerance(base)
    repeat, where = max_change(base, run_call(found, {}, rows=rows))
    out: list[Reading] = [RepeatReading(repeat, where[0], where[1], tolerance)]
    length = int(base.shape[1])
    if length < 2:
        return out
    cut = length // 2 - 1  # the middle: the last position whose outputs must not see the replaced tokens
    valid = causal_valid_positions(rows, length, cut, base.device)
    changes: list[Tensor] = []
    dependence: list[Tensor] = []
    for slot in found.related():
        assert slot.offset is not None
        start = max(0, cut + found.shift + slot.offset)
        perturbed = perturb_from(found, vocab, slot, start, rows, generator)
        if perturbed is None:
            continue
        changed = run_call(found, {slot.path: perturbed}, rows=rows)
        if changed.shape != base.shape:
            continue
        change, where = max_change(base, changed, valid)
        changes.append(change)
        if not slot.primary:  # do the outputs follow this sequence at all (a decoder input)?
            dependence.append(max_change(base, changed)[0])
        out.append(
            LeakReading(
                change, where[0], where[1], cut, start, slot.name, slot.offset, slot.primary, found.shift, tolerance
            )
        )
    largest = torch.stack(changes).max() if changes else None
    out.append(LeakSummary(largest, torch.stack(dependence).max() if dependence else None, tolerance))
    return out


# ---------------------------------------------------------------------------------------------------- position tables
_LAYER_TENSORS = ("weight", "bias")


def watched_tables(model: nn.Module) -> dict[str, Tensor]:
    """The tensors that may be a token or position table, by qualified name: every ``nn.Embedding``'s weight, and every
    2-D or ``(1, rows, width)`` parameter held directly by a module outside ``torch.nn`` that is not a layer's
    ``weight`` or ``bias`` (a hand-written model's ``self.pos = nn.Parameter(...)``). Which of them is the token table
    and which are position tables is read from one forward pass (:func:`position_tables`)."""
    out: dict[str, Tensor] = {}
    for name, module in model.named_modules():
        if isinstance(module, nn.Embedding):
            out[f"{name}.weight" if name else "weight"] = module.weight
            continue
        if type(module).__module__.startswith("torch.nn"):
            continue
        for pname, param in module.named_parameters(recurse=False):
            if pname in _LAYER_TENSORS or not (param.ndim == 2 or (param.ndim == 3 and param.shape[0] == 1)):
                continue
            out[f"{name}.{pname}" if name else pname] = param
    return out


def table_rows(table: Tensor) -> tuple[int, int]:
    """``(rows, width)`` of a table: ``(R, d)`` or ``(1, R, d)``."""
    return int(table.shape[-2]), int(table.shape[-1])


def is_token_lookup(indices: Tensor, input_ids: Tensor) -> bool:
    """Whether a lookup's indices are the call's token ids (the token table's lookup)."""
    return tuple(indices.shape) == tuple(input_ids.shape) and bool(torch.equal(indices.to(input_ids.device), input_ids))


def constant_along_sequence(indices: Tensor) -> Tensor | None:
    """A device bool: every row of ``indices`` holds one value along its last (sequence) dimension; None when that
    dimension has one position or fewer (nothing to vary)."""
    if indices.ndim == 0 or indices.shape[-1] < 2:
        return None
    return (indices == indices[..., :1]).all()


def table_lookups(
    named: dict[str, Tensor], lookups: list[tuple[int, Tensor]], read: set[int], input_ids: Tensor
) -> tuple[str, list[tuple[str, int, bool, Tensor | None]]] | None:
    """From one watched forward pass (:class:`~lightning_tfdebug.core.calls.TableReads`): the token table (the one
    looked up with ``input_ids``) and, for every other watched table of its width with at least ``input_ids.shape[1]``
    rows, ``(name, rows, read, constant)``: ``constant`` a device bool, every lookup of it along the sequence constant
    (None: never looked up along a sequence longer than 1). None when no table took the token ids. Host sync: the
    comparison with the token ids (probe steps only)."""
    length = input_ids.shape[1]
    token_ids = {i for i, indices in lookups if is_token_lookup(indices, input_ids)}
    token_table = next((name for name, t in named.items() if id(t) in token_ids), None)
    if token_table is None:
        return None
    width = table_rows(named[token_table])[1]
    out: list[tuple[str, int, bool, Tensor | None]] = []
    for name, t in named.items():
        rows, w = table_rows(t)
        if id(t) in token_ids or w != width or rows < length:
            continue
        flags = [c for i, indices in lookups if i == id(t) and (c := constant_along_sequence(indices)) is not None]
        out.append((name, rows, id(t) in read, torch.stack(flags).all() if flags else None))
    return token_table, out


def measure_tables(named: dict[str, Tensor], use: TableUse, input_ids: Tensor) -> PositionTablesReading | None:
    """The position tables one watched forward pass of ``input_ids`` used (:func:`table_lookups`), as a reading; None
    when no table took the token ids or none of the token table's width has enough rows. Host sync: probe steps
    only."""
    found = table_lookups(named, use.lookups, use.read, input_ids)
    if found is None:
        return None  # no lookup of the call's token ids: the token table's width is unknown
    token_table, tables = found
    if not tables:
        return None
    readings = tuple(
        PositionTable(name, rows, read, constant is not None, False if constant is None else constant)
        for name, rows, read, constant in tables
    )
    return PositionTablesReading(readings, int(input_ids.shape[1]), token_table)
