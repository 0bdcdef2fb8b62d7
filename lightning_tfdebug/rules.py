"""The rule registry: every finding code the pack can emit, its default severity, its owner, what triggers it and
what to do about it.

This module is the single source of truth for finding codes, like a linter's rule list. Callbacks emit by code
(:meth:`~lightning_tfdebug.DebugCallback.emit`) with their message and evidence; the severity and the hint come from
the rule unless the callback passes a more specific one (a severity escalated by evidence, a hint that names the
module at fault). The tables in ``docs/findings.md`` and on each callback's page are generated from :data:`RULES` by
``python scripts/gen_rule_docs.py``, and ``tests/test_rules.py`` fails when they drift.

Adding a rule: add a :class:`Rule` to ``_RULES`` in the block of its callback (codes are grouped by area, see
:data:`AREAS`, and each callback owns a block of numbers, see :data:`BLOCKS`), emit it from the callback, run
``python scripts/gen_rule_docs.py``, and test that it fires on a bug and stays silent on a healthy run.

Example:
    >>> from lightning_tfdebug.rules import RULES
    >>> RULES["TFD312"].source, RULES["TFD312"].severity
    ('UpdateRatio', 'error')
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from lightning_tfdebug.findings import SEVERITIES, Severity, check_code

__all__ = [
    "AREAS",
    "BLOCKS",
    "BUILTIN_CODES",
    "RULES",
    "Rule",
    "register_rule",
    "render_rule_table",
    "rule",
    "rules_of",
]


@dataclass(frozen=True)
class Rule:
    """One finding code.

    Attributes:
        code: the stable identifier, ``TFD`` + area digit + two digits.
        severity: the default severity; a callback may escalate it when its evidence shows more harm.
        source: the class name of the callback that emits it.
        title: a few words saying what is wrong (the callback page's table).
        trigger: the measured condition that raises it.
        hint: what to do; a finding with a more specific hint carries its own.
        reason: why the rule has its severity, under the severity policy (``docs/severity.md``): what makes the run
            unable to succeed (error), the harm measured or the work lost (warning), or why it is only an
            observation (info).
    """

    code: str
    severity: Severity
    source: str
    title: str
    trigger: str
    hint: str
    reason: str = ""  # required (checked below); a default only so that it can follow `hint` as a keyword

    def __post_init__(self) -> None:
        check_code(self.code)
        if self.severity not in SEVERITIES:
            raise ValueError(f"Rule {self.code}: severity must be one of {SEVERITIES}, got {self.severity!r}.")
        for name in ("source", "title", "trigger", "hint", "reason"):
            if not getattr(self, name).strip():
                raise ValueError(f"Rule {self.code}: `{name}` must not be empty.")


AREAS: tuple[tuple[str, str], ...] = (
    ("1xx", "data, batches, reproducibility"),
    ("2xx", "masks, positions, targets, the loss"),
    ("3xx", "gradients and optimization"),
    ("4xx", "numerics and precision"),
    ("5xx", "distributed"),
    ("6xx", "throughput and memory"),
    ("7xx", "checkpoint and resume"),
)
"""The hundreds digit of a code names its area."""

BLOCKS: tuple[tuple[str, str, str], ...] = (
    ("BatchGuard", "TFD101", "TFD129"),
    ("ReproCapture", "TFD130", "TFD139"),
    ("MaskProbe", "TFD201", "TFD219"),
    ("LossAtInit", "TFD220", "TFD239"),
    ("GradNormMonitor", "TFD301", "TFD309"),
    ("UpdateRatio", "TFD310", "TFD319"),
    ("OptimizerAudit", "TFD320", "TFD339"),
    ("DeadActivation", "TFD340", "TFD349"),
    ("NaNFirstFrame", "TFD401", "TFD409"),
    ("ScalerWatch", "TFD410", "TFD419"),
    ("PerRankLogger", "TFD501", "TFD519"),
    ("ThroughputMonitor", "TFD601", "TFD619"),
    ("CheckpointAudit", "TFD701", "TFD719"),
)
"""Each callback's block of codes: ``(source, first, last)``, in documentation order."""


_RULES: tuple[Rule, ...] = (
    # ---------------------------------------------------------------- BatchGuard
    Rule(
        "TFD101",
        "error",
        "BatchGuard",
        title="a key of the schema is missing",
        trigger="a key of the schema (declared, or learned from the first batches) is missing from a batch",
        hint=("build every batch through the same collate path; a key that only some samples carry needs a default"),
        reason=(
            "A batch without a field the step reads fails that step or feeds the model something else; the run cannot "
            "go through its data as configured"
        ),
    ),
    Rule(
        "TFD102",
        "warning",
        "BatchGuard",
        title="a key the learned schema does not have",
        trigger="a batch carries a key the learned schema does not have",
        hint="as TFD101; if the key is legitimate and optional, declare the `schema`",
        reason=(
            "Measured in this run's batches: two collate paths build them, so some batches are not what the rest are"
        ),
    ),
    Rule(
        "TFD103",
        "error",
        "BatchGuard",
        title="dtype changed (int32 labels, float mask)",
        trigger="a key's dtype differs from the schema (int32 labels where int64 were, a float attention mask)",
        hint=(
            "build every field with an explicit dtype (`torch.tensor(x, dtype=torch.long)`); no cast in one branch only"
        ),
        reason=(
            "The ops that take the field fail or change meaning with its dtype (cross_entropy takes int64 class "
            "indices; a float mask is added, not applied)"
        ),
    ),
    Rule(
        "TFD104",
        "error",
        "BatchGuard",
        title="number of dimensions changed (a squeezed batch of one)",
        trigger="a key's number of dimensions differs (a batch of one squeezed to 1-D)",
        hint="never `squeeze()` a batch; keep the batch dimension (`x[None]`, `unsqueeze(0)`)",
        reason=(
            "A squeezed batch breaks the shapes the model and the loss rely on: the step fails or broadcasts into a "
            "wrong result"
        ),
    ),
    Rule(
        "TFD105",
        "error",
        "BatchGuard",
        title="a size differs from the declared size or from the key it always matched",
        trigger=(
            "a dimension differs from the declared size, or from the key it matched in every early batch (labels "
            "shorter than input ids)"
        ),
        hint="pad / truncate every key of a batch together; check the declared sizes",
        reason=(
            "Fields that no longer line up (labels shorter than the ids) fail the step or score positions against the "
            "wrong labels"
        ),
    ),
    Rule(
        "TFD110",
        "error",
        "BatchGuard",
        title="token id outside `[0, vocab)`",
        trigger=(
            "an input id is outside `[0, vocab)` (on checked steps, or in the batch whose step raised); names the "
            "row, position and value"
        ),
        hint=(
            "The tokenizer and the model disagree on the vocabulary (added special tokens without "
            "resize_token_embeddings, a different tokenizer revision), or a pad id of -1. On CUDA this is a "
            "device-side assert."
        ),
        reason=(
            "An embedding lookup outside the table fails the step (a device-side assert on CUDA): the run cannot go "
            "through this batch"
        ),
    ),
    Rule(
        "TFD111",
        "error",
        "BatchGuard",
        title="sequence longer than the model's context",
        trigger="the sequence length exceeds the model's context (position table, config, `max_length`)",
        hint=(
            "Truncate in the collate function (tokenizer(..., truncation=True, max_length=...)) or pack to the "
            "context length; check sequence packing and concatenation code."
        ),
        reason=(
            "Positions past the model's table fail the step or read rows that were never trained: the run cannot go "
            "through this batch"
        ),
    ),
    Rule(
        "TFD112",
        "error",
        "BatchGuard",
        title="attention mask not binary",
        trigger=(
            "the attention mask holds values other than 0 and 1 (on checked steps, or in the batch whose step raised)"
        ),
        hint=(
            "An attention mask marks real tokens with 1 and padding with 0. Additive masks (0 / -inf) belong inside "
            "the model, not in the batch."
        ),
        reason=(
            "A mask with values other than 0 and 1 is applied as weights or added to the scores, so attention is wrong "
            "on every such batch"
        ),
    ),
    Rule(
        "TFD113",
        "error",
        "BatchGuard",
        title="label outside `[0, vocab)` and not `ignore_index`",
        trigger=(
            "a label is outside `[0, vocab)` and is not `ignore_index` (on checked steps, or in the batch whose step "
            "raised)"
        ),
        hint="Mask with the loss's ignore_index (-100 for cross_entropy), not with the pad id or -1.",
        reason=(
            "Cross_entropy rejects a class index outside the vocabulary (a device-side assert on CUDA): the step fails"
        ),
    ),
    Rule(
        "TFD114",
        "error",
        "BatchGuard",
        title="every label ignored: nothing is learned",
        trigger="every label of a batch is `ignore_index`: nothing is learned, the loss is 0 or NaN",
        hint=(
            "Check the label mask: prompt masking that also masks the completion, truncation that cut every answer "
            "away, or labels built from the wrong field."
        ),
        reason=(
            "A batch with no supervised label gives a loss of 0 or NaN, and a NaN loss ruins the weights: nothing can "
            "be learned from it"
        ),
    ),
    Rule(
        "TFD115",
        "warning",
        "BatchGuard",
        title="padding positions supervised",
        trigger=(
            "padding positions (mask 0) carry a label that is not `ignore_index`: the model learns to predict padding"
        ),
        hint="`labels[attention_mask == 0] = -100` in the collate function",
        reason="Measured in the batches: the loss spends its weight on predicting padding, which the model then learns",
    ),
    Rule(
        "TFD116",
        "warning",
        "BatchGuard",
        title="sequences without BOS",
        trigger="sequences whose first real token is not `bos_id`",
        hint=("The tokenizer's add_special_tokens / chat template differs between data paths, or packing dropped it."),
        reason="Measured against the `bos_id` you declared: the model trains on a format it will not see at inference",
    ),
    Rule(
        "TFD117",
        "warning",
        "BatchGuard",
        title="several EOS in a sequence",
        trigger="sequences with more than one `eos_id`",
        hint=(
            "EOS added twice (by the template and the tokenizer), or documents packed without an attention boundary. "
            "If you pack on purpose, leave eos_id unset."
        ),
        reason=(
            "Measured in the batches: the model is trained to continue past its end token, so it does not learn to stop"
        ),
    ),
    Rule(
        "TFD118",
        "warning",
        "BatchGuard",
        title="real tokens after EOS",
        trigger="real (mask 1) tokens after the first EOS",
        hint="The pad token equals EOS but the mask is 1 on padding, or sequences were packed.",
        reason="Measured in the batches: text after the end token is trained as a continuation of the document",
    ),
    Rule(
        "TFD119",
        "warning",
        "BatchGuard",
        title="truncation rate above `max_truncated_fraction`",
        trigger="more than `max_truncated_fraction` of a batch's sequences fill the maximum length with no EOS",
        hint="Raise the context length, split long documents, or check that truncation keeps the answer.",
        reason="Measured in the batches: most sequences are cut before their end, so the model rarely sees endings",
    ),
    Rule(
        "TFD120",
        "warning",
        "BatchGuard",
        title="the length distribution moved away from the early batches",
        trigger=(
            "the mean real length of a window of `length_window` checked batches moved by more than "
            "`length_shift_tolerance` (and one std) from the first window"
        ),
        hint=(
            "The data changed under the run: a new shard or source, a tokenizer swap, sorted or curriculum data, or a"
            " truncation setting that differs between files."
        ),
        reason=(
            "Measured in this run: the batches seen later differ from the early ones (data sorted or grouped), so the "
            "gradient follows data order"
        ),
    ),
    Rule(
        "TFD121",
        "warning",
        "BatchGuard",
        title=(
            "batches of one epoch repeat earlier batches of the same epoch token for token (data read more than once)"
        ),
        trigger=(
            "more than `max_repeated_fraction` of one epoch's batches (and at least 3) have the same token "
            "ids as an earlier batch of that epoch (from a stream, only within 16 batches)"
        ),
        hint=(
            "Within one epoch a sampler draws every sample once, so identical batches mean the data is read more than"
            " once: an IterableDataset read by several DataLoader workers that do not split the stream (shard it with"
            " torch.utils.data.get_worker_info()), a Dataset whose __getitem__ ignores its index, a sampler with "
            "replacement, or duplicated rows in the data."
        ),
        reason=(
            "Measured in this run: one epoch reads the same batches more than once, so it trains on duplicates instead "
            "of the data"
        ),
    ),
    Rule(
        "TFD122",
        "warning",
        "BatchGuard",
        title="attention mask with holes: real tokens masked out inside the text",
        trigger=(
            "a binary attention mask of the ids' shape masks positions between real tokens of a row (or at both ends "
            "of it), at most half of those rows' text; not for packed batches (position ids restarting in a row, "
            "`cu_seqlens` / `document_ids`-like keys) or 3-D/4-D masks"
        ),
        hint=(
            "A mask built as input_ids != pad_id where the pad id is also a real token (GPT-2 / Llama reuse EOS as "
            "padding): take the mask from the tokenizer, or pad with an id that never occurs in text."
        ),
        reason=(
            "Measured in the batches: real tokens inside the text are masked out, so the model cannot attend to them"
        ),
    ),
    Rule(
        "TFD123",
        "warning",
        "BatchGuard",
        title="the same batches come back sooner than the data allows (overfit_batches, a Dataset ignoring its index)",
        trigger=(
            "of the batches a rank read, fewer are different than min(read, the training DataLoader's length) by at "
            "least 3 and more than `max_repeated_fraction` of that (map-style loaders), or the repeats inside epochs "
            "summed over the run reach 3 and that fraction of the batches read; silent once TFD121 has spoken"
        ),
        hint=(
            "Remove Trainer(overfit_batches=...) or a limit_train_batches on an unshuffled DataLoader left on from "
            "debugging (every epoch then reads the same first batches); otherwise find what makes the data repeat: a "
            "Dataset whose __getitem__ ignores its index, a DataLoader or sampler that yields the same batch."
        ),
        reason=(
            "evidence of harm in this run: the model trains on a fraction of its data and the loss falls by "
            "memorising it, while the rest of the dataset is never read"
        ),
    ),
    Rule(
        "TFD124",
        "warning",
        "BatchGuard",
        title="the end-of-sequence token occurs in the inputs and is never supervised (the model never learns to stop)",
        trigger=(
            "over the first `special_token_batches` checked batches of a causal LM (or a decoder's targets), EOS "
            "occurs among the real input tokens often enough that `min_eos_expected` supervised EOS are expected, "
            "and no supervised label is EOS; masked-LM labels are not judged"
        ),
        hint=(
            "Find where the labels lose the EOS: a collator that masks by id (labels == pad_id while pad id == EOS "
            "id, as DataCollatorForLanguageModeling with tokenizer.pad_token = tokenizer.eos_token does), a "
            "completion-only mask that ends before the EOS. Mask padding by position (attention_mask == 0) or give "
            "the tokenizer a pad token of its own."
        ),
        reason=(
            "evidence of harm in this run: the labels it trains on never contain EOS, so the model is never taught "
            "to end a sequence and generates until the length limit"
        ),
    ),
    # ---------------------------------------------------------------- ReproCapture
    Rule(
        "TFD130",
        "info",
        "ReproCapture",
        title="training failed; a bundle was written (the message has its path and the replay command)",
        trigger="training raised an exception; a repro bundle was written (path in the message)",
        hint="`python -m lightning_tfdebug replay <bundle> --config <your LightningCLI config>`",
        reason=(
            "The failure itself propagates as the exception; the finding only points at the bundle written to reproduce"
            " it"
        ),
    ),
    Rule(
        "TFD131",
        "warning",
        "ReproCapture",
        title="the bundle could not be written; the original exception propagates unchanged",
        trigger=("the bundle could not be written (disk full, no permission); the original exception still propagates"),
        hint="Check free disk space and write permission on the log directory.",
        reason="Loses work: the evidence needed to replay the crash is gone, though the crash itself still propagates",
    ),
    # ---------------------------------------------------------------- MaskProbe
    Rule(
        "TFD201",
        "error",
        "MaskProbe",
        title="future tokens change past logits; names the largest change, its row and position",
        trigger=(
            "replacing the tokens after position t changed the logits at a position <= t beyond the dtype-aware "
            "tolerance"
        ),
        hint=(
            "The decoder's attention does not apply a causal mask (or applies it wrongly): check the mask "
            "construction, `is_causal`, and any custom attention kernel. For an encoder, set `causal=False`."
        ),
        reason=(
            "A causal model that sees the future learns to copy it; it cannot generate, so the run cannot succeed as "
            "configured"
        ),
    ),
    Rule(
        "TFD202",
        "error",
        "MaskProbe",
        title="tokens under the attention mask change the logits of real tokens",
        trigger=(
            "changing the token ids at positions whose attention mask is 0 changed the logits of unmasked positions"
        ),
        hint=(
            "The attention mask does not reach the attention (or is inverted): check that the mask is passed through "
            "every layer and combined with the causal mask."
        ),
        reason=(
            "Measured: tokens the mask hides change real tokens' logits, so every padded batch trains on noise and "
            "inference depends on padding"
        ),
    ),
    Rule(
        "TFD203",
        "error",
        "MaskProbe",
        title="the logits of real tokens depend on the amount of padding",
        trigger="adding padding on the batch's padding side changed the logits of real tokens",
        hint=(
            "Mask padding in attention; with left padding, derive position ids from the attention mask; avoid "
            "normalisations or poolings that run over padded positions."
        ),
        reason=(
            "Measured: real tokens' logits depend on how much padding the batch has, so the trained model computes a "
            "different function per batch"
        ),
    ),
    Rule(
        "TFD204",
        "warning",
        "MaskProbe",
        title="the batch is padded but the model is called without a mask",
        trigger="the batch pads (mask has zeros) but the model is called without an attention mask",
        hint="Pass the attention mask to the model's forward (or give MaskProbe a `forward_fn` that does).",
        reason="The recorded call shows the model attends to the padding the batch marks, as if it were text",
    ),
    Rule(
        "TFD205",
        "error",
        "MaskProbe",
        title="labels not shifted: position t is trained on token t (the model learns to copy its input)",
        trigger=(
            "the loss `training_step` returned equals the cross-entropy of position t against token t (labels equal "
            "to the inputs, no shift)"
        ),
        hint="Shift in the loss (`logits[:, :-1]` against `labels[:, 1:]`) or in the data, exactly once.",
        reason="Position t scored against token t teaches the model to copy its input: the run cannot learn the task",
    ),
    Rule(
        "TFD206",
        "error",
        "MaskProbe",
        title="labels shifted twice: position t is trained on token t+2",
        trigger=(
            "labels shifted twice, position t trained on token t+2: already shifted in the data and shifted again by "
            "the loss, or equal to the inputs and shifted twice by `training_step` (by hand, then inside a Hugging "
            "Face model)"
        ),
        hint=(
            "Shift exactly once: in the data collator or in the loss, not both. Hugging Face causal LMs shift "
            "`labels` inside the model: pass labels equal to input_ids (padding as -100)."
        ),
        reason=(
            "Position t scored against token t+2 trains a different task than next-token prediction: the run cannot "
            "succeed as configured"
        ),
    ),
    Rule(
        "TFD207",
        "error",
        "MaskProbe",
        title="the model fails on a sequence exactly at its context limit",
        trigger="a sequence exactly at the context limit fails",
        hint=(
            "Check the position table / rotary cache size against the configured context length, or pass the real "
            "limit as `context_limit`."
        ),
        reason=(
            "A sequence of the length the model claims to accept fails: the run fails when the data reaches that length"
        ),
    ),
    Rule(
        "TFD208",
        "info",
        "MaskProbe",
        title="the context limit, and where it was read",
        trigger=(
            "states the context limit and where it was read, once a sequence of that length ran (nothing longer is "
            "ever sent to the model)"
        ),
        hint=("Cut or chunk batches to the context limit before the forward (BatchGuard checks batches against it)."),
        reason="An observation: the context limit and where it was read, for the reader to confirm",
    ),
    Rule(
        "TFD209",
        "error",
        "MaskProbe",
        title="incremental decoding (`kv_cache_fn`) disagrees with the full forward; names the first position",
        trigger=(
            "logits from `kv_cache_fn` (incremental decoding) differ from the full forward; names the first position"
        ),
        hint=(
            "Check the cache position / offset passed at each decoding step, rotary offsets, and the mask used with a"
            " cache."
        ),
        reason=(
            "Measured: incremental decoding computes different logits than training, so the trained model generates "
            "wrongly"
        ),
    ),
    Rule(
        "TFD210",
        "info",
        "MaskProbe",
        title=(
            "target alignment undetermined (loss matches neither alignment, or `training_step` could not be replayed)"
        ),
        trigger=(
            "the returned loss matches neither alignment (label smoothing, auxiliary losses), or `training_step` "
            "could not be replayed"
        ),
        hint="nothing if expected; otherwise check `labels_key` / `ignore_index`",
        reason="An observation: the alignment could not be decided from the loss, so nothing was claimed about it",
    ),
    Rule(
        "TFD211",
        "info",
        "MaskProbe",
        title="MaskProbe cannot call the model or read the batch; names the argument to set; stands aside",
        trigger="MaskProbe cannot call the model or read the batch; it says which argument to set and stands aside",
        hint="set `forward_fn` / `input_key` / `mask_key` / `labels_key`",
        reason="The probe stands aside and names the argument that would let it run; nothing was measured",
    ),
    Rule(
        "TFD212",
        "info",
        "MaskProbe",
        title=(
            "with `causal=None`, the labels are neither the inputs nor the next inputs (masked-LM objective): treated"
            " as an encoder"
        ),
        trigger=(
            "`causal=None` and the batch's labels are neither the inputs nor the next inputs at most supervised "
            "positions (masked-LM / denoising objective): treated as an encoder, causality and target alignment not "
            "checked"
        ),
        hint=("If this model is a decoder, set `causal=True` to check its causal mask; `causal=False` silences this."),
        reason=(
            "An observation of the objective (a masked-LM or denoising task), which makes the causal probes not apply"
        ),
    ),
    Rule(
        "TFD213",
        "error",
        "MaskProbe",
        title=(
            "the same tokens twice in eval mode gave different logits: randomness ignores `.eval()`; the other probes"
            " are skipped"
        ),
        trigger=(
            "two eval-mode forwards of the same tokens gave logits differing beyond the tolerance (the other "
            "MaskProbe checks are skipped)"
        ),
        hint=(
            "Something random runs regardless of `.eval()`: usually `F.dropout(x, p)` (its `training` argument "
            "defaults to True; pass `training=self.training` or use `nn.Dropout`), `dropout_p` given to "
            "`scaled_dot_product_attention` without checking `self.training`, or noise / sampling in `forward`. "
            "Validation and generation are then noisy as well."
        ),
        reason=(
            "Measured: the model is random in eval mode, so evaluation and inference of the trained model give "
            "different answers each call"
        ),
    ),
    Rule(
        "TFD214",
        "error",
        "MaskProbe",
        title="the model reads the labels it is trained to predict through one of its inputs (a target leak)",
        trigger=(
            "in the call `training_step` makes, replacing the tokens of an argument that carries the labels (a "
            "decoder input, a second sequence) from the position of an output's own label on changed that output"
        ),
        hint=(
            "The loss falls fast and the model learns to copy. A decoder input must be the labels shifted right "
            "(start token first: `decoder_input_ids[t] = labels[t-1]`), under a causal mask; an encoder must not see "
            "the text the decoder predicts (in a language model both sides read the same text, so the encoder needs "
            "a causal mask too, or use a decoder-only model)."
        ),
        reason=(
            "Measured: the model reads the labels it must predict; it learns to copy them and cannot do the task "
            "without them"
        ),
    ),
    Rule(
        "TFD215",
        "error",
        "MaskProbe",
        title="the model ignores token order: no position information reaches the attention",
        trigger=(
            "from step 100, reversing the tokens before a position leaves that position's output unchanged while "
            "replacing them moves it by over 100x the tolerance"
        ),
        hint=(
            "Check that positions are added for every position: a sinusoidal table indexed as `pe[:, x.size(1)]` "
            "adds one row to all positions (use `pe[:, : x.size(1)]`); position ids that are all zero or never "
            "passed; a position embedding added to the wrong tensor; rotary embeddings applied with a constant "
            "offset."
        ),
        reason=(
            "Measured: no position information reaches attention, so the model cannot use token order: a language model"
            " cannot succeed"
        ),
    ),
    Rule(
        "TFD216",
        "warning",
        "MaskProbe",
        title="a position table gets the same row at every position, or is never read",
        trigger=(
            "in one forward pass of the probe rows: an embedding or position parameter of the token table's width "
            "with at least as many rows as the sequence is looked up with indices constant along the sequence "
            "(longer than 1), or is read by no torch function while the token table is looked up"
        ),
        hint=(
            "Pass position ids that count along the sequence (`torch.arange(t)`, or the mask's cumulative sum minus "
            "one with left padding), not zeros; add the position table to the token embeddings in the forward."
        ),
        reason=(
            "Breaks a rule that always holds for a model built with a position table: every position reads its own "
            "row. The harm is measured only indirectly (with causal layers the mask alone carries some order), so a "
            "warning, not an error"
        ),
    ),
    # ---------------------------------------------------------------- LossAtInit
    Rule(
        "TFD220",
        "error",
        "LossAtInit",
        title="the outputs are probabilities: softmax before a loss that applies it again (loss stuck at ln(V))",
        trigger=(
            "at step 0, >= 99% of the sampled output rows are non-negative and sum to 1: `forward` returns "
            "probabilities (a cross-entropy then applies softmax again and the loss sits at ln(V))"
        ),
        hint=(
            "Return raw logits from forward (remove the softmax) and apply softmax only at inference. If the loss is "
            "NLLLoss, feed it log_softmax(logits) instead of probabilities."
        ),
        reason=(
            "Softmax applied twice holds the loss near ln(V) with vanishing gradients: the run cannot learn as "
            "configured"
        ),
    ),
    Rule(
        "TFD221",
        "info",
        "LossAtInit",
        title="the outputs are log-probabilities (fine for NLLLoss and cross_entropy)",
        trigger="at step 0, >= 99% of the sampled output rows are log-probabilities (all <= 0, logsumexp 0)",
        hint=(
            "Nothing to fix if the loss is NLLLoss or cross_entropy. Make sure nothing applies softmax to them as if "
            "they were probabilities."
        ),
        reason="An observation: log-probabilities are correct input to NLLLoss and harmless to cross_entropy",
    ),
    Rule(
        "TFD222",
        "warning",
        "LossAtInit",
        title="the step-0 loss far above ln(V): logits too large at init",
        trigger="the step-0 loss is above `(1 + init_tolerance) ln(V)`",
        hint=(
            "The logits are too large at init: initialise the output layer with a small std (e.g. 0.02 or "
            "1/sqrt(d_model)), keep the 1/sqrt(d) attention/residual scaling, check a tied embedding's scale. Or the "
            "loss is not a mean (reduction='sum')."
        ),
        reason=(
            "Measured at step 0: confidently wrong logits, which the first steps must undo and which saturate the "
            "softmax's gradient"
        ),
    ),
    Rule(
        "TFD223",
        "warning",
        "LossAtInit",
        title=(
            "the step-0 loss far below ln(V): the loss is not the logits' V-way cross-entropy, or the target leaks "
            "into the input (info for a pretrained model)"
        ),
        trigger=(
            "the step-0 loss is below `(1 - init_tolerance) ln(V)` and the logits' own cross-entropy is not, or the "
            "logits reach it by predicting the current input token; info when the logits give that loss themselves "
            "without copying (weights trained before: fine-tuning)"
        ),
        hint=(
            "Usual causes: the target leaks into the input (labels not shifted and the model copies its input, no "
            "causal mask); NLLLoss fed raw logits or probabilities instead of log_softmax; the mean taken over "
            "padding positions (set ignore_index); a vocab_size different from the logits' width."
        ),
        reason=(
            "Measured at step 0: the returned loss is not the logits' cross-entropy, or the logits reach it by reading "
            "the answer from the input"
        ),
    ),
    Rule(
        "TFD224",
        "error",
        "LossAtInit",
        title="no supervised tokens: every label is `ignore_index`",
        trigger=(
            "no label of the first batch is supervised (all `ignore_index` after alignment): the loss is NaN or 0"
        ),
        hint=(
            "Check the collator/labels: labels set to ignore_index everywhere (a mask inverted, the prompt mask "
            "covering the whole sequence, truncation cutting every answer). With shift_labels=True only labels after "
            "the first position count."
        ),
        reason="With no supervised label the loss is 0 or NaN: nothing can be learned as configured",
    ),
    Rule(
        "TFD225",
        "warning",
        "LossAtInit",
        title='at the check the loss is still at ln(V), flat over a window ("stalled at the uniform loss")',
        trigger=(
            "at `check_step` (5x for masked-LM labels) the training loss is within `stall_tolerance` of ln(V) and fell"
            " by less than `stall_tolerance` of ln(V) since half-way to the check; the message compares it with the "
            "labels' unigram entropy"
        ),
        hint=(
            "Usual causes: softmax applied in forward before a cross-entropy (double softmax, see TFD220); a learning"
            " rate far too low or still in warm-up; parameters not in the optimizer; the loss detached from the "
            "graph. Run the overfit-one-batch test."
        ),
        reason="Measured: the loss has not left ln(V) by the check, so the run so far has learned nothing",
    ),
    Rule(
        "TFD226",
        "warning",
        "LossAtInit",
        title="at `check_step` the model predicts its current input token: labels not shifted",
        trigger=(
            "at `check_step` the argmax equals the current input token at more than `copy_threshold` of positions, "
            "0.25 above the data's own repeat rate, and 0.1 above the rate at step 0 (tied embeddings copy from init)"
        ),
        hint=(
            "The labels are not shifted: position t is trained to predict token t, which it can see. Shift them "
            "(logits[:, :-1] against labels[:, 1:]) in the loss or the collator, not both."
        ),
        reason="Measured: the trained model predicts its current input token, the harm of labels that are not shifted",
    ),
    Rule(
        "TFD227",
        "error",
        "LossAtInit",
        title="the step-0 loss is not finite although labels are supervised",
        trigger="the step-0 loss is NaN/inf although labels are supervised",
        hint=(
            "Look for log(0), division by zero or an overflow in the forward or the loss; NaNFirstFrame names the "
            "first module that produced a non-finite value."
        ),
        reason=(
            "A loss that is not finite before any update turns the first step's weights into NaN: the run cannot "
            "succeed"
        ),
    ),
    Rule(
        "TFD228",
        "info",
        "LossAtInit",
        title="logits or labels cannot be found; names the argument to set, then stands aside",
        trigger="the logits or labels cannot be found; LossAtInit names the argument to set and stands aside",
        hint="Set the named argument; LossAtInit does nothing else in this run.",
        reason="The check stands aside and names the argument that would let it run; nothing was measured",
    ),
    Rule(
        "TFD229",
        "warning",
        "LossAtInit",
        title="the returned loss is a multiple of its logits' cross-entropy (summed, or divided twice)",
        trigger=(
            "the step-0 logits give a cross-entropy within `init_tolerance` of ln(V) but the returned loss is outside"
            " that band: above by any factor, below by one over a count of the batch (rows, tokens, accumulation, "
            "ranks)"
        ),
        hint=(
            "Average the loss over supervised tokens (cross_entropy's default reduction='mean', or divide a sum by "
            "(labels != ignore_index).sum()); do not divide by accumulate_grad_batches yourself (Lightning does); "
            "weight extra loss terms so they do not dominate. A summed loss makes the step size depend on the batch "
            "and sequence length; with Adam it also breaks gradient clipping and the epsilon balance."
        ),
        reason=(
            "Measured: the loss, and with it every gradient, is scaled by a count of the batch: the effective learning "
            "rate is not the one set"
        ),
    ),
    Rule(
        "TFD230",
        "warning",
        "LossAtInit",
        title="the loss is pinned at the floor of outputs squashed into a bounded range (sigmoid, tanh, clamp)",
        trigger=(
            "at the check the logits' cross-entropy has left ln(V) and lies within 30% of the way from "
            "`ln(1 + (V-1) e^-w)` (the lowest loss logits of range `w` allow, per row) up to ln(V), that floor is "
            "above the labels' unigram entropy by 5% of ln(V), and the rows' ranges are alike (standard deviation at "
            "most 5% of their mean: a bound holds every row at the same width; the loss is the alignment the returned "
            "loss agrees with)"
        ),
        hint=(
            "Feed the loss raw, unbounded logits: remove the sigmoid, tanh, clamp or normalisation applied to the "
            "output layer (or move it to inference). For logits confined to a range of width w, no cross-entropy over"
            " V classes is below ln(1 + (V-1) e^-w), whatever the model learns."
        ),
        reason="Measured: the loss sits on the floor that bounded outputs allow, above what the data allows",
    ),
    Rule(
        "TFD231",
        "warning",
        "LossAtInit",
        title="labels from other samples: the loss sits at the unigram entropy and ignores which sample it is",
        trigger=(
            "at the check the loss is at the labels' unigram entropy (0.85x to 1.1x), the loss against labels rolled "
            "by one sample along the batch is within 1% of it, and the labels do not repeat their own inputs more "
            "than a neighbour's (masked-LM labels: do not sit on their own inputs' mask tokens more than on a "
            "neighbour's)"
        ),
        hint=(
            "The labels do not belong to their inputs: look for an off-by-one in the join of inputs and labels, a "
            "label column shuffled or sorted separately from the inputs, or labels built from another batch. For a "
            "task whose labels never repeat the input (classification, translation), the model may instead ignore "
            "its inputs: check what reaches the model."
        ),
        reason=(
            "Measured: the loss stopped at what token frequencies give, and it does not matter which sample the labels "
            "are scored against"
        ),
    ),
    Rule(
        "TFD232",
        "warning",
        "LossAtInit",
        title="the model ignores its context: the loss stalls at the labels' unigram entropy (token frequencies only)",
        trigger=(
            "at the check the loss is flat at the labels' unigram entropy (0.85x to 1.1x), the loss against labels "
            "rolled by one sample is within 1% of it, and the labels repeat their own inputs (so they are right); "
            "info for masked-LM labels that sit on their own inputs' mask tokens (the masked-LM plateau, longer at a "
            "lower learning rate)"
        ),
        hint=(
            "The model predicts from token frequencies alone: its inputs do not reach the prediction. Look for an "
            "attention mask that hides every token, inputs replaced or zeroed before the model (the wrong key, an "
            "embedding never used), a residual path that drops the context, or a learning rate too low to get past "
            "the plateau."
        ),
        reason=(
            "Measured: the loss is flat at what token frequencies give and the labels are right, so the model does not "
            "use its context"
        ),
    ),
    Rule(
        "TFD233",
        "warning",
        "LossAtInit",
        title=(
            "the loss is pinned at the floor of a bounded transform applied after the forward (sigmoid or tanh in "
            "training_step or a loss wrapper)"
        ),
        trigger=(
            "on every compared step (the measuring steps nearest half-way and three quarters to the check, and the "
            "check) the returned loss is above the recorded logits' cross-entropy by more than 3%, it fell by at most "
            "4% of itself over those steps, it stays above the logits' best loss at any temperature by 10% of ln(V) "
            "and above the labels' unigram entropy by 5% of ln(V), and the logits' range grew by 10% or more; the "
            "message names the width w whose floor ln(1 + (V-1) e^-w) the loss sits on"
        ),
        hint=(
            "Something between the model's output and the loss confines the logits to a range (a sigmoid, tanh, "
            "clamp or normalisation in training_step or in a loss module): give the loss the raw logits and apply the "
            "squashing only where probabilities or scores are needed."
        ),
        reason=(
            "Measured: the loss stays at a floor above what the data allows while the model's own logits predict "
            "better; no training can lower it"
        ),
    ),
    Rule(
        "TFD234",
        "info",
        "LossAtInit",
        title="the returned loss is the cross-entropy of the logits divided by a temperature T",
        trigger=(
            "on every compared step the returned loss differs from the recorded logits' cross-entropy by more than 3% "
            "and equals the cross-entropy of logits / T for one T (within 3%) at all of them, T outside [0.8, 1.25]"
        ),
        hint=(
            "If the temperature is deliberate, use the same T wherever the logits are read (evaluation, sampling, a "
            "validation loss); if not, remove the division or multiplication of the logits before the loss."
        ),
        reason=(
            "An observation: a temperature rescales the logits the model learns, and the run still trains; the harm, "
            "if any, is in code that reads the logits without it"
        ),
    ),
    Rule(
        "TFD235",
        "info",
        "LossAtInit",
        title="the returned loss is not the cross-entropy of the model's logits, and no known transform explains it",
        trigger=(
            "on every compared step the returned loss differs from the recorded logits' cross-entropy by more than "
            "3%, and neither a bound (TFD233), label smoothing, a temperature (TFD234), a constant factor nor an "
            "added term of at most 20% explains it; the message gives both numbers"
        ),
        hint=(
            "Check what training_step does to the logits before the loss, or point `logits_module` at the module "
            "whose output the loss reads."
        ),
        reason="An observation: the disagreement is measured, but no harm to this run is",
    ),
    # ---------------------------------------------------------------- GradNormMonitor
    Rule(
        "TFD301",
        "warning",
        "GradNormMonitor",
        title="explosion: total above `explosion_factor` x running median",
        trigger="total gradient norm above `explosion_factor` x its running median, after `warmup_measurements`",
        hint=(
            "Usual causes: learning rate too high or no warm-up, a bad batch, attention logits growing. Lower the LR,"
            " add warm-up, or clip gradients (Trainer(gradient_clip_val=1.0))."
        ),
        reason="Measured: a gradient far above this run's own history, the step that moves weights the most",
    ),
    Rule(
        "TFD302",
        "warning",
        "GradNormMonitor",
        title="vanishing: groups far below the largest group, sustained",
        trigger=(
            "a group's norm below `vanishing_ratio` x the largest group norm for `patience` measurements in a row, "
            "among the groups an optimizer steps (a group in no optimizer's param groups is neither the reference nor "
            "judged: it never learns, and its gradient stays at its initial size)"
        ),
        hint=(
            "Those layers barely learn. Usual causes: missing residual connections, saturating activations "
            "(sigmoid/tanh), post-norm without warm-up, or a detach() in the forward."
        ),
        reason="Measured, sustained: a group whose gradient is far below the others' barely trains",
    ),
    Rule(
        "TFD303",
        "error",
        "GradNormMonitor",
        title="non-finite gradients (without a GradScaler), naming the groups",
        trigger="a gradient holds inf/nan (without a GradScaler; with one, ScalerWatch owns overflow)",
        hint=(
            "Add NaNFirstFrame to find the first module that produced them; check the learning rate, the loss (log of"
            " zero, division by zero) and fp16 ranges."
        ),
        reason=(
            "A step with inf/nan gradients and no GradScaler to skip it writes NaN into the weights: the run cannot "
            "recover"
        ),
    ),
    Rule(
        "TFD304",
        "warning",
        "GradNormMonitor",
        title="trainable parameters that never receive a gradient",
        trigger="a trainable parameter received no gradient in `patience` measured steps",
        hint=(
            "They are not used in the forward that produces the loss (dead branch, a detach, a module called outside "
            "forward). Freeze them (requires_grad=False) or fix the forward."
        ),
        reason=(
            "Measured: trainable parameters that never get a gradient never train (a branch the loss does not reach)"
        ),
    ),
    Rule(
        "TFD305",
        "info",
        "GradNormMonitor",
        title="the optimizer unscales inside `step()`; the norm was divided by the loss scale",
        trigger=(
            "the optimizer unscales inside `step()` (fused AdamW under fp16): gradients were measured scaled and "
            "divided by the loss scale here"
        ),
        hint=("Nothing to fix. Note that Trainer-side clipping and any other hook reading .grad see scaled values."),
        reason="An observation about how the norm was measured; the training itself is unaffected",
    ),
    Rule(
        "TFD306",
        "warning",
        "GradNormMonitor",
        title="norm clipping cuts every step by over 100x: `gradient_clip_val` far below the gradient norm",
        trigger=(
            "norm clipping on, every step since the last measurement clipped, and the gradient norm above 100 x "
            "`gradient_clip_val`, for `patience` measurements"
        ),
        hint=(
            "Set gradient_clip_val near the gradient norm of healthy steps (look at grad_norm/total; 1.0 is usual for"
            " transformers with a mean loss) so that it only cuts spikes. With SGD the step shrinks by that factor; "
            "with Adam the clipped gradients can fall below eps and the step shrinks too. A norm this far above any "
            "sane clip can also mean a summed loss (LossAtInit names it)."
        ),
        reason=(
            "Measured: clipping cuts every step by over 100x, which makes the learning rate set 100x too high in effect"
        ),
    ),
    # ---------------------------------------------------------------- UpdateRatio
    Rule(
        "TFD310",
        "warning",
        "UpdateRatio",
        title="updates too small for the LR plateau, and the loss barely moves: LR too low",
        trigger=(
            "update:weight ratio below `low` for `patience` measurements while the LR is at its plateau (not in "
            "warm-up, not decayed below `decayed_lr_fraction` of its peak), and over them the mean training loss "
            "fell by less than 0.1% of itself per step, and the model has not learned: its first measured loss made "
            "less than 0.35 of the way from ln(V) to the labels' unigram entropy (a fine-tune starts most of the way "
            "down) and its latest loss is not below that entropy (`lightning_tfdebug.functional.learning`)"
        ),
        hint=(
            "The learning rate is probably too low (with AdamW, ratio ~ lr / rms(W)). Raise it, or run an LR range "
            "test; check that the scheduler is not stuck at its initial factor. Groups named in "
            "`groups_below_resolution` did not change at all: the optimizer stepped them by less than half the float "
            "spacing of their weights (AdamW at lr 1e-8 on fp32 norm gains of 1.0), and they rounded back."
        ),
        reason="Measured: updates too small to move the weights, and the loss shows the model has not learned",
    ),
    Rule(
        "TFD311",
        "warning",
        "UpdateRatio",
        title="one step rewrote a large part of the weights: LR too high / no warm-up",
        trigger="update:weight ratio above `high` on any measurement",
        hint=(
            "The learning rate is probably too high, or there is no warm-up: each step rewrites a large part of the "
            "weights. Lower the LR or add warm-up; GradNormMonitor shows whether gradients explode too."
        ),
        reason="Measured: one optimizer step rewrote a large part of the weights",
    ),
    Rule(
        "TFD312",
        "error",
        "UpdateRatio",
        title="a group got gradients but did not change: not in the optimizer",
        trigger=(
            "a group received gradients but did not change when the optimizer stepped, `patience` measurements in a "
            "row, and holds parameters in none of the optimizers' param groups (when the optimizer holds copies and "
            "that cannot be told: its expected step is not below half the float spacing of its weights). A group in "
            "the optimizer whose step rounds away is TFD310's evidence instead"
        ),
        hint=(
            "Their parameters are not in the optimizer (built before the module was added, or filtered out in "
            "configure_optimizers). Add them, or set requires_grad=False if they should stay fixed."
        ),
        reason=(
            "A group that receives gradients but never changes is not being trained: the model cannot learn as "
            "configured"
        ),
    ),
    Rule(
        "TFD313",
        "warning",
        "UpdateRatio",
        title=(
            "the weights inflate (median group norm grew > `growth_limit` x in `growth_window` steps): LR far too high"
        ),
        trigger=(
            "the median group weight norm grew more than `growth_limit` x within `growth_window` optimizer steps "
            "(groups under 5% of the largest group's norm left out)"
        ),
        hint=(
            "Each step moves the weights a lot against their own scale (Adam moves every weight by about the LR per "
            "step), so they inflate instead of learning; the loss typically stalls on a plateau or spikes. The "
            "learning rate is probably far too high: transformers trained with AdamW usually peak between 1e-4 and "
            "1e-3 (a few times more for tiny models). Lower it, and keep a warm-up."
        ),
        reason="Measured: the weights inflate within a short window, which a learning rate far too high does",
    ),
    Rule(
        "TFD314",
        "warning",
        "UpdateRatio",
        title=(
            "the weights deflate (median group norm fell below 1/`growth_limit` in `growth_window` steps): decay far "
            "too strong"
        ),
        trigger=(
            "the median group weight norm fell below `1 / growth_limit` of its value within `growth_window` optimizer"
            " steps"
        ),
        hint=(
            "Weight decay is far too strong for this learning rate (AdamW decays by lr x weight_decay every step: "
            "typical products are 1e-5 to 1e-4, e.g. lr 3e-4 with weight_decay 0.1), so decay, not the loss, sets the"
            " weights' scale. Lower weight_decay; check it is not an L2 coefficient meant for SGD scaled up, or "
            "applied twice (by the optimizer and a penalty in the loss)."
        ),
        reason="Measured: the weights deflate within a short window, which weight decay far too strong does",
    ),
    # ---------------------------------------------------------------- OptimizerAudit
    Rule(
        "TFD320",
        "error",
        "OptimizerAudit",
        title="trainable parameters in no param group (named)",
        trigger="trainable parameters in no param group (names them)",
        hint=(
            "Build the optimizer from all trainable parameters (after the model is complete and moved), or freeze "
            "these with requires_grad=False if that is the intent."
        ),
        reason="Parameters in no param group never change: part of the model cannot be trained as configured",
    ),
    Rule(
        "TFD321",
        "error",
        "OptimizerAudit",
        title="parameters in more than one param group or optimizer",
        trigger="a parameter in more than one param group / optimizer",
        hint="Each parameter must be stepped by exactly one param group; build the groups from disjoint sets.",
        reason=(
            "A parameter stepped by two groups or optimizers gets two updates per step (or the optimizer refuses it): "
            "the run is not the one configured"
        ),
    ),
    Rule(
        "TFD322",
        "info",
        "OptimizerAudit",
        title="frozen parameters still in the optimizer (a warning once one of them moves)",
        trigger=(
            "frozen parameters (`requires_grad=False`) still in the optimizer: info, since torch optimizers skip "
            "parameters without a gradient; a warning when a measured step changes one of them"
        ),
        hint=(
            "Harmless with torch optimizers, which skip parameters whose .grad is None. An optimizer that steps them "
            "anyway (weight decay or momentum applied without a gradient, a custom optimizer, a .grad set by hand) "
            "moves frozen weights: build the optimizer from `[p for p in model.parameters() if p.requires_grad]`."
        ),
        reason=(
            "Torch optimizers skip parameters without a gradient, so frozen ones stay put; a warning once one is "
            "measured to move"
        ),
    ),
    Rule(
        "TFD323",
        "error",
        "OptimizerAudit",
        title="the optimizer holds tensors that are not parameters of the module",
        trigger="the optimizer holds tensors that are not parameters of the module (stale copies)",
        hint=(
            "The optimizer was built before the model was moved, copied or rebuilt; build it in "
            "`configure_optimizers` from `self.parameters()`."
        ),
        reason=(
            "The optimizer updates tensors the model does not use, so the model's own weights are not the ones being "
            "trained"
        ),
    ),
    Rule(
        "TFD324",
        "info",
        "OptimizerAudit",
        title="weight decay on 1-D parameters (norm weights, biases); a warning once they are measured to shrink",
        trigger=(
            "weight decay > 0 on 1-D parameters (norm weights, biases); a warning when their norm, measured on "
            "measuring steps, fell by more than 10% of its first measured value and the decay alone "
            "(`1 - exp(-sum lr * weight_decay)`) accounts for at least half of that fall"
        ),
        hint=(
            "Put biases and norm weights in a param group with weight_decay=0.0 (decay only parameters with ndim >= "
            "2); shrinking norm gains toward zero hurts training."
        ),
        reason=(
            "A lint: at common decay values and run lengths nothing measurable happens to norm gains and biases; a "
            "warning when their norm is measured to shrink"
        ),
    ),
    Rule(
        "TFD325",
        "info",
        "OptimizerAudit",
        title="weight decay on embedding tables",
        trigger="weight decay > 0 on embedding tables",
        hint="Many transformer recipes exclude embeddings from weight decay; check it is intended.",
        reason="A lint: common practice excludes embeddings from decay, but no harm is measured",
    ),
    Rule(
        "TFD326",
        "info",
        "OptimizerAudit",
        title="Adam-family optimizer with `weight_decay > 0` (coupled L2): use AdamW",
        trigger="`Adam`-family optimizer with `weight_decay > 0` (coupled L2)",
        hint="Use torch.optim.AdamW (decoupled weight decay), with a no-decay group for biases and norms.",
        reason=(
            "A lint: coupled L2 is rescaled by Adam's step, so the decay is weaker and uneven, but no harm is measured "
            "in the run"
        ),
    ),
    Rule(
        "TFD327",
        "error",
        "OptimizerAudit",
        title="the module is in eval mode at a training batch",
        trigger="the module is in eval mode at the first batch of an epoch or after validation",
        hint=(
            "Something calls `.eval()` (a hook, an inference helper, a generation callback) without calling "
            "`.train()` after; Lightning sets train mode before each epoch, so look at hooks that run later."
        ),
        reason=(
            "Training in eval mode turns dropout off and freezes normalisation statistics: the run is not the training "
            "configured"
        ),
    ),
    Rule(
        "TFD328",
        "info",
        "OptimizerAudit",
        title="mode-dependent submodules in eval mode while the module trains",
        trigger="dropout / norm submodules in eval mode while the module trains",
        hint="Deliberate for frozen BatchNorm; otherwise a submodule was left in eval mode.",
        reason="An observation: deliberate for frozen normalisation layers, and no harm is measured",
    ),
    Rule(
        "TFD329",
        "warning",
        "OptimizerAudit",
        title="the LR scheduler stepped more than once per optimizer step",
        trigger="an LR scheduler stepped more than once between two steps of its optimizer",
        hint=(
            "Step the scheduler once per optimizer step (not per micro-batch under gradient accumulation), and not by"
            " hand when Lightning already steps it (`interval: step` in configure_optimizers)."
        ),
        reason=(
            "Measured: the schedule runs several times faster than the optimizer steps, so the learning rate applied is"
            " not the one planned"
        ),
    ),
    Rule(
        "TFD330",
        "info",
        "OptimizerAudit",
        title="no learning-rate warm-up on a transformer (a warning once the early loss spikes)",
        trigger=(
            "a transformer trained from step 0 has an LR at a later measured step that is not above its first-step LR;"
            " a warning when a measured loss in the first `warmup_window` steps is not finite, rises above the first "
            "step's loss or doubles from its lowest point (what a warm-up prevents). Never decided from the first "
            "step after a resume"
        ),
        hint=(
            "Many runs train well without warm-up (fine-tuning, small models, constant LR). If the early loss spikes "
            "or diverges, add a linear warm-up (a few hundred to a few thousand steps) before the peak LR: Adam's "
            "early updates on attention and embeddings are large without it."
        ),
        reason="A lint: many runs train well without a warm-up; a warning once the early loss is measured to spike",
    ),
    Rule(
        "TFD331",
        "warning",
        "OptimizerAudit",
        title="the LR reached zero long before the end of the run",
        trigger="the LR reached zero before `zero_lr_fraction` of the run",
        hint=(
            "Size the schedule (total / decay steps) in optimizer steps of this run, accounting for gradient "
            "accumulation and the number of devices."
        ),
        reason="Loses work: the steps after the learning rate reached zero train nothing",
    ),
    Rule(
        "TFD332",
        "warning",
        "OptimizerAudit",
        title="a parameter byte-identical after steps that should have changed it",
        trigger="a parameter with a gradient and LR > 0 byte-identical after `patience` measured steps",
        hint=(
            "The update underflows the parameter's dtype (bf16/fp16 weights with a small LR: keep fp32 master "
            "weights), or the optimizer steps other tensors than the model uses."
        ),
        reason="Measured: a parameter with a gradient and a learning rate did not change over several steps",
    ),
    Rule(
        "TFD333",
        "warning",
        "OptimizerAudit",
        title=(
            "Adam-family optimizer over float16 parameters with `eps` < 1.7e-5: float16 moments underflow, huge or "
            "infinite steps"
        ),
        trigger=(
            "an Adam-family optimizer steps float16 parameters (so float16 moments) with `eps` < 1.7e-5: the second "
            "moment of gradients below 1.7e-4 underflows to 0 and the step is `lr * m / eps`, over 10x Adam's normal "
            "step (division by zero when `eps` rounds to 0, as 1e-8 does)"
        ),
        hint=(
            "Keep fp32 master weights and optimizer state (precision='16-mixed' or 'bf16-mixed' instead of "
            "'16-true'), or raise eps to 1e-4 or more for float16 optimizer math."
        ),
        reason=(
            "Any gradient below 1.7e-4, which every run has, makes its step lr * m / eps: huge or infinite steps at "
            "this configuration"
        ),
    ),
    Rule(
        "TFD334",
        "error",
        "OptimizerAudit",
        title="gradients not zeroed between optimizer steps (manual optimization without `zero_grad`)",
        trigger=(
            "at the first backward after an optimizer step (on a measuring step), a param group's probe parameter "
            "still holds non-zero gradients from earlier steps"
        ),
        hint=(
            "With manual optimization call `optimizer.zero_grad()` once per optimizer step (before the backward of "
            "the next accumulation window, or right after `optimizer.step()`)."
        ),
        reason=(
            "Gradients never zeroed add every step's gradient to all earlier ones: the run cannot train as configured"
        ),
    ),
    Rule(
        "TFD335",
        "warning",
        "OptimizerAudit",
        title=(
            "the LR has not moved since the first step and sits below half the scheduler's base LR: a step-sized "
            "warm-up stepped per epoch"
        ),
        trigger=(
            "a transformer's LR unchanged from the first step to the next measured step and below half of its "
            "schedulers' `base_lrs` (reported instead of TFD330)"
        ),
        hint=(
            "A warm-up or schedule sized in optimizer steps needs `'interval': 'step'` in the lr_scheduler dict that "
            "configure_optimizers returns (Lightning's default, also for a bare scheduler, is 'epoch': one step of "
            "the schedule per epoch). If the schedule is meant per epoch, its first epochs run at this LR."
        ),
        reason=(
            "Measured: the learning rate has not moved from a fraction of the one configured, so the warm-up is frozen"
        ),
    ),
    Rule(
        "TFD336",
        "warning",
        "OptimizerAudit",
        title="weight decay that shrinks weights by more than 5e-3 of themselves per step (`lr * weight_decay`)",
        trigger=(
            "decoupled (AdamW) or SGD weight decay with `lr * weight_decay > 5e-3` per step (the scheduler's "
            "`initial_lr` when there is one): weights halve in under ~140 steps without gradients"
        ),
        hint=(
            "Decoupled decay acts as lr x weight_decay per step; transformer recipes sit around 1e-5 to 1e-4 (AdamW "
            "lr 3e-4, weight_decay 0.1). A weight_decay of several units is usually an L2 coefficient or a percentage"
            " put in the wrong place; with a usual weight_decay, the learning rate itself is far too high "
            "(UpdateRatio shows what it does to the weights)."
        ),
        reason=(
            "At this rate decay alone halves every decayed weight in under 140 steps, so decay rather than the loss "
            "sets their scale"
        ),
    ),
    # ---------------------------------------------------------------- DeadActivation
    Rule(
        "TFD340",
        "warning",
        "DeadActivation",
        title=(
            "layers with more than `dead_threshold` dead units for `patience` measurements, named with their fractions"
        ),
        trigger=(
            "a layer's dead-unit fraction (units zero for every token of the batch, on every rank) above "
            "`dead_threshold` for `patience` measurements"
        ),
        hint="lower the LR / add warm-up; zero-initialise biases before ReLU; use GELU/SiLU/LeakyReLU",
        reason="Measured, sustained: dead units no longer learn and the layer loses their capacity",
    ),
    Rule(
        "TFD341",
        "warning",
        "DeadActivation",
        title=(
            "the dead fraction of a layer is rising: `dead_rise` above its lowest value for `patience` measurements"
        ),
        trigger=(
            "a layer's dead-unit fraction risen by `dead_rise` above its lowest value, for `patience` measurements "
            "without falling back"
        ),
        hint=("units are dying during training: lower the LR, add warm-up or gradient clipping, switch the activation"),
        reason="Measured: units are dying during training, capacity the layer keeps losing",
    ),
    Rule(
        "TFD342",
        "warning",
        "DeadActivation",
        title="layers with more than `saturation_threshold` saturated elements for `patience` measurements",
        trigger=(
            "a layer's saturated fraction (local gradient below `saturation_grad`: tanh/sigmoid near their bounds, "
            "GELU/SiLU/Mish deep in the negative tail) above `saturation_threshold` for `patience` measurements"
        ),
        hint="normalise the layer's input, shrink init or LR, prefer GELU/SiLU over tanh/sigmoid in deep stacks",
        reason="Measured, sustained: saturated units pass almost no gradient",
    ),
    Rule(
        "TFD343",
        "info",
        "DeadActivation",
        title="activations cannot be observed (torch.compile, or no hooked module ran); the callback stands aside",
        trigger=(
            "activations cannot be observed: the model (or a submodule) is compiled with `torch.compile`, it has no "
            "activation module and its submodules called no activation function, or no hooked module ran in the "
            "training forward; DeadActivation stands aside"
        ),
        hint=(
            "measure in an uncompiled debugging run; name the inputs of activations written as arithmetic with "
            "`preactivations`"
        ),
        reason="The check stands aside (compiled or unhooked model); nothing was measured",
    ),
    Rule(
        "TFD344",
        "warning",
        "DeadActivation",
        title=(
            "the saturated fraction of a layer is rising: `saturation_rise` above its lowest value for `patience` "
            "measurements"
        ),
        trigger=(
            "a layer's saturated fraction risen by `saturation_rise` above its lowest value, for `patience` "
            "measurements without falling back"
        ),
        hint=(
            "pre-activations are growing: lower the LR, normalise the layer's input, add weight decay or clipping, "
            "prefer GELU/SiLU"
        ),
        reason="Measured: saturation is rising during training, so ever less gradient passes the layer",
    ),
    # ---------------------------------------------------------------- NaNFirstFrame
    Rule(
        "TFD401",
        "error",
        "NaNFirstFrame",
        title=(
            "the loss or gradients became non-finite; names the first module (forward and backward), the rank(s) and "
            "the report"
        ),
        trigger=(
            "the loss of a micro-batch or (without a GradScaler) a gradient became inf/nan; the step is not applied "
            "and replayed with frame hooks (in eager mode the first non-finite output is also named from this "
            "step's own per-module output sums, even when the replay does not reproduce); names the first module "
            "whose forward output and whose output gradient held inf/nan, the rank(s), and the report "
            "`<log_dir>/tfdebug/nan-step<k>-rank<r>.txt`"
        ),
        hint=(
            "read the report's frames: abs-max growing toward the fp16 limit (small `fp16 room`) means overflow; keep"
            " that module in fp32 or use bf16, lower the LR, add warm-up or clipping; a nan with finite inputs points"
            " at the module's math (`log(0)`, `sqrt` of 0 in backward, 0/0)"
        ),
        reason="A non-finite loss or gradient destroys the weights at the step it reaches: the run cannot continue",
    ),
    Rule(
        "TFD402",
        "info",
        "NaNFirstFrame",
        title="eager mode: a module produced inf/nan that did not reach the loss",
        trigger=(
            "eager mode: a module output held inf/nan although the loss and gradients stayed finite (a fully masked "
            "softmax row, `log(0)` at padding, a discarded branch)"
        ),
        hint=(
            "Masked or discarded positions still hold inf/nan (e.g. a softmax over a fully masked row, log(0) at "
            "padding). Harmless until a mask or branch changes; fix the math at the named module."
        ),
        reason=(
            "Inf/nan inside the forward that reached neither the loss nor the gradients did no measurable harm (a fully"
            " masked row, a discarded branch)"
        ),
    ),
    Rule(
        "TFD403",
        "error",
        "NaNFirstFrame",
        title="the loss or gradients became non-finite and replaying the step to locate the frame failed",
        trigger=(
            "the loss or gradients became non-finite and replaying the step to locate the first bad frame raised; the"
            " report holds the error"
        ),
        hint="Run with mode='eager' to record frames during the step itself.",
        reason="The run produced a non-finite loss or gradient; only its location is missing",
    ),
    # ---------------------------------------------------------------- ScalerWatch
    Rule(
        "TFD410",
        "info",
        "ScalerWatch",
        title="no GradScaler (bf16 or 32-bit): nothing to watch",
        trigger="precision uses no GradScaler (bf16 or 32-bit): ScalerWatch has nothing to watch and stays idle",
        hint="Nothing to fix. Remove ScalerWatch, or keep it: it costs nothing without a scaler.",
        reason="An observation: without a GradScaler there is nothing for ScalerWatch to watch",
    ),
    Rule(
        "TFD411",
        "error",
        "ScalerWatch",
        title="the loss scale collapsed (below `min_scale`, or halved repeatedly within `window`)",
        trigger=(
            "the fp16 loss scale fell below `min_scale`, or was reduced `collapse_backoffs` times within the last "
            "`window` steps"
        ),
        hint=(
            "Something overflows fp16 on every step: add NaNFirstFrame to name the module, keep it in fp32 or switch "
            "to bf16; lower the LR or add warm-up if it started after a spike."
        ),
        reason="A collapsed loss scale underflows every gradient or skips every step: the run cannot train",
    ),
    Rule(
        "TFD412",
        "warning",
        "ScalerWatch",
        title="a high fraction of steps skipped; names the groups whose gradients overflowed",
        trigger=(
            "more than `max_skipped_frac` of the last `window` optimizer steps were skipped for overflow; names the "
            "parameter groups whose gradients held inf/nan"
        ),
        hint=(
            "Skipped steps are lost updates. Find the overflowing module (NaNFirstFrame), keep it in fp32, use bf16, "
            "or lower GradScaler's init_scale if only the first steps skip."
        ),
        reason="Loses work: a large share of the steps was skipped for overflow",
    ),
    Rule(
        "TFD413",
        "warning",
        "ScalerWatch",
        title="a per-step LR scheduler advanced on steps the optimizer skipped",
        trigger=(
            "a per-step LR scheduler advanced (its `last_epoch`) on `lr_skipped_steps` optimizer steps that the "
            "GradScaler skipped"
        ),
        hint=(
            "Fix the overflow that skips steps; or step the scheduler only when the scale did not drop (compare "
            "scaler.get_scale() before and after update())."
        ),
        reason="Measured: the schedule advanced on steps the optimizer skipped, so it runs ahead of the updates",
    ),
    Rule(
        "TFD414",
        "warning",
        "ScalerWatch",
        title="the scale never grew for several growth intervals",
        trigger="the loss scale did not grow for `no_growth_intervals` x `growth_interval` steps",
        hint=(
            "Overflows recur regularly: look for the module near the fp16 limit (NaNFirstFrame, eager mode) or switch"
            " to bf16."
        ),
        reason="Measured: the scale never grew, so overflow keeps skipping steps",
    ),
    # ---------------------------------------------------------------- PerRankLogger
    Rule(
        "TFD501",
        "warning",
        "PerRankLogger",
        title=(
            "identical batch fingerprints on different ranks for `patience` measurements: the data is not split (no "
            "distributed sampler)"
        ),
        trigger=(
            "two or more ranks trained on identical batches (equal fingerprints of the input ids) for `patience` "
            "measurements in a row"
        ),
        hint=(
            "Use a DistributedSampler: keep Trainer(use_distributed_sampler=True) (the default) or, with a custom "
            "sampler or IterableDataset, shard by trainer.global_rank / world_size yourself."
        ),
        reason="Loses work: every rank trains on the same batches, N x the compute for 1 x the data",
    ),
    Rule(
        "TFD502",
        "error",
        "PerRankLogger",
        title="parameter or buffer checksums differ between DDP replicas; names the ranks and the tensors",
        trigger=(
            "parameter or buffer checksums (per-tensor norm and sum) differ between DDP replicas; names the ranks and"
            " tensors (not checked under sharded strategies; BatchNorm running statistics excluded)"
        ),
        hint=(
            "DDP only averages gradients, so a replica that changes a weight on its own (rank-dependent code in "
            "training_step or a hook, a different initialization without a seed, an optimizer step skipped on one "
            "rank) stays different for ever. Seed every rank the same before building the model, and make weight "
            "updates outside the optimizer identical on every rank."
        ),
        reason="Replicas whose weights differ are no longer one model: the ranks train different runs",
    ),
    Rule(
        "TFD503",
        "warning",
        "PerRankLogger",
        title=(
            "a straggler: one rank's own work per step well above the other ranks' median, sustained; names the rank"
        ),
        trigger=(
            "a rank's own work per step (outside backward, plus data wait) above `straggler_factor` x the other "
            "ranks' median and `straggler_min_ms` more, for `patience` measurements"
        ),
        hint=(
            "Check that rank's host (other processes, CPU frequency, thermal throttling), its data shard (slower "
            "samples, longer sequences), and per-rank code paths (logging or checkpointing on one rank inside the "
            "step). Compare tfdebug/rank<r>.jsonl files."
        ),
        reason="Measured: one rank is slower every step and the whole job waits for it",
    ),
    Rule(
        "TFD504",
        "warning",
        "PerRankLogger",
        title=(
            "a rank's loss far from the median over ranks, sustained; with two ranks, the two losses far apart (both "
            "named)"
        ),
        trigger=(
            "a rank's loss differs from the median over ranks by more than `loss_spread` of it (two ranks: the two "
            "losses by more than `loss_spread` of the smaller; both named), for `patience` measurements"
        ),
        hint=(
            "that rank sees different data, computes its loss differently (rank-dependent code) or runs different "
            "weights (see TFD502); compare the `rank<r>.jsonl` files"
        ),
        reason="Measured, sustained: one rank's loss is far from the others', so its data or its replica differs",
    ),
    Rule(
        "TFD505",
        "error",
        "PerRankLogger",
        title="a non-finite loss, naming the rank(s) that produced it",
        trigger="a rank's training loss is inf/nan; names the rank(s)",
        hint=(
            "Look at that rank's batch (its fingerprint is in tfdebug/rank<r>.jsonl) and add NaNFirstFrame to find "
            "the first module that produced it. Under DDP the NaN reaches every rank with the next gradient "
            "all-reduce."
        ),
        reason="A non-finite loss on a rank poisons the averaged gradient on every rank: the run cannot continue",
    ),
    # ---------------------------------------------------------------- ThroughputMonitor
    Rule(
        "TFD601",
        "warning",
        "ThroughputMonitor",
        title="data-loading bound: the wait for the next batch above `wait_threshold` of wall time, sustained",
        trigger=(
            "waiting for the next batch took more than `wait_threshold` of wall time (worst rank) for `patience` "
            "measurements"
        ),
        hint=(
            "Raise DataLoader(num_workers=...), use pin_memory=True and persistent_workers=True, raise "
            "prefetch_factor, and move tokenization or heavy transforms out of __getitem__ (pre-tokenize)."
        ),
        reason="Measured: the run waits for data a large share of its time, compute paid for and idle",
    ),
    Rule(
        "TFD602",
        "info",
        "ThroughputMonitor",
        title=(
            "padding waste: padding above `padding_threshold` of the token positions, sustained (a warning above half)"
        ),
        trigger=(
            "padding above `padding_threshold` of the computed token positions for `patience` measurements; a warning "
            "when padding is most (> 50%) of them, with the speed-up packing and dynamic padding would give"
        ),
        hint=(
            "Group sequences of similar length (length-bucketed sampler), pad to the batch maximum rather than a "
            "fixed length, or pack several sequences per row."
        ),
        reason=(
            "An observation of padding; a warning when padding is most of the computed positions (compute measured "
            "lost)"
        ),
    ),
    Rule(
        "TFD603",
        "warning",
        "ThroughputMonitor",
        title="the median step time regressed to more than `regression_factor` x the early window, sustained",
        trigger=(
            "the median step time above `regression_factor` x the early window's median (after `skip_steps`, over "
            "`baseline_steps`), and the mean step time over the same `window` steps above `regression_factor` x the "
            "early windows' (time lost, not only the median moved), for `patience` measurements"
        ),
        hint=(
            "Look for growth over time: a Python list or tensor kept across steps (retained graph, metrics "
            "accumulated with .append), rising sequence lengths, memory fragmentation, thermal throttling, or other "
            "jobs on the machine. Run with profile_steps=[a, b] early and late, and compare the tables."
        ),
        reason="Measured, sustained: the step time regressed against the run's own early steps",
    ),
    Rule(
        "TFD604",
        "info",
        "ThroughputMonitor",
        title="memory above `memory_threshold` of the device's (or machine's) capacity",
        trigger="peak memory above `memory_threshold` of the device's capacity (CPU: the machine's physical memory)",
        hint=(
            "Lower the micro-batch size and use gradient accumulation, enable activation checkpointing, use bf16 "
            "mixed precision, or shard parameters and optimizer state (FSDP)."
        ),
        reason="An observation: memory near capacity is a risk, not harm (caching allocators keep what they reserved)",
    ),
    Rule(
        "TFD605",
        "info",
        "ThroughputMonitor",
        title=(
            "the step time regressed as for TFD603, but the machine is to blame: the run waited for CPU cores that "
            "other processes took, or a fixed reference computation slowed as much"
        ),
        trigger=(
            "as TFD603, but during the slow streak every regressed rank's threads waited on the run queue for at "
            "least half the extra step time more than in the early windows (`/proc/self/task/*/schedstat`), and "
            "either other processes used >= max(0.5, 0.1 x cores) more CPU cores than in the quietest early window "
            "(Linux `/proc/stat`) or, on a machine already full, the run's own CPU time per step rose by less than "
            "0.9x as much as its step time (no more work, a smaller share of the cores); all judged over the steps the "
            "median step time covers. Or, with or without `/proc`: a fixed CPU computation (two 192x192 matrix "
            "products and a 4 MiB copy, repeated for 20 ms, timed on the early measuring steps and again on the slow "
            "one) took longer by at least half as much as the mean step time rose, while the run's CPU use per "
            "second of wall time did not rise past 1.25x its early one (steal, a lower clock, a saturated memory bus, "
            "other processes on a machine without `/proc`). TFD603 then needs `patience` slow, uncontended "
            "measurements in a row"
        ),
        hint=(
            "Timings from a shared machine are not comparable over time; for benchmarks, use an idle machine or "
            "compare ratios measured in the same period."
        ),
        reason=(
            "The slowdown is the machine's (other processes took the cores, or the same work takes longer), not the "
            "run's"
        ),
    ),
    Rule(
        "TFD606",
        "warning",
        "ThroughputMonitor",
        title=("`torch.compile` keeps compiling new graphs after the early window, at each of `patience` measurements"),
        trigger=(
            "`torch.compile` compiled new graphs at each of `patience` measurements after the early window (counted "
            "from TorchDynamo's counters)"
        ),
        hint=(
            "Something the compiled code is guarded on changes from step to step: usually input shapes (variable "
            "sequence lengths with dynamic=False or mark_static; pad to a few bucket lengths or let shapes be "
            "dynamic), or Python values passed in (the step number, a changing float, a dict with new keys). "
            'TORCH_LOGS="recompiles" prints the failing guard.'
        ),
        reason="Measured: recompiling keeps costing time after the early window",
    ),
    Rule(
        "TFD607",
        "warning",
        "ThroughputMonitor",
        title="`torch.compile` hit its recompile limit during training: that code now runs uncompiled",
        trigger="`torch.compile` hit its recompile limit during training, so that code runs uncompiled",
        hint=(
            'Find what forces the recompilations (TORCH_LOGS="recompiles"): usually changing input shapes or Python '
            "values; pad to fixed buckets, mark dimensions dynamic, or raise torch._dynamo.config.recompile_limit "
            "only if the variants are few and worth compiling."
        ),
        reason="Measured: the code that hit the limit now runs uncompiled, slower than configured",
    ),
    # ---------------------------------------------------------------- CheckpointAudit
    Rule(
        "TFD701",
        "error",
        "CheckpointAudit",
        title="weights missing from the file",
        trigger="the saved file lacks weights for tensors of the module's `state_dict`",
        hint="check `on_save_checkpoint` overrides and how the checkpoint is written",
        reason=(
            "A checkpoint without all the weights cannot restore the model: resuming from it fails or resumes another "
            "model"
        ),
    ),
    Rule(
        "TFD702",
        "error",
        "CheckpointAudit",
        title="saved tensors with the wrong shape",
        trigger="saved tensors with the wrong shape",
        hint="save full (gathered) tensors; the model was not rebuilt between save and load",
        reason="Tensors saved with the wrong shape cannot be loaded back: the checkpoint cannot restore this run",
    ),
    Rule(
        "TFD703",
        "error",
        "CheckpointAudit",
        title="optimizer state missing (in a saved file, or in a checkpoint being resumed)",
        trigger="optimizer state missing from the file (or from a checkpoint being resumed)",
        hint="do not drop `optimizer_states`; not `save_weights_only` for resumable checkpoints",
        reason=(
            "Without optimizer state, resuming fails (Lightning requires it) or restarts the optimizer: the run cannot "
            "be resumed as saved"
        ),
    ),
    Rule(
        "TFD704",
        "error",
        "CheckpointAudit",
        title="optimizer state incomplete: param groups, per-parameter state or step counts",
        trigger="optimizer state incomplete: param groups, per-parameter state or step counts missing",
        hint="save the optimizer's full `state_dict()`",
        reason=(
            "Incomplete optimizer state resumes with moments or step counts lost: the resumed run is not the run saved"
        ),
    ),
    Rule(
        "TFD705",
        "error",
        "CheckpointAudit",
        title="LR scheduler state missing",
        trigger="LR scheduler state missing",
        hint="do not drop `lr_schedulers`",
        reason=(
            "Without scheduler state a resumed run restarts its schedule (a second warm-up): it is not the run saved"
        ),
    ),
    Rule(
        "TFD706",
        "error",
        "CheckpointAudit",
        title="fp16 GradScaler state missing",
        trigger="fp16 GradScaler state missing under the precision plugin's key",
        hint="keep the precision plugin's entry in the checkpoint",
        reason="Without GradScaler state a resumed fp16 run restarts its loss scale: it is not the run saved",
    ),
    Rule(
        "TFD707",
        "error",
        "CheckpointAudit",
        title="loop progress missing or inconsistent with the step it was saved at",
        trigger="loop progress (`loops`, `global_step`, `epoch`) missing or inconsistent",
        hint="keep Lightning's loop state",
        reason=(
            "Without consistent loop progress a resumed run restarts or skips steps and data: it is not the run saved"
        ),
    ),
    Rule(
        "TFD708",
        "warning",
        "CheckpointAudit",
        title="a callback's state missing",
        trigger="a callback's state missing",
        hint='keep `checkpoint["callbacks"]`',
        reason="Loses work: a callback's state (early-stopping counters, an EMA) restarts on resume",
    ),
    Rule(
        "TFD709",
        "info",
        "CheckpointAudit",
        title=(
            "a checkpoint not checked (sharded directory, written outside the CheckpointIO, unreadable), or "
            "weights-only (a warning when no checkpoint the run keeps can resume it)"
        ),
        trigger=(
            "a checkpoint not checked (sharded distributed-checkpoint directory, written outside the CheckpointIO, "
            "unreadable), or a weights-only checkpoint (not resumable): a warning when no checkpoint callback of the "
            "run keeps full checkpoints and the run wrote none"
        ),
        hint="verify by resuming: the resume checks still run; keep one full checkpoint to resume from",
        reason=(
            "Info when another checkpoint the run keeps can resume it; a warning when none can (a crash then loses the "
            "optimizer, schedule and loop state)"
        ),
    ),
    Rule(
        "TFD710",
        "error",
        "CheckpointAudit",
        title="weights after resume differ from the checkpoint, or changed dtype",
        trigger="restored weights differ from the checkpoint (checksums) or changed dtype",
        hint="nothing may re-initialise or convert the module after loading",
        reason="Measured: weights after resume are not the checkpoint's, so the resumed run is another run",
    ),
    Rule(
        "TFD711",
        "error",
        "CheckpointAudit",
        title="optimizer step counts after resume differ from the checkpoint",
        trigger="optimizer step counts after resume differ from the checkpoint",
        hint="the optimizer was rebuilt or reset after loading",
        reason=(
            "Measured: the optimizer's step counts changed on resume (bias correction restarts): the resumed run is "
            "another run"
        ),
    ),
    Rule(
        "TFD712",
        "error",
        "CheckpointAudit",
        title="learning rates after resume differ from the checkpoint",
        trigger="learning rates after resume differ from the checkpoint",
        hint="the scheduler or param groups were rebuilt after loading",
        reason="Measured: the learning rates changed on resume: the resumed run is not the run saved",
    ),
    Rule(
        "TFD713",
        "error",
        "CheckpointAudit",
        title="GradScaler scale after resume differs from the checkpoint",
        trigger="GradScaler scale after resume differs from the checkpoint",
        hint="the scaler was replaced after loading",
        reason="Measured: the loss scale changed on resume: the resumed run is not the run saved",
    ),
    Rule(
        "TFD714",
        "error",
        "CheckpointAudit",
        title="global step after resume differs from the checkpoint",
        trigger="global step after resume differs from the checkpoint",
        hint=("keep the loop state: resume from a checkpoint with `loops`, and do not drop it in `on_load_checkpoint`"),
        reason="Measured: the global step changed on resume: schedules and step-based logic follow another run",
    ),
    Rule(
        "TFD715",
        "error",
        "CheckpointAudit",
        title="the loss on the probe batch after resuming differs from the loss at save time",
        trigger="the loss on the stored probe batch right after resuming differs from the loss at save time",
        hint="the model that trains is not the one saved: re-initialised, dtype or architecture changed",
        reason=(
            "Measured: the same batch gives a different loss after resuming, so the model restored is not the one saved"
        ),
    ),
    Rule(
        "TFD716",
        "error",
        "CheckpointAudit",
        title="a checkpoint this run wrote is truncated, corrupt or incomplete",
        trigger=(
            "a checkpoint file this run wrote cannot be read back (cut short, not a valid archive), or a sharded "
            "distributed-checkpoint directory lacks its metadata or a shard file the metadata lists"
        ),
        hint=(
            "a full disk, a quota, or a process killed while saving; free space, then resume from an earlier "
            "checkpoint that checks out"
        ),
        reason="A checkpoint this run wrote cannot be read back: resuming from it will fail",
    ),
)

_REGISTRY: dict[str, Rule] = {r.code: r for r in _RULES}
if len(_REGISTRY) != len(_RULES):  # pragma: no cover - a duplicate code is a bug in this file
    raise RuntimeError("lightning_tfdebug.rules: a code is registered twice.")

RULES: Mapping[str, Rule] = MappingProxyType(_REGISTRY)
"""Every registered rule by code: the pack's own in documentation order, then any added by
:func:`register_rule` (read-only; register through that function)."""

BUILTIN_CODES: frozenset[str] = frozenset(_REGISTRY)
"""The codes of the pack's own rules (those documented in ``docs/findings.md``)."""


def register_rule(new: Rule) -> Rule:
    """Register the rule of a callback built outside the pack on :class:`~lightning_tfdebug.DebugCallback`.

    Registering the same rule twice is allowed (a module imported again); a different rule under a code that is
    taken is not.

    Raises:
        TypeError: if ``new`` is not a :class:`Rule`.
        ValueError: if its code is already registered with different content.
    """
    if not isinstance(new, Rule):
        raise TypeError(f"register_rule takes a Rule; got {type(new).__name__}.")
    existing = _REGISTRY.get(new.code)
    if existing is not None and existing != new:
        raise ValueError(f"Finding code {new.code} is already registered by {existing.source}: {existing.title!r}.")
    _REGISTRY[new.code] = new
    return new


def rule(code: str) -> Rule:
    """The rule of ``code``.

    Raises:
        KeyError: if ``code`` is not registered (a callback emitting an unregistered code is a bug of the pack).
    """
    try:
        return RULES[code]
    except KeyError:
        raise KeyError(
            f"Finding code {code!r} is not in lightning_tfdebug.rules.RULES; register it there before emitting it."
        ) from None


def rules_of(source: str) -> tuple[Rule, ...]:
    """The rules a callback (by class name) can emit, in code order."""
    return tuple(r for r in _REGISTRY.values() if r.source == source)


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def render_rule_table(source: str, detail: bool) -> str:
    """The markdown table of ``source``'s rules: ``code | severity | trigger | what to do | why this severity`` when
    ``detail`` (the findings page; the last column is the rule's ``reason`` under ``docs/severity.md``), else ``code |
    severity | meaning`` (the callback's own page)."""
    rows = rules_of(source)
    if not rows:
        raise ValueError(f"No rules registered for {source!r}.")
    if detail:
        lines = ["| code | severity | trigger | what to do | why this severity |", "| --- | --- | --- | --- | --- |"]
        lines += [
            f"| {r.code} | {r.severity} | {_cell(r.trigger)} | {_cell(r.hint)} | {_cell(r.reason)} |" for r in rows
        ]
    else:
        lines = ["| code | severity | meaning |", "| --- | --- | --- |"]
        lines += [f"| {r.code} | {r.severity} | {_cell(r.title)} |" for r in rows]
    return "\n".join(lines) + "\n"
