"""BatchGuard's rules: each finding code with its text, and the functions and small state machines that decide it.

Each takes host values (a batch's :class:`~lightning_tfdebug.functional.batches.FieldSpec`, its unpacked
:func:`~lightning_tfdebug.functional.batches.token_statistics`, fingerprints) and returns verdicts: testable with
plain numbers, without a Trainer.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
from torch import Tensor

from lightning_tfdebug.functional.batches import (
    Drift,
    FieldSpec,
    KeySchema,
    Schema,
    compare_schema,
    describe_leaves,
    device_fingerprint,
    host_fingerprint,
    learn_schema,
    length_shift,
    special_token_statistics,
    token_statistics,
)
from lightning_tfdebug.functional.verdicts import Rule, Verdict

TFD101 = Rule(
    "TFD101",
    "error",
    "BatchGuard",
    title="a key of the schema is missing",
    trigger="a key of the schema (declared, or learned from the first batches) is missing from a batch",
    hint="build every batch through the same collate path; a key that only some samples carry needs a default",
    reason="A batch without a field the step reads fails that step or feeds the model something else",
    message="{where}: key '{key}' is missing (expected {expected}) ({schema}).",
)

TFD102 = Rule(
    "TFD102",
    "warning",
    "BatchGuard",
    title="a key the learned schema does not have",
    trigger="a batch carries a key the learned schema does not have",
    hint="as TFD101; if the key is legitimate and optional, declare the `schema`",
    reason="Measured in this run's batches: two collate paths build them, so some batches are not what the rest are",
    message="{where}: key '{key}' is new: {found}, absent from the earlier batches ({schema}).",
)

TFD103 = Rule(
    "TFD103",
    "error",
    "BatchGuard",
    title="dtype changed (int32 labels, float mask)",
    trigger="a key's dtype differs from the schema (int32 labels where int64 were, a float attention mask)",
    hint="build every field with an explicit dtype (`torch.tensor(x, dtype=torch.long)`); no cast in one branch only",
    reason="The ops that take the field fail or change meaning (cross_entropy takes int64; a float mask is added)",
    message="{where}: '{key}' has dtype {found}; expected {expected} ({schema}).",
)

TFD104 = Rule(
    "TFD104",
    "error",
    "BatchGuard",
    title="number of dimensions changed (a squeezed batch of one)",
    trigger="a key's number of dimensions differs (a batch of one squeezed to 1-D)",
    hint="never `squeeze()` a batch; keep the batch dimension (`x[None]`, `unsqueeze(0)`)",
    reason="A squeezed batch breaks the shapes the model and the loss rely on: the step fails or broadcasts wrongly",
    message="{where}: '{key}' has {found}; expected {expected} ({schema}).",
)

TFD105 = Rule(
    "TFD105",
    "error",
    "BatchGuard",
    title="a size differs from the declared size or from the key it always matched",
    trigger="a dimension differs from the declared size, or from the key it matched in every early batch",
    hint="pad / truncate every key of a batch together; check the declared sizes",
    reason="Fields that no longer line up fail the step or score positions against the wrong labels",
    message="{where}: '{key}' has {found}; expected {expected} ({schema}).",
)

TFD110 = Rule(
    "TFD110",
    "error",
    "BatchGuard",
    title="token id outside `[0, vocab)`",
    trigger="an input id is outside `[0, vocab)` (checked steps, or the batch whose step raised)",
    hint=(
        "The tokenizer and the model disagree on the vocabulary (added special tokens without "
        "resize_token_embeddings, a different tokenizer revision), or a pad id of -1. On CUDA this is a device-side "
        "assert."
    ),
    reason="An embedding lookup outside the table fails the step (a device-side assert on CUDA)",
    message=(
        "{where}: '{ids_key}' holds {count:.0f} token id(s) outside [0, {vocab_size}); the first is {value} at row "
        "{row}, position {column}."
    ),
)

TFD111 = Rule(
    "TFD111",
    "error",
    "BatchGuard",
    title="sequence longer than the model's context",
    trigger="the sequence length exceeds the model's context (position table, config, `max_length`)",
    hint=(
        "Truncate in the collate function (tokenizer(..., truncation=True, max_length=...)) or pack to the context "
        "length; check sequence packing and concatenation code."
    ),
    reason="Positions past the model's table fail the step or read rows that were never trained",
    message=(
        "{where}: '{key}' has sequence length {width}, longer than the model's context of {max_length}; positions "
        "past it have no embedding (an index or shape error deep in the model, or silent wrap-around)."
    ),
)

TFD112 = Rule(
    "TFD112",
    "error",
    "BatchGuard",
    title="attention mask not binary",
    trigger="the attention mask holds values other than 0 and 1 (checked steps, or the batch whose step raised)",
    hint=(
        "An attention mask marks real tokens with 1 and padding with 0. Additive masks (0 / -inf) belong inside the "
        "model, not in the batch."
    ),
    reason="A mask of other values is applied as weights or added to the scores: attention is wrong",
    message="{where}: '{key}' has {count:.0f} value(s) that are neither 0 nor 1 (e.g. {example:g}).",
)

TFD113 = Rule(
    "TFD113",
    "error",
    "BatchGuard",
    title="label outside `[0, vocab)` and not `ignore_index`",
    trigger="a label is outside `[0, vocab)` and not `ignore_index` (checked steps, or the batch whose step raised)",
    hint="Mask with the loss's ignore_index (-100 for cross_entropy), not with the pad id or -1.",
    reason="Cross_entropy rejects a class index outside the vocabulary (a device-side assert on CUDA): the step fails",
    message=(
        "{where}: '{labels_key}' holds {count:.0f} label(s) outside [0, {vocab_size}) that are not "
        "ignore_index={ignore_index} (e.g. {value})."
    ),
)

TFD114 = Rule(
    "TFD114",
    "error",
    "BatchGuard",
    title="every label ignored: nothing is learned",
    trigger="every label of a batch is `ignore_index`: nothing is learned, the loss is 0 or NaN",
    hint=(
        "Check the label mask: prompt masking that also masks the completion, truncation that cut every answer away, "
        "or labels built from the wrong field."
    ),
    reason="A batch with no supervised label gives a loss of 0 or NaN, and a NaN loss ruins the weights",
    message=(
        "{where}: every label in '{labels_key}' is ignore_index={ignore_index}; this batch teaches nothing (the loss "
        "is 0 or NaN)."
    ),
)

TFD115 = Rule(
    "TFD115",
    "warning",
    "BatchGuard",
    title="padding positions supervised",
    trigger="padding positions (mask 0) carry a label that is not `ignore_index`",
    hint="`labels[attention_mask == 0] = -100` in the collate function",
    reason="Measured in the batches: the loss spends its weight on predicting padding, which the model then learns",
    message=(
        "{where}: '{labels_key}' supervises {pad_supervised:.0f} of {pad_positions:.0f} padding positions "
        "('{mask_key}' 0, label not ignore_index={ignore_index}): the model is trained to predict padding."
    ),
)

TFD116 = Rule(
    "TFD116",
    "warning",
    "BatchGuard",
    title="sequences without BOS",
    trigger="sequences whose first real token is not `bos_id`",
    hint="The tokenizer's add_special_tokens / chat template differs between data paths, or packing dropped it.",
    reason="Measured against the `bos_id` you declared: the model trains on a format it will not see at inference",
    message="{where}: {without_bos:.0f} of {sequences} sequences do not start with BOS ({bos_id}).",
)

TFD117 = Rule(
    "TFD117",
    "warning",
    "BatchGuard",
    title="several EOS in a sequence",
    trigger="sequences with more than one `eos_id`",
    hint=(
        "EOS added twice (by the template and the tokenizer), or documents packed without an attention boundary. If "
        "you pack on purpose, leave eos_id unset."
    ),
    reason="Measured in the batches: the model is trained to continue past its end token",
    message="{where}: {several_eos:.0f} of {sequences} sequences hold more than one EOS ({eos_id}).",
)

TFD118 = Rule(
    "TFD118",
    "warning",
    "BatchGuard",
    title="real tokens after EOS",
    trigger="real (mask 1) tokens after the first EOS",
    hint="The pad token equals EOS but the mask is 1 on padding, or sequences were packed.",
    reason="Measured in the batches: text after the end token is trained as a continuation of the document",
    message="{where}: {tokens_after_eos:.0f} of {sequences} sequences have real tokens after their EOS.",
)

TFD119 = Rule(
    "TFD119",
    "warning",
    "BatchGuard",
    title="truncation rate above `max_truncated_fraction`",
    trigger="more than `max_truncated_fraction` of a batch's sequences fill the maximum length with no EOS",
    hint="Raise the context length, split long documents, or check that truncation keeps the answer.",
    reason="Measured in the batches: most sequences are cut before their end, so the model rarely sees endings",
    message=(
        "{where}: {truncated} of {sequences} sequences fill the maximum length {max_length} with no EOS: they were "
        "truncated."
    ),
)

TFD120 = Rule(
    "TFD120",
    "warning",
    "BatchGuard",
    title="the length distribution moved away from the early batches",
    trigger="a window's mean real length moved from the first window's by over `length_shift_tolerance` and one std",
    hint=(
        "The data changed under the run: a new shard or source, a tokenizer swap, sorted or curriculum data, or a "
        "truncation setting that differs between files."
    ),
    reason="Measured in this run: later batches differ from the early ones (data sorted or grouped)",
    message=(
        "{where}: the mean sequence length of the last {size} checked batches is {window_mean:.1f}, against "
        "{reference_mean:.1f} (std {reference_std:.1f}) in the first ones."
    ),
)

TFD121 = Rule(
    "TFD121",
    "warning",
    "BatchGuard",
    title="batches of one epoch repeat earlier batches of that epoch token for token",
    trigger=(
        "over `max_repeated_fraction` of an epoch's batches (and 3) equal an earlier one of it (a stream: within 16)"
    ),
    hint=(
        "Within one epoch a sampler draws every sample once, so identical batches mean the data is read more than "
        "once: an IterableDataset read by several DataLoader workers that do not split the stream (shard it with "
        "torch.utils.data.get_worker_info()), a Dataset whose __getitem__ ignores its index, a sampler with "
        "replacement, or duplicated rows in the data."
    ),
    reason="Measured in this run: one epoch trains on duplicates instead of the data",
    message=(
        "{repeated} of the {checked} batches checked so far in epoch {epoch} (rank {rank}) repeat an earlier batch of "
        "the same epoch token for token; the first, at step {step}, repeats step {repeats_step}."
    ),
)

TFD122 = Rule(
    "TFD122",
    "warning",
    "BatchGuard",
    title="attention mask with holes: real tokens masked out inside the text",
    trigger=(
        "a binary attention mask of the ids' shape masks positions between real tokens of a row (or at both ends of "
        "it), at most half of those rows' text; not for packed batches (position ids restarting in a row, "
        "`cu_seqlens` / `document_ids`-like keys) or 3-D/4-D masks"
    ),
    hint=(
        "A mask built as input_ids != pad_id where the pad id is also a real token (GPT-2 / Llama reuse EOS as "
        "padding): take the mask from the tokenizer, or pad with an id that never occurs in text."
    ),
    reason="Measured in the batches: real tokens inside the text are masked out, so the model cannot attend to them",
    message=(
        "{where}: '{key}' masks {holes:.0f} position(s) inside the text of {rows} of {sequences} rows "
        "({hole_fraction:.1%} of those rows' text; the first at row {first_hole[0]}, position {first_hole[1]}, id "
        "{first_hole_id}): padding belongs at one end of a row, so real tokens are hidden from attention. {cause}"
    ),
)

TFD123 = Rule(
    "TFD123",
    "warning",
    "BatchGuard",
    title="the same batches come back sooner than the data allows",
    trigger=(
        "fewer different batches than min(read, the DataLoader's length) by 3 and `max_repeated_fraction` of it, or "
        "repeats inside epochs summed to as many; silent once TFD121 has spoken"
    ),
    hint=(
        "Remove Trainer(overfit_batches=...) or a limit_train_batches on an unshuffled DataLoader left on from "
        "debugging (every epoch then reads the same first batches); otherwise find what makes the data repeat: a "
        "Dataset whose __getitem__ ignores its index, a DataLoader or sampler that yields the same batch."
    ),
    reason="evidence of harm in this run: the model memorises a fraction of its data and never reads the rest",
    message=(
        "{what}: the same batches come back sooner than the data allows ({repeats_within_epochs} of them repeat a "
        "batch of their own epoch; the first repeat, at step {step}, repeats step {repeats_step}).{cause}"
    ),
)

TFD124 = Rule(
    "TFD124",
    "warning",
    "BatchGuard",
    title="the end-of-sequence token occurs in the inputs and is never supervised",
    trigger=(
        "over the first `special_token_batches` checked batches of a causal LM or a decoder's targets, "
        "`min_eos_expected` supervised EOS are expected from the inputs and none is"
    ),
    hint=(
        "Find where the labels lose the EOS: a collator that masks by id (labels == pad_id while pad id == EOS id, as "
        "DataCollatorForLanguageModeling with tokenizer.pad_token = tokenizer.eos_token does), a completion-only mask "
        "that ends before the EOS. Mask padding by position (attention_mask == 0) or give the tokenizer a pad token "
        "of its own."
    ),
    reason="evidence of harm in this run: the model is never taught to end a sequence",
    message=(
        "Over the first {batches} checked batches the end-of-sequence token {eos_id} occurs {eos_in_inputs:.0f} times "
        "among the {inputs} and is never supervised: none of the {supervised_labels:.0f} supervised labels in "
        "{labels_at} is EOS (about {expected_supervised:.0f} expected at this data's supervised share of "
        "{share:.0%}). The model never learns to stop: it generates until the length limit.{collator}"
    ),
)

TFD125 = Rule(
    "TFD125",
    "warning",
    "BatchGuard",
    title="resumed mid-epoch with a DataLoader that cannot restore its position",
    trigger=(
        "a fit resumes at batch S > 0 of an epoch and a training DataLoader has no `state_dict`/`load_state_dict`; "
        "info when it shuffles"
    ),
    hint=(
        "Use a DataLoader that Lightning restores (torchdata's StatefulDataLoader, or any loader with state_dict / "
        "load_state_dict), or resume from checkpoints saved at epoch ends (ModelCheckpoint(every_n_epochs=1, "
        "save_on_train_epoch_end=True))."
    ),
    reason="evidence of harm in this run: the resumed epoch trains some batches twice and skips others",
    message=(
        "The fit resumed at batch {start} of a {per_epoch}-batch epoch (step {step}, epoch {epoch}, rank {rank}), and "
        "the training DataLoader cannot restore its position: Lightning restarts it from the epoch's first batch. "
        "{effect}"
    ),
)

DRIFT_RULES: dict[str, Rule] = {"missing": TFD101, "extra": TFD102, "dtype": TFD103, "ndim": TFD104, "size": TFD105}
"""The rule of each kind of schema :class:`~lightning_tfdebug.functional.batches.Drift`."""

BLOCK = ("TFD101", "TFD129")
"""The codes reserved for BatchGuard's rules."""

RULES: tuple[Rule, ...] = (
    TFD101,
    TFD102,
    TFD103,
    TFD104,
    TFD105,
    TFD110,
    TFD111,
    TFD112,
    TFD113,
    TFD114,
    TFD115,
    TFD116,
    TFD117,
    TFD118,
    TFD119,
    TFD120,
    TFD121,
    TFD122,
    TFD123,
    TFD124,
    TFD125,
)
"""The rules decided in this module, in code order."""

STREAM_REPEAT_WINDOW = 16  # from a stream, a repeat counts only this close (a stream may cycle its data)
MAX_EPOCH_PRINTS = 100_000  # fingerprints kept per epoch for TFD121 (a few MB at most)
MIN_EXCESS_REPEATS = 3  # TFD123 needs at least this many batches beyond the distinct ones the data allows


# ------------------------------------------------------------------------------------------------ readings
@dataclass(frozen=True)
class BatchPaths:
    """Where the ids, the attention mask and the labels of a batch are (``None``: the batch has none)."""

    input_ids: str | None
    attention_mask: str | None
    labels: str | None

    @classmethod
    def of(cls, paths: Mapping[str, str | None]) -> BatchPaths:
        """From :class:`~lightning_tfdebug.primitives.batch.BatchFields`' ``paths``."""
        return cls(paths.get("input_ids"), paths.get("attention_mask"), paths.get("labels"))


@dataclass(frozen=True)
class ValueRules:
    """What the value checks compare against."""

    vocab_size: int | None
    context: int | None
    ignore_index: int
    bos_id: int | None = None
    eos_id: int | None = None
    max_truncated_fraction: float = 0.5

    def statistics(
        self,
        ids: Tensor,
        mask: Tensor | None,
        labels: Tensor | None,
        position_ids: Tensor | None = None,
        labels_aligned: bool = True,
    ) -> Tensor:
        """One batch's :func:`~lightning_tfdebug.functional.batches.token_statistics` for these rules, on its device."""
        with torch.no_grad():
            return token_statistics(
                ids,
                mask,
                labels,
                vocab_size=self.vocab_size,
                ignore_index=self.ignore_index,
                bos_id=self.bos_id,
                eos_id=self.eos_id,
                max_length=self.context,
                position_ids=position_ids,
                labels_aligned=labels_aligned,
            )


class EpochData(NamedTuple):
    """An epoch's training data (host metadata, read once per epoch).

    Attributes:
        stream: not a map-style DataLoader (no epochs of its own).
        loader_length: batches per epoch before any Trainer limit; None for a stream or several loaders.
        per_epoch: the batches the Trainer reads per epoch.
        setting: the Trainer limit in force (``"Trainer(overfit_batches=1)"``).
        stateful: every loader can restore its position (``state_dict``/``load_state_dict``).
        in_order: every loader reads in a fixed order (no shuffling).
    """

    stream: bool = False
    loader_length: int | None = None
    per_epoch: int | None = None
    setting: str | None = None
    stateful: bool = False
    in_order: bool = False


def batch_name(batch_idx: int, step: int, epoch: int, rank: int) -> str:
    """The batch a finding names (the ``where`` of the messages)."""
    return f"Batch {batch_idx} (step {step}, epoch {epoch}, rank {rank})"


def fields_notice(paths: Mapping[str, str | None], leaves: Mapping[str, Any], input_key: str | None) -> str | None:
    """Where the first batch's fields were found, when the user should know (no ids, or ids under another name)."""
    ids = paths.get("input_ids")
    if ids is None:
        return (
            f"BatchGuard: no token ids in the first batch (keys: {sorted(leaves)}); the token, length and label checks "
            "are off, the schema checks stay on. Set `input_key` (and `labels_key`, `mask_key`)."
        )
    if ids != (input_key or "input_ids"):
        return (
            f"BatchGuard: token ids taken from '{ids}' and labels from '{paths.get('labels')}' (the batch has no "
            "'input_ids'); set `input_key` / `labels_key` if that is wrong."
        )
    return None


# ------------------------------------------------------------------------------------------------ host metadata
def drift_verdicts(drifts: list[Drift], where: str, declared: bool) -> list[Verdict]:
    """``TFD101``-``TFD105``: one verdict per difference between a batch and its schema, recorded once per key."""
    schema = "the declared schema" if declared else "the schema learned from the first batches"
    evidence = [{"key": d.key, "expected": d.expected, "found": d.found} for d in drifts]
    return [DRIFT_RULES[d.kind].verdict(e, key=d.key, where=where, schema=schema) for d, e in zip(drifts, evidence)]


def too_long(where: str, ids_path: str | None, spec: FieldSpec | None, context: int | None) -> Verdict | None:
    """``TFD111`` from the ids' shape alone (host metadata): a sequence longer than the model's context."""
    if context is None or ids_path is None or spec is None or not spec.shape or spec.shape[-1] <= context:
        return None
    evidence = {"key": ids_path, "shape": list(spec.shape), "max_length": context}
    return TFD111.verdict(evidence, where=where, width=spec.shape[-1])


@dataclass
class SchemaWatch:
    """``TFD101``-``TFD105`` and ``TFD111`` from host metadata: each batch against its schema, declared or learned.

    A learned schema comes from the first ``learn_batches`` batches that do not drift
    (:func:`~lightning_tfdebug.functional.batches.learn_schema`). Once learned, a batch with the structure of the last
    one that found nothing finds nothing either: the caller skips :meth:`check` while ``structure == clean``.
    """

    learn_batches: int = 4
    declared: Schema | None = None
    context: int | None = None  # the model's context (None: unknown, TFD111 is off)
    schema: Schema | None = None
    learned: list[dict[str, FieldSpec]] = field(default_factory=list)
    clean: tuple | None = None  # the structure of the last batch that found nothing, learning over

    def __post_init__(self) -> None:
        self.schema = self.schema or self.declared

    def new_context(self, context: int | None) -> None:
        """The model's context (read at each fit's set-up): the next batch is compared in full."""
        self.context, self.clean = context, None

    def check(self, structure: tuple, leaves: Mapping[str, Any], ids_path: str | None, where: str) -> list[Verdict]:
        """The drifts of the batch whose flattened ``leaves`` have ``structure``, and its width against the context."""
        specs = describe_leaves(leaves)
        declared = self.declared is not None
        learning = not declared and len(self.learned) < self.learn_batches
        drifts = [] if self.schema is None else compare_schema(self.schema, specs)
        if learning:  # shared sizes are not known yet; a drifting batch does not teach the schema
            drifts = [d for d in drifts if d.kind != "size"]
            if not drifts:
                self.learned.append(specs)
                self.schema = learn_schema(self.learned)
        long = too_long(where, ids_path, specs.get(ids_path or ""), self.context)
        found = drift_verdicts(drifts, where, declared) + ([long] if long is not None else [])
        self.clean = structure if not learning and not found else None
        return found

    def state(self) -> dict[str, Any] | None:
        """The learned schema as plain values once learning is over (None while learning, or when declared)."""
        if self.schema is None or self.declared is not None or len(self.learned) < self.learn_batches:
            return None
        return {k: {"dtype": v.dtype, "dims": v.dims} for k, v in self.schema.keys.items()}

    def load(self, learned: Mapping[str, Any] | None) -> None:
        """Restore :meth:`state`: learning is over, batches are compared from the first on."""
        if learned and self.declared is None:
            self.schema = Schema({k: KeySchema(v["dtype"], v["dims"]) for k, v in learned.items()})
            self.learned = [{}] * self.learn_batches
            self.clean = None


# ------------------------------------------------------------------------------------------------ values
# Each takes one batch's unpacked statistics ``s`` (:func:`~lightning_tfdebug.functional.batches.token_statistics`),
# its name ``where``, where its fields are and what they are compared against.
def ids_outside_vocabulary(s: dict[str, float], where: str, paths: BatchPaths, rules: ValueRules) -> Verdict | None:
    """``TFD110``: input ids outside ``[0, vocab)``, naming the first (row, position, value)."""
    if s["ids_out_of_range"] <= 0:
        return None
    evidence = {
        "count": s["ids_out_of_range"],
        "min": s["ids_min"],
        "max": s["ids_max"],
        "vocab_size": rules.vocab_size,
    }
    row, column, value = int(s["first_bad_id_row"]), int(s["first_bad_id_col"]), int(s["first_bad_id_value"])
    return TFD110.verdict(evidence, where=where, ids_key=paths.input_ids, value=value, row=row, column=column)


def mask_not_binary(s: dict[str, float], where: str, paths: BatchPaths, rules: ValueRules) -> Verdict | None:
    """``TFD112``: attention mask entries that are neither 0 nor 1."""
    if s["mask_non_binary"] <= 0:
        return None
    evidence = {"key": paths.attention_mask, "count": s["mask_non_binary"], "example": s["first_bad_mask_value"]}
    return TFD112.verdict(evidence, where=where)


def labels_outside_vocabulary(s: dict[str, float], where: str, paths: BatchPaths, rules: ValueRules) -> Verdict | None:
    """``TFD113``: labels outside ``[0, vocab)`` that are not ``ignore_index``."""
    if s["labels_out_of_range"] <= 0:
        return None
    evidence = {"count": s["labels_out_of_range"], "vocab_size": rules.vocab_size, "ignore_index": rules.ignore_index}
    return TFD113.verdict(evidence, where=where, labels_key=paths.labels, value=int(s["first_bad_label_value"]))


def every_label_ignored(s: dict[str, float], where: str, paths: BatchPaths, rules: ValueRules) -> Verdict | None:
    """``TFD114``: every label of the batch is ``ignore_index``."""
    if not (s["labels_total"] > 0 and s["labels_ignored"] >= s["labels_total"]):
        return None
    evidence = {"labels": s["labels_total"], "ignored": s["labels_ignored"]}
    return TFD114.verdict(evidence, where=where, labels_key=paths.labels, ignore_index=rules.ignore_index)


def padding_supervised(s: dict[str, float], where: str, paths: BatchPaths, rules: ValueRules) -> Verdict | None:
    """``TFD115``: padding positions (mask 0) whose label is not ``ignore_index``."""
    if s["pad_supervised"] <= 0:
        return None
    ignore = rules.ignore_index
    return TFD115.verdict(
        {"pad_supervised": s["pad_supervised"], "pad_positions": s["pad_positions"]},
        hint=f"Set labels[attention_mask == 0] = {ignore} in the collate function.",
        where=where,
        labels_key=paths.labels,
        mask_key=paths.attention_mask,
        ignore_index=ignore,
    )


def sequences_without_bos(s: dict[str, float], where: str, paths: BatchPaths, rules: ValueRules) -> Verdict | None:
    """``TFD116``: sequences whose first real token is not ``bos_id`` (only with ``bos_id``)."""
    if rules.bos_id is None or s["bos_missing"] <= 0:
        return None
    evidence = {"sequences": int(s["sequences"]), "without_bos": s["bos_missing"]}
    return TFD116.verdict(evidence, where=where, bos_id=rules.bos_id)


def several_eos(s: dict[str, float], where: str, paths: BatchPaths, rules: ValueRules) -> Verdict | None:
    """``TFD117``: sequences with more than one ``eos_id`` (only with ``eos_id``)."""
    if rules.eos_id is None or s["eos_multiple"] <= 0:
        return None
    evidence = {"sequences": int(s["sequences"]), "several_eos": s["eos_multiple"]}
    return TFD117.verdict(evidence, where=where, eos_id=rules.eos_id)


def tokens_after_eos(s: dict[str, float], where: str, paths: BatchPaths, rules: ValueRules) -> Verdict | None:
    """``TFD118``: sequences with real tokens after their first EOS (only with ``eos_id``)."""
    if rules.eos_id is None or s["eos_then_tokens"] <= 0:
        return None
    return TFD118.verdict({"sequences": int(s["sequences"]), "tokens_after_eos": s["eos_then_tokens"]}, where=where)


def truncation_rate(s: dict[str, float], where: str, paths: BatchPaths, rules: ValueRules) -> Verdict | None:
    """``TFD119``: over ``max_truncated_fraction`` of the sequences fill the context with no EOS (needs both)."""
    n = int(s["sequences"])
    if rules.eos_id is None or rules.context is None or not n or s["truncated"] / n <= rules.max_truncated_fraction:
        return None
    evidence = {"truncated_frac": s["truncated"] / n, "max_length": rules.context}
    return TFD119.verdict(evidence, where=where, truncated=int(s["truncated"]), sequences=n)


PACKING_KEYS: tuple[str, ...] = (
    "cu_seqlens",
    "cu_seq_lens_q",
    "cu_seq_lens_k",
    "cu_seqlens_q",
    "cu_seqlens_k",
    "seq_lens",
    "seqlens",
    "packed_seq_lens",
    "seq_idx",
    "document_ids",
    "doc_ids",
    "segment_ids",
    "sequence_ids",
)
"""Batch keys that mark document boundaries inside a row: such a batch is packed, its mask may have holes on purpose."""

MAX_HOLE_FRACTION = 0.5
"""Above this share of a row's text masked inside it, the mask is another mask (masked-LM, loss) read as one."""

HOLES_FROM_IDS_HINT = (
    "Take the attention mask from the tokenizer (it marks padding by position, not by id), or pad with an id that "
    "never occurs in text (add a dedicated pad token and resize the embeddings). GPT-2 and Llama reuse EOS as "
    "padding: input_ids != pad_id then hides every EOS inside the text."
)
HOLES_IN_TEXT_HINT = (
    "Build the attention mask together with the ids it belongs to (the tokenizer's, or padding positions only) and "
    "keep it aligned through every transform. If the batch is packed on purpose, pass its position_ids (restarting "
    "at each document) so the holes between documents are recognised."
)


def packed_keys(leaves: Mapping[str, Any]) -> tuple[str, ...]:
    """The keys of a batch's flattened leaves named like :data:`PACKING_KEYS` (host: key names only)."""
    return tuple(k for k in leaves if k.rsplit(".", 1)[-1] in PACKING_KEYS)


def _hole_cause(s: dict[str, float]) -> tuple[str, str]:
    """Why a mask has holes, and the hint: built from the ids, or hiding tokens attended elsewhere in their row."""
    holes, hole_id = s["mask_holes"], int(s["first_hole_id"])
    if int(s["holes_masked_everywhere"]) != holes:
        cause = (
            f"{int(s['holes_attended_in_row'])} of the {int(holes)} holes hold ids attended elsewhere in the same row: "
            "the mask hides real tokens (built for other ids, shifted, or zeroed by a transform)."
        )
        return cause, HOLES_IN_TEXT_HINT
    if int(s["padding_id_min"]) == int(s["padding_id_max"]) == hole_id:
        cause = (
            f"Every hole holds id {hole_id}, the id of the padding too, and that id is attended nowhere: the mask "
            f"was built from the ids (input_ids != {hole_id}), and {hole_id} is also a real token of the text."
        )
    else:
        cause = (
            f"The holes' ids (the first is {hole_id}) are masked wherever they occur and attended nowhere: the "
            "mask was built from the token ids (input_ids != some id) and that id is also a real token."
        )
    return cause, HOLES_FROM_IDS_HINT


def mask_hole_verdict(
    s: dict[str, float], where: str, paths: BatchPaths, *, has_mask: bool, packed_keys: tuple[str, ...] = ()
) -> Verdict | None:
    """``TFD122``: real tokens masked out inside the text (padding fills one end of a row).

    Silent for a packed batch (``packed_keys``, or position ids restarting in a row), a mask that is not binary
    (``TFD112``'s) and when over :data:`MAX_HOLE_FRACTION` of the holed rows' text is masked.
    """
    holes = s.get("mask_holes", 0.0)
    if not has_mask or holes <= 0 or s["mask_non_binary"] > 0 or packed_keys or s["position_resets"] > 0:
        return None
    fraction = holes / max(holes + s["mask_hole_row_tokens"], 1.0)
    if fraction > MAX_HOLE_FRACTION:
        return None
    cause, hint = _hole_cause(s)
    evidence = {
        "key": paths.attention_mask,
        "rows": int(s["mask_hole_rows"]),
        "sequences": int(s["sequences"]),
        "holes": holes,
        "hole_fraction": fraction,
        "first_hole": [int(s["first_hole_row"]), int(s["first_hole_col"])],
        "first_hole_id": int(s["first_hole_id"]),
        "padding_ids": [int(s["padding_id_min"]), int(s["padding_id_max"])],
        "holes_masked_everywhere": int(s["holes_masked_everywhere"]),
        "holes_attended_in_row": int(s["holes_attended_in_row"]),
    }
    return TFD122.verdict(evidence, hint=hint, where=where, cause=cause)


def value_verdicts(
    s: dict[str, float],
    where: str,
    paths: BatchPaths,
    rules: ValueRules,
    *,
    has_mask: bool,
    has_labels: bool,
    packed: tuple[str, ...] = (),
    crash_only: bool = False,
) -> list[Verdict]:
    """``TFD110``, ``TFD112``-``TFD119`` and ``TFD122`` of one batch, in code order; ``crash_only`` keeps those that
    break a forward (ids and labels outside the vocabulary, a mask that is not binary)."""
    checks = [ids_outside_vocabulary, *([mask_not_binary] if has_mask else [])]
    if has_labels:
        checks.append(labels_outside_vocabulary)
        if not crash_only:
            checks += [every_label_ignored, *([padding_supervised] if has_mask else [])]
            checks += [sequences_without_bos, several_eos, tokens_after_eos, truncation_rate]
    found = [check(s, where, paths, rules) for check in checks]
    if has_mask and not crash_only:
        found.append(mask_hole_verdict(s, where, paths, has_mask=True, packed_keys=packed))
    return [v for v in found if v is not None]


def example_rows(ids: Tensor, labels: Tensor | None, count: int) -> tuple[list[list[int]], list[list[int]] | None]:
    """The first ``count`` rows of the ids (and labels) as host lists, for :func:`decoded_examples` (a host sync)."""
    rows = [t if t.ndim >= 2 else t.reshape(1, -1) for t in (ids, labels) if t is not None]
    k = min(count, rows[0].shape[0])
    return rows[0][:k].tolist(), rows[1][:k].tolist() if len(rows) > 1 else None


def batch_metrics(s: dict[str, float], rules: ValueRules, has_labels: bool) -> dict[str, float]:
    """The ``batch_guard/*`` keys from the unpacked statistics of one batch."""
    n, width = max(s["sequences"], 1.0), max(s["width"], 1.0)
    metrics = {
        "batch_guard/width": s["width"],
        "batch_guard/length_mean": s["length_sum"] / n,
        "batch_guard/pad_frac": s["pad_positions"] / (n * width),
    }
    if has_labels:
        metrics["batch_guard/ignored_frac"] = s["labels_ignored"] / max(s["labels_total"], 1.0)
    if rules.eos_id is not None and rules.context is not None:
        metrics["batch_guard/truncated_frac"] = s["truncated"] / n
    return metrics


def decoded_examples(
    tokenizer: Any, rows: list[list[int]], label_rows: list[list[int]] | None, ignore_index: int, rank: int = 0
) -> list[str]:
    """Markdown lines showing each row decoded, and which of its positions the labels supervise (``·`` = ignored).

    Raises:
        Exception: whatever ``tokenizer.decode`` raises.
    """
    lines = [f"First {len(rows)} sequences of the first training batch (rank {rank}):", ""]
    for i, row in enumerate(rows):
        pieces = [tokenizer.decode([t]) for t in row]
        lines.append(f"**{i}** ({len(row)} tokens) input: `{tokenizer.decode(row)!r}`")
        if label_rows is not None:
            shown = "".join(p if lab != ignore_index else "·" * max(len(p), 1) for p, lab in zip(pieces, label_rows[i]))
            supervised = sum(lab != ignore_index for lab in label_rows[i])
            lines.append(f"  labels ({supervised} supervised, · = ignored): `{shown!r}`")
        lines.append("")
    return lines


# ------------------------------------------------------------------------------------------------ across batches
@dataclass
class RepeatTracker:
    """``TFD121``: batches of one epoch that repeat an earlier batch of that epoch, token for token, fed in order.

    A sampler draws each sample once per epoch, so any repeat is suspect; a stream may cycle its data, so there only
    repeats within :data:`STREAM_REPEAT_WINDOW` batches count.
    """

    max_repeated_fraction: float = 0.1
    epoch: int = -1
    checked: int = 0
    repeated: int = 0
    first_repeat: tuple[int, int] | None = None  # (step, step of the earlier identical batch)
    prints: dict[int, tuple[int, int]] = field(default_factory=dict)  # fingerprint -> (checked index, step)

    def add(self, epoch: int, step: int, fingerprint: int, stream: bool, rank: int = 0) -> Verdict | None:
        """Count the batch of ``step``; its verdict belongs to that step."""
        if epoch != self.epoch:
            self.epoch, self.checked, self.repeated = epoch, 0, 0
            self.prints.clear()
        earlier = self.prints.get(fingerprint)
        if earlier is not None and (not stream or self.checked - earlier[0] <= STREAM_REPEAT_WINDOW):
            self.repeated += 1
            self.first_repeat = self.first_repeat or (step, earlier[1])
        if len(self.prints) < MAX_EPOCH_PRINTS or fingerprint in self.prints:
            self.prints[fingerprint] = (self.checked, step)
        self.checked += 1
        if self.repeated < 3 or self.repeated <= self.max_repeated_fraction * self.checked:
            return None
        first_step, earlier_step = self.first_repeat or (step, -1)
        evidence = {"epoch": epoch, "checked": self.checked, "repeated": self.repeated}
        evidence |= {"step": first_step, "repeats_step": earlier_step}
        return TFD121.verdict(evidence, step=step, rank=rank)


@dataclass
class LengthWindow:
    """``TFD120``: the mean real sequence length of a window of checked batches against the first window."""

    size: int = 50
    tolerance: float = 0.5
    reference: dict[str, float] | None = None  # {"mean", "std"} of real lengths in the first window
    sums: list[float] = field(default_factory=lambda: [0.0, 0.0, 0.0, 0])  # sequences, sum, sum of squares, batches

    def add(self, s: dict[str, float], where: str) -> Verdict | None:
        w = self.sums
        w[0] += s["sequences"]
        w[1] += s["length_sum"]
        w[2] += s["length_sq_sum"]
        w[3] += 1
        if w[3] < self.size:
            return None
        mean = w[1] / max(w[0], 1.0)
        std = max(w[2] / max(w[0], 1.0) - mean * mean, 0.0) ** 0.5
        self.sums = [0.0, 0.0, 0.0, 0]
        if self.reference is None:
            self.reference = {"mean": mean, "std": std}
            return None
        ref = self.reference
        if not length_shift(ref["mean"], ref["std"], mean, self.tolerance):
            return None
        evidence = {"window_mean": mean, "reference_mean": ref["mean"], "reference_std": ref["std"]}
        return TFD120.verdict(evidence, where=where, size=self.size)


@dataclass
class RepeatPeriod:
    """``TFD123``: the same batches come back sooner than the data allows, across epochs; fed in order.

    A map-style DataLoader of ``N`` batches delivers ``min(read, N)`` different batches in its first ``read``, whatever
    the sampler. The excess ``min(read, N) - distinct`` must reach :data:`MIN_EXCESS_REPEATS` and exceed
    ``max_repeated_fraction`` of ``min(read, N)``; or the repeats inside epochs (``TFD121``'s reading) summed over the
    run reach as many (epochs of two batches never hold three repeats each).
    """

    max_repeated_fraction: float = 0.1
    read: int = 0
    seen: dict[int, int] = field(default_factory=dict)  # fingerprint -> step first read
    within: int = 0  # batches that repeated an earlier batch of their own epoch, summed over epochs
    first_repeat: tuple[int, int] | None = None  # (step, step of the earlier identical batch)
    saturated: bool = False  # more than MAX_EPOCH_PRINTS different batches: the data does not repeat early

    def add(
        self,
        step: int,
        fingerprint: int,
        loader_length: int | None,
        *,
        within_epoch: bool = False,
        per_epoch: int | None = None,
        setting: str | None = None,
        rank: int = 0,
    ) -> Verdict | None:
        """Count the batch of ``step``. ``loader_length``: batches per epoch before any Trainer limit (None: a
        stream); ``within_epoch``: it repeats one of its own epoch; ``per_epoch``, ``setting``: :class:`EpochData`'s."""
        self.read += 1
        self.within += int(within_epoch)
        earlier = self.seen.get(fingerprint)
        if earlier is None:
            self.saturated = self.saturated or len(self.seen) >= MAX_EPOCH_PRINTS
            if not self.saturated:
                self.seen[fingerprint] = step
        elif self.first_repeat is None:
            self.first_repeat = (step, earlier)
        known = loader_length is not None and loader_length > 0 and not self.saturated
        allowed = min(self.read, loader_length) if known and loader_length else self.read
        excess = allowed - len(self.seen) if known else 0
        early = excess >= MIN_EXCESS_REPEATS and excess > self.max_repeated_fraction * allowed
        inside = self.within >= MIN_EXCESS_REPEATS and self.within > self.max_repeated_fraction * self.read
        if not (early or inside):
            return None
        return self._verdict(step, loader_length if known else None, per_epoch, setting, rank)

    def _verdict(self, step: int, length: int | None, per_epoch: int | None, setting: str | None, rank: int) -> Verdict:
        first_step, earlier_step = self.first_repeat or (step, -1)
        distinct = len(self.seen)
        if length is not None:
            what = (
                f"Rank {rank} read {self.read} batches and only {distinct} of them are different, while its training "
                f"DataLoader holds {length} batches per epoch"
            )
        else:
            what = f"Rank {rank} read {self.read} batches from a stream and {self.within} repeat a recent one"
        if setting is not None:
            per = f"{per_epoch} batch(es)" if per_epoch is not None else "the same batches"
            cause = (
                f" {setting} is set: every epoch reads the same {per} of the {length} the DataLoader holds, and"
                " the loss falls by memorising them."
            )
        else:
            cause = (
                " No Trainer limit is set: the data itself repeats (a Dataset whose __getitem__ ignores its index, a "
                "DataLoader or sampler that yields the same batch)."
            )
        evidence = {"read": self.read, "distinct": distinct, "repeats_within_epochs": self.within}
        evidence |= {"loader_length": length, "batches_per_epoch": per_epoch, "setting": setting}
        evidence |= {"step": first_step, "repeats_step": earlier_step}
        return TFD123.verdict(evidence, step=step, what=what, cause=cause)


#: One batch's fingerprint waiting to be read: (epoch, step, the epoch's data, the fingerprint: a host int for a CPU
#: batch, else a device scalar read with the next checked batch's transfer)
PendingPrint = tuple[int, int, EpochData, Any]


@dataclass
class BatchRepeats:
    """``TFD121`` and ``TFD123`` from the fingerprints of the batches read, in order.

    Fingerprints wait in :attr:`pending` until they reach the host (device ones with a checked batch's transfer);
    :meth:`read` feeds them to :class:`RepeatTracker` and :class:`RepeatPeriod`. ``TFD123`` stays silent once
    ``TFD121`` has named the repeats, and does not count the epoch a mid-epoch resume restarted (``TFD125``'s).
    """

    max_repeated_fraction: float = 0.1
    pending: list[PendingPrint] = field(default_factory=list)
    spoken: bool = False  # TFD121 was reached
    resumed_epoch: int | None = None  # the epoch a resume restarted mid-way: not counted for TFD123

    def __post_init__(self) -> None:
        self.within = RepeatTracker(self.max_repeated_fraction)
        self.new_fit()

    def new_fit(self) -> None:
        """A new fit reads its data anew: the run-long count starts over."""
        self.period = RepeatPeriod(self.max_repeated_fraction)
        self.spoken, self.resumed_epoch = False, None

    def add(self, epoch: int, step: int, data: EpochData, ids: Tensor) -> None:
        """Fingerprint the batch of ``step`` (every batch, on the hot path): a CPU batch from its bytes (a host int),
        else on its device with no sync, read with the next checked batch."""
        fingerprint = host_fingerprint(ids)
        self.pending.append((epoch, step, data, device_fingerprint(ids) if fingerprint is None else fingerprint))

    def take(self) -> list[PendingPrint]:
        """The fingerprints not yet read, in order; none are pending afterwards."""
        prints, self.pending = self.pending, []
        return prints

    @staticmethod
    def on_device(prints: list[PendingPrint]) -> list[Any]:
        """The device fingerprints of ``prints``, in order (what :meth:`read` expects back on the host)."""
        return [p[3] for p in prints if isinstance(p[3], Tensor)]

    def read(self, prints: list[PendingPrint], device_values: list[float], rank: int = 0) -> list[Verdict]:
        """Verdicts from ``prints``, the device ones' values in ``device_values`` (in :meth:`on_device`'s order)."""
        values = iter(device_values)
        out: list[Verdict] = []
        for epoch, step, data, fingerprint in prints:
            fingerprint = int(next(values) if isinstance(fingerprint, Tensor) else fingerprint)
            earlier = self.within.repeated if self.within.epoch == epoch else 0  # the tracker resets per epoch
            found = self.within.add(epoch, step, fingerprint, data.stream, rank)
            self.spoken = self.spoken or found is not None
            period = None
            if epoch != self.resumed_epoch:
                period = self.period.add(
                    step,
                    fingerprint,
                    None if data.stream else data.loader_length,
                    within_epoch=self.within.repeated > earlier,  # this batch repeats one of its own epoch
                    per_epoch=data.per_epoch,
                    setting=data.setting,
                    rank=rank,
                )
            out += [v for v in (found, None if self.spoken else period) if v is not None]
        return out


def _batch_range(first: int, last: int) -> str:
    return f"batch {first}" if first == last else f"batches {first}-{last}"


def resumed_mid_epoch(start: int, step: int, epoch: int, rank: int, data: EpochData) -> Verdict | None:
    """``TFD125``: the fit's first batch is batch ``start`` > 0 of its epoch (a resume) and the loader restarts.

    The loader yields its batches ``0..N-S-1`` as the epoch's ``S..N-1``: in a fixed order batches
    ``0..min(S, N-S)-1`` train twice and as many at the end are never read; shuffled, a new order is drawn and about
    ``(N-S)·S/N`` batches' worth of samples repeat. Silent for a stateful loader, a stream, an unknown epoch length.
    """
    n = data.per_epoch
    if start <= 0 or data.stateful or data.stream or n is None or start >= n:
        return None
    twice = min(start, n - start)
    evidence = {"start": start, "per_epoch": n, "step": step, "epoch": epoch, "in_order": data.in_order}
    if data.in_order:
        evidence |= {"repeated": [0, twice - 1], "skipped": [n - twice, n - 1]}
        effect = (
            f"In its fixed order, {_batch_range(0, twice - 1)} of the epoch train a second time and "
            f"{_batch_range(n - twice, n - 1)} are never read in it ({twice} each)."
        )
        return TFD125.verdict(evidence, rank=rank, effect=effect)
    expected = (n - start) * start / n
    evidence["expected_repeated"] = expected
    effect = (
        f"The remaining {n - start} batches are drawn in a new order from the whole dataset: about {expected:.0f} "
        "batches' worth of samples trained before the checkpoint train again this epoch, and as many are not read in "
        "it."
    )
    return TFD125.verdict(evidence, severity="info", rank=rank, effect=effect)


# ------------------------------------------------------------------------------------------------ special tokens
SPECIAL_ROLES: tuple[str, ...] = ("eos", "sep", "pad", "bos")
CAUSAL_MATCH = 0.8
"""Aligned labels are a causal LM's when this share of the supervised ones equal the id at the same position or the
next one; a masked LM's match mostly neither (about 10%: the tokens kept unmasked)."""


@dataclass(frozen=True)
class SpecialIds:
    """The special token ids a batch is read against (empty: unknown), and where the EOS came from."""

    eos: tuple[int, ...] = ()
    sep: tuple[int, ...] = ()
    pad: tuple[int, ...] = ()
    bos: tuple[int, ...] = ()
    source: str = ""

    def ordered(self) -> tuple[int, ...]:
        """Every id once, EOS first: the order of :func:`~lightning_tfdebug.functional.batches.
        special_token_statistics`' pairs."""
        out: list[int] = []
        for role in SPECIAL_ROLES:
            out += [i for i in getattr(self, role) if i not in out]
        return tuple(out)


def _ids_of(value: Any) -> tuple[int, ...]:
    """The non-negative token ids of an attribute: an int or a non-empty list of ints (never a bool)."""
    values = value if isinstance(value, (list, tuple)) and value else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        return ()
    return tuple(v for v in values if v >= 0)


def learn_special_ids(sources: list[tuple[str, Any]], eos_id: int | None = None) -> SpecialIds:
    """The special ids of the first source that names each: ``eos_id``, then each ``(name, obj)`` of ``sources`` in
    order (a tokenizer, a Hugging Face config) by its ``<role>_token_id`` or ``<role>_id`` attribute (a list for
    several EOS ids). Host only; an attribute that raises is skipped."""
    found: dict[str, tuple[int, ...]] = {}
    source = ""
    if eos_id is not None:
        found["eos"], source = (eos_id,), "`eos_id`"
    for name, obj in sources:
        for role in SPECIAL_ROLES if obj is not None else ():
            for attr in (f"{role}_token_id", f"{role}_id"):
                if role in found:
                    break
                try:
                    ids = _ids_of(getattr(obj, attr, None))
                except Exception:  # a tokenizer property that complains about an unset token
                    ids = ()
                if ids:
                    found[role] = ids
                    source = name if role == "eos" else source
    return SpecialIds(**found, source=source)


def label_layout(ids: Tensor, labels: Tensor | None, encoder_decoder: bool = False) -> tuple[bool, bool]:
    """How a batch's labels lie against its ids (shapes only): aligned position for position (never an
    encoder-decoder's), and token sequences (aligned, or one row of targets per row of ids)."""
    if labels is None:
        return False, False
    aligned = not encoder_decoder and labels.numel() == ids.numel()
    rows = ids.shape[0] if ids.ndim >= 2 else 1
    return aligned, aligned or (labels.ndim >= 2 and labels.shape[0] == rows)


EOS_CHECK = "EOS supervision (TFD124)"
"""The name under which ``TFD124``'s count stands aside alone while the rest of BatchGuard runs on."""


def eos_count_aside(
    ids: SpecialIds, *, has_labels: bool = True, sequences: bool = True, has_mask: bool = True
) -> tuple[str, str | None] | None:
    """Why ``TFD124``'s count cannot run, and the setting that would let it (None: it can)."""
    if not ids.eos:
        reason = "no end-of-sequence id is known (no `eos_id`, no tokenizer, no Hugging Face config naming one)."
        return reason, "`eos_id` or `tokenizer`"
    if not has_labels:
        return "the batches have no integer token labels to count EOS among.", "`labels_key`"
    if not sequences:
        return "the labels are not token sequences (one value per row: a classifier).", None
    if not has_mask and set(ids.pad) & set(ids.eos):
        reason = (
            "the pad id is the EOS id and the batches have no attention mask, so a real EOS cannot be told from "
            "padding."
        )
        return reason, "`mask_key`"
    return None


PAD_IS_EOS_MESSAGE = (
    " The pad id is the EOS id ({pad}): a collator that masks labels where labels == pad_id (Hugging Face "
    "DataCollatorForLanguageModeling(mlm=False) with tokenizer.pad_token = tokenizer.eos_token) masks every real EOS "
    "along with the padding."
)
PAD_IS_EOS_HINT = (
    "Mask padding by position, not by id: labels[attention_mask == 0] = -100 (e.g. a collator of your own after "
    "tokenizer.pad), or give the tokenizer a pad token of its own (tokenizer.add_special_tokens({'pad_token': "
    "'<pad>'}) and model.resize_token_embeddings(len(tokenizer)))."
)


@dataclass
class SpecialTokenTally:
    """``TFD124``: an end-of-sequence token present among the real inputs and never supervised.

    Sums :func:`~lightning_tfdebug.functional.batches.special_token_statistics` over the first ``max_batches`` checked
    batches. Judged where EOS is a target: a causal LM's labels (aligned, matching the ids for :data:`CAUSAL_MATCH` of
    the supervised ones) or a decoder's targets; a masked LM's are left alone. EOS must be expected among the labels
    (its count among the real inputs times the supervised share, ``min(1, supervised / real)``, reaches
    ``min_expected``) while not one label is EOS. Done at the first supervised EOS or after ``max_batches``.
    """

    ids: SpecialIds
    min_expected: float = 8.0
    max_batches: int = 8
    totals: list[float] = field(default_factory=list)
    batches: int = 0
    aligned: bool = True
    done: bool = False

    def add(self, host: list[float], aligned: bool, labels_key: str | None, has_mask: bool) -> Verdict | None:
        """Count one batch's statistics (``host``, on the host); ``aligned``: its labels align with the ids."""
        if self.done:
            return None
        self.totals = [a + b for a, b in zip(self.totals, host)] if self.totals else list(host)
        self.batches += 1
        self.aligned = self.aligned and aligned
        counts = {t: (self.totals[5 + 2 * k], self.totals[6 + 2 * k]) for k, t in enumerate(self.ids.ordered())}
        real, supervised, aligned_supervised, identity, shift = self.totals[:5]
        eos_inputs = sum(counts[t][0] for t in self.ids.eos)
        eos_supervised = sum(counts[t][1] for t in self.ids.eos)
        if eos_supervised > 0:
            self.done = True
            return None
        match = max(identity, shift) / aligned_supervised if aligned_supervised else 0.0
        layout = ("causal" if match >= CAUSAL_MATCH else "masked") if self.aligned else "targets"
        share = min(1.0, supervised / real) if real else 0.0
        expected = eos_inputs * share
        if layout == "masked" or expected < self.min_expected:
            self.done = self.batches >= self.max_batches
            return None
        self.done = True
        pad_is_eos = bool(set(self.ids.pad) & set(self.ids.eos))
        evidence: dict[str, Any] = {
            "eos_id": self.ids.eos[0] if len(self.ids.eos) == 1 else list(self.ids.eos),
            "eos_source": self.ids.source,
            "eos_in_inputs": eos_inputs,
            "eos_supervised": eos_supervised,
            "supervised_labels": supervised,
            "real_tokens": real,
            "expected_supervised": expected,
            "batches": self.batches,
            "labels_layout": layout,
            "pad_is_eos": pad_is_eos,
        }
        for role in ("sep", "pad"):
            for token in getattr(self.ids, role):
                evidence[f"{role}_{token}"] = {"inputs": counts[token][0], "supervised": counts[token][1]}
        return TFD124.verdict(
            evidence,
            hint=PAD_IS_EOS_HINT if pad_is_eos else None,
            share=share,
            inputs="real input tokens (attention mask 1)" if has_mask else "input tokens",
            labels_at=f"'{labels_key}'" if labels_key else "the labels",
            collator=PAD_IS_EOS_MESSAGE.format(pad=self.ids.pad[0]) if pad_is_eos else "",
        )

    def statistics(self, ids: Tensor, mask: Tensor | None, labels: Tensor, ignore_index: int, aligned: bool) -> Tensor:
        """One batch's :func:`~lightning_tfdebug.functional.batches.special_token_statistics` on its device."""
        with torch.no_grad():
            return special_token_statistics(
                ids, mask, labels, self.ids.ordered(), ignore_index=ignore_index, labels_aligned=aligned
            )
