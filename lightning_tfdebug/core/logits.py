"""The logits a training step computed and the labels they are scored against, read on the steps a callback arms.

:class:`LogitsCapture` reads them from the step's one recording of the calls the real ``training_step`` made
(:func:`~lightning_tfdebug.core.calls.record_step`, shared with MaskProbe and AttentionProbe; for a compiled model,
the calls at compiled code's boundaries only). Where the logits are, first match wins: the named
``logits_module``; the LightningModule's own forward; a direct child's ``.logits`` output; the last direct child to
return a plain tensor shaped like the labels plus a class dimension wider than every label; for token rows without
labels (a loss-only wrapper), the call that took the rows
(:func:`~lightning_tfdebug.primitives.call_finder.find_model_call`).
When nothing fits, :class:`Captured` says why, naming the argument to set.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor, nn

from lightning_tfdebug.core.base import check_choice
from lightning_tfdebug.core.calls import StepRecording, record_step
from lightning_tfdebug.primitives.batch import LABELS_KEYS, StepBatch, logits_for_labels, logits_of, loss_of
from lightning_tfdebug.primitives.call_finder import find_model_call, model_kind
from lightning_tfdebug.primitives.calls import RecordedCall, takes_tokens


def missing_field(batch: Any, key: str | int) -> str:
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


def check_capture_args(
    labels_key: Any, input_key: Any, logits_module: Any, shift_labels: Any = True, model_kind: Any = None
) -> None:
    """Raise unless the keys can name a batch tensor (a key or dotted path, a tuple position, or None),
    ``logits_module`` a submodule (a name, or None), ``shift_labels`` is a bool and ``model_kind`` a kind or None."""
    for name, value in (("labels_key", labels_key), ("input_key", input_key)):
        if not (value is None or (isinstance(value, str) and value) or (type(value) is int and value >= 0)):
            raise TypeError(
                f"`{name}` must be a batch key or dotted path (str), a tuple position (int >= 0) or None (found by its "
                f"usual names); got {value!r}."
            )
    if logits_module is not None and not isinstance(logits_module, str):
        raise TypeError(f"`logits_module` must be a submodule name (str) or None; got {logits_module!r}.")
    if not isinstance(shift_labels, bool):
        raise TypeError(f"`shift_labels` must be True or False; got {shift_labels!r}.")
    check_choice("model_kind", model_kind, (None, "decoder", "encoder", "encoder-decoder"))


def module_device(module: nn.Module) -> torch.device:
    """The device of the module's first parameter (CPU when it has none)."""
    for p in module.parameters():
        return p.device
    return torch.device("cpu")


def row_targets(view: StepBatch | None, ignore_index: int) -> Tensor | None:
    """Token rows without labels: every token after the first is a next-token target (padding excluded)."""
    ids = None if view is None else view.input_ids
    if view is None or ids is None or ids.ndim != 2 or ids.is_floating_point():
        return None
    mask = view.attention_mask
    targets = ids[:, 1:]
    return targets if mask is None else targets.masked_fill(mask[:, 1:] == 0, ignore_index)


def training_loss(trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any) -> Tensor | None:
    """The loss ``training_step`` returned (``outputs``), undivided by gradient accumulation (Lightning divides an
    automatically optimized loss by ``accumulate_grad_batches``); None when it returned none."""
    loss = loss_of(outputs)
    if loss is not None and pl_module.automatic_optimization:
        loss = loss * trainer.accumulate_grad_batches
    return loss


@dataclass
class Captured:
    """What one armed step's forward showed: the logits and the labels they are scored against, or why not.

    Attributes:
        logits: the captured logits, shaped like the labels plus a class dimension; None when not found.
        labels: the labels; None when not found.
        reason: why the logits or labels cannot be read, naming the argument to set ("" when both were found).
        inputs: the input token ids for the copy check: the ids the token-row call received, the batch's ids, or
            (with ``shift_labels``) the labels, which mirror a causal LM's inputs; None when there are none.
        ids_in_batch: the batch has token ids (``inputs`` are not the labels standing in for them).
        token_rows: the logits and labels are those of the call that took the batch's token rows.
        targets: the labels to count for the unigram entropy (the rows' next-token targets for token rows).
    """

    logits: Tensor | None
    labels: Tensor | None
    reason: str
    inputs: Tensor | None = None
    ids_in_batch: bool = False
    token_rows: bool = False
    targets: Tensor | None = None


class LogitsCapture:
    """Finds the logits and labels of the training steps it is armed on (see the module's docstring).

    Args:
        logits_module: qualified name of the submodule whose output holds the logits; None: found.
        labels_key: where the labels are (used to decide whether to look for token rows, and in messages).
        ignore_index: the label value that is not supervised.
        kind: the model's kind (``model_kind=``); an encoder-decoder's copy check reads its decoder's input. None:
            read from the model's config.
    """

    def __init__(
        self, logits_module: str | None, labels_key: str | int | None, ignore_index: int, kind: str | None = None
    ) -> None:
        self.logits_module = logits_module
        self.labels_key = labels_key
        self.ignore_index = ignore_index
        self.kind = kind
        self.read_kind = "unknown"  # the kind the last read() used
        self._decoder_input: Tensor | None = None  # an encoder-decoder's `decoder_input_ids`: its copy check's inputs
        self.view: StepBatch | None = None  # the shared reading of the armed step's batch
        self._recording: StepRecording | None = None
        self._calls: list[RecordedCall] = []  # token rows without labels: the calls that took tokens, at any depth
        self._captured: dict[str, Tensor] = {}  # the root's or the named module's logits, and children's `.logits`
        self._raw: dict[str, Tensor] = {}  # direct children's plain tensor outputs, in call order (a fallback)
        self._output_types: dict[str, str] = {}
        self._batch: Any = None
        self._pl_module: pl.LightningModule | None = None

    # ------------------------------------------------------------------ arming
    def arm(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, view: StepBatch) -> None:
        """Read this step's forward from the step's one recording of its calls (:func:`record_step`): the candidates'
        calls, and for token rows without labels the calls that take tokens at any depth."""
        self.clear()
        self._batch, self.view, self._pl_module = batch, view, pl_module
        candidates = {id(m) for _, m in self._candidates(pl_module)}
        rows = self._wants_token_rows()

        def want(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
            return id(module) in candidates or (rows and takes_tokens(module, args, kwargs))

        self._recording = record_step(trainer, pl_module, batch, self, want)

    @property
    def compiled(self) -> bool:
        """The armed step's model is compiled: only the calls at compiled code's boundaries were recorded."""
        return self._recording is not None and self._recording.compiled

    @property
    def held(self) -> int:
        """How many captured output tensors are held now (0 outside an armed step's forward)."""
        return len(self._captured) + len(self._raw)

    def stop(self) -> None:
        """The forward is over: read the candidates' outputs from the recording (the first reader removes its hooks:
        activation checkpointing re-runs forwards in backward) and let the recording go."""
        recording, self._recording = self._recording, None
        if recording is None:
            return
        try:
            calls = recording.calls()
            names = {id(m): n for n, m in self._candidates(self._pl_module)} if self._pl_module is not None else {}
            # in the order the calls ended: under DDP, Lightning calls the module around ``training_step`` itself
            for call in sorted(calls, key=lambda c: c.finished):
                name = names.get(id(call.module))
                if name is not None:
                    self._take(name, call)
            if self._wants_token_rows():
                self._calls = calls
        finally:
            recording.done(self)

    def clear(self) -> None:
        """Let the recording, every captured tensor and the batch go."""
        self.stop()
        self._captured.clear()
        self._raw.clear()
        self._output_types.clear()
        self._calls = []
        self._decoder_input = None
        self._batch, self.view, self._pl_module = None, None, None

    def _candidates(self, pl_module: pl.LightningModule) -> list[tuple[str, nn.Module]]:
        if self.logits_module is not None:
            module = dict(pl_module.named_modules()).get(self.logits_module)
            return [(self.logits_module, module)] if module is not None else []
        return [("", pl_module), *pl_module.named_children()]

    def _take(self, name: str, call: RecordedCall) -> None:
        """The first call of candidate ``name`` in the training step: its logits (or a child's plain tensor)."""
        if name in self._output_types:
            return
        output, kwargs = call.output, call.kwargs
        self._output_types[name] = type(output).__name__
        if isinstance(kwargs.get("decoder_input_ids"), Tensor):
            self._decoder_input = kwargs["decoder_input_ids"].detach()
        child = self.logits_module is None and name != ""
        logits = logits_of(output, structured_only=child)
        if logits is not None:
            self._captured[name] = logits.detach()
        elif child:
            raw = logits_of(output)
            if raw is not None:
                self._raw[name] = raw.detach()

    def _wants_token_rows(self) -> bool:
        """Token rows without labels (a wrapper that slices the rows and returns only the loss): the calls that take
        tokens, at any depth, are read too."""
        view = self.view
        if self.logits_module is not None or self.labels_key is not None or view is None or view.labels is not None:
            return False
        if self._labels()[0] is not None:
            return False  # labels of another kind (float targets, a tuple's last item): the labels path reports on them
        ids = view.input_ids
        return ids is not None and ids.ndim == 2 and not ids.is_floating_point()

    # ------------------------------------------------------------------ reading
    def read(self, pl_module: pl.LightningModule, shift_labels: bool) -> Captured:
        """The logits and labels of the armed step, then the captured tensors are released. ``shift_labels``: without
        token ids the labels stand in for the copy check's inputs. Host syncs: armed steps only (choosing the token-row
        call, the plain-tensor fallback's largest label)."""
        logits, labels, reason = self._inputs(pl_module)
        tokens = None
        view = self.view
        if logits is None and self._calls and view is not None and view.input_ids is not None:
            # token rows without labels: the logits of the call that received the rows (or rows[:, :-1]), the labels
            # its own loss derives from them
            ids, mask = view.input_ids, view.attention_mask
            found = find_model_call(self._calls, ids, mask, None, self.ignore_index, model=pl_module)
            rows = None if isinstance(found, str) else found.token_rows(ids, mask)
            if isinstance(found, str):  # the shared finder's reading of the model, MaskProbe's too
                reason = f"{found}; set `logits_module` to the submodule that returns the logits"
            elif rows is not None:
                logits, labels, tokens = (t.detach() for t in rows)
                reason = ""
        self._calls = []
        self._captured.clear()
        self._raw.clear()
        got = Captured(logits, labels, reason, ids_in_batch=view is not None and view.input_ids is not None)
        if logits is None or labels is None:
            return got
        got.token_rows = tokens is not None
        got.inputs = tokens if tokens is not None else self._batch_tokens(labels, shift_labels)
        self.read_kind = self.kind or model_kind(None, model=pl_module)[0]
        if tokens is None and self.read_kind == "encoder-decoder":
            # the copy check reads the token the decoder sees at t, not the encoder's (None: shifted inside the model)
            got.inputs, self._decoder_input = self._decoder_input, None
        got.targets = labels if tokens is None else row_targets(view, self.ignore_index)
        return got

    def _batch_tokens(self, labels: Tensor, shift_labels: bool) -> Tensor | None:
        """The batch's input token ids; else, with ``shift_labels``, the labels (a causal LM's mirror its inputs)."""
        inputs = None if self.view is None else self.view.input_ids
        if inputs is not None and not inputs.is_floating_point() and inputs is not labels:
            return inputs  # (a tuple of float features and labels: its only integer tensor is the labels)
        if self.view is not None and any(
            isinstance(t, Tensor) and t.is_floating_point() and t.ndim >= 2 and t.shape[:2] == labels.shape[:2]
            for t in self.view.fields.leaves.values()
        ):
            return None  # the model reads float features per position (not tokens): the labels mirror nothing
        return labels if shift_labels else None

    def _inputs(self, pl_module: pl.LightningModule) -> tuple[Tensor | None, Tensor | None, str]:
        """The captured logits and the labels, or a reason naming the argument to set."""
        if self.logits_module is not None:
            logits = self._captured.get(self.logits_module)
        else:
            logits = self._captured.get("") if "" in self._captured else next(iter(self._captured.values()), None)
        if logits is None and self.logits_module is None and self._raw:
            labels, _ = self._labels()
            if labels is not None:
                logits = self._plain_child_logits(labels)
        if logits is None:
            return None, None, self._no_logits(pl_module)
        labels, reason = self._labels()
        if labels is None:
            return None, None, f"{reason}; set `labels_key` to where the labels are (a dict key or a tuple position)"
        if labels.is_floating_point():
            reason = (
                f"the labels are {labels.dtype} values, not class indices: LossAtInit checks a cross-entropy over V "
                "classes, which this loss (soft or multi-label targets, regression) is not; if the class indices are "
                "elsewhere in the batch, set `labels_key`"
            )
            return None, None, reason
        aligned = logits_for_labels(logits, labels)
        if aligned is None:
            reason = (
                f"the labels {tuple(labels.shape)} do not fit the logits {tuple(logits.shape)} (expected the logits' "
                "shape without the last dimension); set `labels_key` or `logits_module`"
            )
            return None, None, reason
        return aligned, labels, ""

    def _no_logits(self, pl_module: pl.LightningModule) -> str:
        """Why no logits were captured, naming ``logits_module``."""
        if self.logits_module is not None:
            if self.logits_module not in dict(pl_module.named_modules()):
                return f"`logits_module={self.logits_module!r}` is not a submodule of the model"
            seen = self._output_types.get(self.logits_module)
            what = f"returned a {seen} without logits" if seen else "did not run in the training step"
            return f"`logits_module={self.logits_module!r}` {what}; set it to the module that returns them"
        children = [n for n, _ in pl_module.named_children()]
        seen = self._output_types.get("")
        what = (
            f"the LightningModule's forward returned a {seen} without logits"
            if seen
            else "the LightningModule's forward was not called in the training step"
        )
        return (
            f"{what}, and no direct child returned logits (a `.logits` output, or a tensor shaped like the labels plus "
            f"a class dimension); set `logits_module` to the submodule that returns the logits (direct children: "
            f"{', '.join(children[:12]) or 'none'})"
        )

    def _labels(self) -> tuple[Tensor | None, str]:
        """The labels from the shared reading of the batch; left at ``None``, ``labels_key`` also falls back to a float
        tensor under the usual names, to ``label`` and to a tuple's last item (a wrong guess fails the shape test)."""
        assert self.view is not None
        labels = self.view.labels
        if labels is not None:
            return labels, ""
        if self.labels_key is not None:
            return None, missing_field(self._batch, self.labels_key)
        # a float tensor under a labels name is not taken by the shared reader; here it is, so that the message can
        # say these are not class indices
        leaves = self.view.fields.leaves
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
        return None, f"{missing_field(batch, 'labels')} (nor under {names})"

    def _plain_child_logits(self, labels: Tensor) -> Tensor | None:
        """The last direct child's plain tensor output that can be the logits for ``labels``: shaped like them plus a
        class dimension wider than every supervised label (hidden states are ``(batch, time, d_model)`` too)."""
        views = (logits_for_labels(t, labels) for t in self._raw.values())
        fitting = [t for t in views if t is not None and t.shape[-1] > 1]
        if not fitting:
            return None
        # host sync: on the armed steps only, and only when the logits come from this fallback
        top = int(labels.masked_fill(labels == self.ignore_index, -1).max()) if labels.numel() else -1
        return next((t for t in reversed(fitting) if t.shape[-1] > top), None)
