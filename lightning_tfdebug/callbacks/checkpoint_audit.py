"""CheckpointAudit: does a saved checkpoint hold everything a resume needs, and does a resume restore it?"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_warn
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor

from lightning_tfdebug.core.base import DebugCallback, TFDebugWarning, check_number
from lightning_tfdebug.core.batch import loss_of
from lightning_tfdebug.core.model import grad_scaler_of, quiet_training_step
from lightning_tfdebug.findings import OnFinding, Severity
from lightning_tfdebug.functional.probes import relative_difference

Problem = tuple[str, Severity, str, dict[str, Any], str]


def _max_step(state: Mapping[Any, Any]) -> float | None:
    """Largest ``step`` count over an optimizer's per-parameter states (host floats; resume / save time only)."""
    steps = []
    for entry in state.values():
        if isinstance(entry, Mapping) and "step" in entry:
            step = entry["step"]
            steps.append(float(step.item() if isinstance(step, Tensor) else step))  # host sync: save/resume only
    return max(steps) if steps else None


def expectation(trainer: pl.Trainer, pl_module: pl.LightningModule, callback_keys: list[str]) -> dict[str, Any]:
    """What a full checkpoint of this Trainer must hold, from the live objects (taken at save time)."""
    optimizers = []
    for optimizer in trainer.optimizers:
        with_state = [s for s in optimizer.state.values() if isinstance(s, Mapping) and s]
        optimizers.append(
            {
                "groups": len(optimizer.param_groups),
                "with_state": len(with_state),
                "has_step": any("step" in s for s in with_state),
            }
        )
    plugin = trainer.precision_plugin
    return {
        "global_step": trainer.global_step,
        "params": {k: list(v.shape) for k, v in pl_module.state_dict().items() if isinstance(v, Tensor)},
        "optimizers": optimizers,
        "schedulers": len(trainer.lr_scheduler_configs),
        "scaler_key": type(plugin).__qualname__ if grad_scaler_of(trainer) is not None else None,
        "callbacks": list(callback_keys),
    }


def content_problems(checkpoint: Mapping[str, Any], expected: Mapping[str, Any]) -> list[Problem]:
    """Compare a loaded checkpoint with what it must hold. Returns ``(code, severity, message, evidence, hint)``."""
    problems: list[Problem] = []
    saved = checkpoint.get("state_dict")
    params: Mapping[str, list[int]] = expected.get("params", {})
    if not isinstance(saved, Mapping):
        problems.append(("TFD701", "error", "The checkpoint holds no `state_dict` (model weights).", {}, _HINT_WEIGHTS))
    else:
        missing = [k for k in params if k not in saved]
        wrong = [
            f"{k} {list(saved[k].shape)} != {params[k]}"
            for k in params
            if k in saved and isinstance(saved[k], Tensor) and list(saved[k].shape) != params[k]
        ]
        if missing:
            problems.append(
                (
                    "TFD701",
                    "error",
                    f"The checkpoint lacks weights for {len(missing)} of the model's {len(params)} tensors: "
                    f"{', '.join(missing[:8])}{' ...' if len(missing) > 8 else ''}.",
                    {"missing": missing[:50], "count": len(missing)},
                    _HINT_WEIGHTS,
                )
            )
        if wrong:
            problems.append(
                (
                    "TFD702",
                    "error",
                    f"{len(wrong)} saved tensors have the wrong shape: {'; '.join(wrong[:5])}.",
                    {"mismatches": wrong[:50]},
                    "Save the full (gathered) tensors, or check the model was not rebuilt between save and load.",
                )
            )
    n_opt = len(expected.get("optimizers", []))
    states = checkpoint.get("optimizer_states")
    if n_opt and (not isinstance(states, list) or len(states) < n_opt):
        have = len(states) if isinstance(states, list) else 0
        problems.append(
            (
                "TFD703",
                "error",
                f"The checkpoint holds optimizer state for {have} of {n_opt} optimizers: a resume restarts Adam's "
                "moments and step counts from zero.",
                {"saved": have, "expected": n_opt},
                _HINT_STATE,
            )
        )
    elif n_opt:
        for i, (exp, state) in enumerate(zip(expected["optimizers"], states)):
            groups = len(state.get("param_groups", [])) if isinstance(state, Mapping) else 0
            per_param = state.get("state", {}) if isinstance(state, Mapping) else {}
            saved_with_state = sum(1 for s in per_param.values() if isinstance(s, Mapping) and s)
            no_step = exp["has_step"] and _max_step(per_param) is None
            if groups != exp["groups"] or saved_with_state < exp["with_state"] or no_step:
                problems.append(
                    (
                        "TFD704",
                        "error",
                        f"Optimizer {i}'s saved state is incomplete: {groups} of {exp['groups']} param groups, "
                        f"state for {saved_with_state} of {exp['with_state']} parameters"
                        f"{', no step counts' if no_step else ''}.",
                        {"optimizer": i, "groups": groups, "params_with_state": saved_with_state},
                        _HINT_STATE,
                    )
                )
    n_sched = int(expected.get("schedulers", 0))
    scheds = checkpoint.get("lr_schedulers")
    if n_sched and (not isinstance(scheds, list) or len(scheds) < n_sched):
        have = len(scheds) if isinstance(scheds, list) else 0
        problems.append(
            (
                "TFD705",
                "error",
                f"The checkpoint holds LR scheduler state for {have} of {n_sched} schedulers: a resume restarts the "
                "schedule (warm-up again from its first step).",
                {"saved": have, "expected": n_sched},
                _HINT_STATE,
            )
        )
    scaler_key = expected.get("scaler_key")
    if scaler_key and not (isinstance(checkpoint.get(scaler_key), Mapping) and "scale" in checkpoint[scaler_key]):
        problems.append(
            (
                "TFD706",
                "error",
                f"The checkpoint lacks the fp16 GradScaler state (key `{scaler_key}`): a resume restarts the loss "
                "scale at its initial value and skips steps while it backs off again.",
                {"key": scaler_key},
                _HINT_STATE,
            )
        )
    loops = checkpoint.get("loops")
    missing_progress = [k for k in ("global_step", "epoch") if k not in checkpoint]
    if not (isinstance(loops, Mapping) and "fit_loop" in loops):
        missing_progress.append("loops.fit_loop")
    if missing_progress:
        problems.append(
            (
                "TFD707",
                "error",
                f"The checkpoint lacks loop progress ({', '.join(missing_progress)}): "
                "a resume restarts the epoch and step counters and the data order.",
                {"missing": missing_progress},
                _HINT_STATE,
            )
        )
    elif "global_step" in expected and checkpoint.get("global_step") != expected["global_step"]:
        problems.append(
            (
                "TFD707",
                "error",
                f"The checkpoint's global_step is {checkpoint.get('global_step')} but it was saved at step "
                f"{expected['global_step']}.",
                {"saved": checkpoint.get("global_step"), "expected": expected["global_step"]},
                _HINT_STATE,
            )
        )
    saved_callbacks = checkpoint.get("callbacks")
    want = expected.get("callbacks", [])
    lost = [k for k in want if not isinstance(saved_callbacks, Mapping) or k not in saved_callbacks]
    if lost:
        problems.append(
            (
                "TFD708",
                "warning",
                f"The checkpoint lacks the state of {len(lost)} callbacks: {', '.join(lost[:5])}.",
                {"missing": lost},
                "Something removed `checkpoint['callbacks']` entries (an `on_save_checkpoint` override?); early "
                "stopping, checkpointing and the pack's callbacks lose their history on resume.",
            )
        )
    return problems


_HINT_WEIGHTS = "Save with `trainer.save_checkpoint` / ModelCheckpoint; check `on_save_checkpoint` overrides."
_HINT_STATE = (
    "Something drops it from the checkpoint: `save_weights_only=True`, or an `on_save_checkpoint` override that pops "
    "`optimizer_states` / `lr_schedulers`. Resume needs them for the same training run."
)


class CheckpointAudit(DebugCallback):
    r"""Verifies each checkpoint file after it is written, and verifies each resume against the checkpoint.

    **After each save.** At ``on_save_checkpoint`` the callback notes what the file must hold, taken from the live
    objects: weights for every tensor of the module's ``state_dict`` with their shapes, optimizer state for every
    param group (with per-parameter state and step counts), every LR scheduler's state, the fp16 GradScaler's state
    under the precision plugin's key, loop progress (``loops``, ``global_step``, ``epoch``), and every callback's
    state. The callback wraps the strategy's ``CheckpointIO.save_checkpoint``, so right after the file is written
    (rank 0) it opens the file and compares (``TFD701`` to ``TFD708``). An asynchronous writer's file is checked at the
    next batch. Checkpoints written outside the ``CheckpointIO`` (distributed-checkpoint directories of FSDP /
    ``ModelParallelStrategy``) are reported as not checked (``TFD709``, info).

    **On resume.** ``on_load_checkpoint`` records what the checkpoint holds (a checksum of every floating tensor,
    optimizer step counts, LRs, the loss scale, the global step); at ``on_train_start`` the live objects must match
    (``TFD710`` to ``TFD714``). The callback also keeps a small probe batch (``probe_rows`` rows of the first training
    batch) and, at each save, the loss of ``training_step`` on it (eval mode, ``no_grad``, logging silenced); right
    after resuming the same loss must come out (``TFD715``): a module re-initialised after loading, or resumed in a
    different dtype, shows here.

    Cost: nothing on steps without a save. Each save costs one probe forward and reading the file back (rank 0);
    a resume costs one pass over the weights for checksums and one probe forward.

    Findings: ``TFD701`` weights missing, ``TFD702`` wrong shapes, ``TFD703`` optimizer state missing, ``TFD704``
    optimizer state incomplete, ``TFD705`` scheduler state missing, ``TFD706`` GradScaler state missing,
    ``TFD707`` loop progress missing, ``TFD708`` callback state missing, ``TFD709`` (info) not checked or weights-only,
    ``TFD710`` restored weights differ, ``TFD711`` optimizer step counts differ, ``TFD712`` learning rate differs,
    ``TFD713`` loss scale differs, ``TFD714`` global step differs, ``TFD715`` probe loss differs after resume.

    Logged keys: none (the audit is pass/fail; evidence goes into the findings).

    Distributed: rank 0 writes and verifies the file; its findings are rank-local and every rank resolves them
    together at the next batch end (or at the end of training). Resume checks run on every rank.

    Args:
        every_n_steps: unused by the checks (they run at saves and resumes); kept for a uniform interface.
        on_finding: ``"warn"``, ``"stop"`` or ``"raise"``.
        probe_rows: rows of the first training batch kept as the probe batch (stored in the callback's state).
        loss_rtol: relative tolerance between the probe loss at save time and after resume.
        weight_rtol: relative tolerance of the weight checksums after resume.

    Raises:
        ValueError: on an argument outside its allowed range.

    Example:
        ```python
        trainer = Trainer(callbacks=[ModelCheckpoint(every_n_train_steps=500), CheckpointAudit()])
        ```

        LightningCLI:

        ```yaml
        trainer:
          callbacks:
            - class_path: lightning_tfdebug.CheckpointAudit
              init_args:
                probe_rows: 2
        ```
    """

    def __init__(
        self,
        every_n_steps: int | None = None,
        on_finding: OnFinding = "warn",
        probe_rows: int = 2,
        loss_rtol: float = 1e-3,
        weight_rtol: float = 1e-5,
    ) -> None:
        super().__init__(every_n_steps=every_n_steps, on_finding=on_finding)
        check_number("probe_rows", probe_rows, low=1, integer=True)
        check_number("loss_rtol", loss_rtol, low=0.0, low_inclusive=False, high=1.0)
        check_number("weight_rtol", weight_rtol, low=0.0, low_inclusive=False, high=1.0)
        self.probe_rows = probe_rows
        self.loss_rtol = float(loss_rtol)
        self.weight_rtol = float(weight_rtol)
        self._probe_batch: Any = None
        self._probe_loss: float | None = None
        self._probe_loss_step: int | None = None
        self._expected: dict[str, Any] | None = None
        self._pending_files: list[tuple[str, dict[str, Any]]] = []
        self._resolve_due = False
        self._verified_since_save = True
        self._io: Any = None
        self._restored: dict[str, Any] | None = None
        self.checked_files: list[str] = []

    @property
    def state_key(self) -> str:
        return self._generate_state_key(probe_rows=self.probe_rows)

    # ------------------------------------------------------------------ set-up
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        if stage == "fit":
            self._wrap_io(trainer)

    def _wrap_io(self, trainer: pl.Trainer) -> None:
        io = trainer.strategy.checkpoint_io
        if "save_checkpoint" in io.__dict__ and getattr(io.__dict__["save_checkpoint"], "_tfdebug", False):
            return
        original = io.save_checkpoint

        def save_checkpoint(checkpoint: dict[str, Any], path: Any, *args: Any, **kwargs: Any) -> Any:
            result = original(checkpoint, path, *args, **kwargs)
            expected = self._expected if self._expected is not None else {}
            self._expected = None
            self._pending_files.append((os.fspath(path), expected))
            self._verify_pending(trainer)
            return result

        save_checkpoint._tfdebug = True  # type: ignore[attr-defined]
        io.save_checkpoint = save_checkpoint
        self._io = io

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self._io is not None:
            self._io.__dict__.pop("save_checkpoint", None)
            self._io = None

    # ------------------------------------------------------------------ probe batch and loss
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self._probe_batch is None and self.active:
            self._probe_batch = self._slice(batch)

    def _slice(self, batch: Any) -> Any:
        sizes = []
        apply_to_collection(batch, Tensor, lambda t: sizes.append(t.shape[0]) if t.ndim else None)
        if not sizes:
            return None
        rows = sizes[0]
        n = self.probe_rows

        def cut(t: Tensor) -> Tensor:
            if t.ndim and t.shape[0] == rows:
                t = t[:n]
            return t.detach().to("cpu", copy=True)  # host copy: once per fit

        return apply_to_collection(batch, Tensor, cut)

    def _loss_on_probe(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> float | None:
        if self._probe_batch is None or not pl_module.automatic_optimization:
            return None
        batch = apply_to_collection(self._probe_batch, Tensor, lambda t: t.to(pl_module.device))
        modes = {m: m.training for m in pl_module.modules()}
        device = pl_module.device
        devices = [device.index or 0] if device.type == "cuda" else []
        try:
            with torch.random.fork_rng(devices=devices), torch.no_grad(), trainer.precision_plugin.train_step_context():
                pl_module.eval()
                loss = loss_of(quiet_training_step(pl_module, batch, 0))
        except Exception as err:  # a training_step that cannot be replayed on a stored batch
            rank_zero_warn(
                f"CheckpointAudit: the probe-loss check is off, `training_step` failed on the probe batch: {err}",
                category=TFDebugWarning,
            )
            self._probe_batch = None
            return None
        finally:
            for module, flag in modes.items():
                module.training = flag
        if loss is None or loss.numel() != 1:
            return None
        return float(loss.detach().float())  # host sync: at save / resume time only

    # ------------------------------------------------------------------ save
    def on_save_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        if not self.active:
            return
        callbacks = checkpoint.get("callbacks", {})
        self._expected = expectation(trainer, pl_module, list(callbacks))
        self._resolve_due = True  # every rank runs this hook for every save
        self._verified_since_save = False
        loss = self._loss_on_probe(trainer, pl_module)
        self._probe_loss, self._probe_loss_step = loss, trainer.global_step
        own = callbacks.get(self.state_key)
        if isinstance(own, dict):  # Lightning collected state_dict() before this hook: add the save-time loss
            own["probe_loss"] = loss
            own["probe_loss_step"] = trainer.global_step
            own["probe_batch"] = self._probe_batch
        strategy = type(trainer.strategy).__name__
        sharded = "ModelParallel" in strategy or getattr(trainer.strategy, "_state_dict_type", "full") == "sharded"
        if sharded and trainer.is_global_zero:
            self._verified_since_save = True
            self.emit(
                trainer,
                "TFD709",
                f"Checkpoint at step {trainer.global_step} not checked: the {strategy} strategy writes a sharded "
                "distributed-checkpoint directory, which CheckpointAudit does not open.",
                {"strategy": strategy},
                hint="Verify by resuming: the resume checks (TFD710-TFD715) still run.",
                key="sharded",
                synchronized=False,
            )

    def _verify_pending(self, trainer: pl.Trainer) -> None:
        still = []
        for path, expected in self._pending_files:
            if os.path.isdir(path):
                self._not_checked(trainer, path, "it is a directory (a distributed checkpoint)")
                continue
            if not os.path.exists(path):
                still.append((path, expected))  # an asynchronous writer has not finished yet
                continue
            try:
                loaded = _load(path)
            except Exception as err:
                self.emit(
                    trainer,
                    "TFD709",
                    f"Checkpoint {path} could not be opened for checking: {type(err).__name__}: {err}",
                    {"path": path},
                    key=path,
                    synchronized=False,
                )
                continue
            self._verified_since_save = True
            self.checked_files.append(path)
            if not expected:  # written without on_save_checkpoint: a weights-only save
                self.emit(
                    trainer,
                    "TFD709",
                    f"Checkpoint {os.path.basename(path)} is weights-only (no optimizer, scheduler or loop state), so "
                    "only its existence was checked; it serves inference or fine-tuning, not resuming this run.",
                    {"path": path},
                    hint=(
                        "Keep at least one full checkpoint (`save_weights_only=False`, e.g. `save_last=True`) to "
                        "resume."
                    ),
                    key="weights_only",
                    synchronized=False,
                )
                continue
            for code, severity, message, evidence, hint in content_problems(loaded, expected):
                self.emit(
                    trainer,
                    code,
                    f"{message} (file {os.path.basename(path)})",
                    {**evidence, "path": path},
                    severity=severity,
                    hint=hint,
                    key=code,
                    synchronized=False,
                )
        self._pending_files = still

    def _not_checked(self, trainer: pl.Trainer, path: str, why: str) -> None:
        self.emit(
            trainer,
            "TFD709",
            f"Checkpoint {path} not checked: {why}.",
            {"path": path},
            hint="Verify by resuming: the resume checks (TFD710-TFD715) still run.",
            key="not_checked",
            synchronized=False,
        )

    def _settle(self, trainer: pl.Trainer) -> None:
        """Verify files an asynchronous writer finished, then resolve rank-local findings on every rank together."""
        if self._pending_files:
            self._verify_pending(trainer)
        if not self._resolve_due:
            return
        self._resolve_due = False  # set on every rank by on_save_checkpoint, so all ranks arrive here together
        if trainer.is_global_zero and not self._verified_since_save and not self._pending_files:
            self._verified_since_save = True
            self._not_checked(
                trainer, "(last save)", "it was written without going through the strategy's CheckpointIO"
            )
        self.resolve_local_findings(trainer)

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self.active:
            self._settle(trainer)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.active:
            self._settle(trainer)

    # ------------------------------------------------------------------ resume
    def on_load_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        if not self.active:
            return
        full = "loops" in checkpoint
        if full and "optimizer_states" not in checkpoint:
            self.emit(
                trainer,
                "TFD703",
                "Resuming from a checkpoint without optimizer state: Adam's moments and step counts restart from zero.",
                {},
                hint=_HINT_STATE,
                key="resume",
            )
        if full and "lr_schedulers" not in checkpoint:
            self.emit(
                trainer,
                "TFD705",
                "Resuming from a checkpoint without LR scheduler state: the schedule restarts from its first step.",
                {},
                hint=_HINT_STATE,
                key="resume",
            )
        weights = checkpoint.get("state_dict", {})
        names = [k for k, v in weights.items() if isinstance(v, Tensor) and v.is_floating_point()]
        sums = _checksums([weights[k] for k in names])
        steps = [
            _max_step(s.get("state", {})) for s in checkpoint.get("optimizer_states", []) if isinstance(s, Mapping)
        ]
        lrs = [
            [float(g["lr"]) for g in s.get("param_groups", [])]
            for s in checkpoint.get("optimizer_states", [])
            if isinstance(s, Mapping)
        ]
        scale = None
        for value in checkpoint.values():
            if isinstance(value, Mapping) and "scale" in value and "growth_factor" in value:
                scale = float(value["scale"])
        self._restored = {
            "names": names,
            "dtypes": {k: str(weights[k].dtype) for k in names},
            "sums": sums,
            "steps": steps,
            "lrs": lrs,
            "scale": scale,
            "global_step": checkpoint.get("global_step"),
        }

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        restored, self._restored = self._restored, None
        if not self.active or restored is None:
            return
        problems = self._resume_problems(trainer, pl_module, restored)
        for code, message, evidence, hint in problems:
            self.emit(
                trainer,
                code,
                message,
                evidence,
                severity="error",
                hint=hint,
                key="resume",
                synchronized=False,
            )
        self.resolve_local_findings(trainer)  # every rank resumes, so every rank reaches this point

    def _resume_problems(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, restored: dict[str, Any]
    ) -> list[tuple[str, str, dict[str, Any], str]]:
        out: list[tuple[str, str, dict[str, Any], str]] = []
        live = pl_module.state_dict()
        names = [n for n in restored["names"] if n in live]
        dtype_changed = [n for n in names if str(live[n].dtype) != restored["dtypes"][n]]
        now = _checksums([live[n] for n in names])
        differ = [
            n
            for n, a, b in zip(names, restored["sums"], now)
            if any(abs(x - y) > self.weight_rtol * max(1.0, abs(x)) for x, y in zip(a, b))
        ]
        if differ or dtype_changed:
            detail = f"{len(differ)} tensors differ from the checkpoint ({', '.join(differ[:5])})" if differ else ""
            if dtype_changed:
                first = dtype_changed[0]
                detail += (", " if detail else "") + (
                    f"{len(dtype_changed)} changed dtype ({first}: {restored['dtypes'][first]} -> {live[first].dtype})"
                )
            out.append(
                (
                    "TFD710",
                    f"The weights at the start of the resumed training do not match the checkpoint: {detail}.",
                    {"differ": differ[:50], "dtype_changed": dtype_changed[:50]},
                    "Something re-initialises or converts the module after the checkpoint is loaded (`on_fit_start`, "
                    "`setup`, a precision change); load weights before building anything that overwrites them.",
                )
            )
        live_steps = [_max_step(opt.state) for opt in trainer.optimizers]
        for i, (saved, now_step) in enumerate(zip(restored["steps"], live_steps)):
            if saved is not None and now_step != saved:
                out.append(
                    (
                        "TFD711",
                        f"Optimizer {i}'s step count after resume is {now_step}, the checkpoint holds {saved}.",
                        {"optimizer": i, "saved": saved, "now": now_step},
                        "The optimizer was rebuilt or its state reset after loading; bias correction restarts.",
                    )
                )
        for i, (saved_lrs, opt) in enumerate(zip(restored["lrs"], trainer.optimizers)):
            now_lrs = [float(g["lr"]) for g in opt.param_groups]
            if len(saved_lrs) == len(now_lrs) and any(
                relative_difference(a, b) > 1e-9 for a, b in zip(saved_lrs, now_lrs)
            ):
                out.append(
                    (
                        "TFD712",
                        f"Optimizer {i}'s learning rates after resume are {now_lrs}, the checkpoint holds {saved_lrs}.",
                        {"optimizer": i, "saved": saved_lrs, "now": now_lrs},
                        "The scheduler or the param groups were rebuilt after loading, or the LR is set in code that "
                        "runs after the restore.",
                    )
                )
        scaler = grad_scaler_of(trainer)
        if restored["scale"] is not None and scaler is not None:
            now_scale = float(scaler.get_scale())  # host sync: resume time only
            if relative_difference(now_scale, restored["scale"]) > 1e-9:
                out.append(
                    (
                        "TFD713",
                        f"The GradScaler's scale after resume is {now_scale:g}, the checkpoint holds "
                        f"{restored['scale']:g}.",
                        {"saved": restored["scale"], "now": now_scale},
                        "The precision plugin's scaler was replaced after loading.",
                    )
                )
        saved_step = restored["global_step"]
        if isinstance(saved_step, int) and trainer.global_step != saved_step:
            out.append(
                (
                    "TFD714",
                    f"The global step after resume is {trainer.global_step}, the checkpoint was saved at {saved_step}.",
                    {"saved": saved_step, "now": trainer.global_step},
                    "The loop state was not restored: the checkpoint has no `loops` entry, or something removed it "
                    "before Lightning restored it (an `on_load_checkpoint` that drops it). Resume from a full "
                    "checkpoint.",
                )
            )
        if self._probe_loss is not None:
            now_loss = self._loss_on_probe(trainer, pl_module)
            if now_loss is not None and relative_difference(now_loss, self._probe_loss) > self.loss_rtol:
                out.append(
                    (
                        "TFD715",
                        f"The loss on the probe batch right after resuming is {now_loss:.6g}; at save time (step "
                        f"{self._probe_loss_step}) it was {self._probe_loss:.6g}.",
                        {"saved": self._probe_loss, "now": now_loss, "saved_step": self._probe_loss_step},
                        "The model that trains is not the model that was saved: re-initialised after loading, a "
                        "different dtype or precision, or a changed architecture.",
                    )
                )
        return out

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        return {
            **super().state_dict(),
            "probe_batch": self._probe_batch,
            "probe_loss": self._probe_loss,
            "probe_loss_step": self._probe_loss_step,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self._probe_batch = state_dict.get("probe_batch")
        self._probe_loss = state_dict.get("probe_loss")
        self._probe_loss_step = state_dict.get("probe_loss_step")


def _load(path: str) -> Any:
    """The checkpoint file as a resume reads it. Memory-mapped where the format allows, so that checking shapes and
    keys does not read every tensor of a large file into memory."""
    try:
        return torch.load(path, map_location="cpu", weights_only=False, mmap=True)
    except RuntimeError:  # legacy (non-zip) serialization cannot be memory-mapped
        return torch.load(path, map_location="cpu", weights_only=False)


def _checksums(tensors: list[Tensor]) -> list[tuple[float, float]]:
    """(sum, sum of squares) of every tensor in float64, moved to the host in one transfer."""
    if not tensors:
        return []
    with torch.no_grad():
        device = tensors[0].device
        stats = torch.stack(
            [torch.stack([t.detach().double().sum(), t.detach().double().square().sum()]).to(device) for t in tensors]
        )
    return [tuple(row) for row in stats.tolist()]  # host sync: one per resume
