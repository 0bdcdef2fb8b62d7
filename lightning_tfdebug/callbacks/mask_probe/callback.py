"""MaskProbe: tests what the model does with masks, positions and targets, on a real batch, in seconds."""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any, ClassVar, Literal

import lightning.pytorch as pl
import torch
from torch import Tensor

from lightning_tfdebug.callbacks.mask_probe import (
    alignment_checks,
    call_probes,
    capture,
    decisions,
    leak_checks,
    order_any,
    probes,
)
from lightning_tfdebug.callbacks.mask_probe.readings import ALIGNMENT_RETRY_STEPS, ORDER_STEPS, SECONDS
from lightning_tfdebug.callbacks.mask_probe.readings import KEYS as PROBE_KEYS
from lightning_tfdebug.core.base import DebugCallback, check_choice, check_number, eager_model_calls
from lightning_tfdebug.core.batch import step_batch
from lightning_tfdebug.core.calls import StepRecording, record_step
from lightning_tfdebug.core.data import special_token_sources
from lightning_tfdebug.core.logits import training_loss
from lightning_tfdebug.core.model import find_context_length
from lightning_tfdebug.findings import Finding, OnFinding
from lightning_tfdebug.primitives import call_finder, calls
from lightning_tfdebug.primitives.batch import IGNORE_INDEX, BatchKeys
from lightning_tfdebug.primitives.keys import Key


class MaskProbe(DebugCallback):
    r"""Tests the model's behaviour on a real batch: causality, padding, samples, positions, target alignment.

    At the first training batch of a fit (and every ``every_n_steps`` steps if set), MaskProbe runs a few extra forward
    passes in eval mode under ``no_grad`` on the first ``probe_rows`` rows of the batch, through the call
    ``training_step`` makes, else ``forward`` by its signature, or ``forward_fn``. Each rank probes its own batch; under
    sharded strategies it stands aside. Probes and codes (``TFD201``-``TFD218``): ``docs/callbacks/mask_probe.md``.

    Args:
        every_n_steps: probe again whenever ``global_step % every_n_steps == 0``; ``None`` (default) probes only at
            the first batch of each fit.
        on_finding: ``"warn"``, ``"stop"`` or ``"raise"``.
        causal: ``True``: a decoder; ``False``: an encoder (no causality, no alignment); ``None``: read, else measured.
        model_kind: ``"decoder"``, ``"encoder"`` (as ``causal=False``) or ``"encoder-decoder"``; ``None``: read it.
        check_padding: run the padding checks (needs a model that takes an attention mask).
        check_targets: run the target-alignment check.
        check_positions: run the context-limit checks (once per fit).
        context_limit: the model's context length; ``None`` reads it from the module.
        kv_cache_fn: import path of ``fn(pl_module, input_ids) -> logits`` that decodes incrementally.
        forward_fn: import path of ``fn(pl_module, input_ids, attention_mask) -> logits`` (or a model output).
        input_key: where the token ids are in the batch: a key, a dotted path or a tuple position; ``None`` finds
            them. Also the forward's keyword for the ids when the forward names it.
        mask_key: where the attention mask (1 = real token) is; ``None`` finds it. Also the forward's keyword for the
            mask when the forward names it.
        labels_key: where the labels are; ``None`` finds them.
        ignore_index: label value that is not supervised; ``None``: -100.
        padding_side: ``"auto"`` (read from the batch's mask), ``"right"`` or ``"left"``.
        probe_rows: rows of the batch the probes use.
        probe_length: longest sequence the causality and padding probes use (the batch is cut to it).

    Raises:
        ValueError: on an argument outside its allowed range.

    Example:
        ```python
        trainer = Trainer(callbacks=[MaskProbe()])
        ```

        LightningCLI:

        ```yaml
        trainer:
          callbacks:
            - class_path: lightning_tfdebug.MaskProbe
              init_args:
                causal: true
                probe_rows: 2
        ```
    """

    COVERAGE: ClassVar[Mapping[str, tuple[str, ...]]] = decisions.COVERAGE  # declared beside the rules

    KEYS: ClassVar[tuple[Key, ...]] = PROBE_KEYS  # declared beside the readings that log them

    def __init__(
        self,
        every_n_steps: int | None = None,
        on_finding: OnFinding = "warn",
        causal: bool | None = None,
        model_kind: Literal["decoder", "encoder", "encoder-decoder"] | None = None,
        check_padding: bool = True,
        check_targets: bool = True,
        check_positions: bool = True,
        context_limit: int | None = None,
        kv_cache_fn: str | None = None,
        forward_fn: str | None = None,
        input_key: str | int | None = None,
        mask_key: str | int | None = None,
        labels_key: str | int | None = None,
        ignore_index: int | None = None,
        padding_side: Literal["auto", "right", "left"] = "auto",
        probe_rows: int = 2,
        probe_length: int = 64,
    ) -> None:
        super().__init__(every_n_steps=every_n_steps, on_finding=on_finding)
        if causal is not None and not isinstance(causal, bool):
            raise TypeError(f"`causal` must be True, False or None (decide from the labels); got {causal!r}.")
        check_choice("model_kind", model_kind, (None, "decoder", "encoder", "encoder-decoder"))
        causal = False if causal is None and model_kind == "encoder" else causal
        flags = {"check_padding": check_padding, "check_targets": check_targets, "check_positions": check_positions}
        for name, value in flags.items():
            if not isinstance(value, bool):
                raise TypeError(f"`{name}` must be True or False; got {value!r}.")
        check_number("context_limit", context_limit, low=1, integer=True, optional=True)
        capture.check_import_paths(kv_cache_fn=kv_cache_fn, forward_fn=forward_fn)  # imported now: a typo fails here
        check_number("ignore_index", ignore_index, integer=True, optional=True)
        ignore_index = IGNORE_INDEX if ignore_index is None else ignore_index
        self._keys = BatchKeys(input_key=input_key, mask_key=mask_key, labels_key=labels_key, ignore_index=ignore_index)
        check_choice("padding_side", padding_side, ("auto", "right", "left"))
        check_number("probe_rows", probe_rows, low=1, integer=True)
        check_number("probe_length", probe_length, low=4, integer=True)
        self.causal, self.model_kind = causal, model_kind
        self.check_padding, self.check_targets = check_padding, check_targets
        self.check_positions, self.context_limit = check_positions, context_limit
        self.kv_cache_fn, self.forward_fn = kv_cache_fn, forward_fn
        self.input_key, self.mask_key, self.labels_key = input_key, mask_key, labels_key
        self.ignore_index = ignore_index
        self.padding_side, self.probe_rows, self.probe_length = padding_side, probe_rows, probe_length
        self._settings = probes.ProbeSettings(probe_rows, probe_length, check_padding, padding_side, ignore_index)
        self._recording: StepRecording | None = None  # the calls of this step's real training_step
        self._pending: tuple[Any, int, bool] | None = None  # (batch, batch_idx, full probe) once the forward is over
        self._probe_step: int | None = None  # the step being probed, while its probes emit
        self._mask_path: str | None = None  # where the mask was found in the batch (evidence of TFD204)
        self._setup_aside = False
        self.last_report: dict[str, float] = {}
        self._reset()

    def _reset(self) -> None:
        """The state of one fit: set at construction and at each fit's setup."""
        self._caller: call_probes.ModelCaller | None = None
        self._found: calls.ModelCall | None = None  # the call training_step makes, recorded at each probe
        self._returned: Tensor | None = None  # the loss training_step returned on the probed batch (the alignment's)
        self._last_probe_step: int | None = None
        self._positions_done, self._samples_done, self._special_ids = False, False, ()
        self._alignment_decided = self.causal is False or not self.check_targets
        self._order_decided, self.order_watch = not self.check_positions, order_any.OrderWatch()  # pending order checks
        self._is_causal: bool | None = self.causal  # resolved at the first probe of a fit when None

    @property
    def state_key(self) -> str:
        return self._generate_state_key(every_n_steps=self.every_n_steps, causal=self.causal)

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        self._reset()
        strategy = type(trainer.strategy).__name__
        if "FSDP" in strategy or "ModelParallel" in strategy or "DeepSpeed" in strategy:
            self._setup_aside = True  # the same on every rank
            self.stand_aside(
                f"the {strategy} strategy shards parameters, so each probe forward pass is a collective and a probe "
                "failing on one rank would hang the others. Run MaskProbe in a single-device or DDP run of the model."
            )

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # the special ids BatchGuard reads, from the same sources (the DataLoader's collator exists from here on)
        self._special_ids = probes.known_special_ids(special_token_sources(trainer, pl_module, None))
        if not self._special_ids and not self._setup_aside:
            self.check_aside(*leak_checks.NO_SPECIAL_IDS)

    # ------------------------------------------------------------------ hooks
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self._setup_aside or trainer.sanity_checking:
            return
        step = capture.order_batch_start(self, trainer, pl_module, batch)  # records an order-blind decision step
        if self._last_probe_step == step:
            return  # gradient accumulation: one probe per optimizer step
        first = self._last_probe_step is None
        periodic = self.every_n_steps is not None and step % self.every_n_steps == 0
        retry_step = self.causal is not False and self.check_targets and step in ALIGNMENT_RETRY_STEPS
        order_step = self.check_positions and step in ORDER_STEPS
        if not (first or periodic or retry_step or order_step):
            return  # a step that does not probe: no batch reading, no tensor work, no sync
        # A probing step depends on global_step and the configuration only, so every rank reaches
        # `resolve_local_findings` (a collective unless on_finding="warn") together, whatever it decided before.
        self._last_probe_step = step
        pending = (retry_step and not self._alignment_decided) or (order_step and not self._order_decided)
        if self.active and (first or periodic or pending):
            # The probes replay the model call the real training_step makes (never the step itself): record its
            # calls now, probe once its forward is over (before backward, or at the batch's end).
            self._pending = (batch, batch_idx, first or periodic)
            if self.forward_fn is None:
                self._recording = record_step(trainer, pl_module, batch, self, calls.takes_tokens)
            return
        self.resolve_local_findings(trainer)

    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: Tensor) -> None:
        if self._pending is None:
            return
        self._run_pending(trainer, pl_module, capture.returned_loss(trainer, pl_module, loss))

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._pending is not None:  # no backward ran through Lightning (a manual step without manual_backward)
            self._run_pending(trainer, pl_module, training_loss(trainer, pl_module, outputs))
        capture.order_batch_end(self, trainer, pl_module, outputs, (batch, batch_idx))  # a few fixed steps only

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        capture.order_fit_end(self, trainer)  # a fit stopped before the order decision step decides with what it read

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._drop_recording()

    def _run_pending(self, trainer: pl.Trainer, pl_module: pl.LightningModule, returned: Tensor | None) -> None:
        """The probes of this step, once its forward is over; then every rank resolves (all armed on this step)."""
        assert self._pending is not None
        (batch, batch_idx, full), self._pending = self._pending, None
        self._probe_step = self._last_probe_step  # a skipped batch's end comes after global_step moved on
        try:
            if self.active:
                self._probe(trainer, pl_module, batch, batch_idx, full, returned)
        finally:
            self._drop_recording()
            self._probe_step = None
        self.resolve_local_findings(trainer)

    def emit(self, trainer: pl.Trainer, verdicts: Any, *, synchronized: bool = True) -> list[Finding]:
        """:meth:`DebugCallback.emit`, a probe's findings dated at the step it probed."""
        return super().emit(trainer, capture.dated(verdicts, self._probe_step), synchronized=synchronized)

    def _drop_recording(self) -> None:
        if self._recording is not None:
            self._recording.done(self)
        self._recording, self._pending = None, None

    # ------------------------------------------------------------------ the probe
    def _probe(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        batch: Any,
        batch_idx: int,
        full: bool,
        returned: Tensor | None,
    ) -> None:
        start = time.perf_counter()
        self._returned = returned
        ids, mask, labels, self._mask_path = capture.token_fields(step_batch(trainer, batch, self._keys).fields)
        fields = (ids, mask, labels)
        per_sequence = None if ids is None or self.forward_fn else capture.per_sequence(self, pl_module, fields)
        if ids is None or per_sequence:  # the probes of any inputs on the recorded call; the token probes stand aside
            said = capture.probe_features(self, trainer, pl_module, self._recording, (batch, batch_idx))
            leaves = step_batch(trainer, batch, self._keys).fields.leaves
            why = per_sequence or probes.no_token_ids_reason(leaves, self.input_key)
            setting = "`input_key` (where the token ids are) or `forward_fn` (a function calling the model on ids)"
            return self._cannot_call(trainer, why + said, setting=setting)
        modes = {m: m.training for m in pl_module.modules()}
        session = None
        try:
            with (
                eager_model_calls(),  # a compiled forward runs eagerly: the probes' shapes compile nothing new
                torch.random.fork_rng(devices=[ids.device.index or 0] if ids.device.type == "cuda" else []),
                torch.no_grad(),
                trainer.precision_plugin.train_step_context(),
            ):
                pl_module.eval()
                session = self._session(trainer, pl_module, (batch, batch_idx), fields)
                if session is None:
                    return
                self._run_probes(trainer, pl_module, session, (batch, batch_idx), fields, full)
        except Exception as err:  # never crash training: say how to make the model callable and stand aside
            self.emit(trainer, session.verdicts if session is not None else None, synchronized=False)
            self._cannot_call(trainer, f"calling the model failed ({type(err).__name__}: {err}); set `forward_fn`.")
            return
        finally:
            for module, flag in modes.items():
                module.training = flag
            if self._found is not None:
                self._found.release()  # the shared reading stays; the replay's outputs do not outlive the probe
            self._found, self._returned = None, None
        assert session is not None
        session.logged[SECONDS.name] = time.perf_counter() - start
        self._conclude(trainer, session)

    def _conclude(self, trainer: pl.Trainer, session: probes.MaskProbes) -> None:
        """The probe's one host transfer, its logged scalars, and the findings of its readings."""
        self.emit(trainer, session.verdicts, synchronized=False)  # read on the host while probing, in that order
        readings = probes.on_host(session.readings, self.to_host)  # host sync: one transfer (probing steps only)
        self.last_report = {**session.logged, **{k: v for r in readings for k, v in r.logged().items()}}
        self.log_scalars(trainer, self.last_report)
        for row in decisions.rows_verified(readings):  # a finding among a row's codes makes it one in the report
            self.cover(row, "verified")
        if self._is_causal is False:
            why = "the model is bidirectional (an encoder): no future to hide, no next-token labels."
            self.cover("causal mask", "n/a", why)
            self.cover("label alignment", "n/a", why)
        verdicts, settled = decisions.decide_probe(readings)
        settled |= session.settled
        self._alignment_decided = self._alignment_decided or "alignment" in settled
        self._order_decided = self._order_decided or "order" in settled
        self.emit(trainer, verdicts, synchronized=False)  # this rank's own: resolved together at the step's end

    def _session(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, step_args: tuple[Any, int], fields: tuple
    ) -> probes.MaskProbes | None:
        """This step's probes (``forward_fn``, the recorded call, or ``forward``); None after ``TFD211``."""
        recorded = None if self.forward_fn is not None else self._record_call(trainer, pl_module, *step_args, fields)
        if self._found is None and self._caller is None:
            caller = self._build_caller(pl_module)
            if isinstance(caller, str):
                self._cannot_call(trainer, f"{recorded}; and by signature: {caller}" if recorded else caller)
                return None
            self._caller = caller
        target = self._found if self._found is not None else self._caller
        assert target is not None
        generator = torch.Generator().manual_seed(1234 + trainer.global_step)  # every rank draws the same
        session = probes.MaskProbes(
            target, fields[0], generator, self._settings, self._mask_path, attention_mask=fields[1],
            special_ids=self._special_ids, cross_sample=not self._samples_done,
        )  # fmt: skip
        if self._found is None:  # by signature: the kind from `model_kind=`, else the model's config
            session.kind = self.model_kind or call_finder.model_kind(None, model=pl_module)[0]
        if self._is_causal is None:  # once per fit
            self._is_causal, aligned = session.decide_causal(fields[0], fields[2], pl_module, self.cover)
            self._alignment_decided = self._alignment_decided or not aligned
            if session.aside is not None:  # (why, the setting that enables them): recorded once
                self.check_aside("causality and target alignment", *session.aside)
        session.causal = self._is_causal
        return session

    def _run_probes(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        session: probes.MaskProbes,
        step_args: tuple[Any, int],
        fields: tuple,
        full: bool,
    ) -> None:
        # Token rows sliced in the step or the model: the probes perturb the call's columns, alignment reads whole rows
        ids, mask = session.columns(fields[0]), session.columns(fields[1])
        assert ids is not None
        context = (self.context_limit, "`context_limit`") if self.context_limit else find_context_length(pl_module)
        limit, source = context
        if full:
            session.masks(ids, mask, limit)
            self._samples_done = True  # once per fit
            for aside in session.not_run:
                self.check_aside(*aside)
            if self.check_positions and not self._positions_done:
                self._positions_done = True
                if session.resizable:  # (kv_cache_fn is imported only where the position probes run)
                    session.positions(ids, limit, source, capture.imported(self.kv_cache_fn), pl_module)
                session.tables(pl_module, ids, mask)
        if not self._alignment_decided:
            returned, automatic = self._returned, pl_module.automatic_optimization
            output = (lambda: returned) if returned is not None or automatic else None
            session.alignment(*fields, output, automatic, trainer.global_step >= ALIGNMENT_RETRY_STEPS[-1])
        if not self._order_decided and trainer.global_step in ORDER_STEPS:
            session.order(ids, mask, trainer.global_step)

    # ------------------------------------------------------------------ batch and model access
    def _record_call(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int, fields: tuple
    ) -> str | None:
        """The model call among those the real ``training_step`` made on this batch; returns why none was found."""
        fields = (*fields[:2], capture.sequence_labels(step_batch(trainer, batch, self._keys).fields, fields[0]))
        found = capture.recorded_model_call(self._recording, fields, self.ignore_index, pl_module, self.model_kind)
        self._found = None if isinstance(found, str) else found
        return found if isinstance(found, str) else None

    def _build_caller(self, pl_module: pl.LightningModule) -> call_probes.ModelCaller | str:
        """How to call the model by its signature (or ``forward_fn``), or why it cannot be."""
        forward_fn = capture.imported(self.forward_fn)
        if isinstance(forward_fn, Exception):
            return f"`forward_fn={self.forward_fn!r}` could not be imported ({forward_fn})."
        names = [k if isinstance(k, str) and not k.isdigit() else None for k in (self.input_key, self.mask_key)]
        return call_probes.build_caller(pl_module, forward_fn, input_key=names[0], mask_key=names[1])

    def _cannot_call(self, trainer: pl.Trainer, reason: str, setting: str = "`forward_fn`") -> None:
        self.emit(trainer, alignment_checks.cannot_call(reason), synchronized=False)
        self.stand_aside(reason, setting=setting)

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        state.update(alignment_decided=self._alignment_decided, order_decided=self._order_decided)
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self._alignment_decided = bool(state_dict.get("alignment_decided", False))
        self._order_decided = bool(state_dict.get("order_decided", self._order_decided))
