"""BatchGuard: checks every training batch before it reaches the model, and names the key that is wrong."""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch import Tensor
from torch.utils.data import DataLoader, IterableDataset

from lightning_tfdebug.core.base import DebugCallback, TFDebugWarning, check_number
from lightning_tfdebug.core.batch import IGNORE_INDEX, BatchKeys, StepBatch, is_id_tensor, step_batch
from lightning_tfdebug.core.compat import is_lightning_instance
from lightning_tfdebug.core.io import write_text
from lightning_tfdebug.core.model import find_context_length, find_vocab_size, load_tokenizer
from lightning_tfdebug.findings import OnFinding
from lightning_tfdebug.functional.batch_checks import (
    DRIFT_CODES,
    PACKING_KEYS,
    BatchPaths,
    LengthWindow,
    RepeatPeriod,
    RepeatTracker,
    SpecialTokenTally,
    ValueRules,
    batch_metrics,
    decoded_examples,
    drift_verdicts,
    learn_special_ids,
    mask_hole_verdict,
    too_long,
    value_verdicts,
)
from lightning_tfdebug.functional.batches import (
    FieldSpec,
    KeySchema,
    Schema,
    compare_schema,
    describe_leaves,
    device_fingerprint,
    host_fingerprint,
    learn_schema,
    parse_declared_schema,
    special_token_statistics,
    structure_key,
    token_statistics,
    unpack_statistics,
)
from lightning_tfdebug.functional.verdicts import Verdict
from lightning_tfdebug.repro import shared_host_copy


def _reads_a_stream(trainer: pl.Trainer) -> bool:
    """True unless the training data is a DataLoader over a map-style dataset (which has epochs)."""
    loader = getattr(trainer.fit_loop, "_combined_loader", None)
    loaders = getattr(loader, "flattened", None) or [trainer.train_dataloader]
    return not all(isinstance(dl, DataLoader) and not isinstance(dl.dataset, IterableDataset) for dl in loaders)


def _loader_length(trainer: pl.Trainer) -> int | None:
    """Batches per epoch of the one training DataLoader over a map-style dataset, before any Trainer limit; None for
    a stream, several loaders or a loader without a length (host metadata, once per epoch)."""
    loader = getattr(trainer.fit_loop, "_combined_loader", None)
    loaders = getattr(loader, "flattened", None) or [trainer.train_dataloader]
    if len(loaders) != 1 or not isinstance(loaders[0], DataLoader) or isinstance(loaders[0].dataset, IterableDataset):
        return None
    try:
        return len(loaders[0])
    except TypeError:
        return None


def _limit_setting(trainer: pl.Trainer) -> str | None:
    """The Trainer setting that makes every epoch read the same subset of the data, when one is set."""
    overfit = getattr(trainer, "overfit_batches", 0)
    if overfit:
        return f"Trainer(overfit_batches={overfit!r})"
    limit = getattr(trainer, "limit_train_batches", 1.0)
    # an int is a number of batches (1 is one batch), a float a fraction of the epoch (1.0 is all of it)
    if limit is not None and (isinstance(limit, int) or limit < 1.0):
        return f"Trainer(limit_train_batches={limit!r})"
    return None


def _special_sources(trainer: pl.Trainer, pl_module: pl.LightningModule, tokenizer: Any) -> list[tuple[str, Any]]:
    """Where the special token ids may be read, most specific first: the `tokenizer` argument, a `tokenizer`
    attribute of the DataModule or of the LightningModule, then Hugging Face configs (and generation configs) of the
    model's modules."""
    sources: list[tuple[str, Any]] = [("`tokenizer`", tokenizer)]
    datamodule = getattr(trainer, "datamodule", None)
    sources.append(("the DataModule's tokenizer", getattr(datamodule, "tokenizer", None)))
    sources.append(("the LightningModule's tokenizer", getattr(pl_module, "tokenizer", None)))
    for name, module in pl_module.named_modules():
        for attr in ("config", "generation_config"):
            config = getattr(module, attr, None)
            if config is not None and hasattr(config, "eos_token_id"):
                sources.append((f"{name or type(module).__name__}.{attr}", config))
    return sources


def _token_fields(view: StepBatch) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """The ids, mask and labels the value checks can read: integer ids, a mask with one entry per id, integer labels
    (float labels, for regression or soft targets, are not token labels)."""
    ids, mask, labels = view.input_ids, view.fields.attention_mask, view.labels
    if ids is None or not is_id_tensor(ids) or ids.numel() == 0:
        return None, None, None
    mask = mask if isinstance(mask, Tensor) and mask.numel() == ids.numel() else None
    labels = labels if isinstance(labels, Tensor) and labels.numel() and is_id_tensor(labels) else None
    return ids, mask, labels


class BatchGuard(DebugCallback):
    r"""Checks each training batch before the forward: schema drift, token ids, lengths, masks and targets.

    Runs in ``on_train_batch_start``, after the batch reached the device and before ``training_step``, so a bad
    batch is reported in one sentence (batch, key, expected, found) instead of a stack trace from inside attention.

    **Structural checks** (every batch, host metadata only: keys, dtypes, number of dimensions, sizes shared
    between keys). The schema is declared with ``schema`` or learned: keys, dtypes and dimension counts from the
    first batch, and which dimensions keys share (``input_ids``, ``attention_mask`` and ``labels`` share batch and
    sequence sizes) from the first ``learn_batches``. A sequence longer than the model's context is also caught
    from the shape alone.

    **Value checks** (on measuring steps, ``global_step % every_n_steps == 0``, or every
    ``check_values_every_n_steps`` steps when given; one packed device-to-host transfer per checked batch): input ids
    and labels within ``[0, vocab)`` (labels may be ``ignore_index``), a binary attention mask, the fraction of
    ignored labels, supervised padding, optional BOS/EOS conventions, truncation, and a shift of the mean sequence
    length against the early checked batches, and holes in the attention mask: positions masked between real tokens
    (or at both ends of a row) while padding belongs at one end; packed batches (position ids restarting inside a
    row, or keys such as ``cu_seqlens`` / ``document_ids``), 3-D/4-D masks and masks that hide most of the text
    (masked-LM or loss masks) are left alone. Labels of another shape than the ids (seq2seq targets, a class per
    row), and an encoder-decoder's labels (Hugging Face ``config.is_encoder_decoder``) even when their width matches
    the source's, get the range and ignored checks, not the padding check.

    **Between checked batches** nothing is read on the host: a batch whose ids, mask or labels would crash the model
    (``TFD110``, ``TFD112``, ``TFD113``) is diagnosed in ``on_exception`` when the forward raises, before the
    exception reaches the user, naming the batch, the key and the bad value. Every batch's ids are fingerprinted for
    ``TFD121``: on the device (no sync; read with the next checked batch's transfer), or, for a CPU batch, on the
    host from its bytes (no kernel).

    Logged keys (every ``every_n_steps`` steps, from the last checked batch):

    | key | meaning |
    | --- | --- |
    | `batch_guard/width` | padded sequence length |
    | `batch_guard/length_mean` | mean real length (attention mask sum) per sequence |
    | `batch_guard/ignored_frac` | fraction of labels equal to `ignore_index` |
    | `batch_guard/pad_frac` | fraction of positions whose attention mask is 0 |
    | `batch_guard/truncated_frac` | fraction of sequences that fill `max_length` with no EOS (needs `eos_id`) |

    Findings: ``TFD101`` key missing, ``TFD102`` new key, ``TFD103`` dtype changed, ``TFD104`` number of
    dimensions changed, ``TFD105`` size differs from the declared size or from a key it always matched,
    ``TFD110`` token id outside the vocabulary, ``TFD111`` sequence longer than the context, ``TFD112`` attention
    mask not binary, ``TFD113`` label outside the vocabulary, ``TFD114`` every label ignored, ``TFD115`` padding
    positions supervised, ``TFD116`` sequence without BOS, ``TFD117`` several EOS, ``TFD118`` tokens after EOS,
    ``TFD119`` truncation rate, ``TFD120`` length distribution shift, ``TFD121`` batches read twice in one epoch,
    ``TFD122`` an attention mask with holes: real tokens masked out inside the text, ``TFD123`` the same batches
    coming back sooner than the DataLoader's length allows (``overfit_batches``, ``limit_train_batches``, a Dataset
    ignoring its index), ``TFD124`` an end-of-sequence token in the inputs that no label supervises (see
    ``docs/findings.md``).

    Args:
        every_n_steps: log the `batch_guard/*` keys when ``global_step % every_n_steps == 0``; default: the Trainer's
            ``log_every_n_steps``.
        on_finding: ``"warn"``, ``"stop"`` or ``"raise"``. ``"raise"`` stops before the forward, so the finding is
            what the user reads (on checked steps); with ``"warn"`` a batch that breaks the model still reaches it
            (pair with ReproCapture). Under DDP findings are rank-local; with ``"stop"``/``"raise"`` one boolean
            all-reduce per batch makes every rank act together.
        schema: declared schema ``{key: "int64[B, T]"}`` (dtype, then sizes: integer fixed, name shared, ``*``
            free); ``None`` learns it from the first batches.
        learn_batches: batches that the shared-dimension part of a learned schema is learned from.
        check_values_every_n_steps: value checks every this many steps; ``None`` (default) checks on measuring
            steps only (``every_n_steps``). 1 checks every batch before its forward (one host sync per batch): with
            ``on_finding="raise"``, the run then stops before a bad batch reaches the model, not after it crashed.
        input_key: where the token ids are; nested keys join with ``.``; tuple batches use indices (``"0"`` or ``0``). A
            key a batch lacks disables that check. ``None`` (default) finds the ids, mask and labels as every callback
            of the pack does (:mod:`lightning_tfdebug.core.batch`): ``input_ids`` / ``attention_mask`` / ``labels`` and
            their usual aliases, else, for a tuple batch ``(x, y)``, the first integer 2-D tensor as ids and the next
            one of its size as labels. Dict, tuple, dataclass and Hugging Face ``BatchEncoding`` batches are read alike.
        mask_key: where the attention mask (1 = real token) is; given and found as ``input_key``.
        labels_key: where the labels are; given and found as ``input_key``.
        vocab_size: size of the vocabulary; ``None`` reads it from the model's input embedding.
        max_length: longest allowed sequence; ``None`` reads it from the model (config, position table,
            hyper-parameters).
        ignore_index: the label value that the loss ignores; ``None`` is PyTorch's and Hugging Face's -100.
        bos_id: the beginning-of-sequence token id; enables the BOS convention checks.
        eos_id: the end-of-sequence token id; enables the EOS convention and truncation checks.
        max_truncated_fraction: ``TFD119`` when more than this fraction of a batch's sequences fill
            ``max_length`` without EOS.
        length_window: checked batches per window of the length-shift check (the first window is the reference).
        length_shift_tolerance: ``TFD120`` when a window's mean length moves by more than this fraction of the
            reference mean.
        max_repeated_fraction: ``TFD121`` when more than this fraction of the batches seen in one epoch (and at
            least 3) have the same token ids as an earlier batch of that epoch; ``TFD123`` when the batches read
            fall short of ``min(read, len(train DataLoader))`` different ones by more than this fraction (and 3).
        special_token_batches: checked batches over which the special tokens (EOS, SEP, a pad id that is also a real
            token) are counted among the real inputs and the supervised labels for ``TFD124``; 0 turns the count
            off. The ids come from ``eos_id``, ``tokenizer``, a ``tokenizer`` attribute of the DataModule or the
            LightningModule, or the model's Hugging Face config (``eos_token_id``, ``pad_token_id``,
            ``sep_token_id``).
        min_eos_expected: ``TFD124`` needs EOS to be expected among the supervised labels at least this many times
            (its count among the real inputs times the supervised share of the tokens) while none is.
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
        check_values_every_n_steps: int | None = None,
        input_key: str | int | None = None,
        mask_key: str | int | None = None,
        labels_key: str | int | None = None,
        vocab_size: int | None = None,
        max_length: int | None = None,
        ignore_index: int | None = None,
        bos_id: int | None = None,
        eos_id: int | None = None,
        max_truncated_fraction: float = 0.5,
        length_window: int = 50,
        length_shift_tolerance: float = 0.5,
        max_repeated_fraction: float = 0.1,
        tokenizer: Any = None,
        decode_examples: int = 4,
        special_token_batches: int = 8,
        min_eos_expected: float = 8.0,
    ) -> None:
        super().__init__(every_n_steps=every_n_steps, on_finding=on_finding)
        if schema is not None and (not isinstance(schema, Mapping) or not schema):
            raise ValueError(f"`schema` must be a non-empty mapping {{key: 'int64[B, T]'}} or None; got {schema!r}.")
        self._declared = parse_declared_schema(schema) if schema is not None else None
        check_number("learn_batches", learn_batches, low=1, integer=True)
        check_number("check_values_every_n_steps", check_values_every_n_steps, low=1, integer=True, optional=True)
        check_number("vocab_size", vocab_size, low=1, integer=True, optional=True)
        check_number("max_length", max_length, low=1, integer=True, optional=True)
        check_number("ignore_index", ignore_index, integer=True, optional=True)
        check_number("bos_id", bos_id, low=0, integer=True, optional=True)
        check_number("eos_id", eos_id, low=0, integer=True, optional=True)
        check_number("max_truncated_fraction", max_truncated_fraction, low=0.0, high=1.0)
        check_number("length_window", length_window, low=1, integer=True)
        check_number("length_shift_tolerance", length_shift_tolerance, low=0.0, low_inclusive=False)
        check_number("max_repeated_fraction", max_repeated_fraction, low=0.0, high=1.0, low_inclusive=False)
        check_number("decode_examples", decode_examples, low=0, integer=True)
        check_number("special_token_batches", special_token_batches, low=0, integer=True)
        check_number("min_eos_expected", min_eos_expected, low=0.0, low_inclusive=False)
        # raises a TypeError naming the argument when a key is not a string, a tuple position or None
        self._batch_keys = BatchKeys(
            input_key, mask_key, labels_key, ignore_index=IGNORE_INDEX if ignore_index is None else ignore_index
        )
        self.schema = dict(schema) if schema is not None else None
        self.learn_batches = learn_batches
        self.check_values_every_n_steps = check_values_every_n_steps
        self.input_key, self.mask_key, self.labels_key = input_key, mask_key, labels_key
        self.vocab_size, self.max_length = vocab_size, max_length
        self.ignore_index = self._batch_keys.ignore_index
        self.bos_id, self.eos_id = bos_id, eos_id
        self.max_truncated_fraction = float(max_truncated_fraction)
        self.length_window = length_window
        self.length_shift_tolerance = float(length_shift_tolerance)
        self.max_repeated_fraction = float(max_repeated_fraction)
        self.tokenizer = load_tokenizer(tokenizer)
        self.decode_examples = decode_examples
        self.special_token_batches = special_token_batches
        self.min_eos_expected = float(min_eos_expected)
        self._vocab: int | None = vocab_size
        self._encoder_decoder = False  # labels are the decoder's targets, not aligned with the input ids
        self._context: int | None = max_length
        self._learned: list[dict[str, FieldSpec]] = []
        self._schema: Schema | None = self._declared
        self._keys_announced = False
        self._examples_logged = False
        self._lengths = LengthWindow(length_window, self.length_shift_tolerance)
        self._repeats = RepeatTracker(self.max_repeated_fraction)
        self._period = RepeatPeriod(self.max_repeated_fraction)
        self._repeats_found = False  # TFD121 was emitted: TFD123 would say the same again
        # (epoch, step, stream, epoch facts, fingerprint) not yet read; the fingerprint is a host int for a CPU batch,
        # else a device scalar; epoch facts: the DataLoader's length, the batches the Trainer reads per epoch, the
        # Trainer limit in force
        self._prints: list[tuple[int, int, bool, tuple[int | None, int | None, str | None], Tensor | int]] = []
        self._stream = False  # the training data is a stream, not a map-style dataset (set per epoch)
        self._epoch_facts: tuple[int | None, int | None, str | None] = (None, None, None)
        self._tally: SpecialTokenTally | None = None  # TFD124's count, None when off or done
        self._checks_aside: dict[str, str] = {}  # check -> why it stood aside (the rest of BatchGuard runs on)
        self._last: tuple[StepBatch, tuple[int, int, int, int], bool] | None = None  # batch, _where's parts, checked
        # the structure of the last batch whose full structural check found nothing (learning over), or None: a batch
        # of the same structure would find nothing either
        self._clean_structure: tuple | None = None

    @property
    def state_key(self) -> str:
        return self._generate_state_key(input_key=self.input_key, labels_key=self.labels_key, schema=self.schema)

    @property
    def _rules(self) -> ValueRules:
        return ValueRules(
            self._vocab, self._context, self.ignore_index, self.bos_id, self.eos_id, self.max_truncated_fraction
        )

    # ------------------------------------------------------------------ set-up
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        if stage != "fit":
            return
        # an encoder-decoder (Hugging Face config flag) is fed labels for its decoder: even when their width matches
        # the source's, they are not aligned with the input ids or the attention mask (no padding-supervision check)
        self._encoder_decoder = any(
            getattr(getattr(m, "config", None), "is_encoder_decoder", False) is True for m in pl_module.modules()
        )
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
        self._period = RepeatPeriod(self.max_repeated_fraction)  # a new fit reads its data anew
        self._clean_structure = None  # the context may have changed with the model
        self._repeats_found = False
        self._tally = None
        if self.special_token_batches:
            ids = learn_special_ids(_special_sources(trainer, pl_module, self.tokenizer), self.eos_id)
            if ids.eos:
                self._tally = SpecialTokenTally(ids, self.min_eos_expected, self.special_token_batches)
            else:
                self._check_aside(
                    "EOS supervision (TFD124)",
                    "no end-of-sequence id is known (no `eos_id`, no tokenizer, no Hugging Face config naming one).",
                    "`eos_id` or `tokenizer`",
                )

    @property
    def checks_aside(self) -> dict[str, str]:
        """The checks of BatchGuard that stood aside while the others ran on: ``{check: reason and setting}``."""
        return dict(self._checks_aside)

    @staticmethod
    def _where(parts: tuple[int, int, int, int]) -> str:
        """The batch named in a finding, from ``(batch_idx, step, epoch, rank)``: formatted only when needed."""
        return "Batch {} (step {}, epoch {}, rank {})".format(*parts)

    def _check_aside(self, check: str, reason: str, setting: str | None) -> None:
        """One check of BatchGuard stands aside, once, while the others run on: said at info level, with the setting
        that would let it run, and kept in :attr:`checks_aside`. Not :meth:`stand_aside`, which stops the whole
        callback, nor its ``stood-aside`` record, which lists the callbacks that did not run (BatchGuard does)."""
        if check in self._checks_aside:
            return
        tail = f" To let it run: {setting}." if setting else ""
        self._checks_aside[check] = reason + tail
        rank_zero_info(f"lightning_tfdebug: {type(self).__name__}'s check of {check} stands aside: {reason}{tail}")

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._stream = _reads_a_stream(trainer)  # host metadata, once per epoch
        per_epoch = trainer.num_training_batches
        self._epoch_facts = (
            _loader_length(trainer),
            int(per_epoch) if isinstance(per_epoch, (int, float)) and math.isfinite(per_epoch) else None,
            _limit_setting(trainer),
        )

    # ------------------------------------------------------------------ every batch (hot path: host metadata and
    # one fingerprint, no sync; values only on checked steps)
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if not self.active or trainer.sanity_checking:
            return
        step, epoch = trainer.global_step, trainer.current_epoch
        where = (batch_idx, step, epoch, trainer.global_rank)  # the sentence is built only for a finding
        view = step_batch(trainer, batch, self._batch_keys)  # the step's one reading of the batch, shared
        if not self._keys_announced:
            self._announce_keys(view)
        self._check_structure(trainer, view, where)
        checks = self.should_measure(trainer) or (
            self.check_values_every_n_steps is not None and step % self.check_values_every_n_steps == 0
        )
        # a reference, no copy: if the forward raises, `on_exception` diagnoses this batch
        self._last = (view, where, checks)
        ids = _token_fields(view)[0]
        if ids is not None:
            # a CPU batch: a host int (its bytes' CRC, no kernel); else device work, no sync, read with the next
            # checked batch (integer ids carry no autograd history)
            fingerprint = host_fingerprint(ids)
            if fingerprint is None:
                fingerprint = device_fingerprint(ids)
            self._prints.append((epoch, step, self._stream, self._epoch_facts, fingerprint))
        if checks:
            self._check_values(trainer, view, self._where(where))
        # Findings are rank-local (each rank sees its own batch). With "stop"/"raise" this is one boolean all-reduce,
        # on every batch and on every rank alike (decided from nothing but the hook being called), so all ranks act
        # together before the forward; with "warn" it does nothing.
        self.resolve_local_findings(trainer)

    def _announce_keys(self, view: StepBatch) -> None:
        self._keys_announced = True
        ids = view.fields.paths["input_ids"]
        if ids is None:
            rank_zero_warn(
                f"BatchGuard: no token ids in the first batch (keys: {sorted(view.fields.leaves)}); the token, length "
                "and label checks are off, the schema checks stay on. Set `input_key` (and `labels_key`, `mask_key`).",
                category=TFDebugWarning,
            )
        elif ids != (self._batch_keys.input_key or "input_ids"):
            rank_zero_warn(
                f"BatchGuard: token ids taken from '{ids}' and labels from '{view.fields.paths['labels']}' (the batch "
                "has no 'input_ids'); set `input_key` / `labels_key` if that is wrong.",
                category=TFDebugWarning,
            )

    def _emit(self, trainer: pl.Trainer, verdicts: list[Verdict] | Verdict | None, step: int | None = None) -> None:
        """Emit decisions as rank-local findings (each rank judges its own batch); a schema finding once per key."""
        for v in [verdicts] if isinstance(verdicts, Verdict) else verdicts or []:
            self.emit_code(
                trainer,
                v.code,
                v.message,
                v.evidence,
                severity=v.severity,
                hint=v.hint,
                key=v.evidence["key"] if v.code in DRIFT_CODES.values() else None,
                synchronized=False,
                step=step,
            )

    def _check_structure(self, trainer: pl.Trainer, view: StepBatch, parts: tuple[int, int, int, int]) -> None:
        """Schema drift and a sequence longer than the context, from host metadata. Once the schema is learned (or
        declared), a batch with the keys, dtypes and shapes of the last batch that passed passes too: the findings
        depend on nothing else (the schema and the context stay fixed), so it is not compared again."""
        structure = structure_key(view.fields.leaves)  # host metadata only
        if structure == self._clean_structure:
            return
        specs = describe_leaves(view.fields.leaves)
        where = self._where(parts)
        declared = self._declared is not None
        found: list[Verdict] = []
        learning = not declared and len(self._learned) < self.learn_batches
        if learning:
            drifts = []
            if self._schema is not None:  # compare against what was learned so far; shared sizes not yet
                drifts = [d for d in compare_schema(self._schema, specs) if d.kind != "size"]
                found = drift_verdicts(drifts, where, declared)
            if not drifts:  # a drifting batch does not teach the schema
                self._learned.append(specs)
                self._schema = learn_schema(self._learned)
        elif self._schema is not None:
            found = drift_verdicts(compare_schema(self._schema, specs), where, declared)
        ids_path = view.fields.paths["input_ids"]
        long = too_long(where, ids_path, specs.get(ids_path or ""), self._context)
        self._emit(trainer, found)
        self._emit(trainer, long)
        self._clean_structure = structure if not learning and not found and long is None else None

    # ------------------------------------------------------------------ checked batches
    def _statistics(self, view: StepBatch) -> Tensor | None:
        ids, mask, labels = _token_fields(view)
        if ids is None:
            return None
        with torch.no_grad():
            # on the CPU it reads a few counts on the host to skip kernels (no sync: the data are in host memory);
            # on an accelerator everything stays on the device until the checked batch's one transfer
            return token_statistics(
                ids,
                mask,
                labels,
                vocab_size=self._vocab,
                ignore_index=self.ignore_index,
                bos_id=self.bos_id,
                eos_id=self.eos_id,
                max_length=self._context,
                position_ids=view.fields.position_ids if isinstance(view.fields.position_ids, Tensor) else None,
                labels_aligned=not self._encoder_decoder,
            )

    def _special_statistics(self, view: StepBatch) -> tuple[Tensor, bool] | None:
        """TFD124's counts of this batch on the device (no sync), and whether its labels align with the ids; None
        when the count is off or done, or the batch cannot serve it (then that check stands aside, once)."""
        tally = self._tally
        if tally is None or tally.done:
            return None
        ids, mask, labels = _token_fields(view)
        assert ids is not None
        check = "EOS supervision (TFD124)"
        if labels is None:
            self._check_aside(check, "the batches have no integer token labels to count EOS among.", "`labels_key`")
            return None
        rows = ids.shape[0] if ids.ndim >= 2 else 1
        aligned = not self._encoder_decoder and labels.numel() == ids.numel()
        if not aligned and (labels.ndim < 2 or labels.shape[0] != rows):
            self._check_aside(check, "the labels are not token sequences (one value per row: a classifier).", None)
            return None
        if mask is None and set(tally.ids.pad) & set(tally.ids.eos):
            self._check_aside(
                check,
                "the pad id is the EOS id and the batches have no attention mask, so a real EOS cannot be told from "
                "padding.",
                "`mask_key`",
            )
            return None
        with torch.no_grad():
            stats = special_token_statistics(
                ids, mask, labels, tally.ids.ordered(), ignore_index=self.ignore_index, labels_aligned=aligned
            )
        return stats, aligned

    def _read_prints(self, trainer: pl.Trainer, prints: list, fingerprints: list[float]) -> None:
        """TFD121 and TFD123 from fingerprints that reached the host, in the order their batches were read."""
        rank = trainer.global_rank
        for (epoch, step, stream, (length, per_epoch, setting), _), fingerprint in zip(prints, fingerprints):
            earlier = self._repeats.repeated if self._repeats.epoch == epoch else 0  # the tracker resets per epoch
            found = self._repeats.add(epoch, step, int(fingerprint), stream, rank)
            within = self._repeats.repeated > earlier  # this batch repeats one of its own epoch
            self._repeats_found = self._repeats_found or found is not None
            self._emit(trainer, found, step)
            period = self._period.add(
                step,
                int(fingerprint),
                None if stream else length,
                within_epoch=within,
                per_epoch=per_epoch,
                setting=setting,
                rank=rank,
            )
            if not self._repeats_found:  # TFD121 already named these repeats, from inside one epoch
                self._emit(trainer, period, step)

    def _check_values(self, trainer: pl.Trainer, view: StepBatch, where: str) -> None:
        stats = self._statistics(view)
        prints, self._prints = self._prints, []
        if stats is None:
            return
        special = self._special_statistics(view)
        parts = [stats]
        if special is not None:
            parts.append(special[0].to(stats.dtype))
        on_device = [p[4] for p in prints if isinstance(p[4], Tensor)]
        if on_device:
            parts.append(torch.stack(on_device).to(stats.dtype))
        values = torch.cat(parts) if len(parts) > 1 else stats
        # host sync: the one transfer of this checked batch (its statistics, TFD124's counts while they are taken,
        # and the fingerprints since the last checked batch)
        host = values.tolist()
        s = unpack_statistics(host[: stats.numel()])
        offset = stats.numel()
        if special is not None and self._tally is not None:
            width = special[0].numel()
            self._emit(
                trainer,
                self._tally.add(
                    host[offset : offset + width],
                    special[1],
                    view.fields.paths["labels"],
                    view.fields.attention_mask is not None,
                ),
            )
            offset += width
        self._read_prints(trainer, prints, _merged_prints(prints, host[offset:]))
        ids, mask, labels = _token_fields(view)
        paths = BatchPaths(**{k: view.fields.paths[k] for k in ("input_ids", "attention_mask", "labels")})
        rules = self._rules
        self._emit(
            trainer, value_verdicts(s, where, paths, rules, has_mask=mask is not None, has_labels=labels is not None)
        )
        packed = tuple(k for k in view.fields.leaves if k.rsplit(".", 1)[-1] in PACKING_KEYS)  # host: key names
        self._emit(trainer, mask_hole_verdict(s, where, paths, has_mask=mask is not None, packed_keys=packed))
        self._emit(trainer, self._lengths.add(s, where))
        if not self._examples_logged and self.tokenizer is not None and self.decode_examples:
            self._examples_logged = True
            assert ids is not None
            self._log_examples(trainer, ids, labels if labels is not None and labels.shape == ids.shape else None)
        if self.should_measure(trainer):
            self.log_scalars(trainer, batch_metrics(s, rules, labels is not None))

    def _flush_prints(self, trainer: pl.Trainer) -> None:
        """Read the fingerprints not yet read (at the end of training: one host transfer)."""
        prints, self._prints = self._prints, []
        if not prints:
            return
        on_device = [p[4] for p in prints if isinstance(p[4], Tensor)]
        host = torch.stack(on_device).tolist() if on_device else []  # host sync: once, at the end of training
        self._read_prints(trainer, prints, _merged_prints(prints, host))

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.active:
            self._flush_prints(trainer)
        self._last = None

    # ------------------------------------------------------------------ failure: diagnose the batch that crashed
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        last, self._last, self._prints = self._last, None, []
        if last is None or not self.active or not isinstance(exception, Exception):
            return
        view, parts, checked = last
        where = self._where(parts)
        if checked:  # its values were checked before the forward
            return
        try:
            stats = self._statistics(view)
            if stats is None:
                return
            try:
                host = stats.tolist()  # host sync: on failure only, to name the bad value
            except RuntimeError:
                # a CUDA device-side assert poisons every later CUDA call: read ReproCapture's pinned host copy
                copy = shared_host_copy(trainer, view.batch)
                stats = None if copy is None else self._statistics(StepBatch(copy, self._batch_keys))
                if stats is None:
                    return
                host = stats.tolist()
            _, mask, labels = _token_fields(view)
            paths = BatchPaths(**{k: view.fields.paths[k] for k in ("input_ids", "attention_mask", "labels")})
            verdicts = value_verdicts(
                unpack_statistics(host),
                where,
                paths,
                self._rules,
                has_mask=mask is not None,
                has_labels=labels is not None,
                crash_only=True,
            )
            self._emit(trainer, verdicts)  # rank-local: warned and written to the findings file, never raised here
        except Exception as err:  # never mask the exception that is propagating
            rank_zero_warn(f"BatchGuard could not diagnose the failing batch: {err}", category=TFDebugWarning)

    # ------------------------------------------------------------------ decoded examples
    def _log_examples(self, trainer: pl.Trainer, ids: Tensor, labels: Tensor | None) -> None:
        k = min(self.decode_examples, ids.shape[0] if ids.ndim >= 2 else 1)
        rows = (ids if ids.ndim >= 2 else ids.reshape(1, -1))[:k].tolist()  # host sync: once per fit
        label_rows = None
        if labels is not None:
            label_rows = (labels if labels.ndim >= 2 else labels.reshape(1, -1))[:k].tolist()
        try:
            lines = decoded_examples(self.tokenizer, rows, label_rows, self.ignore_index, trainer.global_rank)
        except Exception as err:  # a tokenizer that cannot decode must not break training
            rank_zero_warn(
                f"BatchGuard: tokenizer.decode failed ({err}); no decoded examples.", category=TFDebugWarning
            )
            return
        body = "  \n".join(lines)
        if trainer.is_global_zero:
            for logger in trainer.loggers:
                if is_lightning_instance(logger, "TensorBoardLogger"):  # either Lightning package
                    logger.experiment.add_text("batch_guard/examples", body, global_step=trainer.global_step)
        write_text(
            os.path.join(self.tfdebug_dir, f"batch_examples-rank{trainer.global_rank}.md"), "\n".join(lines) + "\n"
        )

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        schema = None
        if self._schema is not None and self._declared is None and len(self._learned) >= self.learn_batches:
            schema = {k: {"dtype": v.dtype, "dims": v.dims} for k, v in self._schema.keys.items()}
        return {
            **super().state_dict(),
            "learned_schema": schema,
            "reference": self._lengths.reference,
            "window": list(self._lengths.sums),
            "examples_logged": self._examples_logged,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        learned = state_dict.get("learned_schema")
        if learned and self._declared is None:
            self._schema = Schema({k: KeySchema(v["dtype"], v["dims"]) for k, v in learned.items()})
            self._learned = [{}] * self.learn_batches  # learning is over: compare from the first batch on
            self._clean_structure = None
        self._lengths.reference = state_dict.get("reference")
        self._lengths.sums = list(state_dict.get("window", [0.0, 0.0, 0.0, 0]))
        self._examples_logged = bool(state_dict.get("examples_logged", False))


def _merged_prints(prints: list, device_values: list[float]) -> list[float]:
    """The fingerprints of ``prints`` in order: host ints as they are, device ones from ``device_values`` (read back
    in the order they were stacked)."""
    read = iter(device_values)
    return [next(read) if isinstance(p[4], Tensor) else p[4] for p in prints]
