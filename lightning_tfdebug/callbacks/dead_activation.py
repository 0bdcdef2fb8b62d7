"""DeadActivation: exact-zero, dead-unit and saturation fractions per activation layer."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, ClassVar

import lightning.pytorch as pl
import torch
from torch import Tensor, nn

from lightning_tfdebug.core.activation_hooks import ActivationHooks, HookedLayer
from lightning_tfdebug.core.base import DebugCallback, check_number, model_is_compiled
from lightning_tfdebug.core.distributed import world_size
from lightning_tfdebug.core.reduction import Reduced, reduce_now
from lightning_tfdebug.findings import OnFinding
from lightning_tfdebug.functional.activation_checks import COVERAGE as COVERAGE_ROWS
from lightning_tfdebug.functional.activation_checks import (
    ActivationHistory,
    ActivationThresholds,
    compiled_reason,
    decide_activations,
    no_layer_reason,
    silent_layers_reason,
    unobservable_verdict,
)
from lightning_tfdebug.functional.activations import ACTIVATION_KINDS, layer_fractions, pack_counts
from lightning_tfdebug.primitives.keys import Key


class DeadActivation(DebugCallback):
    r"""Per activation layer: the fraction of exactly-zero outputs, of dead units, and of saturated elements.

    On a measuring step, :class:`~lightning_tfdebug.core.activation_hooks.ActivationHooks` are attached just before
    the training batch (activation modules recognised by class name, the modules named in ``preactivations``, and
    activation functions a submodule's ``forward`` calls, logged as ``<module>.<function>()``) and removed in
    ``on_before_backward``; other steps do no work. A unit (one feature of the last dimension) is *dead* when it was
    zero for every token of the measured batch on every rank. Details in ``docs/callbacks/dead_activation.md``.

    Findings: ``TFD340`` dead units above `dead_threshold`, ``TFD341`` dead fraction rising, ``TFD342`` saturation
    above `saturation_threshold`, ``TFD343`` activations cannot be observed (torch.compile, or no hooked module ran),
    ``TFD344`` saturated fraction rising; see ``docs/findings.md``.

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
        dead_rise: ``TFD341`` when a layer's dead fraction stays at least this much (absolute) above its lowest
            value for ``patience`` measurements in a row.
        saturation_grad: local-gradient magnitude under which an element counts as saturated.
        saturation_rise: ``TFD344``, the same as ``dead_rise`` for the saturated fraction.
        functional: also measure activation functions called from submodules' ``forward`` (see above).

    Raises:
        ValueError: on an argument outside its allowed range or an invalid regular expression or kind.

    Example:
        ```python
        trainer = Trainer(callbacks=[DeadActivation(every_n_steps=50)])
        ```

        With LightningCLI:

        ```yaml
        trainer:
          callbacks:
            - class_path: lightning_tfdebug.DeadActivation
              init_args:
                every_n_steps: 50
        ```
    """

    COVERAGE: ClassVar[Mapping[str, tuple[str, ...]]] = COVERAGE_ROWS  # declared beside the rules
    COVERAGE_WATCHED: ClassVar[frozenset[str]] = frozenset(COVERAGE)  # verified by watching the whole fit

    KEYS: ClassVar[tuple[Key, ...]] = (
        Key(
            "dead_activation/zero_frac/<layer>",
            "fraction of exactly-zero outputs (not for tanh/sigmoid)",
            chart="zero fraction per layer",
        ),
        Key(
            "dead_activation/dead_frac/<layer>",
            "fraction of units zero for every token of the batch on every rank (not for tanh/sigmoid)",
            chart="dead fraction per layer",
        ),
        Key(
            "dead_activation/saturated_frac/<layer>",
            "fraction of elements whose local gradient is below `saturation_grad` (tanh, sigmoid, GELU, SiLU, Mish "
            "only)",
            chart="saturated fraction per layer",
        ),
    )

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
            _check_preactivations(preactivations)
        check_number("dead_threshold", dead_threshold, low=0.0, high=1.0, low_inclusive=False)
        check_number("saturation_threshold", saturation_threshold, low=0.0, high=1.0, low_inclusive=False)
        check_number("patience", patience, low=1, integer=True)
        check_number("dead_rise", dead_rise, low=0.0, high=1.0, low_inclusive=False)
        check_number("saturation_rise", saturation_rise, low=0.0, high=1.0, low_inclusive=False)
        if not isinstance(functional, bool):
            raise TypeError(f"`functional` must be True or False; got {functional!r}.")
        check_number("saturation_grad", saturation_grad, low=0.0, high=0.25, low_inclusive=False)
        self.functional = functional
        self.layers = layers
        self.preactivations = dict(preactivations) if preactivations else None
        self.dead_threshold = float(dead_threshold)
        self.saturation_threshold = float(saturation_threshold)
        self.patience = patience
        self.dead_rise = float(dead_rise)
        self.saturation_rise = float(saturation_rise)
        self.saturation_grad = float(saturation_grad)
        self._limits = ActivationThresholds(
            self.dead_threshold,
            self.saturation_threshold,
            patience,
            self.dead_rise,
            self.saturation_rise,
            self.saturation_grad,
        )
        self._history = ActivationHistory()
        self._hooks: ActivationHooks | None = None  # built at the start of training
        self._units: list[int] | None = None  # global unit count per layer, learned at the first measurement
        self._armed_step: int | None = None  # the step whose forward the hooks are measuring
        self._measured_step: int | None = None

    @property
    def state_key(self) -> str:
        return self._generate_state_key(every_n_steps=self.every_n_steps, layers=self.layers)

    # ------------------------------------------------------------------ set-up
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        self._hooks, self._units = None, None

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self.active:
            return
        # Same model on every rank, so every rank stands aside together and no collective is left waiting.
        if self._unobservable(trainer, compiled_reason(model_is_compiled(trainer, pl_module)), compiled=True):
            return
        hooks = ActivationHooks(
            pl_module,
            layers=self.layers,
            preactivations=self.preactivations,
            functional=self.functional,
            saturation_grad=self.saturation_grad,
        )
        if hooks.layers or self.functional:  # function-call layers are found at the first measurement
            self._hooks = hooks
            return
        self.stand_aside(
            "no activation module (ReLU, GELU, SiLU, Tanh, Sigmoid, ...) "
            + (f"matching `layers={self.layers!r}` " if self.layers else "")
            + "was found in the model. If forward applies activations as functions, name the modules whose "
            "outputs feed them with `preactivations={regex: kind}`.",
            setting="`preactivations`" if not self.layers else "`layers` matching an activation module",
        )

    def busy_at(self, step: int) -> bool:
        """Hooks go on the layers on measuring steps only (and come off within the same batch)."""
        return step % self._interval == 0 or self._armed_step is not None

    # ------------------------------------------------------------------ hooks on / off
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int):
        if self._hooks is None or not self.should_measure(trainer) or self._measured_step == trainer.global_step:
            return
        self._measured_step = trainer.global_step  # only the first micro-batch of a measuring step
        self._armed_step = trainer.global_step
        self._hooks.attach()  # removed in on_before_backward at the latest

    def _remove_hooks(self) -> None:
        if self._hooks is not None:
            self._hooks.remove()

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
            if self._hooks is not None:
                self._hooks.reset()

    def _measure(self, trainer: pl.Trainer, pl_module: pl.LightningModule, step: int) -> None:
        """Reduce, log and diagnose what the hooks collected. ``step``: the optimizer step the batch belongs to
        (``global_step`` has already moved on when ``on_train_batch_end`` runs)."""
        assert self._hooks is not None
        if self._hooks.discovering:
            self._hooks.adopt_function_layers()
        layers = self._hooks.layers
        if self._unobservable(trainer, no_layer_reason(len(layers), self.layers), step=step):
            return
        device = _device_of(pl_module)
        units = self._agree_units(layers, device)
        sums, alive = pack_counts(layers, units, device)
        # Declared into the step's one reduction over ranks (collective): counts add up, and a unit is dead only if it
        # was dead on every rank's batch.
        self.reduce_then(
            trainer,
            lambda reduced: self._conclude(trainer, pl_module, layers, reduced, step),
            device,
            sums=sums,
            anys=alive,
        )

    def _agree_units(self, layers: list[HookedLayer], device: torch.device) -> list[int]:
        """Each layer's unit count, the same on every rank (a layer that did not run on this rank has none here)."""
        if self._units is not None and all(n for n, layer in zip(self._units, layers) if layer.counts_zeros):
            return self._units
        local = [int(layer.alive.numel()) if layer.alive is not None else 0 for layer in layers]
        if world_size() > 1:
            # First measurement (or while some layer never ran anywhere): one small collective. The condition depends
            # only on values every rank shares, so every rank reaches it on the same step.
            units = reduce_now(device, maxes={"units": torch.tensor(local, device=device, dtype=torch.float)})
            local = [int(u) for u in units.maxes["units"].tolist()]  # host sync: first measurement only
        self._units = local
        return local

    def _conclude(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        layers: list[HookedLayer],
        reduced: Reduced,
        step: int,
    ) -> None:
        host = self.to_host(layer_fractions(layers, reduced.sums, reduced.anys))  # the one host transfer of the step
        ran = [layer.name for layer in layers if host[f"calls/{layer.name}"] > 0]
        compiled = not ran and model_is_compiled(trainer, pl_module)
        if self._unobservable(trainer, silent_layers_reason(len(ran), compiled), step=step):
            return
        names = set(ran)
        logged = {
            f"dead_activation/{k}": v
            for k, v in host.items()
            if not k.startswith("calls/") and k.split("/", 1)[1] in names
        }
        self.log_scalars(trainer, logged, step=step)
        fractions = [(name, host.get(f"dead_frac/{name}"), host.get(f"saturated_frac/{name}")) for name in ran]
        self.emit(trainer, decide_activations(fractions, self._history, self._limits, step))

    # ------------------------------------------------------------------ findings
    def _unobservable(
        self, trainer: pl.Trainer, reason: str | None, *, compiled: bool = False, step: int | None = None
    ) -> bool:
        """Say ``TFD343`` and stand aside when there is a ``reason`` activations cannot be observed."""
        if reason is None:
            return False
        self.emit(trainer, unobservable_verdict(reason, compiled=compiled, step=step))
        self._remove_hooks()
        self.stand_aside(reason, setting="an uncompiled model (no torch.compile)" if compiled else "`preactivations`")
        return True

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


def _check_preactivations(preactivations: Any) -> None:
    if not isinstance(preactivations, dict) or not preactivations:
        raise ValueError(f"`preactivations` must be a non-empty mapping {{regex: kind}}; got {preactivations!r}.")
    for pattern, kind in preactivations.items():
        _check_regex(f"preactivations[{pattern!r}]", pattern)
        if kind not in ACTIVATION_KINDS:
            raise ValueError(
                f"`preactivations[{pattern!r}]` must be one of {', '.join(ACTIVATION_KINDS)}; got {kind!r}."
            )


def _device_of(module: nn.Module) -> torch.device:
    for p in module.parameters():
        return p.device
    return torch.device("cpu")
