"""NaNFirstFrame: which module first produced inf or nan, forward and backward, and what led up to it."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any, ClassVar, Literal

import lightning.pytorch as pl
import torch
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
from lightning_tfdebug.core.batch import step_rng_state
from lightning_tfdebug.core.distributed import any_rank, gradients_replicated, world_size
from lightning_tfdebug.core.io import write_text
from lightning_tfdebug.core.model import grad_scaler_of, quiet_training_step
from lightning_tfdebug.core.reduction import gather_records, reduce_now
from lightning_tfdebug.core.step import step_state
from lightning_tfdebug.findings import OnFinding
from lightning_tfdebug.functional.finite import StepFinite, any_flag, flag_fields, flagged_ranks
from lightning_tfdebug.functional.frame_reports import nan_report, replay_frames, rng_state
from lightning_tfdebug.functional.frames import LOSS_FRAME, FrameFlags, FrameRecorder
from lightning_tfdebug.functional.nan_checks import COVERAGE as COVERAGE_ROWS
from lightning_tfdebug.functional.nan_checks import (
    TFD402,
    NaNStep,
    nonfinite_step,
    rank_frames,
    replay_failed_on_rank,
)
from lightning_tfdebug.primitives.batch import loss_of
from lightning_tfdebug.primitives.keys import Key

Mode = Literal["lazy", "eager"]
_MODES = ("lazy", "eager")
_MAX_KEPT_MICRO_BATCHES = 64


class NaNFirstFrame(DebugCallback):
    r"""Finds the first module whose forward output, and the first whose gradient, became inf or nan.

    On the first step whose loss or gradients turn non-finite, the optimizer step is not applied and the step's
    micro-batches are replayed with the same RNG state and frame hooks attached (every rank replays). The report,
    ``<trainer.log_dir>/tfdebug/nan-step<k>-rank<r>.txt`` and ``.json``, names the first module whose forward output
    and the first whose output gradient held inf/nan, with the frames that led up to each (abs-min/abs-max of inputs,
    outputs and weights, fp16/bf16 headroom). ``"eager"`` mode also keeps one float32 output sum per module call on
    every step, to catch inf/nan that never reach the loss. How each mode decides, and what it costs, is in
    ``docs/callbacks/nan_first_frame.md``.

    Collectives: none per step under DDP with gradients checked (the all-reduced gradients carry every rank's flag);
    otherwise one one-element ``all_reduce`` (max) per step; an ``all_gather`` of three flags per rank on a bad step.

    Logged keys: :attr:`KEYS` (on the steps it skips), tabled in ``docs/callbacks/nan_first_frame.md``.

    Findings: ``TFD401`` non-finite loss or gradients, ``TFD402`` a module produced inf/nan that did not reach the
    loss (eager mode), ``TFD403`` the replay failed (see ``docs/findings.md``).

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

        With LightningCLI:

        ```yaml
        trainer:
          callbacks:
            - class_path: lightning_tfdebug.NaNFirstFrame
              init_args:
                on_finding: stop
        ```
    """

    COVERAGE: ClassVar[Mapping[str, tuple[str, ...]]] = COVERAGE_ROWS  # declared beside the rules
    COVERAGE_WATCHED: ClassVar[frozenset[str]] = frozenset(COVERAGE)  # verified by watching the whole fit

    KEYS: ClassVar[tuple[Key, ...]] = (
        Key(
            "nan_first_frame/skipped_steps",
            "optimizer steps not applied because the loss or gradients were non-finite (cumulative; logged on the "
            "steps it skips)",
            chart="steps skipped for non-finite values",
        ),
    )

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
        self._finite = StepFinite()  # this fit's parameters and this step's losses (detached references)
        self._micro: list[tuple[Any, int, dict[str, Any]]] = []
        self._flags: FrameFlags | None = None  # eager mode: one output sum per module call, every step
        self._mode: Mode = mode  # the mode this fit runs in: eager falls back to lazy on a compiled model
        self._replicated = False  # this fit's decision flag is identical on every rank: no collective per step

    @property
    def state_key(self) -> str:
        return self._generate_state_key(mode=self.mode, on_finding=self.on_finding)

    # ------------------------------------------------------------------ lifecycle
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        params = [p for p in pl_module.parameters() if p.requires_grad]
        # gradients are checked without a GradScaler (which skips the steps whose gradients overflow)
        self._finite = StepFinite(params, self.check_gradients and grad_scaler_of(trainer) is None)
        self._mode = self.mode
        if self.mode == "eager" and self.active and model_is_compiled(trainer, pl_module):
            # frame hooks traced into compiled code would recompile it at every step; lazy mode replays eagerly
            self._mode = "lazy"
            rank_zero_warn(
                "NaNFirstFrame: the model is compiled with torch.compile, so eager mode's frame hooks would recompile "
                "it at every step; running in lazy mode (a bad step is replayed eagerly, hooks on). Inf/nan that "
                f"never reaches the loss or the gradients ({TFD402.code}) is not looked for.",
                category=TFDebugWarning,
            )
        if self._mode == "eager" and self.active:
            self._flags = FrameFlags(pl_module).attach()
            self._flags.enabled = False
        # DDP all-reduces the gradients before the check: their flag is the same on every rank (a rank's bad loss made
        # every rank's gradients bad), so lazy mode decides from it alone, with no collective on a healthy step.
        self._replicated = (
            self._mode == "lazy"
            and self._finite.check_gradients
            and gradients_replicated(getattr(trainer.strategy, "model", None), params)
        )

    def _detach(self) -> None:
        if self._flags is not None:
            self._flags.detach()
            self._flags = None
        self._micro.clear()
        self._finite.reset()

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
        if len(self._micro) >= _MAX_KEPT_MICRO_BATCHES:
            self._micro.pop(0)
        # a reference to the batch, no copy; the CPU generator's state is the batch's one shared copy (ReproCapture's)
        self._micro.append((batch, idx, rng_state(pl_module.device, step_rng_state(trainer, batch, idx))))
        if self._flags is not None:
            self._flags.enabled = True

    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: Tensor) -> None:
        if not self.active:
            return
        self._finite.add_loss(loss)  # a reference, no kernel: checked with the gradients, before the optimizer step
        if self._flags is not None and self._flags.enabled:
            self._flags.record_value(LOSS_FRAME, "loss", loss)

    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        if not self.active or trainer.sanity_checking:
            return
        try:
            self._check_step(trainer, pl_module)
        finally:
            self._micro.clear()
            self._finite.reset()
            if self._flags is not None:
                self._flags.enabled = False
                self._flags.clear()

    def _step_flags(self) -> tuple[Tensor | None, Tensor | None]:
        """This rank's ``(grad_nonfinite, frame_nonfinite)`` flags of the step, device tensors or None; no host sync."""
        return self._finite.grad_flag(), (self._flags.nonfinite() if self._flags is not None else None)

    def _check_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        device = trainer.strategy.root_device
        world = trainer.world_size  # a Trainer attribute: no call into torch.distributed on the hot path
        grad_bad = frame_bad = local = None
        with torch.no_grad():
            # the common path, one process, CPU, lazy mode: the losses and the gradients in one fused pass
            decision = self._finite.one_pass() if world == 1 and self._flags is None else None
            if decision is None:
                grad_bad, frame_bad = self._step_flags()
                if world == 1:  # the fewest kernels: the flags added up, the table only if one is set
                    decision = any_flag(self._finite.loss_flag(), grad_bad, frame_bad, device)
                elif self._replicated:  # DDP: the all-reduced gradients' flag, identical on every rank; no collective
                    decision = grad_bad if grad_bad is not None else torch.zeros((), device=device)
                else:
                    # Collective, every step, and deliberate: a loss is rank-local (the only flag under a GradScaler
                    # or with check_gradients=False), an FSDP gradient shard or an eager frame may hold the only
                    # inf/nan, so every rank must learn whether any rank's step is bad. One one-element all_reduce.
                    local = flag_fields(device, self._finite.loss_flag(), grad_bad, frame_bad)
                    decision = any_rank(torch.stack(list(local.values())).amax())
        # host sync: the step's one read, before `optimizer.step()` could apply a bad step
        if decision is None or not self._read(trainer, decision):
            return
        if local is None:
            if grad_bad is None and frame_bad is None:  # the one-pass path: the separate flags, on a bad step only
                grad_bad, frame_bad = self._step_flags()
            local = flag_fields(device, self._finite.loss_flag(), grad_bad, frame_bad)
        # A bad step, the same on every rank: which ranks were bad (collective, only on such a step).
        rows = reduce_now(device, rows=local).host().per_rank()
        self._bad_step(trainer, pl_module, rows)

    @staticmethod
    def _read(trainer: pl.Trainer, decision: Tensor) -> float:
        """The step's one host read of ``decision``; a member's folded flag (SpikeGuard) travels in the same read."""
        folded = step_state(trainer).folded_flag
        extra = folded.flag(trainer) if folded is not None else None
        if extra is None:
            return decision.item()
        both = torch.stack(
            [decision.detach().float().reshape(()), extra.detach().float().reshape(()).to(decision.device)]
        )
        value, folded.value = both.tolist()  # host sync: the same one read, now carrying both flags
        return value

    def _bad_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, rows: list[dict[str, float]]) -> None:
        """Skip a step some rank found bad; on the first ``max_reports`` replay, report and decide (every rank)."""
        bad_ranks, frame_ranks = flagged_ranks(rows)
        if not bad_ranks and not frame_ranks:
            return
        if bad_ranks and self.skip_nonfinite_steps:
            for p in self._finite.params:  # only on a bad step: the optimizer skips parameters without a gradient
                p.grad = None
            self.skipped_steps += 1
            step_state(trainer).skipped_step = trainer.global_step
            self.log_scalars(trainer, {"nan_first_frame/skipped_steps": float(self.skipped_steps)})
        if len(self.reports) >= self.max_reports or (self._mode == "lazy" and not bad_ranks):
            return
        step, rank = trainer.global_step, trainer.global_rank
        step_first = None
        if self._flags is not None:
            self._flags.enabled = False  # the replay below records into its own flags
            if rows[rank]["frame"] > 0:
                step_first = self._flags.first_nonfinite()  # this step's first non-finite output (one host read)
        recorder, replay_flags, error = self._replay(trainer, pl_module)
        micro = [idx for _, idx, _ in self._micro]
        header = {
            "step": step,
            "batch_idx": micro[-1] if micro else trainer.fit_loop.epoch_loop.batch_idx,
            "micro_batches": micro,
            "rank": rank,
            "world_size": world_size(),
            "precision": str(trainer.precision),
            "mode": self._mode,
        }
        summary, lines = nan_report(
            recorder, header, rows, self.max_frames, error=error, step_first=step_first, replay_flags=replay_flags
        )
        txt_path, json_path = (
            os.path.join(self.tfdebug_dir, f"nan-step{step}-rank{rank}{ext}") for ext in (".txt", ".json")
        )
        if error is not None and self._finite.sharded and world_size() > 1:
            self._write(summary, lines, txt_path, json_path)
            self._end_after_sharded_replay_failure(trainer, step, bad_ranks, error, txt_path)
        everyone = self._share(trainer, summary)
        reading = NaNStep.of(summary, everyone, txt_path, json_path, skipped=self.skip_nonfinite_steps)
        verdict = nonfinite_step(reading)
        if verdict is None:
            # every flagged output sum was a float32 overflow of finite values: nothing to report (on every rank)
            return
        self._write(summary, lines, txt_path, json_path)
        self.emit(trainer, verdict)

    def _write(self, summary: dict[str, Any], lines: list[str], txt_path: str, json_path: str) -> None:
        # Through the pack's writer: a refused write warns once and the report still reaches the finding's evidence.
        write_text(json_path, json.dumps(summary, indent=1, default=str, allow_nan=False))
        write_text(txt_path, "\n".join(lines) + "\n")
        self.reports.append(txt_path)

    def _end_after_sharded_replay_failure(
        self, trainer: pl.Trainer, step: int, bad_ranks: list[int], error: str, txt_path: str
    ) -> None:
        """End the run on this rank: its FSDP2 replay failed part-way, so another rank may wait in a replay collective
        this rank will never join. No further collective runs: the finding is recorded here alone and the error ends
        this process; the other ranks' pending collective then fails at once and they end here too."""
        verdict = replay_failed_on_rank(step, bad_ranks, trainer.global_rank, error, txt_path)
        self.emit(trainer, verdict, synchronized=False)  # no collective: the ranks are no longer in step
        raise RuntimeError(
            f"NaNFirstFrame's replay of step {step} failed on rank {trainer.global_rank} ({error}) under a sharded "
            "(FSDP2) model: the other ranks' replay collectives can no longer be matched, so the run ends on every "
            f"rank instead of hanging. This rank's report: {txt_path}."
        )

    # ------------------------------------------------------------------ replay
    def _replay(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule
    ) -> tuple[FrameRecorder, FrameFlags | None, str | None]:
        """Re-run this step's micro-batches with the same RNG state and frame hooks (:func:`replay_frames`).

        Every rank replays every micro-batch: the model is called directly (DDP's reducer does not all-reduce the
        replay's gradients), and under FSDP2 each rank must run the same all-gathers and reduce-scatters.
        """
        scaler = grad_scaler_of(trainer)

        def run_step(batch: Any, batch_idx: int) -> Tensor | None:
            # eagerly under torch.compile: the frame hooks run, and the replay compiles nothing new
            with eager_model_calls(), torch.enable_grad(), trainer.precision_plugin.train_step_context():
                return loss_of(quiet_training_step(pl_module, batch, batch_idx))

        return replay_frames(
            pl_module,
            pl_module.device,
            self._micro,
            run_step,
            self._finite.params,
            flags=self._flags is not None,
            scale=scaler.scale if scaler is not None else None,
        )

    def _share(self, trainer: pl.Trainer, summary: dict[str, Any]) -> list[dict[str, Any]]:
        """Every rank's first forward/backward module names (and whether the replay reproduced this step's flags)."""
        # Only on a reporting step, which every rank reached from the same gathered flags: share the names
        # (a collective under several ranks).
        return [r for r in gather_records(rank_frames(trainer.global_rank, summary)) if r]

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "reports": list(self.reports), "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self.reports = list(state_dict.get("reports", []))
        self.skipped_steps = int(state_dict.get("skipped_steps", 0))
