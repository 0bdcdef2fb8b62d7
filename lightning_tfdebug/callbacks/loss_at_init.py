"""LossAtInit: the first loss against ln(V), the shape of the model's outputs, and the later checks of the loss."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import lightning.pytorch as pl
import torch
from torch import Tensor

from lightning_tfdebug.core.base import DebugCallback, check_number
from lightning_tfdebug.core.batch import IGNORE_INDEX, BatchKeys, loss_of, step_batch
from lightning_tfdebug.core.distributed import world_size
from lightning_tfdebug.core.keys import Key
from lightning_tfdebug.core.logits import LogitsCapture, check_batch_key, module_device, row_targets
from lightning_tfdebug.core.reduction import Reduced
from lightning_tfdebug.findings import OnFinding
from lightning_tfdebug.functional.loss import (
    CHECK_SUMS,
    INIT_SUMS,
    TRANSFORM_SUMS,
    label_counts,
    step_sums,
    uniform_loss,
    unigram_entropy,
)
from lightning_tfdebug.functional.loss_checks import (
    COMPARE_FRACTIONS,
    MASKED_LM_CHECK_FACTOR,
    LossReading,
    check_findings,
    check_reading,
    classify_init_loss,
    compare_steps,
    follow_returned_loss,
    late_masked_lm,
    loss_reading,
    returned_loss,
    summarize_init,
    unreadable_verdict,
)

_SUMS = {"init": INIT_SUMS, "compare": TRANSFORM_SUMS, "check": (*CHECK_SUMS, *TRANSFORM_SUMS)}
"""The sums each armed phase reduces (:func:`~lightning_tfdebug.functional.loss.step_sums`)."""
_UNIGRAM_BATCHES = 8
"""The labels' unigram entropy is counted over this many measured batches (every rank's), then kept."""
_HISTORY = 64
"""Measured losses kept for the stall window."""
_BASELINES = "loss against ln V and the unigram entropy"
"""The dashboard chart of the loss between its two baselines."""


class LossAtInit(DebugCallback):
    r"""Checks the first loss against ln(V) and what the model's outputs are, then whether training left ln(V).

    On the first training step, before any update, the logits are captured with a forward hook (on the
    LightningModule's ``forward``, on ``logits_module``, or on a direct child that returns them;
    :mod:`lightning_tfdebug.core.logits`) and the labels are read from the batch. The training step's loss is compared
    with ln(V), the loss of a uniform prediction, where V is the logits' last dimension; the outputs are told apart
    from probabilities and log-probabilities, and the supervised labels are counted. Token rows without labels (a
    loss-only wrapper that slices the rows) are read from the call that took the rows.

    On its measuring steps (``every_n_steps``) it reads the training loss and, over the first 8 measured batches,
    counts the labels for their unigram entropy H (the loss of a model that learned the token frequencies only). At
    ``check_step`` (5x for masked-LM labels) it captures the logits again and judges the loss against ln(V) and H:
    a stall, a model that copies its current input token, outputs squashed into a bounded range, labels from other
    samples or a model that ignores its context. On the check and two compared steps before it, the returned loss is
    held against the recorded logits' own cross-entropy, which tells a squash or a temperature applied after the
    forward. Hooks exist only during those steps' forwards; the outputs are reduced to a few scalars in
    ``on_before_backward`` and released; one collective and one host transfer per measured step.

    What each check measures, its thresholds and where the logits and labels come from: ``docs/callbacks/
    loss_at_init.md``. Logged keys: :attr:`KEYS` (the table on that page).

    Findings: ``TFD220`` outputs are probabilities, ``TFD221`` log-probabilities, ``TFD222`` initial loss far above
    ln(V), ``TFD223`` far below, ``TFD224`` no supervised tokens, ``TFD225`` loss still at ln(V) at the check,
    ``TFD226`` the model copies its current input token, ``TFD227`` initial loss not finite, ``TFD228`` logits or
    labels cannot be found (it then stands aside), ``TFD229`` the loss is a multiple of the logits' cross-entropy,
    ``TFD230`` the loss pinned at the floor of bounded outputs, ``TFD231`` labels from other samples, ``TFD232`` the
    model ignores its context, ``TFD233`` the floor of a bound applied after the forward, ``TFD234`` a temperature
    between the logits and the loss, ``TFD235`` a returned loss that is not the logits' cross-entropy; see
    ``docs/findings.md``.

    Args:
        on_finding: ``"warn"``, ``"stop"`` or ``"raise"`` (see :class:`~lightning_tfdebug.DebugCallback`).
        labels_key: where the labels are in the batch: a key, a dotted path (``"inputs.labels"``) or a tuple
            position (int). ``None`` (default) finds them with the pack's shared batch reader
            (:mod:`lightning_tfdebug.core.batch`: ``labels``, ``label_ids``, ``targets``, ``target``, ``tgt``, ``y``;
            in a tuple the integer tensor after the ids), then under ``label``, then as a tuple's last item.
        input_key: where the input token ids are (for the copy check): a key, dotted path or tuple position; ``None``
            (default) finds them (``input_ids``, ``tokens``, ...; the first 2-D integer tensor of a tuple), and uses
            the labels when the batch has none and ``shift_labels`` is set.
        logits_module: qualified name of the submodule whose output holds the logits; ``None``: found.
        shift_labels: the logits at ``t`` predict the label at ``t + 1`` (causal LMs that shift internally); set
            ``False`` when labels are already aligned with the logits. Ignored when the logits have no time dimension;
            the loss the step returned picks the alignment where either is possible.
        ignore_index: label value that is not supervised; ``None``: -100 (PyTorch's and Hugging Face's).
        label_smoothing: the loss's label smoothing, used in the recomputed loss.
        vocab_size: V for ln(V); ``None`` takes the logits' last dimension.
        init_tolerance: ``TFD222``/``TFD223`` when the initial loss is above ``(1 + init_tolerance) ln(V)`` or
            below ``(1 - init_tolerance) ln(V)`` (``TFD223`` is info when the logits themselves give that loss: a
            pretrained model).
        check_step: optimizer step of the later checks (``5 * check_step`` for masked-LM labels); ``None`` disables
            them.
        stall_tolerance: ``TFD225`` when the loss at the check is within this fraction of ln(V) and fell by less
            than this fraction of ln(V) since half-way to the check.
        copy_threshold: ``TFD226`` when the copy rate at ``check_step`` exceeds this, and exceeds the rate at which
            the data repeats a token by at least 0.25, and has risen by at least 0.1 since step 0 (tied embeddings make
            an untrained model copy).
        max_rows: positions sampled from the logits for the statistics (bounds the cost for long sequences and
            large vocabularies).
        every_n_steps: the measuring steps that read the loss and count labels (``global_step % every_n_steps ==
            0``); default: the Trainer's ``log_every_n_steps``.

    Raises:
        ValueError: on an argument outside its allowed range.

    Example:
        ```python
        trainer = Trainer(callbacks=[LossAtInit(check_step=200)])
        ```

        LightningCLI:

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

    KEYS: ClassVar[tuple[Key, ...]] = (
        Key(
            "loss_at_init/observed",
            "step 0: the training step's loss, averaged over ranks (the recomputed loss if the step returned none)",
            "nats",
        ),
        Key("loss_at_init/expected", "step 0: ln(V)", "nats"),
        Key(
            "loss_at_init/recomputed",
            "step 0: cross-entropy recomputed from the captured outputs and labels under the assumed alignment",
            "nats",
        ),
        Key(
            "loss_at_init/logit_std", "step 0: spread of the outputs across the vocabulary (root mean of row variances)"
        ),
        Key("loss_at_init/supervised_frac", "step 0: fraction of label positions that are not `ignore_index`"),
        Key(
            "loss_at_init/check_loss", "the training step's loss at the check (`check_step`; 5x for masked LM)", "nats"
        ),
        Key("loss_at_init/copy_rate", "step 0 and the check: fraction of positions whose argmax is the current input"),
        Key("loss_at_init/rolled_loss", "the check: cross-entropy against the labels rolled by one sample", "nats"),
        Key(
            "loss_at_init/loss_floor",
            "the check: mean of `ln(1 + (V-1) e^-w)` over rows, `w` a row's logit range: the lowest loss these logits "
            "allow",
            "nats",
        ),
        Key(
            "loss_at_init/loss",
            "measuring steps (and 0, the check): the training loss (shared `loss_of`, undivided by accumulation, mean "
            "over ranks)",
            "nats",
            chart=_BASELINES,
        ),
        Key(
            "loss_at_init/ln_vocab",
            "measuring steps, once V is known: ln(V), a uniform guess's loss",
            "nats",
            _BASELINES,
        ),
        Key(
            "loss_at_init/unigram_entropy",
            "measuring steps, once known: entropy of the supervised labels' frequencies (first 8 measured batches, "
            "all ranks)",
            "nats",
            chart=_BASELINES,
        ),
        Key(
            "loss_at_init/logits_loss",
            "compared steps and the check: the recorded logits' own cross-entropy, under the alignment they predict "
            "best (the returned loss should be it)",
            "nats",
        ),
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
    ) -> None:
        super().__init__(every_n_steps=every_n_steps, on_finding=on_finding)
        check_batch_key("labels_key", labels_key)
        check_batch_key("input_key", input_key)
        if logits_module is not None and not isinstance(logits_module, str):
            raise TypeError(f"`logits_module` must be a submodule name (str) or None; got {logits_module!r}.")
        if not isinstance(shift_labels, bool):
            raise TypeError(f"`shift_labels` must be True or False; got {shift_labels!r}.")
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
        self.init_tolerance = float(init_tolerance)
        self.check_step = check_step
        self.stall_tolerance = float(stall_tolerance)
        self.copy_threshold = float(copy_threshold)
        self.max_rows = max_rows
        self._capture = LogitsCapture(logits_module, labels_key, self.ignore_index)
        self._armed: str | None = None  # "init", "compare" or "check" while a step is being captured
        self._armed_step = 0
        self._collected: _Collected | None = None
        self._measuring: int | None = None  # the step whose loss this batch reads (first micro-batch only)
        self._last_measured = -1
        self._label_counts: Tensor | None = None  # this rank's label counts over the first measured batches
        self._counted_batches = 0
        self._restore({})  # what the run has learned so far (kept in checkpoints): nothing yet

    @property
    def state_key(self) -> str:
        # `None` keeps the key of the former default ("labels"), so checkpoints of default configs still restore
        labels_key = "labels" if self.labels_key is None else self.labels_key
        return self._generate_state_key(labels_key=labels_key, logits_module=self.logits_module)

    def busy_at(self, step: int) -> bool:
        """Step 0, the compared steps, the check and the measuring steps; and while a capture is in flight."""
        if self._armed is not None or self._measuring is not None:
            return True
        return step == 0 or step % self._interval == 0 or step == self._check_at or step in self._compare_steps()

    def _compare_steps(self) -> tuple[int, ...]:
        return compare_steps(self._check_at, self._interval)

    # ------------------------------------------------------------------ capture
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int):
        if not self.active or trainer.sanity_checking or self._armed is not None:
            return
        step = trainer.global_step
        if step == 0 and not self._init_done:
            self._init_done = True  # the first micro-batch only
            phase = "init"
        elif self._check_at is not None and step == self._check_at and not self._check_done:
            self._check_done = True
            phase = "check"
        elif step in self._compare_steps() and step not in self._compared:
            self._compared.append(step)  # the first micro-batch only
            phase = "compare"
        else:
            if step != self._last_measured and self.should_measure(trainer):
                self._measuring = step  # read this batch's loss at its end (the first micro-batch of the step)
            return
        self._last_measured = step
        self._armed, self._armed_step = phase, step
        self._capture.arm(trainer, pl_module, batch, step_batch(trainer, batch, self._keys))

    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: Tensor) -> None:
        if self._armed is None or self._collected is not None or self._capture.replay:
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

    def _collect(self, pl_module: pl.LightningModule) -> _Collected:
        """Sums and counts (device scalars) of the armed phase from the captured outputs and the labels."""
        got = self._capture.read(pl_module, self.shift_labels)
        self._token_rows = self._token_rows or (got.token_rows and self._armed == "init")
        logits, labels = got.logits, got.labels
        found = _Collected(
            stats={},
            reason=got.reason,
            ok=logits is not None,
            vocab=self.vocab_size or (int(logits.shape[-1]) if logits is not None else 0),
            device=logits.device if logits is not None else module_device(pl_module),
            shifted=logits is not None and self._shift(logits),
        )
        if logits is not None and labels is not None:
            assert self._armed is not None
            found.stats = step_sums(
                self._armed,
                logits,
                labels,
                got.inputs,
                shift_labels=self._shift(logits),
                vocab_size=found.vocab,
                masked_lm=self._masked_lm,
                inputs_are_ids=got.ids_in_batch,
                late=not self._init_done,
                ignore_index=self.ignore_index,
                label_smoothing=self.label_smoothing,
                max_rows=self.max_rows,
            )
            found.labels = got.targets
        return found

    def _shift(self, logits: Tensor) -> bool:
        """Whether to score position ``t`` against label ``t + 1``: never when the logits have no time dimension,
        nor once step 0 showed masked-LM labels (aligned with the logits by construction)."""
        return self.shift_labels and logits.ndim >= 3 and not self._masked_lm

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
            loss = self._training_loss(trainer, pl_module, outputs)
            if self._capture.replay and pl_module.automatic_optimization:
                with contextlib.suppress(Exception):  # a step that cannot be replayed: nothing captured, stand aside
                    loss = loss_of(self._capture.replay_step(trainer, pl_module, batch, batch_idx))
            with torch.no_grad():
                found = self._collected or self._collect(pl_module)  # no backward ran (manual optimization)
                if phase != "init":  # V is known alike on every rank (or on none); these counts travel in the reduction
                    self._count_labels(found.labels, found.device)
                conclude = {"init": self._init, "compare": self._compare, "check": self._check}[phase]

                def then(host: dict[str, float]) -> None:
                    if not self._stand_aside_if_unreadable(trainer, host, found.reason, step):
                        conclude(trainer, found, host, step)

                self._reduce(trainer, found.stats, _SUMS[phase], loss, found.ok, found.device, then)
        finally:
            self._capture.clear()
            self._armed, self._collected = None, None

    @staticmethod
    def _training_loss(trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any) -> Tensor | None:
        loss = loss_of(outputs)
        if loss is not None and pl_module.automatic_optimization:
            loss = loss * trainer.accumulate_grad_batches  # Lightning divides the returned loss by it
        return loss

    def _count_labels(self, labels: Tensor | None, device: torch.device) -> None:
        """Add this batch's supervised labels to this rank's counts (device work, no sync), on the first
        ``_UNIGRAM_BATCHES`` measured batches once V is known."""
        if self._vocab is None or self._counted_batches >= _UNIGRAM_BATCHES or self._unigram_done:
            return
        self._counted_batches += 1
        if self._label_counts is None:
            self._label_counts = torch.zeros(self._vocab, device=device)
        if labels is not None and not labels.is_floating_point():
            self._label_counts += label_counts(labels.to(device), self._vocab, self.ignore_index)

    @property
    def _unigram_done(self) -> bool:
        return self._unigram is not None and self._label_counts is None

    def _measure_loss(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, step: int
    ) -> None:
        """A measuring step between the captured ones: the training loss and, while counting, the labels."""
        loss = self._training_loss(trainer, pl_module, outputs)
        device = loss.device if loss is not None else module_device(pl_module)
        with torch.no_grad():
            view = step_batch(trainer, batch, self._keys)
            labels = view.labels
            if labels is None and self._token_rows:
                labels = row_targets(view, self.ignore_index)
            self._count_labels(labels, device)  # before the declaration: these counts travel in it
            self._reduce(trainer, {}, (), loss, True, device, lambda host: self._keep_loss(trainer, host, step))

    def _keep_loss(self, trainer: pl.Trainer, host: dict[str, float], step: int) -> float:
        """Keep this step's loss for the stall window and log the dashboard keys; returns the loss (NaN: none)."""
        loss = returned_loss(host)
        if "unigram_entropy" in host and math.isfinite(host["unigram_entropy"]):
            self._unigram = host["unigram_entropy"]
            if self._counted_batches >= _UNIGRAM_BATCHES:
                self._label_counts = None  # counted: the entropy is kept, the counts let go
        self._history = [*self._history, (step, loss)][-_HISTORY:]
        metrics = {"loss_at_init/loss": loss}
        if self._vocab is not None:
            metrics["loss_at_init/ln_vocab"] = uniform_loss(self._vocab)
        if self._unigram is not None:
            metrics["loss_at_init/unigram_entropy"] = self._unigram
        self.log_scalars(trainer, {k: v for k, v in metrics.items() if math.isfinite(v)}, step=step)
        return loss

    def _reduce(
        self,
        trainer: pl.Trainer,
        stats: dict[str, Tensor],
        keys: tuple[str, ...],
        loss: Tensor | None,
        ok: bool,
        device: torch.device,
        then: Callable[[dict[str, float]], Any],
    ) -> None:
        """Declare this step's sums into the step's one reduction over ranks, and call ``then(host)`` with them reduced
        and on the host (the one host transfer of this step).

        Inside :class:`~lightning_tfdebug.TFDebug` the declaration travels in the pack's one collective, run after
        this hook, and ``then`` runs then; on its own the callback reduces it at once and ``then`` runs before this
        returns. Every rank reaches this on the same step whatever it found: a rank without logits sends zeros and
        ``ok = 0``, so every rank's declaration has the same sizes. The label counts in the declaration are those
        counted until now; counts added after it go into the next measuring step's.
        """
        zero = torch.zeros((), device=device)
        values = [stats.get(k, zero).float().to(device) for k in keys]
        values += [
            loss.detach().float().reshape(()).to(device) if loss is not None else zero,
            torch.tensor(float(loss is not None), device=device),
            torch.tensor(float(ok), device=device),
        ]
        names = (*keys, "loss_sum", "loss_n", "ok")
        counts = self._label_counts if self._counted_batches > 0 else None
        packed = torch.stack(values)
        if counts is not None:  # the label counts travel in the same reduction (a copy: later counts do not change it)
            packed = torch.cat([packed, counts.to(device)])

        def conclude(reduced: Reduced) -> None:
            with torch.no_grad():
                sums = reduced.sums.float()
                scalars: dict[str, Tensor] = {k: sums[i] for i, k in enumerate(names)}
                if counts is not None:
                    scalars["unigram_entropy"] = unigram_entropy(sums[len(names) :])
                then(self.to_host(scalars))  # host sync: the one transfer of this measuring step

        self.reduce_then(trainer, conclude, device, sums=packed)

    def _stand_aside_if_unreadable(self, trainer: pl.Trainer, host: dict[str, float], reason: str, step: int) -> bool:
        """``TFD228`` and stand aside, on every rank, when a rank could not read the logits or labels."""
        if host["ok"] >= world_size():
            return False
        text = reason or "another rank could not find the logits or labels (see its warning)"
        self.emit(trainer, unreadable_verdict(text, self.labels_key, self.logits_module, step=step))
        names = ("`labels_key`", "`logits_module`")
        self.stand_aside(text + ".", setting=next((s for s in names if s in text), "`labels_key` or `logits_module`"))
        return True

    # ------------------------------------------------------------------ conclusions (reduced values: every rank alike)
    def _init(self, trainer: pl.Trainer, found: _Collected, host: dict[str, float], step: int) -> None:
        host, other_alignment = follow_returned_loss(host, returned_loss(host))
        # every rank found logits of the same width: V is known alike everywhere, and the counts of this batch go
        # into the next measuring step's reduction (this one's declaration is made)
        self._vocab = self._vocab or found.vocab
        self._count_labels(found.labels, found.device)
        init = summarize_init(host, found.vocab)
        if init.copy_rate is not None:
            self._init_copy_rate = init.copy_rate
        self._masked_lm = init.masked_lm
        if init.masked_lm and self.check_step is not None:
            self._check_at = MASKED_LM_CHECK_FACTOR * self.check_step
        self.log_scalars(trainer, init.metrics(), step=step)
        self._keep_loss(trainer, {**host, "loss_sum": init.observed, "loss_n": 1.0}, step)
        self._probabilities = init.probabilities
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

    def _compare(self, trainer: pl.Trainer, found: _Collected, host: dict[str, float], step: int) -> None:
        """A compared step before the check: the returned loss against the recorded logits, kept for the check."""
        self._vocab = self._vocab or found.vocab
        self._add_reading(trainer, host, self._keep_loss(trainer, host, step), step)

    def _add_reading(self, trainer: pl.Trainer, host: dict[str, float], loss: float, step: int) -> None:
        reading = loss_reading(host, loss, step)
        if reading is not None:
            self._readings = [*self._readings, reading][-(len(COMPARE_FRACTIONS) + 1) :]
            self.log_scalars(trainer, {"loss_at_init/logits_loss": reading.ce}, step=step)

    def _check(self, trainer: pl.Trainer, found: _Collected, host: dict[str, float], step: int) -> None:
        returned = returned_loss(host)
        host, _ = follow_returned_loss(host, returned)
        self._vocab = self._vocab or found.vocab
        if not self._init_done and not self._masked_lm and late_masked_lm(host):
            # a run resumed without this callback's state, seeing masked-LM labels first here: their check moves to
            # its own later step, as step 0 would have set (a masked LM sits at the unigram entropy far longer)
            self._masked_lm = True
            later = MASKED_LM_CHECK_FACTOR * self.check_step if self.check_step is not None else None
            if later is not None and step < later:
                self._check_at, self._check_done = later, False
                self._keep_loss(trainer, {**host, "loss_sum": returned, "loss_n": 1.0}, step)
                return
        window = [(s, v) for s, v in self._history if s >= step // 2]  # measured before this check, in its window
        reading = check_reading(host, found.vocab)
        self._keep_loss(trainer, {**host, "loss_sum": reading.loss, "loss_n": 1.0}, step)
        self.log_scalars(trainer, reading.metrics(), step=step)
        self._add_reading(trainer, host, returned, step)  # the returned loss against the recorded logits
        verdicts = check_findings(
            reading,
            step,
            window=window,
            unigram_entropy=self._unigram if self._unigram is not None else math.nan,
            readings=self._readings,
            vocab=found.vocab,
            stall_tolerance=self.stall_tolerance,
            copy_threshold=self.copy_threshold,
            init_copy_rate=self._init_copy_rate,
            probabilities=self._probabilities,
            masked=self._masked_lm,
            learning_rates=[group["lr"] for opt in trainer.optimizers for group in opt.param_groups],
            shift_labels=self.shift_labels,
        )
        self.emit(trainer, verdicts)

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        return {
            **super().state_dict(),
            "init_done": self._init_done,
            "check_done": self._check_done,
            "init_copy_rate": self._init_copy_rate,
            "check_at": self._check_at,
            "masked_lm": self._masked_lm,
            "vocab": self._vocab,
            "unigram_entropy": self._unigram if self._unigram_done else None,
            "history": [list(point) for point in self._history],
            "probabilities": self._probabilities,
            "token_rows": self._token_rows,
            "compared": list(self._compared),
            "loss_readings": [r.to_list() for r in self._readings],
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self._restore(state_dict)

    def _restore(self, state_dict: dict[str, Any]) -> None:
        self._init_done = bool(state_dict.get("init_done", False))
        self._check_done = bool(state_dict.get("check_done", False))
        rate = state_dict.get("init_copy_rate")
        self._init_copy_rate: float | None = float(rate) if rate is not None else None  # the untrained model's
        self._check_at: int | None = state_dict.get("check_at", self.check_step)  # 5x for masked-LM labels
        self._masked_lm = bool(state_dict.get("masked_lm", False))
        self._vocab: int | None = state_dict.get("vocab") or getattr(self, "_vocab", None) or self.vocab_size
        self._unigram: float | None = state_dict.get("unigram_entropy")  # nats, reduced over ranks
        self._label_counts = None
        self._counted_batches = _UNIGRAM_BATCHES if self._unigram is not None else 0
        self._history = [(int(s), float(v)) for s, v in state_dict.get("history", [])]  # (step, loss) for the stall
        self._probabilities = bool(state_dict.get("probabilities", False))  # TFD220 at step 0
        self._token_rows = bool(state_dict.get("token_rows", False))  # the labels are the batch's token rows
        self._compared = [int(s) for s in state_dict.get("compared", [])]  # compared steps before the check armed
        self._readings = [LossReading.from_list(r) for r in state_dict.get("loss_readings", [])]


@dataclass
class _Collected:
    """What one measured step found on this rank, kept (small) from the backward to the end of the batch."""

    stats: dict[str, Tensor]
    reason: str
    ok: bool
    vocab: int
    device: torch.device
    shifted: bool = False
    labels: Tensor | None = None  # for the label counts; released with the rest at the end of the batch
