"""The bug matrix: every row of the bug zoo (``shared/bugzoo.md``) that a callback claims, injected into three model
families where users put it, must be flagged by its owner at its severity.

Families (``tests/bug_models.py``, built on the healthy matrix's ``tests/healthy_models.py``): ``encoder_lm``, a causal
LM on ``nn.TransformerEncoder`` with PyTorch's default initialisation (tuple batches, or the bundled padded dict batches
for the rows about padding); ``gpt2``, Hugging Face GPT-2 from a tiny config (Llama for row 34, whose bug needs
PyTorch's default initialisation; BERT's LM head for the encoder-as-decoder of row 33); ``tinygpt``, the bundled
TinyGPT; Hugging Face T5 and BART for the encoder-decoder rows (36; T5 also for row 39). Every case runs the whole
pack at its defaults (every callback, as the healthy matrix does; that includes CheckpointAudit's reading of
files back, which ``TFDebug()`` leaves to ``full``) on the buggy run, for the fewest steps that let the owner decide,
and asserts the owner's code at its severity. Rows 16, 17, 18 and 23 run under DDP with two gloo processes
(``tests/helpers.run_distributed``).

Rows 29 and 45 (the attention scale) are read at step 0 by AttentionProbe on hand-written and eager Hugging Face
attention.

The matrix runs under ``-m "slow or not slow"`` (CI runs it beside the default run, which holds only its docs-table
check). ``docs/bug-matrix.md`` has the table of rows, families, placements and codes. :data:`KNOWN_MISSES` lists the
cases where the owner misses the bug today (xfail, not strict), with what it saw."""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.precision import MixedPrecision

from lightning_tfdebug.findings import SEVERITIES, Finding
from lightning_tfdebug.rules import RULES
from tests.bug_models import (
    BugEncoderLM,
    BugHFLM,
    BugSeq2SeqLM,
    BugTinyGPT,
    CorruptBatch,
    HandAttentionGPT,
    HFAttentionLM,
    TokenRowLM,
    dict_data,
    in_order_loader,
    kind_loader,
    kind_module,
    leaky,
    token_rows,
    tuple_loader,
)
from tests.floor_models import Gemma2LM, SmoothedEncoderLM, SmoothedHFLM, SmoothedTinyGPT
from tests.healthy_models import HFLM, PACK_NAMES, the_pack_at_defaults
from tests.healthy_models import data as healthy_data
from tests.helpers import make_trainer, run_distributed

pytest.importorskip("transformers")

CHECK_STEP = 100  # LossAtInit's default check_step; MaskProbe's token-order check runs from step 100 too
AFTER_CHECK = CHECK_STEP + 10
PREFLIGHT = 50  # the steps of `tfdebug check`


@dataclass(frozen=True)
class Expect:
    """One of ``codes``, each from its owner in the registry, at ``severity`` or above."""

    codes: tuple[str, ...]
    severity: str = "warning"

    def met_by(self, finding: Any) -> bool:
        ours = finding.code in self.codes and RULES[finding.code].source == finding.source
        return ours and SEVERITIES.index(finding.severity) >= SEVERITIES.index(self.severity)

    def __str__(self) -> str:
        return f"{'/'.join(f'{RULES[c].source} {c}' for c in self.codes)} at {self.severity} or above"


def owner(*codes: str, severity: str = "warning") -> Expect:
    """One of ``codes`` from its owner, at ``severity`` or above (the row's severity, fixed here: a registry change
    that lowers it fails the row)."""
    assert all(c in RULES for c in codes), codes
    return Expect(codes, severity)


@dataclass
class Case:
    """One row on one family: how to build the buggy run and what its owner must say."""

    module: Callable[[], Any]
    data: Callable[[], Any]
    expect: tuple[Expect, ...]
    placement: str
    steps: int = 3
    trainer: dict[str, Any] = field(default_factory=dict)
    callbacks: Callable[[Path], list] = lambda tmp_path: []
    raises: bool | None = False  # the bug ends the run with an exception (True), may (None), or must not (False)
    resume_at: int = 0  # > 0: the run resumes from a checkpoint saved at this step by a run without the pack


FAMILIES = ("encoder_lm", "gpt2", "tinygpt")
BUGS: dict[int, str] = {
    1: "softmax(logits), then cross-entropy",
    2: "every label ignore_index",
    3: "pad positions supervised",
    4: "one batch longer than the position table",
    5: "one batch with a token id >= V",
    6: "one batch with int32 labels / float mask",
    7: "no causal mask",
    8: "padding not masked in attention",
    9: "labels not shifted",
    10: "a submodule left out of the optimizer",
    11: "learning rate 100x too low",
    12: "learning rate 100x too high, no warm-up",
    13: "deep stack without residuals, saturating activations",
    14: "large negative bias before ReLU",
    15: "an activation past the fp16 range under 16-bit AMP",
    16: "DDP without a distributed sampler",
    17: "a parameter changed on one rank",
    18: "one rank much slower",
    19: "a slow dataset __getitem__",
    20: "weight decay on norm weights and biases, strong enough to shrink them",
    21: "model left in eval() during training",
    22: "checkpoint without optimizer / scheduler state",
    23: "NaN on one DDP rank",
    24: "outputs squashed into a bounded range in the forward",
    25: "attention mask = ids != pad_id, pad id a real token",
    26: "labels joined to the wrong samples",
    27: "most computed positions padding",
    28: "position ids constant or missing",
    30: "the squashing of row 24 in training_step",
    31: "the same batch at every step",
    32: "eos never supervised (pad id == eos id)",
    33: "loss-only wrapper over token rows, non-causal stack",
    34: "learning rate far too low, PyTorch's default init",
    35: "no resumable checkpoint (weights-only)",
    36: "a decoder fed its own targets (the labels, unshifted, as its input)",
    37: "gradients clipped by value far below their size",
    38: "a warm-up ten times longer than the run",
    39: "a resume mid-epoch with a DataLoader that cannot restore its position",
    40: "samples mixed across the batch",
    41: "the squashing of row 30 as a soft-cap far too small in training_step, beside the model's own loss",
    47: "one corrupt batch (random ids in two rows) in a healthy run",
    49: "one batch far longer than the rest on a device sized for the usual",
    29: "attention logits without the 1/sqrt(d) scale, q and k of unit variance at init",
    45: "attention logits multiplied by sqrt(d) instead of divided",
    42: "no positional information on an order-dependent task",
    43: "per-sequence classification labels joined to the wrong rows",
    51: "a forward random in eval mode (a functional dropout left on)",
    52: "a causal LM fed the next sample's labels (labels rolled across the batch)",
    44: "label smoothing far too large (0.9 for 0.1)",
    46: "a validation loader that reads the training data",
}
"""Every row of the bug zoo a callback claims."""


def enc(**kw: Any) -> Callable[[], BugEncoderLM]:
    return lambda: BugEncoderLM(**kw)


def gpt2(**kw: Any) -> Callable[[], BugHFLM]:
    return lambda: BugHFLM("gpt2", **kw)


def tiny(**kw: Any) -> Callable[[], BugTinyGPT]:
    return lambda: BugTinyGPT(**kw)


def t5(**kw: Any) -> Callable[[], BugHFLM]:
    return lambda: BugHFLM("t5", **kw)


def seq2seq() -> Any:
    return healthy_data("t5")


def tuples(**kw: Any) -> Callable[[], Any]:
    return lambda: tuple_loader(**kw)


def dicts(**kw: Any) -> Callable[[], Any]:
    return lambda: dict_data(**kw)


def fp16() -> dict[str, Any]:
    return {"plugins": [MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))]}


def saver(**kw: Any) -> Callable[[Path], list]:
    return lambda tmp_path: [ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=4, save_top_k=-1, **kw)]


def row_cases() -> dict[tuple[int, str], Case]:
    """Every (row, family) of the single-process matrix."""
    c: dict[tuple[int, str], Case] = {}
    # 1: softmax in the forward, cross-entropy after it
    for fam, module, data in (
        ("encoder_lm", enc(output_squash="softmax"), tuples()),
        ("gpt2", gpt2(output_squash="softmax"), dicts()),
        ("tinygpt", tiny(softmax_output=True), dicts()),
    ):
        c[1, fam] = Case(module, data, (owner("TFD220", severity="error"),), "forward returns softmax(logits)")
    # 2: every label ignored (data)
    for fam, module, data in (
        ("encoder_lm", enc(), tuples(all_ignored=True)),
        ("gpt2", gpt2(), dicts(all_labels_ignored=True)),
        ("tinygpt", tiny(), dicts(all_labels_ignored=True)),
    ):
        c[2, fam] = Case(
            module, data, (owner("TFD114", "TFD224", severity="error"),), "collator/dataset sets every label to -100"
        )
    # 3: pad positions supervised (collator)
    for fam, module in (("encoder_lm", enc()), ("gpt2", gpt2()), ("tinygpt", tiny())):
        c[3, fam] = Case(module, dicts(pad_labels_supervised=True), (owner("TFD115"),), "collator keeps pad labels")
    # 4, 5: one batch too long / one bad token id (data); the model then fails, ReproCapture writes its bundle
    for row, code, tup, dic, what in (
        (4, "TFD111", dict(long_every=3), dict(long_batch_every=3), "the 3rd batch longer than the position table"),
        (5, "TFD110", dict(bad_token_every=3), dict(bad_token_every=3), "the 3rd batch carries id >= V"),
    ):
        for fam, module, data in (
            ("encoder_lm", enc(), tuples(**tup)),
            ("gpt2", gpt2(), dicts(**dic)),
            ("tinygpt", tiny(), dicts(**dic)),
        ):
            c[row, fam] = Case(
                module,
                data,
                (owner(code, severity="error"), owner("TFD130", severity="info")),
                what,
                steps=5,
                raises=True,
            )
    # 6: dtype drift in one batch (data)
    for fam, module, data in (
        ("encoder_lm", enc(), tuples(int32_every=3)),
        ("gpt2", gpt2(), dicts(dtype_drift_every=3)),
        ("tinygpt", tiny(), dicts(dtype_drift_every=3)),
    ):
        c[6, fam] = Case(
            module, data, (owner("TFD103", severity="error"),), "the 3rd batch has int32 labels", steps=5, raises=None
        )
    # 7: no causal mask (forward)
    for fam, module, data in (
        ("encoder_lm", enc(causal=False), tuples()),
        ("gpt2", gpt2(bidirectional_mask=True), dicts()),
        ("tinygpt", tiny(no_causal_mask=True), dicts()),
    ):
        c[7, fam] = Case(module, data, (owner("TFD201", severity="error"),), "forward attends without the causal mask")
    # 8: padding not masked (forward)
    for fam, module in (
        ("encoder_lm", enc(padding_mask=False)),
        ("gpt2", gpt2(pass_mask=False)),
        ("tinygpt", tiny(no_padding_mask=True)),
    ):
        c[8, fam] = Case(
            module,
            dicts(collator="left_pad"),  # on right padding a causal model's dropped mask is harmless (info)
            (owner("TFD202", "TFD203", "TFD204", severity="error"),),
            "forward drops the padding mask; left-padded batches",
        )
    # 9: labels not shifted (data for the tuple pipeline, the step for the others)
    for fam, module, data, where in (
        ("encoder_lm", enc(), tuples(unshifted=True), "dataset targets = tokens"),
        ("gpt2", gpt2(shift=False), dicts(), "step's loss without the shift"),
        ("tinygpt", tiny(unshifted_labels=True), dicts(), "step's loss without the shift"),
    ):
        c[9, fam] = Case(module, data, (owner("TFD205", "TFD226"),), where)
    # 10: a submodule left out of the optimizer (configure_optimizers)
    for fam, module, data in (
        ("encoder_lm", enc(left_out="out."), tuples()),
        ("gpt2", gpt2(left_out="model.transformer.h.1."), dicts()),
        ("tinygpt", tiny(head_not_in_optimizer=True), dicts()),
    ):
        c[10, fam] = Case(
            module, data, (owner("TFD312", "TFD320", severity="error"),), "configure_optimizers leaves it out", steps=12
        )
    # 11: learning rate 100x too low (configuration)
    for fam, module, data in (
        ("encoder_lm", enc(lr=2e-5), tuples()),
        ("gpt2", gpt2(lr=2e-5), dicts()),
        ("tinygpt", tiny(lr=2e-5), dicts()),
    ):
        c[11, fam] = Case(module, data, (owner("TFD310"),), "lr 2e-5 (100x below 2e-3)", steps=45)
    # 12: learning rate 100x too high, no warm-up (configuration)
    for fam, module, data in (
        ("encoder_lm", enc(lr=0.2, warmup_steps=0), tuples()),
        ("gpt2", gpt2(lr=0.2, warmup_steps=0), dicts()),
        ("tinygpt", tiny(lr=0.2, warmup_steps=0), dicts()),
    ):
        c[12, fam] = Case(
            module, data, (owner("TFD301", "TFD311", "TFD313"),), "lr 0.2 (100x above 2e-3), no warm-up", steps=31
        )
    # 13: a deep stack without residuals, saturating activations (model structure)
    for fam, module, data, where in (
        ("encoder_lm", enc(deep_head=8), tuples(), "8 sigmoid layers without residuals before the output layer"),
        ("gpt2", gpt2(deep_head=8), dicts(), "8 sigmoid layers without residuals before the LM head"),
        ("tinygpt", tiny(n_layers=8, no_residual=True, activation="sigmoid"), dicts(), "8 blocks, no residuals"),
    ):
        c[13, fam] = Case(module, data, (owner("TFD302"),), where, steps=40)
    # 14: large negative bias before ReLU (initialisation)
    for fam, module, data in (
        ("encoder_lm", enc(dead_bias=-20.0), tuples()),
        ("gpt2", gpt2(activation="relu", mlp_bias_init=-20.0), dicts()),
        ("tinygpt", tiny(activation="relu", mlp_bias_init=-5.0), dicts()),
    ):
        c[14, fam] = Case(module, data, (owner("TFD340", "TFD341"),), "MLP input bias initialised negative", steps=30)
    # 15: an activation past the fp16 range under 16-bit AMP with a GradScaler. ScalerWatch sees the skipped steps on
    # every family; where the forward itself overflows (not only the gradients), NaNFirstFrame names the module.
    scaler = owner("TFD411", "TFD412")
    for fam, module, data, expect in (
        (
            "encoder_lm",
            enc(overflow_module="encoder.layers.0.linear1"),
            tuples(),
            (scaler, owner("TFD401", severity="error")),
        ),
        ("gpt2", gpt2(overflow_module="model.transformer.h.0.mlp.c_fc"), dicts(), (scaler,)),
        (
            "tinygpt",
            tiny(d_model=64, overflow_module="blocks.0.mlp.fc"),
            dicts(),
            (scaler, owner("TFD401", severity="error")),
        ),
    ):
        c[15, fam] = Case(module, data, expect, "first MLP layer's output x 1e5, 16-mixed", steps=12, trainer=fp16())
    # 19: a slow __getitem__ (data)
    for fam, module, data in (
        ("encoder_lm", enc(), tuples(slow_s=0.005)),
        ("gpt2", gpt2(), dicts(slow_getitem_s=0.01)),
        ("tinygpt", tiny(), dicts(slow_getitem_s=0.01)),
    ):
        c[19, fam] = Case(module, data, (owner("TFD601"),), "dataset sleeps in __getitem__", steps=45)
    # 20: weight decay on every parameter, norms and biases included (configure_optimizers), strong enough to shrink
    # the norm gains measurably (the registry makes TFD324 a warning only then; coupled L2 in Adam, TFD326, is info)
    for fam, module, data in (
        ("encoder_lm", enc(decay_all=2.0), tuples()),
        ("gpt2", gpt2(decay_all=2.0), dicts()),
        ("tinygpt", tiny(decay_norms=True, weight_decay=2.0), dicts()),
    ):
        c[20, fam] = Case(module, data, (owner("TFD324"),), "AdamW(model.parameters(), weight_decay=2.0)", steps=60)
    # 21: the module in eval mode during training (a hook)
    for fam, module, data in (
        ("encoder_lm", enc(eval_mode=True), tuples()),
        ("gpt2", gpt2(eval_mode=True), dicts()),
        ("tinygpt", tiny(eval_mode=True), dicts()),
    ):
        c[21, fam] = Case(module, data, (owner("TFD327", severity="error"),), "on_train_epoch_start calls self.eval()")
    # 22: checkpoints without optimizer / scheduler state (on_save_checkpoint)
    for fam, module, data in (
        ("encoder_lm", enc(drop_optimizer_state=True), tuples()),
        ("gpt2", gpt2(drop_optimizer_state=True), dicts()),
        ("tinygpt", tiny(drop_optimizer_state=True), dicts()),
    ):
        c[22, fam] = Case(
            module,
            data,
            (owner("TFD703", "TFD705", severity="error"),),
            "on_save_checkpoint pops the optimizer and scheduler state",
            steps=5,
            trainer={"enable_checkpointing": True},
            callbacks=saver(),
        )
    # 24: outputs squashed in the forward
    for fam, module, data, what in (
        ("encoder_lm", enc(output_squash="sigmoid"), tuples(), "sigmoid"),
        ("gpt2", gpt2(output_squash="tanh"), dicts(), "tanh"),
        ("tinygpt", tiny(output_squash="clamp"), dicts(), "clamp(-1, 1)"),
    ):
        c[24, fam] = Case(module, data, (owner("TFD230"),), f"forward returns {what}(logits)", steps=AFTER_CHECK)
    # 25: attention mask built as ids != pad_id, pad id a real token (collator)
    for fam, module in (("encoder_lm", enc()), ("gpt2", gpt2()), ("tinygpt", tiny())):
        c[25, fam] = Case(
            module,
            dicts(collator="pad_is_real"),
            (owner("TFD122"),),
            "collator: mask = ids != pad_id, pad id = the space byte",
        )
    # 26: labels joined to the wrong samples (collator)
    for fam, module in (("encoder_lm", enc()), ("gpt2", gpt2()), ("tinygpt", tiny())):
        c[26, fam] = Case(
            module,
            dicts(collator="wrong_labels"),
            (owner("TFD231"),),
            "collator rolls the labels by one sample",
            steps=AFTER_CHECK,
        )
    # 27: most positions padding (collator pads to the full context)
    for fam, module in (("encoder_lm", enc()), ("gpt2", gpt2()), ("tinygpt", tiny())):
        c[27, fam] = Case(
            module,
            dicts(collator="max_length"),
            (owner("TFD602"),),
            "collator pads 8-token documents to 64",
            steps=45,
        )
    # 28: position ids constant or missing (forward)
    for fam, module, data, where in (
        ("encoder_lm", enc(positions=False), tuples(), "forward adds no position table"),
        ("gpt2", gpt2(constant_positions=True), dicts(), "forward passes position_ids of zeros"),
        ("tinygpt", tiny(constant_positions=True), dicts(), "forward uses position 0 everywhere"),
    ):
        c[28, fam] = Case(module, data, (owner("TFD216"),), where, steps=3)
    # 30: the squashing of row 24 in training_step
    for fam, module, data, what in (
        ("encoder_lm", enc(step_squash="sigmoid"), tuples(), "sigmoid"),
        ("gpt2", gpt2(step_squash="tanh"), dicts(), "tanh"),
        ("tinygpt", tiny(step_squash="sigmoid"), dicts(), "sigmoid"),
    ):
        c[30, fam] = Case(
            module, data, (owner("TFD233"),), f"training_step applies {what} before the loss", steps=AFTER_CHECK
        )
    # 31: the same batch at every step
    for fam, module, data, trainer, where in (
        ("encoder_lm", enc(), tuples(), {"limit_train_batches": 1}, "Trainer(limit_train_batches=1), no shuffle"),
        ("gpt2", gpt2(), dicts(same_index=True), {}, "dataset __getitem__ ignores its index"),
        ("tinygpt", tiny(), dicts(), {"overfit_batches": 1}, "Trainer(overfit_batches=1) left on"),
    ):
        c[31, fam] = Case(module, data, (owner("TFD121", "TFD123"),), where, steps=20, trainer=trainer)
    # 32: eos never supervised (collator pads with eos and masks labels equal to the pad id)
    for fam, module in (("encoder_lm", enc()), ("gpt2", gpt2()), ("tinygpt", tiny())):
        c[32, fam] = Case(
            module, dicts(collator="eos_pad"), (owner("TFD124"),), "collator: pad = eos, labels == pad masked", steps=12
        )
    # 33: a loss-only wrapper over token rows, built with a non-causal stack
    for fam, where in (
        ("encoder_lm", "wrapper over nn.TransformerEncoder without a mask"),
        ("gpt2", "wrapper over transformers.BertLMHeadModel(is_decoder=False)"),
        ("tinygpt", "wrapper over TinyGPT(no_causal_mask=True)"),
    ):
        c[33, fam] = Case(lambda fam=fam: TokenRowLM(fam), token_rows, (owner("TFD201", severity="error"),), where)
    # 34: learning rate far too low on PyTorch's default initialisation
    for fam, module, data in (
        ("encoder_lm", enc(lr=1e-8, layers=3), tuples()),
        ("gpt2", lambda: BugHFLM("llama", lr=1e-8, default_init=True), dicts()),
        ("tinygpt", tiny(lr=1e-8, pytorch_init=True), dicts()),
    ):
        c[34, fam] = Case(module, data, (owner("TFD310"),), "lr 1e-8, PyTorch's default init", steps=60)
    # 35: every checkpoint weights-only (ModelCheckpoint configuration)
    for fam, module, data in (("encoder_lm", enc(), tuples()), ("gpt2", gpt2(), dicts()), ("tinygpt", tiny(), dicts())):
        c[35, fam] = Case(
            module,
            data,
            (owner("TFD709"),),
            "ModelCheckpoint(save_weights_only=True)",
            steps=5,
            trainer={"enable_checkpointing": True},
            callbacks=saver(save_weights_only=True),
        )
    # 36: a decoder fed its own targets (the step); on a decoder-only model, row 9's labels not shifted
    for fam, module, loader, where in (
        ("t5", lambda: BugSeq2SeqLM("t5"), lambda: healthy_data("t5"), "step passes decoder_input_ids=labels"),
        ("bart", lambda: BugSeq2SeqLM("bart"), lambda: healthy_data("bart"), "step passes decoder_input_ids=labels"),
        ("gpt2", gpt2(shift=False), dicts(), "step's loss without the shift"),
    ):
        c[36, fam] = Case(module, loader, (owner("TFD214", "TFD205", severity="error"),), where)
    # 40: samples mixed across the batch (forward)
    for fam, module, where in (
        ("encoder_lm", enc(batch_norm=True), "BatchNorm1d over the flattened batch's token features"),
        ("gpt2", gpt2(mixed_reshape=True), "first block's output reshaped from its transpose"),
        ("tinygpt", tiny(batch_axis_attention=True), "first block's attention over the batch axis"),
    ):
        c[40, fam] = Case(module, dicts(), (owner("TFD217", severity="error"),), where)
    # 39: resumed from a checkpoint saved mid-epoch; the plain DataLoader restarts the epoch from its first batch
    for fam, module, data, where in (
        ("encoder_lm", enc(), tuples(), "checkpoint at batch 10 of 16, plain DataLoader in a fixed order"),
        (
            "gpt2",
            lambda: HFLM("t5"),
            lambda: in_order_loader("t5"),
            "T5: checkpoint at batch 8 of 12, plain DataLoader",
        ),
        ("tinygpt", tiny(), lambda: in_order_loader("tinygpt"), "checkpoint at batch 8 of 12, plain DataLoader"),
    ):
        at = 10 if fam == "encoder_lm" else 8
        c[39, fam] = Case(module, data, (owner("TFD125"),), where, steps=at + 2, resume_at=at)
    # 41: a Gemma-style soft-cap c * tanh(logits / c), c = 0.75, in training_step; Llama's ModelOutput also carries
    # the model's own loss of the raw logits
    cap = "training_step returns the loss of 0.75 * tanh(logits / 0.75)"
    llama = lambda: BugHFLM("llama", step_squash="softcap", model_loss=True)  # noqa: E731
    for fam, module, data, where in (
        ("encoder_lm", enc(step_squash="softcap"), tuples(), cap),
        ("gpt2", llama, dicts(), f"Llama(labels=...); {cap}"),
        ("tinygpt", tiny(step_squash="softcap"), dicts(), cap),
        ("t5", t5(step_squash="softcap", model_loss=True, shift=False), seq2seq, f"T5(labels=...); {cap}"),
    ):
        c[41, fam] = Case(module, data, (owner("TFD233"),), where, steps=AFTER_CHECK)
    # 37: SGD with momentum whose every gradient Lightning clips by value far below its elements' size
    clip = {"gradient_clip_val": 1e-4, "gradient_clip_algorithm": "value"}
    for fam, module, data in (
        ("encoder_lm", enc(lr=0.1, sgd_momentum=0.9), tuples()),
        ("gpt2", gpt2(lr=0.1, sgd_momentum=0.9), dicts()),
        ("t5", t5(lr=0.1, sgd_momentum=0.9), seq2seq),
    ):
        placement = "Trainer(gradient_clip_val=1e-4, gradient_clip_algorithm='value'), SGD(lr=0.1, momentum=0.9)"
        c[37, fam] = Case(module, data, (owner("TFD306"),), placement, steps=31, trainer=clip)
    # 38: a linear warm-up of 500 steps in a 50-step run (configure_optimizers)
    for fam, module, data in (
        ("encoder_lm", enc(warmup_steps=500), tuples()),
        ("gpt2", gpt2(warmup_steps=500), dicts()),
        ("t5", t5(warmup_steps=500), seq2seq),
    ):
        c[38, fam] = Case(module, data, (owner("TFD337"),), "LambdaLR warm-up of 500 steps, max_steps=50", steps=50)
    # 49: the sixth batch four times the usual length, on a device sized for twice the usual (a forward pre-hook)
    for fam, module in (
        ("encoder_lm", enc(memory_positions=256)),
        ("gpt2", gpt2(memory_positions=256)),
        ("tinygpt", tiny(memory_positions=256)),
    ):
        place = "collator: the 6th batch 4x the usual length; forward raises OutOfMemoryError over 2x the usual"
        c[49, fam] = Case(
            module, dicts(collator="one_long"), (owner("TFD621", severity="error"),), place, 8, raises=True
        )
    # 47: two rows of one batch turned into random ids at step 80 (a callback at the batch's start); flagged at that
    # step, naming those rows
    for fam, module, data in (("encoder_lm", enc(), tuples()), ("gpt2", gpt2(), dicts()), ("tinygpt", tiny(), dicts())):
        c[47, fam] = Case(
            module,
            data,
            (SpikeAt(("TFD530",), "warning", step=80, rows=(2, 5)),),
            "callback: rows 2 and 5 of the batch of step 80 become random ids",
            steps=84,
            callbacks=lambda tmp_path: [CorruptBatch(80, (2, 5))],
        )
    # 29 and 45: the attention scale, read at step 0 (AttentionProbe) on hand-written and eager HF attention, d = 64
    scaled = {
        (29, "tinygpt"): (lambda: HandAttentionGPT("none", unit_qk=True), "hand-written attention, no scale"),
        (29, "gpt2"): (lambda: HFAttentionLM("gpt2", "none", unit_qk=True), "GPT-2 `scale_attn_weights=False`"),
        (29, "llama"): (lambda: HFAttentionLM("llama", "none", unit_qk=True), "Llama attention `scaling = 1`"),
        (45, "tinygpt"): (lambda: HandAttentionGPT("multiply"), "hand-written attention `* sqrt(d)`"),
        (45, "tinygpt_unit_qk"): (lambda: HandAttentionGPT("multiply", unit_qk=True), "the same, unit-variance q, k"),
        (45, "llama"): (lambda: HFAttentionLM("llama", "multiply"), "Llama attention `scaling = sqrt(d)`"),
    }
    for (row, fam), (module, place) in scaled.items():
        c[row, fam] = Case(module, dicts(), (owner("TFD240"),), place, steps=2)
    kind_rows(c)
    # 30, 41 and 44 inside a preflight's 50 steps (issue 44): the floor a bound or a smoothing sets, an error
    floor = owner("TFD236", severity="error")
    for fam, module, data, what in (
        ("encoder_lm_preflight", enc(step_squash="sigmoid"), tuples(), "sigmoid"),
        ("llama_preflight", lambda: BugHFLM("llama", step_squash="tanh"), dicts(), "tanh (a soft-cap of 1)"),
        ("tinygpt_preflight", tiny(step_squash="tanh"), dicts(), "tanh (a soft-cap of 1)"),
    ):
        c[30, fam] = Case(module, data, (owner("TFD233"), floor), f"training_step applies {what}", steps=PREFLIGHT)
    for fam, module, data, where in (
        ("gemma2_forward", lambda: Gemma2LM(softcap=1.0), lambda: healthy_data("gemma"), "Gemma 2 config: cap 1.0"),
        ("encoder_lm_forward", enc(output_squash="tanh"), tuples(), "forward returns tanh(logits): a cap of 1"),
        ("tinygpt_forward", tiny(output_squash="tanh"), dicts(), "forward returns tanh(logits): a cap of 1"),
    ):
        c[41, fam] = Case(module, data, (floor,), where, steps=PREFLIGHT)
    smoothed = "CrossEntropyLoss(label_smoothing=0.9) in training_step"
    for fam, module, data in (
        ("encoder_lm", lambda: SmoothedEncoderLM(0.9), tuples()),
        ("gpt2", lambda: SmoothedHFLM("gpt2", 0.9), dicts()),
        ("tinygpt", lambda: SmoothedTinyGPT(0.9), dicts()),
    ):
        c[44, fam] = Case(module, data, (owner("TFD237"), floor), smoothed, steps=PREFLIGHT)
    # 46: val_dataloader a new DataLoader over the training dataset (in order, 2 batches): the sanity check's rows are
    # training rows read later; the bundled corpus cut to 200 documents so that 30 steps read most of it
    for fam, module, data in (
        ("encoder_lm", enc(), tuples()),
        ("gpt2", gpt2(), dicts(n_documents=200)),
        ("tinygpt", tiny(), dicts(n_documents=200)),
    ):
        place = "val_dataloader: a DataLoader over the training dataset (limit_val_batches=2)"
        leak = owner("TFD126", severity="error")
        c[46, fam] = Case(module, leaky(data), (leak,), place, steps=30, trainer={"limit_val_batches": 2})
    return c


PENDING_CODES: set[str] = set()
"""Expectations that issue 43's probes bring and the pack cannot meet yet: a code the pack does not raise on these
families yet (none at present), or a
registered code at a severity it does not reach yet (``code:severity``; none at present). A case that expects one is a
strict xfail: when the probes land, it passes and fails as XPASS; then remove the entry."""
PENDING_OWNERS: dict[str, str] = {}  # the owner of a pending code the rule registry does not hold yet


@dataclass(frozen=True)
class Pending(Expect):
    """An expectation on a code not registered yet (its owner named here, not read from the registry)."""

    source: str = "MaskProbe"

    def met_by(self, finding: Any) -> bool:
        ours = finding.code in self.codes and finding.source == self.source
        return ours and SEVERITIES.index(finding.severity) >= SEVERITIES.index(self.severity)

    def __str__(self) -> str:
        return f"{'/'.join(f'{self.source} {c}' for c in self.codes)} at {self.severity} or above"


def expect(code: str, severity: str = "warning") -> Expect:
    """``code`` from its owner at ``severity``: :func:`owner` once registered, :class:`Pending` until then."""
    return owner(code, severity=severity) if code in RULES else Pending((code,), severity, PENDING_OWNERS[code])


def pending(case: Case) -> list[str]:
    """The entries of :data:`PENDING_CODES` that ``case`` expects."""
    keys = [k for e in case.expect for c in e.codes for k in (c, f"{c}:{e.severity}")]
    return [k for k in keys if k in PENDING_CODES]


def kind_rows(c: dict[tuple[int, str], Case]) -> None:
    """Issue 43: the bugs on transformers that do not read token ids (``tests/kind_models.py``), and a causal LM's
    labels from the next sample."""
    # 51: a forward random in eval mode: F.dropout(h, p) with `training` at its default True
    for fam, where in (("float_encoder", "after the input layer"), ("vit", "on the patch embeddings")):
        c[51, fam] = Case(
            kind_module(fam, eval_dropout=0.1), kind_loader(fam), (expect("TFD213"),), f"F.dropout(h, 0.1) {where}"
        )
    # 42: no positional information on an order-dependent task
    for fam, where in (
        ("float_encoder", "forward adds no position table; label = (symbol + position) mod 16"),
        ("bert_cls", "forward passes position_ids of zeros; class = the quarter holding a marker token"),
    ):
        c[42, fam] = Case(
            kind_module(fam, positions=False), kind_loader(fam), (expect("TFD215"),), where, steps=AFTER_CHECK
        )
    # 43: per-sequence labels joined to the wrong rows: the loss stays at ln C
    for fam in ("vit", "bert_cls"):
        c[43, fam] = Case(
            kind_module(fam),
            kind_loader(fam, wrong_rows=True),
            (expect("TFD231", severity="error"),),
            "collate rolls the labels by one row",
            steps=AFTER_CHECK,
        )
    # 52: a causal LM fed the next sample's labels, flagged by MaskProbe's label alignment within 80 steps
    for fam, module in (("tinygpt", tiny()), ("gpt2", gpt2())):
        c[52, fam] = Case(
            module,
            dicts(collator="wrong_labels"),
            (owner("TFD205", "TFD206", "TFD210", severity="warning"),),
            "collator rolls the labels by one sample",
            steps=80,
        )
    # 36 on an nn.Transformer whose call takes decoder ids, decoder mask and keyword labels (one length)
    c[36, "seq2seq_reverse"] = Case(
        kind_module("seq2seq_reverse", leak=True),
        kind_loader("seq2seq_reverse"),
        (owner("TFD214", "TFD205", severity="error"),),
        "nn.Transformer; step passes decoder_input_ids=labels",
    )


@dataclass(frozen=True)
class SpikeAt(Expect):
    """Row 47: the spike finding at ``step``, naming ``rows``."""

    step: int = 0
    rows: tuple[int, ...] = ()

    def met_by(self, finding: Any) -> bool:
        named = sorted(finding.evidence.get("rows") or [])
        return super().met_by(finding) and finding.step == self.step and named == sorted(self.rows)


CASES = row_cases()

KNOWN_MISSES: dict[tuple[int, str], str] = {}
"""Cases where the owner misses the bug today: ``(row, family) -> what it saw`` (xfail, not strict)."""


def run_case(tmp_path: Path, case: Case) -> tuple[list, BaseException | None]:
    """Fit the buggy run with the whole pack at its defaults; return the pack and the exception the bug raised."""
    pack = the_pack_at_defaults()
    kwargs = {"max_steps": case.steps, "log_every_n_steps": 10, **case.trainer}
    trainer = make_trainer(tmp_path, pack + case.callbacks(tmp_path), **kwargs)
    error, ckpt_path = None, None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if case.resume_at:
            saver = ModelCheckpoint(dirpath=tmp_path / "first", every_n_train_steps=case.resume_at, save_last=True)
            first = make_trainer(tmp_path / "first", [saver], max_steps=case.resume_at, enable_checkpointing=True)
            first.fit(case.module(), case.data())
            ckpt_path = str(tmp_path / "first" / "last.ckpt")
        try:
            trainer.fit(case.module(), case.data(), ckpt_path=ckpt_path)
        except Exception as err:  # the bug's own failure, after the pack has spoken
            if case.raises is False:
                raise
            error = err
    for finding in (f for c in pack for f in c.findings):  # every finding is a registered rule's, from its owner
        assert RULES[finding.code].source == finding.source, finding.format()
    return pack, error


def cases():
    for row, family in CASES:
        marks = [pytest.mark.slow]
        waiting = pending(CASES[row, family])
        if waiting:
            marks.append(pytest.mark.xfail(strict=True, reason=f"pending: {', '.join(waiting)} (PENDING_CODES)"))
        elif (row, family) in KNOWN_MISSES:
            marks.append(pytest.mark.xfail(strict=False, reason=KNOWN_MISSES[row, family]))
        yield pytest.param(row, family, marks=marks, id=f"row{row}-{family}")


@pytest.mark.parametrize("row, family", list(cases()))
def test_the_owner_flags_the_bug(tmp_path, row, family):
    case = CASES[row, family]
    pack, error = run_case(tmp_path, case)
    found = [f for c in pack for f in c.findings]
    said = [f"{f.code} {f.severity} {f.source}: {f.message}" for f in found]
    record(f"row{row}-{family}", found)
    for expect in case.expect:
        assert any(expect.met_by(f) for f in found), f"row {row} on {family}: expected {expect}; the pack said {said}"
    if case.raises is True:
        assert error is not None, "the bug was expected to end the run"


def record(case: str, found: list[Any]) -> None:
    """With ``TFD_BUG_REPORT=<file>``, append every finding of a case (code, severity, step) to that file as JSON lines:
    two runs' files compared show whether a change moved any finding of the matrix."""
    path = os.environ.get("TFD_BUG_REPORT")
    if path:
        with open(path, "a") as f:
            for finding in found:
                row = {"case": case, "code": finding.code, "severity": finding.severity, "step": finding.step}
                f.write(json.dumps(row) + "\n")


CONTROLS: dict[str, tuple[Callable[[], Any], Callable[[], Any]]] = {
    "encoder_lm_dict_batches": (enc(), dicts()),
    "token_rows_encoder_lm_causal": (lambda: TokenRowLM("encoder_lm", causal=True), token_rows),
    "token_rows_bert_decoder": (lambda: TokenRowLM("gpt2", causal=True), token_rows),
    "token_rows_tinygpt_causal": (lambda: TokenRowLM("tinygpt", causal=True), token_rows),
}
"""The variants this module adds to the healthy matrix's families, without their bug."""


@pytest.mark.slow
@pytest.mark.parametrize("control", sorted(CONTROLS))
def test_the_variants_without_their_bug_are_silent(tmp_path, control):
    module, data = CONTROLS[control]
    pack, _ = run_case(tmp_path, Case(module, data, (), "healthy", steps=AFTER_CHECK))
    record(f"control-{control}", [f for c in pack for f in c.findings])
    assert [f.format() for c in pack for f in c.findings if f.severity in ("warning", "error")] == []


# ------------------------------------------------------------------------------------------------------------ DDP
DDP_MODELS = {
    "encoder_lm": ("tests.bug_models:BugEncoderLM", {}),
    "gpt2": ("tests.bug_models:BugHFLM", {"family": "gpt2"}),
    "tinygpt": ("tests.bug_models:BugTinyGPT", {}),
}
PERTURBED = {"encoder_lm": "out.bias", "gpt2": "model.transformer.ln_f.weight"}
NAN_MODULE = {"encoder_lm": "encoder.layers.1.linear1", "gpt2": "model.transformer.h.1.mlp.c_fc"}
NAN_MODULE["tinygpt"] = "blocks.1.mlp.fc"


def ddp_case(row: int, family: str) -> tuple[dict[str, Any], dict[str, Any], Expect, str]:
    """Model kwargs, Trainer kwargs, the expectation on every rank, and the placement of row ``row``."""
    if row == 16:
        return {}, {"use_distributed_sampler": False}, owner("TFD501"), "Trainer(use_distributed_sampler=False)"
    if row == 17:
        if family == "tinygpt":
            model = {"perturb_rank": 1, "perturb_at_step": 3}
        else:
            model = {"perturb_rank": 1, "perturb_at_step": 3, "perturb_param": PERTURBED[family]}
        return model, {}, owner("TFD502", severity="error"), "training_step changes a weight on rank 1 at step 3"
    if row == 18:
        return {"slow_rank": 1, "slow_rank_s": 0.2}, {}, owner("TFD503"), "training_step sleeps 0.2 s on rank 1"
    if row == 23:
        model = {"nan_module": NAN_MODULE[family], "nan_module_rank": 1, "nan_at_step": 3}
        return model, {}, owner("TFD401", severity="error"), "an MLP layer's output turns NaN on rank 1 at step 3"
    raise ValueError(row)


DDP_ROWS = (16, 17, 18, 23)
DDP_STEPS = 8


@pytest.mark.slow
@pytest.mark.ddp
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("row", DDP_ROWS)
def test_the_owner_flags_the_bug_under_ddp(tmp_path, row, family):
    if (row, family) in KNOWN_MISSES:
        pytest.xfail(KNOWN_MISSES[row, family])
    model_class, model = DDP_MODELS[family]
    extra_model, trainer, expect, _ = ddp_case(row, family)
    spec = {
        "strategy": "ddp",
        "model_class": model_class,
        "model": {**model, **extra_model},
        "data": {"batch_size": 8},
        "trainer": {"max_steps": DDP_STEPS, "log_every_n_steps": 1, **trainer},
        "callbacks": [{"class_path": f"lightning_tfdebug.{name}"} for name in PACK_NAMES],
    }
    results = run_distributed(tmp_path, spec, timeout=300)
    for result in results:  # every rank reaches the owner's finding
        found = [f for findings in result["findings"].values() for f in findings]
        record(f"ddp-row{row}-{family}-rank{result['rank']}", [Finding(**f) for f in found])
        said = [f"{f['code']} {f['severity']} {f['source']}: {f['message']}" for f in found]
        assert any(expect.met_by(Finding(**f)) for f in found), (
            f"rank {result['rank']}: expected {expect}; the pack said {said}"
        )
        if row == 23:  # the report names the rank and the module, and no rank hangs
            [nan] = [f for f in found if f["code"] == "TFD401"]
            assert 1 in nan["evidence"].get("ranks", [nan["evidence"].get("rank")]), nan
            assert NAN_MODULE[family] in str(nan["evidence"]), nan


# ------------------------------------------------------------------------------------------------------- the docs
def matrix_table() -> str:
    """The table of ``docs/bug-matrix.md``: one line per row, the placement on each family and the expectation."""
    lines = [
        "| row | bug | placement per family | expected (owner, code, least severity) |",
        "| --- | --- | --- | --- |",
    ]
    for row, bug in BUGS.items():
        if row in DDP_ROWS:
            cells = [(family, ddp_case(row, family)[3]) for family in FAMILIES]
            expect = [ddp_case(row, FAMILIES[0])[2]]
        else:
            cells = [(family, case.placement) for (r, family), case in CASES.items() if r == row]
            expect = list(CASES[row, cells[0][0]].expect)
        if len({p for _, p in cells}) == 1:
            names = [family for family, _ in cells]
            placement = f"{'all' if names == list(FAMILIES) else ', '.join(names)}: {cells[0][1]}"
        else:
            placement = "<br>".join(f"{family}: {p}" for family, p in cells)
        misses = [family for family, _ in cells if (row, family) in KNOWN_MISSES]
        note = f" (missed today on {', '.join(misses)})" if misses else ""
        waiting = [family for family, _ in cells if (row, family) in CASES and pending(CASES[row, family])]
        note += f" (pending on {', '.join(waiting)}: `PENDING_CODES`)" if waiting else ""
        lines.append(f"| {row} | {bug} | {placement} | {'; '.join(str(e) for e in expect)}{note} |")
    return "\n".join(lines) + "\n"


def test_the_docs_table_is_in_step_with_the_cases():
    text = (Path(__file__).resolve().parents[1] / "docs" / "bug-matrix.md").read_text()
    start, end = "<!-- bug-matrix -->\n", "<!-- /bug-matrix -->"
    assert start in text and end in text
    assert text.split(start, 1)[1].split(end, 1)[0] == matrix_table(), (
        "docs/bug-matrix.md is out of step: paste `python -c 'from tests.test_bug_matrix import matrix_table; "
        'print(matrix_table(), end="")\'` between its markers'
    )
