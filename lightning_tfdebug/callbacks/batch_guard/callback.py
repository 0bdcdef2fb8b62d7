"""BatchGuard: checks every training batch before it reaches the model, and names the key that is wrong."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from typing import Any, ClassVar

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor

from lightning_tfdebug.callbacks.batch_guard import capture, checks, eos_checks, readings
from lightning_tfdebug.callbacks.batch_guard.capture import epoch_data
from lightning_tfdebug.callbacks.batch_guard.leakage_checks import LeakageWatch
from lightning_tfdebug.callbacks.batch_guard.leakage_rows import LEAKAGE_CHECK, LEAKAGE_ROW, LeakageRows, leakage_aside
from lightning_tfdebug.callbacks.batch_guard.length_checks import LengthSums, LengthWindow
from lightning_tfdebug.callbacks.batch_guard.loaders import EpochData
from lightning_tfdebug.callbacks.batch_guard.mask_hole_checks import packed_keys
from lightning_tfdebug.callbacks.batch_guard.repeat_checks import BatchRepeats, resumed_mid_epoch
from lightning_tfdebug.callbacks.batch_guard.schema import parse_declared_schema, structure_key
from lightning_tfdebug.callbacks.batch_guard.schema_checks import SchemaWatch
from lightning_tfdebug.callbacks.batch_guard.statistics import unpack_statistics
from lightning_tfdebug.callbacks.batch_guard.value_checks import value_verdicts
from lightning_tfdebug.core.base import DebugCallback, TFDebugWarning, check_number
from lightning_tfdebug.core.batch import step_batch
from lightning_tfdebug.core.data import special_token_sources
from lightning_tfdebug.core.model import load_tokenizer
from lightning_tfdebug.core.reduction import host_fields
from lightning_tfdebug.findings import OnFinding
from lightning_tfdebug.functional.special_ids import learn_special_ids
from lightning_tfdebug.functional.verdicts import Verdict
from lightning_tfdebug.primitives.batch import IGNORE_INDEX, BatchKeys, StepBatch
from lightning_tfdebug.primitives.keys import Key
from lightning_tfdebug.repro import shared_host_copy


class BatchGuard(DebugCallback):
    r"""Checks each training batch before the forward: schema drift, token ids, lengths, masks and targets.

    Every batch (in ``on_train_batch_start``): keys, dtypes and shapes against a declared or learned schema (host
    metadata), fingerprints of it and its rows (no sync). Checked batches: every value statistic in one transfer;
    between them a batch that crashes the forward is diagnosed in ``on_exception``. A fit resumed mid-epoch is checked
    against its DataLoader; validation and test rows against the training rows. Details: the docs page.

    Logged keys: :attr:`KEYS`; findings: the rules of :mod:`lightning_tfdebug.callbacks.batch_guard.checks` (docs page).

    Args:
        every_n_steps: log the `batch_guard/*` keys every this many steps; default: the Trainer's ``log_every_n_steps``.
        on_finding: ``"warn"``, ``"stop"`` or ``"raise"`` (before the forward, on checked steps); under DDP
            ``"stop"``/``"raise"`` cost one boolean all-reduce per batch so every rank acts together.
        schema: declared schema ``{key: "int64[B, T]"}`` (integer fixed, name shared, ``*`` free); ``None`` learns it.
        learn_batches: batches that the shared-dimension part of a learned schema is learned from.
        check_values_every_n_steps: value checks every this many steps; ``None`` on measuring steps only; 1 checks
            every batch before its forward (one host sync per batch), so ``"raise"`` stops before a bad batch.
        input_key: where the token ids are (a key, a dotted path, a tuple index); ``None`` finds them by name.
        mask_key: where the attention mask (1 = real token) is; given and found as ``input_key``.
        labels_key: where the labels are; given and found as ``input_key``.
        vocab_size: size of the vocabulary; ``None`` reads it from the model's input embedding.
        max_length: longest allowed sequence; ``None`` reads it from the model (config, position table, hparams).
        ignore_index: the label value that the loss ignores; ``None`` is PyTorch's and Hugging Face's -100.
        bos_id: the beginning-of-sequence token id; enables the BOS convention checks.
        eos_id: the end-of-sequence token id; enables the EOS convention and truncation checks.
        max_truncated_fraction: ``TFD119`` above this fraction of sequences filling ``max_length`` without EOS.
        length_window: checked batches per window of the length-shift check (the first window is the reference).
        length_shift_tolerance: ``TFD120`` when a window's mean length moves by more than this fraction of the first.
        max_repeated_fraction: ``TFD121`` above this fraction of an epoch's batches (and 3) repeating one of it;
            ``TFD123`` when the different batches fall short of ``min(read, len(DataLoader))`` by more (and 3).
        special_token_batches: checked batches over which special tokens are counted for ``TFD124``; 0 turns it off.
        min_eos_expected: ``TFD124`` needs this many supervised EOS to be expected while none is.
        tokenizer: an object with ``decode`` or an import path to one; the first batch's sequences are logged decoded.
        decode_examples: how many sequences to decode.
        max_overlap_fraction: ``TFD126``/``TFD127`` above this share (and 3) of validation/test rows trained on.

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

    COVERAGE: ClassVar[Mapping[str, tuple[str, ...]]] = checks.COVERAGE  # declared beside the rules
    COVERAGE_WATCHED: ClassVar[frozenset[str]] = frozenset(COVERAGE)  # verified by watching the whole fit
    KEYS: ClassVar[tuple[Key, ...]] = (
        Key("batch_guard/width", "padded sequence length", unit="tokens", chart="batches"),
        Key("batch_guard/length_mean", "mean real length (attention mask sum) per sequence", "tokens", "batches"),
        Key("batch_guard/ignored_frac", "fraction of labels equal to `ignore_index`", chart="batches"),
        Key("batch_guard/pad_frac", "fraction of positions whose attention mask is 0", chart="batches"),
        Key(
            "batch_guard/truncated_frac",
            "fraction of sequences that fill the maximum length with no EOS (needs `eos_id`)",
            chart="batches",
        ),
    )

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
        max_overlap_fraction: float = 0.1,
    ) -> None:
        super().__init__(every_n_steps=every_n_steps, on_finding=on_finding)
        if schema is not None and (not isinstance(schema, Mapping) or not schema):
            raise ValueError(f"`schema` must be a non-empty mapping {{key: 'int64[B, T]'}} or None; got {schema!r}.")
        declared = parse_declared_schema(schema) if schema is not None else None
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
        check_number("max_overlap_fraction", max_overlap_fraction, low=0.0, high=1.0, low_inclusive=False)
        # raises a TypeError naming the argument when a key is not a string, a tuple position or None
        self._batch_keys = BatchKeys(
            input_key, mask_key, labels_key, ignore_index=IGNORE_INDEX if ignore_index is None else ignore_index
        )
        self.schema = dict(schema) if schema is not None else None
        self.learn_batches, self.check_values_every_n_steps = learn_batches, check_values_every_n_steps
        self.input_key, self.mask_key, self.labels_key = input_key, mask_key, labels_key
        self.vocab_size, self.max_length, self.ignore_index = vocab_size, max_length, self._batch_keys.ignore_index
        self.bos_id, self.eos_id, self.max_truncated_fraction = bos_id, eos_id, float(max_truncated_fraction)
        self.length_window, self.length_shift_tolerance = length_window, float(length_shift_tolerance)
        self.max_repeated_fraction = float(max_repeated_fraction)
        self.tokenizer, self.decode_examples = load_tokenizer(tokenizer), decode_examples
        self.special_token_batches, self.min_eos_expected = special_token_batches, float(min_eos_expected)
        # the vocabulary and the context are read from the model at setup when not given
        self._rules = readings.ValueRules(
            vocab_size, max_length, self.ignore_index, bos_id, eos_id, self.max_truncated_fraction
        )
        self._encoder_decoder = False  # labels are the decoder's targets, not aligned with the input ids
        self._schema = SchemaWatch(learn_batches, declared, max_length)
        self._lengths = LengthWindow(length_window, self.length_shift_tolerance)
        self._repeats = BatchRepeats(self.max_repeated_fraction)
        self.max_overlap_fraction = float(max_overlap_fraction)
        self._leak = LeakageRows(LeakageWatch(self.max_overlap_fraction))  # TFD126/TFD127's rows
        self._epoch = EpochData()  # the training data of the current epoch (set per epoch)
        self._tally: eos_checks.SpecialTokenTally | None = None  # TFD124's count, None when off
        self._last: readings.KeptBatch | None = None  # the step's batch, diagnosed if its forward raises
        self._keys_announced = self._examples_logged = False
        self._fit_started = False  # the fit's first batch was seen (a resume shows there)

    @property
    def state_key(self) -> str:
        return self._generate_state_key(input_key=self.input_key, labels_key=self.labels_key, schema=self.schema)

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
        vocab, context = capture.model_limits(pl_module, self.vocab_size, self.max_length)
        self._rules = dataclasses.replace(self._rules, vocab_size=vocab, context=context)
        self._repeats.new_fit()  # a new fit reads its data anew
        self._leak.new_fit()
        self._schema.new_context(context)  # the context may have changed with the model
        self._tally = None
        self._fit_started = False

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # here, not in setup: the training DataLoader (whose collator may hold the tokenizer) exists from now on;
        # a fit resumed mid-epoch starts its first epoch without `on_train_epoch_start`
        self._epoch = epoch_data(trainer)
        if self.special_token_batches and self.active:
            ids = learn_special_ids(special_token_sources(trainer, pl_module, self.tokenizer), self.eos_id)
            aside = eos_checks.eos_count_aside(ids)
            if aside is None:
                self._tally = eos_checks.SpecialTokenTally(ids, self.min_eos_expected, self.special_token_batches)
            else:
                self.check_aside(eos_checks.EOS_CHECK, *aside)

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._epoch = epoch_data(trainer)  # host metadata, once per epoch

    # ------------------------------------------------------------------ every batch (hot path: host metadata and
    # one fingerprint, no sync; values only on checked steps)
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if not self.active or trainer.sanity_checking:
            return
        step, epoch = trainer.global_step, trainer.current_epoch
        place = readings.BatchPlace(batch_idx, step, epoch, trainer.global_rank)  # named only for a finding
        view = step_batch(trainer, batch, self._batch_keys)  # the step's one reading of the batch, shared
        if not self._keys_announced:  # once: where the fields were found, when the user should know
            self._keys_announced = True
            notice = readings.fields_notice(view.fields.paths, view.fields.leaves, self._batch_keys.input_key)
            if notice is not None:  # said in the debug log only: a healthy run prints nothing from the pack
                logging.getLogger("lightning_tfdebug").debug(notice)
        structure = structure_key(view.fields.leaves)  # host metadata only
        if structure != self._schema.clean:  # a batch shaped like the last one that passed would pass too
            ids_path = view.fields.paths["input_ids"]
            found = self._schema.check(structure, view.fields.leaves, ids_path, place.name())
            self.emit(trainer, found, synchronized=False)  # rank-local: each rank judges its own batch
        if not self._fit_started:  # a fit resumed mid-epoch starts at a batch index past 0
            self._fit_started = True
            resumed = resumed_mid_epoch(batch_idx, step, epoch, trainer.global_rank, self._epoch)
            if resumed is not None:
                self._repeats.resumed_epoch = epoch  # the restarted loader's repeats are TFD125's, not TFD123's
            self.emit(trainer, resumed, synchronized=False)
        checked = self.should_measure(trainer) or (
            self.check_values_every_n_steps is not None and step % self.check_values_every_n_steps == 0
        )
        # a reference, no copy: if the forward raises, `on_exception` diagnoses this batch
        self._last = readings.KeptBatch(view, place, checked)
        ids = view.token_fields()[0]
        if ids is not None:
            self._repeats.add(epoch, step, self._epoch, ids)  # a fingerprint: no sync (a host int for a CPU batch)
        capture.learn_pad_ids(self._leak, trainer, pl_module, self.tokenizer)  # host attributes, once per fit
        self._leak.add_trained(view, step, trainer.global_rank, self.ignore_index, not self._encoder_decoder)  # no sync
        if checked:
            self._check_values(trainer, view, place.name())
        # Findings are rank-local (each rank sees its own batch). With "stop"/"raise" this is one boolean all-reduce,
        # on every batch and on every rank alike (decided from nothing but the hook being called), so all ranks act
        # together before the forward; with "warn" it does nothing.
        self.resolve_local_findings(trainer)

    # ------------------------------------------------------------------ checked batches
    def _statistics(self, view: StepBatch) -> Tensor | None:
        ids, mask, labels = view.token_fields()
        if ids is None:
            return None
        positions = view.fields.position_ids if isinstance(view.fields.position_ids, Tensor) else None
        return self._rules.statistics(ids, mask, labels, positions, labels_aligned=not self._encoder_decoder)

    def _special_statistics(self, view: StepBatch) -> tuple[dict[str, Tensor], bool] | None:
        """TFD124's counts of this batch on the device (no sync) and whether its labels align with the ids; None when
        the count is off, done, or cannot use this batch (then it stands aside)."""
        tally = self._tally
        if tally is None or tally.done:
            return None
        ids, mask, labels = view.token_fields()
        assert ids is not None
        aligned, aside = eos_checks.batch_aside(tally.ids, ids, mask, labels, self._encoder_decoder)
        if aside is not None:
            self.check_aside(eos_checks.EOS_CHECK, *aside)
            return None
        assert labels is not None
        return tally.statistics(ids, mask, labels, self.ignore_index, aligned), aligned

    def _check_values(self, trainer: pl.Trainer, view: StepBatch, where: str) -> None:
        prints = self._repeats.take()
        stats = self._statistics(view)
        if stats is None:
            return
        special = self._special_statistics(view)
        fingerprints = BatchRepeats.on_device(prints)
        rows, row_fields = self._leak.device_fields(train_only=True)
        fields: dict[str, Tensor] = {"statistics": stats, **(special[0] if special else {}), **row_fields}
        if fingerprints:
            fields["fingerprints"] = torch.stack(fingerprints)
        # host sync: the one transfer of this checked batch (its statistics, TFD124's counts while they are taken,
        # the fingerprints of the batches and of their rows since the last checked batch), read back by name
        host = host_fields(fields)
        self._leak.read(rows, host)
        if trainer.world_size == 1:  # one process: the rows are compared now (under DDP: at the loops' ends)
            found = capture.leakage_verdicts(self._leak, trainer.global_step, exchange=False)
            self.emit(trainer, found, synchronized=False)
        s = unpack_statistics(host["statistics"])
        if special is not None and self._tally is not None:
            has_mask, labels_path = view.fields.attention_mask is not None, view.fields.paths["labels"]
            self.emit(trainer, self._tally.add(host, special[1], labels_path, has_mask), synchronized=False)
        device_prints = host.get("fingerprints", [])
        self.emit(trainer, self._repeats.read(prints, device_prints, trainer.global_rank), synchronized=False)
        self.emit(trainer, self._value_verdicts(view, s, where), synchronized=False)
        ids, _, labels = view.token_fields()
        if not self._examples_logged and self.tokenizer is not None and self.decode_examples:
            self._examples_logged = True
            examples = (ids, labels if labels is not None and labels.shape == ids.shape else None, self.decode_examples)
            capture.log_examples(trainer, self.tfdebug_dir, self.tokenizer, examples, self.ignore_index)
        if self.should_measure(trainer):
            self.log_scalars(trainer, readings.batch_metrics(s, self._rules, labels is not None))

    def _value_verdicts(
        self, view: StepBatch, s: dict[str, float], where: str, crash_only: bool = False
    ) -> list[Verdict | None]:
        """The rules of one batch's values, and, unless ``crash_only``, the length window."""
        _, mask, labels = view.token_fields()
        paths, packed = readings.BatchPaths.of(view.fields.paths), packed_keys(view.fields.leaves)
        present = {"has_mask": mask is not None, "has_labels": labels is not None}
        found = value_verdicts(s, where, paths, self._rules, **present, packed=packed, crash_only=crash_only)
        return [*found] if crash_only else [*found, self._lengths.add(s, where)]

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        prints = self._repeats.take()
        if self.active and prints:  # the fingerprints not yet read
            fingerprints = BatchRepeats.on_device(prints)
            host = torch.stack(fingerprints).tolist() if fingerprints else []  # host sync: once, at the end of training
            self.emit(trainer, self._repeats.read(prints, host, trainer.global_rank), synchronized=False)
        if self._leak.loops:  # alike on every rank (merged at each loop's end): training rows read since, compared
            self.on_validation_epoch_end(trainer, pl_module)
        if self.active:  # n/a without a validation or test loop
            self.cover(LEAKAGE_ROW, *self._leak.coverage(LEAKAGE_CHECK in self.checks_aside))
        self._last = None

    # ------------------------------------------------------------------ validation and test batches (TFD126, TFD127)
    def on_validation_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        if self.active:  # its rows' keys on the device, no sync (read at the loop's end); step -1: the sanity check
            loop, step = "test" if trainer.testing else "validation", trainer.global_step
            place = (-1 if trainer.sanity_checking else step, dataloader_idx, batch_idx, trainer.global_rank)
            capture.learn_pad_ids(self._leak, trainer, pl_module, self.tokenizer)
            view = StepBatch(batch, self._batch_keys)
            if not self._leak.add_loop(loop, view, place, self.ignore_index, not self._encoder_decoder):
                self.check_aside(LEAKAGE_CHECK, *leakage_aside(loop))  # no field shared with training: said once

    on_test_batch_start = on_validation_batch_start  # the test loop's rows, the same way (TFD127)

    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.active:  # every rank, at the same point: the rows cross ranks here
            self.emit(trainer, capture.leakage_verdicts(self._leak, trainer.global_step))

    on_test_epoch_end = on_validation_epoch_end  # the test rows are decided the same way

    # ------------------------------------------------------------------ failure: diagnose the batch that crashed
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        last, self._last = self._last, None
        self._repeats.take()
        if last is None or not self.active or not isinstance(exception, Exception) or last.checked:
            return  # nothing kept, or the batch's values were checked before the forward
        view = last.view
        try:
            stats = self._statistics(view)
            try:
                host = None if stats is None else stats.tolist()  # host sync: on failure only, to name the bad value
            except RuntimeError:
                # a CUDA device-side assert poisons every later CUDA call: read ReproCapture's pinned host copy
                copy = shared_host_copy(trainer, view.batch)
                stats = None if copy is None else self._statistics(StepBatch(copy, self._batch_keys))
                host = None if stats is None else stats.tolist()
            if host is not None:  # rank-local: warned and written to the findings file, never raised here
                verdicts = self._value_verdicts(view, unpack_statistics(host), last.place.name(), crash_only=True)
                self.emit(trainer, verdicts, synchronized=False)
        except Exception as err:  # never mask the exception that is propagating
            rank_zero_warn(f"BatchGuard could not diagnose the failing batch: {err}", category=TFDebugWarning)

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        return {
            **super().state_dict(),
            "learned_schema": self._schema.state(),
            "reference": self._lengths.reference,
            "window": self._lengths.sums.state(),
            "examples_logged": self._examples_logged,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self._schema.load(state_dict.get("learned_schema"))
        self._lengths.reference = state_dict.get("reference")
        self._lengths.sums = LengthSums.load(state_dict.get("window"))
        self._examples_logged = bool(state_dict.get("examples_logged", False))
