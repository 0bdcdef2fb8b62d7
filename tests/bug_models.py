"""Bug-zoo injections for the bug matrix (``tests/test_bug_matrix.py``), placed where users place them.

Three model families, built on the healthy matrix's builders (``tests/healthy_models.py``):

* ``encoder_lm``: a causal LM on ``nn.TransformerEncoder`` with PyTorch's default initialisation (embeddings
  N(0, 1), Kaiming-uniform linears): :class:`BugEncoderLM`. It reads the healthy matrix's tuple batches
  ``(tokens, targets)`` and also the padded dict batches of the bundled data (the rows that need padding);
* ``gpt2``: Hugging Face GPT-2 from a tiny config (:class:`BugHFLM`; Llama for the rows about PyTorch's default
  initialisation, BERT's LM head for the encoder-as-decoder wrapper of row 33);
* ``tinygpt``: the bundled TinyGPT (:class:`BugTinyGPT`: its own bug flags plus the bugs it has no flag for).

Where a bug lives: the model's ``forward`` (softmax or squashed outputs, no causal mask, no padding mask, constant
positions), the training step (squashing before the loss, labels not shifted), the data pipeline (collators and
datasets of :func:`bug_data`), the configuration (optimizer, learning rate, Trainer flags, checkpoint callbacks) or
the model's structure (dead biases, an overflowing module, a deep stack without residuals), and for DDP one rank's
code (:class:`RankBugs`).
"""

from __future__ import annotations

import time
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

from lightning_tfdebug.demo import ByteTokenizer, TinyGPT, TinyTextDataModule
from lightning_tfdebug.demo.data import IGNORE_INDEX, Collator, TextDataset, generate_corpus
from tests.healthy_models import (
    HFLM,
    PAD,
    VOCAB,
    EncoderLM,
    adamw_with_warmup,
    hf_model,
    periodic_text,
    seq2seq_collate,
)

FAMILIES: tuple[str, ...] = ("encoder_lm", "gpt2", "tinygpt")
EOS = ByteTokenizer.eos_id


# --------------------------------------------------------------------------------------------- shared injections
def squash(logits: Tensor, kind: str | None) -> Tensor:
    """Bounded outputs (rows 24, 30, 40): ``sigmoid`` (width 1), ``tanh`` (``c * tanh(logits / c)``, c = 1: width 2),
    ``softcap`` (a Gemma-style soft-cap far too small, c = 0.75: width 1.5), ``clamp`` (to [-1, 1]); ``softmax``
    (row 1); None leaves the logits alone."""
    if kind is None:
        return logits
    if kind == "softmax":
        return logits.softmax(-1)
    if kind == "sigmoid":
        return logits.sigmoid()
    if kind == "tanh":
        return torch.tanh(logits)
    if kind == "softcap":
        return 0.75 * torch.tanh(logits / 0.75)
    if kind == "clamp":
        return logits.clamp(-1.0, 1.0)
    raise ValueError(f"unknown squash {kind!r}")


def next_token_loss(logits: Tensor, labels: Tensor, shift: bool = True) -> Tensor:
    """Cross-entropy of position t against label t+1 (or label t when ``shift`` is False: row 9)."""
    if shift:
        logits, labels = logits[:, :-1], labels[:, 1:]
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1).long(), ignore_index=IGNORE_INDEX)


class _Scale:
    """A forward hook that multiplies a module's output (row 15: an activation pushed past the fp16 range)."""

    def __init__(self, factor: float) -> None:
        self.factor = factor

    def __call__(self, module: nn.Module, args: Any, output: Tensor) -> Tensor:
        return output * self.factor


class _MemoryLimit:
    """A forward pre-hook (row 49): the forward of a batch with more token positions than the device was sized for
    raises ``torch.OutOfMemoryError``, as the allocator would."""

    def __init__(self, positions: int) -> None:
        self.positions = positions

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        if isinstance(ids, Tensor) and ids.numel() > self.positions:
            raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate {ids.numel() * 2**21} bytes.")


def default_init(module: nn.Module) -> None:
    """Re-initialise every submodule with PyTorch's own ``reset_parameters`` (row 34's default initialisation)."""
    for sub in module.modules():
        if sub is not module and hasattr(sub, "reset_parameters"):
            sub.reset_parameters()


def deep_sigmoid_stack(depth: int, width: int = 32) -> nn.Sequential:
    """Row 13: ``depth`` sigmoid layers without residual connections (a saturating deep stack)."""
    return nn.Sequential(*(m for _ in range(depth) for m in (nn.Linear(width, width), nn.Sigmoid())))


class RankBugs:
    """Bugs in one rank's code, and the configuration bugs every family shares; mixed into the family modules.

    ``bugs`` keys: ``perturb_rank``/``perturb_at_step``/``perturb_param`` (row 17), ``slow_rank``/``slow_rank_s``
    (row 18), ``nan_module``/``nan_module_rank``/``nan_at_step`` (row 23), ``overflow_module`` (row 15),
    ``eval_mode`` (row 21), ``drop_optimizer_state`` (row 22), ``left_out`` (a parameter-name prefix left out of the
    optimizer: row 10), ``decay_all`` (AdamW with this decay on every parameter: row 20), ``adam_l2`` (Adam with
    this coupled weight decay), ``default_init`` (row 34), ``sgd_momentum`` (SGD with this momentum at a constant
    LR: row 37), ``memory_positions`` (the token positions a forward may take before it raises
    ``torch.OutOfMemoryError``, as a device sized for the usual batch would: row 49).
    """

    bugs: dict[str, Any]

    def install_bugs(self, bugs: dict[str, Any]) -> None:
        self.bugs = dict(bugs)
        modules = dict(self.named_modules())
        if bugs.get("default_init"):
            default_init(self)
        if bugs.get("overflow_module"):
            modules[bugs["overflow_module"]].register_forward_hook(_Scale(1e5))
        if bugs.get("nan_module"):
            modules[bugs["nan_module"]].register_forward_hook(self._nan_hook)
        if bugs.get("memory_positions"):
            self.register_forward_pre_hook(_MemoryLimit(bugs["memory_positions"]), with_kwargs=True)

    def _nan_hook(self, module: nn.Module, args: Any, output: Any) -> Any:
        trainer = self._trainer
        if trainer is None or not self.training or trainer.global_step < self.bugs.get("nan_at_step", 0):
            return output
        rank = self.bugs.get("nan_module_rank")
        if rank is not None and trainer.global_rank != rank:
            return output
        if isinstance(output, tuple):
            return (output[0] * float("nan"), *output[1:])
        return output * float("nan")

    def rank_step_bugs(self) -> None:
        """Called first in ``training_step``: a slow rank, a weight changed on one rank."""
        step, rank = self.trainer.global_step, self.trainer.global_rank
        if self.bugs.get("slow_rank") == rank:
            time.sleep(self.bugs.get("slow_rank_s", 0.2))
        if self.bugs.get("perturb_rank") == rank and step == self.bugs.get("perturb_at_step", 3):
            with torch.no_grad():
                dict(self.named_parameters())[self.bugs["perturb_param"]].add_(0.5)

    def on_train_epoch_start(self) -> None:
        if self.bugs.get("eval_mode"):
            self.eval()

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        if self.bugs.get("drop_optimizer_state"):
            checkpoint.pop("optimizer_states", None)
            checkpoint.pop("lr_schedulers", None)

    def configure_optimizers(self):
        if self.bugs.get("decay_all"):  # what many recipes do: one group, decay on norms and biases too
            optimizer = torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=self.bugs["decay_all"])
            warm = max(1, self.warmup_steps)
            schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / warm))
            return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}
        if self.bugs.get("sgd_momentum"):
            return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=self.bugs["sgd_momentum"])
        if self.bugs.get("adam_l2"):
            return torch.optim.Adam(self.parameters(), lr=self.lr, weight_decay=self.bugs["adam_l2"])
        config = adamw_with_warmup(self, self.lr, self.warmup_steps)
        left_out = self.bugs.get("left_out")
        if left_out:  # the parameters under this prefix are dropped from every group
            excluded = {id(p) for name, p in self.named_parameters() if name.startswith(left_out)}
            for group in config["optimizer"].param_groups:
                group["params"] = [p for p in group["params"] if id(p) not in excluded]
        return config


# ------------------------------------------------------------------------------------------------------ encoder_lm
class BugEncoderLM(RankBugs, EncoderLM):
    """The healthy matrix's ``nn.TransformerEncoder`` causal LM (PyTorch's default initialisation), with the bugs
    placed in its forward and step. Tuple batches ``(tokens, targets)`` (targets shifted by the data) or dict batches
    ``{input_ids, attention_mask, labels}`` (labels shifted here; padding masked with ``src_key_padding_mask``).

    Args:
        causal: the causal mask in the forward (False: row 7).
        padding_mask: the key padding mask in the forward (False: row 8).
        positions: add the position table (False: row 28).
        output_squash: applied to the logits in the forward (``softmax``: row 1; ``sigmoid``/``tanh``: row 24).
        step_squash: applied to the logits in ``training_step`` (row 30).
        shift: shift dict labels by one (False: row 9).
        dead_bias: constant initial bias of every ReLU's input layer (row 14).
        deep_head: this many sigmoid layers without residuals between the encoder and the output layer (row 13).
        layers: encoder layers.
        batch_norm: a ``BatchNorm1d`` over the token features of the flattened batch, on batch statistics in eval
            mode too (row 40).
        bugs: :class:`RankBugs` keys.
    """

    def __init__(
        self,
        lr: float = 2e-3,
        warmup_steps: int = 10,
        context: int = 64,
        causal: bool = True,
        padding_mask: bool = True,
        positions: bool = True,
        output_squash: str | None = None,
        step_squash: str | None = None,
        shift: bool = True,
        dead_bias: float | None = None,
        deep_head: int = 0,
        layers: int = 2,
        batch_norm: bool = False,
        **bugs: Any,
    ) -> None:
        super().__init__(lr=lr, warmup_steps=warmup_steps, context=context)
        self.norm = nn.BatchNorm1d(32, track_running_stats=False) if batch_norm else None
        self.deep = deep_sigmoid_stack(deep_head) if deep_head else None
        if layers != 2:
            layer = nn.TransformerEncoderLayer(32, 2, 64, dropout=0.0, activation="relu", batch_first=True)
            self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.causal, self.padding_mask, self.positions = causal, padding_mask, positions
        self.output_squash, self.step_squash, self.shift = output_squash, step_squash, shift
        if dead_bias is not None:
            for block in self.encoder.layers:
                nn.init.constant_(block.linear1.bias, dead_bias)  # every pre-ReLU value negative: dead units
        self.install_bugs(bugs)

    def forward(self, tokens: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        t = tokens.shape[1]
        h = self.embed(tokens)
        if self.positions:
            h = h + self.pos[:t]
        if self.norm is not None:
            h = self.norm(h.flatten(0, 1)).view_as(h)
        mask = nn.Transformer.generate_square_subsequent_mask(t) if self.causal else None
        padding = None
        if attention_mask is not None and self.padding_mask:
            padding = attention_mask == 0
        h = self.encoder(h, mask=mask, src_key_padding_mask=padding, is_causal=self.causal)
        if self.deep is not None:
            h = self.deep(h)
        return squash(self.out(h), self.output_squash)

    def training_step(self, batch, batch_idx):
        self.rank_step_bugs()
        if isinstance(batch, dict):
            logits = squash(self(batch["input_ids"], batch.get("attention_mask")), self.step_squash)
            loss = next_token_loss(logits, batch["labels"], shift=self.shift)
        else:
            tokens, targets = batch
            logits = squash(self(tokens), self.step_squash)
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1).long())
        self.log("loss", loss)
        return loss


# ------------------------------------------------------------------------------------------------ Hugging Face
class BugHFLM(RankBugs, HFLM):
    """A Hugging Face causal LM (GPT-2 by default) with the bugs placed in the LightningModule around it.

    Args:
        family: ``gpt2`` or ``llama`` (tiny configs of ``tests/healthy_models.hf_model``).
        output_squash: applied to the logits in ``forward`` (row 1, 24); the step then computes the loss.
        step_squash: applied to the logits in ``training_step`` before the loss (rows 30, 41).
        model_loss: the step calls the model with the labels (its ``ModelOutput`` carries its own loss) and returns
            the loss of the ``step_squash``-ed logits instead (row 41).
        shift: False computes the loss in the step without the shift Hugging Face does inside the model (row 9).
        pass_mask: False drops the attention mask from the model call (row 8).
        bidirectional_mask: the forward builds a 4-D mask from the padding mask alone, which replaces the model's
            causal mask (row 7).
        constant_positions: the forward passes ``position_ids`` of zeros (row 28).
        activation: GPT-2's MLP activation (``relu`` for row 14).
        mlp_bias_init: constant initial bias of every MLP input layer (row 14).
        deep_head: this many sigmoid layers without residuals between the body and the LM head (row 13).
        mixed_reshape: the first block's output ``(b, t, d)`` read back through ``transpose(0, 1).reshape(b, t, d)``
            (row 40).
        bugs: :class:`RankBugs` keys.
    """

    def __init__(
        self,
        family: str = "gpt2",
        lr: float = 2e-3,
        warmup_steps: int = 10,
        output_squash: str | None = None,
        step_squash: str | None = None,
        model_loss: bool = False,
        shift: bool = True,
        pass_mask: bool = True,
        bidirectional_mask: bool = False,
        constant_positions: bool = False,
        activation: str | None = None,
        mlp_bias_init: float | None = None,
        deep_head: int = 0,
        mixed_reshape: bool = False,
        **bugs: Any,
    ) -> None:
        pl.LightningModule.__init__(self)
        self.family, self.lr, self.warmup_steps = family, lr, warmup_steps
        self.model = hf_model(family)
        self.deep = deep_sigmoid_stack(deep_head) if deep_head else None
        if activation is not None:
            self.model.config.activation_function = activation
            from transformers.activations import ACT2FN

            for block in self.model.transformer.h:
                block.mlp.act = ACT2FN[activation]
        if mlp_bias_init is not None:
            for block in self.model.transformer.h:
                nn.init.constant_(block.mlp.c_fc.bias, mlp_bias_init)
        self.output_squash, self.step_squash, self.shift = output_squash, step_squash, shift
        self.model_loss = model_loss
        self.pass_mask, self.bidirectional_mask = pass_mask, bidirectional_mask
        self.constant_positions = constant_positions
        if mixed_reshape:
            self.model.transformer.h[0].register_forward_hook(_mixed_reshape)
        self.install_bugs(bugs)

    @property
    def _loss_in_step(self) -> bool:
        return self.output_squash is not None or self.step_squash is not None or not self.shift or self.deep is not None

    def forward(self, input_ids, attention_mask=None, labels=None):
        kwargs: dict[str, Any] = {}
        if self.constant_positions:
            kwargs["position_ids"] = torch.zeros_like(input_ids)
        if not self.pass_mask:
            attention_mask = None
        elif self.bidirectional_mask:
            if attention_mask is None:
                attention_mask = torch.ones_like(input_ids)
            t = input_ids.shape[1]
            attention_mask = attention_mask.bool()[:, None, None, :].expand(-1, 1, t, t)
        if self.deep is not None:
            hidden = self.model.base_model(input_ids=input_ids, attention_mask=attention_mask, **kwargs)[0]
            return self.model.lm_head(self.deep(hidden))
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, labels=labels, **kwargs)
        if self.output_squash is not None:
            return squash(out.logits, self.output_squash)
        return out

    def training_step(self, batch, batch_idx):
        self.rank_step_bugs()
        if self.model_loss:  # the model computes its own loss; the step trains another one
            loss = next_token_loss(squash(self(**batch).logits, self.step_squash), batch["labels"], shift=self.shift)
        elif self._loss_in_step:
            out = self(batch["input_ids"], batch.get("attention_mask"))
            logits = out if isinstance(out, Tensor) else out.logits
            loss = next_token_loss(squash(logits, self.step_squash), batch["labels"], shift=self.shift)
        else:
            loss = self(**batch).loss
        self.log("loss", loss)
        return loss


class BugSeq2SeqLM(HFLM):
    """A Hugging Face encoder-decoder (``t5`` or ``bart``) whose step passes the labels, unshifted, as
    ``decoder_input_ids`` (row 36): the decoder sees at position t the token it must predict there."""

    def training_step(self, batch, batch_idx):
        labels = batch["labels"]
        loss = self.model(**batch, decoder_input_ids=labels.masked_fill(labels == IGNORE_INDEX, 0)).loss
        self.log("loss", loss)
        return loss


def _mixed_reshape(module: nn.Module, args: Any, out: Any) -> Any:
    """Row 37: a block's hidden states ``(b, t, d)`` reshaped from their transpose, which mixes the samples."""
    hidden = out[0] if isinstance(out, tuple) else out
    mixed = hidden.transpose(0, 1).reshape(hidden.shape)
    return (mixed, *out[1:]) if isinstance(out, tuple) else mixed


# ------------------------------------------------------------------------------------------------------- TinyGPT
class BugTinyGPT(TinyGPT):
    """The bundled TinyGPT at the tests' small size, with its own bug flags (``lightning_tfdebug.demo.model``) and
    the bugs it has no flag for.

    Args:
        output_squash: applied to the logits in ``forward`` (row 24).
        step_squash: applied to the logits in ``training_step`` before the loss (row 30).
        constant_positions: the forward adds position 0 everywhere (row 28).
        pytorch_init: PyTorch's default initialisation instead of GPT-style std 0.02 (row 34).
        batch_axis_attention: the first block's attention runs over the batch axis (its input transposed, row 40).
        memory_positions: the forward raises ``torch.OutOfMemoryError`` above this many token positions (row 49).
        flags: TinyGPT's own arguments and bug flags.
    """

    def __init__(
        self,
        output_squash: str | None = None,
        step_squash: str | None = None,
        constant_positions: bool = False,
        pytorch_init: bool = False,
        batch_axis_attention: bool = False,
        memory_positions: int | None = None,
        **flags: Any,
    ) -> None:
        flags = {"d_model": 32, "n_layers": 2, "n_heads": 2, "lr": 2e-3, "warmup_steps": 10, **flags}
        super().__init__(**flags)
        self.output_squash, self.step_squash, self.constant_positions = output_squash, step_squash, constant_positions
        if pytorch_init:
            default_init(self)
        if batch_axis_attention:
            attention = self.blocks[0].attn
            attention.register_forward_pre_hook(lambda module, args: (args[0].transpose(0, 1), None))
            attention.register_forward_hook(lambda module, args, out: out.transpose(0, 1))
        if memory_positions:
            self.register_forward_pre_hook(_MemoryLimit(memory_positions), with_kwargs=True)

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        if not self.constant_positions:
            return squash(super().forward(input_ids, attention_mask), self.output_squash)
        pos = torch.zeros(input_ids.shape[1], dtype=torch.long, device=input_ids.device)
        x = self.tok_emb(input_ids) + self.pos_emb(pos)
        for block in self.blocks:
            x = block(x, attention_mask)
        return squash(self.head(self.ln_f(x)), self.output_squash)

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        if self.step_squash is None:
            return super().training_step(batch, batch_idx)
        logits = squash(self(batch["input_ids"], batch.get("attention_mask")), self.step_squash)
        loss = self.loss(logits, batch["labels"])
        self.log("train/loss", loss)
        return loss


# ------------------------------------------------------------------------ row 33: loss-only wrappers on token rows
class _TupleOut(nn.Module):
    """An inner network that returns ``(logits, cache)``, as many libraries' do."""

    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net

    def forward(self, ids: Tensor) -> tuple[Tensor, None]:
        out = self.net(input_ids=ids) if not isinstance(self.net, pl.LightningModule) else self.net(ids)
        return (out if isinstance(out, Tensor) else out.logits), None


class EncoderStack(nn.Module):
    """A library's "encoder" stack (no causal mask) with the constructor of its decoder stack; default init."""

    def __init__(self, causal: bool = False, context: int = 64) -> None:
        super().__init__()
        self.causal = causal
        self.embed = nn.Embedding(VOCAB, 32)
        self.pos = nn.Parameter(torch.zeros(context, 32))
        layer = nn.TransformerEncoderLayer(32, 2, 64, dropout=0.0, activation="relu", batch_first=True)
        self.layers = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.out = nn.Linear(32, VOCAB)

    def forward(self, input_ids: Tensor) -> Tensor:
        t = input_ids.shape[1]
        mask = nn.Transformer.generate_square_subsequent_mask(t) if self.causal else None
        return self.out(self.layers(self.embed(input_ids) + self.pos[:t], mask=mask, is_causal=self.causal))


class ShiftingLossWrapper(nn.Module):
    """A library's loss-only wrapper: takes token rows ``(B, T+1)``, shifts them itself, returns only the loss."""

    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = _TupleOut(net)

    def forward(self, rows: Tensor) -> Tensor:
        x, y = rows[:, :-1], rows[:, 1:]
        logits, _ = self.net(x)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def inner_network(family: str, causal: bool = False) -> nn.Module:
    """Row 33's inner stack: non-causal unless ``causal``."""
    if family == "encoder_lm":
        return EncoderStack(causal=causal)
    if family == "tinygpt":
        return TinyGPT(d_model=32, n_layers=2, n_heads=2, no_causal_mask=not causal)
    if family == "gpt2":  # the library's BERT LM head: an encoder unless told it is a decoder
        import transformers

        config = transformers.BertConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            max_position_embeddings=64,
            is_decoder=causal,
        )
        return transformers.BertLMHeadModel(config)
    raise ValueError(family)


class TokenRowLM(pl.LightningModule):
    """``training_step`` returns ``self.model(batch)``: a loss-only wrapper over a bare tensor of token rows."""

    def __init__(self, family: str = "encoder_lm", causal: bool = False, lr: float = 2e-3) -> None:
        super().__init__()
        self.lr = lr
        self.model = ShiftingLossWrapper(inner_network(family, causal))

    def training_step(self, batch, batch_idx):
        loss = self.model(batch)
        self.log("loss", loss)
        return loss

    def configure_optimizers(self):
        return adamw_with_warmup(self, self.lr, 10)


def token_rows(batch_size: int = 16) -> DataLoader:
    """Bare integer tensors of token rows ``(B, 33)``."""
    return DataLoader(periodic_text(), batch_size=batch_size, shuffle=True)


# ----------------------------------------------------------------------------------------------------------- data
class TupleText(Dataset):
    """The encoder LM's tuple pipeline ``(tokens, targets)`` over periodic text, with its bugs.

    Args:
        all_ignored: every target is ``-100`` (row 2).
        long_every / bad_token_every / int32_every: the k-th, 2k-th ... batch of ``batch_size`` rows is longer than
            the context (row 4), carries a token id >= V (row 5), or int32 targets (row 6).
        unshifted: targets equal the tokens (row 9).
        slow_s: sleep per ``__getitem__`` (row 19).
        same_index: ``__getitem__`` ignores its index (row 31).
    """

    def __init__(
        self,
        batch_size: int = 16,
        all_ignored: bool = False,
        long_every: int = 0,
        bad_token_every: int = 0,
        int32_every: int = 0,
        unshifted: bool = False,
        slow_s: float = 0.0,
        same_index: bool = False,
    ) -> None:
        self.text = periodic_text(length=33)
        self.long = periodic_text(length=81, seed=1)
        self.batch_size = batch_size
        self.all_ignored, self.long_every, self.bad_token_every = all_ignored, long_every, bad_token_every
        self.int32_every, self.unshifted, self.slow_s, self.same_index = int32_every, unshifted, slow_s, same_index

    def __len__(self) -> int:
        return len(self.text)

    def batch(self, i: int) -> list[tuple[Tensor, Tensor]]:
        rows = range(i * self.batch_size, (i + 1) * self.batch_size)
        k = i + 1  # the k-th batch
        every = lambda n: n > 0 and k % n == 0  # noqa: E731
        source = self.long if every(self.long_every) else self.text
        out = []
        for r in rows:
            row = source[0 if self.same_index else r % len(source)]
            if self.slow_s:
                time.sleep(self.slow_s)
            tokens, targets = row[:-1].clone(), (row[:-1] if self.unshifted else row[1:]).clone()
            if every(self.bad_token_every):
                tokens[1] = VOCAB + 3
            if self.all_ignored:
                targets.fill_(IGNORE_INDEX)
            if every(self.int32_every):
                targets = targets.to(torch.int32)
            out.append((tokens, targets))
        return out


class _BatchIndex(Dataset):
    def __init__(self, text: TupleText) -> None:
        self.text = text

    def __len__(self) -> int:
        return len(self.text) // self.text.batch_size

    def __getitem__(self, i: int):
        rows = self.text.batch(i)
        return torch.stack([t for t, _ in rows]), torch.stack([y for _, y in rows])


def tuple_loader(**bugs: Any) -> DataLoader:
    """The encoder LM's tuple batches of 16 rows in a fixed order (the k-th batch is the one with the bug)."""
    return DataLoader(_BatchIndex(TupleText(**bugs)), batch_size=None, shuffle=False)


class EosPaddedCollator(Collator):
    """Row 32: a collator that pads with the end-of-sequence id (pad id == eos id, as with GPT-2's tokenizer) and
    masks every label equal to the pad id: the eos of every document goes unsupervised. Documents cut to the context
    keep their eos (the tokenizer adds it after truncation)."""

    def __call__(self, samples: list[list[int]]) -> dict[str, Tensor]:
        samples = [s if s[-1] == EOS else [*s[:-1], EOS] for s in samples]
        width = max(len(s) for s in samples)
        ids = torch.full((len(samples), width), EOS, dtype=torch.long)
        mask = torch.zeros((len(samples), width), dtype=torch.long)
        for i, s in enumerate(samples):
            ids[i, : len(s)] = torch.tensor(s)
            mask[i, : len(s)] = 1
        labels = ids.masked_fill(ids == EOS, IGNORE_INDEX)
        return {"input_ids": ids, "attention_mask": mask, "labels": labels}


class PadIsRealTokenCollator(Collator):
    """Row 25: the pad id is a real token (the space byte) and the attention mask is built as ``ids != pad_id``:
    every space inside the text is masked out."""

    pad = ord(" ")

    def __call__(self, samples: list[list[int]]) -> dict[str, Tensor]:
        width = max(len(s) for s in samples)
        ids = torch.full((len(samples), width), self.pad, dtype=torch.long)
        for i, s in enumerate(samples):
            ids[i, : len(s)] = torch.tensor(s)
        mask = (ids != self.pad).long()
        labels = ids.masked_fill(mask == 0, IGNORE_INDEX)
        return {"input_ids": ids, "attention_mask": mask, "labels": labels}


class WrongSampleLabelsCollator(Collator):
    """Row 26: labels joined to the wrong samples (each row's labels are the next row's tokens)."""

    def __call__(self, samples: list[list[int]]) -> dict[str, Tensor]:
        batch = super().__call__(samples)
        batch["labels"] = batch["labels"].roll(1, dims=0)
        return batch


class MaxLengthCollator(Collator):
    """Row 27: every document cut to 8 tokens and padded to the full context (``padding="max_length"``)."""

    def __call__(self, samples: list[list[int]]) -> dict[str, Tensor]:
        samples = [s[:8] for s in samples]
        ids = torch.full((len(samples), self.context_length), PAD, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, s in enumerate(samples):
            ids[i, : len(s)] = torch.tensor(s)
            mask[i, : len(s)] = 1
        labels = ids.masked_fill(mask == 0, IGNORE_INDEX)
        return {"input_ids": ids, "attention_mask": mask, "labels": labels}


class LeftPaddedCollator(Collator):
    """Row 8: the bundled batches padded on the left (as for batched generation), padding unsupervised."""

    def __call__(self, samples: list[list[int]]) -> dict[str, Tensor]:
        batch = Collator.__call__(self, samples)
        real = batch["attention_mask"].sum(1)
        for i, n in enumerate(real.tolist()):
            for key in ("input_ids", "attention_mask", "labels"):
                batch[key][i] = batch[key][i].roll(batch[key].shape[1] - n)
        return batch


class OneSampleDataset(TextDataset):
    """Row 31: a dataset whose ``__getitem__`` ignores its index."""

    def __getitem__(self, i: int) -> list[int]:
        return self.samples[0]


class OneLongBatchCollator(Collator):
    """Row 49: documents cut to 16 tokens, but the sixth batch keeps them whole (up to the context, 64): one batch
    four times the usual."""

    def __call__(self, samples: list[list[int]]) -> dict[str, Tensor]:
        if self.calls + 1 != 6:
            samples = [s[:16] for s in samples]
        return Collator.__call__(self, samples)


_COLLATORS: dict[str, type[Collator]] = {
    "eos_pad": EosPaddedCollator,
    "pad_is_real": PadIsRealTokenCollator,
    "wrong_labels": WrongSampleLabelsCollator,
    "max_length": MaxLengthCollator,
    "left_pad": LeftPaddedCollator,
    "one_long": OneLongBatchCollator,
}


class BugTextDataModule(TinyTextDataModule):
    """The bundled text data with one of this module's collators, or a dataset that ignores its index.

    Args:
        collator: a key of ``_COLLATORS``, or None for the bundled collator (with its own flags in ``flags``).
        same_index: the dataset ignores its index (row 31).
        flags: :class:`~lightning_tfdebug.demo.TinyTextDataModule` arguments.
    """

    def __init__(self, collator: str | None = None, same_index: bool = False, **flags: Any) -> None:
        super().__init__(**{"batch_size": 8, **flags})
        if collator is not None:
            self.collator = _COLLATORS[collator](self.tokenizer, self.hparams.context_length)
        if same_index:
            self.train_set = OneSampleDataset(generate_corpus(100, seed=0), self.tokenizer, self.hparams.context_length)


def dict_data(**flags: Any) -> BugTextDataModule:
    """Padded dict batches of 8 documents (the bundled corpus) with the given bugs."""
    return BugTextDataModule(**flags)


def tensor_loader(text: Tensor, batch_size: int = 16, shuffle: bool = True) -> DataLoader:
    return DataLoader(TensorDataset(text[:, :-1], text[:, 1:]), batch_size=batch_size, shuffle=shuffle)


def in_order_loader(family: str, batches: int = 12) -> DataLoader:
    """Row 39: a plain DataLoader (no state for Lightning to restore) reading ``batches`` batches of 8 documents in a
    fixed order: T5's source and target halves, or the bundled padded dict batches."""
    dataset = TextDataset(generate_corpus(8 * batches, seed=1), ByteTokenizer(), 48)
    collate = seq2seq_collate if family == "t5" else Collator(ByteTokenizer(), 64)
    return DataLoader(dataset, batch_size=8, shuffle=False, collate_fn=collate)


class CorruptBatch(pl.Callback):
    """Bug-zoo row 47: at optimizer step ``step``, ``rows`` of the batch become random byte ids (their labels or
    targets follow), once, in an otherwise healthy run. Dict batches (``input_ids``, ``labels``) or tuple batches
    ``(tokens, targets)``."""

    def __init__(self, step: int = 40, rows: tuple[int, ...] = (2, 5)) -> None:
        self.step, self.rows = step, rows

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if trainer.global_step != self.step:
            return
        g = torch.Generator().manual_seed(0)
        for r in self.rows:
            if isinstance(batch, dict):
                ids = batch["input_ids"]
                ids[r] = torch.randint(3, 256, ids[r].shape, generator=g)
                if "labels" in batch:
                    batch["labels"][r] = ids[r]
            else:
                tokens, targets = batch[0], batch[1]
                row = torch.randint(3, 256, (tokens.shape[1] + 1,), generator=g)
                tokens[r], targets[r] = row[:-1], row[1:]


# ------------------------------------------------ attention scale (bug-zoo rows 29 and 45): AttentionProbe
ATTENTION_SCALES = ("divide", "none", "multiply")
"""How a hand-written attention scales ``q @ k.T``: ``/ sqrt(d)`` (healthy), not at all (row 29), ``* sqrt(d)``
(row 45)."""


def _hand_attention(self: nn.Module, x: Tensor, attention_mask: Tensor | None = None) -> Tensor:
    """TinyGPT's attention written out: scores, a scale by ``self.scale_mode``, masks, softmax, values."""
    b, t, c = x.shape
    q, k, v = self.qkv(x).split(c, dim=2)
    q, k, v = (z.view(b, t, self.n_heads, c // self.n_heads).transpose(1, 2) for z in (q, k, v))
    d = c // self.n_heads
    factor = {"divide": d**-0.5, "none": 1.0, "multiply": d**0.5}[self.scale_mode]
    scores = (q @ k.transpose(-2, -1)) * factor
    allowed = torch.ones(t, t, dtype=torch.bool, device=x.device).tril().expand(b, 1, t, t)
    if attention_mask is not None:
        allowed = (allowed & attention_mask.bool()[:, None, None, :]) | torch.eye(t, dtype=torch.bool, device=x.device)
    probs = scores.masked_fill(~allowed, float("-inf")).softmax(dim=-1)
    return self.proj((probs @ v).transpose(1, 2).reshape(b, t, c))


class HandAttentionGPT(TinyGPT):
    """TinyGPT (two layers, head dimension 64) with a hand-written attention scaled by ``scale``; ``unit_qk``
    initialises the q/k/v projection so that q and k have unit variance (the setting the 1/sqrt(d) rule is made for:
    there a missing scale makes attention one-hot at init; with the default small init it barely shows)."""

    def __init__(self, scale: str = "divide", unit_qk: bool = False, d_model: int = 128, n_heads: int = 2,
                 **kwargs: Any) -> None:  # fmt: skip
        super().__init__(d_model=d_model, n_layers=2, n_heads=n_heads, **kwargs)
        import types

        for module in self.modules():
            if hasattr(module, "qkv") and hasattr(module, "n_heads"):
                module.scale_mode = scale
                module.forward = types.MethodType(_hand_attention, module)
                if unit_qk:
                    nn.init.normal_(module.qkv.weight, std=d_model**-0.5)


def hf_attention_model(family: str, scale: str = "divide", unit_qk: bool = False) -> nn.Module:
    """A small eager-attention Hugging Face model (head dimension 64) whose attention scale is ``scale``: GPT-2
    through its config (``scale_attn_weights=False`` leaves the scale out), Llama through each layer's ``scaling``.
    ``unit_qk``: weights initialised with std 1/sqrt(width), so q and k have unit variance (their own init, 0.02,
    keeps q.k so small that even a missing scale leaves attention near uniform at init)."""
    import transformers

    if family == "gpt2":
        if scale == "multiply":
            raise ValueError("gpt2: its config can only drop the scale; use `scale='none'`.")
        config = transformers.GPT2Config(
            vocab_size=ByteTokenizer.vocab_size, n_embd=128, n_layer=2, n_head=2, n_positions=64,
            scale_attn_weights=scale == "divide", attn_implementation="eager",
            initializer_range=128**-0.5 if unit_qk else 0.02,
        )  # fmt: skip
        return transformers.GPT2LMHeadModel(config)
    config = transformers.LlamaConfig(
        vocab_size=ByteTokenizer.vocab_size, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64, attn_implementation="eager",
        initializer_range=128**-0.5 if unit_qk else 0.02,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(config)
    for layer in model.model.layers:
        layer.self_attn.scaling = {"divide": 64**-0.5, "none": 1.0, "multiply": 64**0.5}[scale]
    return model


class HFAttentionLM(pl.LightningModule):
    """:func:`hf_attention_model` trained on TinyTextDataModule's dict batches; the model computes its own loss."""

    def __init__(self, family: str = "gpt2", scale: str = "divide", unit_qk: bool = False, lr: float = 1e-3) -> None:
        super().__init__()
        self.lr = lr
        self.model = hf_attention_model(family, scale, unit_qk)

    def forward(self, input_ids, attention_mask=None, labels=None):
        return self.model(input_ids=input_ids, attention_mask=attention_mask, labels=labels)

    def training_step(self, batch, batch_idx):
        return self(batch["input_ids"], batch.get("attention_mask"), batch["labels"]).loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


# ------------------------------------------ issue 43: transformers that do not read token ids (tests/kind_models.py)
def kind_module(family: str, **bugs: Any) -> Any:
    """A builder of ``family`` of ``tests/kind_models.py`` with ``bugs`` (its constructor's flags: ``eval_dropout``,
    ``positions``, ``leak``)."""
    from tests.kind_models import build_kind

    return lambda: build_kind(family, **bugs)


def kind_loader(family: str, wrong_rows: bool = False) -> Any:
    """A builder of ``family``'s data; ``wrong_rows``: the collate rolls the labels by one row."""
    from tests.kind_models import kind_data

    return lambda: kind_data(family, wrong_rows=wrong_rows)


# ------------------------------------------------------------------------------- row 46: validation on training data
class ValidatesOnTraining(pl.LightningDataModule):
    """Row 46: ``val_dataloader`` reads the training data (a new DataLoader over the training dataset, in order, with
    the training collate and batch size), beside the training loader of ``data`` (a DataModule or a DataLoader)."""

    def __init__(self, data: Any) -> None:
        super().__init__()
        self.train = data.train_dataloader() if isinstance(data, pl.LightningDataModule) else data

    def train_dataloader(self) -> DataLoader:
        return self.train

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.train.dataset, batch_size=self.train.batch_size, collate_fn=self.train.collate_fn)


def leaky(data: Any) -> Any:
    """Row 46: ``data`` (a factory) whose validation reads its training data."""
    return lambda: ValidatesOnTraining(data())
