"""BatchGuard: checks every training batch before it reaches the model, and names the key that is wrong."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor
from torch.utils.data import DataLoader, IterableDataset

from lightning_tfdebug.core.base import DebugCallback, TFDebugWarning, check_number
from lightning_tfdebug.core.model import find_context_length, find_vocab_size, load_tokenizer
from lightning_tfdebug.findings import OnFinding
from lightning_tfdebug.functional.batches import (
    Drift,
    FieldSpec,
    KeySchema,
    Schema,
    compare_schema,
    describe_leaves,
    flatten_batch,
    learn_schema,
    length_shift,
    parse_declared_schema,
    resolve_keys,
    token_statistics,
    unpack_statistics,
)
from lightning_tfdebug.functional.throughput import batch_fingerprint

_MAX_EPOCH_PRINTS = 100_000  # fingerprints kept per epoch for TFD121 (a few MB at most)
_STREAM_REPEAT_WINDOW = 16  # from a stream, a repeat counts only this close (a stream may cycle its data)
_DRIFT_CODES = {"missing": "TFD101", "extra": "TFD102", "dtype": "TFD103", "ndim": "TFD104", "size": "TFD105"}
_DRIFT_SEVERITY = {"missing": "error", "extra": "warning", "dtype": "error", "ndim": "error", "size": "error"}


def _reads_a_stream(trainer: pl.Trainer) -> bool:
    """True unless the training data is a DataLoader over a map-style dataset (which has epochs)."""
    loader = getattr(trainer.fit_loop, "_combined_loader", None)
    loaders = getattr(loader, "flattened", None) or [trainer.train_dataloader]
    return not all(isinstance(dl, DataLoader) and not isinstance(dl.dataset, IterableDataset) for dl in loaders)


class BatchGuard(DebugCallback):
    r"""Checks each training batch before the forward: schema drift, token ids, lengths, masks and targets.

    Runs in ``on_train_batch_start``, after the batch reached the device and before ``training_step``, so a bad
    batch is reported in one sentence (batch, key, expected, found) instead of a stack trace from inside attention.

    **Structural checks** (every batch, host metadata only: keys, dtypes, number of dimensions, sizes shared
    between keys). The schema is declared with ``schema`` or learned: keys, dtypes and dimension counts from the
    first batch, and which dimensions keys share (``input_ids``, ``attention_mask`` and ``labels`` share batch and
    sequence sizes) from the first ``learn_batches``. A sequence longer than the model's context is also caught
    from the shape alone.

    **Value checks** (on steps where ``global_step % check_values_every_n_steps == 0``; one packed device-to-host
    transfer per checked batch): input ids and labels within ``[0, vocab)`` (labels may be ``ignore_index``), a
    binary attention mask, the fraction of ignored labels, supervised padding, optional BOS/EOS conventions,
    truncation, a shift of the mean sequence length against the early batches, and batches that repeat an earlier
    batch of the same epoch (a fingerprint of the ids in the same transfer). Labels of another shape than
    the ids (seq2seq targets, a class per row) get the range and ignored checks, not the padding check.

    Logged keys (every ``every_n_steps`` steps, from the last checked batch):

    | key | meaning |
    | --- | --- |
    | `batch/width` | padded sequence length |
    | `batch/length_mean` | mean real length (attention mask sum) per sequence |
    | `batch/ignored_frac` | fraction of labels equal to `ignore_index` |
    | `batch/pad_frac` | fraction of positions whose attention mask is 0 |
    | `batch/truncated_frac` | fraction of sequences that fill `max_length` with no EOS (needs `eos_id`) |

    Findings: ``TFD101`` key missing, ``TFD102`` new key, ``TFD103`` dtype changed, ``TFD104`` number of
    dimensions changed, ``TFD105`` size differs from the declared size or from a key it always matched,
    ``TFD110`` token id outside the vocabulary, ``TFD111`` sequence longer than the context, ``TFD112`` attention
    mask not binary, ``TFD113`` label outside the vocabulary, ``TFD114`` every label ignored, ``TFD115`` padding
    positions supervised, ``TFD116`` sequence without BOS, ``TFD117`` several EOS, ``TFD118`` tokens after EOS,
    ``TFD119`` truncation rate, ``TFD120`` length distribution shift, ``TFD121`` batches read twice in one epoch
    (see ``docs/findings.md``).

    Args:
        every_n_steps: log the `batch/*` keys when ``global_step % every_n_steps == 0``; default: the Trainer's
            ``log_every_n_steps``.
        on_finding: ``"warn"``, ``"stop"`` or ``"raise"``. ``"raise"`` stops before the forward, so the finding is
            what the user reads; with ``"warn"`` a batch that breaks the model still reaches it (pair with
            ReproCapture). Under DDP findings are rank-local; with ``"stop"``/``"raise"`` one boolean all-reduce per
            batch makes every rank act together.
        schema: declared schema ``{key: "int64[B, T]"}`` (dtype, then sizes: integer fixed, name shared, ``*``
            free); ``None`` learns it from the first batches.
        learn_batches: batches that the shared-dimension part of a learned schema is learned from.
        check_values_every_n_steps: value checks on steps where ``global_step % n == 0``; 1 checks every batch
            (needed to catch one bad batch in hundreds).
        input_key, mask_key, labels_key: where ids, attention mask (1 = real token) and labels are; nested keys
            join with ``.``; tuple batches use indices (``"0"``). A key a batch lacks disables that check. ``None``
            (default) finds them at the first batch: ``input_ids`` / ``attention_mask`` / ``labels``, else, for a
            tuple batch ``(x, y)``, the first integer 2-D tensor as ids and the next one of its shape as labels.
        vocab_size: size of the vocabulary; ``None`` reads it from the model's input embedding.
        max_length: longest allowed sequence; ``None`` reads it from the model (config, position table,
            hyper-parameters).
        ignore_index: the label value that the loss ignores.
        bos_id, eos_id: enable the BOS/EOS convention and truncation checks.
        max_truncated_fraction: ``TFD119`` when more than this fraction of a batch's sequences fill
            ``max_length`` without EOS.
        length_window: checked batches per window of the length-shift check (the first window is the reference).
        length_shift_tolerance: ``TFD120`` when a window's mean length moves by more than this fraction of the
            reference mean.
        max_repeated_fraction: ``TFD121`` when more than this fraction of the batches checked in one epoch (and at
            least 3) have the same token ids as an earlier batch of that epoch.
        tokenizer: an object with ``decode`` or an import path to one; the first ``decode_examples`` sequences
            of the first batch are logged decoded, with their label masks, to TensorBoard text at fit start.
        decode_examples: how many sequences to decode.

    Raises:
        ValueError: on an argument outside its allowed range, a malformed schema, or a tokenizer without decode.

    Example:
        ```python
        trainer = Trainer(callbacks=[BatchGuard(on_finding="raise", eos_id=tokenizer.eos_token_id)])
        ```

        LightningCLI:

        ```yaml
        trainer:
          callbacks:
            - class_path: lightning_tfdebug.BatchGuard
              init_args:
                on_finding: raise
                tokenizer: lightning_tfdebug.demo.ByteTokenizer
        ```
    """

    def __init__(
        self,
        every_n_steps: int | None = None,
        on_finding: OnFinding = "warn",
        schema: dict[str, str] | None = None,
        learn_batches: int = 4,
        check_values_every_n_steps: int = 1,
        input_key: str | None = None,
        mask_key: str | None = None,
        labels_key: str | None = None,
        vocab_size: int | None = None,
        max_length: int | None = None,
        ignore_index: int = -100,
        bos_id: int | None = None,
        eos_id: int | None = None,
        max_truncated_fraction: float = 0.5,
        length_window: int = 50,
        length_shift_tolerance: float = 0.5,
        max_repeated_fraction: float = 0.1,
        tokenizer: Any = None,
        decode_examples: int = 4,
    ) -> None:
        super().__init__(every_n_steps=every_n_steps, on_finding=on_finding)
        if schema is not None and (not isinstance(schema, Mapping) or not schema):
            raise ValueError(f"`schema` must be a non-empty mapping {{key: 'int64[B, T]'}} or None; got {schema!r}.")
        self._declared = parse_declared_schema(schema) if schema is not None else None
        check_number("learn_batches", learn_batches, low=1, integer=True)
        check_number("check_values_every_n_steps", check_values_every_n_steps, low=1, integer=True)
        for name, value in (("input_key", input_key), ("mask_key", mask_key), ("labels_key", labels_key)):
            if value is not None and not isinstance(value, str):
                raise TypeError(f"`{name}` must be a string key or None; got {value!r}.")
        check_number("vocab_size", vocab_size, low=1, integer=True, optional=True)
        check_number("max_length", max_length, low=1, integer=True, optional=True)
        check_number("ignore_index", ignore_index, integer=True)
        check_number("bos_id", bos_id, low=0, integer=True, optional=True)
        check_number("eos_id", eos_id, low=0, integer=True, optional=True)
        check_number("max_truncated_fraction", max_truncated_fraction, low=0.0, high=1.0)
        check_number("length_window", length_window, low=1, integer=True)
        check_number("length_shift_tolerance", length_shift_tolerance, low=0.0, low_inclusive=False)
        check_number("max_repeated_fraction", max_repeated_fraction, low=0.0, high=1.0, low_inclusive=False)
        check_number("decode_examples", decode_examples, low=0, integer=True)
        self.schema = dict(schema) if schema is not None else None
        self.learn_batches = learn_batches
        self.check_values_every_n_steps = check_values_every_n_steps
        self.input_key, self.mask_key, self.labels_key = input_key, mask_key, labels_key
        self.vocab_size, self.max_length = vocab_size, max_length
        self.ignore_index = ignore_index
        self.bos_id, self.eos_id = bos_id, eos_id
        self.max_truncated_fraction = float(max_truncated_fraction)
        self.length_window = length_window
        self.length_shift_tolerance = float(length_shift_tolerance)
        self.max_repeated_fraction = float(max_repeated_fraction)
        self.tokenizer = load_tokenizer(tokenizer)
        self.decode_examples = decode_examples
        self._vocab: int | None = vocab_size
        self._context: int | None = max_length
        self._learned: list[dict[str, FieldSpec]] = []
        self._keys: tuple[str | None, str | None, str | None] | None = None  # ids, mask, labels: at the first batch
        self._schema: Schema | None = self._declared
        self._examples_logged = False
        self._reference: dict[str, float] | None = None  # {"mean", "std"} of real lengths in the first window
        self._window = [0.0, 0.0, 0.0, 0]  # sequences, sum, sum of squares, batches
        self._epoch_prints: dict[int, tuple[int, int]] = {}  # fingerprint -> (checked index, step) in this epoch
        self._epoch_seen: tuple[int, int, int] = (-1, 0, 0)  # epoch, batches checked, batches that repeated
        self._first_repeat: tuple[int, int] | None = None  # (step, step of the earlier identical batch)
        self._stream = False  # the training data is a stream, not a map-style dataset (set per epoch)

    @property
    def state_key(self) -> str:
        return self._generate_state_key(input_key=self.input_key, labels_key=self.labels_key, schema=self.schema)

    # ------------------------------------------------------------------ set-up
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        if stage != "fit":
            return
        if self.vocab_size is None:
            self._vocab, where = find_vocab_size(pl_module)
            if self._vocab is None:
                rank_zero_warn(
                    f"BatchGuard: {where}; token-id and label range checks are off. Pass `vocab_size`.",
                    category=TFDebugWarning,
                )
        if self.max_length is None:
            self._context, where = find_context_length(pl_module)
            if self._context is None:
                rank_zero_warn(
                    f"BatchGuard: {where}; the sequence-length check is off. Pass `max_length`.",
                    category=TFDebugWarning,
                )

    # ------------------------------------------------------------------ the check
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if not self.active or trainer.sanity_checking:
            return
        where = (
            f"Batch {batch_idx} (step {trainer.global_step}, epoch {trainer.current_epoch}, rank {trainer.global_rank})"
        )
        leaves = flatten_batch(batch)
        specs = describe_leaves(leaves)  # host metadata only
        if self._keys is None:
            self._resolve_keys(leaves)
        self._check_structure(trainer, specs, where)
        check_values = trainer.global_step % self.check_values_every_n_steps == 0
        if check_values:
            self._check_values(trainer, leaves, where)
        # Findings are rank-local (each rank sees its own batch). With "stop"/"raise" this is one boolean all-reduce,
        # on every batch and on every rank alike (decided from nothing but the hook being called), so all ranks act
        # together before the forward; with "warn" it does nothing.
        self.resolve_local_findings(trainer)

    def _resolve_keys(self, leaves: dict[str, Any]) -> None:
        self._keys = resolve_keys(leaves, self.input_key, self.mask_key, self.labels_key)
        ids = self._keys[0]
        if ids is None:
            rank_zero_warn(
                f"BatchGuard: no token ids in the first batch (keys: {sorted(leaves)}); the token, length and label "
                "checks are off, the schema checks stay on. Set `input_key` (and `labels_key`, `mask_key`).",
                category=TFDebugWarning,
            )
        elif ids != (self.input_key or "input_ids"):
            rank_zero_warn(
                f"BatchGuard: token ids taken from '{ids}' and labels from '{self._keys[2]}' (the batch has no "
                "'input_ids'); set `input_key` / `labels_key` if that is wrong.",
                category=TFDebugWarning,
            )

    def _check_structure(self, trainer: pl.Trainer, specs: dict[str, FieldSpec], where: str) -> None:
        if self._declared is None and len(self._learned) < self.learn_batches:
            drifts = []
            if self._schema is not None:  # compare against what was learned so far; shared sizes not yet
                drifts = [d for d in compare_schema(self._schema, specs) if d.kind != "size"]
                self._report_drifts(trainer, drifts, where)
            if not drifts:  # a drifting batch does not teach the schema
                self._learned.append(specs)
                self._schema = learn_schema(self._learned)
        elif self._schema is not None:
            self._report_drifts(trainer, compare_schema(self._schema, specs), where)
        ids = specs.get(self._keys[0]) if self._keys[0] is not None else None
        if self._context is not None and ids is not None and ids.shape and len(ids.shape) >= 1:
            width = ids.shape[-1]
            if width > self._context:
                self.emit(
                    trainer,
                    "TFD111",
                    f"{where}: '{self._keys[0]}' has sequence length {width}, longer than the model's context of "
                    f"{self._context}; positions past it have no embedding (an index or shape error deep in the "
                    "model, or silent wrap-around).",
                    {"key": self._keys[0], "shape": list(ids.shape), "max_length": self._context},
                    synchronized=False,
                )

    def _report_drifts(self, trainer: pl.Trainer, drifts: list[Drift], where: str) -> None:
        for d in drifts:
            what = {
                "missing": f"key '{d.key}' is missing (expected {d.expected})",
                "extra": f"key '{d.key}' is new: {d.found}, absent from the earlier batches",
                "dtype": f"'{d.key}' has dtype {d.found}; expected {d.expected}",
                "ndim": f"'{d.key}' has {d.found}; expected {d.expected}",
                "size": f"'{d.key}' has {d.found}; expected {d.expected}",
            }[d.kind]
            source = (
                "the declared schema" if self._declared is not None else "the schema learned from the first batches"
            )
            self.emit(
                trainer,
                _DRIFT_CODES[d.kind],
                f"{where}: {what} ({source}).",
                {"key": d.key, "expected": d.expected, "found": d.found},
                severity=_DRIFT_SEVERITY[d.kind],
                hint="A collate path that only some batches take: a last or single-sample batch squeezed, a dtype cast "
                "in one branch, tensors built from Python lists (int32/float defaults). Build every field with an "
                "explicit dtype and keep the batch dimension.",
                key=f"{d.key}",
                synchronized=False,
            )

    def _track_repeats(self, trainer: pl.Trainer, fingerprint: int) -> None:
        """``TFD121``: batches of one epoch that repeat an earlier batch of the same epoch, token for token."""
        epoch, checked, repeated = self._epoch_seen
        if epoch != trainer.current_epoch:
            epoch, checked, repeated = trainer.current_epoch, 0, 0
            self._epoch_prints.clear()
            self._stream = _reads_a_stream(trainer)
        earlier = self._epoch_prints.get(fingerprint)
        # A map-style dataset's sampler draws each sample once per epoch, so any repeat is suspect; a stream
        # (IterableDataset, generator) may legitimately cycle its data, so only close repeats count there.
        window = _STREAM_REPEAT_WINDOW if self._stream else None
        if earlier is not None and (window is None or checked - earlier[0] <= window):
            repeated += 1
            self._first_repeat = self._first_repeat or (trainer.global_step, earlier[1])
        if len(self._epoch_prints) < _MAX_EPOCH_PRINTS or fingerprint in self._epoch_prints:
            self._epoch_prints[fingerprint] = (checked, trainer.global_step)
        checked += 1
        self._epoch_seen = (epoch, checked, repeated)
        if repeated < 3 or repeated <= self.max_repeated_fraction * checked:
            return
        step, first = self._first_repeat or (trainer.global_step, -1)
        self.emit(
            trainer,
            "TFD121",
            f"{repeated} of the {checked} batches checked so far in epoch {epoch} (rank {trainer.global_rank}) repeat "
            f"an earlier batch of the same epoch token for token; the first, at step {step}, repeats step {first}.",
            {"epoch": epoch, "checked": checked, "repeated": repeated, "step": step, "repeats_step": first},
            synchronized=False,
        )

    def _check_values(self, trainer: pl.Trainer, leaves: dict[str, Any], where: str) -> None:
        ids_key, mask_key, labels_key = self._keys
        ids = leaves.get(ids_key) if ids_key is not None else None
        if not isinstance(ids, Tensor) or ids.is_floating_point() or ids.dtype == torch.bool or ids.numel() == 0:
            return
        mask = leaves.get(mask_key) if mask_key is not None else None
        labels = leaves.get(labels_key) if labels_key is not None else None
        mask = mask if isinstance(mask, Tensor) and mask.numel() == ids.numel() else None
        if not (isinstance(labels, Tensor) and labels.numel() and not labels.is_floating_point()):
            labels = None  # float labels (regression, soft targets) are not token labels
        if labels is not None and labels.dtype == torch.bool:
            labels = None
        stats = token_statistics(
            ids,
            mask,
            labels,
            vocab_size=self._vocab,
            ignore_index=self.ignore_index,
            bos_id=self.bos_id,
            eos_id=self.eos_id,
            max_length=self._context,
        )
        values = torch.cat([stats, batch_fingerprint(ids).to(stats.dtype).reshape(1)])
        *host, fingerprint = values.tolist()  # host sync: the one transfer of this checked batch
        s = unpack_statistics(host)
        self._findings_from_values(trainer, s, where, mask is not None, labels is not None)
        self._track_repeats(trainer, int(fingerprint))
        self._track_lengths(trainer, s, where)
        if not self._examples_logged and self.tokenizer is not None and self.decode_examples:
            self._examples_logged = True
            self._log_examples(trainer, ids, labels if labels is not None and labels.shape == ids.shape else None)
        if self.should_measure(trainer):
            n, width = max(s["sequences"], 1.0), max(s["width"], 1.0)
            metrics = {
                "batch/width": s["width"],
                "batch/length_mean": s["length_sum"] / n,
                "batch/pad_frac": s["pad_positions"] / (n * width),
            }
            if labels is not None:
                metrics["batch/ignored_frac"] = s["labels_ignored"] / max(s["labels_total"], 1.0)
            if self.eos_id is not None and self._context is not None:
                metrics["batch/truncated_frac"] = s["truncated"] / n
            self.log_scalars(trainer, metrics)

    def _findings_from_values(
        self, trainer: pl.Trainer, s: dict[str, float], where: str, has_mask: bool, has_labels: bool
    ) -> None:
        n = int(s["sequences"])
        if s["ids_out_of_range"] > 0:
            self.emit(
                trainer,
                "TFD110",
                f"{where}: '{self._keys[0]}' holds {int(s['ids_out_of_range'])} token id(s) outside [0, "
                f"{self._vocab}); the first is {int(s['first_bad_id_value'])} at row {int(s['first_bad_id_row'])}, "
                f"position {int(s['first_bad_id_col'])}.",
                {"count": s["ids_out_of_range"], "min": s["ids_min"], "max": s["ids_max"], "vocab_size": self._vocab},
                synchronized=False,
            )
        if has_mask and s["mask_non_binary"] > 0:
            self.emit(
                trainer,
                "TFD112",
                f"{where}: '{self._keys[1]}' has {int(s['mask_non_binary'])} value(s) that are neither 0 nor 1 "
                f"(e.g. {s['first_bad_mask_value']:g}).",
                {"key": self._keys[1], "count": s["mask_non_binary"], "example": s["first_bad_mask_value"]},
                synchronized=False,
            )
        if not has_labels:
            return
        if s["labels_out_of_range"] > 0:
            self.emit(
                trainer,
                "TFD113",
                f"{where}: '{self._keys[2]}' holds {int(s['labels_out_of_range'])} label(s) outside [0, "
                f"{self._vocab}) that are not ignore_index={self.ignore_index} "
                f"(e.g. {int(s['first_bad_label_value'])}).",
                {"count": s["labels_out_of_range"], "vocab_size": self._vocab, "ignore_index": self.ignore_index},
                synchronized=False,
            )
        if s["labels_total"] > 0 and s["labels_ignored"] >= s["labels_total"]:
            self.emit(
                trainer,
                "TFD114",
                f"{where}: every label in '{self._keys[2]}' is ignore_index={self.ignore_index}; this batch "
                "teaches nothing (the loss is 0 or NaN).",
                {"labels": s["labels_total"], "ignored": s["labels_ignored"]},
                synchronized=False,
            )
        if has_mask and s["pad_supervised"] > 0:
            self.emit(
                trainer,
                "TFD115",
                f"{where}: '{self._keys[2]}' supervises {int(s['pad_supervised'])} of {int(s['pad_positions'])} "
                f"padding positions ('{self._keys[1]}' 0, label not ignore_index={self.ignore_index}): the model is "
                "trained to predict padding.",
                {"pad_supervised": s["pad_supervised"], "pad_positions": s["pad_positions"]},
                hint=f"Set labels[attention_mask == 0] = {self.ignore_index} in the collate function.",
                synchronized=False,
            )
        if self.bos_id is not None and s["bos_missing"] > 0:
            self.emit(
                trainer,
                "TFD116",
                f"{where}: {int(s['bos_missing'])} of {n} sequences do not start with BOS ({self.bos_id}).",
                {"sequences": n, "without_bos": s["bos_missing"]},
                synchronized=False,
            )
        if self.eos_id is not None and s["eos_multiple"] > 0:
            self.emit(
                trainer,
                "TFD117",
                f"{where}: {int(s['eos_multiple'])} of {n} sequences hold more than one EOS ({self.eos_id}).",
                {"sequences": n, "several_eos": s["eos_multiple"]},
                synchronized=False,
            )
        if self.eos_id is not None and s["eos_then_tokens"] > 0:
            self.emit(
                trainer,
                "TFD118",
                f"{where}: {int(s['eos_then_tokens'])} of {n} sequences have real tokens after their EOS.",
                {"sequences": n, "tokens_after_eos": s["eos_then_tokens"]},
                synchronized=False,
            )
        if (
            self.eos_id is not None
            and self._context is not None
            and n
            and s["truncated"] / n > self.max_truncated_fraction
        ):
            self.emit(
                trainer,
                "TFD119",
                f"{where}: {int(s['truncated'])} of {n} sequences fill the maximum length {self._context} with no "
                "EOS: they were truncated.",
                {"truncated_frac": s["truncated"] / n, "max_length": self._context},
                synchronized=False,
            )

    def _track_lengths(self, trainer: pl.Trainer, s: dict[str, float], where: str) -> None:
        w = self._window
        w[0] += s["sequences"]
        w[1] += s["length_sum"]
        w[2] += s["length_sq_sum"]
        w[3] += 1
        if w[3] < self.length_window:
            return
        mean = w[1] / max(w[0], 1.0)
        std = max(w[2] / max(w[0], 1.0) - mean * mean, 0.0) ** 0.5
        self._window = [0.0, 0.0, 0.0, 0]
        if self._reference is None:
            self._reference = {"mean": mean, "std": std}
            return
        ref = self._reference
        if length_shift(ref["mean"], ref["std"], mean, self.length_shift_tolerance):
            self.emit(
                trainer,
                "TFD120",
                f"{where}: the mean sequence length of the last {self.length_window} checked batches is "
                f"{mean:.1f}, against {ref['mean']:.1f} (std {ref['std']:.1f}) in the first ones.",
                {"window_mean": mean, "reference_mean": ref["mean"], "reference_std": ref["std"]},
                synchronized=False,
            )

    # ------------------------------------------------------------------ decoded examples
    def _log_examples(self, trainer: pl.Trainer, ids: Tensor, labels: Tensor | None) -> None:
        k = min(self.decode_examples, ids.shape[0] if ids.ndim >= 2 else 1)
        rows = (ids if ids.ndim >= 2 else ids.reshape(1, -1))[:k].tolist()  # host sync: once per fit
        label_rows = None
        if labels is not None:
            label_rows = (labels if labels.ndim >= 2 else labels.reshape(1, -1))[:k].tolist()
        lines = [f"First {k} sequences of the first training batch (rank {trainer.global_rank}):", ""]
        for i, row in enumerate(rows):
            try:
                text = self.tokenizer.decode(row)
                pieces = [self.tokenizer.decode([t]) for t in row]
            except Exception as err:  # a tokenizer that cannot decode must not break training
                rank_zero_warn(
                    f"BatchGuard: tokenizer.decode failed ({err}); no decoded examples.", category=TFDebugWarning
                )
                return
            lines.append(f"**{i}** ({len(row)} tokens) input: `{text!r}`")
            if label_rows is not None:
                shown = "".join(
                    p if lab != self.ignore_index else "·" * max(len(p), 1) for p, lab in zip(pieces, label_rows[i])
                )
                supervised = sum(lab != self.ignore_index for lab in label_rows[i])
                lines.append(f"  labels ({supervised} supervised, · = ignored): `{shown!r}`")
            lines.append("")
        body = "  \n".join(lines)
        if trainer.is_global_zero:
            for logger in trainer.loggers:
                if isinstance(logger, TensorBoardLogger):
                    logger.experiment.add_text("batch_guard/examples", body, global_step=trainer.global_step)
        os.makedirs(self.tfdebug_dir, exist_ok=True)
        with open(os.path.join(self.tfdebug_dir, f"batch_examples-rank{trainer.global_rank}.md"), "w") as f:
            f.write("\n".join(lines) + "\n")

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        schema = None
        if self._schema is not None and self._declared is None and len(self._learned) >= self.learn_batches:
            schema = {k: {"dtype": v.dtype, "dims": v.dims} for k, v in self._schema.keys.items()}
        return {
            **super().state_dict(),
            "learned_schema": schema,
            "reference": self._reference,
            "window": list(self._window),
            "examples_logged": self._examples_logged,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        learned = state_dict.get("learned_schema")
        if learned and self._declared is None:
            self._schema = Schema({k: KeySchema(v["dtype"], v["dims"]) for k, v in learned.items()})
            self._learned = [{}] * self.learn_batches  # learning is over: compare from the first batch on
        self._reference = state_dict.get("reference")
        self._window = list(state_dict.get("window", [0.0, 0.0, 0.0, 0]))
        self._examples_logged = bool(state_dict.get("examples_logged", False))
