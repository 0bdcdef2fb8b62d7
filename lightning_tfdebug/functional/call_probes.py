"""Probing a model through the call its ``training_step`` really makes (see :mod:`lightning_tfdebug.core.calls`).

:func:`plan_call` picks, among the calls a replayed ``training_step`` made, the one that takes the batch's token ids
and returns logits, and reads its token tensors ("slots"): which is the batch's ids, which carry the labels and at
what offset, which is the attention mask, and whether each is batch- or sequence-first. :class:`CallPlan` re-issues
the call with perturbed slots and reads the logits back as ``(batch, time, vocab)``, whatever layout the model
returns: ``(B, T, V)``, flattened ``(B*T, V)``, sequence-first ``(T, B, V)``, inside tuples, dicts or model outputs.

The labels fix what a leak is. Output position ``p`` is trained on label ``p + shift`` (``shift`` is 1 when the
labels equal the ids, so the model or its loss shifts them; 0 when the data holds next-token labels, or for a
decoder's own targets). A slot whose position ``t`` carries label ``t - offset`` must not reach output ``p`` from any
position ``t >= p + shift + offset``: the decoder input of an encoder-decoder that is the labels themselves
(``offset`` 0, ``shift`` 0) leaks each position's own label, and an encoder that sees the whole text of a language
model leaks the next token. Slots unrelated to the labels (a translation's source) are not perturbed: an encoder
may see all of them.

Token rows without labels: a batch that is one integer tensor ``(B, T+1)`` (or a tuple whose first item is one) is
sliced inside the step or the model (``x, y = rows[:, :-1], rows[:, 1:]``). The calls are then recorded at every
depth, and the chosen call may take the rows themselves or a slice of them without the last or the first column; the
plan keeps which columns it received (:attr:`CallPlan.ids_start`), so the probes perturb the call's own tokens and the
alignment of its outputs with the next tokens is read against the whole row.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from lightning_tfdebug.core.batch import LABELS_KEYS, MASK_KEYS, logits_of
from lightning_tfdebug.core.calls import Path, RecordedCall, tensor_leaves
from lightning_tfdebug.functional.verdicts import Verdict

RELATION_FRACTION = 0.95
"""A slot carries the labels when it equals them, at one offset, at this fraction of the supervised positions or more.
Text shifted against itself matches everywhere (padding aside); a denoising source (BART's 15% token corruption) does
not, and an encoder may see all of it."""


@dataclass(frozen=True)
class Slot:
    """A token tensor in the recorded call."""

    path: Path
    name: str
    seq_first: bool
    length: int
    offset: int | None  # position t carries label t - offset; None: unrelated to the labels
    primary: bool  # the batch's token ids
    label_like: bool  # passed under a labels name (labels, targets, ...): read by the loss, not by the network


@dataclass
class CallPlan:
    """A recorded call and what its tensors are, able to re-issue it with perturbed slots."""

    call: RecordedCall
    batch_size: int
    slots: list[Slot]
    shift: int
    mask_path: Path | None = None
    mask_inverted: bool = False  # a padding mask (True = padding) rather than an attention mask (1 = real)
    mask_seq_first: bool = False
    mask_named: bool = False  # the forward names a mask parameter
    mask_opaque: bool = False  # a mask is passed, in an encoding not read here (additive floats, 4-D): not probed
    out_seq_first: bool = False
    vocab: Tensor | None = None  # the distinct token ids seen, for replacements
    ignore_index: int = -100
    ids_start: int = 0  # the call's token ids are the batch's ids from this column ...
    ids_stop: int | None = None  # ... to this one (None: to the end): a slice of token rows, e.g. rows[:, :-1]
    _tensors: dict[Path, Tensor] = field(default_factory=dict)

    # ------------------------------------------------------------------ views
    @property
    def primary(self) -> Slot | None:
        return next((s for s in self.slots if s.primary), None)

    @property
    def takes_mask(self) -> bool:
        return self.mask_path is not None

    @property
    def sliced(self) -> bool:
        """Whether the call received a slice of the batch's token rows rather than the rows themselves."""
        return self.ids_start != 0 or self.ids_stop is not None

    def columns(self, t: Tensor | None) -> Tensor | None:
        """``t`` (batch-first, shaped like the batch's ids) cut to the columns the call received."""
        return None if t is None else t[:, self.ids_start : self.ids_stop]

    def batch_first(self, slot: Slot) -> Tensor:
        t = self._tensors[slot.path]
        return t.transpose(0, 1) if slot.seq_first else t

    def related(self) -> list[Slot]:
        """The slots that carry the labels, the ones a leak probe perturbs."""
        return [s for s in self.slots if s.offset is not None]

    def companions(self) -> list[Slot]:
        """Other sequences of the ids' length that are not passed under a labels name (a decoder input, position
        ids): resizing the ids says nothing certain about what they should become."""
        primary = self.primary
        if primary is None:
            return []
        return [s for s in self.slots if not s.primary and not s.label_like and s.length == primary.length]

    @property
    def time_cut_safe(self) -> bool:
        """Whether the sequences can be cut shorter: no other tensor of the call has a dimension of their length
        (a ``(T, T)`` causal mask, float features per position)."""
        primary = self.primary
        if primary is None:
            return False
        known = {s.path for s in self.slots} | ({self.mask_path} if self.mask_path is not None else set())
        return not any(
            primary.length in tuple(t.shape) for p, t in self._tensors.items() if p not in known and t.ndim >= 1
        )

    # ------------------------------------------------------------------ re-issuing
    def run(self, changes: dict[Path, Tensor], rows: int | None = None) -> Tensor:
        """Call again with the slots at ``changes`` replaced (batch-first ``(b, t)`` tensors; converted to each slot's
        layout), every other batch-shaped tensor cut to ``rows``; returns the logits ``(b, T_out, V)``."""
        b = rows or self.batch_size
        replacements: dict[Path, Tensor] = {}
        for path, value in self._tensors.items():
            slot = next((s for s in self.slots if s.path == path), None)
            if path in changes:
                new = changes[path]
                transposed = slot.seq_first if slot is not None else path == self.mask_path and self.mask_seq_first
                if transposed:
                    new = new.transpose(0, 1)
                replacements[path] = new.to(value.dtype) if path == self.mask_path else new
            elif b != self.batch_size:
                axis = 1 if slot is not None and slot.seq_first else 0
                if value.ndim > axis and value.shape[axis] == self.batch_size:
                    replacements[path] = value.narrow(axis, 0, b)
        logits = read_logits(self.call.call(replacements), b, self.out_seq_first)
        if logits is None:
            raise ValueError("the recorded call did not return logits for the probe's rows")
        return logits

    def mask_value(self, real: Tensor) -> Tensor:
        """The recorded mask's encoding of ``real`` (1 = real token), batch-first."""
        return (real == 0) if self.mask_inverted else real

    def random_ids(self, shape: tuple[int, ...], generator: torch.Generator) -> Tensor:
        assert self.vocab is not None
        idx = torch.randint(0, self.vocab.numel(), shape, generator=generator, device="cpu").to(self.vocab.device)
        return self.vocab[idx]

    def perturb_from(self, slot: Slot, start: int, rows: int, generator: torch.Generator) -> Tensor | None:
        """The slot's first ``rows`` rows (batch-first) with every supervised position from ``start`` on replaced by
        another id; None when there is nothing to replace."""
        original = self.batch_first(slot)[:rows]
        if start >= original.shape[1] or self.vocab is None or self.vocab.numel() < 2:
            return None
        out = original.clone()
        tail = out[:, start:]
        new = self.random_ids(tuple(tail.shape), generator).to(tail.dtype)
        alt = self.vocab[(torch.searchsorted(self.vocab, new.to(self.vocab.dtype)) + 1) % self.vocab.numel()]
        new = torch.where(new == tail, alt.to(tail.dtype), new)
        keep = tail == self.ignore_index
        out[:, start:] = torch.where(keep, tail, new)
        return out


# ---------------------------------------------------------------------------------------------------- reading outputs
def read_logits(output: Any, batch_size: int, seq_first: bool = False) -> Tensor | None:
    """The logits in a call's output as ``(batch, time, vocab)``: ``(B, T, V)`` as is, ``(T, B, V)`` transposed when
    the call is sequence-first (or when only that reading fits), ``(B*T, V)`` reshaped (``(T*B, V)`` for a
    sequence-first call). The logits are ``.logits`` / ``["logits"]``, else the first float tensor of the output (a
    tuple ``(logits, cache)``, a dict or a dataclass of other names). None when no float tensor fits."""
    logits = logits_of(output)
    if logits is None:
        logits = next((t for _, t in tensor_leaves(output) if t.is_floating_point() and t.ndim >= 2), None)
    if logits is None:
        return None
    if logits.ndim == 3:
        if logits.shape[0] == batch_size and not (seq_first and logits.shape[1] == batch_size):
            return logits
        if logits.shape[1] == batch_size:
            return logits.transpose(0, 1)
        return None
    if logits.ndim == 2 and logits.shape[0] % batch_size == 0 and logits.shape[0] > batch_size:
        if seq_first:
            return logits.reshape(-1, batch_size, logits.shape[-1]).transpose(0, 1)
        return logits.reshape(batch_size, -1, logits.shape[-1])
    return None


# ------------------------------------------------------------------------------------------------------------ planning
def _layout(t: Tensor, batch_size: int) -> bool | None:
    """False when ``t`` is batch-first ``(B, T)``, True when sequence-first ``(T, B)``, None when neither."""
    if t.ndim != 2:
        return None
    if t.shape[0] == batch_size:
        return False
    if t.shape[1] == batch_size:
        return True
    return None


def _is_ids(t: Tensor) -> bool:
    return not t.is_floating_point() and not t.is_complex() and t.dtype != torch.bool


def relation_offset(
    slot: Tensor, reference: Tensor, ignore_index: int, offsets: tuple[int, ...] = (0, 1, -1)
) -> int | None:
    """The offset ``o`` at which ``slot[:, t] == reference[:, t - o]`` holds at :data:`RELATION_FRACTION` or more of
    the positions where ``reference`` is supervised (not ``ignore_index``), over the positions both have; the largest
    such offset, or None. Both batch-first with the same number of rows. Host syncs: probing steps only."""
    matches: list[int] = []
    ts, tr = slot.shape[1], reference.shape[1]
    for o in offsets:
        lo, hi = max(0, o), min(ts, tr + o)
        if hi - lo < 2:
            continue
        s = slot[:, lo:hi]
        r = reference[:, lo - o : hi - o]
        supervised = r != ignore_index
        n = int(supervised.sum())
        if n == 0:
            continue
        frac = int(((s == r) & supervised).sum()) / n
        if frac >= RELATION_FRACTION:
            matches.append(o)
    # Repetitive text matches at several offsets; the largest one starts the leak probe latest, so it never blames a
    # model for reading a token that only happens to equal a label.
    return max(matches) if matches else None


def plan_call(
    calls: list[RecordedCall],
    input_ids: Tensor,
    attention_mask: Tensor | None,
    labels: Tensor | None,
    ignore_index: int = -100,
) -> CallPlan | str:
    """The :class:`CallPlan` of the call that takes the batch's token ids, or a slice of them without the last or the
    first column, and returns logits (outputs wider than every token id) over those positions; among several, the
    outermost (lowest depth), then the first. Failing that, an outermost call that takes a token tensor of the batch's
    size and returns logits. A sentence saying why not otherwise. ``calls`` may hold calls at every depth
    (:class:`~lightning_tfdebug.core.calls.CallRecorder` with ``nested``): a loss-only wrapper's inner network."""
    b, length = int(input_ids.shape[0]), int(input_ids.shape[1])
    top_id = int(input_ids.max()) if input_ids.numel() else -1  # host sync: probing steps only
    Choice = tuple[RecordedCall, list[tuple[Path, Tensor, bool]], Path | None, tuple[int, int | None]]
    positional: Choice | None = None  # takes the ids or a slice, one output per position it received
    other_length: Choice | None = None  # takes the ids, outputs over other positions (a decoder's, a shifted wrapper's)
    fallback: Choice | None = None
    for call in sorted(calls, key=lambda c: (c.depth, c.order)):
        if positional is not None:
            break
        if isinstance(call.module, (torch.nn.Embedding, torch.nn.EmbeddingBag)):
            continue  # an embedding's output is hidden states, whatever its width
        seqs = [(p, t, _layout(t, b)) for p, t in call.leaves() if _is_ids(t) and _layout(t, b) is not None]
        if not seqs:
            continue
        match = _ids_match(seqs, input_ids)
        seq_first = bool(match[1] if match is not None else seqs[0][2])
        logits = read_logits(call.output, b, seq_first)
        if logits is None or logits.shape[-1] <= top_id:
            continue  # no output, or one narrower than the token ids (an embedding's hidden states, not logits)
        if match is not None:
            path, _, columns = match
            received = length if columns == (0, None) else length - 1
            if logits.shape[1] == received:
                positional = (call, seqs, path, columns)
            elif columns == (0, None):
                other_length = other_length or (call, seqs, path, columns)
        elif call.depth == 0:
            fallback = fallback or (call, seqs, None, (0, None))
    # A call whose outputs follow the positions it received is preferred: a wrapper fed the whole rows that returns
    # the logits of rows[:, :-1] is passed over for the inner call that received that slice. Outputs over other
    # positions (an encoder-decoder's decoder) come next, then a call that takes some token tensor of the batch.
    if positional is not None and other_length is not None and other_length[0].depth < positional[0].depth:
        chosen = positional if positional[3] != (0, None) else other_length
    else:
        chosen = positional or other_length
    chosen = chosen or fallback
    if chosen is None:
        names = ", ".join(sorted({type(c.module).__name__ for c in calls if c.depth == 0})) or "none"
        return (
            f"no call made in `training_step` takes the batch's token ids and returns logits (modules called: {names})"
        )
    call, seqs, primary_path, (start, stop) = chosen
    seq_first = next((sf for p, t, sf in seqs if p == primary_path), seqs[0][2])
    tensors = {p: t for p, t in call.leaves()}
    # the mask: the batch's attention mask (or its inverse, a padding mask), cut like the ids, passed in the call
    mask_path, inverted, mask_seq_first = None, False, False
    call_mask = None if attention_mask is None else attention_mask[:, start:stop]
    for p, t in call.leaves():
        if call_mask is None or t.ndim != 2:
            continue
        transposed = t.shape != call_mask.shape
        view = t.transpose(0, 1) if transposed else t
        if view.shape != call_mask.shape or (call.keyword(p) or "") in LABELS_KEYS:
            continue
        if torch.equal(view.to(call_mask.dtype), call_mask):
            mask_path, mask_seq_first = p, transposed
            break
        if torch.equal(view.bool(), call_mask == 0):
            mask_path, inverted, mask_seq_first = p, True, transposed
            break
    opaque = mask_path is None and any(
        (call.keyword(p) or "") in MASK_KEYS or str(p[-1]) in MASK_KEYS for p, _ in call.leaves()
    )
    seqs = [(p, t, sf) for p, t, sf in seqs if p != mask_path]
    # the labels every slot is compared with: the batch's, else the ids' next tokens (virtual next-token labels)
    ref, base = _reference(input_ids, labels, b)
    shift = 0
    if ref is not None and labels is not None and primary_path is not None:
        ids_offset = relation_offset(input_ids, ref, ignore_index, offsets=(0,))
        shift = 1 if ids_offset == 0 else 0
    # output p of a call that received the rows from column `start` on stands at row position p + start
    shift += start
    slots = []
    for p, t, sf in seqs:
        bf = t.transpose(0, 1) if sf else t
        offset = None
        if ref is not None and bf.shape[0] == ref.shape[0]:
            o = relation_offset(bf, ref, ignore_index)
            offset = None if o is None else o + base
        name = call.keyword(p) or ""
        slots.append(
            Slot(
                path=p,
                name=call.describe(p),
                seq_first=sf,
                length=int(bf.shape[1]),
                offset=offset,
                primary=p == primary_path,
                label_like=name in LABELS_KEYS or str(p[-1]) in LABELS_KEYS,
            )
        )
    values = [input_ids.flatten()]
    values += [tensors[s.path].flatten() for s in slots]
    vocab = torch.unique(torch.cat([v.to(input_ids.device, input_ids.dtype) for v in values]))
    vocab = vocab[vocab != ignore_index]
    vocab = vocab[vocab >= 0]
    return CallPlan(
        call=call,
        batch_size=b,
        slots=slots,
        shift=shift,
        mask_path=mask_path,
        mask_inverted=inverted,
        mask_seq_first=mask_seq_first,
        mask_named=_names_a_mask(call),
        mask_opaque=opaque,
        out_seq_first=seq_first,
        vocab=vocab,
        ignore_index=ignore_index,
        ids_start=start,
        ids_stop=stop,
        _tensors=tensors,
    )


ROW_SLICES: tuple[tuple[int, int | None], ...] = ((0, None), (0, -1), (1, None))
"""The columns of the batch's ids a call may receive, in order of preference: all of them, all but the last (the
inputs of a next-token loss, ``rows[:, :-1]``), all but the first (``rows[:, 1:]``)."""


def _ids_match(
    seqs: list[tuple[Path, Tensor, bool | None]], input_ids: Tensor
) -> tuple[Path, bool | None, tuple[int, int | None]] | None:
    """``(path, seq_first, columns)`` of the call's tensor that is the batch's ids, or a slice of them (see
    :data:`ROW_SLICES`), preferring the whole ids; None when none is."""
    for columns in ROW_SLICES:
        if columns != (0, None) and input_ids.shape[1] < 3:
            break  # a slice of a row of two tokens says nothing
        part = input_ids[:, columns[0] : columns[1]]
        for p, t, sf in seqs:
            if _matches_ids(t, sf, part):
                return p, sf, columns
    return None


def _matches_ids(t: Tensor, seq_first: bool | None, input_ids: Tensor) -> bool:
    view = t.transpose(0, 1) if seq_first else t
    if view.shape != input_ids.shape:
        return False
    return bool(torch.equal(view.to(input_ids.device).long(), input_ids.long()))


def _reference(input_ids: Tensor, labels: Tensor | None, batch_size: int) -> tuple[Tensor | None, int]:
    """``(reference, base)``: the labels as ``(B, T)``, with ``base`` 0; or, without labels, the ids standing for
    next-token labels (label t is id t+1), with ``base`` 1 added to every offset read against them."""
    if labels is not None and not labels.is_floating_point() and labels.numel() % batch_size == 0:
        return labels.reshape(batch_size, -1), 0
    return input_ids, 1


def decide_leak(
    change: float, row: int, position: int, cut: int, start: int, slot: Slot, shift: int, tolerance: float
) -> Verdict | None:
    """A leak through ``slot``: replacing its tokens from ``start`` on moved an output at or before ``cut``.

    ``TFD201`` when the slot is the batch's token ids one step behind the labels (future tokens reach past outputs,
    a causal-mask bug or an encoder that sees the whole text); ``TFD214`` for any other argument that carries the
    labels (a decoder input that is the labels themselves, not shifted right).
    """
    if change <= tolerance:  # NaN falls through: a NaN output is not a clean pass
        return None
    evidence = {
        "max_change": change,
        "position": position,
        "row": row,
        "cut": cut,
        "replaced_from": start,
        "argument": slot.name,
        "label_offset": slot.offset,
        "tolerance": tolerance,
    }
    if slot.primary and slot.offset is not None and slot.offset + shift >= 1:
        return Verdict(
            "TFD201",
            f"Future tokens change past logits: replacing the tokens of `{slot.name}` from position {start} on changed "
            f"the output at position {position} (row {row}) by {change:.3g} (tolerance {tolerance:.2g}); outputs up "
            f"to {cut} must not see them.",
            evidence,
        )
    carries = (
        "the label of its own position" if slot.offset == 0 and shift == 0 else "labels the outputs are trained on"
    )
    return Verdict(
        "TFD214",
        f"Target leak: the model reads `{slot.name}`, which carries {carries} (label offset {slot.offset}); replacing "
        f"its tokens from position {start} on changed the output at position {position} (row {row}) by "
        f"{change:.3g} (tolerance {tolerance:.2g}), so the model can copy the answer instead of predicting it.",
        evidence,
    )


def _names_a_mask(call: RecordedCall) -> bool:
    import inspect

    try:
        params = inspect.signature(call.module.forward).parameters
    except (TypeError, ValueError):
        return False
    return any(name in params for name in MASK_KEYS) or any("mask" in name for name in params)


def token_row_logits(
    calls: list[RecordedCall], input_ids: Tensor, attention_mask: Tensor | None, ignore_index: int = -100
) -> tuple[Tensor, Tensor, Tensor] | None:
    """For a batch of token ids without labels: ``(logits, labels, tokens)`` of the recorded call (at any depth) that
    received the ids, or a slice of them without the last or the first column, and returned logits ``(B, L, V)``, one
    per position it received. ``tokens`` are the ids that call received, ``(B, L)``; ``labels`` the same with the
    batch's padding set to ``ignore_index``: the labels a model that shifts them itself scores position ``t`` against
    at ``t + 1`` (``rows[:, :-1]`` fed to the model: every target but the row's last). None when no such call was
    recorded. Host syncs (choosing the call): for the steps that record only."""
    plan = plan_call(calls, input_ids, attention_mask, None, ignore_index)
    if isinstance(plan, str) or plan.primary is None:
        return None
    logits = read_logits(plan.call.output, plan.batch_size, plan.out_seq_first)
    tokens = plan.columns(input_ids)
    assert tokens is not None
    if logits is None or tuple(logits.shape[:2]) != tuple(tokens.shape):
        return None
    mask = plan.columns(attention_mask)
    labels = tokens if mask is None or mask.shape != tokens.shape else tokens.masked_fill(mask == 0, ignore_index)
    return logits, labels, tokens


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


@dataclass(frozen=True)
class PositionTable:
    """A table of at least the call's length in rows and of the token table's width, and what the forward did with
    it: ``read`` (taken by any torch function), ``looked_up`` (indexed along the sequence, longer than 1), and
    ``constant`` (every such lookup's indices constant along the sequence; a host bool)."""

    name: str
    rows: int
    read: bool
    looked_up: bool
    constant: bool


def decide_position_tables(tables: list[PositionTable], length: int, token_table: str) -> Verdict | None:
    """``TFD216`` when a position table (rows >= ``length`` > 1, the token table's width) is looked up with indices
    constant along the sequence (every position gets the same row: position ids all zero), or is never read by the
    forward (positions never added). None otherwise: a table looked up with ids that vary (left padding starting
    later, packed documents restarting) is in use; a model with no such table (rotary, relative bias) has none."""
    if length < 2:
        return None
    constant = [t for t in tables if t.looked_up and t.constant]
    unread = [t for t in tables if not t.read]
    if constant:
        t = constant[0]
        return Verdict(
            "TFD216",
            f"Every position gets the same row of the position table `{t.name}` ({t.rows} rows): the forward looks it "
            f"up with indices that are constant along the sequence ({length} tokens), so no position information "
            "reaches the model beyond what a causal mask implies.",
            {"table": t.name, "rows": t.rows, "length": length, "kind": "constant", "token_table": token_table},
            hint=f"Pass position ids that count along the sequence to the lookup of `{t.name}` (e.g. "
            "`torch.arange(t)`, or the mask's cumulative sum minus one with left padding), not zeros.",
        )
    if unread:
        t = unread[0]
        return Verdict(
            "TFD216",
            f"The model holds a position table `{t.name}` ({t.rows} rows, the width of the token table "
            f"`{token_table}`) that the forward never reads: the token embedding is looked up, positions are never "
            "added.",
            {"table": t.name, "rows": t.rows, "length": length, "kind": "unread", "token_table": token_table},
            hint=f"Add `{t.name}` (its first {length} rows, or its lookup of the position ids) to the token "
            "embeddings in the forward.",
        )
    return None
