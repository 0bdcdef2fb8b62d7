"""DeadActivation: exact-zero, dead-unit and saturation fractions per activation layer."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode
from torch.utils.hooks import RemovableHandle

from lightning_tfdebug.core.base import DebugCallback, check_number, model_is_compiled
from lightning_tfdebug.core.distributed import clean_param_name, packed_reduce, world_size
from lightning_tfdebug.core.model import in_training_step
from lightning_tfdebug.findings import OnFinding
from lightning_tfdebug.functional.activation_checks import ActivationHistory, ActivationThresholds, decide_activations
from lightning_tfdebug.functional.activations import (
    ACTIVATION_KINDS,
    FUNCTION_KINDS,
    OUTPUT_SATURATING,
    TAIL_SATURATING,
    apply_activation,
    dead_fraction,
    kind_of_module,
    saturated_count,
    tail_cutoff,
    zeros_and_alive,
)


@dataclass
class _Layer:
    """One hooked layer and what its hook collected on the current measuring step (device tensors)."""

    name: str
    kind: str
    from_preactivation: bool  # the hooked module's output is the pre-activation; the activation is applied here
    calls: int = 0
    numel: int = 0
    zeros: Tensor | None = None
    saturated: Tensor | None = None
    alive: Tensor | None = None
    handles: list[RemovableHandle] = field(default_factory=list)

    @property
    def counts_zeros(self) -> bool:
        return self.kind not in OUTPUT_SATURATING

    @property
    def saturates(self) -> bool:
        return self.kind in OUTPUT_SATURATING or self.kind in TAIL_SATURATING

    def reset(self) -> None:
        self.calls, self.numel, self.zeros, self.saturated, self.alive = 0, 0, None, None, None


class _FunctionCalls(TorchFunctionMode):
    """Sees the activation *functions* (``F.gelu``, ``torch.relu`` ...) that ``forward`` calls, and which module called
    them, during one measured forward. Never active on other steps.

    The calling module is the innermost module whose forward is running (a stack kept by forward hooks that exist
    only while this mode does). Calls made inside an activation *module* (``nn.GELU`` calls ``F.gelu``) are left to
    that module's hook, calls from the LightningModule's own code (a hinge loss in ``training_step``) are not
    activations of a layer, and calls made by DeadActivation's own hooks (``paused``) are not the model's, so none of
    them is counted.

    Two ways to run (see :meth:`start`): *discovery* (the first measuring step) keeps global module hooks and the mode
    over the whole forward, to find which modules call activation functions; afterwards the mode is entered only
    while one of those *callers* runs, with hooks on the callers and their children alone, so the rest of the
    forward runs at full speed.
    """

    def __init__(self, owner: DeadActivation, names: dict[int, str], skip: set[int], modules: dict[int, nn.Module]):
        super().__init__()
        self.owner = owner
        self.names = names  # id(module) -> qualified name, for the modules of the LightningModule
        self.skip = skip  # ids of activation modules and of the LightningModule itself
        self.modules = modules  # id(module) -> module, for the modules named in `names`
        self.stack: list[int] = []
        self.paused = False  # True while DeadActivation's own hooks compute (their F.gelu is not the model's)
        self._depth = 0  # callers running (the mode is entered while > 0), after discovery
        self._entered = False
        self._handles: list[RemovableHandle] = []

    def start(self, callers: set[int] | None = None) -> None:
        """Observe the next forward. ``callers=None``: discovery, everywhere; else only inside these modules."""
        from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

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

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kind = FUNCTION_KINDS.get(func)
        if kind is None or self.paused:  # the fast path: every other torch call of the forward
            return func(*args, **kwargs) if kwargs else func(*args)
        out = func(*args, **(kwargs or {}))
        if self.stack and args and isinstance(args[0], Tensor):
            caller = self.stack[-1]
            name = self.names.get(caller)
            if name is not None and caller not in self.skip:
                self.owner._record_call(f"{name}.{getattr(func, '__name__', kind).rstrip('_')}()", kind, args[0], out)
        return out


class DeadActivation(DebugCallback):
    r"""Per activation layer: the fraction of exactly-zero outputs, of dead units, and of saturated elements.

    On a measuring step, forward hooks are attached to every activation module (``nn.ReLU``, ``nn.GELU``,
    ``nn.SiLU``, ``nn.Tanh``, ``nn.Sigmoid``, ``nn.LeakyReLU``, ``nn.ELU``, Hugging Face's ``GELUActivation`` ...,
    recognised by class name) just before the training batch, and removed in ``on_before_backward``, before any
    backward runs, so activation checkpointing's re-run of the forward is never counted. Activations called as
    functions inside ``forward`` (``F.gelu(self.fc(x))``) are measured by naming the modules whose outputs are
    the pre-activations in ``preactivations``, and found on their own: on a measuring step a
    ``TorchFunctionMode`` sees the calls of ``F.relu``/``F.gelu``/``F.silu``/``F.leaky_relu``/``F.elu``/``F.mish``
    (and ``torch.relu``, ``Tensor.relu``) made by a submodule's ``forward`` (``nn.TransformerEncoderLayer``, a
    nanoGPT or Llama MLP), and logs them as ``<module>.<function>()``, e.g. ``encoder.layers.0.relu()``. The set of
    such layers is fixed at the first measurement (agreed by every rank). ``functional=False`` turns that off. On
    other steps there are no hooks, no mode and no work. Under gradient
    accumulation, the first micro-batch of a measuring step is measured. Forwards that other callbacks run from
    their own hooks are not counted.

    A unit (one feature of the last dimension) is *dead* when it was zero for every token of the measured batch
    (on every rank); ReLU units in that state receive no gradient and never recover.

    Logged keys (on measuring steps; `<layer>` is the module's qualified name):

    | key | meaning |
    | --- | --- |
    | `dead_activation/zero_frac/<layer>` | fraction of exactly-zero outputs (not for tanh/sigmoid) |
    | `dead_activation/dead_frac/<layer>` | fraction of units zero for every token of the batch (not for tanh/sigmoid) |
    | `dead_activation/saturated_frac/<layer>` | fraction of elements whose local gradient is below `saturation_grad` |

    Saturation: tanh/sigmoid, read from the output (near its bound); GELU/SiLU/Mish, read from the
    pre-activation (deep enough in the negative tail that the gradient is below `saturation_grad`).

    Findings: ``TFD340`` dead units above `dead_threshold`, ``TFD341`` dead fraction rising over training,
    ``TFD342`` saturation above `saturation_threshold`, ``TFD343`` activations cannot be observed (torch.compile,
    or no hooked module ran), ``TFD344`` saturated fraction rising over training; see ``docs/findings.md``.

    Args:
        every_n_steps: measure when ``global_step % every_n_steps == 0``; default: the Trainer's
            ``log_every_n_steps``.
        on_finding: ``"warn"``, ``"stop"`` or ``"raise"`` (see :class:`~lightning_tfdebug.DebugCallback`).
        layers: regular expression; only activation modules whose qualified name matches (``re.search``) are
            measured. ``None`` measures all of them.
        preactivations: ``{regex: kind}``: modules whose *output* is the input of an activation that ``forward``
            applies as a function; ``kind`` is one of ``relu``, ``relu6``, ``leaky_relu``, ``elu``, ``gelu``,
            ``silu``, ``mish``, ``tanh``, ``sigmoid``. E.g. ``{"mlp\\.fc$": "gelu"}``.
        dead_threshold: ``TFD340`` when a layer's dead fraction exceeds this ...
        saturation_threshold: ``TFD342`` when a layer's saturated fraction exceeds this ...
        patience: ... for this many measurements in a row.
        dead_rise: ``TFD341`` when a layer's dead fraction has risen by at least this much (absolute) above the
            lowest value it had, for ``patience`` measurements in a row without falling back.
        saturation_grad: local-gradient magnitude under which an element counts as saturated.
        saturation_rise: ``TFD344`` when a layer's saturated fraction has risen by at least this much (absolute)
            above the lowest value it had, for ``patience`` measurements in a row without falling back.
        functional: also measure activation functions called from submodules' ``forward`` (see above).

    Raises:
        ValueError: on an argument outside its allowed range or an invalid regular expression or kind.

    Example:
        ```python
        trainer = Trainer(callbacks=[DeadActivation(every_n_steps=50)])
        ```

        LightningCLI:

        ```yaml
        trainer:
          callbacks:
            - class_path: lightning_tfdebug.DeadActivation
              init_args:
                every_n_steps: 50
                dead_threshold: 0.5
                preactivations: {"mlp\\.c_fc$": gelu}
        ```
    """

    def __init__(
        self,
        every_n_steps: int | None = None,
        on_finding: OnFinding = "warn",
        layers: str | None = None,
        preactivations: dict[str, str] | None = None,
        dead_threshold: float = 0.5,
        saturation_threshold: float = 0.5,
        patience: int = 2,
        dead_rise: float = 0.35,
        saturation_grad: float = 0.01,
        saturation_rise: float = 0.35,
        functional: bool = True,
    ) -> None:
        super().__init__(every_n_steps=every_n_steps, on_finding=on_finding)
        if layers is not None:
            _check_regex("layers", layers)
        if preactivations is not None:
            if not isinstance(preactivations, dict) or not preactivations:
                raise ValueError(
                    f"`preactivations` must be a non-empty mapping {{regex: kind}}; got {preactivations!r}."
                )
            for pattern, kind in preactivations.items():
                _check_regex(f"preactivations[{pattern!r}]", pattern)
                if kind not in ACTIVATION_KINDS:
                    raise ValueError(
                        f"`preactivations[{pattern!r}]` must be one of {', '.join(ACTIVATION_KINDS)}; got {kind!r}."
                    )
        check_number("dead_threshold", dead_threshold, low=0.0, high=1.0, low_inclusive=False)
        check_number("saturation_threshold", saturation_threshold, low=0.0, high=1.0, low_inclusive=False)
        check_number("patience", patience, low=1, integer=True)
        check_number("dead_rise", dead_rise, low=0.0, high=1.0, low_inclusive=False)
        check_number("saturation_rise", saturation_rise, low=0.0, high=1.0, low_inclusive=False)
        if not isinstance(functional, bool):
            raise TypeError(f"`functional` must be True or False; got {functional!r}.")
        self.functional = functional
        check_number("saturation_grad", saturation_grad, low=0.0, high=0.25, low_inclusive=False)
        self.layers = layers
        self.preactivations = dict(preactivations) if preactivations else None
        self.dead_threshold = float(dead_threshold)
        self.saturation_threshold = float(saturation_threshold)
        self.patience = patience
        self.dead_rise = float(dead_rise)
        self.saturation_rise = float(saturation_rise)
        self.saturation_grad = float(saturation_grad)
        self._layers: list[_Layer] | None = None
        self._modules: list[nn.Module] = []
        self._armed_step: int | None = None
        self._pl_module: pl.LightningModule | None = None
        self._measured_step: int | None = None
        self._units: list[int] | None = None  # global unit count per layer, learned at the first measurement
        self._history = ActivationHistory()
        self._limits = ActivationThresholds(
            self.dead_threshold,
            self.saturation_threshold,
            patience,
            self.dead_rise,
            self.saturation_rise,
            self.saturation_grad,
        )
        self._calls: _FunctionCalls | None = None
        self._call_layers: dict[str, _Layer] = {}  # function-call layers, by name
        self._discovering = False  # the first measuring step: new function-call layers may appear
        self._callers: set[int] = set()  # ids of the modules whose forward calls a measured activation function

    @property
    def state_key(self) -> str:
        return self._generate_state_key(every_n_steps=self.every_n_steps, layers=self.layers)

    # ------------------------------------------------------------------ set-up
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        self._layers, self._modules, self._units = None, [], None
        self._calls, self._call_layers, self._discovering, self._callers = None, {}, False, set()

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self.active:
            return
        if model_is_compiled(trainer, pl_module):
            # Same model on every rank, so every rank stands aside together and no collective is left waiting.
            self._report_unobservable(
                trainer,
                "the model (or a submodule) is compiled with torch.compile, and compiled code ignores forward hooks "
                "added after compilation (or bakes in hooks present when it was traced), so activations cannot be "
                "observed.",
                compiled=True,
            )
            return
        self._build(pl_module)

    def _build(self, pl_module: pl.LightningModule) -> None:
        layer_rx = re.compile(self.layers) if self.layers else None
        pre = [(re.compile(p), k) for p, k in (self.preactivations or {}).items()]
        layers: list[_Layer] = []
        modules: list[nn.Module] = []
        for raw, module in pl_module.named_modules():
            name = clean_param_name(raw)
            if not name:
                continue
            kind = next((k for rx, k in pre if rx.search(name)), None)
            if kind is not None:
                layers.append(_Layer(name, kind, from_preactivation=True))
                modules.append(module)
                continue
            kind = kind_of_module(module)
            if kind is not None and (layer_rx is None or layer_rx.search(name)):
                layers.append(_Layer(name, kind, from_preactivation=False))
                modules.append(module)
        for kind in {layer.kind for layer in layers} | set(FUNCTION_KINDS.values()):
            if kind in TAIL_SATURATING:
                tail_cutoff(kind, self.saturation_grad)  # cached; computed here, not inside a measured forward
        if self.functional:
            names = {id(m): clean_param_name(n) for n, m in pl_module.named_modules() if clean_param_name(n)}
            skip = {id(m) for m in pl_module.modules() if kind_of_module(m) is not None} | {id(pl_module)}
            if layer_rx is not None:  # `layers` narrows function-call layers by their module's name too
                names = {i: n for i, n in names.items() if layer_rx.search(n)}
            modules_by_id = {id(m): m for m in pl_module.modules() if id(m) in names}
            self._calls = _FunctionCalls(self, names, skip, modules_by_id)
            self._discovering = True
            self._layers, self._modules = layers, modules
            return
        if not layers:
            self.stand_aside(
                "no activation module (ReLU, GELU, SiLU, Tanh, Sigmoid, ...) "
                + (f"matching `layers={self.layers!r}` " if self.layers else "")
                + "was found in the model. If forward applies activations as functions, name the modules whose "
                "outputs feed them with `preactivations={regex: kind}`.",
                setting="`preactivations`" if not self.layers else "`layers` matching an activation module",
            )
            return
        self._layers, self._modules = layers, modules

    def busy_at(self, step: int) -> bool:
        """Hooks go on the layers on measuring steps only (and come off within the same batch)."""
        return step % self._interval == 0 or self._armed_step is not None

    # ------------------------------------------------------------------ hooks on / off
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int):
        if self._layers is None or not self.should_measure(trainer) or self._measured_step == trainer.global_step:
            return
        self._measured_step = trainer.global_step  # only the first micro-batch of a measuring step
        self._armed_step = trainer.global_step
        self._pl_module = pl_module
        for layer, module in zip(self._layers, self._modules):
            layer.reset()
            layer.handles.append(module.register_forward_hook(self._make_hook(layer)))
        if self._calls is not None and (self._discovering or self._call_layers):
            for layer in self._call_layers.values():
                layer.reset()
            # Only for this forward; stopped in on_before_backward at the latest. Discovery (first measuring step)
            # watches the whole forward; later steps only the modules found calling activation functions, and a
            # model with none (activations are modules) never starts the mode again.
            self._calls.start(None if self._discovering else self._callers)

    def _make_hook(self, layer: _Layer):
        grad_threshold = self.saturation_grad

        def hook(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
            if not isinstance(output, Tensor) or not output.is_floating_point() or output.ndim == 0:
                return
            if not in_training_step(self._pl_module):
                return  # another callback's probe forward, not the training batch
            calls = self._calls
            if calls is not None:
                calls.paused = True  # our own F.gelu (preactivations) is not an activation the model called
            try:
                with torch.no_grad():
                    if layer.from_preactivation:
                        pre, out = output, apply_activation(layer.kind, output.float())
                    else:
                        first = args[0] if args else None
                        pre, out = (first if isinstance(first, Tensor) else None), output
                    self._accumulate(layer, pre, out, grad_threshold)
            finally:
                if calls is not None:
                    calls.paused = False

        return hook

    def _accumulate(self, layer: _Layer, pre: Tensor | None, out: Tensor, grad_threshold: float) -> None:
        """Add one call's counts to ``layer`` (device tensors; no host sync)."""
        if layer.counts_zeros:
            zeros, alive = zeros_and_alive(out)  # one boolean view: branch-free whatever the activation
            layer.zeros = zeros if layer.zeros is None else layer.zeros + zeros
            if layer.alive is None:
                layer.alive = alive
            elif layer.alive.shape == alive.shape:  # a module called again in the same forward
                layer.alive = layer.alive | alive
        if layer.saturates:
            sat = saturated_count(layer.kind, pre, out, grad_threshold)
            if sat is not None:
                layer.saturated = sat if layer.saturated is None else layer.saturated + sat
        layer.numel += out.numel()  # shape arithmetic on the host: no sync
        layer.calls += 1

    def _record_call(self, name: str, kind: str, pre: Tensor, out: Any) -> None:
        """An activation function called by a submodule during the measured forward (from :class:`_FunctionCalls`)."""
        if not isinstance(out, Tensor) or not out.is_floating_point() or out.ndim == 0:
            return
        if not in_training_step(self._pl_module):
            return
        layer = self._call_layers.get(name)
        if layer is None:
            if not self._discovering:
                return  # the set was fixed at the first measurement (every rank measures the same layers)
            layer = self._call_layers[name] = _Layer(name, kind, from_preactivation=False)
        with torch.no_grad():
            self._accumulate(layer, pre, out, self.saturation_grad)

    def _remove_hooks(self) -> None:
        for layer in self._layers or []:
            for handle in layer.handles:
                handle.remove()
            layer.handles.clear()
        if self._calls is not None and self._calls.active:
            self._calls.stop()

    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: Tensor) -> None:
        # The forward is over: remove the hooks before backward, where activation checkpointing re-runs forwards.
        if self._armed_step is not None:  # other steps: nothing to do, not even a loop over the layers
            self._remove_hooks()

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._remove_hooks()
        self._armed_step = None

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._remove_hooks()

    # ------------------------------------------------------------------ measuring
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._armed_step is None:
            return
        try:
            self._remove_hooks()  # manual optimization without backward: make sure nothing outlives the step
            with torch.no_grad():
                self._measure(trainer, pl_module, self._armed_step)
        finally:
            self._armed_step = None
            for layer in self._layers or []:
                layer.reset()

    def _measure(self, trainer: pl.Trainer, pl_module: pl.LightningModule, step: int) -> None:
        """Reduce, log and diagnose what the hooks collected. ``step``: the optimizer step the batch belongs to
        (``global_step`` has already moved on when ``on_train_batch_end`` runs)."""
        if self._discovering:
            self._adopt_function_layers()
        layers = self._layers
        assert layers is not None
        if not layers:
            self._report_unobservable(
                trainer,
                "no activation module (ReLU, GELU, SiLU, Tanh, Sigmoid, ...) "
                + (f"matching `layers={self.layers!r}` " if self.layers else "")
                + "is in the model and its submodules called no activation function (F.relu, F.gelu, F.silu, ...) "
                "during the training forward.",
                compiled=False,
                step=step,
            )
            return
        device = _device_of(pl_module)
        zero = torch.zeros((), device=device)
        sums = torch.stack(
            [
                v
                for layer in layers
                for v in (
                    (layer.zeros if layer.zeros is not None else zero).float().to(device),
                    (layer.saturated if layer.saturated is not None else zero).float().to(device),
                    torch.tensor(float(layer.numel), device=device),
                    torch.tensor(float(layer.calls), device=device),
                )
            ]
        )
        local_units = [int(layer.alive.numel()) if layer.alive is not None else 0 for layer in layers]
        distributed = world_size() > 1
        if self._units is None or any(n == 0 for n, layer in zip(self._units, layers) if layer.counts_zeros):
            if distributed:
                # First measurement (or while some layer never ran anywhere): one small collective agrees on each
                # layer's unit count, since a layer that did not run on this rank has none locally. The condition
                # depends only on values every rank shares, so every rank reaches it on the same step.
                _, units = packed_reduce(sums.new_zeros(0), torch.tensor(local_units, device=device, dtype=torch.float))
                self._units = [int(u) for u in units.tolist()]  # host sync: first measurement only
            else:
                self._units = local_units
        alive = torch.cat(
            [_fit_length(layer.alive, n, device) for layer, n in zip(layers, self._units)]
            or [torch.zeros(0, device=device)]
        )
        # Declared into the step's one reduction over ranks (the pack's shared collective; on its own, one of its
        # own): counts add up over ranks, and a unit is alive if it was alive on any rank's batch, i.e. dead only if
        # dead everywhere.
        self.reduce_then(
            trainer,
            lambda reduced: self._conclude(trainer, pl_module, layers, reduced.sums, reduced.anys, step),
            device,
            sums=sums,
            anys=alive,
        )

    def _conclude(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        layers: list[_Layer],
        sums: Tensor,
        alive: Tensor,
        step: int,
    ) -> None:
        sums = sums.float().view(len(layers), 4)
        values: dict[str, Tensor | float] = {}
        offset = 0
        for i, (layer, n) in enumerate(zip(layers, self._units)):
            numel = sums[i, 2].clamp(min=1.0)
            if layer.counts_zeros:
                values[f"dead_activation/zero_frac/{layer.name}"] = sums[i, 0] / numel
                values[f"dead_activation/dead_frac/{layer.name}"] = dead_fraction(alive[offset : offset + n])
            if layer.saturates:
                values[f"dead_activation/saturated_frac/{layer.name}"] = sums[i, 1] / numel
            values[f"_calls/{layer.name}"] = sums[i, 3]
            offset += n
        host = self.to_host(values)  # the one host transfer of this measuring step
        ran = {layer.name for layer in layers if host[f"_calls/{layer.name}"] > 0}
        if not ran:
            self._report_unobservable(
                trainer,
                "none of the hooked activation modules ran during the training forward"
                + (" (the model is compiled)" if model_is_compiled(trainer, pl_module) else "")
                + ", so activations cannot be observed.",
                compiled=False,
                step=step,
            )
            return
        logged = {k: v for k, v in host.items() if not k.startswith("_") and k.split("/", 2)[2] in ran}
        self.log_scalars(trainer, logged, step=step)
        self._diagnose(trainer, host, [layer for layer in layers if layer.name in ran], step)

    def _adopt_function_layers(self) -> None:
        """End of the first measurement: the function-call layers seen become fixed layers, the same on every rank.

        A rank may not have called every function (a mixture-of-experts expert that got no token), so the names are
        gathered once (a one-off collective on the first measuring step, which every rank reaches) and every rank
        adopts the union, in the model's module order; a layer a rank did not see contributes zero counts.
        """
        self._discovering = False
        assert self._layers is not None and self._calls is not None
        names = sorted(self._call_layers)
        kinds = {n: layer.kind for n, layer in self._call_layers.items()}
        if world_size() > 1:
            everyone: list[Any] = [None] * world_size()
            dist.all_gather_object(everyone, kinds)  # collective: once per fit
            for other in everyone:
                for n, k in (other or {}).items():
                    kinds.setdefault(n, k)
            names = sorted(kinds)
        order = {n: i for i, n in enumerate(self._calls.names.values())}
        names.sort(key=lambda n: (order.get(n.rsplit(".", 1)[0], len(order)), n))
        ids = {name: i for i, name in self._calls.names.items()}
        for n in names:
            layer = self._call_layers.get(n) or _Layer(n, kinds[n], from_preactivation=False)
            self._call_layers[n] = layer
            self._layers.append(layer)
            caller = ids.get(n.rsplit(".", 1)[0])
            if caller is not None:
                self._callers.add(caller)

    # ------------------------------------------------------------------ findings
    def _diagnose(self, trainer: pl.Trainer, host: dict[str, float], layers: list[_Layer], step: int) -> None:
        fractions = [
            (
                layer.name,
                host[f"dead_activation/dead_frac/{layer.name}"] if layer.counts_zeros else None,
                host[f"dead_activation/saturated_frac/{layer.name}"] if layer.saturates else None,
            )
            for layer in layers
        ]
        for verdict in decide_activations(fractions, self._history, self._limits):
            self.emit_code(trainer, verdict.code, verdict.message, verdict.evidence, hint=verdict.hint, step=step)

    def _report_unobservable(self, trainer: pl.Trainer, reason: str, compiled: bool, step: int | None = None) -> None:
        hint = (
            "Run DeadActivation on an uncompiled model (e.g. a short debugging run without torch.compile), or compile "
            "only parts of the model that contain no activation you want measured."
            if compiled
            else "Check that the activations are modules called in the training forward; for activations applied as "
            "functions, name the modules feeding them with `preactivations`."
        )
        self.emit_code(
            trainer,
            "TFD343",
            f"DeadActivation cannot measure: {reason}",
            {"compiled": compiled},
            hint=hint,
            step=step,
        )
        self._remove_hooks()
        self.stand_aside(reason, setting="an uncompiled model (no torch.compile)" if compiled else "`preactivations`")

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), **self._history.state_dict()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self._history.load_state_dict(state_dict)


def _check_regex(name: str, pattern: Any) -> None:
    if not isinstance(pattern, str):
        raise TypeError(f"`{name}` must be a regular expression string; got {pattern!r}.")
    try:
        re.compile(pattern)
    except re.error as err:
        raise ValueError(f"`{name}` is not a valid regular expression ({err}); got {pattern!r}.") from None


def _device_of(module: nn.Module) -> torch.device:
    for p in module.parameters():
        return p.device
    return torch.device("cpu")


def _fit_length(alive: Tensor | None, n: int, device: torch.device) -> Tensor:
    """The alive mask as 0/1 floats of length ``n`` (zeros where this rank saw nothing)."""
    out = torch.zeros(n, device=device)
    if alive is not None and n:
        m = min(n, alive.numel())
        out[:m] = alive[:m].float().to(device)
    return out
