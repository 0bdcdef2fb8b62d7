"""SpikeGuard: loss spikes detected on the step, traced to the samples behind them, kept for replay, skipped."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar, Literal

import lightning.pytorch as pl
import torch
from torch import Tensor

from lightning_tfdebug.callbacks.spike_guard.capture import (
    COMPILED,
    call_inputs,
    group_norms,
    read_recording,
    replay_losses,
    write_spike_bundle,
)
from lightning_tfdebug.core.base import DebugCallback, check_choice, check_number, model_is_compiled
from lightning_tfdebug.core.batch import step_batch, step_rng_state
from lightning_tfdebug.core.calls import StepRecording, record_step
from lightning_tfdebug.core.step import step_state
from lightning_tfdebug.findings import OnFinding
from lightning_tfdebug.functional.memory import check_budget
from lightning_tfdebug.functional.spike_checks import COVERAGE as COVERAGE_ROWS
from lightning_tfdebug.functional.spike_checks import (
    LrTrack,
    RobustBaseline,
    SpikeReading,
    carriers,
    log_value,
    repeat_verdict,
    restart_reason,
    spike_flag,
    spike_verdict,
)
from lightning_tfdebug.functional.spikes import (
    dataset_indices_of,
    sample_stats,
    targets_for,
    usual_max_id,
)
from lightning_tfdebug.primitives import calls
from lightning_tfdebug.primitives.keys import Key

OnSpike = Literal["warn", "skip"]
_ON_SPIKE = ("warn", "skip")


class SpikeGuard(DebugCallback):
    r"""Detects loss spikes on every step, names the samples that carry them, keeps a bundle, skips on request.

    Every optimizer step feeds a robust baseline held on the device (an exponential mean and mean absolute deviation of
    the log-loss, fed with clipped values and never with a spike). One process decides on the step's loss; several
    ranks decide on the all-reduced total gradient norm, which every rank holds alike, so every rank decides the same
    without a collective. The decision is a device flag that NaNFirstFrame reads in its one host read before
    ``optimizer.step()`` (alone, SpikeGuard reads it itself: one host read per step). On a spike step the model call
    recorded on the first step is run again on the batch under ``no_grad`` (eval mode, RNG forked), per-sample losses
    name the rows carrying the excess, and a bundle is written to ``<log_dir>/tfdebug/spikes/step<k>-rank<r>``
    (``python -m lightning_tfdebug replay <bundle>`` reproduces the per-sample losses).

    Not judged: the first ``warmup_steps`` steps, and the ``warmup_steps`` after an LR restart or a change of sequence
    length; a resumed run builds its baseline again.

    Collectives: none. Host syncs: none of its own next to NaNFirstFrame (else one read per step); more on spike steps.

    Logged keys: :attr:`KEYS` (on spike steps), tabled in ``docs/callbacks/spike_guard.md``.

    Findings: ``TFD530`` a loss spike with its attribution, ``TFD531`` spikes that repeat or a loss that does not
    recover (see ``docs/findings.md``).

    Args:
        on_spike: ``"warn"`` (report and apply the step) or ``"skip"`` (report and leave the weights and the optimizer
            state exactly as they were).
        max_skips: skipped steps in a row after which the run stops (``TFD531``); 0: never stop.
        threshold: robust deviations above the baseline that make a spike.
        min_ratio: the least ratio of the value to its baseline that makes a spike.
        warmup_steps: steps of history before the first judged step (and after a restart of the baseline).
        max_spikes: spikes within ``spike_window`` steps that make ``TFD531``.
        spike_window: see ``max_spikes``.
        restart_ratio: an LR that rises more than this many times in one step restarts the baseline.
        max_bundles: spike bundles written per run (later spikes are still detected and skipped).
        memory_budget_mb: the most the bundle's weights may take (default: the pack's budget, max(2% of the training
            state, 32 MiB)); above it the bundle names the latest checkpoint instead.
        on_finding: what a finding does (see :class:`~lightning_tfdebug.DebugCallback`).

    Raises:
        ValueError: on an argument outside its allowed range.

    Example:
        ```python
        trainer = Trainer(callbacks=[SpikeGuard(on_spike="skip", max_skips=3)])
        ```

        With LightningCLI:

        ```yaml
        trainer:
          callbacks:
            - class_path: lightning_tfdebug.SpikeGuard
              init_args:
                on_spike: skip
                max_skips: 3
        ```
    """

    COVERAGE: ClassVar[Mapping[str, tuple[str, ...]]] = COVERAGE_ROWS  # declared beside the rules
    COVERAGE_WATCHED: ClassVar[frozenset[str]] = frozenset(COVERAGE)  # verified by watching the whole fit

    KEYS: ClassVar[tuple[Key, ...]] = (
        Key("spike/spikes", "loss spikes detected (cumulative; logged on spike steps)", chart="loss spikes"),
        Key(
            "spike/skipped_steps",
            "optimizer steps skipped on a spike (cumulative; logged on the steps it skips)",
            chart="loss spikes",
        ),
    )

    def __init__(
        self,
        on_spike: OnSpike = "warn",
        max_skips: int = 5,
        threshold: float = 6.0,
        min_ratio: float = 1.3,
        warmup_steps: int = 20,
        max_spikes: int = 3,
        spike_window: int = 100,
        restart_ratio: float = 1.5,
        max_bundles: int = 5,
        memory_budget_mb: float | None = None,
        on_finding: OnFinding = "warn",
    ) -> None:
        super().__init__(every_n_steps=None, on_finding=on_finding)
        check_choice("on_spike", on_spike, _ON_SPIKE)
        check_number("max_skips", max_skips, low=0, integer=True)
        check_number("threshold", threshold, low=0, low_inclusive=False)
        check_number("min_ratio", min_ratio, low=1)
        check_number("warmup_steps", warmup_steps, low=1, integer=True)
        check_number("max_spikes", max_spikes, low=1, integer=True)
        check_number("spike_window", spike_window, low=1, integer=True)
        check_number("restart_ratio", restart_ratio, low=1, low_inclusive=False)
        check_number("max_bundles", max_bundles, low=0, integer=True)
        self.memory_budget_mb = check_budget(memory_budget_mb)
        self.on_spike, self.max_skips, self.warmup_steps = on_spike, max_skips, warmup_steps
        self.threshold, self.min_ratio, self.restart_ratio = float(threshold), float(min_ratio), float(restart_ratio)
        self.max_spikes, self.spike_window, self.max_bundles = max_spikes, spike_window, max_bundles
        self.spike_steps: list[int] = []
        self.skipped_steps = 0
        self.bundles: list[str] = []
        self.restarts: list[tuple[int, str]] = []  # (step, why) where the baseline started again
        self._baseline = RobustBaseline()
        self._run_of_skips = 0
        self._params: list[Tensor] = []
        self._by_grad_norm = False  # several ranks: decide on the all-reduced gradient norm
        self._losses: list[Tensor] = []
        self._batch, self._batch_idx = None, 0
        self._recorder: StepRecording | None = None  # the first batch's recording of its calls
        self._found: calls.ModelCall | None = None
        self._call_reason: str | None = "no model call recorded yet"
        self._flag_key: int | None = None
        self._flag: Tensor | None = None
        self._x: Tensor | None = None
        self.value: float | None = None  # the flag as NaNFirstFrame read it (its one host read)
        self._lr_track = LrTrack()
        self._base_length: int | None = None

    @property
    def state_key(self) -> str:
        return self._generate_state_key(on_spike=self.on_spike)

    # ------------------------------------------------------------------ lifecycle
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not pl_module.automatic_optimization:
            self.stand_aside(
                "manual optimization: the loss and the optimizer step are the module's own",
                "automatic optimization",
            )
            return
        self._params = [p for p in pl_module.parameters() if p.requires_grad]
        self._by_grad_norm = trainer.world_size > 1
        self._baseline.reset()  # a resumed run builds its baseline again (its first steps are not judged)
        self._base_length = None

    def _clear(self) -> None:
        if self._recorder is not None:
            self._recorder.done(self)
        self._recorder, self._losses, self._batch = None, [], None

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._clear()
        if step_state(trainer).folded_flag is self:
            step_state(trainer).folded_flag = None

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._clear()

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._clear()

    # ------------------------------------------------------------------ per step
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int):
        if not self.active or trainer.sanity_checking:
            return
        self._batch, self._batch_idx = batch, batch_idx
        step_rng_state(trainer, batch, batch_idx)  # the batch's shared CPU RNG state (a host copy, no sync)
        if self._found is None and self._recorder is None and self._call_reason == "no model call recorded yet":
            if model_is_compiled(trainer, pl_module):  # module hooks on compiled code would make it recompile
                self._call_reason = COMPILED
                return self.check_aside("spike attribution", COMPILED, "attribution in a run without torch.compile")
            # the first batch only: the model call made by the real training_step (the step's one recording)
            self._recorder = record_step(trainer, pl_module, batch, self, calls.takes_tokens)

    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: Tensor) -> None:
        if not self.active or trainer.sanity_checking:
            return
        if self._recorder is not None:  # the first batch: the model call, from the step's one recording
            found = read_recording(self._recorder, self, step_batch(trainer, self._batch).fields, pl_module)
            self._recorder = None
            self._found, self._call_reason = (None, found) if isinstance(found, str) else (found, None)
        if not isinstance(loss, Tensor) or loss.numel() != 1:
            self.stand_aside("the loss is not a scalar per step", "a `training_step` that returns a scalar loss")
            return
        self._losses.append(loss.detach())  # a reference, no kernel
        step_state(trainer).folded_flag = self  # NaNFirstFrame reads this step's flag in its own host read

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._recorder is not None:  # no backward ran (a step that returned None): the recording's hooks go now
            self._recorder.done(self)
            self._recorder = None
        if self.active and not trainer.sanity_checking and outputs is None:
            self.stand_aside("`training_step` returned None", "a `training_step` that returns the loss")

    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        if not self.active or trainer.sanity_checking:
            return
        try:
            step = trainer.global_step
            if self._flag_key == step and self.value is not None:
                value = self.value  # read by NaNFirstFrame in its one host read: no sync here
            else:
                flag = self.flag(trainer)
                # Host sync, deliberate: alone (no NaNFirstFrame to carry it), the one read of the step's flag
                value = float(flag.item()) if flag is not None else 0.0
            if not value or step_state(trainer).skipped_step == step:
                self._run_of_skips = 0 if not value else self._run_of_skips
                return
            self._spike(trainer, pl_module, optimizer)
        finally:
            self._losses = []
            self.value = None

    # ------------------------------------------------------------------ the flag
    def flag(self, trainer: pl.Trainer) -> Tensor | None:
        """This step's spike flag (a device bool, once per step; None while not judged); feeds the baseline. No sync."""
        step = trainer.global_step
        if self._flag_key == step:
            return self._flag
        self._flag_key, self._flag, self.value = step, None, None
        if not self._losses and not self._by_grad_norm:
            return None
        lr = self._lr(trainer)
        length = self._length(trainer)
        track = self._lr_track
        why = restart_reason(lr, track.last_lr, length, self._base_length, self.restart_ratio, track.warming(step))
        if why is not None and self._baseline.seen:
            self._baseline.reset()
            self.restarts.append((step, why))
        if self._baseline.seen == 0:
            self._base_length = length
        track.add(step, lr)
        with torch.no_grad():
            x = self._grad_norm_log() if self._by_grad_norm else self._loss_log()
            if x is None:
                return None
            flag = None
            if self._baseline.seen >= self.warmup_steps:
                flag = spike_flag(self._baseline, x, self.threshold, self.min_ratio)
            self._baseline.update(x, None if flag is None else flag.logical_not())
        self._flag, self._x = flag, x
        return flag

    def _loss_log(self) -> Tensor | None:
        losses = self._losses
        if not losses:
            return None
        loss = losses[0] if len(losses) == 1 else torch.stack([t.float().reshape(()) for t in losses]).mean()
        return log_value(loss)

    def _grad_norm_log(self) -> Tensor | None:
        # Deliberate, every step under several ranks: a Python list over the parameters for this step's `.grad`
        # tensors, then one fused norm kernel; the all-reduced gradients are alike on every rank, so is the decision.
        grads = [g for g in [p.grad for p in self._params] if g is not None]
        if not grads:
            return None
        norms = torch._foreach_norm(grads, 2, dtype=torch.float32)
        return log_value(torch.linalg.vector_norm(torch.stack(norms)))

    def _lr(self, trainer: pl.Trainer) -> float | None:
        optimizers = trainer.optimizers
        if not optimizers or not optimizers[0].param_groups:
            return None
        lr = optimizers[0].param_groups[0].get("lr")
        return float(lr) if isinstance(lr, (int, float)) else None

    def _length(self, trainer: pl.Trainer) -> int | None:
        if self._batch is None:
            return None
        ids = step_batch(trainer, self._batch).input_ids
        return int(ids.shape[-1]) if isinstance(ids, Tensor) and ids.ndim >= 2 else None

    # ------------------------------------------------------------------ a spike
    def _spike(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer) -> None:
        step, lr = trainer.global_step, self._lr(trainer)
        # host sync, spike steps only: the value and its baseline, and each group's gradient norm
        x, mean = torch.stack([self._x.float(), self._baseline.mean.float()]).tolist()  # type: ignore[union-attr]
        groups = group_norms(pl_module)
        skip = self.on_spike == "skip"
        if skip:
            for p in self._params:  # only on a spike step: the optimizer skips parameters without a gradient
                p.grad = None
            self.skipped_steps += 1
            self._run_of_skips += 1
            step_state(trainer).skipped_step = step
        self.spike_steps.append(step)
        scalars = {"spike/spikes": float(len(self.spike_steps))}
        if skip:
            scalars["spike/skipped_steps"] = float(self.skipped_steps)
        self.log_scalars(trainer, scalars)
        reading = SpikeReading(
            step=step,
            value_name="log total gradient norm" if self._by_grad_norm else "log loss",
            value=x,
            baseline=mean,
            lr=lr,
            groups=groups,
            at_lr_peak=self._lr_track.at_peak(step, lr),
            skipped=skip,
        )
        self._attribute(trainer, pl_module, reading)
        verdicts = [spike_verdict(reading)]
        verdicts.append(
            repeat_verdict(self.spike_steps, self.spike_window, self.max_spikes, self._run_of_skips, self.max_skips)
        )
        if skip and self.max_skips and self._run_of_skips >= self.max_skips:
            trainer.should_stop = True  # every rank: the decision is the same on every rank
        self.emit(trainer, verdicts)

    def _attribute(self, trainer: pl.Trainer, pl_module: pl.LightningModule, reading: SpikeReading) -> None:
        """Replay the recorded model call on this batch, name the carrying rows and write the bundle."""
        if self._found is None or self._batch is None:
            reading.attribution_error = self._call_reason or "no batch"
            self._bundle(trainer, pl_module, reading, None)
            return
        try:
            repl, ids, mask, labels = call_inputs(self._found, step_batch(trainer, self._batch).fields)
            shift = self._found.shift if labels is not None else max(self._found.shift, 1)
            targets = targets_for(
                self._found.columns(ids), self._found.columns(labels), self._found.columns(mask), -100
            )
            losses = replay_losses(pl_module, self._found, repl, targets, shift)
        except Exception as err:  # never crash the run: the spike is still reported, without attribution
            reading.attribution_error = f"the replay failed ({type(err).__name__}: {err})"
            self._bundle(trainer, pl_module, reading, None)
            return
        host = losses.tolist()  # host read, spike steps only
        usual = usual_max_id(ids, mask, carriers(host))
        reading.samples, reading.excess_share = sample_stats(host, ids, mask, dataset_indices_of(self._batch), usual)
        call = {"repl": repl, "targets": targets, "shift": shift}
        self._bundle(trainer, pl_module, reading, (call, host))

    def _bundle(self, trainer: pl.Trainer, pl_module: pl.LightningModule, reading: SpikeReading, replayed: Any) -> None:
        if len(self.bundles) >= self.max_bundles:
            return
        path = write_spike_bundle(self, trainer, pl_module, reading, replayed)
        if path is not None:
            self.bundles.append(path)
            reading.bundle = path

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        return {
            **super().state_dict(),
            "spike_steps": list(self.spike_steps),
            "skipped_steps": self.skipped_steps,
            "bundles": list(self.bundles),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self.spike_steps = list(state_dict.get("spike_steps", []))
        self.skipped_steps = int(state_dict.get("skipped_steps", 0))
        self.bundles = list(state_dict.get("bundles", []))
