"""Recording the model calls a ``training_step`` makes, and re-issuing one with some of its tensors replaced.

A probe that guesses how to call a model fails on the models users actually write: ``forward(inputs, target)``, a
LightningModule without ``forward`` whose ``training_step`` calls ``self.model(x, y)``, a dict passed whole. Recording
the call ``training_step`` makes (module, positional and keyword arguments, output) and re-issuing it with perturbed
copies of its token tensors reaches all of them. Nothing here measures or decides; the recording is meant for
probing steps only (it adds hooks to every submodule for the duration of one call).

A library's loss-only wrapper (``training_step`` returns ``self.model(batch)``; the wrapper slices the token rows,
calls its inner network and returns only the loss) makes the call that returns logits one level down: with
``nested=True`` the recorder also keeps the calls made inside other calls, at any depth, each with its depth and the
order in which it started.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

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
        try:
            import inspect

            params = [
                p.name
                for p in inspect.signature(self.module.forward).parameters.values()
                if p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
            ]
        except (TypeError, ValueError):
            return None
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
    """Records the module calls under ``root`` between :meth:`start` and :meth:`stop`.

    By default the outermost calls only: calls made while no other module under ``root`` was running, i.e. the calls
    ``training_step`` itself makes (``self(x)``, ``self.model(x, y)``, ``self.loss_fn(...)``), not the layers inside
    them. With ``nested=True`` the calls at every depth, those inside others included (a loss-only wrapper's inner
    network); ``want(module, args, kwargs)``, asked when a nested call starts, keeps only the calls worth holding
    (their outputs stay alive until :meth:`stop`), and the outermost calls are always kept. :meth:`stop` returns the
    calls in the order they started. ``keep`` decides, at each call, whether to keep it (e.g. only inside the
    Trainer's ``training_step``). Adding a hook to every submodule is a Python loop over the modules: for probing
    steps only.
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
        self._depth = 0
        self._started = 0
        self._stack: list[tuple[int, bool]] = []  # (order, recorded) of the calls in progress
        self._handles: list[Any] = []

    def start(self) -> CallRecorder:
        def pre(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            order, self._started = self._started, self._started + 1
            wanted = self._depth == 0 or (self.nested and (self.want is None or self.want(module, args, kwargs)))
            self._stack.append((order, wanted))
            self._depth += 1

        def post(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
            self._depth -= 1
            order, wanted = self._stack.pop() if self._stack else (self._started, self._depth == 0)
            if wanted and (self.keep is None or self.keep()):
                self.calls.append(RecordedCall(module, args, dict(kwargs), output, depth=self._depth, order=order))

        for module in self.root.modules():
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
    """Run ``run()`` under a :class:`CallRecorder` on ``root``; returns its result and the module calls it made (the
    outermost ones, or with ``nested`` those at every depth that ``want`` keeps), in the order they started. The
    hooks are removed before this returns, also when ``run`` raises."""
    recorder = CallRecorder(root, nested=nested, want=want).start()
    try:
        result = run()
    finally:
        calls = recorder.stop()
    return result, calls


def takes_tokens(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether a call passes a 2-D integer tensor (token ids, or a slice of them), and is not an embedding lookup (whose
    output is hidden states, never logits): the nested calls worth recording for the token probes."""
    if isinstance(module, (nn.Embedding, nn.EmbeddingBag)):
        return False
    return any(
        t.ndim == 2 and not t.is_floating_point() and not t.is_complex() and t.dtype != torch.bool
        for _, t in tensor_leaves(args) + tensor_leaves(kwargs)
    )


@dataclass
class TableUse:
    """What one forward pass did with a set of watched tables (embedding weights, position parameters): which were
    read at all, and the index tensors each was looked up with (``F.embedding``, or indexing with an integer tensor)."""

    read: set[int] = dataclasses.field(default_factory=set)  # id() of every watched table read
    lookups: list[tuple[int, Tensor]] = dataclasses.field(default_factory=list)  # (id of the table, indices)


class TableReads(torch.overrides.TorchFunctionMode):
    """Watches, during one forward pass, every torch function that takes one of ``tables`` (weights or parameters):
    a table that no function takes is never read; ``F.embedding(indices, table)`` and ``table[indices]`` with an
    integer index tensor are lookups, kept with their indices. The ``id()`` of the tensors is the key. A Python hook on
    every torch function of the pass: for probing steps only."""

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
            if isinstance(index, Tensor) and not index.is_floating_point() and index.dtype != torch.bool:
                self.use.lookups.append((id(args[0]), index))
        for value in (*args, *kwargs.values()):
            if isinstance(value, Tensor) and id(value) in self._ids:
                self.use.read.add(id(value))
            elif isinstance(value, (list, tuple)):
                self.use.read.update(id(v) for v in value if isinstance(v, Tensor) and id(v) in self._ids)
        return func(*args, **kwargs)
