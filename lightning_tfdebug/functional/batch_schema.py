"""A batch's structure as host metadata: each field's dtype, rank and sizes (:class:`FieldSpec`), the schema a run
declares or learns from its first batches (:class:`Schema`), and how a batch drifts from it (:class:`Drift`). Pure:
no tensor data is read."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

# ----------------------------------------------------------------------------------------------------------- schema


@dataclass(frozen=True)
class FieldSpec:
    """What one leaf of a batch looks like: ``dtype`` (a torch dtype name, or a Python type name for non-tensors)
    and ``shape`` (``None`` for non-tensors)."""

    dtype: str
    shape: tuple[int, ...] | None

    def describe(self) -> str:
        if self.shape is None:
            return self.dtype
        return f"{self.dtype}[{', '.join(str(s) for s in self.shape)}]"


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def describe_leaves(leaves: Mapping[str, Any]) -> dict[str, FieldSpec]:
    """The :class:`FieldSpec` of every flattened leaf of a batch
    (:func:`~lightning_tfdebug.primitives.batch.flatten_batch`). Host metadata only."""
    out = {}
    for path, value in leaves.items():
        if isinstance(value, Tensor):
            out[path] = FieldSpec(_dtype_name(value.dtype), tuple(value.shape))
        else:  # a list of plain values too: its length is the batch size, not checked
            out[path] = FieldSpec(type(value).__name__, None)
    return out


def structure_key(leaves: Mapping[str, Any]) -> tuple:
    """What :func:`describe_leaves` reads of every leaf (path, dtype and shape of a tensor, type of anything else), as
    one tuple: two batches with equal keys have equal specs. Cheaper than the specs; host metadata only."""
    return tuple(
        (path, value.dtype, value.shape) if isinstance(value, Tensor) else (path, type(value))
        for path, value in leaves.items()
    )


_DECLARED = re.compile(r"^\s*([A-Za-z0-9_]+)\s*(?:\[(.*)\])?\s*$")


@dataclass
class KeySchema:
    """Expected dtype and dimensions of one key.

    ``dims`` holds, per dimension, an int (fixed size), a name (a size shared by every dimension of the batch with
    the same name) or ``None`` (free). ``None`` for ``dims`` means the number of dimensions is not checked.
    """

    dtype: str
    dims: list[int | str | None] | None


@dataclass
class Schema:
    """Expected structure of every batch: a :class:`KeySchema` per key, and whether it was declared or learned."""

    keys: dict[str, KeySchema] = field(default_factory=dict)
    declared: bool = False


def parse_declared_schema(declared: Mapping[str, str]) -> Schema:
    """Parse ``{key: "int64[B, T]"}`` declarations: a dtype name, then optional dimensions (an integer is fixed, a
    name shared by every dimension so named, ``*`` free).

    Raises:
        ValueError: on a malformed declaration or an unknown dtype.
    """
    schema = Schema(declared=True)
    for key, text in declared.items():
        match = _DECLARED.match(str(text))
        if not match:
            raise ValueError(f"`schema[{key!r}]` must look like 'int64[B, T]'; got {text!r}.")
        dtype, dims_text = match.group(1), match.group(2)
        if not isinstance(getattr(torch, dtype, None), torch.dtype):
            raise ValueError(f"`schema[{key!r}]` names dtype {dtype!r}, which is not a torch dtype (e.g. 'int64').")
        dims: list[int | str | None] | None = None
        if dims_text is not None:
            dims = []
            for part in (p.strip() for p in dims_text.split(",")) if dims_text.strip() else ():
                if part == "*":
                    dims.append(None)
                elif part.isdigit():
                    dims.append(int(part))
                elif part.isidentifier():
                    dims.append(part)
                else:
                    raise ValueError(f"`schema[{key!r}]`: dimension {part!r} must be an integer, a name or '*'.")
        schema.keys[key] = KeySchema(_dtype_name(getattr(torch, dtype)), dims)
    return schema


def _size(spec: Mapping[str, FieldSpec], key: str, i: int) -> int | None:
    shape = spec[key].shape if key in spec else None
    return shape[i] if shape is not None and len(shape) > i else None


def learn_schema(specs: Sequence[Mapping[str, FieldSpec]]) -> Schema:
    """A schema learned from the specs of the first batches: the first batch's keys, dtypes and dimension counts.

    Sizes are free (a run whose first batches share a padded length must not flag the first shorter one), except that
    dimension ``i`` of keys whose sizes were equal in *every* batch gets a shared name, so a later batch where they
    disagree (labels shorter than the ids) is caught.
    """
    first = specs[0]
    tensors = [k for k, s in first.items() if s.shape is not None]
    names: dict[tuple[str, int], str] = {}
    for key in tensors:
        for i in range(len(first[key].shape or ())):
            if (key, i) in names:
                continue
            group = [
                other
                for other in tensors
                if other != key
                and (other, i) not in names
                and all(_size(s, other, i) is not None and _size(s, other, i) == _size(s, key, i) for s in specs)
            ]
            for member in [key, *group] if group else []:
                names[member, i] = f"d{i}:{key}"
    schema = Schema()
    for key, spec in first.items():
        dims = None if spec.shape is None else [names.get((key, i)) for i in range(len(spec.shape))]
        schema.keys[key] = KeySchema(spec.dtype, dims)
    return schema


@dataclass(frozen=True)
class Drift:
    """One difference between a batch and the schema.

    ``kind`` is ``"missing"``, ``"extra"``, ``"dtype"``, ``"ndim"`` or ``"size"``.
    """

    kind: str
    key: str
    expected: str
    found: str


def compare_schema(schema: Schema, specs: Mapping[str, FieldSpec]) -> list[Drift]:
    """Every way the batch described by ``specs`` differs from ``schema``."""
    out = [Drift("missing", key, expected.dtype, "absent") for key, expected in schema.keys.items() if key not in specs]
    if not schema.declared:
        out += [Drift("extra", key, "absent", spec.describe()) for key, spec in specs.items() if key not in schema.keys]
    sizes: dict[str, tuple[str, int]] = {}  # a shared dimension name -> (the first key, its size)
    for key, expected in schema.keys.items():
        spec = specs.get(key)
        if spec is not None and spec.dtype != expected.dtype:
            out.append(Drift("dtype", key, expected.dtype, spec.dtype))
        if spec is None or expected.dims is None or spec.shape is None:
            continue
        if len(spec.shape) != len(expected.dims):
            want = "[" + ", ".join("*" if d is None else str(d) for d in expected.dims) + "]"
            out.append(Drift("ndim", key, f"{len(expected.dims)} dims {want}", f"{len(spec.shape)} dims {spec.shape}"))
            continue
        for i, (dim, size) in enumerate(zip(expected.dims, spec.shape)):
            found = f"dim {i} = {size} (shape {tuple(spec.shape)})"
            if isinstance(dim, int) and size != dim:
                out.append(Drift("size", key, f"dim {i} = {dim}", found))
            elif isinstance(dim, str):
                other, other_size = sizes.setdefault(dim, (key, size))
                if other_size != size:
                    out.append(Drift("size", key, f"dim {i} = {other_size}, as in {other!r}", found))
    return out
