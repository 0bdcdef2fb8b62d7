"""LossAtInit: the first loss against ln(V), the shape of the model's outputs, and two later checks."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from lightning_tfdebug.core.base import DebugCallback, check_number, eager_model_calls, model_is_compiled
from lightning_tfdebug.core.batch import (
    IGNORE_INDEX,
    LABELS_KEYS,
    BatchKeys,
    StepBatch,
    logits_for_labels,
    logits_of,
    loss_of,
    step_batch,
)
from lightning_tfdebug.core.calls import CallRecorder, RecordedCall, takes_tokens
from lightning_tfdebug.core.distributed import world_size
from lightning_tfdebug.core.model import in_training_step, quiet_training_step
from lightning_tfdebug.core.reduction import Reduced
from lightning_tfdebug.findings import OnFinding
from lightning_tfdebug.functional.call_probes import token_row_logits
from lightning_tfdebug.functional.loss import (
    TEMPERATURE_GRID,
    bounded_floor_sums,
    copy_sums,
    init_loss_sums,
    label_counts,
    label_input_match_sums,
    loss_transform_sums,
    masked_input_sums,
    rolled_label_sums,
    uniform_loss,
    unigram_entropy,
)
from lightning_tfdebug.functional.loss_checks import (
    MASKED_LM_CHECK_FACTOR,
    MASKED_LM_SHARE,
    MASKED_LM_SUPERVISED,
    OTHER_ALIGNMENT,
    LossReading,
    bounded_output_verdict,
    check_verdicts,
    classify_init_loss,
    context_verdict,
    flat_window,
    follow_returned_loss,
    loss_reading,
    loss_transform_verdict,
    summarize_init,
)
from lightning_tfdebug.functional.verdicts import Verdict

_INIT_KEYS = (
    "ce_sum",
    "ce_count",
    "var_sum",
    "rows",
    "prob_rows",
    "logprob_rows",
    "supervised",
    "positions",
    "label_rows",
    "copies",
    "repeats",
    "count",
    "mask_share_top",
    "mask_share_count",
    "other_ce_sum",
    "other_ce_count",
)
_LATE_KEYS = ("late_mask_top", "late_mask_count", "late_supervised", "late_positions")
"""At the check of a run whose step 0 this callback did not see (resumed from a checkpoint written without it): what
step 0 would have read to tell masked-LM labels (:func:`~lightning_tfdebug.functional.loss.masked_input_sums` and the
supervised share)."""
_CHECK_KEYS = (
    "ce_sum",
    "ce_count",
    "copies",
    "repeats",
    "count",
    "own_ce_sum",
    "rolled_ce_sum",
    "rolled_count",
    "own_match",
    "rolled_match",
    "match_count",
    "floor_sum",
    "range_sum",
    "range_sq_sum",
    "floor_count",
    *(
        OTHER_ALIGNMENT + key
        for key in ("ce_sum", "ce_count", "own_ce_sum", "rolled_ce_sum", "rolled_count", "floor_sum", "range_sum")
    ),
    OTHER_ALIGNMENT + "range_sq_sum",
    OTHER_ALIGNMENT + "floor_count",
    *_LATE_KEYS,
)
_TRANSFORM_KEYS = (
    "tx_ce_sum",
    "tx_ce_sq_sum",
    "tx_count",
    "tx_total",
    "tx_positions",
    "tx_uniform_sum",
    "tx_range_sum",
    *(f"tx_beta_{k}" for k in range(len(TEMPERATURE_GRID))),
)
"""The sums of `loss_transform_sums` reduced on the compared steps (the check's and the two before it)."""
COMPARE_FRACTIONS = (0.5, 0.75)
"""Besides the check, the returned loss is compared with the recorded logits on the first measuring steps at or after
these fractions of the way to it."""
_UNIGRAM_BATCHES = 8
"""The labels' unigram entropy is counted over this many measured batches (every rank's), then kept."""
_HISTORY = 64
"""Measured losses kept for the stall window."""


def _missing(batch: Any, key: str | int) -> str:
    """Why ``key`` names no tensor of ``batch``, in the words of the batch's own structure."""
    if isinstance(batch, Mapping):
        if key in batch and not isinstance(batch[key], Tensor):
            return f"batch[{key!r}] is a {type(batch[key]).__name__}, not a tensor"
        return f"the batch is a mapping with keys {sorted(map(str, batch))}, without {key!r}"
    if isinstance(batch, Sequence) and not isinstance(batch, (str, bytes)):
        return f"the batch is a {type(batch).__name__} of {len(batch)} items, which has no tensor at {key!r}"
    if dataclasses.is_dataclass(batch):
        names = [f.name for f in dataclasses.fields(batch)]
        return f"the batch is a {type(batch).__name__} with fields {names}, without a tensor {key!r}"
    return f"the batch is a {type(batch).__name__} without {key!r}"


def _check_key(name: str, value: Any) -> None:
    if value is None or (isinstance(value, str) and value) or (type(value) is int and value >= 0):
        return
    raise TypeError(
        f"`{name}` must be a batch key or dotted path (str), a tuple position (int >= 0) or None (found by its usual "
        f"names); got {value!r}."
    )


class LossAtInit(DebugCallback):
    r"""Checks the first loss against ln(V) and what the model's outputs are, then whether training left ln(V).

    On the first training step, before any update, the logits are captured with a forward hook (on the
    LightningModule's ``forward``, on a named submodule, or on a direct child: one that returns a ``.logits`` output
    such as a Hugging Face model, else the last one to return a tensor shaped like the labels plus a class dimension
    wider than every label, as when ``training_step`` calls ``self.model(x)``) and the labels are read from the
    batch. Forwards that other callbacks run from their own hooks are ignored. It compares the training step's loss
    with ln(V), the loss of a uniform prediction (label smoothing does not change it), where V is the logits' last
    dimension; it tells whether the outputs are already probabilities or log-probabilities; and it counts the
    supervised labels (not ``ignore_index``). At ``check_step`` it captures the logits again and checks whether the
    loss is still at ln(V) and whether the model predicts the *current* input token instead of the next.

    Token rows without labels (the batch is one integer tensor ``(B, T+1)``, or a list whose first item is one, and
    ``training_step`` returns ``self.model(batch)``, a wrapper that slices the rows and returns only the loss): the
    calls that take tokens are recorded at every depth on the two captured steps, the logits are those of the call
    that received the rows, ``rows[:, :-1]`` or ``rows[:, 1:]`` (its output, or the first tensor of ``(logits,
    cache)``), its tokens are the labels (the wrapper's loss shifts them) and the copy check's inputs, and every
    token after a row's first counts towards the unigram entropy.

    Data-aware baselines: on its measuring steps (``every_n_steps``) it reads the training loss, and over the first
    8 measured batches it counts the supervised labels (reduced over ranks) for their unigram entropy H: the loss of a
    model that learned the token frequencies and ignores its context. At the check the loss is judged against both
    ln(V) and H: a stall (``TFD225``) is a loss flat over the window since half-way to the check, not one point; a
    loss at H whose predictions fit the sample's own labels no better than its neighbour's (labels rolled by one
    along the batch) is ``TFD231`` (labels from other samples) or ``TFD232`` (the model ignores its context), told
    apart by whether the labels repeat their own inputs (masked-LM labels: whether they sit on their own inputs' mask
    tokens; there ``TFD232`` is info, the masked-LM plateau); a loss pinned at the floor ``ln(1 + (V-1) e^-w)`` that
    the logits' range ``w`` allows, above H, with every row at the same width, is ``TFD230`` (outputs squashed into a
    bounded range). Masked-LM labels (recognised at step 0: few supervised positions, most of them holding one input
    token, the mask) sit at H for a while before they learn, so their check runs at ``5 * check_step``.

    Alignment: with ``shift_labels=True`` (default) the logits at position ``t`` are scored against the label at
    ``t + 1``, as in causal LMs that shift internally (Hugging Face models, ``TinyGPT``) and take
    ``labels == input_ids``. Set ``shift_labels=False`` when labels are already aligned with the logits (shifted in
    the collator, classification, seq2seq decoders). The observed loss is the one the training step returned, and
    it has the last word: where the logits have a time dimension (not masked-LM labels), the recomputed statistics
    are taken under both alignments and the one the returned loss agrees with is used (an untrained model gives ln(V)
    under either; a pretrained one fed already-shifted targets gives its loss only under the right one). The copy
    check compares the argmax at ``t`` with the input token at ``t`` (``input_key``; the labels when
    ``shift_labels`` and the batch has no input ids).

    The loss where the bug lives: a squash or a temperature applied in ``training_step`` or in a loss module, between
    the model's output and the loss, leaves the recorded logits unbounded. So on the compared steps (the check and the
    first measuring steps at or after half-way and three quarters of the way to it) the loss the step returned is held
    against the recorded logits' own cross-entropy, under the label alignment those logits predict best. A
    disagreement at every compared step is explained: a loss pinned at the floor ``ln(1 + (V-1) e^-w)`` of some
    width ``w``, above what the labels' frequencies allow, while the logits learn and widen (``TFD233``); the
    cross-entropy of ``logits / T`` for one ``T`` (``TFD234``, info); label smoothing, an added term (z-loss,
    auxiliary loss), a constant factor (``loss / k`` when accumulating by hand) or a sum divided by every label
    position (silent); anything else is ``TFD235`` (info, both numbers).

    Nothing runs on other steps: hooks exist only during the forward of step 0, of the compared steps and of the
    check, the captured outputs are reduced to a few scalars in ``on_before_backward`` and released; the other
    measuring steps read the loss (and, on the first 8, count the labels) with one host transfer.

    Logged keys:

    | key | step | meaning |
    | --- | --- | --- |
    | `loss_at_init/observed` | 0 | the training step's loss, averaged over ranks (else the recomputed loss) |
    | `loss_at_init/expected` | 0 | ln(V) |
    | `loss_at_init/recomputed` | 0 | cross-entropy recomputed from the captured outputs and labels |
    | `loss_at_init/logit_std` | 0 | spread of the outputs across the vocabulary (root mean of per-row variances) |
    | `loss_at_init/supervised_frac` | 0 | fraction of label positions that are not `ignore_index` |
    | `loss_at_init/check_loss` | check | the training step's loss at the check (`check_step`, 5x for masked LM) |
    | `loss_at_init/copy_rate` | 0 and check | fraction of positions whose argmax is the current input token |
    | `loss_at_init/rolled_loss` | check | cross-entropy against the labels rolled by one sample along the batch |
    | `loss_at_init/loss_floor` | check | the lowest loss the logits' range allows, `ln(1 + (V-1) e^-range)` |
    | `loss_at_init/loss` | measuring steps | the training loss (the returned loss, undivided by accumulation) |
    | `loss_at_init/ln_vocab` | measuring steps | ln(V), the loss of a uniform guess |
    | `loss_at_init/unigram_entropy` | measuring steps, once known | entropy of the supervised labels' frequencies |
    | `loss_at_init/logits_loss` | compared steps, check | the recorded logits' cross-entropy (the loss should be it) |

    Findings: ``TFD220`` outputs are probabilities, ``TFD221`` outputs are log-probabilities, ``TFD222`` initial
    loss far above ln(V), ``TFD223`` far below, ``TFD224`` no supervised tokens, ``TFD225`` loss still at ln(V) at
    ``check_step``, ``TFD226`` the model copies its current input token, ``TFD227`` initial loss not finite,
    ``TFD229`` the returned loss is a multiple of the logits' cross-entropy (a sum, or divided twice), ``TFD230``
    the loss pinned at the floor of bounded outputs, ``TFD231`` labels from other samples, ``TFD232`` the model
    ignores its context (loss at the unigram entropy);
    ``TFD233`` the loss pinned at the floor of a bound applied after the forward, ``TFD234`` a temperature between the
    logits and the loss, ``TFD235`` a returned loss that is not the logits' cross-entropy for no known reason;
    ``TFD228`` when logits or labels cannot be found (it then stands aside); see ``docs/findings.md``.

    Args:
        on_finding: ``"warn"``, ``"stop"`` or ``"raise"`` (see :class:`~lightning_tfdebug.DebugCallback`).
        labels_key: where the labels are in the batch: a key, a dotted path (``"inputs.labels"``) or a tuple
            position (int). ``None`` (default) finds them with the pack's shared batch reader
            (:mod:`lightning_tfdebug.core.batch`: ``labels``, ``label_ids``, ``targets``, ``target``, ``tgt``, ``y``;
            in a tuple the integer tensor after the ids), then under ``label``, then as a tuple's last item.
        input_key: where the input token ids are (for the copy check): a key, dotted path or tuple position; ``None``
            (default) finds them (``input_ids``, ``tokens``, ...; the first 2-D integer tensor of a tuple), and uses
            the labels when the batch has none and ``shift_labels`` is set.
        logits_module: qualified name of the submodule whose output holds the logits; ``None``: found as described
            above.
        shift_labels: the logits at ``t`` predict the label at ``t + 1`` (see Alignment above); ignored when the
            logits have no time dimension (a classifier's ``(batch, classes)``).
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
        _check_key("labels_key", labels_key)
        _check_key("input_key", input_key)
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
        self.labels_key = labels_key
        self.input_key = input_key
        self.logits_module = logits_module
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
        self._init_done = False
        self._check_done = False
        self._init_copy_rate: float | None = None  # copy rate of the untrained model (step 0)
        self._armed: str | None = None  # "init" or "check" while a step is being captured
        self._armed_step = 0
        self._handles: list[RemovableHandle] = []
        self._replay = False  # compiled model: the armed step's logits come from an eager replay at its end
        self._replaying = False
        self._captured: dict[str, Tensor] = {}  # the root's or the named module's logits, and children's `.logits`
        self._raw: dict[str, Tensor] = {}  # direct children's plain tensor outputs, in call order (a fallback)
        # token rows without labels (a loss-only wrapper's inner call): the calls that took tokens, at any depth
        self._recorder: CallRecorder | None = None
        self._calls: list[RecordedCall] = []
        self._row_tokens: Tensor | None = None  # the tokens that call received (the copy check's inputs)
        self._token_rows = False  # the labels are the batch's token rows (read at step 0): count them for H
        self._output_types: dict[str, str] = {}
        self._batch: Any = None
        self._view: StepBatch | None = None  # the shared reading of the armed step's batch
        self._pl_module: pl.LightningModule | None = None
        self._collected: _Collected | None = None
        self._check_at = check_step  # 5 * check_step once step 0 shows masked-LM labels
        self._masked_lm = False
        self._vocab: int | None = vocab_size  # V, once known
        self._probabilities = False  # TFD220 at step 0: the bounded-output floor is that finding's
        self._history: list[tuple[int, float]] = []  # (step, loss) of the measuring steps, for the stall window
        self._measuring: int | None = None  # the step whose loss this batch reads (first micro-batch only)
        self._last_measured = -1
        self._label_counts: Tensor | None = None  # this rank's label counts over the first measured batches
        self._counted_batches = 0
        self._unigram: float | None = None  # the labels' unigram entropy (nats), reduced over ranks
        self._compared: list[int] = []  # the compared steps before the check that were armed
        self._readings: list[LossReading] = []  # the returned loss against the logits, on the compared steps

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
        self._armed, self._armed_step, self._batch, self._pl_module = phase, step, batch, pl_module
        self._view = step_batch(trainer, batch, self._keys)
        self._captured.clear()
        self._raw.clear()
        self._output_types.clear()
        if model_is_compiled(trainer, pl_module):
            # Hooks that come and go on compiled code make Dynamo recompile it (and a recompiled graph with them has
            # failed in AOT autograd): read the logits from an eager replay of this batch at its end instead.
            self._replay = True
            return
        self._replay = False
        self._record_token_calls(pl_module)
        for name, module in self._candidates(pl_module):
            self._handles.append(module.register_forward_hook(self._make_hook(name)))

    def _replay_outputs(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> Any:
        """Run ``training_step`` again on the batch, eagerly, under ``no_grad`` with the RNG restored and ``self.log``
        silenced, with the capture hooks on; returns what it returned (the loss the captured logits belong to).
        For compiled models, on the two armed steps only."""
        devices = [torch.cuda.current_device()] if torch.cuda.is_available() and torch.cuda.is_initialized() else []
        handles = [m.register_forward_hook(self._make_hook(n)) for n, m in self._candidates(pl_module)]
        self._record_token_calls(pl_module)
        self._replaying = True
        try:
            with (
                eager_model_calls(),
                torch.random.fork_rng(devices=devices),
                torch.no_grad(),
                trainer.precision_plugin.train_step_context(),
            ):
                return quiet_training_step(pl_module, batch, batch_idx)
        finally:
            self._replaying = False
            self._stop_recording()
            for handle in handles:
                handle.remove()

    def _candidates(self, pl_module: pl.LightningModule) -> list[tuple[str, nn.Module]]:
        if self.logits_module is not None:
            module = dict(pl_module.named_modules()).get(self.logits_module)
            return [(self.logits_module, module)] if module is not None else []
        return [("", pl_module), *pl_module.named_children()]

    def _make_hook(self, name: str):
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            if name in self._output_types or not (self._replaying or in_training_step(self._pl_module)):
                return  # the first call in the training step only; not another callback's probe forward
            self._output_types[name] = type(output).__name__
            child = self.logits_module is None and name != ""
            logits = logits_of(output, structured_only=child)
            if logits is not None:
                self._captured[name] = logits.detach()
            elif child:
                raw = logits_of(output)
                if raw is not None:
                    self._raw[name] = raw.detach()

        return hook

    def _record_token_calls(self, pl_module: pl.LightningModule) -> None:
        """Token rows without labels (``training_step`` returns ``self.model(batch)``, a wrapper that slices the rows
        and returns only the loss): record the calls that take tokens, at any depth, to find the inner call that
        returns the logits. A hook on every module, on the two armed steps only."""
        view = self._view
        if self.logits_module is not None or self.labels_key is not None or view is None or view.labels is not None:
            return
        if self._labels()[0] is not None:
            return  # labels of another kind (float targets, a tuple's last item): the labels path reports on them
        ids = view.input_ids
        if ids is None or ids.ndim != 2 or ids.is_floating_point():
            return
        module = pl_module

        def keep() -> bool:
            return self._replaying or in_training_step(module)  # not another callback's probe forward

        self._recorder = CallRecorder(pl_module, keep=keep, nested=True, want=takes_tokens).start()

    def _stop_recording(self) -> None:
        if self._recorder is not None:
            self._calls = self._recorder.stop()
            self._recorder = None

    def _remove_hooks(self) -> None:
        self._stop_recording()
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: Tensor) -> None:
        if self._armed is None or self._collected is not None or self._replay:
            return
        # The forward is over: remove the hooks (activation checkpointing re-runs forwards in backward), reduce the
        # captured outputs to a few device scalars and let the logits go, so they do not outlive the backward.
        self._remove_hooks()
        with torch.no_grad():
            self._collected = self._collect(pl_module)

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._remove_hooks()
        self._armed, self._batch, self._pl_module, self._collected = None, None, None, None
        self._view = None
        self._captured.clear()
        self._raw.clear()
        self._calls = []

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._remove_hooks()

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
            self._remove_hooks()
            loss = self._training_loss(trainer, pl_module, outputs)
            if self._replay and pl_module.automatic_optimization:
                try:
                    loss = loss_of(self._replay_outputs(trainer, pl_module, batch, batch_idx))
                except Exception:  # a training_step that cannot be replayed: nothing captured, stand aside below
                    self._captured.clear()
                    self._raw.clear()
            with torch.no_grad():
                collected = self._collected or self._collect(pl_module)  # no backward ran (manual optimization)
                if phase == "init":
                    self._measure_init(trainer, collected, loss, step)
                elif phase == "compare":
                    self._measure_compare(trainer, collected, loss, step)
                else:
                    self._measure_check(trainer, collected, loss, step)
        finally:
            self._armed, self._batch, self._pl_module, self._collected = None, None, None, None
            self._view = None
            self._captured.clear()
            self._raw.clear()

    def _compare_steps(self) -> tuple[int, ...]:
        """The measuring steps before the check on which the returned loss is compared with the recorded logits (the
        first ones at or after :data:`COMPARE_FRACTIONS` of the way to the check); decided from steps alone."""
        if self._check_at is None:
            return ()
        n = self._interval
        steps = (-(-math.ceil(self._check_at * f) // n) * n for f in COMPARE_FRACTIONS)
        return tuple(sorted({s for s in steps if 0 < s < self._check_at}))

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
        """A measuring step between the two captured ones: the training loss and, while counting, the labels."""
        loss = self._training_loss(trainer, pl_module, outputs)
        device = loss.device if loss is not None else _device_of(pl_module)
        with torch.no_grad():
            view = step_batch(trainer, batch, self._keys)
            labels = view.labels
            if labels is None and self._token_rows:
                labels = self._row_targets(view)
            self._count_labels(labels, device)  # before the declaration: these counts travel in it
            self._reduce(trainer, {}, (), loss, True, device, lambda host: self._keep_loss(trainer, host, step))

    def _keep_loss(self, trainer: pl.Trainer, host: dict[str, float], step: int) -> float:
        """Keep this step's loss for the stall window and log the dashboard keys; returns the loss (NaN: none)."""
        loss = host["loss_sum"] / host["loss_n"] if host["loss_n"] else float("nan")
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

    def _inputs(self, pl_module: pl.LightningModule) -> tuple[Tensor | None, Tensor | None, str]:
        """The captured logits and the labels, or a reason naming the argument to set.

        Where the logits come from, first match wins: the named ``logits_module``; the LightningModule's forward;
        a direct child's ``.logits``/``"logits"`` output; else (a ``training_step`` that calls ``self.model(x)``
        rather than ``self(x)``) the last direct child to return a plain tensor shaped like the labels plus a class
        dimension wider than every label.
        """
        if self.logits_module is not None:
            logits = self._captured.get(self.logits_module)
        else:
            logits = self._captured.get("") if "" in self._captured else next(iter(self._captured.values()), None)
        if logits is None and self.logits_module is None and self._raw:
            labels, _ = self._labels()
            if labels is not None:
                logits = self._plain_child_logits(labels)
        if logits is None:
            if self.logits_module is not None:
                if self.logits_module not in dict(pl_module.named_modules()):
                    return None, None, f"`logits_module={self.logits_module!r}` is not a submodule of the model"
                seen = self._output_types.get(self.logits_module)
                what = f"returned a {seen} without logits" if seen else "did not run in the training step"
                return (
                    None,
                    None,
                    f"`logits_module={self.logits_module!r}` {what}; set it to the module that returns them",
                )
            children = [n for n, _ in pl_module.named_children()]
            seen = self._output_types.get("")
            what = (
                f"the LightningModule's forward returned a {seen} without logits"
                if seen
                else "the LightningModule's forward was not called in the training step"
            )
            return (
                None,
                None,
                (
                    f"{what}, and no direct child returned logits (a `.logits` output, or a tensor shaped like the "
                    f"labels plus a class dimension); set `logits_module` to the submodule "
                    f"that returns the logits (direct children: {', '.join(children[:12]) or 'none'})"
                ),
            )
        labels, reason = self._labels()
        if labels is None:
            return None, None, f"{reason}; set `labels_key` to where the labels are (a dict key or a tuple position)"
        if labels.is_floating_point():
            return (
                None,
                None,
                (
                    f"the labels are {labels.dtype} values, not class indices: LossAtInit checks a cross-entropy over "
                    "V classes, which this loss (soft or multi-label targets, regression) is not; if the class "
                    "indices are elsewhere in the batch, set `labels_key`"
                ),
            )
        aligned = logits_for_labels(logits, labels)
        if aligned is None:
            return (
                None,
                None,
                (
                    f"the labels {tuple(labels.shape)} do not fit the logits {tuple(logits.shape)} (expected the "
                    "logits' shape without the last dimension); set `labels_key` or `logits_module`"
                ),
            )
        return aligned, labels, ""

    def _labels(self) -> tuple[Tensor | None, str]:
        """The labels, from the shared reading of the batch (``labels_key``, else the usual names).

        Left at ``None``, the key also falls back to a non-integer tensor under those names, to ``label`` and to the
        last item of a tuple batch
        (``(features, labels)``, where no token ids say which item the labels follow); a wrong guess fails the shape
        test against the logits, which names ``labels_key``.
        """
        assert self._view is not None
        labels = self._view.labels
        if labels is not None:
            return labels, ""
        if self.labels_key is not None:
            return None, _missing(self._batch, self.labels_key)
        # a float tensor under a labels name is not taken by the shared reader; here it is, so that the message can
        # say these are not class indices
        leaves = self._view.fields.leaves
        fallback = next(
            (
                value
                for name in (*LABELS_KEYS, "label")
                for path, value in leaves.items()
                if path.rsplit(".", 1)[-1] == name and isinstance(value, Tensor)
            ),
            None,
        )
        batch = self._batch
        if not isinstance(fallback, Tensor) and isinstance(batch, (tuple, list)) and len(batch) >= 2:
            fallback = batch[-1]
        if isinstance(fallback, Tensor):
            return fallback, ""
        names = ", ".join((*LABELS_KEYS, "label"))
        return None, f"{_missing(batch, 'labels')} (nor under {names})"

    def _shift(self, logits: Tensor) -> bool:
        """Whether to score position ``t`` against label ``t + 1``: never when the logits have no time dimension,
        nor once step 0 showed masked-LM labels (aligned with the logits by construction)."""
        return self.shift_labels and logits.ndim >= 3 and not self._masked_lm

    def _plain_child_logits(self, labels: Tensor) -> Tensor | None:
        """The last direct child's plain tensor output that can be the logits for ``labels``, or None.

        Shape alone does not tell logits from hidden states (an embedding's or a final norm's output is
        ``(batch, time, d_model)`` too), so the class dimension must also exceed every supervised label.
        """
        views = (logits_for_labels(t, labels) for t in self._raw.values())
        fitting = [t for t in views if t is not None and t.shape[-1] > 1]
        if not fitting:
            return None
        # host sync: on the two measured steps only, and only when the logits come from this fallback
        top = int(labels.masked_fill(labels == self.ignore_index, -1).max()) if labels.numel() else -1
        return next((t for t in reversed(fitting) if t.shape[-1] > top), None)

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
        loss_ok = loss is not None
        values = [stats.get(k, zero).float().to(device) for k in keys]
        values += [
            loss.detach().float().reshape(()).to(device) if loss_ok else zero,
            torch.tensor(float(loss_ok), device=device),
            torch.tensor(float(ok), device=device),
        ]
        names = (*keys, "loss_sum", "loss_n", "ok")
        counting = self._label_counts is not None and self._counted_batches > 0
        packed = torch.stack(values)
        if counting:  # the label counts travel in the same reduction (a copy: later counts do not change it)
            packed = torch.cat([packed, self._label_counts.to(device)])  # type: ignore[union-attr]

        def conclude(reduced: Reduced) -> None:
            with torch.no_grad():
                sums = reduced.sums.float()
                scalars: dict[str, Tensor] = {k: sums[i] for i, k in enumerate(names)}
                if counting:
                    scalars["unigram_entropy"] = unigram_entropy(sums[len(names) :])
                host = self.to_host(scalars)  # host sync: the one transfer of this measuring step
                then(host)

        self.reduce_then(trainer, conclude, device, sums=packed)

    def _collect(self, pl_module: pl.LightningModule) -> _Collected:
        """Sums and counts (device scalars) from the captured outputs and the labels, for the armed phase; then the
        captured tensors are released."""
        logits, labels, reason = self._inputs(pl_module)
        self._row_tokens = None
        if logits is None and self._calls and self._view is not None and self._view.input_ids is not None:
            # token rows without labels: the logits of the call that received the rows (or rows[:, :-1]), the labels
            # its own loss derives from them (host syncs choosing the call: armed steps only)
            rows = token_row_logits(self._calls, self._view.input_ids, self._view.attention_mask, self.ignore_index)
            if rows is not None:
                logits, labels, self._row_tokens = (t.detach() for t in rows)
                self._token_rows, reason = self._token_rows or self._armed == "init", ""
        self._calls = []
        found = _Collected(
            stats={},
            reason=reason,
            ok=logits is not None,
            vocab=self.vocab_size or (int(logits.shape[-1]) if logits is not None else 0),
            device=logits.device if logits is not None else _device_of(pl_module),
            shifted=logits is not None and self._shift(logits),
        )
        if logits is not None and labels is not None:
            sums = init_loss_sums(
                logits,
                labels,
                shift_labels=self._shift(logits),
                ignore_index=self.ignore_index,
                label_smoothing=self.label_smoothing,
                max_rows=self.max_rows,
            )
            shift = self._shift(logits)
            # either alignment is possible (a time dimension, not masked-LM labels): the sums are taken under both,
            # and the loss the training step returned picks one on the host (`follow_returned_loss`)
            alignments = (
                {"": shift, OTHER_ALIGNMENT: not shift} if logits.ndim >= 3 and not self._masked_lm else {"": shift}
            )
            inputs = self._current_tokens(labels)
            fits = inputs is not None and tuple(inputs.shape) == tuple(labels.shape)
            if self._armed == "init":
                found.stats = sums
                if OTHER_ALIGNMENT in alignments:
                    other = init_loss_sums(
                        logits,
                        labels,
                        shift_labels=not shift,
                        ignore_index=self.ignore_index,
                        label_smoothing=self.label_smoothing,
                        max_rows=self.max_rows,
                    )
                    found.stats.update({OTHER_ALIGNMENT + k: other[k] for k in ("ce_sum", "ce_count")})
                if fits:  # masked-LM labels: most supervised inputs are one token (the mask)
                    found.stats.update(masked_input_sums(inputs, labels, found.vocab, self.ignore_index))
            elif self._armed == "check":
                found.stats = {"ce_sum": sums["ce_sum"], "ce_count": sums["ce_count"]}
                for prefix, shifted in alignments.items():
                    options = {"shift_labels": shifted, "ignore_index": self.ignore_index, "max_rows": self.max_rows}
                    rolled = rolled_label_sums(logits, labels, **options)
                    if (
                        prefix
                    ):  # the own labels' cross-entropy under this alignment, over the rows `init_loss_sums` takes
                        ce = init_loss_sums(logits, labels, label_smoothing=self.label_smoothing, **options)
                        rolled.update({"ce_sum": ce["ce_sum"], "ce_count": ce["ce_count"]})
                    rolled.update(bounded_floor_sums(logits, labels, **options))
                    found.stats.update({prefix + k: v for k, v in rolled.items()})
                if fits and self._view is not None and self._view.input_ids is not None and self._masked_lm:
                    # masked-LM labels never repeat their inputs (the input there is the mask): they belong to their
                    # own inputs when their supervised positions are where those inputs hold the mask token
                    own_mask = masked_input_sums(inputs, labels, found.vocab, self.ignore_index)
                    rolled_mask = masked_input_sums(inputs.roll(1, 0), labels, found.vocab, self.ignore_index)
                    found.stats.update(
                        own_match=own_mask["mask_share_top"],
                        rolled_match=rolled_mask["mask_share_top"],
                        match_count=own_mask["mask_share_count"],
                    )
                elif fits and self._view is not None and self._view.input_ids is not None:
                    found.stats.update(label_input_match_sums(labels, inputs, self.ignore_index))
                if fits and not self._init_done:  # step 0 unseen: its masked-LM reading is taken here instead
                    late = masked_input_sums(inputs, labels, found.vocab, self.ignore_index)
                    found.stats.update(
                        late_mask_top=late["mask_share_top"],
                        late_mask_count=late["mask_share_count"],
                        late_supervised=(labels != self.ignore_index).sum(dtype=torch.float32),
                        late_positions=torch.tensor(float(labels.numel()), device=labels.device),
                    )
            if self._armed in ("compare", "check"):  # the returned loss against these logits (and transforms of them)
                found.stats.update(
                    loss_transform_sums(
                        logits,
                        labels,
                        shift_labels=shift,
                        ignore_index=self.ignore_index,
                        max_rows=self.max_rows,
                        both_alignments=OTHER_ALIGNMENT in alignments,
                    )
                )
            # the copy rate at init too: with tied input/output embeddings an untrained model already predicts its
            # current token, and only a rise from there says the model learned to copy
            copy_check = fits and logits.ndim == 3 and tuple(inputs.shape) == tuple(logits.shape[:2])
            if copy_check and self._armed != "compare":
                found.stats.update(copy_sums(logits, inputs, labels != self.ignore_index, max_rows=self.max_rows))
            # for the unigram counts: the rows' next-token targets (token rows), else the labels
            found.labels = labels if self._row_tokens is None else self._row_targets(self._view)
        self._captured.clear()
        self._raw.clear()
        self._row_tokens = None
        return found

    def _stand_aside_if_missing(self, trainer: pl.Trainer, host: dict[str, float], reason: str, step: int) -> bool:
        if host["ok"] >= world_size():
            return False
        text = reason or "another rank could not find the logits or labels (see its warning)"
        self.emit_code(
            trainer,
            "TFD228",
            f"LossAtInit cannot read the model's outputs or labels: {text}.",
            {"labels_key": self.labels_key, "logits_module": self.logits_module},
            step=step,
        )
        self.stand_aside(
            text + ".",
            setting=next(
                (s for s in ("`labels_key`", "`logits_module`") if s in text), "`labels_key` or `logits_module`"
            ),
        )
        return True

    def _emit(self, trainer: pl.Trainer, verdicts: list[Verdict], step: int) -> None:
        for verdict in verdicts:  # from reduced values: every rank reaches the same findings
            self.emit_code(
                trainer,
                verdict.code,
                verdict.message,
                verdict.evidence,
                hint=verdict.hint,
                severity=verdict.severity,
                step=step,
            )

    def _measure_init(self, trainer: pl.Trainer, found: _Collected, loss: Tensor | None, step: int) -> None:
        self._reduce(
            trainer,
            found.stats,
            _INIT_KEYS,
            loss,
            found.ok,
            found.device,
            lambda host: self._conclude_init(trainer, found, host, step),
        )

    def _conclude_init(self, trainer: pl.Trainer, found: _Collected, host: dict[str, float], step: int) -> None:
        if self._stand_aside_if_missing(trainer, host, found.reason, step):
            return
        returned = host["loss_sum"] / host["loss_n"] if host["loss_n"] else float("nan")
        host, other_alignment = follow_returned_loss(host, returned)
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
        verdicts = classify_init_loss(
            init,
            init_tolerance=self.init_tolerance,
            ignore_index=self.ignore_index,
            shifted=found.shifted != other_alignment,
            accumulate_grad_batches=trainer.accumulate_grad_batches,
            ranks=world_size(),
            manual_optimization=not trainer.lightning_module.automatic_optimization,
        )
        self._probabilities = any(v.code == "TFD220" for v in verdicts)
        self._emit(trainer, verdicts, step)

    def _measure_compare(self, trainer: pl.Trainer, found: _Collected, loss: Tensor | None, step: int) -> None:
        """A compared step before the check: the returned loss, the recorded logits' cross-entropy and the sums that
        may explain a difference, kept for the check (and the labels counted, as on any measuring step)."""
        self._count_labels(found.labels, found.device)  # before the declaration: these counts travel in it

        def conclude(host: dict[str, float]) -> None:
            if self._stand_aside_if_missing(trainer, host, found.reason, step):
                return
            self._vocab = self._vocab or found.vocab
            self._add_reading(trainer, host, self._keep_loss(trainer, host, step), step)

        self._reduce(trainer, found.stats, _TRANSFORM_KEYS, loss, found.ok, found.device, conclude)

    def _add_reading(self, trainer: pl.Trainer, host: dict[str, float], loss: float, step: int) -> None:
        reading = loss_reading(host, loss, step)
        if reading is not None:
            self._readings = [*self._readings, reading][-(len(COMPARE_FRACTIONS) + 1) :]
            self.log_scalars(trainer, {"loss_at_init/logits_loss": reading.ce}, step=step)

    def _late_masked_lm(self, host: dict[str, float], step: int) -> bool:
        """A run resumed without this callback's state never showed step 0, where masked-LM labels are recognised and
        their check moved to ``MASKED_LM_CHECK_FACTOR * check_step`` (a masked LM sits at the unigram entropy far
        longer than a causal LM). Recognise them at the check instead, from the same reading; True when the check
        was moved (nothing is judged at this step)."""
        if self._masked_lm or not host["late_mask_count"] or not host["late_positions"]:
            return False
        share = host["late_mask_top"] / host["late_mask_count"]
        supervised = host["late_supervised"] / host["late_positions"]
        if not (share >= MASKED_LM_SHARE and 0 < supervised <= MASKED_LM_SUPERVISED):
            return False
        self._masked_lm = True
        later = MASKED_LM_CHECK_FACTOR * self.check_step if self.check_step is not None else None
        if later is None or step >= later:
            return False  # judged now, as a masked LM
        self._check_at, self._check_done = later, False
        return True

    def _measure_check(self, trainer: pl.Trainer, found: _Collected, loss: Tensor | None, step: int) -> None:
        # V is known alike on every rank (or on none); before the declaration: these counts travel in it
        self._count_labels(found.labels, found.device)
        self._reduce(
            trainer,
            found.stats,
            (*_CHECK_KEYS, *_TRANSFORM_KEYS),
            loss,
            found.ok,
            found.device,
            lambda host: self._conclude_check(trainer, found, host, step),
        )

    def _conclude_check(self, trainer: pl.Trainer, found: _Collected, host: dict[str, float], step: int) -> None:
        if self._stand_aside_if_missing(trainer, host, found.reason, step):
            return
        returned = host["loss_sum"] / host["loss_n"] if host["loss_n"] else float("nan")
        host, _ = follow_returned_loss(host, returned)
        self._vocab = self._vocab or found.vocab
        if not self._init_done and self._late_masked_lm(host, step):
            self._keep_loss(trainer, {**host, "loss_sum": returned, "loss_n": 1.0}, step)
            return  # a masked LM seen first here: its check moves to its own later step, as step 0 would have set
        window = [(s, v) for s, v in self._history if s >= step // 2]  # measured before this check, in its window
        nan = float("nan")
        recomputed = host["ce_sum"] / host["ce_count"] if host["ce_count"] else nan
        current = host["loss_sum"] / host["loss_n"] if host["loss_n"] else recomputed
        self._keep_loss(trainer, {**host, "loss_sum": current, "loss_n": 1.0}, step)
        expected, unigram = uniform_loss(found.vocab), self._unigram if self._unigram is not None else nan
        metrics = {"loss_at_init/check_loss": current}
        copy_rate = repeat_rate = nan
        if host["count"]:  # reduced: every rank takes the same branch
            copy_rate, repeat_rate = host["copies"] / host["count"], host["repeats"] / host["count"]
            metrics["loss_at_init/copy_rate"] = copy_rate
        own = rolled = floor = logit_range = range_spread = nan
        if host["rolled_count"]:
            own, rolled = host["own_ce_sum"] / host["rolled_count"], host["rolled_ce_sum"] / host["rolled_count"]
            metrics["loss_at_init/rolled_loss"] = rolled
        if host["floor_count"]:
            floor, logit_range = host["floor_sum"] / host["floor_count"], host["range_sum"] / host["floor_count"]
            spread_sq = host["range_sq_sum"] / host["floor_count"] - logit_range**2
            range_spread = math.sqrt(max(spread_sq, 0.0)) / logit_range if logit_range > 0 else nan
            metrics["loss_at_init/loss_floor"] = floor
        self.log_scalars(trainer, metrics, step=step)
        verdicts = check_verdicts(
            current,
            expected,
            step,
            window=window,
            unigram_entropy=unigram,
            stall_tolerance=self.stall_tolerance,
            copy_rate=copy_rate,
            repeat_rate=repeat_rate,
            init_copy_rate=self._init_copy_rate,
            copy_threshold=self.copy_threshold,
            learning_rates=[group["lr"] for opt in trainer.optimizers for group in opt.param_groups],
            shift_labels=self.shift_labels,
        )
        if not self._probabilities:  # exact probabilities are TFD220's, found at step 0
            bounded = bounded_output_verdict(
                recomputed,
                floor,
                logit_range,
                expected,
                unigram,
                step,
                stall_tolerance=self.stall_tolerance,
                range_spread=range_spread,
            )
            verdicts += [bounded] if bounded is not None else []
        matched = host["match_count"]
        context = context_verdict(
            own,
            rolled,
            unigram,
            step,
            own_match=host["own_match"] / matched if matched else nan,
            rolled_match=host["rolled_match"] / matched if matched else nan,
            flat=flat_window(window, current, expected, self.stall_tolerance),
            window_steps=step - min((s for s, _ in window), default=step),
            masked=self._masked_lm,
        )
        verdicts += [context] if context is not None else []
        # the returned loss against the recorded logits, on this and the compared steps before it
        self._add_reading(trainer, host, returned, step)
        transform = loss_transform_verdict(self._readings, found.vocab, unigram)
        if transform is not None and transform.code == "TFD233":
            # the loss does not train these logits: how they relate to the labels says nothing about the labels
            verdicts = [v for v in verdicts if v.code not in ("TFD231", "TFD232")]
        verdicts += [transform] if transform is not None else []
        self._emit(trainer, verdicts, step)

    def _row_targets(self, view: StepBatch | None) -> Tensor | None:
        """Token rows without labels: every token after the first is a next-token target (padding excluded)."""
        ids = None if view is None else view.input_ids
        if ids is None or ids.ndim != 2 or ids.is_floating_point():
            return None
        mask = view.attention_mask  # type: ignore[union-attr]
        targets = ids[:, 1:]
        return targets if mask is None else targets.masked_fill(mask[:, 1:] == 0, self.ignore_index)

    def _current_tokens(self, labels: Tensor) -> Tensor | None:
        """The input token ids, for the copy check: the tokens the recorded call received (token rows without
        labels); from the shared reading (``input_key``, else found by name or as a tuple's first 2-D integer
        tensor); else, with ``shift_labels``, the labels (a causal LM's labels mirror its inputs)."""
        assert self._view is not None
        if self._row_tokens is not None:
            return self._row_tokens
        inputs = self._view.input_ids
        if inputs is not None and not inputs.is_floating_point():
            return inputs
        return labels if self.shift_labels else None

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
        self._init_done = bool(state_dict.get("init_done", False))
        self._check_done = bool(state_dict.get("check_done", False))
        rate = state_dict.get("init_copy_rate")
        self._init_copy_rate = float(rate) if rate is not None else None
        self._check_at = state_dict.get("check_at", self.check_step)
        self._masked_lm = bool(state_dict.get("masked_lm", False))
        self._vocab = state_dict.get("vocab") or self._vocab
        self._unigram = state_dict.get("unigram_entropy")
        self._label_counts = None
        self._counted_batches = _UNIGRAM_BATCHES if self._unigram is not None else 0
        self._history = [(int(s), float(v)) for s, v in state_dict.get("history", [])]
        self._probabilities = bool(state_dict.get("probabilities", False))
        self._token_rows = bool(state_dict.get("token_rows", False))
        self._compared = [int(s) for s in state_dict.get("compared", [])]
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


def _device_of(module: nn.Module) -> torch.device:
    for p in module.parameters():
        return p.device
    return torch.device("cpu")
