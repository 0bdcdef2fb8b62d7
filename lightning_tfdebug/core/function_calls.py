"""Which module called which torch *function* during one forward: a ``TorchFunctionMode`` that exists only while a
callback measures.

An activation written as a function call inside ``forward`` (``F.gelu(self.fc(x))``) has no module of its own to hook.
:class:`FunctionCalls` sees such calls and names the innermost module whose forward made each, from forward hooks
that exist just as long as the mode. Nothing here measures or decides: each call is handed to ``record``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

from torch import Tensor, nn
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook
from torch.overrides import TorchFunctionMode
from torch.utils.hooks import RemovableHandle

from lightning_tfdebug.core.distributed import clean_param_name

Record = Callable[[str, str, Tensor, Any], None]
"""``record(layer, kind, input, output)``: one watched call, its layer named ``<module>.<function>()``."""


class FunctionCalls(TorchFunctionMode):
    """Sees the watched ``functions`` that ``forward`` calls, and which module called them, during one forward.

    The calling module is the innermost module whose forward is running (a stack kept by forward hooks that exist
    only while this mode does). Calls made by a module in ``skip`` (an activation module that calls ``F.gelu``
    itself, the LightningModule's own code) are not counted, nor calls made while :attr:`paused` (the measuring
    callback's own computations).

    Two ways to run (see :meth:`start`): *discovery* keeps global module hooks and the mode over the whole forward,
    to find which modules call a watched function; afterwards the mode is entered only while one of those *callers*
    runs, with hooks on the callers and their children alone, so the rest of the forward runs at full speed.

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
