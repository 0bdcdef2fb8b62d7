"""Batch views: one reading of a training batch and of what the model returns (pure; no Trainer).

A :class:`StepBatch` resolves the fields once per key settings and computes counts once on the device (no sync);
:func:`lightning_tfdebug.core.batch.step_batch` shares one per step. Batches may be mappings, tuples/lists, dataclasses
or a bare tensor, nested; a key is a name, a dotted path (``"inputs.input_ids"``) or a tuple index (``"0"``), and left
as ``None`` is found by its usual names, or in tuple batches by position. :func:`logits_of` and :func:`loss_of` read
model and step outputs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np  # installed with torchmetrics and tensorboard (both require it); not a dependency of its own
import torch
from torch import Tensor

IGNORE_INDEX = -100
"""PyTorch's default ``ignore_index`` of ``cross_entropy`` / ``nll_loss``, and Hugging Face's label padding."""

IDS_KEYS: tuple[str, ...] = ("input_ids", "tokens", "token_ids", "ids", "input", "inputs", "src", "x")
MASK_KEYS: tuple[str, ...] = ("attention_mask", "padding_mask", "attn_mask", "mask")
LABELS_KEYS: tuple[str, ...] = ("labels", "label_ids", "targets", "target", "tgt", "y")
POSITION_KEYS: tuple[str, ...] = ("position_ids", "positions", "pos")


def _is_container(value: Any) -> bool:
    return isinstance(value, (Mapping, Tensor)) or (isinstance(value, Sequence) and not isinstance(value, (str, bytes)))


def _is_dataclass_instance(value: Any) -> bool:
    return dataclasses.is_dataclass(value) and not isinstance(value, type)


def flatten_batch(batch: Any, prefix: str = "") -> dict[str, Any]:
    """Leaves of a batch by path (keys, fields and indices joined with ``.``; a bare tensor is ``""``); a list of
    plain values (per-sample ids or texts) is one leaf."""
    out: dict[str, Any] = {}
    _flatten_into(out, batch, prefix)
    return out


def _flatten_into(out: dict[str, Any], batch: Any, prefix: str) -> None:
    # Every batch, every step: a tensor (the usual leaf) is told apart first, with one plain isinstance, before the
    # abstract-class and dataclass checks that containers need.
    if isinstance(batch, Tensor):
        out[prefix[:-1] if prefix else ""] = batch
    elif isinstance(batch, Mapping):
        for k, v in batch.items():
            if isinstance(v, Tensor):
                out[f"{prefix}{k}"] = v
            else:
                _flatten_into(out, v, f"{prefix}{k}.")
    elif _is_dataclass_instance(batch):
        for f in dataclasses.fields(batch):
            _flatten_into(out, getattr(batch, f.name), f"{prefix}{f.name}.")
    elif isinstance(batch, Sequence) and not isinstance(batch, (str, bytes)) and any(_is_container(v) for v in batch):
        for i, v in enumerate(batch):
            _flatten_into(out, v, f"{prefix}{i}.")
    else:
        out[prefix[:-1] if prefix else ""] = batch


#: dtypes NumPy reads from a CPU tensor without a copy (not bfloat16, which NumPy lacks)
_NUMPY_READABLE = frozenset(
    {
        torch.bool,
        torch.uint8,
        torch.int8,
        torch.int16,
        torch.int32,
        torch.int64,
        torch.float16,
        torch.float32,
        torch.float64,
    }
)


def host_array(tensor: Tensor) -> np.ndarray | None:
    """``tensor``'s memory as a NumPy array (no copy) when it is a CPU tensor NumPy can read (no autograd history, no
    negative bit, a NumPy dtype); else None. Saves torch kernels on the hot path."""
    if tensor.device.type != "cpu" or tensor.dtype not in _NUMPY_READABLE or tensor.requires_grad or tensor.is_neg():
        return None
    return tensor.numpy()


def is_id_tensor(value: Any) -> bool:
    """An integer tensor (token ids, labels): not floating, complex or boolean."""
    return (
        isinstance(value, Tensor)
        and not value.is_floating_point()
        and not value.is_complex()
        and value.dtype != torch.bool
    )


@dataclass(frozen=True)
class BatchKeys:
    """Where the fields of a batch are; ``None`` finds a field by its usual names, an int is a tuple position.

    Raises:
        TypeError: if a key is not a non-empty string or None, or ``ignore_index`` is not an integer.
    """

    input_key: str | int | None = None
    mask_key: str | int | None = None
    labels_key: str | int | None = None
    position_key: str | int | None = None
    ignore_index: int = IGNORE_INDEX

    def __post_init__(self) -> None:
        for name in ("input_key", "mask_key", "labels_key", "position_key"):
            value = getattr(self, name)
            if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
                object.__setattr__(self, name, str(value))  # a tuple position: the path "1"
                continue
            if value is not None and (not isinstance(value, str) or not value):
                raise TypeError(f"`{name}` must be a non-empty string (a key or dotted path) or None; got {value!r}.")
        if isinstance(self.ignore_index, bool) or not isinstance(self.ignore_index, int):
            raise TypeError(f"`ignore_index` must be an integer; got {self.ignore_index!r}.")


def _tails(leaves: Mapping[str, Any]) -> dict[str, list[str]]:
    """The paths of the tensor leaves by the last part of their path, in the batch's order."""
    out: dict[str, list[str]] = {}
    for path, value in leaves.items():
        if isinstance(value, Tensor):
            out.setdefault(path.rsplit(".", 1)[-1], []).append(path)
    return out


def _by_name(
    leaves: Mapping[str, Any], tails: Mapping[str, list[str]], given: str | None, names: Sequence[str]
) -> str | None:
    """The path of the leaf ``given`` names (exact path, else a unique tensor leaf whose last part is ``given``), or,
    when nothing is given, of the first tensor leaf whose last part is one of ``names`` (``tails``: :func:`_tails`)."""
    if given is not None:
        if isinstance(leaves.get(given), Tensor):
            return given
        tail = tails.get(given, ())
        return tail[0] if len(tail) == 1 else None
    for name in names:
        paths = tails.get(name)
        if paths:
            return paths[0]
    return None


@dataclass
class BatchFields:
    """The fields of one batch, each with the path it was found at (``None`` when the batch has no such field)."""

    leaves: dict[str, Any] = field(default_factory=dict)
    input_ids: Tensor | None = None
    attention_mask: Tensor | None = None
    labels: Tensor | None = None
    position_ids: Tensor | None = None
    paths: dict[str, str | None] = field(default_factory=dict)
    ids_by_position: bool = False  # the ids were found by position in a tuple batch, not by name


def read_batch(batch: Any, keys: BatchKeys | None = None) -> BatchFields:
    """Resolve the token ids, attention mask, labels and position ids of ``batch`` (host metadata only).

    Ids by key or name (integers), else the first 2-D integer tensor; mask and positions by name; labels by name, else
    (ids found by position) the next integer tensor with as many elements. Fields that do not fit are still returned.
    """
    keys = keys or BatchKeys()
    leaves = flatten_batch(batch)
    tails = _tails(leaves)
    ids_path = _by_name(leaves, tails, keys.input_key, IDS_KEYS)
    if ids_path is not None and keys.input_key is None and not is_id_tensor(leaves[ids_path]):
        ids_path = None  # a float `x` (features) is not token ids
    mask_path = _by_name(leaves, tails, keys.mask_key, MASK_KEYS)
    labels_path = _by_name(leaves, tails, keys.labels_key, LABELS_KEYS)
    if labels_path is not None and keys.labels_key is None and not is_id_tensor(leaves[labels_path]):
        labels_path = None
    by_position = False
    if ids_path is None and keys.input_key is None:  # never the tensor already named as the labels or the mask
        named = (labels_path, mask_path)
        ids_path = next((p for p, v in leaves.items() if p not in named and is_id_tensor(v) and v.ndim == 2), None)
        by_position = ids_path is not None
    if labels_path is None and keys.labels_key is None and by_position and ids_path is not None:
        order = list(leaves)
        numel = leaves[ids_path].numel()
        labels_path = next(
            (
                p
                for p in order[order.index(ids_path) + 1 :]
                if p != mask_path and is_id_tensor(leaves[p]) and leaves[p].numel() == numel
            ),
            None,
        )
    position_path = _by_name(leaves, tails, keys.position_key, POSITION_KEYS)
    return BatchFields(
        leaves=leaves,
        input_ids=leaves.get(ids_path) if ids_path is not None else None,
        attention_mask=leaves.get(mask_path) if mask_path is not None else None,
        labels=leaves.get(labels_path) if labels_path is not None else None,
        position_ids=leaves.get(position_path) if position_path is not None else None,
        paths={
            "input_ids": ids_path,
            "attention_mask": mask_path,
            "labels": labels_path,
            "position_ids": position_path,
        },
        ids_by_position=by_position,
    )


class StepBatch:
    """The current training batch as every callback sees it (:func:`step_batch`): counts on the device, sizes on the
    host."""

    def __init__(self, batch: Any, keys: BatchKeys) -> None:
        self.batch = batch
        self.keys = keys
        self.fields = read_batch(batch, keys)
        self._cache: dict[str, Any] = {}

    @property
    def input_ids(self) -> Tensor | None:
        return self.fields.input_ids

    @property
    def attention_mask(self) -> Tensor | None:
        """The mask when it has the ids' shape (else None: it cannot say which ids are padding)."""
        mask, ids = self.fields.attention_mask, self.fields.input_ids
        if mask is None or (ids is not None and mask.shape != ids.shape):
            return None
        return mask

    @property
    def labels(self) -> Tensor | None:
        return self.fields.labels

    @property
    def samples(self) -> int:
        """Sequences in the batch (host, from the shape)."""
        source = self.fields.input_ids if self.fields.input_ids is not None else self.attention_mask
        if source is None:
            return 0
        return int(source.shape[0]) if source.ndim >= 2 else 1

    @property
    def positions(self) -> int:
        """Token positions computed, padding included (host, from the shape)."""
        source = self.fields.input_ids if self.fields.input_ids is not None else self.attention_mask
        return 0 if source is None else int(source.numel())

    def token_fields(self) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
        """The ids, mask and labels as token tensors: integer ids (else all three are None), a mask with one entry
        per id, integer labels (float labels, for regression or soft targets, are not token labels). Host metadata."""
        ids, mask, labels = self.fields.input_ids, self.fields.attention_mask, self.fields.labels
        if ids is None or not is_id_tensor(ids) or ids.numel() == 0:
            return None, None, None
        mask = mask if isinstance(mask, Tensor) and mask.numel() == ids.numel() else None
        labels = labels if isinstance(labels, Tensor) and labels.numel() and is_id_tensor(labels) else None
        return ids, mask, labels

    def tokens(self) -> Tensor | int:
        """Real (non-padding) tokens: the mask's non-zero entries (a device tensor; a host int for a CPU mask), or
        every position when the batch has no mask (a host int)."""
        if "tokens" not in self._cache:
            mask = self.attention_mask
            if mask is None:
                self._cache["tokens"] = self.positions
            else:
                # a CPU mask is host memory already: NumPy counts it without a torch kernel (about 1 us against
                # 10-20 us of dispatch on the hot path, every batch) and the count stays a host int
                array = host_array(mask)
                self._cache["tokens"] = int(np.count_nonzero(array)) if array is not None else torch.count_nonzero(mask)
        return self._cache["tokens"]

    def supervised(self) -> Tensor | None:
        """Labels that are not ``ignore_index`` (a device tensor), or None when the batch has no labels."""
        if "supervised" not in self._cache:
            labels = self.fields.labels
            self._cache["supervised"] = (
                None if labels is None else torch.count_nonzero(labels != self.keys.ignore_index)
            )
        return self._cache["supervised"]


def _usable_logits(x: Any) -> bool:
    return isinstance(x, Tensor) and x.is_floating_point() and x.ndim >= 2


def logits_of(output: Any, structured_only: bool = False) -> Tensor | None:
    """The logits in a model's output: ``.logits`` or ``["logits"]`` (Hugging Face outputs, dicts), a float tensor
    with a class dimension, or (unless ``structured_only``) the first such tensor in a tuple or list (``logits, loss =
    model(x, y)``). None when there is none."""
    if isinstance(output, Mapping):
        value = output.get("logits")
        return value if _usable_logits(value) else None
    value = getattr(output, "logits", None)
    if _usable_logits(value):
        return value
    if structured_only:
        return None
    if _usable_logits(output):
        return output
    if isinstance(output, (tuple, list)):
        return next((x for x in output if _usable_logits(x)), None)
    return None


def loss_of(output: Any) -> Tensor | None:
    """The loss in what ``training_step`` (or a model) returned: a scalar tensor, ``["loss"]`` or ``.loss``."""
    if isinstance(output, Mapping):
        output = output.get("loss")
    elif not isinstance(output, Tensor):
        output = getattr(output, "loss", None)
    return output if isinstance(output, Tensor) and output.numel() == 1 else None


def logits_for_labels(logits: Tensor, labels: Tensor) -> Tensor | None:
    """``logits`` viewed as ``labels.shape + (V,)``, or None when they cannot be the logits for these labels.

    Accepts the layouts models return: already ``(B, T, V)`` for labels ``(B, T)``; flattened to ``(B*T, V)`` (a
    model that returns ``output.view(-1, V)`` for an NLL loss over ``target.view(-1)``); sequence-first ``(T, B, V)``
    (``nn.Transformer`` without ``batch_first``), transposed. Log-probabilities pass as they are: the cross-entropy
    of log-probabilities equals their NLL. A view, no copy and no sync.
    """
    if logits.ndim < 2 or labels.ndim < 1:
        return None
    vocab = int(logits.shape[-1])
    target = (*labels.shape, vocab)
    if tuple(logits.shape) == target:
        return logits
    if logits.ndim == 2 and logits.shape[0] == labels.numel():
        return logits.reshape(target)
    if labels.ndim == 2 and logits.ndim == 3 and tuple(logits.shape[:2]) == (labels.shape[1], labels.shape[0]):
        return logits.transpose(0, 1)
    return None
