"""BatchGuard's value rules of one batch: token ids and labels within the vocabulary, a binary attention mask,
supervision (every label ignored, padding supervised) and the BOS / EOS conventions and truncation.

Each decider takes one batch's unpacked statistics ``s`` (:func:`~lightning_tfdebug.callbacks.batch_guard.statistics.
token_statistics` named by :func:`~lightning_tfdebug.callbacks.batch_guard.statistics.unpack_statistics`), its name
``where``, where its fields are and what they are compared against, and returns a verdict or None.
"""

from __future__ import annotations

from lightning_tfdebug.callbacks.batch_guard.mask_hole_checks import mask_hole_verdict
from lightning_tfdebug.callbacks.batch_guard.readings import BatchPaths, ValueRules
from lightning_tfdebug.functional.evidence_chart import EvidenceChart
from lightning_tfdebug.functional.verdicts import Rule, Verdict

# --------------------------------------------------------------------------------------------------------- token ranges


TFD110 = Rule(
    "TFD110",
    "error",
    "BatchGuard",
    title="token id outside `[0, vocab)`",
    headline="token id {value} outside [0, vocab {vocab_size}) in `{ids_key}`",
    trigger="an input id is outside `[0, vocab)` (checked steps, or the batch whose step raised)",
    details=(
        "On value-checked batches (`global_step % every_n_steps == 0`, default the Trainer's `log_every_n_steps`, or "
        "every `check_values_every_n_steps` when set), and in `on_exception` on the batch of the step that raised: at"
        " least one input id is below 0 or at or above `vocab_size` (default: the model's input embedding's rows). "
        "The message names the first (row, position, value)."
    ),
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


TFD112 = Rule(
    "TFD112",
    "error",
    "BatchGuard",
    title="attention mask not binary",
    headline="attention mask `{key}` not binary ({count:.0f} values, e.g. {example:g})",
    trigger="the attention mask holds values other than 0 and 1 (checked steps, or the batch whose step raised)",
    details=(
        "On value-checked batches (see `TFD110`) and the batch whose step raised: at least one entry of the attention"
        " mask (`mask_key`, or found) is neither 0 nor 1."
    ),
    hint=(
        "An attention mask marks real tokens with 1 and padding with 0. Additive masks (0 / -inf) belong inside the "
        "model, not in the batch."
    ),
    reason="A mask of other values is applied as weights or added to the scores: attention is wrong",
    message="{where}: '{key}' has {count:.0f} value(s) that are neither 0 nor 1 (e.g. {example:g}).",
)


def mask_not_binary(s: dict[str, float], where: str, paths: BatchPaths, rules: ValueRules) -> Verdict | None:
    """``TFD112``: attention mask entries that are neither 0 nor 1."""
    if s["mask_non_binary"] <= 0:
        return None
    evidence = {"key": paths.attention_mask, "count": s["mask_non_binary"], "example": s["first_bad_mask_value"]}
    return TFD112.verdict(evidence, where=where)


# ----------------------------------------------------------------------------------------------- labels and supervision


TFD113 = Rule(
    "TFD113",
    "error",
    "BatchGuard",
    title="label outside `[0, vocab)` and not `ignore_index`",
    headline="{count:.0f} labels outside [0, vocab {vocab_size}) and not ignore_index",
    trigger="a label is outside `[0, vocab)` and not `ignore_index` (checked steps, or the batch whose step raised)",
    details=(
        "On value-checked batches (see `TFD110`) and the batch whose step raised: at least one label is below 0 or at"
        " or above `vocab_size` and is not `ignore_index` (default -100)."
    ),
    hint="Mask with the loss's ignore_index (-100 for cross_entropy), not with the pad id or -1.",
    reason="Cross_entropy rejects a class index outside the vocabulary (a device-side assert on CUDA): the step fails",
    message=(
        "{where}: '{labels_key}' holds {count:.0f} label(s) outside [0, {vocab_size}) that are not "
        "ignore_index={ignore_index} (e.g. {value})."
    ),
)


def labels_outside_vocabulary(s: dict[str, float], where: str, paths: BatchPaths, rules: ValueRules) -> Verdict | None:
    """``TFD113``: labels outside ``[0, vocab)`` that are not ``ignore_index``."""
    if s["labels_out_of_range"] <= 0:
        return None
    evidence = {"count": s["labels_out_of_range"], "vocab_size": rules.vocab_size, "ignore_index": rules.ignore_index}
    return TFD113.verdict(evidence, where=where, labels_key=paths.labels, value=int(s["first_bad_label_value"]))


TFD114 = Rule(
    "TFD114",
    "error",
    "BatchGuard",
    title="every label ignored: nothing is learned",
    headline="every label is ignore_index ({ignore_index}): nothing is learned",
    chart=EvidenceChart(
        "Which share of the labels is ignored?",
        "fraction of labels",
        logged=("batch_guard/ignored_frac",),
    ),
    trigger="every label of a batch is `ignore_index`: nothing is learned, the loss is 0 or NaN",
    details=(
        "On value-checked batches (see `TFD110`): the batch has labels and every one of them equals `ignore_index` "
        "(default -100)."
    ),
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


def every_label_ignored(s: dict[str, float], where: str, paths: BatchPaths, rules: ValueRules) -> Verdict | None:
    """``TFD114``: every label of the batch is ``ignore_index``."""
    if not (s["labels_total"] > 0 and s["labels_ignored"] >= s["labels_total"]):
        return None
    evidence = {"labels": s["labels_total"], "ignored": s["labels_ignored"]}
    return TFD114.verdict(evidence, where=where, labels_key=paths.labels, ignore_index=rules.ignore_index)


TFD115 = Rule(
    "TFD115",
    "warning",
    "BatchGuard",
    title="padding positions supervised",
    headline="{pad_supervised:.0f} of {pad_positions:.0f} padding positions are supervised",
    chart=EvidenceChart(
        "How much of each batch is padding?",
        "fraction of positions",
        logged=("batch_guard/pad_frac",),
    ),
    trigger="padding positions (mask 0) carry a label that is not `ignore_index`",
    details=(
        "On value-checked batches (see `TFD110`), with an attention mask and labels of the ids' shape (not an "
        "encoder-decoder's targets): at least one position with mask 0 has a label other than `ignore_index` (default"
        " -100)."
    ),
    hint="`labels[attention_mask == 0] = -100` in the collate function",
    reason="Measured in the batches: the loss spends its weight on predicting padding, which the model then learns",
    message=(
        "{where}: '{labels_key}' supervises {pad_supervised:.0f} of {pad_positions:.0f} padding positions "
        "('{mask_key}' 0, label not ignore_index={ignore_index}): the model is trained to predict padding."
    ),
)


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


# ------------------------------------------------------------------------------------------------ BOS / EOS conventions


TFD116 = Rule(
    "TFD116",
    "warning",
    "BatchGuard",
    title="sequences without BOS",
    headline="{without_bos:.0f} of {sequences} sequences start without BOS ({bos_id})",
    trigger="sequences whose first real token is not `bos_id`",
    details=(
        "Only with `bos_id` set, on value-checked batches (see `TFD110`): at least one sequence with a real token "
        "(mask 1) starts with a first real token other than `bos_id`."
    ),
    hint="The tokenizer's add_special_tokens / chat template differs between data paths, or packing dropped it.",
    reason="Measured against the `bos_id` you declared: the model trains on a format it will not see at inference",
    message="{where}: {without_bos:.0f} of {sequences} sequences do not start with BOS ({bos_id}).",
)


def sequences_without_bos(s: dict[str, float], where: str, paths: BatchPaths, rules: ValueRules) -> Verdict | None:
    """``TFD116``: sequences whose first real token is not ``bos_id`` (only with ``bos_id``)."""
    if rules.bos_id is None or s["bos_missing"] <= 0:
        return None
    evidence = {"sequences": int(s["sequences"]), "without_bos": s["bos_missing"]}
    return TFD116.verdict(evidence, where=where, bos_id=rules.bos_id)


TFD117 = Rule(
    "TFD117",
    "warning",
    "BatchGuard",
    title="several EOS in a sequence",
    headline="{several_eos:.0f} of {sequences} sequences hold several EOS ({eos_id})",
    trigger="sequences with more than one `eos_id`",
    details=(
        "Only with `eos_id` set, on value-checked batches (see `TFD110`): at least one sequence holds `eos_id` more "
        "than once."
    ),
    hint=(
        "EOS added twice (by the template and the tokenizer), or documents packed without an attention boundary. If "
        "you pack on purpose, leave eos_id unset."
    ),
    reason="Measured in the batches: the model is trained to continue past its end token",
    message="{where}: {several_eos:.0f} of {sequences} sequences hold more than one EOS ({eos_id}).",
)


def several_eos(s: dict[str, float], where: str, paths: BatchPaths, rules: ValueRules) -> Verdict | None:
    """``TFD117``: sequences with more than one ``eos_id`` (only with ``eos_id``)."""
    if rules.eos_id is None or s["eos_multiple"] <= 0:
        return None
    evidence = {"sequences": int(s["sequences"]), "several_eos": s["eos_multiple"]}
    return TFD117.verdict(evidence, where=where, eos_id=rules.eos_id)


TFD118 = Rule(
    "TFD118",
    "warning",
    "BatchGuard",
    title="real tokens after EOS",
    headline="real tokens after EOS in {tokens_after_eos:.0f} of {sequences} sequences",
    trigger="real (mask 1) tokens after the first EOS",
    details=(
        "Only with `eos_id` set, on value-checked batches (see `TFD110`): at least one sequence has a real token "
        "(mask 1) after its first EOS."
    ),
    hint="The pad token equals EOS but the mask is 1 on padding, or sequences were packed.",
    reason="Measured in the batches: text after the end token is trained as a continuation of the document",
    message="{where}: {tokens_after_eos:.0f} of {sequences} sequences have real tokens after their EOS.",
)


def tokens_after_eos(s: dict[str, float], where: str, paths: BatchPaths, rules: ValueRules) -> Verdict | None:
    """``TFD118``: sequences with real tokens after their first EOS (only with ``eos_id``)."""
    if rules.eos_id is None or s["eos_then_tokens"] <= 0:
        return None
    return TFD118.verdict({"sequences": int(s["sequences"]), "tokens_after_eos": s["eos_then_tokens"]}, where=where)


TFD119 = Rule(
    "TFD119",
    "warning",
    "BatchGuard",
    title="truncation rate above `max_truncated_fraction`",
    headline="{truncated} of {sequences} sequences truncated at {max_length} tokens",
    chart=EvidenceChart(
        "Which share of the sequences is truncated?",
        "fraction of sequences",
        logged=("batch_guard/truncated_frac",),
    ),
    trigger="more than `max_truncated_fraction` of a batch's sequences fill the maximum length with no EOS",
    details=(
        "Only with `eos_id` set and the context known (see `TFD111`), on value-checked batches (see `TFD110`): more "
        "than `max_truncated_fraction` (default 0.5) of the batch's sequences have a real length at or above the "
        "context and no EOS."
    ),
    hint="Raise the context length, split long documents, or check that truncation keeps the answer.",
    reason="Measured in the batches: most sequences are cut before their end, so the model rarely sees endings",
    message=(
        "{where}: {truncated} of {sequences} sequences fill the maximum length {max_length} with no EOS: they were "
        "truncated."
    ),
)


def truncation_rate(s: dict[str, float], where: str, paths: BatchPaths, rules: ValueRules) -> Verdict | None:
    """``TFD119``: over ``max_truncated_fraction`` of the sequences fill the context with no EOS (needs both)."""
    n = int(s["sequences"])
    if rules.eos_id is None or rules.context is None or not n or s["truncated"] / n <= rules.max_truncated_fraction:
        return None
    evidence = {"truncated_frac": s["truncated"] / n, "max_length": rules.context}
    return TFD119.verdict(evidence, where=where, truncated=int(s["truncated"]), sequences=n)


# ------------------------------------------------------------------------------------------------ one batch, every rule


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
