"""The record of the module calls a ``training_step`` makes: each call's module, arguments and output
(:class:`RecordedCall`, :class:`CallRecorder`), and what the model call is once found (:class:`ModelCall`, its token
slots and objective). Finding it among the calls: :mod:`lightning_tfdebug.primitives.call_finder`; one recording per
step is shared by the members that read it: :func:`lightning_tfdebug.core.calls.record_step`.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor, nn

from lightning_tfdebug.primitives.batch import is_id_tensor, logits_of

Path = tuple[Any, ...]
"""Where a tensor sits in a call: ``("args", 0)``, ``("kwargs", "labels")``, then keys or indices into containers."""


@dataclass
class RecordedCall:
    """One module call: the module, its arguments as they were passed, and what it returned."""

    module: nn.Module
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    output: Any
    depth: int = 0  # 0: made by training_step itself; 1: made inside such a call (a wrapper's inner network); ...
    order: int = 0  # when it started, among the recorded calls
    finished: int = 0  # when it ended, among the recorded calls (an inner call ends before the call around it)

    def leaves(self) -> list[tuple[Path, Tensor]]:
        """Every tensor in the arguments, with its path (containers: dict-likes, lists, tuples, dataclasses)."""
        return tensor_leaves(self.args, ("args",)) + tensor_leaves(self.kwargs, ("kwargs",))

    def call(self, replacements: Mapping[Path, Tensor] | None = None) -> Any:
        """Call the module again with the same arguments, the tensors at ``replacements``' paths replaced."""
        args, kwargs = self.args, self.kwargs
        if replacements:
            args = replace_leaves(args, {p[1:]: t for p, t in replacements.items() if p[0] == "args"})
            kwargs = replace_leaves(kwargs, {p[1:]: t for p, t in replacements.items() if p[0] == "kwargs"})
        return self.module(*args, **kwargs)

    def keyword(self, path: Path) -> str | None:
        """The argument name a tensor was passed under: the keyword, or the forward's parameter name for a positional
        argument (None when it cannot be read)."""
        if path[0] == "kwargs":
            return str(path[1])
        positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
        params = [p.name for p in forward_parameters(self.module).values() if p.kind in positional]
        index = path[1]
        return params[index] if isinstance(index, int) and index < len(params) else None

    def describe(self, path: Path) -> str:
        """A name for the tensor at ``path`` in messages: ``target`` (argument 2 of Transformer.forward)."""
        name = self.keyword(path)
        where = ".".join(str(p) for p in path[2:])
        label = name or (f"positional argument {path[1]}" if path[0] == "args" else str(path[1]))
        return f"{label}.{where}" if where else label


def _is_container(value: Any) -> bool:
    return isinstance(value, (Mapping, list, tuple)) or (
        dataclasses.is_dataclass(value) and not isinstance(value, type)
    )


def tensor_leaves(obj: Any, prefix: Path = ()) -> list[tuple[Path, Tensor]]:
    """``(path, tensor)`` for every tensor inside ``obj`` (nested dict-likes, lists, tuples and dataclasses)."""
    if isinstance(obj, Tensor):
        return [(prefix, obj)]
    out: list[tuple[Path, Tensor]] = []
    if isinstance(obj, Mapping):
        for key, value in obj.items():
            out += tensor_leaves(value, (*prefix, key))
    elif isinstance(obj, (list, tuple)):
        for i, value in enumerate(obj):
            out += tensor_leaves(value, (*prefix, i))
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            out += tensor_leaves(getattr(obj, f.name), (*prefix, f.name))
    return out


def replace_leaves(obj: Any, replacements: Mapping[Path, Tensor], prefix: Path = ()) -> Any:
    """A copy of ``obj`` with the tensors at the given paths replaced; containers are rebuilt, the rest shared."""
    if prefix in replacements:
        return replacements[prefix]
    if not any(p[: len(prefix)] == prefix for p in replacements) or not _is_container(obj):
        return obj
    if isinstance(obj, Mapping):
        items = {k: replace_leaves(v, replacements, (*prefix, k)) for k, v in obj.items()}
        try:
            return type(obj)(items)
        except Exception:  # a mapping type that cannot be built from a dict: a plain dict works for `**`
            return items
    if isinstance(obj, (list, tuple)):
        items_list = [replace_leaves(v, replacements, (*prefix, i)) for i, v in enumerate(obj)]
        if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # a namedtuple
            return type(obj)(*items_list)
        return type(obj)(items_list)
    changes = {
        f.name: replace_leaves(getattr(obj, f.name), replacements, (*prefix, f.name)) for f in dataclasses.fields(obj)
    }
    return dataclasses.replace(obj, **changes)


class CallRecorder:
    """Records the module calls under ``root`` between :meth:`start` and :meth:`stop`, in the order they started.

    Args:
        root: the module whose submodules are hooked (a hook on every one: for probing steps only).
        keep: decides at each call whether to keep it (e.g. only inside ``training_step``).
        nested: also keep inner calls that ``want(module, args, kwargs)`` accepts (their outputs live until
            :meth:`stop`); by default only the outermost calls.
        want: the filter of inner calls.
    """

    def __init__(
        self,
        root: nn.Module,
        keep: Callable[[], bool] | None = None,
        nested: bool = False,
        want: Callable[[nn.Module, tuple[Any, ...], dict[str, Any]], bool] | None = None,
    ) -> None:
        self.root = root
        self.keep = keep
        self.nested = nested
        self.want = want
        self.calls: list[RecordedCall] = []
        self.modules: list[nn.Module] | None = None  # the modules to hook; None: every module under ``root``
        # a call that does not count as a level (DDP routes ``training_step`` through the module: the calls inside it
        # are the outermost ones, as they are in one process); it is recorded itself like any outermost call
        self.transparent: Callable[[nn.Module, tuple[Any, ...], dict[str, Any]], bool] | None = None
        self._depth = 0
        self._started = 0
        self._stack: list[tuple[int, bool, bool]] = []  # (order, recorded, transparent) of the calls in progress
        self._handles: list[Any] = []

    def start(self) -> CallRecorder:
        def pre(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            order, self._started = self._started, self._started + 1
            wanted = self._depth == 0 or (self.nested and (self.want is None or self.want(module, args, kwargs)))
            through = self._depth == 0 and self.transparent is not None and self.transparent(module, args, kwargs)
            self._stack.append((order, wanted, through))
            self._depth += 0 if through else 1

        def post(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
            order, wanted, through = self._stack.pop() if self._stack else (self._started, self._depth == 1, False)
            self._depth -= 0 if through else 1
            if wanted and (self.keep is None or self.keep()):
                call = RecordedCall(module, args, dict(kwargs), output, self._depth, order, finished=len(self.calls))
                self.calls.append(call)

        for module in self.root.modules() if self.modules is None else self.modules:
            self._handles.append(module.register_forward_pre_hook(pre, with_kwargs=True))
            self._handles.append(module.register_forward_hook(post, with_kwargs=True, always_call=True))
        return self

    def stop(self) -> list[RecordedCall]:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._depth = 0
        self._stack.clear()
        self.calls.sort(key=lambda c: c.order)  # inner calls end first: give them back in the order they started
        return self.calls


def record_calls(
    root: nn.Module,
    run: Callable[[], Any],
    nested: bool = False,
    want: Callable[[nn.Module, tuple[Any, ...], dict[str, Any]], bool] | None = None,
) -> tuple[Any, list[RecordedCall]]:
    """``(run(), calls)``: ``run`` under a :class:`CallRecorder` on ``root`` (hooks removed even if it raises)."""
    recorder = CallRecorder(root, nested=nested, want=want).start()
    try:
        result = run()
    finally:
        calls = recorder.stop()
    return result, calls


def takes_tokens(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether a call passes a 2-D integer tensor and is not an embedding lookup: the nested calls worth recording."""
    if isinstance(module, (nn.Embedding, nn.EmbeddingBag)):
        return False  # an embedding's output is hidden states, never logits
    return any(t.ndim == 2 and is_id_tensor(t) for _, t in tensor_leaves(args) + tensor_leaves(kwargs))


@dataclass
class TableUse:
    """What one forward pass did with the watched tables: which were read, and the indices each was looked up with."""

    read: set[int] = dataclasses.field(default_factory=set)  # id() of every watched table read
    lookups: list[tuple[int, Tensor]] = dataclasses.field(default_factory=list)  # (id of the table, indices)


class TableReads(torch.overrides.TorchFunctionMode):
    """Records into :attr:`use` which of ``tables`` one forward pass reads, and its ``F.embedding(indices, table)`` /
    ``table[indices]`` lookups. A Python hook on every torch function of the pass: for probing steps only."""

    def __init__(self, tables: list[Tensor]) -> None:
        super().__init__()
        self._ids = {id(t) for t in tables}
        self.use = TableUse()

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.nn.functional.embedding:
            weight = kwargs.get("weight", args[1] if len(args) > 1 else None)
            indices = kwargs.get("input", args[0] if args else None)
            if weight is not None and id(weight) in self._ids and isinstance(indices, Tensor):
                self.use.lookups.append((id(weight), indices))
        elif func is Tensor.__getitem__ and args and id(args[0]) in self._ids:
            index = args[1] if len(args) > 1 else None
            if is_id_tensor(index):
                self.use.lookups.append((id(args[0]), index))
        for value in (*args, *kwargs.values()):
            if isinstance(value, Tensor) and id(value) in self._ids:
                self.use.read.add(id(value))
            elif isinstance(value, (list, tuple)):
                self.use.read.update(id(v) for v in value if isinstance(v, Tensor) and id(v) in self._ids)
        return func(*args, **kwargs)


# ==================================================================================================== the model call
ModelKind = Literal["decoder", "encoder", "encoder-decoder", "loss-only wrapper", "unknown"]

RELATION_FRACTION = 0.95
"""A token tensor carries the labels when it equals them, at one offset, at this fraction of the supervised positions
or more (a denoising source, BART's 15% corruption, does not)."""

ROW_SLICES: tuple[tuple[int, int | None], ...] = ((0, None), (0, -1), (1, None))
"""The columns of the batch's ids a call may receive, by preference: all, ``rows[:, :-1]``, ``rows[:, 1:]``."""


@dataclass(frozen=True)
class Objective:
    """What the batch's labels ask the model to predict, counted over the supervised positions (host numbers).

    Attributes:
        supervised: labels that are not ``ignore_index``.
        same: supervised labels equal to the input at their position (a model that shifts them itself).
        following: supervised labels equal to the next input (labels shifted in the data).
        supervised_next: supervised labels that have a next input.
        label_positions: every label position, supervised or not.
    """

    supervised: float
    same: float
    following: float
    supervised_next: float
    label_positions: int

    @property
    def next_token(self) -> bool:
        """A decoder's objective: labels equal to the inputs or to the next inputs at half or more of the supervised
        positions (or nothing supervised); anything else is masked-LM or denoising."""
        return (
            self.supervised == 0
            or self.same >= 0.5 * self.supervised
            or self.following >= 0.5 * max(self.supervised_next, 1.0)
        )


def read_objective(input_ids: Tensor, labels: Tensor, ignore_index: int) -> Objective:
    """The :class:`Objective` of ``labels`` (shaped like ``input_ids``). One host sync: reading steps only."""
    with torch.no_grad():
        supervised = labels != ignore_index
        same = ((labels == input_ids) & supervised).sum()
        following = ((labels[:, :-1] == input_ids[:, 1:]) & supervised[:, :-1]).sum()
        counts = torch.stack([supervised.sum(), same, following, supervised[:, :-1].sum()]).tolist()
    return Objective(*(float(c) for c in counts), label_positions=int(labels.numel()))


@dataclass(frozen=True)
class TokenSlot:
    """A token tensor of the model call (a 2-D integer tensor with a batch dimension).

    Attributes:
        path: where it sits in the call (:data:`Path`).
        name: how messages name it: ``target`` (argument 2 of ``Transformer.forward``).
        seq_first: stored ``(T, B)`` rather than ``(B, T)``.
        length: its sequence length.
        offset: its position ``t`` carries label ``t - offset``; None: unrelated to the labels.
        primary: the batch's token ids (or the slice of them the call received).
        label_like: passed under a labels name (``labels``, ``targets``, ...): read by the loss, not the network.
    """

    path: Path
    name: str
    seq_first: bool
    length: int
    offset: int | None
    primary: bool
    label_like: bool


@dataclass
class ModelCall:
    """The call that took the batch's token rows and returned logits, and what each of its tensors is.

    Built by :func:`~lightning_tfdebug.primitives.call_finder.find_model_call` from a step's recorded calls.
    Output position ``p`` is trained on label ``p + shift`` (:attr:`shift`).

    Attributes:
        call: the recorded call (module, arguments, output).
        kind: what the model is (:data:`ModelKind`; a loss-only wrapper's call is the network inside it).
        kind_source: where the kind was read (:func:`model_kind`; ``"setting"``: ``model_kind=``).
        batch_size: rows of the call.
        slots: its token tensors.
        ids_shift: 1 when the labels equal the ids (the model or its loss shifts them), else 0.
        mask_path: where the batch's attention mask (or its inverse) sits in the call; None: not passed.
        mask_inverted: a padding mask (True = padding) rather than an attention mask (1 = real).
        mask_seq_first: the mask is stored ``(T, B)``.
        mask_named: the called forward names a mask parameter.
        mask_opaque: a mask is passed in an encoding not read here (additive floats, 4-D).
        out_seq_first: the call is sequence-first (its logits too).
        ignore_index: the label value that is not supervised.
        ids_start: the call's token ids are the batch's ids from this column ...
        ids_stop: ... to this one (None: to the end): a slice of token rows such as ``rows[:, :-1]``.
        objective: what the batch's labels ask for, when the kind was read from them (labels shaped like the ids).
        tensors: every tensor of the call by path.
    """

    call: RecordedCall
    kind: ModelKind
    kind_source: str
    batch_size: int
    slots: list[TokenSlot]
    ids_shift: int
    mask_path: Path | None = None
    mask_inverted: bool = False
    mask_seq_first: bool = False
    mask_named: bool = False
    mask_opaque: bool = False
    out_seq_first: bool = False
    ignore_index: int = -100
    ids_start: int = 0
    ids_stop: int | None = None
    objective: Objective | None = None
    tensors: dict[Path, Tensor] = dataclasses.field(default_factory=dict)

    # ------------------------------------------------------------------ views
    @property
    def shift(self) -> int:
        """Output ``p`` is trained on label ``p + shift``: ``ids_shift + ids_start``; 0 for an encoder-decoder."""
        return 0 if self.kind == "encoder-decoder" else self.ids_start + self.ids_shift

    @property
    def decoder_input(self) -> TokenSlot | None:
        """An encoder-decoder's slot that carries the decoder's input (``decoder_input_ids``, else another sequence that
        carries the labels); None for other kinds."""
        if self.kind != "encoder-decoder":
            return None
        named = [s for s in self.slots if not s.primary and s.name.split(".")[0] == "decoder_input_ids"]
        carriers = [s for s in self.slots if not s.primary and s.offset is not None]
        return next(iter(named + sorted(carriers, key=lambda s: s.label_like)), None)

    @property
    def primary(self) -> TokenSlot | None:
        """The slot holding the batch's token ids (or their slice); None when the call takes tensors made from them."""
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

    def batch_first(self, slot: TokenSlot) -> Tensor:
        t = self.tensors[slot.path]
        return t.transpose(0, 1) if slot.seq_first else t

    def related(self) -> list[TokenSlot]:
        """The slots that carry the labels (those a leak probe perturbs), never an encoder-decoder's encoder input."""
        encoder = self.kind == "encoder-decoder"
        return [s for s in self.slots if s.offset is not None and not (encoder and s.primary)]

    def seq_first_at(self, path: Path) -> bool:
        """Whether the tensor at ``path`` is stored ``(T, B, ...)``: a slot's or the mask's layout as read; another
        tensor's from where its rows are (the call's layout when both of its first dimensions could hold them)."""
        slot = next((s for s in self.slots if s.path == path), None)
        if slot is not None:
            return slot.seq_first
        if path == self.mask_path:
            return self.mask_seq_first
        t = self.tensors.get(path)
        if t is None or t.ndim < 2 or t.shape[1] != self.batch_size:
            return False
        return self.out_seq_first or t.shape[0] != self.batch_size

    def sequence_group(self, length: int, exclude: Path | None = None) -> list[Path]:
        """The tensors of the call with a row per sample and ``length`` positions along their sequence axis (dim 1
        batch-first), whatever their dtype or name: a decoder's ids, its mask and per-position labels share one
        length, so a probe that cuts or extends one of them cuts or extends them all (``exclude``: the one changed)."""
        out = []
        for path, t in self.tensors.items():
            if path == exclude or t.ndim < 2:
                continue
            rows, positions = (1, 0) if self.seq_first_at(path) else (0, 1)
            if t.shape[rows] == self.batch_size and t.shape[positions] == length:
                out.append(path)
        return out

    @property
    def resizable(self) -> bool:
        """Whether the probes may give the ids another length: every other tensor of their length is a token tensor
        passed under a labels name (``labels``, ``targets``, ``tgt``: extended with ids of the batch); a decoder input
        by another name, a float feature or a mask of that length has no value a longer probe could give it (see
        :meth:`sequence_group`)."""
        primary = self.primary
        if primary is None:
            return False
        labels = {s.path for s in self.slots if s.label_like}
        others = set(self.sequence_group(primary.length, exclude=primary.path)) - {self.mask_path}
        return others <= labels

    @property
    def time_cut_safe(self) -> bool:
        """Whether the sequences can be cut shorter: every tensor with a dimension of their length has it only along
        its sequence axis, with a row per sample (the :meth:`sequence_group`, cut together)."""
        primary = self.primary
        if primary is None:
            return False
        group = set(self.sequence_group(primary.length))
        for path, t in self.tensors.items():
            rows, positions = (1, 0) if self.seq_first_at(path) else (0, 1)
            skip = {positions} if path in group else set()  # a member's positions are cut with the ids
            if t.ndim >= 2 and t.shape[rows] == self.batch_size:
                skip.add(rows)  # (the row dimension holds the batch size, whatever it equals)
            if primary.length in [n for i, n in enumerate(t.shape) if i not in skip]:
                return False
        return True

    def mask_value(self, real: Tensor) -> Tensor:
        """The recorded mask's encoding of ``real`` (1 = real token), batch-first."""
        return (real == 0) if self.mask_inverted else real

    # ------------------------------------------------------------------ outputs
    def logits(self) -> Tensor | None:
        """The recorded output's logits as ``(batch, time, vocab)`` (:func:`read_logits`); None once released."""
        if self.call.output is None:
            return None
        return read_logits(self.call.output, self.batch_size, self.out_seq_first)

    def token_rows(self, input_ids: Tensor, attention_mask: Tensor | None) -> tuple[Tensor, Tensor, Tensor] | None:
        """For a batch without labels: ``(logits, labels, tokens)`` of this call, ``tokens`` the ids it received and
        ``labels`` the same with padding set to ``ignore_index``. None when the call does not take the ids themselves,
        or returned no logits over the positions it received."""
        logits = self.logits()
        tokens = self.columns(input_ids)
        if self.primary is None or logits is None or tokens is None or tuple(logits.shape[:2]) != tuple(tokens.shape):
            return None
        mask = self.columns(attention_mask)
        if mask is None or mask.shape != tokens.shape:
            return logits, tokens, tokens
        return logits, tokens.masked_fill(mask == 0, self.ignore_index), tokens

    def release(self) -> None:
        """Let the recorded output and tensors go: a shared reading must not hold a step's logits."""
        self.call = dataclasses.replace(self.call, output=None)
        self.tensors = {}


def read_logits(output: Any, batch_size: int, seq_first: bool = False) -> Tensor | None:
    """The logits in a call's output (``.logits``, else its first float tensor) as ``(batch, time, vocab)``, from
    ``(B, T, V)``, ``(T, B, V)`` or flattened ``(B*T, V)`` / ``(T*B, V)``; None when no float tensor fits."""
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


def relation_offset(
    slot: Tensor, reference: Tensor, ignore_index: int, offsets: tuple[int, ...] = (0, 1, -1)
) -> int | None:
    """The largest offset ``o`` at which ``slot[:, t] == reference[:, t - o]`` at :data:`RELATION_FRACTION` of the
    supervised positions, or None. A position counts when the label it carries is supervised and so is the label of
    its own position, where the reference has one (a decoder input's position past the last label is padding, which a
    collator may blank). Host syncs: recording steps only."""
    matches: list[int] = []
    ts, tr = slot.shape[1], reference.shape[1]
    for o in offsets:
        lo, hi = max(0, o), min(ts, tr + o)
        if hi - lo < 2:
            continue
        s = slot[:, lo:hi]
        r = reference[:, lo - o : hi - o]
        supervised = r != ignore_index
        own = reference[:, lo : min(hi, tr)] != ignore_index  # the labels of the slot's own positions
        supervised[:, : own.shape[1]] &= own
        n = int(supervised.sum())
        if n == 0:
            continue
        frac = int(((s == r) & supervised).sum()) / n
        if frac >= RELATION_FRACTION:
            matches.append(o)
    # Repetitive text matches at several offsets; the largest starts the leak probe latest (never blaming a repeat)
    return max(matches) if matches else None


def forward_parameters(module: nn.Module) -> Mapping[str, inspect.Parameter]:
    """The parameters of ``module.forward`` by name (none when its signature cannot be read)."""
    try:
        return inspect.signature(module.forward).parameters
    except (TypeError, ValueError):
        return {}
