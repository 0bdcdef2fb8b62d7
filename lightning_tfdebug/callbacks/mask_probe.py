"""MaskProbe: tests what the model does with masks, positions and targets, on a real batch, in seconds."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from torch import Tensor

from lightning_tfdebug.core.base import DebugCallback, check_choice, check_number, eager_model_calls
from lightning_tfdebug.core.batch import IGNORE_INDEX, BatchKeys, logits_of, loss_of, step_batch
from lightning_tfdebug.core.calls import CallRecorder, TableReads, record_calls, takes_tokens
from lightning_tfdebug.core.model import find_context_length, import_object, in_training_step, quiet_training_step
from lightning_tfdebug.findings import OnFinding
from lightning_tfdebug.functional import call_probes
from lightning_tfdebug.functional import mask_probes as probes
from lightning_tfdebug.functional.call_probes import CallPlan
from lightning_tfdebug.functional.mask_probes import ALIGNMENT_RETRY_STEPS, ORDER_STEPS, ModelCaller
from lightning_tfdebug.functional.probes import (
    alignment_losses,
    causal_valid_positions,
    labels_relation,
    logit_tolerance,
    max_change,
    replace_after,
)
from lightning_tfdebug.functional.verdicts import Verdict

PaddingSide = Literal["auto", "right", "left"]
Decision = Callable[[dict[str, float]], "Verdict | None"]
"""Turns the probe's host values into a finding (or None), after the one transfer of a probing step."""


class MaskProbe(DebugCallback):
    r"""Tests the model's behaviour on a real batch: causality, padding invariance, positions, target alignment.

    At the first training batch of a fit (and every ``every_n_steps`` steps if set), MaskProbe puts the module in
    ``eval()`` mode, runs a few extra forward passes under ``no_grad`` on the first ``probe_rows`` rows of the batch,
    and restores every submodule's mode and the RNG state afterwards. It reads behaviour, not code, so it works on
    any model it can call:

    - **Decoder or encoder** (``causal=None``, the default): read from the batch's objective at the first probe.
      Labels equal to the inputs (shifted inside the model, Hugging Face style) or to the next inputs (shifted in
      the data) at most supervised positions mean a next-token objective, so a decoder; labels that are neither
      (a masked-LM or denoising objective, as BERT's) mean an encoder, and the causality and target-alignment
      checks are skipped with one ``TFD212`` (info) saying so. Batches without token labels count as a decoder.
      ``causal=True`` / ``False`` decide it yourself.
    - **Determinism**: the same tokens are run twice; logits that differ mean something random runs in eval mode
      (``F.dropout`` without ``training=self.training``), which would also make every comparison below measure
      noise: ``TFD213`` is raised instead of them.
    - **Causality** (decoders): the tokens after the middle position are replaced; the logits at and before it
      must not move beyond a dtype-aware tolerance (relative ``1e-4`` of the largest logit in fp32, ``5e-3`` fp16,
      ``2e-2`` bf16). Catches a missing or wrong causal mask (``TFD201``).
    - **Padding mask**: a block of a quarter of the positions (after the first) is marked as padding (attention
      mask 0) and its token ids changed; the logits of the other positions must not move (``TFD202``). Then padding
      is added on the side the batch pads (``padding_side``) with random ids under it; the real tokens' logits must
      not move (``TFD203``). Batches that pad while the model is called without a mask get ``TFD204``. Both probes
      run when the forward names a mask argument or the batch carries a mask.
    - **Positions**: a sequence exactly at the context limit (``context_limit``, or read from the module's
      hyperparameters, its Hugging Face config or a position embedding) must run (``TFD207``), and ``TFD208`` states
      the limit and where it was read. No probe feeds the model anything it could fail on natively: nothing past
      that limit (nor, when no limit is known, past the batch's own length) and only token ids taken from the batch
      (past its limit a compiled kernel aborts the process and CUDA raises a device-side assert; neither can be
      caught). Under ``torch.compile`` the probes run the model eagerly, so they add no recompile.
      With ``kv_cache_fn``, the logits decoded incrementally must equal the full forward's at every position
      (``TFD209``: off-by-one cache positions, rotary offsets).
    - **Target alignment** (decoders, automatic optimization): the module's own ``training_step`` is called
      on the batch (in eval mode, under ``no_grad``, with ``self.log`` silenced) and its loss is compared with the
      cross-entropy of the same logits against the labels shifted by one, unshifted, and shifted by two. Labels
      equal to the inputs with an unshifted loss mean the model learns to copy its input (``TFD205``); labels
      already shifted in the data and shifted again by the loss, or labels equal to the inputs scored two tokens
      ahead (shifted by hand and again inside the model), mean it predicts two tokens ahead (``TFD206``). When the
      alignments give losses too close to tell apart (a freshly initialised model), the check is repeated at steps
      1, 5, 20, 50, 100, 200, 500 until it decides. A loss that matches neither (label smoothing, auxiliary losses)
      gives ``TFD210`` (info) once it has been tried on a trained-enough model.

    - **Token order** (at steps 100, 200 and 500 until decided, once the model has trained: a fresh model's nearly
      uniform attention hardly depends on order even when positions reach it): the tokens before a position are
      reversed, and separately replaced; an output that ignores the reversal but not the replacement means no
      position information reaches the attention (``TFD215``).
    - **Position tables** (once per fit, at the first probe): one forward pass of the probe rows watches every
      embedding weight and hand-held table parameter; a table of the token table's width with at least as many rows
      as the sequence must be read, and looked up with indices that vary along the sequence (``TFD216``: position
      ids all zero, or a table the forward never adds). With two causal layers the causal mask alone carries some
      order, so the token-order check cannot see these.
    - **Target leaks** (every argument of the model call that carries the labels): see below; ``TFD214`` for a
      decoder input (or any second sequence) that carries the labels its outputs are trained on, ``TFD201`` for the
      token ids themselves.

    How the model is called: through the call ``training_step`` itself makes. Each probe replays ``training_step``
    on the batch (eval mode, ``no_grad``, ``self.log`` silenced) with a forward hook on every submodule, records the
    calls that take token tensors at any depth, and keeps the outermost one that took the batch's token ids and
    returned logits (``self(x)``, ``self.model(x, y)``, ``self.model(**batch)``, ``self(src, tgt)``, or the inner
    network a loss-only wrapper calls); the probes re-issue it with every argument as recorded except the token
    tensors they perturb (:mod:`lightning_tfdebug.core.calls`, :mod:`lightning_tfdebug.functional.call_probes`).
    Token rows without labels (a batch that is one integer tensor ``(B, T+1)``, sliced by the step or the model):
    the call may receive the rows or ``rows[:, :-1]`` / ``rows[:, 1:]``; the probes perturb what it received, and
    its outputs are aligned with the rows' next tokens from the columns it received.
    Each token tensor of the call is compared with the labels: one that equals them at an offset (95% of the
    supervised positions) carries them, and output ``p`` (trained on label ``p``, or ``p + 1`` when the labels equal
    the ids) must not read it from the position carrying its own label on. A tensor unrelated to the labels (a
    translation's source) is never perturbed. Outputs may be ``(B, T, V)``, flattened ``(B*T, V)``, sequence-first
    ``(T, B, V)``, log-probabilities, alone or in a tuple, dict or model output. Under manual optimization the
    calls of the real ``training_step`` are recorded instead and probed at the batch's end. Without any recorded
    call (a ``training_step`` that raises when replayed) the model is called by signature: ``pl_module.forward`` with
    ``input_ids`` by keyword (``**kwargs`` included) or the ids as its first positional argument (the mask when the
    forward names one). ``forward_fn`` (import path of ``fn(pl_module, input_ids, attention_mask) -> logits or
    model output``) overrides both. The batch is read by the pack's shared reader
    (:mod:`lightning_tfdebug.core.batch`): dicts, Hugging Face ``BatchEncoding``, dataclasses and tuples, with the
    ids, mask and labels found by their usual names, or in tuples by position (the first 2-D integer tensor is the
    ids, the next of the same size the labels), unless ``input_key`` / ``mask_key`` / ``labels_key`` say where. When
    it cannot call the model MaskProbe says which setting would let it run (``TFD211``) and stands aside; the check
    is listed among those that did not run in the end-of-run summary and the report.

    Logged keys (on probing steps, values in the units named):

    | key | meaning |
    | --- | --- |
    | `mask_probe/repeat_max_change` | largest logit difference between two forwards of the same tokens |
    | `mask_probe/causal_max_change` | largest logit change at positions before the edited tokens |
    | `mask_probe/padding_max_change` | largest real-token logit change when masked tokens change |
    | `mask_probe/pad_side_max_change` | largest real-token logit change when padding is added on the pad side |
    | `mask_probe/kv_cache_max_change` | largest difference between incremental and full-forward logits |
    | `mask_probe/loss_returned` | the loss `training_step` returned on the batch (eval mode) |
    | `mask_probe/loss_shifted` | cross-entropy of the same logits, position t against label t+1 |
    | `mask_probe/loss_shifted2` | the same, position t against label t+2 |
    | `mask_probe/loss_unshifted` | the same, position t against label t |
    | `mask_probe/context_limit` | the context limit used for the position checks |
    | `mask_probe/order_change` | largest change of a position's output when the tokens before it are reversed |
    | `mask_probe/content_change` | largest change of that output when the tokens before it are replaced |
    | `mask_probe/seconds` | wall time of the probe |

    Findings: ``TFD201`` future tokens change past logits, ``TFD202`` masked tokens change real tokens' logits,
    ``TFD203`` logits depend on the amount of padding, ``TFD204`` padded batches but no mask reaches the model,
    ``TFD205`` unshifted labels, ``TFD206`` labels shifted twice, ``TFD207`` fails within its context limit,
    ``TFD208`` (info) the context limit and what happens past it, ``TFD209`` incremental decoding differs,
    ``TFD210`` (info) target alignment undetermined, ``TFD211`` (info) cannot call the model, ``TFD212`` (info)
    treated as an encoder because the labels are a masked-LM objective, ``TFD213`` the eval-mode forward is random,
    ``TFD214`` the model reads the labels it predicts through one of its inputs, ``TFD215`` the model ignores token
    order, ``TFD216`` a position table gets the same row at every position or is never read.

    Distributed: each rank probes its own batch with plain forward passes on the unwrapped module (no collective);
    findings are rank-local and resolved together. Under sharded strategies (FSDP, ``ModelParallelStrategy``) a
    forward pass all-gathers parameters, so a probe that fails on one rank would hang the others: MaskProbe stands
    aside there.

    Args:
        every_n_steps: probe again whenever ``global_step % every_n_steps == 0``; ``None`` (default) probes only at
            the first batch of each fit.
        on_finding: ``"warn"``, ``"stop"`` or ``"raise"``.
        causal: ``True`` for decoders; ``False`` for encoders (skips causality and target alignment); ``None``
            decides from the batch's labels (see above).
        check_padding: run the padding checks (needs a model that takes an attention mask).
        check_targets: run the target-alignment check.
        check_positions: run the context-limit checks (once per fit).
        context_limit: the model's context length; ``None`` reads it from the module.
        kv_cache_fn: import path of ``fn(pl_module, input_ids) -> logits`` that decodes incrementally with the
            model's cache.
        forward_fn: import path of ``fn(pl_module, input_ids, attention_mask) -> logits`` (or a model output).
        input_key: where the token ids are in the batch: a key, a dotted path (``"inputs.input_ids"``) or a tuple
            position; ``None`` finds them (``input_ids``, ``tokens``, ...; the first 2-D integer tensor of a tuple).
            Also the forward's keyword for the ids when the forward names it.
        mask_key: where the attention mask (1 = real token) is; ``None`` finds it (``attention_mask``,
            ``padding_mask``, ...). Also the forward's keyword for the mask when the forward names it.
        labels_key: where the labels are; ``None`` finds them (``labels``, ``targets``, ...; in a tuple the integer
            tensor after the ids).
        ignore_index: label value that is not supervised; ``None``: -100 (PyTorch's and Hugging Face's).
        padding_side: ``"auto"`` (read from the batch's mask; right when it has no padding), ``"right"`` or
            ``"left"``.
        probe_rows: rows of the batch the causality and padding probes use.
        probe_length: longest sequence those probes use (the batch is cut to it).

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

    def __init__(
        self,
        every_n_steps: int | None = None,
        on_finding: OnFinding = "warn",
        causal: bool | None = None,
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
        padding_side: PaddingSide = "auto",
        probe_rows: int = 2,
        probe_length: int = 64,
    ) -> None:
        super().__init__(every_n_steps=every_n_steps, on_finding=on_finding)
        if causal is not None and not isinstance(causal, bool):
            raise TypeError(f"`causal` must be True, False or None (decide from the labels); got {causal!r}.")
        for name, value in (
            ("check_padding", check_padding),
            ("check_targets", check_targets),
            ("check_positions", check_positions),
        ):
            if not isinstance(value, bool):
                raise TypeError(f"`{name}` must be True or False; got {value!r}.")
        check_number("context_limit", context_limit, low=1, integer=True, optional=True)
        for name, value in (("kv_cache_fn", kv_cache_fn), ("forward_fn", forward_fn)):
            if value is not None and (not isinstance(value, str) or not value.strip()):
                raise ValueError(
                    f"`{name}` must be an import path like 'package.module:function' or None; got {value!r}."
                )
        check_number("ignore_index", ignore_index, integer=True, optional=True)
        # validates the keys (a non-empty string, a tuple position or None) with a message naming the argument
        self._keys = BatchKeys(
            input_key=input_key,
            mask_key=mask_key,
            labels_key=labels_key,
            ignore_index=IGNORE_INDEX if ignore_index is None else ignore_index,
        )
        check_choice("padding_side", padding_side, ("auto", "right", "left"))
        check_number("probe_rows", probe_rows, low=1, integer=True)
        check_number("probe_length", probe_length, low=4, integer=True)
        self.causal = causal
        self.check_padding = check_padding
        self.check_targets = check_targets
        self.check_positions = check_positions
        self.context_limit = context_limit
        self.kv_cache_fn = kv_cache_fn
        self.forward_fn = forward_fn
        self.input_key = input_key
        self.mask_key = mask_key
        self.labels_key = labels_key
        self.ignore_index = self._keys.ignore_index
        self.padding_side = padding_side
        self.probe_rows = probe_rows
        self.probe_length = probe_length
        self._caller: ModelCaller | None = None
        self._plan: CallPlan | None = None  # the call training_step makes, recorded at each probe
        self._replayed: Any = None  # what the recording replay of training_step returned (the alignment's loss)
        # manual optimization: the calls of the real training_step, recorded from batch start to batch end
        self._recorder: CallRecorder | None = None
        self._manual: tuple[Any, bool] | None = None  # (recorded calls and output, full probe) for the batch end
        self._mask_path: str | None = None  # where the mask was found in the batch (evidence of TFD204)
        self._last_probe_step: int | None = None
        self._positions_done = False
        self._alignment_decided = False
        self._order_decided = not check_positions
        self._targets_wanted = causal is not False and check_targets
        self._is_causal: bool | None = causal  # resolved at the first probe of a fit when None
        self._setup_aside = False
        self.last_report: dict[str, float] = {}

    @property
    def state_key(self) -> str:
        return self._generate_state_key(every_n_steps=self.every_n_steps, causal=self.causal)

    # ------------------------------------------------------------------ set-up
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        self._last_probe_step = None
        self._positions_done = False
        self._targets_wanted = self.causal is not False and self.check_targets
        self._alignment_decided = not self._targets_wanted
        self._order_decided = not self.check_positions
        self._is_causal = self.causal
        self._caller = None
        self._plan = None
        strategy = type(trainer.strategy).__name__
        if "FSDP" in strategy or "ModelParallel" in strategy or "DeepSpeed" in strategy:
            self._setup_aside = True  # the same on every rank
            self.stand_aside(
                f"the {strategy} strategy shards parameters, so each probe forward pass is a collective and a probe "
                "failing on one rank would hang the others. Run MaskProbe in a single-device or DDP run of the model."
            )

    # ------------------------------------------------------------------ hook
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self._setup_aside or trainer.sanity_checking:
            return
        step = trainer.global_step
        if self._last_probe_step == step:
            return  # gradient accumulation: one probe per optimizer step
        first = self._last_probe_step is None
        periodic = self.every_n_steps is not None and step % self.every_n_steps == 0
        # from the configuration only, not from what this rank decided, so that every rank takes the same steps
        retry_step = self.causal is not False and self.check_targets and step in ALIGNMENT_RETRY_STEPS
        order_step = self.check_positions and step in ORDER_STEPS
        if not (first or periodic or retry_step or order_step):
            return  # a step that does not probe: no batch reading, no tensor work, no sync
        # Whether this step is a probing step depends on global_step only, so every rank gets here on the same steps
        # and reaches `resolve_local_findings` (a collective unless on_finding="warn") together, even when a rank
        # has already decided the target alignment or stood aside after a failed call.
        self._last_probe_step = step
        pending = (retry_step and not self._alignment_decided) or (order_step and not self._order_decided)
        if self.active and (first or periodic or pending):
            if not pl_module.automatic_optimization and self.forward_fn is None:
                # A manual-optimization training_step steps its optimizers: it is never replayed. Record the calls
                # the real one makes instead, and probe through them at the batch's end.
                self._recorder = CallRecorder(
                    pl_module, keep=lambda: in_training_step(pl_module), nested=True, want=takes_tokens
                ).start()
                self._manual = (None, first or periodic)
                return
            self._probe(trainer, pl_module, batch, batch_idx, full=first or periodic)
        self.resolve_local_findings(trainer)

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._recorder is None or self._manual is None:
            return
        calls = self._recorder.stop()
        full = self._manual[1]
        self._recorder, self._manual = None, (calls, outputs)
        try:
            if self.active:
                self._probe(trainer, pl_module, batch, batch_idx, full=full)
        finally:
            self._manual = None
        self.resolve_local_findings(trainer)  # every rank armed on the same step, so every rank resolves here

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        if self._recorder is not None:
            self._recorder.stop()
        self._recorder, self._manual = None, None

    # ------------------------------------------------------------------ batch and model access
    def _extract(self, trainer: pl.Trainer, batch: Any) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
        """(input_ids, attention_mask, labels) of a batch from the shared reading, each None when missing or unfit:
        the ids must be a 2-D integer tensor, the mask and the labels of the ids' shape."""
        fields = step_batch(trainer, batch, self._keys).fields
        ids, mask, labels = fields.input_ids, fields.attention_mask, fields.labels
        ids = ids if isinstance(ids, Tensor) and ids.ndim == 2 and not ids.is_floating_point() else None
        mask = mask if ids is not None and mask is not None and mask.shape == ids.shape else None
        labels = labels if ids is not None and labels is not None and labels.shape == ids.shape else None
        self._mask_path = fields.paths.get("attention_mask")
        return ids, mask, labels

    def _build_caller(self, pl_module: pl.LightningModule) -> str | None:
        """Decide how to call the model; returns a reason when it cannot."""
        forward_fn = None
        if self.forward_fn is not None:
            try:
                forward_fn = import_object(self.forward_fn)
            except (ImportError, AttributeError, ValueError) as err:
                return f"`forward_fn={self.forward_fn!r}` could not be imported ({err})."
        names = [k if isinstance(k, str) and not k.isdigit() else None for k in (self.input_key, self.mask_key)]
        caller = probes.build_caller(pl_module, forward_fn, input_key=names[0], mask_key=names[1])
        if isinstance(caller, str):
            return caller
        self._caller = caller
        return None

    def _logits(self, ids: Tensor, mask: Tensor | None) -> Tensor:
        if self._plan is not None:
            return self._plan_logits(ids, mask)
        assert self._caller is not None
        logits = logits_of(self._caller.call(ids, mask if self._caller.takes_mask else None))
        if logits is None or logits.ndim != 3 or tuple(logits.shape[:2]) != tuple(ids.shape):
            shape = None if logits is None else tuple(logits.shape)
            raise _CallError(f"the model's output is not logits of shape (batch, time, vocab) (got {shape})")
        return logits

    def _plan_logits(self, ids: Tensor, mask: Tensor | None) -> Tensor:
        """The recorded call with its token ids (and mask) replaced by ``ids`` (and ``mask``); the call's other token
        tensors of the ids' length follow (cut to the same rows and length, or extended with ids from the batch)."""
        plan = self._plan
        assert plan is not None and plan.primary is not None
        primary = plan.primary
        b, t = ids.shape
        changes: dict[Any, Tensor] = {primary.path: ids}
        if plan.mask_path is not None and mask is not None:
            changes[plan.mask_path] = plan.mask_value(mask)
        for slot in plan.slots:
            if slot.primary or slot.length != primary.length:
                continue
            companion = plan.batch_first(slot)[:b, :t].contiguous()
            if companion.shape[1] < t:
                extra = plan.random_ids((b, t - companion.shape[1]), self._generator).to(companion.dtype)
                companion = torch.cat([companion, extra], 1)
            changes[slot.path] = companion
        logits = plan.run(changes, rows=b)
        return logits

    def _record(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int, fields: tuple
    ) -> str | None:
        """Replay ``training_step`` on the batch with every module call recorded, and plan the probes on the call
        that takes the token ids; returns why not (the caller then falls back to calling ``forward`` by signature).
        Inside the probe's eval / no_grad / RNG-fork context; probing steps only."""
        self._plan, self._replayed = None, None
        ids, mask, labels = fields
        if self._manual is not None:  # recorded during the real training_step (manual optimization)
            calls, returned = self._manual
        elif not pl_module.automatic_optimization:
            return "a manual-optimization `training_step` steps its optimizers, so it is never replayed"
        else:
            try:
                returned, calls = record_calls(
                    pl_module, lambda: quiet_training_step(pl_module, batch, batch_idx), nested=True, want=takes_tokens
                )
            except Exception as err:  # a training_step that cannot be replayed (dataloader_iter, side effects)
                return f"replaying `training_step` failed ({type(err).__name__}: {err})"
        plan = call_probes.plan_call(calls, ids, mask, labels, self.ignore_index)
        if isinstance(plan, str):
            return plan
        self._plan, self._replayed = plan, returned
        return None

    def _emit(self, trainer: pl.Trainer, verdict: Verdict | None, **kwargs: Any) -> None:
        if verdict is not None:  # every MaskProbe finding is this rank's own: resolved together at the step's end
            self.emit_code(
                trainer,
                verdict.code,
                verdict.message,
                verdict.evidence,
                hint=verdict.hint,
                synchronized=False,
                **kwargs,
            )

    # ------------------------------------------------------------------ probe
    def _probe(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int, full: bool
    ) -> None:
        start = time.perf_counter()
        ids, mask, labels = self._extract(trainer, batch)
        if ids is None:
            self._cannot_call(
                trainer,
                probes.no_token_ids_reason(step_batch(trainer, batch, self._keys).fields.leaves, self.input_key),
                setting="`input_key` (where the token ids are) or `forward_fn` (a function calling the model on ids)",
            )
            return
        modes = {m: m.training for m in pl_module.modules()}
        devices = [ids.device.index or 0] if ids.device.type == "cuda" else []
        values: dict[str, Tensor | float] = {}
        decisions: list[Decision] = []
        try:
            with (
                eager_model_calls(),  # a compiled forward runs eagerly: the probes' shapes compile nothing new
                torch.random.fork_rng(devices=devices),
                torch.no_grad(),
                trainer.precision_plugin.train_step_context(),
            ):
                pl_module.eval()
                self._generator = torch.Generator().manual_seed(1234 + trainer.global_step)
                # How to call the model: `forward_fn` when given; else the call training_step itself makes, recorded
                # on a replay of it; else `forward` by its signature.
                recorded = (
                    None
                    if self.forward_fn is not None
                    else self._record(trainer, pl_module, batch, batch_idx, (ids, mask, labels))
                )
                if self._plan is None and self._caller is None:
                    reason = self._build_caller(pl_module)
                    if reason is not None:
                        why = f"{recorded}; and by signature: {reason}" if recorded else reason
                        self._cannot_call(trainer, why)
                        return
                if self._is_causal is None:
                    self._is_causal = self._decide_causal(trainer, ids, labels)
                    if not self._is_causal:
                        self._targets_wanted, self._alignment_decided = False, True
                # Token rows sliced in the step or the model (`rows[:, :-1]`): the probes perturb the tokens the call
                # received; the target alignment reads its outputs against the whole rows.
                call_ids, call_mask = ids, mask
                if self._plan is not None and self._plan.sliced:
                    call_ids, call_mask = self._plan.columns(ids), self._plan.columns(mask)
                    assert call_ids is not None
                if full:
                    self._probe_masks(trainer, call_ids, call_mask, self._generator, values, decisions)
                    if self.check_positions and not self._positions_done:
                        self._positions_done = True
                        self._probe_positions(trainer, pl_module, call_ids, values, decisions)
                        self._probe_tables(pl_module, call_ids, call_mask, values, decisions)
                if not self._alignment_decided:
                    self._probe_alignment(trainer, pl_module, batch, batch_idx, ids, mask, labels, values, decisions)
                if not self._order_decided and trainer.global_step in ORDER_STEPS:
                    self._probe_order(trainer, call_ids, call_mask, values, decisions)
        except Exception as err:  # never crash training: say how to make the model callable and stand aside
            self._cannot_call(
                trainer,
                f"calling the model failed ({type(err).__name__}: {err}); set `forward_fn`.",
            )
            return
        finally:
            for module, flag in modes.items():
                module.training = flag
            self._replayed = None  # the replay's outputs do not outlive the probe
            if self._plan is not None:
                self._plan = None
        values["mask_probe/seconds"] = time.perf_counter() - start
        host = self.to_host(values)  # host sync: one transfer for all of the probe's scalars (probing steps only)
        self.last_report = {k: v for k, v in host.items() if k.startswith("mask_probe/")}
        self.log_scalars(trainer, self.last_report)
        if "mask_probe/repeat_max_change" in host:
            repeat = probes.decide_repeat(
                host["mask_probe/repeat_max_change"],
                int(host["_repeat_row"]),
                int(host["_repeat_pos"]),
                host["_repeat_tol"],
            )
            if repeat is not None:
                self._alignment_decided = True  # its loss comparison would be noise too
                self._emit(trainer, repeat)
                return  # every other comparison would be measuring the noise
        for decide in decisions:
            self._emit(trainer, decide(host))

    def _decide_causal(self, trainer: pl.Trainer, ids: Tensor, labels: Tensor | None) -> bool:
        """Decoder (True) or encoder (False), from what the labels ask the model to predict."""
        plan = self._plan
        if plan is not None and plan.related():
            # some argument of the model call carries the labels: there are tokens the model must not see. The
            # target-alignment check applies when the token ids themselves carry them (a decoder-only model).
            if plan.primary is None or plan.primary.offset is None:
                self._targets_wanted, self._alignment_decided = False, True
            return True
        if labels is None:
            return True  # no token labels to read the objective from: decoders are the common case
        with torch.no_grad():
            counts = probes.objective_counts(ids, labels, self.ignore_index).tolist()  # host sync: once per fit
        verdict = probes.decide_objective(*counts, label_positions=labels.numel())
        self._emit(trainer, verdict)
        return verdict is None

    def _cannot_call(self, trainer: pl.Trainer, reason: str, setting: str = "`forward_fn`") -> None:
        self.emit_code(
            trainer,
            "TFD211",
            f"MaskProbe cannot call the model: {reason}",
            hint="MaskProbe calls `pl_module(input_ids=..., attention_mask=...)` or `pl_module(input_ids)`; otherwise "
            "give `forward_fn` (and `input_key` / `mask_key` / `labels_key` to point at the batch's fields).",
            synchronized=False,
        )
        self.stand_aside(reason, setting=setting)

    def _rows(self, t: Tensor | None) -> Tensor | None:
        if t is None:
            return None
        if self._plan is not None and not self._plan.time_cut_safe:
            return t[: self.probe_rows]  # other tensors of the call have the sequence's length: keep it whole
        return t[: self.probe_rows, : self.probe_length]

    def _probe_masks(
        self,
        trainer: pl.Trainer,
        ids_full: Tensor,
        mask_full: Tensor | None,
        gen: torch.Generator,
        values: dict[str, Tensor | float],
        decisions: list[Decision],
    ) -> None:
        plan = self._plan
        if plan is not None and plan.primary is None:
            # the call takes tensors derived from the ids, neither the ids nor a slice of them: only the leak probe
            self._probe_repeat_and_leaks(gen, values, decisions)
            return
        ids = self._rows(ids_full)
        mask = self._rows(mask_full)
        assert ids is not None and (self._caller is not None or plan is not None)
        b, t = ids.shape
        ones = torch.ones_like(ids)
        if plan is not None and self._is_causal and plan.related():
            self._probe_repeat_and_leaks(gen, values, decisions)
            base = self._logits(ids, ones)
            tol = logit_tolerance(base)
        else:
            base = self._logits(ids, ones)
            tol = logit_tolerance(base)
            # the same input again: every comparison below assumes an eval-mode forward is a function of its input
            repeat, where = max_change(base, self._logits(ids, ones))
            values.update({"mask_probe/repeat_max_change": repeat, "_repeat_row": where[0], "_repeat_pos": where[1]})
            values["_repeat_tol"] = tol
        if self._is_causal and t >= 2 and not (plan is not None and plan.related()):
            cut = probes.causal_cut(t)
            changed = self._logits(replace_after(ids, cut, gen), ones)
            change, where = max_change(base, changed, causal_valid_positions(b, t, cut, ids.device))
            values.update({"mask_probe/causal_max_change": change, "_causal_row": where[0], "_causal_pos": where[1]})
            values["_causal_tol"] = tol
            decisions.append(
                lambda h, cut=cut, t=t: probes.decide_causal(
                    h["mask_probe/causal_max_change"],
                    int(h["_causal_row"]),
                    int(h["_causal_pos"]),
                    cut,
                    t,
                    h["_causal_tol"],
                )
            )
        if not self.check_padding:
            return
        caller = plan if plan is not None else self._caller
        assert caller is not None
        if plan is not None and plan.mask_opaque:
            return  # a mask reaches the model in an encoding of its own (additive, other shape): not probed
        if not caller.takes_mask:
            if mask_full is not None and bool((mask_full == 0).any()):  # host sync: probe step only
                self._emit(trainer, probes.unpadded_mask_verdict(self._mask_path))
            return
        if mask_full is None and not caller.mask_named:
            return  # only `**kwargs` could take a mask, and the batch has none: nothing claims mask support
        # (a) masked positions are ignored: mask a block of positions after the first, change its ids, compare the rest
        block = probes.masked_block(ids, gen)
        if block is not None:
            masked, other, k = block
            first = self._logits(ids, masked)
            second = self._logits(other, masked)
            change, where = max_change(first, second, masked.bool() if first.shape[:2] == masked.shape else None)
            values.update({"mask_probe/padding_max_change": change, "_pad_pos": where[1], "_pad_tol": tol})
            # When the outputs follow another sequence of the call (an encoder-decoder's decoder, seen by the leak
            # probe), every output must ignore the masked source tokens, not only those at the ids' real positions.
            every, where_every = max_change(first, second) if first.shape == second.shape else (change, where)
            values.update({"_pad_every": every, "_pad_every_pos": where_every[1]})

            def decide_padding(h: dict[str, float], k: int = k) -> Verdict | None:
                if _follows_other(h):
                    return probes.decide_padding(h["_pad_every"], int(h["_pad_every_pos"]), k, h["_pad_tol"])
                return probes.decide_padding(h["mask_probe/padding_max_change"], int(h["_pad_pos"]), k, h["_pad_tol"])

            decisions.append(decide_padding)
        # (b) adding padding on the side the batch pads must not change the real tokens' logits
        if plan is not None and plan.companions():
            return  # another sequence of the call has the ids' length (a decoder input): padding the ids says nothing
        side = probes.probe_padding_side(self.padding_side, mask_full)  # host sync on "auto": probe step only
        real = mask if mask is not None else ones
        # Learned from configuration, else from the batch: a padded probe never exceeds the configured context limit,
        # nor, when none is known, the batch's own length (what the training step feeds the model anyway).
        t, extra = probes.padding_extra(t, self._limit_for(trainer) or ids_full.shape[1])
        if t < 2:
            return
        ids, real = ids[:, :t], real[:, :t]
        plain = self._logits(ids, real)
        longer_ids, longer_mask, keep = probes.add_padding(ids, real, side, extra, gen)
        try:
            longer = self._logits(longer_ids, longer_mask)[:, keep]
        except _CallError:
            raise
        except Exception:  # the longer sequence is past the model's real limit: the position checks report that
            return
        if longer.shape != plain.shape:
            return  # the outputs do not follow the ids' positions
        change, where = max_change(plain, longer, real.bool())
        values.update(
            {"mask_probe/pad_side_max_change": change, "_side_pos": where[1], "_side_tol": logit_tolerance(plain)}
        )
        decisions.append(
            lambda h, side=side, extra=extra: (
                None
                if _follows_other(h)  # outputs are a decoder's positions: the ids' padding moves nothing position-wise
                else probes.decide_pad_side(
                    h["mask_probe/pad_side_max_change"], int(h["_side_pos"]), side, extra, h["_side_tol"]
                )
            )
        )

    def _probe_repeat_and_leaks(
        self, gen: torch.Generator, values: dict[str, Tensor | float], decisions: list[Decision]
    ) -> None:
        """Through the recorded call: the repeat check, then for each argument that carries the labels, replace its
        tokens from the first position an output at or before the cut must not see, and compare those outputs."""
        plan = self._plan
        assert plan is not None
        rows = min(self.probe_rows, plan.batch_size)
        base = plan.run({}, rows=rows)
        tol = logit_tolerance(base)
        repeat, where = max_change(base, plan.run({}, rows=rows))
        values.update({"mask_probe/repeat_max_change": repeat, "_repeat_row": where[0], "_repeat_pos": where[1]})
        values["_repeat_tol"] = tol
        length = int(base.shape[1])
        if length < 2:
            return
        cut = probes.causal_cut(length)
        valid = causal_valid_positions(rows, length, cut, base.device)
        changes: list[Tensor] = []
        dependence: list[Tensor] = []
        for i, slot in enumerate(plan.related()):
            assert slot.offset is not None
            start = max(0, cut + plan.shift + slot.offset)
            perturbed = plan.perturb_from(slot, start, rows, gen)
            if perturbed is None:
                continue
            changed = plan.run({slot.path: perturbed}, rows=rows)
            if changed.shape != base.shape:
                continue
            change, where = max_change(base, changed, valid)
            changes.append(change)
            if not slot.primary:  # do the outputs follow this sequence at all (a decoder input)?
                dependence.append(max_change(base, changed)[0])
            values.update({f"_leak{i}": change, f"_leak{i}_row": where[0], f"_leak{i}_pos": where[1]})
            decisions.append(
                lambda h, i=i, slot=slot, start=start: call_probes.decide_leak(
                    h[f"_leak{i}"],
                    int(h[f"_leak{i}_row"]),
                    int(h[f"_leak{i}_pos"]),
                    cut,
                    start,
                    slot,
                    plan.shift,
                    h["_repeat_tol"],
                )
            )
        if changes:
            values["mask_probe/causal_max_change"] = torch.stack(changes).max()
        if dependence:
            values["_other_dep"] = torch.stack(dependence).max()

    def _limit_for(self, trainer: pl.Trainer) -> int | None:
        return self.context_limit or find_context_length(trainer.lightning_module)[0]

    def _limit_source(self, trainer: pl.Trainer) -> str:
        return "`context_limit`" if self.context_limit else find_context_length(trainer.lightning_module)[1]

    def _probe_positions(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        ids_full: Tensor,
        values: dict[str, Tensor | float],
        decisions: list[Decision],
    ) -> None:
        if self._plan is not None and (self._plan.primary is None or self._plan.companions()):
            return  # the call takes other sequences shaped like the ids: a longer row says nothing certain about them
        row = ids_full[:1]
        limit = self._limit_for(trainer)
        if self.kv_cache_fn is not None:
            self._probe_kv_cache(trainer, pl_module, self._rows(ids_full), values, decisions)  # type: ignore[arg-type]
        if limit is None:
            return
        values["mask_probe/context_limit"] = float(limit)
        long_row = probes.long_row(row, limit + 1)
        try:
            self._logits(long_row[:, :limit], torch.ones_like(long_row[:, :limit]))
        except _CallError:
            raise
        except Exception as err:  # the model fails within its own limit: that is the finding
            self._emit(trainer, probes.context_failure_verdict(limit, err))
            return
        # Never past the limit: a sequence the model cannot take fails natively in compiled code (an inductor kernel
        # aborts the process) and as a device-side assert on CUDA, neither of which any handler can catch.
        self._emit(trainer, probes.context_limit_verdict(limit, source=self._limit_source(trainer)))

    def _probe_tables(
        self,
        pl_module: pl.LightningModule,
        ids_full: Tensor,
        mask_full: Tensor | None,
        values: dict[str, Tensor | float],
        decisions: list[Decision],
    ) -> None:
        """Position tables: one forward pass of the probe rows watching every embedding weight and hand-held table
        parameter; a table of the token table's width with at least as many rows as the sequence must be read, and
        looked up with indices that vary along the sequence (``TFD216``). Once per fit."""
        ids, mask = self._rows(ids_full), self._rows(mask_full)
        assert ids is not None
        length = ids.shape[1]
        if length < 2:
            return
        named = call_probes.watched_tables(pl_module)
        if not named:
            return
        watcher = TableReads(list(named.values()))
        try:
            with watcher:
                self._logits(ids, torch.ones_like(ids) if mask is None else mask)
        except Exception:  # the other probes ran on this call: a failure here only means this check cannot run
            return
        # host sync (probe step, once per fit): which lookup took the call's token ids
        found = call_probes.table_lookups(named, watcher.use.lookups, watcher.use.read, ids)
        if found is None:
            return  # no lookup of the call's token ids: the token table's width is unknown
        token_table, tables = found
        flags: list[tuple[str, int, bool, bool, int]] = []
        for k, (name, rows, read, constant) in enumerate(tables):
            if constant is not None:
                values[f"_table{k}_constant"] = constant.float()
            flags.append((name, rows, read, constant is not None, k))
        if not flags:
            return

        def decide_tables(h: dict[str, float]) -> Verdict | None:
            reports = [
                call_probes.PositionTable(name, rows, read, looked_up, h.get(f"_table{k}_constant", 0.0) > 0.5)
                for name, rows, read, looked_up, k in flags
            ]
            return call_probes.decide_position_tables(reports, length, token_table)

        decisions.append(decide_tables)

    def _probe_kv_cache(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        ids: Tensor,
        values: dict[str, Tensor | float],
        decisions: list[Decision],
    ) -> None:
        try:
            fn = import_object(self.kv_cache_fn)  # type: ignore[arg-type]
        except (ImportError, AttributeError, ValueError) as err:
            self.emit_code(
                trainer, "TFD211", f"`kv_cache_fn` could not be imported: {err}", synchronized=False, key="kv_cache_fn"
            )
            return
        full = self._logits(ids, torch.ones_like(ids))
        incremental = logits_of(fn(pl_module, ids))
        if incremental is None or incremental.shape != full.shape:
            shape = None if incremental is None else tuple(incremental.shape)
            self.emit_code(
                trainer,
                "TFD211",
                f"`kv_cache_fn` returned {shape}, not logits of shape {tuple(full.shape)}; the cache check is skipped.",
                synchronized=False,
                key="kv_cache_shape",
            )
            return
        diff = (incremental.float() - full.float()).abs().amax(dim=-1).amax(dim=0)  # (T,)
        tol = logit_tolerance(full)
        values.update(
            {"mask_probe/kv_cache_max_change": diff.max(), "_kv_first": (diff > tol).float().argmax(), "_kv_tol": tol}
        )
        decisions.append(
            lambda h: probes.decide_kv_cache(h["mask_probe/kv_cache_max_change"], int(h["_kv_first"]), h["_kv_tol"])
        )

    def _probe_alignment(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        batch: Any,
        batch_idx: int,
        ids: Tensor,
        mask: Tensor | None,
        labels: Tensor | None,
        values: dict[str, Tensor | float],
        decisions: list[Decision],
    ) -> None:
        if not pl_module.automatic_optimization and self._plan is None:
            self._alignment_decided = True  # a manual training_step would step the optimizer: never call it
            return
        if labels is None:
            labels = ids.masked_fill(mask == 0, self.ignore_index) if mask is not None else ids
        if labels.shape != ids.shape and labels.numel() == ids.numel():
            labels = labels.reshape(ids.shape)  # labels flattened in the batch
        try:
            if self._plan is not None:  # the recording replay already ran training_step on this batch
                output = self._replayed
            else:
                output = quiet_training_step(pl_module, batch, batch_idx)
            returned = loss_of(output)
        except Exception as err:  # a training_step that cannot be replayed (dataloader_iter, side effects)
            self._alignment_decided = True
            self.emit_code(
                trainer,
                "TFD210",
                f"Target alignment not checked: calling `training_step` on the batch failed ({type(err).__name__}).",
                synchronized=False,
            )
            return
        if returned is None and not pl_module.automatic_optimization:
            self._alignment_decided = True  # a manual training_step need not return its loss: nothing to compare
            return
        if returned is None or returned.numel() != 1:
            self._alignment_decided = True
            self.emit_code(
                trainer,
                "TFD210",
                "Target alignment not checked: `training_step` did not return a scalar loss.",
                synchronized=False,
            )
            return
        offset = 0
        if self._plan is not None:
            # the logits of the very call whose loss training_step returned
            logits = call_probes.read_logits(self._plan.call.output, ids.shape[0], self._plan.out_seq_first)
            # a call that received a slice of the rows: its output p stands at row position p + ids_start
            offset = self._plan.ids_start
            expected = len(range(labels.shape[1])[self._plan.ids_start : self._plan.ids_stop])
            if logits is None or tuple(logits.shape[:2]) != (labels.shape[0], expected):
                self._alignment_decided = True  # outputs not position-aligned with the labels: nothing to compare
                return
        else:
            logits = self._logits(ids, mask)
        losses = alignment_losses(logits, labels, self.ignore_index, offset=offset)
        values.update(
            {
                "mask_probe/loss_returned": returned.detach().float(),
                "mask_probe/loss_shifted": losses["shifted"],
                "mask_probe/loss_unshifted": losses["unshifted"],
                "mask_probe/loss_shifted2": losses["shifted2"],
            }
        )
        relation = labels_relation(ids, labels, self.ignore_index)  # host syncs: probe step only
        rtol = probes.alignment_rtol(logits.dtype, returned.dtype)
        last_try = trainer.global_step >= ALIGNMENT_RETRY_STEPS[-1]

        def decide_alignment(h: dict[str, float]) -> Verdict | None:
            decided, verdict = probes.decide_alignment(
                h["mask_probe/loss_returned"],
                h["mask_probe/loss_shifted"],
                h["mask_probe/loss_unshifted"],
                h["mask_probe/loss_shifted2"],
                relation,
                rtol,
                last_try,
            )
            self._alignment_decided = self._alignment_decided or decided
            return verdict

        decisions.append(decide_alignment)

    def _probe_order(
        self,
        trainer: pl.Trainer,
        ids_full: Tensor,
        mask_full: Tensor | None,
        values: dict[str, Tensor | float],
        decisions: list[Decision],
    ) -> None:
        """Token order: reverse the tokens before a position, and separately replace them; a model that positions
        reach must move that position's output under the first, not only under the second."""
        plan = self._plan
        if plan is not None and plan.primary is None:
            self._order_decided = True  # the call takes tensors derived from the ids: no position of them to hold
            return
        ids, mask = self._rows(ids_full), self._rows(mask_full)
        assert ids is not None
        position = probes.order_probe_position(mask, ids.shape[1])  # host sync: probe step only
        if position is None:
            return
        # only the tokens before `position` change between the three calls; those after it stay as they are
        real = torch.ones_like(ids) if mask is None else mask
        try:
            base = self._logits(ids, real)
            reordered = self._logits(probes.reorder_prefix(ids, position), real)
            replaced = ids.clone()
            replaced[:, :position] = replace_after(ids[:, :position], -1, self._generator)
            content = self._logits(replaced, real)
        except Exception:  # the other probes ran on this call: a failure here only means this check cannot run
            self._order_decided = True
            return
        if reordered.shape != base.shape or content.shape != base.shape:
            self._order_decided = True
            return
        at = min(position, base.shape[1] - 1)  # an encoder-decoder's outputs follow its decoder
        values["mask_probe/order_change"] = (reordered[:, at] - base[:, at]).float().abs().max()
        values["mask_probe/content_change"] = (content[:, at] - base[:, at]).float().abs().max()
        values["_order_tol"] = logit_tolerance(base)
        step, last_try = trainer.global_step, trainer.global_step >= ORDER_STEPS[-1]

        def decide_order(h: dict[str, float]) -> Verdict | None:
            decided, verdict = probes.decide_order(
                h["mask_probe/order_change"], h["mask_probe/content_change"], position, h["_order_tol"], step, last_try
            )
            self._order_decided = self._order_decided or decided
            return verdict

        decisions.append(decide_order)

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        return {
            **super().state_dict(),
            "alignment_decided": self._alignment_decided,
            "order_decided": self._order_decided,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self._alignment_decided = bool(state_dict.get("alignment_decided", False))
        self._order_decided = bool(state_dict.get("order_decided", self._order_decided))


def _follows_other(host: dict[str, float]) -> bool:
    """Whether the outputs moved when another sequence of the call than the ids changed (the leak probe's
    measurement): they are then a decoder's positions, not the ids'."""
    return host.get("_other_dep", 0.0) > host.get("_repeat_tol", float("inf"))


class _CallError(RuntimeError):
    """The model could not be called the way MaskProbe tried, or did not return logits."""
