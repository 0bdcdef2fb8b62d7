"""LossAtInit: the first loss against ln(V), the shape of the model's outputs, and the later checks of the loss."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar, Literal

import lightning.pytorch as pl
import torch
from torch import Tensor

from lightning_tfdebug.callbacks.loss_at_init.check import COVERAGE as COVERAGE_ROWS
from lightning_tfdebug.callbacks.loss_at_init.check import COVERED_ROW, check_findings, comparison_aside, early_findings
from lightning_tfdebug.callbacks.loss_at_init.init_checks import classify_init_loss, unreadable_verdict
from lightning_tfdebug.callbacks.loss_at_init.phases import EARLY_DECISION, LossRun
from lightning_tfdebug.callbacks.loss_at_init.readings import (
    Collected,
    LossSums,
    check_reading,
    follow_returned_loss,
    late_masked_lm,
    loss_reading,
    returned_loss,
    summarize_init,
)
from lightning_tfdebug.callbacks.loss_at_init.transform_checks import COMPARISON, NOT_CROSS_ENTROPY
from lightning_tfdebug.core.base import DebugCallback, check_number
from lightning_tfdebug.core.batch import step_batch
from lightning_tfdebug.core.distributed import world_size
from lightning_tfdebug.core.logits import LogitsCapture, check_capture_args, module_device, row_targets, training_loss
from lightning_tfdebug.core.reduction import Reduced
from lightning_tfdebug.findings import OnFinding
from lightning_tfdebug.functional.loss import PHASE_SUMS, LabelFrequencies, step_sums, unigram_entropy
from lightning_tfdebug.primitives.batch import IGNORE_INDEX, BatchKeys
from lightning_tfdebug.primitives.keys import Key

_BASELINES = "loss against ln V and the unigram entropy"
"""The dashboard chart of the loss between its two baselines."""


def _key(name: str, description: str, chart: str = "", unit: str = "nats") -> Key:
    return Key(f"loss_at_init/{name}", description, unit, chart=chart)


class LossAtInit(DebugCallback):
    r"""Checks the first loss against ln(V) and what the model's outputs are, then whether training left ln(V) and
    whether the loss it returns is the cross-entropy of its own logits.

    Step 0 captures the logits (forward hooks, :mod:`lightning_tfdebug.core.logits`) and judges the loss against ln(V);
    measuring steps read the loss and count the labels' unigram entropy; at ``check_step`` (5x for masked-LM labels)
    and on the compared steps (10 to 40, two before the check) the logits are captured again (from step 30 the loss's
    family and floor are decided). One collective and one host transfer per measured step. What each check measures:
    ``docs/callbacks/loss_at_init.md``; findings: ``docs/findings.md``; logged keys: :attr:`KEYS`.

    Args:
        on_finding: ``"warn"``, ``"stop"`` or ``"raise"`` (see :class:`~lightning_tfdebug.DebugCallback`).
        labels_key: where the labels are: a key, a dotted path (``"inputs.labels"``) or a tuple position; ``None``
            finds them (the shared batch reader's names, then ``label``, then a tuple's last item).
        input_key: where the input token ids are (for the copy check); ``None`` finds them, else takes the labels
            when ``shift_labels`` is set.
        logits_module: qualified name of the submodule whose output holds the logits; ``None``: found.
        shift_labels: the logits at ``t`` predict the label at ``t + 1`` (causal LMs that shift internally); ``False``
            when the labels are aligned with the logits. Where either is possible the returned loss picks one.
        ignore_index: label value that is not supervised; ``None``: -100.
        label_smoothing: the loss's label smoothing, used in the recomputed loss.
        vocab_size: V for ln(V); ``None`` takes the logits' last dimension.
        init_tolerance: ``TFD222``/``TFD223`` when the initial loss is outside ``(1 -/+ init_tolerance) ln(V)``.
        check_step: optimizer step of the later checks (5x for masked-LM labels); ``None`` disables them.
        stall_tolerance: ``TFD225`` when the loss at the check is within this fraction of ln(V) and fell by less than
            this fraction of ln(V) since half-way to the check.
        copy_threshold: ``TFD226`` when the copy rate at the check exceeds this (and the data's repeat rate by 0.25,
            the rate at step 0 by 0.1).
        max_rows: positions sampled from the logits for the statistics (bounds the cost).
        model_kind: ``"decoder"``, ``"encoder"``, ``"encoder-decoder"`` (see MaskProbe); ``None``: read from the model.
        every_n_steps: measuring steps that read the loss and count labels; default: ``log_every_n_steps``.

    Raises:
        ValueError: on an argument outside its allowed range.

    Example:
        LightningCLI (in Python: ``Trainer(callbacks=[LossAtInit(check_step=200)])``):

        ```yaml
        trainer:
          callbacks:
            - class_path: lightning_tfdebug.LossAtInit
              init_args:
                labels_key: labels  # or 1 for (input_ids, labels) tuples; leave out to find them
                shift_labels: true
                check_step: 200
        ```
    """

    COVERAGE: ClassVar[Mapping[str, tuple[str, ...]]] = COVERAGE_ROWS  # declared beside the rules

    KEYS: ClassVar[tuple[Key, ...]] = (
        _key("observed", "step 0: the training step's loss, mean over ranks (the recomputed loss if none)"),
        _key("expected", "step 0: ln(V), the loss of a uniform prediction"),
        _key("recomputed", "step 0: cross-entropy recomputed from the captured outputs and labels"),
        _key("logit_std", "step 0: spread of the outputs across the vocabulary (root mean of row variances)", unit=""),
        _key("supervised_frac", "step 0: fraction of label positions that are not `ignore_index`", unit=""),
        _key("check_loss", "the check: the training step's loss (at `check_step`; 5x for masked-LM labels)"),
        _key("copy_rate", "step 0 and the check: share of positions whose argmax is the current input", unit=""),
        _key("rolled_loss", "the check: cross-entropy against the labels rolled by one sample along the batch"),
        _key("loss_floor", "the check: mean over rows of `ln(1 + (V-1) e^-w)`, `w` the row's logit range"),
        _key("loss", "measuring steps: the training loss (undivided by accumulation, mean over ranks)", _BASELINES),
        _key("ln_vocab", "measuring steps, once V is known: ln(V), the loss of a uniform guess", _BASELINES),
        _key("unigram_entropy", "measuring steps: the labels' unigram entropy (8 batches, all ranks)", _BASELINES),
        _key("logits_loss", "compared steps and the check: the recorded logits' own cross-entropy"),
    )

    def __init__(
        self,
        on_finding: OnFinding = "warn",
        labels_key: str | int | None = None,
        input_key: str | int | None = None,
        logits_module: str | None = None,
        shift_labels: bool = True,
        ignore_index: int | None = None,
        label_smoothing: float = 0.0,
        vocab_size: int | None = None,
        init_tolerance: float = 0.25,
        check_step: int | None = 100,
        stall_tolerance: float = 0.05,
        copy_threshold: float = 0.5,
        max_rows: int = 2048,
        every_n_steps: int | None = None,
        model_kind: Literal["decoder", "encoder", "encoder-decoder"] | None = None,
    ) -> None:
        super().__init__(every_n_steps=every_n_steps, on_finding=on_finding)
        check_capture_args(labels_key, input_key, logits_module, shift_labels, model_kind)
        check_number("ignore_index", ignore_index, integer=True, optional=True)
        check_number("label_smoothing", label_smoothing, low=0.0, high=1.0)
        check_number("vocab_size", vocab_size, low=2, integer=True, optional=True)
        check_number("init_tolerance", init_tolerance, low=0.0, high=1.0, low_inclusive=False)
        check_number("check_step", check_step, low=1, integer=True, optional=True)
        check_number("stall_tolerance", stall_tolerance, low=0.0, high=1.0, low_inclusive=False)
        check_number("copy_threshold", copy_threshold, low=0.0, high=1.0, low_inclusive=False)
        check_number("max_rows", max_rows, low=1, integer=True)
        self.labels_key, self.input_key, self.logits_module = labels_key, input_key, logits_module
        self.shift_labels = shift_labels
        self.ignore_index = IGNORE_INDEX if ignore_index is None else ignore_index
        self._keys = BatchKeys(input_key=input_key, labels_key=labels_key, ignore_index=self.ignore_index)
        self.label_smoothing = float(label_smoothing)
        self.vocab_size = vocab_size
        self.init_tolerance, self.stall_tolerance = float(init_tolerance), float(stall_tolerance)
        self.check_step, self.copy_threshold = check_step, float(copy_threshold)
        self.max_rows, self.model_kind = max_rows, model_kind
        self._capture = LogitsCapture(logits_module, labels_key, self.ignore_index, model_kind)
        self._run = LossRun(check_step, check_at=check_step, vocab=vocab_size)  # what the run has read so far
        self._frequencies = LabelFrequencies()  # the labels' unigram entropy, once counted
        self._armed: str | None = None  # "init", "compare" or "check" while a step is being captured
        self._armed_step = 0
        self._collected: Collected | None = None
        self._measuring: int | None = None  # the step whose loss this batch reads (first micro-batch only)
        self._last_measured = -1

    @property
    def state_key(self) -> str:
        # `None` keeps the key of the former default ("labels"), so checkpoints of default configs still restore
        labels_key = "labels" if self.labels_key is None else self.labels_key
        return self._generate_state_key(labels_key=labels_key, logits_module=self.logits_module)

    def busy_at(self, step: int) -> bool:
        """Step 0, the compared steps, the check and the measuring steps; and while a capture is in flight."""
        if self._armed is not None or self._measuring is not None:
            return True
        return step == 0 or step % self._interval == 0 or step == self._run.check_at or step in self._compare_steps()

    def _compare_steps(self) -> tuple[int, ...]:
        return self._run.compare_steps(self._interval)

    # ------------------------------------------------------------------ capture
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int):
        if not self.active or trainer.sanity_checking or self._armed is not None:
            return
        step = trainer.global_step
        phase = self._run.arm(step, self._interval)
        if phase is None:
            if step != self._last_measured and self.should_measure(trainer):
                self._measuring = step  # read this batch's loss at its end (the first micro-batch of the step)
            return
        self._last_measured = step
        self._armed, self._armed_step = phase, step
        self._capture.arm(trainer, pl_module, batch, step_batch(trainer, batch, self._keys))

    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: Tensor) -> None:
        if self._armed is None or self._collected is not None:
            return
        # The forward is over: remove the hooks (activation checkpointing re-runs forwards in backward), reduce the
        # captured outputs to a few device scalars and let the logits go, so they do not outlive the backward.
        self._capture.stop()
        with torch.no_grad():
            self._collected = self._collect(pl_module)

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._capture.clear()
        self._armed, self._collected = None, None

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._capture.stop()

    def _collect(self, pl_module: pl.LightningModule) -> Collected:
        """Sums and counts (device scalars) of the armed phase from the captured outputs and the labels."""
        got = self._capture.read(pl_module, self.shift_labels)
        self._run.token_rows = self._run.token_rows or (got.token_rows and self._armed == "init")
        if got.logits is None or got.labels is None or self._armed is None:
            return Collected(reason=got.reason, ok=False, vocab=self.vocab_size or 0, device=module_device(pl_module))
        logits, vocab, shift = got.logits, self.vocab_size or int(got.logits.shape[-1]), self._shift(got.logits)
        stats = step_sums(
            self._armed,
            logits,
            got.labels,
            got.inputs,
            shift_labels=shift,
            vocab_size=vocab,
            masked_lm=self._run.masked_lm,
            inputs_are_ids=got.ids_in_batch,
            late=not self._run.init_done,
            ignore_index=self.ignore_index,
            label_smoothing=self.label_smoothing,
            max_rows=self.max_rows,
        )
        return Collected(got.reason, True, vocab, logits.device, shift, stats, labels=got.targets)

    def _shift(self, logits: Tensor) -> bool:
        """Whether to score position ``t`` against label ``t + 1``: never when the logits have no time dimension,
        nor once step 0 showed masked-LM labels (aligned with the logits by construction)."""
        return self.shift_labels and logits.ndim >= 3 and not self._run.masked_lm

    # ------------------------------------------------------------------ measuring
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._measuring is not None:
            step, self._measuring = self._measuring, None
            self._last_measured = step
            self._measure_loss(trainer, pl_module, outputs, batch, step)
            return
        if self._armed is None:
            return
        phase, step = self._armed, self._armed_step
        try:
            self._capture.stop()
            loss = training_loss(trainer, pl_module, outputs)
            with torch.no_grad():
                found = self._collected or self._collect(pl_module)  # no backward ran (manual optimization)
                if phase != "init":  # V is known alike on every rank (or on none); these counts travel in the reduction
                    self._frequencies.add(found.labels, self._run.vocab, found.device, self.ignore_index)
                conclude = {"init": self._init, "compare": self._compare, "check": self._check}[phase]

                def then(host: LossSums) -> None:
                    if not self._stand_aside_if_unreadable(trainer, host, found.reason, step):
                        self._run.vocab = self._run.vocab or found.vocab  # every rank found logits of one width
                        conclude(trainer, found, host, step)

                self._reduce(trainer, found, PHASE_SUMS[phase], loss, then)
        finally:
            self._capture.clear()
            self._armed, self._collected = None, None

    def _measure_loss(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, step: int
    ) -> None:
        """A measuring step between the captured ones: the training loss and, while counting, the labels."""
        loss = training_loss(trainer, pl_module, outputs)
        device = loss.device if loss is not None else module_device(pl_module)
        with torch.no_grad():
            view = step_batch(trainer, batch, self._keys)
            labels = view.labels
            if labels is None and self._run.token_rows:
                labels = row_targets(view, self.ignore_index)
            self._frequencies.add(labels, self._run.vocab, device, self.ignore_index)  # travel in this declaration
            measured = Collected(reason="", ok=True, vocab=0, device=device)
            self._reduce(trainer, measured, (), loss, lambda host: self._keep_loss(trainer, host, step))

    def _keep_loss(self, trainer: pl.Trainer, host: LossSums, step: int) -> float:
        """Keep this step's loss for the stall window and log the dashboard keys; returns the loss (NaN: none)."""
        loss = returned_loss(host)
        self._frequencies.receive(host.unigram_entropy)
        self.log_scalars(trainer, self._run.keep_loss(step, loss, self._frequencies.entropy), step=step)
        return loss

    def _reduce(self, trainer: pl.Trainer, found: Collected, keys: tuple[str, ...], loss: Tensor | None, then: Any):
        """Declare this step's sums (a rank without logits sends zeros and ``ok = 0``: every rank's have the same sizes)
        and the label counts so far into the step's one reduction over ranks, then call ``then(host)`` with them
        reduced, on the host: at once on its own, after the hook inside :class:`~lightning_tfdebug.TFDebug`."""
        device, zero = found.device, torch.zeros((), device=found.device)
        named = {k: found.stats.get(k, zero) for k in keys}
        named["loss_sum"] = loss.detach().reshape(()) if loss is not None else zero
        named["loss_n"] = torch.tensor(float(loss is not None), device=device)
        named["ok"] = torch.tensor(float(found.ok), device=device)
        counts = self._frequencies.payload  # a copy travels: counts added later go into the next reduction
        declared: dict[str, Tensor] = {k: v.float().to(device) for k, v in named.items()}
        if counts is not None:
            declared["label_counts"] = counts.to(device)

        def conclude(reduced: Reduced) -> None:
            with torch.no_grad():
                scalars = {k: reduced.sums[k].float() for k in named}
                if counts is not None:
                    scalars["unigram_entropy"] = unigram_entropy(reduced.sums["label_counts"].float())
                # host sync: the one transfer of this measuring step, read by name into the typed payload
                then(LossSums.from_host(self.to_host(scalars)))

        self.reduce_then(trainer, conclude, device, sums=declared)

    def _stand_aside_if_unreadable(self, trainer: pl.Trainer, host: LossSums, reason: str, step: int) -> bool:
        """``TFD228`` and stand aside, on every rank, when a rank could not read the logits or labels."""
        if host.ok >= world_size():
            return False
        text = reason or "another rank could not find the logits or labels (see its warning)"
        self.emit(trainer, unreadable_verdict(text, self.labels_key, self.logits_module, step=step))
        names = ("`labels_key`", "`logits_module`")
        self.stand_aside(text + ".", setting=next((s for s in names if s in text), "`labels_key` or `logits_module`"))
        return True

    # ------------------------------------------------------------------ conclusions (reduced values: every rank alike)
    def _init(self, trainer: pl.Trainer, found: Collected, host: LossSums, step: int) -> None:
        host, other_alignment = follow_returned_loss(host, returned_loss(host))
        # V is known alike everywhere now; this batch's counts go into the next measuring step's reduction
        self._frequencies.add(found.labels, self._run.vocab, found.device, self.ignore_index)
        init = summarize_init(host, found.vocab, self._capture.read_kind)
        self._run.start(init)
        self.log_scalars(trainer, init.metrics(), step=step)
        self._keep_loss(trainer, host.with_loss(init.observed), step)
        verdicts = classify_init_loss(
            init,
            init_tolerance=self.init_tolerance,
            ignore_index=self.ignore_index,
            shifted=found.shifted != other_alignment,
            accumulate_grad_batches=trainer.accumulate_grad_batches,
            ranks=world_size(),
            manual_optimization=not trainer.lightning_module.automatic_optimization,
            step=step,
        )
        self.emit(trainer, verdicts)
        self.cover("loss at init", "verified")  # a finding among the row's codes makes it one in the report

    def _compare(self, trainer: pl.Trainer, found: Collected, host: LossSums, step: int) -> None:
        """A compared step before the check: the returned loss against the logits, kept; from the third on decided."""
        self._add_reading(trainer, host, self._keep_loss(trainer, host, step), step)
        self.emit(trainer, early_findings(self._run, found.vocab, self._frequencies.entropy))
        if len(self._run.readings) >= EARLY_DECISION and not self._run.compare_aside:
            self.cover(COVERED_ROW, "verified")  # decided (a finding among the row's codes makes it one)

    def _comparison_aside(self) -> None:
        if comparison_aside(self._run):  # once: the returned loss is no cross-entropy of the logits
            setting = "`logits_module` naming the logits the loss reads"
            self.check_aside(COMPARISON, NOT_CROSS_ENTROPY, setting=setting)
            self.cover(COVERED_ROW, "unknown", NOT_CROSS_ENTROPY, setting)

    def _add_reading(self, trainer: pl.Trainer, host: LossSums, loss: float, step: int) -> None:
        reading = loss_reading(host, loss, step)
        if reading is not None:
            self._run.add_reading(reading)
            self.log_scalars(trainer, {"loss_at_init/logits_loss": reading.ce}, step=step)
            self._comparison_aside()

    def _check(self, trainer: pl.Trainer, found: Collected, host: LossSums, step: int) -> None:
        returned = returned_loss(host)
        host, _ = follow_returned_loss(host, returned)
        # masked-LM labels seen first here (resumed without this state): their check moves later
        if self._run.check_moves(late_masked_lm(host), step):
            self._keep_loss(trainer, host.with_loss(returned), step)
            return
        reading = check_reading(host, found.vocab)
        self._keep_loss(trainer, host.with_loss(reading.loss), step)
        self.log_scalars(trainer, reading.metrics(), step=step)
        self._add_reading(trainer, host, returned, step)  # the returned loss against the recorded logits
        verdicts = check_findings(
            reading,
            step,
            self._run,
            unigram_entropy=self._frequencies.entropy,
            vocab=found.vocab,
            stall_tolerance=self.stall_tolerance,
            copy_threshold=self.copy_threshold,
            learning_rates=[group["lr"] for opt in trainer.optimizers for group in opt.param_groups],
            shift_labels=self.shift_labels,
        )
        self.emit(trainer, verdicts)
        self.cover("loss leaves the uniform level", "verified")
        if not self._run.compare_aside:
            self.cover(COVERED_ROW, "verified")

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        entropy = self._frequencies.entropy if self._frequencies.done else None
        return {**super().state_dict(), **self._run.to_state(), "unigram_entropy": entropy}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self._run = LossRun.from_state(state_dict, self.check_step, self._run.vocab)
        self._frequencies.restore(state_dict.get("unigram_entropy"))
