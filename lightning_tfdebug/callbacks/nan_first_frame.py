"""NaNFirstFrame: which module first produced inf or nan, forward and backward, and what led up to it."""

from __future__ import annotations

import json
import math
import os
from typing import Any, Literal

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor

from lightning_tfdebug.core.base import (
    DebugCallback,
    TFDebugWarning,
    check_choice,
    check_number,
    eager_model_calls,
    model_is_compiled,
)
from lightning_tfdebug.core.batch import loss_of, step_rng_state
from lightning_tfdebug.core.distributed import (
    all_gather_vector,
    any_rank,
    gradients_replicated,
    local_tensor,
    world_size,
)
from lightning_tfdebug.core.io import write_text
from lightning_tfdebug.core.model import grad_scaler_of, quiet_training_step
from lightning_tfdebug.findings import OnFinding
from lightning_tfdebug.functional.finite import flagged_ranks, grads_nonfinite_flag
from lightning_tfdebug.functional.frames import (
    Frame,
    FrameFlags,
    FrameRecorder,
    format_frames,
    weight_ranges,
    window,
)

Mode = Literal["lazy", "eager"]
_MODES = ("lazy", "eager")
_MAX_KEPT_MICRO_BATCHES = 64
_MAX_PENDING_LOSSES = 16  # micro-batch losses kept as references before they are folded into one flag
_LOSS_FRAME = "training_step"  # the pseudo-module under which the loss returned by training_step is recorded


def _rng_state(device: torch.device, cpu: Tensor | None = None) -> dict[str, Any]:
    state: dict[str, Any] = {"cpu": torch.get_rng_state() if cpu is None else cpu}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)  # a host copy of the generator's seed and offset
    return state


def _set_rng_state(state: dict[str, Any], device: torch.device) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


class NaNFirstFrame(DebugCallback):
    r"""Finds the first module whose forward output, and the first whose gradient, became inf or nan.

    When a step's loss or gradients turn non-finite, the optimizer step is not applied (the weights stay as they
    were before the bad step) and a report is written to ``<trainer.log_dir>/tfdebug/nan-step<k>-rank<r>.txt`` (a
    table) and ``.json``, atomically and before any stop or raise. The report names the first module whose forward
    output held inf/nan and the first module whose output gradient did, with the frames that led up to each: per
    module call in call order, the abs-min/abs-max of its inputs, outputs and own weights, and how many times the
    abs-max could still grow before overflowing fp16 and bf16. It also records step, batch index, rank(s) and
    precision.

    Modes:

    * ``"lazy"`` (default): each step checks on the device whether the loss (every micro-batch) and, without a
      GradScaler, the gradients are finite; one small host read per step. On the first non-finite step, the
      micro-batches of that step are replayed with the same RNG state (dropout masks repeat) and with frame hooks
      attached. Every rank replays, so collectives inside the model (FSDP2) stay matched.
    * ``"eager"``: for inf/nan that never reach the loss (a masked-out position, a discarded branch) and for a
      non-finite value a replay may not reproduce. Every step, a forward hook on every module records one device
      scalar per floating-point output (its float32 sum: one kernel, no host sync; no abs ranges, no gradient
      hooks); the sums join the loss/gradient flags in the same single host read. On a flagged step the first
      non-finite output of that step is named from the sums, and the step is replayed as in lazy mode for the full
      frames (abs ranges, weights, backward). A flag the replay shows to be a float32 overflow of finite values is
      dropped; one the replay does not reproduce is still reported, named from the step's sums.

    Every rank must take the same decision on the same step. Under DDP (lazy mode, gradients checked) it needs no
    collective: DDP's reducer has all-reduced the gradients before the check, so they are identical on every rank,
    and a non-finite loss on one rank has made every rank's gradients non-finite too. Where the flag a rank sees is
    its own (FSDP / FSDP2 gradient shards, eager mode's frame flags, ``check_gradients=False`` or a GradScaler,
    where only the rank-local loss decides), one one-element ``all_reduce`` (max) per step shares it. Only on a bad
    step (rare, and the same on every rank) does an ``all_gather`` of three flags per rank say which ranks were bad.

    Under a GradScaler (fp16), overflowing gradients are the scaler's business (it skips those steps; see
    :class:`~lightning_tfdebug.ScalerWatch`); NaNFirstFrame then triggers on a non-finite loss, i.e. an overflow
    in the forward pass.

    Logged keys (on steps it skips):

    | key | meaning |
    | --- | --- |
    | `nan_first_frame/skipped_steps` | optimizer steps not applied because the loss or gradients were non-finite |

    Findings: ``TFD401`` the loss or gradients became non-finite (names the first module, the rank(s) and the
    report), ``TFD402`` a module produced inf/nan that did not reach the loss (eager mode), ``TFD403`` the replay
    itself failed (see ``docs/findings.md``).

    Args:
        mode: ``"lazy"`` or ``"eager"`` (see above).
        on_finding: ``"warn"`` (report, skip the step and go on), ``"stop"`` or ``"raise"``; all ranks act together.
        max_frames: frames shown before (and including) the first bad one, per direction.
        max_reports: reports written per run; later non-finite steps are still skipped and counted.
        check_gradients: also treat non-finite gradients (without a GradScaler) as a bad step.
        skip_nonfinite_steps: leave the weights untouched on a non-finite step (set every gradient to None, so the
            optimizer skips every parameter and its moments).

    Raises:
        ValueError: on an argument outside its allowed range.

    Example:
        ```python
        trainer = Trainer(callbacks=[NaNFirstFrame(on_finding="stop")])
        ```

        LightningCLI:

        ```yaml
        trainer:
          callbacks:
            - class_path: lightning_tfdebug.NaNFirstFrame
              init_args:
                mode: lazy
                on_finding: stop
                max_frames: 21
        ```
    """

    def __init__(
        self,
        mode: Mode = "lazy",
        on_finding: OnFinding = "warn",
        max_frames: int = 21,
        max_reports: int = 1,
        check_gradients: bool = True,
        skip_nonfinite_steps: bool = True,
    ) -> None:
        super().__init__(every_n_steps=None, on_finding=on_finding)
        check_choice("mode", mode, _MODES)
        check_number("max_frames", max_frames, low=1, integer=True)
        check_number("max_reports", max_reports, low=0, integer=True)
        for name, value in (("check_gradients", check_gradients), ("skip_nonfinite_steps", skip_nonfinite_steps)):
            if not isinstance(value, bool):
                raise TypeError(f"`{name}` must be True or False; got {value!r}.")
        self.mode = mode
        self.max_frames = max_frames
        self.max_reports = max_reports
        self.check_gradients = check_gradients
        self.skip_nonfinite_steps = skip_nonfinite_steps
        self.reports: list[str] = []
        self.skipped_steps = 0
        self._params: list[Tensor] = []  # the trainable parameters, listed once per fit
        self._sharded = False  # some parameter is a DTensor (FSDP2): gradients are read through their local shard
        self._losses: list[Tensor] = []  # this step's micro-batch losses, detached references (no kernel per batch)
        self._loss_bad: Tensor | None = None  # the flag of losses folded early (many micro-batches in one step)
        self._micro: list[tuple[Any, int, dict[str, Any]]] = []
        self._flags: FrameFlags | None = None  # eager mode: one output sum per module call, every step
        self._mode: Mode = mode  # the mode this fit runs in: eager falls back to lazy on a compiled model
        self._check_grads = check_gradients  # this fit checks the gradients (not under a GradScaler)
        self._replicated = False  # this fit's decision flag is identical on every rank: no collective per step

    @property
    def state_key(self) -> str:
        return self._generate_state_key(mode=self.mode, on_finding=self.on_finding)

    # ------------------------------------------------------------------ lifecycle
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._params = [p for p in pl_module.parameters() if p.requires_grad]
        self._sharded = any(local_tensor(p) is not p for p in self._params)
        self._mode = self.mode
        if self.mode == "eager" and self.active and model_is_compiled(trainer, pl_module):
            # Frame hooks inside compiled code would be traced into it and recompile it at every step (their record
            # count is guarded on) until Dynamo's limit; lazy mode replays a bad step eagerly instead.
            self._mode = "lazy"
            rank_zero_warn(
                "NaNFirstFrame: the model is compiled with torch.compile, so eager mode's frame hooks would recompile "
                "it at every step; running in lazy mode (a bad step is replayed eagerly, hooks on). Inf/nan that "
                "never reaches the loss or the gradients (TFD402) is not looked for.",
                category=TFDebugWarning,
            )
        if self._mode == "eager" and self.active:
            self._flags = FrameFlags(pl_module).attach()
            self._flags.enabled = False
        self._check_grads = self.check_gradients and grad_scaler_of(trainer) is None
        # Under DDP the gradients are all-reduced before `on_before_optimizer_step`: a gradient flag is the same on
        # every rank, and a rank-local non-finite loss has made every rank's gradients non-finite. Lazy mode then
        # decides from the gradient flag alone, with no collective on any healthy step.
        self._replicated = (
            self._mode == "lazy"
            and self._check_grads
            and gradients_replicated(getattr(trainer.strategy, "model", None), self._params)
        )

    def _detach(self) -> None:
        if self._flags is not None:
            self._flags.detach()
            self._flags = None
        self._micro.clear()
        self._losses.clear()
        self._loss_bad = None

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._detach()

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._detach()

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._detach()

    # ------------------------------------------------------------------ per step
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, idx: int) -> None:
        if not self.active:
            return
        # both modes: a bad step is replayed with frame hooks (eager mode names the first frame from its own flags
        # even when the replay does not reproduce it)
        if len(self._micro) >= _MAX_KEPT_MICRO_BATCHES:
            self._micro.pop(0)
        # a reference to the batch, no copy; the CPU generator's state is the batch's one shared copy (ReproCapture's)
        self._micro.append((batch, idx, _rng_state(pl_module.device, step_rng_state(trainer, batch, idx))))
        if self._flags is not None:
            self._flags.enabled = True

    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: Tensor) -> None:
        if not self.active:
            return
        # a reference, no kernel: the loss is checked with the gradients, before the optimizer step
        self._losses.append(loss.detach())
        if len(self._losses) >= _MAX_PENDING_LOSSES:  # long gradient accumulation: fold into one flag, no sync
            self._loss_bad = self._loss_flag()
            self._losses = []
        if self._flags is not None and self._flags.enabled:
            self._flags.record_value(_LOSS_FRAME, "loss", loss)

    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        if not self.active or trainer.sanity_checking:
            return
        try:
            self._check_step(trainer, pl_module)
        finally:
            self._micro.clear()
            self._losses = []
            self._loss_bad = None
            if self._flags is not None:
                self._flags.enabled = False
                self._flags.clear()

    def _loss_flag(self) -> Tensor | None:
        """Whether a loss of this step (the pending ones and any folded earlier) is inf/nan: a device bool, no sync."""
        flag = self._loss_bad
        with torch.no_grad():
            for loss in self._losses:
                bad = torch.isfinite(loss).logical_not_()
                bad = bad.any() if bad.ndim else bad
                flag = bad if flag is None else flag | bad.to(flag.device)
        return flag

    def _step_flags(self) -> tuple[Tensor | None, Tensor | None]:
        """This rank's ``(grad_nonfinite, frame_nonfinite)`` flags of the step, device tensors or None; no host sync."""
        grad_bad = None
        if self._check_grads:
            # Deliberate, every step: a list over the parameters (cached per fit) to collect this step's `.grad`
            # tensors, which are new objects each step when `zero_grad` sets them to None; the check itself is one
            # fused kernel over every gradient (about 0.3 ms for 0.9M float32 gradients on one CPU thread, memory
            # bound; see `grads_nonfinite_flag`).
            grads = [g for g in [p.grad for p in self._params] if g is not None]  # one `.grad` read per parameter
            if self._sharded:
                grads = [local_tensor(g) for g in grads]
            grad_bad = grads_nonfinite_flag(grads)
        frame_bad = self._flags.nonfinite() if self._flags is not None else None
        return grad_bad, frame_bad

    def _local_flags(self, device: torch.device, grad_bad: Tensor | None, frame_bad: Tensor | None) -> Tensor:
        """``[loss_nonfinite, grad_nonfinite, frame_nonfinite]`` for this rank, on the device, no host sync."""
        zero = torch.zeros((), device=device)
        flags = (self._loss_flag(), grad_bad, frame_bad)
        return torch.stack([zero if f is None else f.to(device=device, dtype=zero.dtype).reshape(()) for f in flags])

    def _one_pass_decision(self) -> Tensor | None:
        """One process, CPU gradients, lazy mode: the step's losses and gradients checked in one fused pass (the
        losses concatenated into a fresh tensor first: the check writes ``x * 1.0`` back and the losses stay
        untouched). None where that does not apply (decided before reading any gradient, so the caller's own pass does
        not read them twice); the caller then adds up the separate flags."""
        if not self._check_grads or self._flags is not None or self._sharded or self._loss_bad is not None:
            return None
        if not self._params or self._params[0].device.type != "cpu":
            return None
        # Deliberate, every step: one `.grad` read per parameter (a list cached per fit); see `_step_flags`.
        grads = [g for g in [p.grad for p in self._params] if g is not None]
        if not grads or grads[0].device.type != "cpu":
            return None
        losses = self._losses
        if losses and not all(t.device == grads[0].device and t.is_floating_point() for t in losses):
            return None
        if len(losses) == 1 and losses[0].ndim == 0:
            # the usual case, one scalar loss on the CPU: read on the host (no sync on a CPU tensor, and no kernel;
            # a bad loss decides the step at once, the gradients then read in the separate flags)
            if not math.isfinite(losses[0].item()):
                return torch.ones((), device=grads[0].device)
        elif losses:  # a fresh tensor (one kernel): the check must not write into the losses themselves
            grads.append(torch.cat([t.reshape(-1) for t in losses]))
        return grads_nonfinite_flag(grads)

    def _check_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        device = trainer.strategy.root_device
        world = trainer.world_size  # a Trainer attribute: no call into torch.distributed on the hot path
        grad_bad = frame_bad = None
        with torch.no_grad():
            local: Tensor | None = None
            decision = self._one_pass_decision() if world == 1 else None
            if decision is not None:
                pass  # the common path: the losses and the gradients in one fused pass, nothing else to add
            elif world == 1:
                # the fewest kernels on the other paths: the flags added up, the table only if one is set
                grad_bad, frame_bad = self._step_flags()
                present = [f for f in (self._loss_flag(), grad_bad, frame_bad) if f is not None]
                if not present:
                    return
                if len(present) == 1:
                    decision = present[0]
                elif len(present) == 2 and frame_bad is None and present[0].device == present[1].device:
                    decision = present[0] + present[1]  # the loss's and the gradients' flags: one kernel
                else:
                    decision = torch.stack([f.to(device, torch.float32).reshape(()) for f in present]).sum()
            elif self._replicated:
                # DDP: the all-reduced gradients' flag, identical on every rank; no collective
                grad_bad, frame_bad = self._step_flags()
                decision = grad_bad if grad_bad is not None else torch.zeros((), device=device)
            else:
                # Collective, every step, and deliberate: a loss is rank-local (the only flag under a GradScaler or
                # with check_gradients=False), an FSDP gradient shard or an eager frame may hold the only inf/nan, so
                # every rank must learn whether any rank's step is bad. One one-element all_reduce (max).
                grad_bad, frame_bad = self._step_flags()
                local = self._local_flags(device, grad_bad, frame_bad)
                decision = any_rank(local.amax())
        if not decision.item():
            return
        if local is None:
            if grad_bad is None and frame_bad is None:  # the one-pass path: the separate flags, on a bad step only
                grad_bad, frame_bad = self._step_flags()
            local = self._local_flags(device, grad_bad, frame_bad)
        # A bad step, the same on every rank: which ranks were bad (collective, only on such a step).
        rows = (all_gather_vector(local) if world > 1 else local.unsqueeze(0)).tolist()
        bad_ranks, frame_ranks = flagged_ranks(rows)
        if not bad_ranks and not frame_ranks:
            return
        step = trainer.global_step
        if bad_ranks and self.skip_nonfinite_steps:
            for p in self._params:  # only on a bad step: the optimizer skips parameters without a gradient
                p.grad = None
            self.skipped_steps += 1
            self.log_scalars(trainer, {"nan_first_frame/skipped_steps": float(self.skipped_steps)})
        if len(self.reports) >= self.max_reports:
            return
        if self._mode == "lazy" and not bad_ranks:
            return
        step_first = None
        if self._flags is not None:
            self._flags.enabled = False  # the replay below records into its own flags
            if rows[trainer.global_rank][2] > 0:
                step_first = self._flags.first_nonfinite()  # this step's first non-finite output (one host read)
        recorder, replay_flags, error = self._replay(trainer, pl_module, flags=self._flags is not None)
        summary, lines = self._report(trainer, recorder, rows, bad_ranks, frame_ranks, error, step_first, replay_flags)
        stem = f"nan-step{step}-rank{trainer.global_rank}"
        txt_path, json_path = (os.path.join(self.tfdebug_dir, stem + ext) for ext in (".txt", ".json"))
        if error is not None and self._sharded and world_size() > 1:
            self._write(summary, lines, txt_path, json_path)
            self._end_after_sharded_replay_failure(trainer, step, bad_ranks, error, txt_path)
        everyone = self._share(trainer, summary)
        if not bad_ranks and not any(r["forward"] for r in everyone):
            # Every flagged output sum was a float32 overflow of finite values (the replay's exact abs ranges are
            # finite where its sums overflow again): no inf/nan, nothing to report. The same verdict on every rank.
            return
        self._write(summary, lines, txt_path, json_path)
        self._emit(trainer, summary, txt_path, json_path, bad_ranks, frame_ranks, error, everyone)

    def _write(self, summary: dict[str, Any], lines: list[str], txt_path: str, json_path: str) -> None:
        # Through the pack's writer: a refused write warns once and the report still reaches the finding's evidence.
        write_text(json_path, json.dumps(summary, indent=1, default=str, allow_nan=False))
        write_text(txt_path, "\n".join(lines) + "\n")
        self.reports.append(txt_path)

    def _end_after_sharded_replay_failure(
        self, trainer: pl.Trainer, step: int, bad_ranks: list[int], error: str, txt_path: str
    ) -> None:
        """End the run on this rank: its FSDP2 replay failed part-way, so the other ranks may be waiting in one of the
        replay's all-gathers or reduce-scatters that this rank will never join. Any next collective from here would
        be matched against the wrong one (gloo aborts the process natively, NCCL hangs), so none is run: the finding
        is recorded on this rank alone, and the error ends this process; the other ranks' pending collective then
        fails at once (their peer is gone), their own replay fails and they end here too."""
        self.emit_code(
            trainer,
            "TFD403",
            f"The loss or gradients became non-finite at step {step} on rank(s) {bad_ranks}, and replaying the batch "
            f"to locate the first bad frame failed on rank {trainer.global_rank}: {error}. Report: {txt_path}",
            {"ranks": bad_ranks, "report": txt_path, "replay_error": error},
            key=f"step{step}",
            synchronized=False,  # no collective: the ranks are no longer in step
        )
        raise RuntimeError(
            f"NaNFirstFrame's replay of step {step} failed on rank {trainer.global_rank} ({error}) under a sharded "
            "(FSDP2) model: the other ranks' replay collectives can no longer be matched, so the run ends on every "
            f"rank instead of hanging. This rank's report: {txt_path}."
        )

    # ------------------------------------------------------------------ replay
    def _replay(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, flags: bool = False
    ) -> tuple[FrameRecorder, FrameFlags | None, str | None]:
        """Re-run this step's micro-batches with the same RNG state and frame hooks; every rank does it.

        With ``flags`` (eager mode) the replay also records the output sums eager mode flags a step with, so that a
        flag whose exact abs ranges are finite can be told apart: its sum overflows again (a float32 overflow of
        finite values, deterministic), or it does not (the non-finite value did not reproduce).

        The model is called directly (not through the DDP wrapper), so DDP's reducer does not all-reduce the
        replayed gradients; under FSDP2 the replay runs the same all-gathers and reduce-scatters on every rank,
        which is why every rank replays all micro-batches whatever it finds. The replay's gradients are dropped and
        the step's own are put back.
        """
        device = pl_module.device
        recorder = FrameRecorder(pl_module, backward=True)
        replay_flags = FrameFlags(pl_module) if flags else None
        saved = _rng_state(device)
        scaler = grad_scaler_of(trainer)
        error: str | None = None
        # The step's own gradients (None after a skipped bad step) are put back afterwards: a step whose only flag is
        # a module output (TFD402) is still applied, and the replay's backward must not accumulate into them.
        grads = [p.grad for p in self._params]
        for p in self._params:
            p.grad = None
        try:
            recorder.attach()
            if replay_flags is not None:
                replay_flags.attach()
            for batch, batch_idx, rng in list(self._micro):
                _set_rng_state(rng, device)
                # eagerly under torch.compile: the frame hooks run, and the replay compiles nothing new
                with eager_model_calls(), torch.enable_grad(), trainer.precision_plugin.train_step_context():
                    loss = loss_of(quiet_training_step(pl_module, batch, batch_idx))
                if loss is None:
                    continue
                recorder.record_value(_LOSS_FRAME, "loss", loss)
                if replay_flags is not None:
                    replay_flags.record_value(_LOSS_FRAME, "loss", loss)
                if scaler is not None:
                    loss = scaler.scale(loss)
                if loss.requires_grad:
                    loss.backward()
        except Exception as err:  # the report says the replay failed; training decides with on_finding
            error = f"{type(err).__name__}: {err}"
        finally:
            recorder.detach()
            if replay_flags is not None:
                replay_flags.detach()
            _set_rng_state(saved, device)
            for p, g in zip(self._params, grads):
                p.grad = g
        return recorder, replay_flags, error

    # ------------------------------------------------------------------ report
    def _section(self, recorder: FrameRecorder, phase: str) -> tuple[int | None, list[Frame]]:
        first = recorder.first_nonfinite(phase)
        n = recorder.count(phase)
        if first is not None:
            start, stop = window(first, self.max_frames)
        else:
            start, stop = max(0, n - self.max_frames), n
        frames = recorder.frames(phase, start, stop)
        if phase == "forward":
            cache: dict[str, list[Any]] = {}
            for frame in frames:
                if frame.module not in cache:
                    module = recorder.module_of(frame.module)
                    cache[frame.module] = weight_ranges(module) if module is not None else []
                frame.entries[:0] = cache[frame.module]
        return first, frames

    def _report(
        self,
        trainer: pl.Trainer,
        recorder: FrameRecorder,
        rows: list[list[float]],
        bad_ranks: list[int],
        frame_ranks: list[int],
        error: str | None,
        step_first: tuple[int, str, str, str] | None = None,
        replay_flags: FrameFlags | None = None,
    ) -> tuple[dict[str, Any], list[str]]:
        first_fwd, fwd = self._section(recorder, "forward")
        first_bwd, bwd = self._section(recorder, "backward")

        def pick(first: int | None, frames: list[Frame]) -> dict[str, Any] | None:
            if first is None:
                return None
            frame = next(f for f in frames if f.index == first)
            bad = next((e.label for e in frame.entries if not e.finite), None)
            return {
                "module": frame.module,
                "module_type": frame.module_type,
                "index": first,
                "tensor": bad,
                "source": "replay",
            }

        replayed_fwd = pick(first_fwd, fwd)
        first_forward = replayed_fwd
        reproduced: bool | None = None  # eager mode: did the replay reproduce this step's flagged output?
        overflow = False  # eager mode: the flag was a float32 overflow of the sum of finite values
        if step_first is not None:
            _, module, module_type, label = step_first
            reproduced = replayed_fwd is not None
            if not reproduced and error is None and replay_flags is not None and replay_flags.first_nonfinite():
                overflow = True  # the exact abs ranges are finite and the sum overflows again: no inf/nan
                first_forward = None
            else:
                # this step's own flags name the first frame (the replay's exact frames give the detail)
                first_forward = {
                    "module": module,
                    "module_type": module_type,
                    "index": first_fwd if replayed_fwd is not None and replayed_fwd["module"] == module else None,
                    "tensor": label,
                    "source": "step",
                }

        rank = trainer.global_rank
        micro = [idx for _, idx, _ in self._micro]
        summary: dict[str, Any] = {
            "step": trainer.global_step,
            "batch_idx": micro[-1] if micro else trainer.fit_loop.epoch_loop.batch_idx,
            "micro_batches": micro,
            "rank": rank,
            "world_size": world_size(),
            "precision": str(trainer.precision),
            "mode": self._mode,
            "loss_nonfinite": bool(rows[rank][0] > 0),
            "grad_nonfinite": bool(rows[rank][1] > 0),
            "nonfinite_ranks": bad_ranks,
            "frame_nonfinite_ranks": frame_ranks,
            "first_forward": first_forward,
            "first_backward": pick(first_bwd, bwd),
            "replay_first_forward": replayed_fwd,
            "replay_reproduced": reproduced,
            "flag_was_sum_overflow": overflow,
            "frames_recorded": {"forward": recorder.count("forward"), "backward": recorder.count("backward")},
            "replay_error": error,
            "forward_frames": [f.to_dict() for f in fwd],
            "backward_frames": [f.to_dict() for f in bwd],
        }
        ff, fb = summary["first_forward"], summary["first_backward"]
        lines = [
            f"NaNFirstFrame report: step {summary['step']}, batch {summary['batch_idx']}, rank {rank} of "
            f"{summary['world_size']}, precision {summary['precision']}, mode {self._mode}",
            f"non-finite loss or gradients on rank(s): {bad_ranks or 'none'}; "
            f"non-finite module outputs on rank(s): {frame_ranks or 'none'}",
            "first non-finite forward frame on this rank: "
            + (f"{ff['module']} ({ff['module_type']}), {ff['tensor']}" if ff else "none"),
            "first non-finite gradient on this rank reached the output of: "
            + (f"{fb['module']} ({fb['module_type']})" if fb else "none"),
        ]
        if reproduced is False and not overflow:
            lines.append(
                "the first forward frame is named from this step's output sums: the replay did not reproduce the "
                "non-finite value (a nondeterministic inf/nan); the frames below are the replay's"
            )
        elif reproduced and replayed_fwd is not None and ff is not None and replayed_fwd["module"] != ff["module"]:
            lines.append(f"the replay's first non-finite forward frame differs: {replayed_fwd['module']}")
        if overflow:
            lines.append(
                "this step's flagged output sum overflowed float32 while every value was finite (exact abs ranges "
                "of the replay): no inf/nan"
            )
        if error:
            lines.append(f"the replay failed: {error}")
        lines.append("")
        lines += format_frames(f"Last {len(fwd)} forward frames (call order):", fwd)
        lines.append("")
        lines += format_frames(f"Last {len(bwd)} backward frames (order gradients arrived):", bwd)
        return summary, lines

    def _share(self, trainer: pl.Trainer, summary: dict[str, Any]) -> list[dict[str, Any]]:
        """Every rank's first forward/backward module names (and whether the replay reproduced this step's flags)."""
        mine = {
            "rank": trainer.global_rank,
            "forward": (summary["first_forward"] or {}).get("module"),
            "backward": (summary["first_backward"] or {}).get("module"),
            "reproduced": summary["replay_reproduced"],
        }
        everyone: list[Any] = [mine]
        if world_size() > 1:
            # Only on a reporting step, which every rank reached from the same gathered flags: share the names.
            everyone = [None] * world_size()
            dist.all_gather_object(everyone, mine)  # collective
        return [r for r in everyone if r]

    def _emit(
        self,
        trainer: pl.Trainer,
        summary: dict[str, Any],
        txt_path: str,
        json_path: str,
        bad_ranks: list[int],
        frame_ranks: list[int],
        error: str | None,
        everyone: list[dict[str, Any]],
    ) -> None:
        named = [r for r in everyone if r and r["forward"]] or [r for r in everyone if r and r["backward"]]
        culprit = named[0] if named else None
        if not bad_ranks:  # eager mode: the ranks whose flagged outputs held inf/nan (not a float32 sum overflow)
            frame_ranks = [r for r in frame_ranks if any(e["rank"] == r and e["forward"] for e in everyone)]
        evidence = {
            "module": culprit["forward"] if culprit else None,
            "backward_module": culprit["backward"] if culprit else None,
            "module_rank": culprit["rank"] if culprit else None,
            "ranks": bad_ranks or frame_ranks,
            "per_rank": {str(r["rank"]): {"forward": r["forward"], "backward": r["backward"]} for r in everyone if r},
            "batch_idx": summary["batch_idx"],
            "precision": summary["precision"],
            "report": txt_path,
            "report_json": json_path,
        }
        not_reproduced = bool(culprit and culprit["forward"] and culprit.get("reproduced") is False)
        if not_reproduced:
            evidence["replay_reproduced"] = False
        loss_only = bool(culprit and culprit["forward"] == _LOSS_FRAME)
        if loss_only:
            where = (
                f"no module output held inf/nan; the first non-finite value is the loss computed in training_step on "
                f"rank {culprit['rank']} (a mean over zero supervised tokens, or log(0) or 0/0 in the loss function)"
            )
        elif culprit and culprit["forward"]:
            where = (
                f"the first module whose forward output held inf/nan was `{culprit['forward']}` on rank "
                f"{culprit['rank']}"
            )
        else:
            where = "no module output held inf/nan in the replay"
        if not_reproduced:
            where += " (named from that step's own output sums: the replay did not reproduce the inf/nan)"
        if culprit and culprit["backward"]:
            where += f"; the first non-finite gradient reached the output of `{culprit['backward']}`"
        hint = (
            "Every module's output was finite: look at the loss itself. A batch whose labels are all ignore_index "
            "gives mean cross-entropy 0/0 = nan (BatchGuard and LossAtInit name it); a hand-written loss taking "
            "log of a probability that reached 0 gives -inf (use log_softmax / cross_entropy on logits)."
            if loss_only
            else "Read the report's frames: the abs-max column shows where values grew; a small 'fp16 room' means the "
            "next operation may overflow. Under fp16 keep that module in fp32 (or use bf16), lower the LR, add "
            "warm-up or clipping; a nan from log(0), sqrt(0) backward or 0/0 points at the named module's math."
        )
        if error and bad_ranks:
            self.emit_code(
                trainer,
                "TFD403",
                f"The loss or gradients became non-finite at step {summary['step']} on rank(s) {bad_ranks}, and "
                f"replaying the batch to locate the first bad frame failed: {error}. Report: {txt_path}",
                evidence,
                key=f"step{summary['step']}",
            )
        elif bad_ranks:
            self.emit_code(
                trainer,
                "TFD401",
                f"The loss or gradients became non-finite at step {summary['step']} on rank(s) {bad_ranks}: {where}. "
                f"{'The optimizer step was not applied. ' if self.skip_nonfinite_steps else ''}Report: {txt_path}",
                evidence,
                hint=hint,
                key=f"step{summary['step']}",
            )
        else:
            self.emit_code(
                trainer,
                "TFD402",
                f"At step {summary['step']} a module produced inf/nan that did not reach the loss, on rank(s) "
                f"{frame_ranks}: {where}.{f' The replay failed: {error}.' if error else ''} Report: {txt_path}",
                evidence,
                key=f"step{summary['step']}",
            )

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "reports": list(self.reports), "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self.reports = list(state_dict.get("reports", []))
        self.skipped_steps = int(state_dict.get("skipped_steps", 0))
