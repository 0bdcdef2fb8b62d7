"""``TFDebug``: the whole pack as one callback, with presets, shared settings, a dashboard and an end-of-run summary."""

from __future__ import annotations

import inspect
import json
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback as LightningCallback
from lightning.pytorch.utilities import rank_zero_warn

from lightning_tfdebug.callbacks.attention_probe import AttentionProbe
from lightning_tfdebug.callbacks.batch_guard.callback import BatchGuard
from lightning_tfdebug.callbacks.checkpoint_audit.callback import CheckpointAudit
from lightning_tfdebug.callbacks.dead_activation import DeadActivation
from lightning_tfdebug.callbacks.grad_norm_monitor import GradNormMonitor
from lightning_tfdebug.callbacks.loss_at_init import LossAtInit
from lightning_tfdebug.callbacks.mask_probe.callback import MaskProbe
from lightning_tfdebug.callbacks.memory_watch import MemoryWatch
from lightning_tfdebug.callbacks.nan_first_frame import NaNFirstFrame
from lightning_tfdebug.callbacks.optimizer_audit import OptimizerAudit
from lightning_tfdebug.callbacks.per_rank_logger import PerRankLogger
from lightning_tfdebug.callbacks.repro_capture import ReproCapture
from lightning_tfdebug.callbacks.scaler_watch import ScalerWatch
from lightning_tfdebug.callbacks.spike_guard.callback import SpikeGuard
from lightning_tfdebug.callbacks.stall_watchdog import StallWatchdog
from lightning_tfdebug.callbacks.throughput_monitor import ThroughputMonitor
from lightning_tfdebug.callbacks.update_ratio import UpdateRatio
from lightning_tfdebug.core.base import DebugCallback, PackContext, TFDebugWarning, check_choice, check_number
from lightning_tfdebug.core.compat import Callback, is_lightning_instance
from lightning_tfdebug.core.guard import BATCH_HOOKS, busy_at_step
from lightning_tfdebug.core.io import write_text
from lightning_tfdebug.core.messages import pack_warning
from lightning_tfdebug.core.reduction import StepReduction
from lightning_tfdebug.core.scalars import ScalarSink
from lightning_tfdebug.dashboard import write_dashboard
from lightning_tfdebug.findings import ON_FINDING_CHOICES, Finding, OnFinding
from lightning_tfdebug.repro import run_first

Preset = Literal["always", "full"]
PRESETS: tuple[str, ...] = ("always", "full")

#: Every member, in the order the pack calls them: ReproCapture first (it must hold the batch before any other
#: callback can reject it), the batch and model checks next, the per-step monitors, then the cost and rank views.
MEMBERS: dict[str, type[DebugCallback]] = {
    cls.__name__: cls
    for cls in (
        ReproCapture,
        BatchGuard,
        MaskProbe,
        LossAtInit,
        AttentionProbe,
        NaNFirstFrame,
        GradNormMonitor,
        ScalerWatch,
        UpdateRatio,
        OptimizerAudit,
        DeadActivation,
        ThroughputMonitor,
        PerRankLogger,
        CheckpointAudit,
        MemoryWatch,
        StallWatchdog,
        SpikeGuard,  # after NaNFirstFrame, which reads its flag in the step's one host read
    )
}

#: Both presets run every member; ``full`` reads every checkpoint back and puts NaNFirstFrame in eager mode.
PRESET_MEMBERS: dict[str, tuple[str, ...]] = {preset: tuple(MEMBERS) for preset in PRESETS}
PRESET_SETTINGS: dict[str, dict[str, dict[str, Any]]] = {
    "always": {"CheckpointAudit": {"reload": False}},
    "full": {"NaNFirstFrame": {"mode": "eager"}},
}
#: What a preflight run (``tfdebug check``) changes: a run of a few dozen steps cannot show a stalled loss, and its
#: length is not the one the LR schedule was written for.
PREFLIGHT_SETTINGS: dict[str, dict[str, Any]] = {
    "LossAtInit": {"check_step": None},
    "OptimizerAudit": {"check_schedule_fits": False},
    "MemoryWatch": {"record_history": True},  # CUDA: the allocator's history, into the bundle of an OOM
}
CHECK_RESULT_ENV = "TFDEBUG_CHECK_RESULT"
#: The settings a preflight pack takes over from a pack configured in the same run (``tfdebug check`` on a config
#: that already holds a ``TFDebug``): how to read the batch, and the memory budget. Its cadence and ``on_finding``
#: stay the preflight's.
ADOPTED = ("input_key", "mask_key", "labels_key", "ignore_index", "tokenizer", "vocab_size", "memory_budget_mb")

# Hooks with their own methods below; the pack forwards every other `on_*` hook as it is.
_OWN_HOOKS = ("on_save_checkpoint", "on_load_checkpoint", "on_fit_start", "on_fit_end", "on_exception")
_FORWARDED = tuple(
    name
    for name, value in vars(LightningCallback).items()
    if callable(value) and name.startswith("on_") and name not in _OWN_HOOKS
)


#: What a collective reports when the process at the other end is gone (gloo's TCP transport, NCCL, the store).
_LOST_PEER_MESSAGES = (
    "connection reset by peer",
    "connection closed by peer",
    "broken pipe",
    "remote process exited",
    "socket timeout",
    "connection refused",
)


def lost_peer_hint(error: BaseException, world_size: int) -> str | None:
    """One sentence for a multi-process run that failed because another rank stopped answering, else None: a rank
    that died without a word shows on the others only as a low-level error from their next collective."""
    if world_size <= 1:
        return None
    text = f"{type(error).__name__}: {error}".lower()
    if type(error).__name__ != "DistBackendError" and not any(m in text for m in _LOST_PEER_MESSAGES):
        return None
    return (
        "another rank stopped answering in a collective: its process most likely died (killed by the out-of-memory "
        "killer or the scheduler, a lost node, a native crash); this rank's findings up to here are on disk. Read "
        "the other ranks' own logs for the cause."
    )


def _member_name(name: Any, what: str) -> str:
    """The canonical member name for ``name`` (class name, any case, with or without underscores)."""
    if not isinstance(name, str):
        raise TypeError(f"`{what}` must name pack members as strings; got {name!r}.")
    wanted = name.replace("_", "").lower()
    for member in MEMBERS:
        if member.lower() == wanted:
            return member
    raise ValueError(f"`{what}` names an unknown member {name!r}; the members are {', '.join(MEMBERS)}.")


def _accepts(cls: type, argument: str) -> bool:
    return argument in inspect.signature(cls.__init__).parameters


def _overridden(member: Callback, hook: str) -> bool:
    """Whether ``member`` does something in ``hook`` (the base class's guarded batch-start no-op does not)."""
    method = getattr(type(member), hook, None)
    return method is not getattr(Callback, hook) and not getattr(method, "_tfdebug_noop", False)


class TFDebug(Callback):
    """The whole pack as one callback: presets, shared settings, per-member overrides, a dashboard and a summary.

    The members are built with the pack, so a bad argument fails at once and names the member. At the end of ``fit``
    rank 0 writes ``<log_dir>/tfdebug/pack.json`` and prints the short run report.

    Args:
        preset: ``"always"`` (default): every member at the cost of a run that stays on (MaskProbe's one-time
            probes; CheckpointAudit judging each save in memory, ``reload=False``). ``"full"``: CheckpointAudit also
            reads every checkpoint back and checks resumes, NaNFirstFrame in eager mode; for a debugging or preflight
            run (``tfdebug check`` uses it).
        every_n_steps: measuring cadence of every member that has one (default: the Trainer's ``log_every_n_steps``).
        on_finding: ``"warn"`` | ``"stop"`` | ``"raise"``, for every member (see :class:`DebugCallback`).
        input_key: where the batch holds the input ids (a name, dotted path or tuple position), for every member
            that reads the batch; default: found from common names.
        mask_key: where the batch holds the attention mask, likewise.
        labels_key: where the batch holds the labels, likewise.
        ignore_index: the label value the loss ignores; default: -100, PyTorch's and Hugging Face's.
        tokenizer: a tokenizer (or its import path) for BatchGuard's decoded examples.
        vocab_size: the vocabulary size, for the members that check ids and the loss against ln V.
        memory_budget_mb: the most a member's copies of weights on a measuring step may take, in MiB, for every
            member that takes one (UpdateRatio, OptimizerAudit); default: ``max(2% of the training state, 32 MiB)``.
        include: members to run on top of the preset (names as in :data:`MEMBERS`, any case).
        exclude: members of the preset not to run.
        overrides: per-member constructor arguments, e.g. ``{"GradNormMonitor": {"explosion_factor": 20}}``; they
            win over the shared settings and the preset's.
        dashboard: write the TensorBoard custom-scalars layout (the "CUSTOM SCALARS" tab) at the start of ``fit``.
        summary: print the short run report on rank 0 at the end of ``fit`` (and after a failed one).
        preflight: a short trial run (what ``tfdebug check`` sets): checkpoint callbacks save nothing, the loss is not
            judged for a stall, and the log directory is handed to ``tfdebug check``. It runs instead of a
            ``TFDebug`` already in the config, with that pack's batch settings, ``exclude`` and overrides.

    Raises:
        ValueError: on an unknown preset, member name, or a value a member rejects (the message names the member).
        TypeError: on an argument of the wrong type, or an override a member does not take.

    A member also listed by hand in ``Trainer(callbacks=[...])`` runs as configured there, and the pack's copy stands
    aside. Of two packs in one Trainer only one runs: a preflight pack if there is one, else the first.

    Example:
        ```python
        trainer = Trainer(callbacks=[TFDebug()])  # preset="full" for a debugging or preflight run
        ```

        LightningCLI:

        ```yaml
        trainer:
          callbacks:
            - class_path: lightning_tfdebug.TFDebug
              init_args:
                preset: always
                exclude: [DeadActivation]
                overrides:
                  GradNormMonitor: {explosion_factor: 20}
        ```
    """

    def __init__(
        self,
        preset: Preset = "always",
        every_n_steps: int | None = None,
        on_finding: OnFinding = "warn",
        input_key: str | int | None = None,
        mask_key: str | int | None = None,
        labels_key: str | int | None = None,
        ignore_index: int | None = None,
        tokenizer: Any = None,
        vocab_size: int | None = None,
        memory_budget_mb: float | None = None,
        include: Sequence[str] | None = None,
        exclude: Sequence[str] | None = None,
        overrides: Mapping[str, Mapping[str, Any]] | None = None,
        dashboard: bool = True,
        summary: bool = True,
        preflight: bool = False,
    ) -> None:
        super().__init__()
        check_choice("preset", preset, PRESETS)
        check_choice("on_finding", on_finding, ON_FINDING_CHOICES)
        check_number("every_n_steps", every_n_steps, low=1, integer=True, optional=True)
        check_number("vocab_size", vocab_size, low=2, integer=True, optional=True)
        check_number("memory_budget_mb", memory_budget_mb, low=0.0, low_inclusive=False, optional=True)
        for name, flag in (("dashboard", dashboard), ("summary", summary), ("preflight", preflight)):
            if not isinstance(flag, bool):
                raise TypeError(f"`{name}` must be True or False; got {flag!r}.")
        for name, names in (("include", include), ("exclude", exclude)):
            if names is not None and (isinstance(names, str) or not isinstance(names, Sequence)):
                raise TypeError(f"`{name}` must be a list of member names; got {names!r}.")
        if overrides is not None and not isinstance(overrides, Mapping):
            raise TypeError(f"`overrides` must map member names to their arguments; got {overrides!r}.")
        self.preset = preset
        self.include = [_member_name(n, "include") for n in include or ()]
        self.exclude = [_member_name(n, "exclude") for n in exclude or ()]
        self.overrides: dict[str, dict[str, Any]] = {}
        for key, arguments in (overrides or {}).items():
            name = _member_name(key, "overrides")
            if not isinstance(arguments, Mapping):
                raise TypeError(f"`overrides[{key!r}]` must map argument names to values; got {arguments!r}.")
            self.overrides[name] = dict(arguments)
        self.dashboard = dashboard
        self.summary = summary
        self.preflight = preflight
        self.shared = {
            "every_n_steps": every_n_steps,
            "on_finding": on_finding,
            "input_key": input_key,
            "mask_key": mask_key,
            "labels_key": labels_key,
            "ignore_index": ignore_index,
            "tokenizer": tokenizer,
            "vocab_size": vocab_size,
            "memory_budget_mb": memory_budget_mb,
        }
        chosen = [n for n in MEMBERS if (n in PRESET_MEMBERS[preset] or n in self.include) and n not in self.exclude]
        unused = sorted(set(self.overrides) - set(chosen))
        if unused:
            raise ValueError(
                f"`overrides` configures {', '.join(unused)}, which the pack does not run (preset {preset!r}, "
                f"exclude {self.exclude}); add them to `include` or drop the overrides."
            )
        self._scalars = ScalarSink()  # the members' scalars of one forwarded hook call, written at its end
        self._per_step_dispatch = True  # False under manual optimization (set in setup): every hook on every batch
        self._reduction = StepReduction()  # one collective per measuring step for every member
        self.members: dict[str, DebugCallback] = {name: self._build(name) for name in chosen}
        self.idle = False  # True when another TFDebug in trainer.callbacks runs the pack
        self.by_hand: list[str] = []  # members also listed in trainer.callbacks: that copy runs, the pack's does not
        self._hooks: dict[str, tuple[Callable[..., Any], ...]] = {}
        # a preflight pack's key differs from that of a configured pack with the same members, so that `tfdebug check`
        # can add one to a config that already holds a TFDebug (Lightning refuses two callbacks with one state key)
        identity: dict[str, Any] = {"preset": preset, "members": tuple(chosen)}
        if preflight:
            identity["preflight"] = True
        self._state_key = self._generate_state_key(**identity)
        self._set_up = False  # setup ran (a failure before it means another callback or Lightning refused the run)
        self._log_dir: str | None = None
        self._summarized = False
        self._index_hooks()

    def _build(self, name: str) -> DebugCallback:
        cls = MEMBERS[name]
        kwargs = {k: v for k, v in self.shared.items() if v is not None and _accepts(cls, k)}
        kwargs.update(PRESET_SETTINGS[self.preset].get(name, {}))
        if self.preflight:
            kwargs.update(PREFLIGHT_SETTINGS.get(name, {}))
        for key, value in self.overrides.get(name, {}).items():
            if not _accepts(cls, key):
                raise TypeError(f"`overrides[{name!r}]`: {name} takes no argument {key!r}.")
            kwargs[key] = value
        try:
            member = cls(**kwargs)
        except (TypeError, ValueError) as err:
            raise type(err)(f"TFDebug member {name}: {err}") from err
        # the whole protocol between the pack and a member: the scalar sink, the reduction (set while it runs), and
        # whether its findings warn live (a preflight's are printed once, by `tfdebug check`)
        member.pack = PackContext(scalar_sink=self._scalars, live_warnings=not self.preflight)
        return member

    def _index_hooks(self) -> None:
        """For each forwarded hook, the bound methods of the members that implement it (looked up once); the running
        members declare their measuring steps' statistics into the pack's one reduction."""
        running = list(self.running.values())
        for member in self.members.values():
            assert member.pack is not None
            member.pack.reduction = self._reduction if any(member is m for m in running) else None
        self._reduction.members = running  # the order of the declarations, the same on every rank
        self._hooks = {
            hook: tuple(getattr(m, hook) for m in running if _overridden(m, hook)) for hook in _FORWARDED + _OWN_HOOKS
        }
        self._hooks["setup"] = tuple(m.setup for m in running)
        self._hooks["teardown"] = tuple(m.teardown for m in running)
        self._running_list = running
        self._tables: dict[tuple[bool, ...], dict[str, tuple[Callable[..., Any], ...]]] = {}
        self._batch_table: dict[str, tuple[Callable[..., Any], ...]] | None = None

    def _table_at(self, step: int) -> dict[str, tuple[Callable[..., Any], ...]]:
        """The batch hooks to call on the batches that train optimizer step ``step``: per member, all of them where it
        is busy at that step (:meth:`DebugCallback.busy_at`), else only its :attr:`~DebugCallback.every_batch_hooks`.
        One tuple of booleans per batch (host arithmetic); the tables for each pattern are built once."""
        running = self._running_list
        if self._per_step_dispatch:
            busy = tuple(m.failure is None and busy_at_step(m, step) for m in running)
        else:
            busy = tuple(True for _ in running)
        table = self._tables.get(busy)
        if table is None:
            table = {
                hook: tuple(
                    getattr(m, hook)
                    for m, b in zip(running, busy)
                    if _overridden(m, hook) and (b or hook in m.every_batch_hooks)
                )
                for hook in BATCH_HOOKS
            }
            self._tables[busy] = table
        return table

    # ------------------------------------------------------------------ identity and state
    @property
    def state_key(self) -> str:
        return self._state_key  # computed once: Lightning reads it around every hook call when profiling

    @property
    def running(self) -> dict[str, DebugCallback]:
        """The members that run: none when another TFDebug runs the pack, and none listed by hand as well."""
        if self.idle:
            return {}
        return {n: m for n, m in self.members.items() if n not in self.by_hand}

    @property
    def findings(self) -> list[Finding]:
        """Every finding of every member, in the order each member found them."""
        return [f for m in self.members.values() for f in m.findings]

    def state_dict(self) -> dict[str, Any]:
        return {"members": {name: m.state_dict() for name, m in self.members.items()}}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        for name, state in state_dict.get("members", {}).items():
            if name in self.members:
                self.members[name].load_state_dict(state)

    def on_save_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        for hook in self._hooks["on_save_checkpoint"]:
            hook(trainer, pl_module, checkpoint)
        # Lightning took `state_dict()` before this hook; members may have added to theirs in it (CheckpointAudit's
        # save-time probe loss), so take it again.
        callbacks = checkpoint.get("callbacks")
        if isinstance(callbacks, dict) and self.state_key in callbacks:
            callbacks[self.state_key] = self.state_dict()

    def on_load_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        for hook in self._hooks["on_load_checkpoint"]:
            hook(trainer, pl_module, checkpoint)

    # ------------------------------------------------------------------ lifecycle
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        packs = [cb for cb in trainer.callbacks if isinstance(cb, TFDebug)]
        leader = next((p for p in packs if p.preflight), packs[0]) if packs else self  # a preflight pack wins
        self.idle = self is not leader
        self.by_hand = []
        self._set_up = True
        if self.idle and leader.preflight and not self.preflight:
            if trainer.is_global_zero:
                pack_warning(
                    "the preflight pack (tfdebug check) runs instead of the configured "
                    f"TFDebug(preset={self.preset!r}), with its batch settings, exclude and overrides; the configured "
                    "pack stands aside for this run.",
                    TFDebugWarning,
                )
        elif self.idle:
            rank_zero_warn(
                "TFDebug is listed more than once in trainer.callbacks; only one runs"
                + (" (the preflight one)." if leader.preflight else " (the first)."),
                category=TFDebugWarning,
            )
        else:
            if self.preflight:
                self._take_over([p for p in packs if p is not self and not p.preflight])
            others = [cb for cb in trainer.callbacks if not isinstance(cb, TFDebug)]
            self.by_hand = [n for n, m in self.members.items() if any(isinstance(cb, type(m)) for cb in others)]
            if self.by_hand:
                rank_zero_warn(
                    f"TFDebug: {', '.join(self.by_hand)} also listed in trainer.callbacks; the pack's own copy stands "
                    "aside so nothing runs twice, and the one you configured runs.",
                    category=TFDebugWarning,
                )
        self._index_hooks()
        # manual optimization may step the optimizer several times in one batch (global_step moves inside it), so a
        # decision taken at the batch's start cannot say which steps it trains: every hook runs on every batch
        self._per_step_dispatch = bool(getattr(pl_module, "automatic_optimization", True))
        if "ReproCapture" in self.running and stage == "fit":
            run_first(trainer, self)
        self._log_dir = trainer.log_dir or trainer.default_root_dir
        self._summarized = False
        if self.preflight and not self.idle and stage == "fit":
            self._start_preflight(trainer)
        for hook in self._hooks["setup"]:
            hook(trainer, pl_module, stage)

    def _take_over(self, configured: Sequence[TFDebug]) -> None:
        """A preflight pack in a Trainer whose config already holds a pack: take that pack's batch settings
        (:data:`ADOPTED`), exclusions and overrides, so the preflight reads the batch as the real run will. The
        preflight's own settings, cadence and ``on_finding`` win."""
        changed = False
        for pack in configured:
            for key in ADOPTED:
                if self.shared[key] is None and pack.shared[key] is not None:
                    self.shared[key] = pack.shared[key]
                    changed = True
            for name in pack.exclude:
                if name in self.members and name not in self.include:
                    del self.members[name]
                    self.exclude.append(name)
            for name, args in pack.overrides.items():
                fixed = set(PREFLIGHT_SETTINGS.get(name, {})) | {"every_n_steps", "on_finding"}
                mine = self.overrides.setdefault(name, {})
                for key, value in args.items():
                    if key not in fixed and key not in mine:
                        mine[key] = value
                        changed = True
        if changed:  # the members are rebuilt before any of them set up; the configured pack checked these values
            self.members = {name: self._build(name) for name in self.members}

    def _start_preflight(self, trainer: pl.Trainer) -> None:
        quiet = []
        for cb in trainer.callbacks:
            if hasattr(cb, "save_top_k") and hasattr(cb, "save_last"):  # ModelCheckpoint, of either Lightning package
                cb.save_top_k, cb.save_last = 0, False  # a trial run must not replace the user's checkpoints
                quiet.append(type(cb).__name__)
        _tell_check(trainer, log_dir=self._log_dir, checkpoint_callbacks_silenced=quiet)

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        for hook in self._hooks["on_fit_start"]:
            hook(trainer, pl_module)
        if self.dashboard and not self.idle and trainer.is_global_zero:
            write_dashboard(trainer, pl_module, self.running)

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        for hook in self._hooks["on_fit_end"]:
            hook(trainer, pl_module)
        # one collective, at the end of fit: every rank's findings are on disk before rank 0 reads them
        trainer.strategy.barrier("tfdebug_summary")
        self._finish(trainer)

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        if not self._set_up:
            # fit failed before the pack was set up: no member started. A preflight tells `tfdebug check` who refused.
            if self.preflight:
                self._refused(trainer, exception)
            return
        for hook in self._hooks["on_exception"]:
            hook(trainer, pl_module, exception)
        self._finish(trainer, failed=exception)  # no barrier: the other ranks may be gone

    def _refused(self, trainer: pl.Trainer, exception: BaseException) -> None:
        error = f"{type(exception).__name__}: {exception}".strip()
        _tell_check(trainer, log_dir=None, refused_by=_raising_callback(exception, trainer), error=error)

    def _finish(self, trainer: pl.Trainer, failed: BaseException | None = None) -> None:
        if self._summarized or self.idle or not trainer.is_global_zero:
            return
        self._summarized = True
        tfdebug_dir = os.path.join(self._log_dir or ".", "tfdebug")
        info = {
            "preset": self.preset,
            "members": list(self.members),
            "running": list(self.running),
            "by_hand": self.by_hand,
            # rank 0's members that did not run (every rank's also record themselves in stood-aside-rank<r>.jsonl)
            "stood_aside": {
                n: {"reason": aside["reason"], "setting": aside["setting"]}
                for n, m in self.running.items()
                if (aside := m.stood_aside) is not None
            },
            "settings": {
                k: v if isinstance(v, (int, float, str, bool, type(None))) else repr(v) for k, v in self.shared.items()
            },
            "step": trainer.global_step,
            "failed": None if failed is None else f"{type(failed).__name__}: {failed}",
            "failed_because": None if failed is None else lost_peer_hint(failed, trainer.world_size),
        }
        # through the one writer: a refused write warns once and the summary below still prints
        write_text(os.path.join(tfdebug_dir, "pack.json"), json.dumps(info, indent=2, default=str))
        from lightning_tfdebug.report import Run, load_run, log_headlines, render_short

        try:
            run = load_run(self._log_dir or ".")
        except (OSError, ValueError):  # the files were refused (warned once): summarize what rank 0 holds in memory
            run = Run(self._log_dir or ".", tfdebug_dir, self.findings, info)
        log_headlines(trainer, run)  # TensorBoard's text tab: every headline on one card
        if not self.summary or self.preflight:  # `tfdebug check` prints the report of a preflight itself
            return
        print("\n" + render_short(run), flush=True)

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._reduction.clear()
        self._scalars.clear()
        for hook in self._hooks["teardown"]:
            hook(trainer, pl_module, stage)


def _tell_check(trainer: pl.Trainer, **result: Any) -> None:
    """Rank 0 of a preflight run: write ``result`` to the file ``tfdebug check`` reads (named in its environment)."""
    path = os.environ.get(CHECK_RESULT_ENV)
    if path and trainer.is_global_zero:
        write_text(path, json.dumps(result))


def _raising_callback(exception: BaseException, trainer: pl.Trainer) -> str | None:
    """The class name of the innermost callback (not a pack or its member) whose method raised ``exception``."""
    ours = {id(cb) for cb in trainer.callbacks if isinstance(cb, TFDebug)}
    ours |= {id(m) for cb in trainer.callbacks if isinstance(cb, TFDebug) for m in cb.members.values()}
    found = None
    tb = exception.__traceback__
    while tb is not None:
        owner = tb.tb_frame.f_locals.get("self")
        if owner is not None and id(owner) not in ours and is_lightning_instance(owner, "Callback"):
            found = type(owner).__name__
        tb = tb.tb_next
    return found


def _make_forwarder(hook: str) -> Callable[..., None]:
    per_batch = hook in BATCH_HOOKS

    def forward(self: TFDebug, *args: Any, **kwargs: Any) -> None:
        if hook == "on_train_batch_start":
            self._reduction.step_at_start = args[0].global_step
            self._batch_table = self._table_at(args[0].global_step)
        table = self._batch_table if per_batch else None
        sink = self._scalars
        sink.depth += 1  # the members' scalars wait for the end of this call: one write per logger and step
        try:
            for method in table[hook] if table is not None else self._hooks[hook]:
                method(*args, **kwargs)
            if hook == "on_train_batch_end":
                self._batch_table = None
            if self._reduction.pending or (hook == "on_train_batch_end" and self._reduction.stand_in_due):
                # members declared statistics in this hook (a measuring step): one collective; at a batch's end also
                # the stand-in of a member that failed on this rank, on the steps it would have declared
                self._reduction.run(args[0], hook)
        finally:
            sink.depth -= 1
            if not sink.depth and sink.pending:
                sink.flush(args[0])

    forward.__name__ = hook
    forward.__doc__ = f"Calls ``{hook}`` on every running member that implements it."
    return forward


for _hook in _FORWARDED:
    setattr(TFDebug, _hook, _make_forwarder(_hook))
