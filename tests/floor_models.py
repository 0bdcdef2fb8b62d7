"""Loss floors for the bug and healthy matrices (issue 44): label smoothing in ``training_step`` on the bug matrix's
families, and a Hugging Face Gemma 2 whose final-logit soft-cap lives in the model's forward (its config), from a tiny
config (nothing downloaded). Healthy counterparts: label smoothing 0.1, Gemma's own soft-cap of 30."""

from __future__ import annotations

from typing import Any

import torch.nn.functional as F
from torch import Tensor

from lightning_tfdebug.demo.data import IGNORE_INDEX
from tests.bug_models import BugEncoderLM, BugHFLM, BugTinyGPT
from tests.healthy_models import GEMMA_INIT, HFLM, VOCAB


def smoothed_loss(logits: Tensor, labels: Tensor, eps: float, shift: bool = True) -> Tensor:
    """``CrossEntropyLoss(label_smoothing=eps)`` of position t against label t+1 (t when ``shift`` is False)."""
    if shift:
        logits, labels = logits[:, :-1], labels[:, 1:]
    flat = logits.reshape(-1, logits.shape[-1])
    return F.cross_entropy(flat, labels.reshape(-1).long(), ignore_index=IGNORE_INDEX, label_smoothing=eps)


class SmoothedEncoderLM(BugEncoderLM):
    """The encoder LM whose step smooths the labels by ``eps`` (tuple batches: targets shifted by the data)."""

    def __init__(self, eps: float, **kw: Any) -> None:
        super().__init__(**kw)
        self.eps = eps

    def training_step(self, batch, batch_idx):
        tokens, targets = batch
        loss = smoothed_loss(self(tokens), targets, self.eps, shift=False)
        self.log("loss", loss)
        return loss


class SmoothedHFLM(BugHFLM):
    """A Hugging Face causal LM (``gpt2``, ``llama``) whose step computes its logits' loss, smoothed by ``eps``."""

    def __init__(self, family: str, eps: float, **kw: Any) -> None:
        super().__init__(family, **kw)
        self.eps = eps

    def training_step(self, batch, batch_idx):
        logits = self.model(input_ids=batch["input_ids"], attention_mask=batch.get("attention_mask")).logits
        loss = smoothed_loss(logits, batch["labels"], self.eps)
        self.log("loss", loss)
        return loss


class SmoothedTinyGPT(BugTinyGPT):
    """TinyGPT whose step smooths the labels by ``eps``."""

    def __init__(self, eps: float, **flags: Any) -> None:
        super().__init__(**flags)
        self.eps = eps

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        loss = smoothed_loss(self(batch["input_ids"], batch.get("attention_mask")), batch["labels"], self.eps)
        self.log("train/loss", loss)
        return loss


def gemma2(final_logit_softcapping: float | None) -> Any:
    """A freshly initialised Hugging Face Gemma 2 from a tiny config, with its final-logit soft-cap."""
    import transformers

    config = transformers.Gemma2Config(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=8,
        max_position_embeddings=64,
        initializer_range=GEMMA_INIT,
        final_logit_softcapping=final_logit_softcapping,
        attn_implementation="eager",
    )
    return transformers.Gemma2ForCausalLM(config)


class Gemma2LM(HFLM):
    """Gemma 2 trained on dict batches with its own loss; ``softcap``: its config's ``final_logit_softcapping``."""

    def __init__(self, softcap: float | None = 30.0, lr: float = 2e-3, warmup_steps: int = 10) -> None:
        super().__init__("gemma", lr=lr, warmup_steps=warmup_steps)
        self.model = gemma2(softcap)
