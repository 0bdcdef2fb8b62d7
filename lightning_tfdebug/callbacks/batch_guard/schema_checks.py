"""BatchGuard's structure rules, decided from host metadata on every batch (no sync): keys, dtypes and shapes
against the declared or learned schema (``TFD101``-``TFD105``), and the width against the model's context
(``TFD111``)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from lightning_tfdebug.callbacks.batch_guard.schema import (
    Drift,
    FieldSpec,
    KeySchema,
    Schema,
    compare_schema,
    describe_leaves,
    learn_schema,
)
from lightning_tfdebug.functional.evidence_chart import EvidenceChart
from lightning_tfdebug.functional.verdicts import Rule, Verdict

# --------------------------------------------------------------------------------------------------------- schema drift


TFD101 = Rule(
    "TFD101",
    "error",
    "BatchGuard",
    title="a key of the schema is missing",
    headline="key `{key}` of the batch schema is missing",
    trigger="a key of the schema (declared, or learned from the first batches) is missing from a batch",
    details=(
        "On every batch, from host metadata (keys of the flattened batch: `input_ids`, `inputs.pixel_values`, `0` for"
        " a tuple's first item), no sync: a key of the schema is absent. The schema is `schema` when declared, else "
        "learned: keys, dtypes and number of dimensions from the first batch, shared dimensions from the first "
        "`learn_batches` (default 4) batches that do not drift. Recorded once per key."
    ),
    hint="build every batch through the same collate path; a key that only some samples carry needs a default",
    reason="A batch without a field the step reads fails that step or feeds the model something else",
    message="{where}: key '{key}' is missing (expected {expected}) ({schema}).",
)


TFD102 = Rule(
    "TFD102",
    "warning",
    "BatchGuard",
    title="a key the learned schema does not have",
    headline="key `{key}` is not in the learned batch schema",
    trigger="a batch carries a key the learned schema does not have",
    details=(
        "On every batch, from host metadata: the batch carries a key the schema (declared `schema`, or learned from "
        "the first batch) does not have. Recorded once per key."
    ),
    hint="as TFD101; if the key is legitimate and optional, declare the `schema`",
    reason="Measured in this run's batches: two collate paths build them, so some batches are not what the rest are",
    message="{where}: key '{key}' is new: {found}, absent from the earlier batches ({schema}).",
)


TFD103 = Rule(
    "TFD103",
    "error",
    "BatchGuard",
    title="dtype changed (int32 labels, float mask)",
    headline="dtype of `{key}` changed: {found}, was {expected}",
    trigger="a key's dtype differs from the schema (int32 labels where int64 were, a float attention mask)",
    details=(
        "On every batch, from host metadata: a key's dtype differs from the schema's (declared in `schema` as "
        '`"int64[B, T]"`, or the first batch\'s). Recorded once per key.'
    ),
    hint="build every field with an explicit dtype (`torch.tensor(x, dtype=torch.long)`); no cast in one branch only",
    reason="The ops that take the field fail or change meaning (cross_entropy takes int64; a float mask is added)",
    message="{where}: '{key}' has dtype {found}; expected {expected} ({schema}).",
)


TFD104 = Rule(
    "TFD104",
    "error",
    "BatchGuard",
    title="number of dimensions changed (a squeezed batch of one)",
    headline="number of dimensions of `{key}` changed: {found}, was {expected}",
    trigger="a key's number of dimensions differs (a batch of one squeezed to 1-D)",
    details=(
        "On every batch, from host metadata: a key's number of dimensions differs from the schema's (declared, or the"
        " first batch's). Recorded once per key."
    ),
    hint="never `squeeze()` a batch; keep the batch dimension (`x[None]`, `unsqueeze(0)`)",
    reason="A squeezed batch breaks the shapes the model and the loss rely on: the step fails or broadcasts wrongly",
    message="{where}: '{key}' has {found}; expected {expected} ({schema}).",
)


TFD105 = Rule(
    "TFD105",
    "error",
    "BatchGuard",
    title="a size differs from the declared size or from the key it always matched",
    headline="size of `{key}` changed: {found}, expected {expected}",
    trigger="a dimension differs from the declared size, or from the key it matched in every early batch",
    details=(
        "On every batch after learning, from host metadata: a dimension differs from its declared size (an integer in"
        " `schema`; `*` is free, a name is shared between keys), or, for a learned schema, from the dimension of "
        "another key it equalled in every one of the first `learn_batches` (default 4) batches. Sizes themselves are "
        "never learned: dynamic padding and a smaller last batch are not drift. Recorded once per key."
    ),
    hint="pad / truncate every key of a batch together; check the declared sizes",
    reason="Fields that no longer line up fail the step or score positions against the wrong labels",
    message="{where}: '{key}' has {found}; expected {expected} ({schema}).",
)


DRIFT_RULES: dict[str, Rule] = {"missing": TFD101, "extra": TFD102, "dtype": TFD103, "ndim": TFD104, "size": TFD105}
"""The rule of each kind of schema :class:`~lightning_tfdebug.callbacks.batch_guard.schema.Drift`."""


def schema_drifts(schema: Schema | None, specs: Mapping[str, FieldSpec], learning: bool) -> list[Drift]:
    """How the batch described by ``specs`` differs from ``schema``; while ``learning``, sizes are not compared (the
    shared sizes are not known yet)."""
    drifts = [] if schema is None else compare_schema(schema, specs)
    return [d for d in drifts if d.kind != "size"] if learning else drifts


def drift_verdicts(drifts: list[Drift], where: str, declared: bool) -> list[Verdict]:
    """``TFD101``-``TFD105``: one verdict per difference between a batch and its schema, recorded once per key."""
    schema = "the declared schema" if declared else "the schema learned from the first batches"
    evidence = [{"key": d.key, "expected": d.expected, "found": d.found} for d in drifts]
    return [DRIFT_RULES[d.kind].verdict(e, key=d.key, where=where, schema=schema) for d, e in zip(drifts, evidence)]


# ------------------------------------------------------------------------------------------------------ sequence length


TFD111 = Rule(
    "TFD111",
    "error",
    "BatchGuard",
    title="sequence longer than the model's context",
    headline="sequence of {width} tokens, longer than the context of {max_length}",
    chart=EvidenceChart(
        "How long are the batches against the context?",
        "tokens",
        logged=("batch_guard/width",),
        lines=("max_length",),
    ),
    trigger="the sequence length exceeds the model's context (position table, config, `max_length`)",
    details=(
        "On every batch, from the ids' shape alone: the last dimension is longer than the model's context, "
        "`max_length` when given, else read from a Hugging Face config (`max_position_embeddings`, `n_positions`, "
        "...), a position embedding or parameter, or the module's hyper-parameters (`block_size`, `context_length`, "
        "`max_seq_len`, ...). Off when no context is found."
    ),
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


def too_long(where: str, ids_path: str | None, spec: FieldSpec | None, context: int | None) -> Verdict | None:
    """``TFD111`` from the ids' shape alone (host metadata): a sequence longer than the model's context."""
    if context is None or ids_path is None or spec is None or not spec.shape or spec.shape[-1] <= context:
        return None
    evidence = {"key": ids_path, "shape": list(spec.shape), "max_length": context}
    return TFD111.verdict(evidence, where=where, width=spec.shape[-1])


# --------------------------------------------------------------------------------------------------------------- memory


@dataclass
class SchemaWatch:
    """``TFD101``-``TFD105`` and ``TFD111`` from host metadata: each batch against its schema, declared or learned.

    A learned schema comes from the first ``learn_batches`` batches that do not drift
    (:func:`~lightning_tfdebug.callbacks.batch_guard.schema.learn_schema`). Once learned, a batch with the structure of
    the last one that found nothing finds nothing either: the caller skips :meth:`check` while ``structure == clean``.
    :meth:`check` decides (:func:`schema_drifts`, :func:`too_long`), then :meth:`remember` records.
    """

    learn_batches: int = 4
    declared: Schema | None = None
    context: int | None = None  # the model's context (None: unknown, TFD111 is off)
    schema: Schema | None = None
    learned: list[dict[str, FieldSpec]] = field(default_factory=list)
    clean: tuple | None = None  # the structure of the last batch that found nothing, learning over

    def __post_init__(self) -> None:
        self.schema = self.schema or self.declared

    @property
    def learning(self) -> bool:
        """The shared sizes of a learned schema are not known yet."""
        return self.declared is None and len(self.learned) < self.learn_batches

    def new_context(self, context: int | None) -> None:
        """The model's context (read at each fit's set-up): the next batch is compared in full."""
        self.context, self.clean = context, None

    def check(self, structure: tuple, leaves: Mapping[str, Any], ids_path: str | None, where: str) -> list[Verdict]:
        """The drifts of the batch whose flattened ``leaves`` have ``structure``, and its width against the context."""
        specs = describe_leaves(leaves)
        learning = self.learning
        drifts = schema_drifts(self.schema, specs, learning)
        long = too_long(where, ids_path, specs.get(ids_path or ""), self.context)
        found = drift_verdicts(drifts, where, self.declared is not None) + ([long] if long is not None else [])
        self.remember(structure, specs, learning=learning, drifted=bool(drifts), found=bool(found))
        return found

    def remember(self, structure: tuple, specs: dict[str, FieldSpec], *, learning: bool, drifted: bool, found: bool):
        """Record a checked batch: while learning, one that did not drift teaches the schema; after, one that found
        nothing is the structure the next batches are skipped by."""
        if learning and not drifted:
            self.learned.append(specs)
            self.schema = learn_schema(self.learned)
        self.clean = structure if not learning and not found else None

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
