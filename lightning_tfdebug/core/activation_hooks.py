"""DeadActivation's forward hooks (:class:`ActivationHooks`) and the ``TorchFunctionMode`` that finds activations
called as functions inside ``forward`` (:class:`FunctionCalls`). They count; nothing here decides."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook
from torch.overrides import TorchFunctionMode
from torch.utils.hooks import RemovableHandle

from lightning_tfdebug.core.distributed import world_size
from lightning_tfdebug.core.model import in_training_step
from lightning_tfdebug.functional.activations import (
    FUNCTION_KINDS,
    TAIL_SATURATING,
    LayerCounts,
    apply_activation,
    kind_of_module,
    tail_cutoff,
)
from lightning_tfdebug.primitives.tensors import clean_param_name


@dataclass
class HookedLayer(LayerCounts):
    """One measured layer: what its hook counted on the current measuring step, and the hook while it exists."""

    from_preactivation: bool = False  # the hooked module's output is the pre-activation; the activation is applied here
    handles: list[RemovableHandle] = field(default_factory=list)


class ActivationHooks:
    """The activation layers of ``root`` and the hooks that count them during one measured forward.

    Args:
        root: the LightningModule; only forwards inside its ``training_step`` are counted (not another callback's
            probe forward).
        layers: regular expression narrowing the activation modules (and the modules whose function calls count) by
            qualified name; None: all.
        preactivations: ``{regex: kind}``: modules whose *output* is the input of an activation applied as a
            function; the activation is applied to their output here.
        functional: also find the activation functions submodules call (:class:`FunctionCalls`). The set of such
            layers is open during the first measured forward (*discovery*) and fixed by :meth:`adopt_function_layers`.
        saturation_grad: local-gradient magnitude under which an element counts as saturated.
    """

    def __init__(
        self,
        root: nn.Module,
        *,
        layers: str | None,
        preactivations: Mapping[str, str] | None,
        functional: bool,
        saturation_grad: float,
    ) -> None:
        self.root = root
        self.saturation_grad = saturation_grad
        layer_rx = re.compile(layers) if layers else None
        pre = [(re.compile(p), k) for p, k in (preactivations or {}).items()]
        self.layers: list[HookedLayer] = []  # the module layers, then (after discovery) the function-call layers
        self._modules: list[nn.Module] = []  # the hooked module of each module layer
        for raw, module in root.named_modules():
            name = clean_param_name(raw)
            kind = next((k for rx, k in pre if rx.search(name)), None)
            from_preactivation = kind is not None
            if kind is None and (layer_rx is None or layer_rx.search(name)):
                kind = kind_of_module(module)
            if name and kind is not None:
                self.layers.append(HookedLayer(name, kind, from_preactivation=from_preactivation))
                self._modules.append(module)
        for kind in {layer.kind for layer in self.layers} | set(FUNCTION_KINDS.values()):
            if kind in TAIL_SATURATING:
                tail_cutoff(kind, saturation_grad)  # cached; computed here, not inside a measured forward
        self.calls: FunctionCalls | None = None
        self._call_layers: dict[str, HookedLayer] = {}  # function-call layers, by name
        self._callers: set[int] = set()  # ids of the modules whose forward calls a measured activation function
        self.discovering = functional  # the first measured forward: new function-call layers may appear
        if functional:  # `layers` narrows function-call layers by their module's name too
            self.calls = FunctionCalls(
                root,
                FUNCTION_KINDS,
                self._record_call,
                include=layer_rx.search if layer_rx else None,
                skip=lambda module: kind_of_module(module) is not None,  # an activation module counts its own calls
            )

    def attach(self) -> None:
        """Hook every layer for the next forward (and the function mode, while it may find or count a layer)."""
        for layer, module in zip(self.layers, self._modules):
            layer.reset()
            layer.handles.append(module.register_forward_hook(self._make_hook(layer)))
        if self.calls is not None and (self.discovering or self._call_layers):
            for layer in self._call_layers.values():
                layer.reset()
            # Only for this forward; stopped by remove(). Discovery watches the whole forward; later forwards only the
            # modules found calling activation functions, and a model with none never starts the mode again.
            self.calls.start(None if self.discovering else self._callers)

    def remove(self) -> None:
        """Remove every hook (and leave the function mode): the forward is over."""
        for layer in self.layers:
            for handle in layer.handles:
                handle.remove()
            layer.handles.clear()
        if self.calls is not None and self.calls.active:
            self.calls.stop()

    def reset(self) -> None:
        for layer in self.layers:
            layer.reset()

    def _make_hook(self, layer: HookedLayer) -> Callable[[nn.Module, tuple[Any, ...], Any], None]:
        def hook(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
            if not isinstance(output, Tensor) or not output.is_floating_point() or output.ndim == 0:
                return
            if not in_training_step(self.root):
                return  # another callback's probe forward, not the training batch
            calls = self.calls
            if calls is not None:
                calls.paused = True  # our own F.gelu (preactivations) is not an activation the model called
            try:
                with torch.no_grad():
                    if layer.from_preactivation:
                        # memory: the activation recomputed in fp32 from its input (the size of the layer's output),
                        # on a measuring step, freed after `layer.add`
                        pre, out = output, apply_activation(layer.kind, output.float())
                    else:
                        first = args[0] if args else None
                        pre, out = (first if isinstance(first, Tensor) else None), output
                    layer.add(pre, out, self.saturation_grad)  # device tensors: no host sync
            finally:
                if calls is not None:
                    calls.paused = False

        return hook

    def _record_call(self, name: str, kind: str, pre: Tensor, out: Any) -> None:
        """An activation function called by a submodule during the measured forward (from :class:`FunctionCalls`)."""
        if not isinstance(out, Tensor) or not out.is_floating_point() or out.ndim == 0:
            return
        if not in_training_step(self.root):
            return
        layer = self._call_layers.get(name)
        if layer is None:
            if not self.discovering:
                return  # the set was fixed at the first measurement (every rank measures the same layers)
            layer = self._call_layers[name] = HookedLayer(name, kind)
        with torch.no_grad():
            layer.add(pre, out, self.saturation_grad)

    def adopt_function_layers(self) -> None:
        """End of the first measurement: the function-call layers seen on any rank (a rank may not have called every
        function) become fixed layers, the same on every rank, in the model's module order."""
        self.discovering = False
        if self.calls is None:
            return
        kinds = {n: layer.kind for n, layer in self._call_layers.items()}
        if world_size() > 1:
            everyone: list[Any] = [None] * world_size()
            dist.all_gather_object(everyone, kinds)  # collective: once per fit
            for other in everyone:
                for n, k in (other or {}).items():
                    kinds.setdefault(n, k)
        for n in self.calls.in_module_order(kinds):
            self.layers.append(self._call_layers.setdefault(n, HookedLayer(n, kinds[n])))
            caller = self.calls.caller_of(n)
            if caller is not None:
                self._callers.add(caller)


Record = Callable[[str, str, Tensor, Any], None]
"""``record(layer, kind, input, output)``: one watched call, its layer named ``<module>.<function>()``."""


class FunctionCalls(TorchFunctionMode):
    """Sees the watched ``functions`` that ``forward`` calls, and which module called them, during one forward.

    The caller is the innermost module whose forward is running (a stack kept by forward hooks that exist only while
    the mode does). Calls by a ``skip`` module or while :attr:`paused` are not counted. *Discovery* watches the whole
    forward; afterwards the mode is entered only while a known caller runs (:meth:`start`).

    Args:
        root: the model.
        functions: the watched functions and their kinds (``{F.relu: "relu", ...}``).
        record: receives each counted call.
        include: which modules' calls count, by qualified name; None: every module's.
        skip: modules whose calls never count (besides ``root``'s own).
    """

    def __init__(
        self,
        root: nn.Module,
        functions: Mapping[object, str],
        record: Record,
        *,
        include: Callable[[str], Any] | None = None,
        skip: Callable[[nn.Module], bool] = lambda module: False,
    ) -> None:
        super().__init__()
        named = ((m, clean_param_name(n)) for n, m in root.named_modules())
        self.names = {id(m): n for m, n in named if n and (include is None or include(n))}  # id(module) -> name
        self.modules = {id(m): m for m in root.modules() if id(m) in self.names}
        self.skip = {id(m) for m in root.modules() if skip(m)} | {id(root)}
        self.functions = functions
        self.record = record
        self.stack: list[int] = []
        self.paused = False  # True while the measuring callback's own hooks compute (their F.gelu is not the model's)
        self._depth = 0  # callers running (the mode is entered while > 0), after discovery
        self._entered = False
        self._handles: list[RemovableHandle] = []

    def in_module_order(self, layers: Iterable[str]) -> list[str]:
        """Layer names (``<module>.<function>()``) sorted by their module's place in the model, then by name."""
        order = {n: i for i, n in enumerate(self.names.values())}
        return sorted(layers, key=lambda n: (order.get(n.rsplit(".", 1)[0], len(order)), n))

    def caller_of(self, layer: str) -> int | None:
        """The id of the module whose forward calls ``layer`` (``<module>.<function>()``), if it is in the model."""
        return {n: i for i, n in self.names.items()}.get(layer.rsplit(".", 1)[0])

    def start(self, callers: set[int] | None = None) -> None:
        """Observe the next forward. ``callers=None``: discovery, everywhere; else only inside these modules."""
        self.stack.clear()
        self.paused, self._depth = False, 0
        if callers is None:
            self._handles = [
                register_module_forward_pre_hook(lambda m, args: self.stack.append(id(m))),
                register_module_forward_hook(lambda m, args, out: self._pop(m), always_call=True),
            ]
            self._enter()
            return
        for caller in callers:
            module = self.modules[caller]
            self._handles.append(module.register_forward_pre_hook(self._caller_in))
            self._handles.append(module.register_forward_hook(self._caller_out, always_call=True))
            for child in module.children():  # a call inside a child is the child's (or its children's), not ours
                if id(child) not in callers:
                    self._handles.append(child.register_forward_pre_hook(lambda m, args: self.stack.append(id(m))))
                    self._handles.append(child.register_forward_hook(lambda m, a, o: self._pop(m), always_call=True))

    def stop(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self.stack.clear()
        self._depth = 0
        self._exit()

    @property
    def active(self) -> bool:
        return bool(self._handles)

    def _enter(self) -> None:
        self.__enter__()
        self._entered = True

    def _exit(self) -> None:
        if self._entered:
            self._entered = False
            self.__exit__(None, None, None)

    def _caller_in(self, module: nn.Module, args: Any) -> None:
        self.stack.append(id(module))
        self._depth += 1
        if self._depth == 1:
            self._enter()

    def _caller_out(self, module: nn.Module, args: Any, out: Any) -> None:
        self._pop(module)
        self._depth = max(0, self._depth - 1)
        if self._depth == 0:
            self._exit()

    def _pop(self, module: nn.Module) -> None:
        if self.stack and self.stack[-1] == id(module):
            self.stack.pop()

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kind = self.functions.get(func)
        if kind is None or self.paused:  # the fast path: every other torch call of the forward
            return func(*args, **kwargs) if kwargs else func(*args)
        out = func(*args, **(kwargs or {}))
        if self.stack and args and isinstance(args[0], Tensor):
            caller = self.stack[-1]
            name = self.names.get(caller)
            if name is not None and caller not in self.skip:
                self.record(f"{name}.{getattr(func, '__name__', kind).rstrip('_')}()", kind, args[0], out)
        return out
