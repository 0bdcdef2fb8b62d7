"""The rules MaskProbe decides: each finding code with its severity, text and hint."""

from __future__ import annotations

from lightning_tfdebug.functional.verdicts import Rule

TFD201 = Rule(
    "TFD201",
    "error",
    "MaskProbe",
    title="future tokens change past logits; names the largest change, its row and position",
    trigger=(
        "replacing the tokens after position t changed the logits at a position <= t beyond the dtype-aware tolerance"
    ),
    hint=(
        "The decoder's attention does not apply a causal mask (or applies it wrongly): check the mask "
        "construction, `is_causal`, and any custom attention kernel. For an encoder, set `causal=False`."
    ),
    reason=(
        "A causal model that sees the future learns to copy it; it cannot generate, so the run cannot succeed as "
        "configured"
    ),
)

TFD202 = Rule(
    "TFD202",
    "error",
    "MaskProbe",
    title="tokens under the attention mask change the logits of real tokens",
    trigger=("changing the token ids at positions whose attention mask is 0 changed the logits of unmasked positions"),
    hint=(
        "The attention mask does not reach the attention (or is inverted): check that the mask is passed through "
        "every layer and combined with the causal mask."
    ),
    reason=(
        "Measured: tokens the mask hides change real tokens' logits, so every padded batch trains on noise and "
        "inference depends on padding"
    ),
)

TFD203 = Rule(
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
)

TFD204 = Rule(
    "TFD204",
    "warning",
    "MaskProbe",
    title="the batch is padded but the model is called without a mask",
    trigger="the batch pads (mask has zeros) but the model is called without an attention mask",
    hint="Pass the attention mask to the model's forward (or give MaskProbe a `forward_fn` that does).",
    reason="The recorded call shows the model attends to the padding the batch marks, as if it were text",
)

TFD205 = Rule(
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
)

TFD206 = Rule(
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
)

TFD207 = Rule(
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
)

TFD208 = Rule(
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
)

TFD209 = Rule(
    "TFD209",
    "error",
    "MaskProbe",
    title="incremental decoding (`kv_cache_fn`) disagrees with the full forward; names the first position",
    trigger=("logits from `kv_cache_fn` (incremental decoding) differ from the full forward; names the first position"),
    hint=(
        "Check the cache position / offset passed at each decoding step, rotary offsets, and the mask used with a"
        " cache."
    ),
    reason=(
        "Measured: incremental decoding computes different logits than training, so the trained model generates wrongly"
    ),
)

TFD210 = Rule(
    "TFD210",
    "info",
    "MaskProbe",
    title=("target alignment undetermined (loss matches neither alignment, or `training_step` could not be replayed)"),
    trigger=(
        "the returned loss matches neither alignment (label smoothing, auxiliary losses), or `training_step` "
        "could not be replayed"
    ),
    hint="nothing if expected; otherwise check `labels_key` / `ignore_index`",
    reason="An observation: the alignment could not be decided from the loss, so nothing was claimed about it",
)

TFD211 = Rule(
    "TFD211",
    "info",
    "MaskProbe",
    title="MaskProbe cannot call the model or read the batch; names the argument to set; stands aside",
    trigger="MaskProbe cannot call the model or read the batch; it says which argument to set and stands aside",
    hint="set `forward_fn` / `input_key` / `mask_key` / `labels_key`",
    reason="The probe stands aside and names the argument that would let it run; nothing was measured",
)

TFD212 = Rule(
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
    reason=("An observation of the objective (a masked-LM or denoising task), which makes the causal probes not apply"),
)

TFD213 = Rule(
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
)

TFD214 = Rule(
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
)

TFD215 = Rule(
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
)

TFD216 = Rule(
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
)

BLOCK = ("TFD201", "TFD219")
"""The codes reserved for MaskProbe's rules."""

RULES: tuple[Rule, ...] = (
    TFD201,
    TFD202,
    TFD203,
    TFD204,
    TFD205,
    TFD206,
    TFD207,
    TFD208,
    TFD209,
    TFD210,
    TFD211,
    TFD212,
    TFD213,
    TFD214,
    TFD215,
    TFD216,
)
"""The rules decided in this module, in code order."""
