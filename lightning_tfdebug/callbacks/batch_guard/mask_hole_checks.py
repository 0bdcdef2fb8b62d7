"""``TFD122``: an attention mask with holes, real tokens masked out inside the text (padding fills one end of a
row), with why the mask has them (built from the ids, or hiding tokens attended elsewhere in their row)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from lightning_tfdebug.callbacks.batch_guard.readings import BatchPaths
from lightning_tfdebug.functional.verdicts import Rule, Verdict

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


TFD122 = Rule(
    "TFD122",
    "warning",
    "BatchGuard",
    title="attention mask with holes: real tokens masked out inside the text",
    headline="attention mask with {holes:.0f} holes inside the text ({hole_fraction:.1%} of rows)",
    trigger=(
        "a binary attention mask of the ids' shape masks positions between real tokens of a row (or at both ends of "
        "it), at most half of those rows' text; not for packed batches (position ids restarting in a row, "
        "`cu_seqlens` / `document_ids`-like keys) or 3-D/4-D masks"
    ),
    details=(
        "On value-checked batches (see `TFD110`), with a binary attention mask of the ids' shape: positions with mask"
        " 0 between real tokens of a row (or, for a row masked at both ends, the shorter end), as long as those holes"
        " are at most 50% of the holed rows' text (a masked-LM or loss mask read as an attention mask hides more). "
        "Silent for a non-binary mask (`TFD112`'s), 3-D/4-D masks and packed batches: position ids that restart "
        "inside a row, or a key named `cu_seqlens`, `seq_lens`, `seqlens`, `packed_seq_lens`, `seq_idx`, "
        "`document_ids`, `doc_ids`, `segment_ids`, `sequence_ids` (or a `cu_seq_lens_q/k` variant). The message says "
        "whether the holes' id is attended nowhere in the batch (the mask was built from token identity) or elsewhere"
        " in the same row."
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
