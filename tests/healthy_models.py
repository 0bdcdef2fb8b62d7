"""Healthy training runs of six model families, built from tiny configs (nothing downloaded), for the healthy matrix
(``tests/test_healthy_matrix.py``) and the detectors' controls.

Families: the bundled TinyGPT, a causal LM on ``torch.nn.TransformerEncoder`` fed tuple batches, and Hugging Face
GPT-2, Llama, BERT (masked LM) and T5 (encoder-decoder). Every model trains with AdamW and a step-wise schedule
(``warmup_steps`` linear warm-up, then constant; 0 is a constant learning rate), and each family comes with its own
healthy data: right-padded text with ``-100`` on padding for the causal LMs, BERT's 15% masking recipe on padded
rows, source/target halves for T5. Fine-tuning starts from weights trained first in the test (:func:`pretrain`);
LoRA adapters come from ``peft`` (:func:`with_lora`).
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_tfdebug.demo import ByteTokenizer, TinyGPT, TinyTextDataModule
from lightning_tfdebug.demo.data import TextDataset, generate_corpus

VOCAB = ByteTokenizer.vocab_size
PAD = ByteTokenizer.pad_id
MLM_MASK_ID = VOCAB  # BERT gets one more row for its mask token
FAMILIES: tuple[str, ...] = ("tinygpt", "encoder_lm", "gpt2", "llama", "bert_mlm", "t5")
HF_FAMILIES: tuple[str, ...] = ("gpt2", "llama", "bert_mlm", "t5", "bart", "t5_copy", "gemma")
SEQ2SEQ_FAMILIES: tuple[str, ...] = ("bart", "t5_copy")
"""Encoder-decoder runs beside ``t5`` (not in :data:`FAMILIES`), each taught to reproduce its input (BART's own
pretraining objective, without the noise): the labels are the input ids, shifted into the decoder by the model."""
EXTRA_FAMILIES: tuple[str, ...] = ("mlm_padpos", "tinygpt_nomask")
"""Healthy designs the pack once flagged, run in one setting each: a masked LM whose positions count the real tokens
(:class:`PadPositionMLM`), and a causal LM that ignores its mask on right-padded batches."""
KIND_FAMILIES: tuple[str, ...] = ("float_encoder", "vit", "bert_cls", "seq2seq_reverse", "set_max")
"""Transformers that do not read token ids or return per-token logits (``tests/kind_models.py``, issue 43): a float
one-hot encoder, a ViT on patches, a BERT sequence classifier, an ``nn.Transformer`` whose call takes decoder ids, mask
and labels, and an order-blind set model; each with its own data and learning rate."""
GEMMA_INIT = 0.01
"""The Gemma family's ``initializer_range``: half its default, weights small enough to grow 2x in 50 steps."""

PACK_NAMES: tuple[str, ...] = (
    "BatchGuard",
    "CheckpointAudit",
    "DeadActivation",
    "GradNormMonitor",
    "LossAtInit",
    "MaskProbe",
    "NaNFirstFrame",
    "OptimizerAudit",
    "PerRankLogger",
    "ReproCapture",
    "ScalerWatch",
    "StallWatchdog",
    "ThroughputMonitor",
    "UpdateRatio",
    "MemoryWatch",
    "SpikeGuard",
    "AttentionProbe",
)
"""Every callback of ``lightning_tfdebug.__all__``."""


def the_pack_at_defaults() -> list[pl.Callback]:
    """Every callback of the pack with every argument at its default, as a new user adds them."""
    import lightning_tfdebug as tfd

    return [getattr(tfd, name)() for name in PACK_NAMES]


def adamw_with_warmup(module: nn.Module, lr: float, warmup_steps: int) -> dict:
    """AdamW without decay on norms, biases and embeddings; a linear warm-up over ``warmup_steps`` (0: none), then
    constant."""
    named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]

    def decays(n: str, p: torch.Tensor) -> bool:
        return p.ndim >= 2 and not any(k in n for k in ("emb", "wte", "wpe", "shared", "lora_"))

    optimizer = torch.optim.AdamW(
        [
            {"params": [p for n, p in named if decays(n, p)], "weight_decay": 0.1},
            {"params": [p for n, p in named if not decays(n, p)], "weight_decay": 0.0},
        ],
        lr=lr,
    )
    warm = max(1, warmup_steps)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / warm))
    return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


# ---------------------------------------------------------------------------------------------------------- models
class HealthyTinyGPT(TinyGPT):
    """The bundled TinyGPT at the tests' small size; its own AdamW and warm-up schedule. ``ignore_mask``: its forward
    ignores the attention mask, as nanoGPT-style models do (healthy on right-padded batches)."""

    def __init__(self, lr: float = 2e-3, warmup_steps: int = 10, ignore_mask: bool = False) -> None:
        super().__init__(
            d_model=32, n_layers=2, n_heads=2, lr=lr, warmup_steps=warmup_steps, no_padding_mask=ignore_mask
        )


class EncoderLM(pl.LightningModule):
    """A causal LM on ``nn.TransformerEncoder``: ``batch = (tokens, targets)``, targets shifted by the data, no mask."""

    def __init__(self, lr: float = 2e-3, warmup_steps: int = 10, context: int = 32) -> None:
        super().__init__()
        self.lr, self.warmup_steps, self.context = lr, warmup_steps, context
        self.embed = nn.Embedding(VOCAB, 32)
        self.pos = nn.Parameter(torch.zeros(context, 32))
        layer = nn.TransformerEncoderLayer(32, 2, 64, dropout=0.0, activation="relu", batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.out = nn.Linear(32, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        t = tokens.shape[1]
        mask = nn.Transformer.generate_square_subsequent_mask(t)
        return self.out(self.encoder(self.embed(tokens) + self.pos[:t], mask=mask, is_causal=True))

    def training_step(self, batch, batch_idx):
        tokens, targets = batch
        logits = self(tokens)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
        self.log("loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):  # runs only where a case gives a validation loader
        tokens, targets = batch
        logits = self(tokens)
        self.log("val_loss", F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1).long()))

    def configure_optimizers(self):
        return adamw_with_warmup(self, self.lr, self.warmup_steps)


class PadPositionMLM(pl.LightningModule):
    """A BERT-style masked LM whose position ids count the real tokens (``input_ids != pad``, as RoBERTa's do): a
    position table, a bidirectional encoder that honours the attention mask, and no tokenizer or config naming a
    special id."""

    def __init__(self, lr: float = 2e-3, warmup_steps: int = 10, context: int = 64) -> None:
        super().__init__()
        self.lr, self.warmup_steps = lr, warmup_steps
        self.embed = nn.Embedding(VOCAB + 1, 32)
        self.position_embeddings = nn.Embedding(context, 32)
        layer = nn.TransformerEncoderLayer(32, 2, 64, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.out = nn.Linear(32, VOCAB + 1)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        real = input_ids != PAD
        positions = (real.long().cumsum(1) - 1).clamp_min(0) * real
        h = self.embed(input_ids) + self.position_embeddings(positions)
        padding = None if attention_mask is None else attention_mask == 0
        return self.out(self.encoder(h, src_key_padding_mask=padding))

    def training_step(self, batch, batch_idx):
        logits = self(batch["input_ids"], batch["attention_mask"])
        loss = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten())
        self.log("loss", loss)
        return loss

    def configure_optimizers(self):
        return adamw_with_warmup(self, self.lr, self.warmup_steps)


def hf_model(family: str) -> nn.Module:
    """A freshly initialised Hugging Face model of ``family`` from a tiny config."""
    import transformers

    if family == "gpt2":
        config = transformers.GPT2Config(
            n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=64, attn_implementation="eager"
        )
        return transformers.GPT2LMHeadModel(config)
    if family == "llama":
        config = transformers.LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=64,
        )
        return transformers.LlamaForCausalLM(config)
    if family == "bert_mlm":
        config = transformers.BertConfig(
            vocab_size=VOCAB + 1,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            max_position_embeddings=64,
            pad_token_id=PAD,
        )
        return transformers.BertForMaskedLM(config)
    if family == "gemma":  # small init: its weight norms double early while the loss falls (issue 38)
        config = transformers.GemmaConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=8,
            max_position_embeddings=64,
            initializer_range=GEMMA_INIT,
        )
        return transformers.GemmaForCausalLM(config)
    if family == "bart":
        config = transformers.BartConfig(
            vocab_size=VOCAB,
            d_model=32,
            encoder_layers=2,
            decoder_layers=2,
            encoder_attention_heads=2,
            decoder_attention_heads=2,
            encoder_ffn_dim=64,
            decoder_ffn_dim=64,
            max_position_embeddings=64,
            pad_token_id=0,
            decoder_start_token_id=0,
        )
        return transformers.BartForConditionalGeneration(config)
    if family in ("t5", "t5_copy"):
        config = transformers.T5Config(
            vocab_size=VOCAB, d_model=32, d_kv=16, d_ff=64, num_layers=2, num_heads=2, decoder_start_token_id=0
        )
        return transformers.T5ForConditionalGeneration(config)
    raise ValueError(f"`family` must be one of {HF_FAMILIES}; got {family!r}.")


class HFLM(pl.LightningModule):
    """A Hugging Face model of ``family`` trained on dict batches; the model computes its own loss."""

    def __init__(self, family: str = "gpt2", lr: float = 2e-3, warmup_steps: int = 10) -> None:
        super().__init__()
        self.family, self.lr, self.warmup_steps = family, lr, warmup_steps
        self.model = hf_model(family)

    def forward(self, **batch):
        return self.model(**batch)

    def training_step(self, batch, batch_idx):
        loss = self(**batch).loss
        self.log("loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):  # runs only where a case gives a validation loader
        self.log("val_loss", self(**batch).loss)

    def configure_optimizers(self):
        return adamw_with_warmup(self, self.lr, self.warmup_steps)


LORA_TARGETS: dict[str, list[str]] = {
    "tinygpt": ["qkv", "proj", "fc"],
    "encoder_lm": ["linear1", "linear2"],
    "gpt2": ["c_attn", "c_proj", "c_fc"],
    "llama": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    "bert_mlm": ["query", "key", "value", "dense"],
    "t5": ["q", "k", "v", "o", "wi", "wo"],
    "t5_copy": ["q", "k", "v", "o", "wi", "wo"],
    "bart": ["q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2"],
}


def build(family: str, lr: float = 2e-3, warmup_steps: int = 10) -> pl.LightningModule:
    """A fresh healthy module of ``family`` (a family of :data:`KIND_FAMILIES` at its own learning rate)."""
    if family in KIND_FAMILIES:
        from tests.kind_models import build_kind

        return build_kind(family, warmup_steps=warmup_steps)
    if family == "tinygpt":
        return HealthyTinyGPT(lr=lr, warmup_steps=warmup_steps)
    if family == "encoder_lm":
        return EncoderLM(lr=lr, warmup_steps=warmup_steps)
    if family in EXTRA_FAMILIES:
        return PadPositionMLM(lr, warmup_steps) if family == "mlm_padpos" else HealthyTinyGPT(lr, warmup_steps, True)
    return HFLM(family, lr=lr, warmup_steps=warmup_steps)


def with_lora(module: pl.LightningModule, family: str, rank: int = 8) -> pl.LightningModule:
    """Freeze ``module`` and add LoRA adapters (``peft``) to its attention and MLP projections."""
    from peft import LoraConfig, get_peft_model, inject_adapter_in_model

    config = LoraConfig(
        r=rank, lora_alpha=2 * rank, lora_dropout=0.0, target_modules=LORA_TARGETS[family], fan_in_fan_out=False
    )
    if isinstance(module, HFLM):
        if family == "gpt2":
            config.fan_in_fan_out = True  # GPT-2's Conv1D stores weights transposed
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            module.model = get_peft_model(module.model, config)
        return module
    inject_adapter_in_model(config, module)
    for name, p in module.named_parameters():
        p.requires_grad_("lora_" in name)
    return module


# ------------------------------------------------------------------------------------------------------------ data
def periodic_text(rows: int = 256, length: int = 33, seed: int = 0) -> torch.Tensor:
    """Rows of a repeating byte pattern with a random phase: learnable, so losses fall from ln(V)."""
    g = torch.Generator().manual_seed(seed)
    pattern = torch.tensor(list(b"the quick brown fox jumps over the lazy dog. "))
    start = torch.randint(0, len(pattern), (rows, 1), generator=g)
    return pattern[(start + torch.arange(length)) % len(pattern)]


def _documents(max_length: int = 48) -> TextDataset:
    return TextDataset(generate_corpus(1000, seed=1), ByteTokenizer(), max_length)


def _right_pad(rows: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(r)
        mask[i, : len(r)] = 1
    return ids, mask


def mlm_collate(rows: list[list[int]]) -> dict[str, torch.Tensor]:
    """BERT's recipe on right-padded rows: 15% of the real positions supervised, 80% of those replaced by the mask
    token, 10% by a random token; padding neither masked nor supervised."""
    ids, mask = _right_pad(rows, PAD)
    draw = torch.rand(ids.shape)
    chosen = (draw < 0.15) & (mask == 1)
    labels = torch.where(chosen, ids, torch.full_like(ids, -100))
    inputs = torch.where(chosen & (draw < 0.12), torch.full_like(ids, MLM_MASK_ID), ids)
    random = chosen & (draw >= 0.12) & (draw < 0.135)
    inputs = torch.where(random, torch.randint(0, 256, ids.shape), inputs)
    return {"input_ids": inputs, "attention_mask": mask, "labels": labels}


def seq2seq_collate(rows: list[list[int]]) -> dict[str, torch.Tensor]:
    """The first half of each document is the source, the second half the target (T5 pads with id 0)."""
    sources, mask = _right_pad([r[: len(r) // 2] for r in rows], 0)
    targets, target_mask = _right_pad([r[len(r) // 2 :] for r in rows], 0)
    labels = targets.masked_fill(target_mask == 0, -100)
    return {"input_ids": sources, "attention_mask": mask, "labels": labels}


def copy_collate(rows: list[list[int]]) -> dict[str, torch.Tensor]:
    """Each document is both the source and the target: the labels are the input ids (padding -100)."""
    ids, mask = _right_pad(rows, 0)
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def data(family: str, batch_size: int = 8) -> Any:
    """The healthy data of ``family``: a DataModule or a DataLoader (a family of :data:`KIND_FAMILIES`: its own)."""
    if family in KIND_FAMILIES:
        from tests.kind_models import kind_data

        return kind_data(family)
    if family in ("tinygpt", "gpt2", "llama", "tinygpt_nomask", "gemma"):
        return TinyTextDataModule(batch_size=batch_size)
    if family == "encoder_lm":
        text = periodic_text()
        return DataLoader(TensorDataset(text[:, :-1], text[:, 1:]), batch_size=2 * batch_size, shuffle=True)
    masked_lm = family in ("bert_mlm", "mlm_padpos")
    copying = family in ("t5_copy", "bart")
    collate = mlm_collate if masked_lm else copy_collate if copying else seq2seq_collate
    batch = 2 * batch_size if masked_lm else batch_size
    return DataLoader(_documents(), batch_size=batch, shuffle=True, collate_fn=collate, drop_last=True)


# ------------------------------------------------------------------------------------------------------- pretraining
def quiet_fit(tmp_path: Path, module: pl.LightningModule, family: str, steps: int, **trainer: Any) -> pl.Trainer:
    """Fit without callbacks or loggers (the part of a test that is not under observation)."""
    kwargs: dict[str, Any] = dict(
        accelerator="cpu",
        devices=1,
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        default_root_dir=tmp_path,
    )
    kwargs.update(trainer)
    fitted = pl.Trainer(**kwargs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fitted.fit(module, data(family))
    return fitted


def pretrain(tmp_path: Path, family: str, steps: int = 60) -> dict[str, torch.Tensor]:
    """Weights of ``family`` trained for ``steps`` steps: the "pretrained" checkpoint a fine-tune starts from."""
    module = build(family)
    quiet_fit(tmp_path / "pretrain", module, family, steps)
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


# -------------------------------------------------------------------------------------------- a validation split
class DocumentSplit(pl.LightningDataModule):
    """The masked LM's documents split once, by document, before batching: 100 held out for validation, the rest for
    training (natural duplicates of short documents across the split stay, as in real data)."""

    def __init__(self, batch_size: int = 16) -> None:
        super().__init__()
        docs = _documents()
        self.batch_size, self.val_set = batch_size, torch.utils.data.Subset(docs, range(100))
        self.train_set = torch.utils.data.Subset(docs, range(100, len(docs)))

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_set, self.batch_size, shuffle=True, collate_fn=mlm_collate, drop_last=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, self.batch_size, collate_fn=mlm_collate)


def split_data(family: str, batch_size: int = 8) -> Any:
    """``family``'s healthy data with a held-out validation split (the bundled DataModule's, or :class:`DocumentSplit`
    for the masked LM)."""
    if family in ("bert_mlm", "mlm_padpos"):
        return DocumentSplit(2 * batch_size)
    return TinyTextDataModule(batch_size=batch_size)
