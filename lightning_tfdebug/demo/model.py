"""A tiny decoder-only transformer LightningModule, shared by tests, examples and benchmarks.

Pre-norm blocks (causal self-attention with a padding mask, an MLP), an LM head and a next-token loss with the label
shift done in the module (``ignore_index=-100``). Every bug-zoo bug that lives in the model or its optimizer has a
flag here, off by default: the table is in ``docs/demo.md``.
"""

from __future__ import annotations

import time
from typing import Any, Literal

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_tfdebug.demo.data import IGNORE_INDEX, ByteTokenizer

Activation = Literal["gelu", "relu", "tanh", "sigmoid", "silu"]
_ACTIVATIONS: dict[str, type[nn.Module]] = {
    "gelu": nn.GELU,
    "relu": nn.ReLU,
    "tanh": nn.Tanh,
    "sigmoid": nn.Sigmoid,
    "silu": nn.SiLU,
}


class CausalSelfAttention(nn.Module):
    def __init__(self, d_model: int, n_heads: int, causal: bool, use_padding_mask: bool) -> None:
        super().__init__()
        if d_model % n_heads:
            raise ValueError(f"`d_model` ({d_model}) must be divisible by `n_heads` ({n_heads}).")
        self.n_heads = n_heads
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.causal = causal
        self.use_padding_mask = use_padding_mask

    def forward(self, x: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_heads, c // self.n_heads).transpose(1, 2) for z in (q, k, v))
        allowed = torch.ones(t, t, dtype=torch.bool, device=x.device)
        if self.causal:
            allowed = allowed.tril()
        allowed = allowed.expand(b, 1, t, t)
        if attention_mask is not None and self.use_padding_mask:
            keys = attention_mask.bool()[:, None, None, :]
            # a query always sees itself, so a row is never fully masked (no NaN at pad queries)
            allowed = (allowed & keys) | torch.eye(t, dtype=torch.bool, device=x.device)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class MLP(nn.Module):
    def __init__(self, d_model: int, activation: str) -> None:
        super().__init__()
        self.fc = nn.Linear(d_model, 4 * d_model)
        self.act = _ACTIVATIONS[activation]()
        self.proj = nn.Linear(4 * d_model, d_model)

    def forward(self, x: Tensor) -> Tensor:
        return self.proj(self.act(self.fc(x)))


class Block(nn.Module):
    def __init__(self, d_model: int, n_heads: int, activation: str, residual: bool, **attn: Any) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, n_heads, **attn)  # causal, use_padding_mask
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = MLP(d_model, activation)
        self.residual = residual

    def forward(self, x: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        a = self.attn(self.ln1(x), attention_mask)
        x = x + a if self.residual else a
        m = self.mlp(self.ln2(x))
        return x + m if self.residual else m


class _Scale(nn.Module):
    """Multiplies a module's output (bug 15: an activation pushed past the fp16 range)."""

    def __init__(self, factor: float) -> None:
        super().__init__()
        self.factor = factor

    def __call__(self, module: nn.Module, args: Any, output: Tensor) -> Tensor:
        return output * self.factor


class TinyGPT(pl.LightningModule):
    """Tiny decoder-only transformer for byte-level language modelling.

    Args:
        vocab_size: embedding rows and logits width (259 for :class:`~lightning_tfdebug.demo.ByteTokenizer`).
        d_model: width.
        n_layers: number of blocks.
        n_heads: attention heads.
        context_length: size of the position table; longer inputs raise an index error (as real models do).
        lr: peak AdamW learning rate.
        weight_decay: AdamW weight decay, applied to matrices only (unless ``decay_norms``).
        warmup_steps: linear warm-up steps, then constant.
        activation: MLP activation.
        Remaining flags inject bugs (``docs/demo.md``).
    """

    def __init__(
        self,
        vocab_size: int = ByteTokenizer.vocab_size,
        d_model: int = 64,
        n_layers: int = 2,
        n_heads: int = 4,
        context_length: int = 64,
        lr: float = 1e-3,
        weight_decay: float = 0.1,
        warmup_steps: int = 10,
        activation: Activation = "gelu",
        softmax_output: bool = False,
        no_causal_mask: bool = False,
        no_padding_mask: bool = False,
        unshifted_labels: bool = False,
        head_not_in_optimizer: bool = False,
        no_residual: bool = False,
        mlp_bias_init: float | None = None,
        overflow_module: str | None = None,
        decay_norms: bool = False,
        adam_l2: bool = False,
        eval_mode: bool = False,
        drop_optimizer_state: bool = False,
        nan_on_rank: int | None = None,
        nan_at_step: int = 0,
        nan_module: str | None = None,
        nan_module_rank: int | None = None,
        perturb_rank: int | None = None,
        perturb_at_step: int = 0,
        slow_rank: int | None = None,
        slow_rank_s: float = 0.05,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.tok_emb = nn.Embedding(vocab_size, d_model)
        self.pos_emb = nn.Embedding(context_length, d_model)
        self.blocks = nn.ModuleList(
            Block(
                d_model,
                n_heads,
                activation,
                residual=not no_residual,
                causal=not no_causal_mask,
                use_padding_mask=not no_padding_mask,
            )
            for _ in range(n_layers)
        )
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size, bias=False)
        self.apply(self._init_weights)
        if mlp_bias_init is not None:  # bug 14: after the init, which zeroes every bias
            for block in self.blocks:
                nn.init.constant_(block.mlp.fc.bias, mlp_bias_init)
        if overflow_module is not None:
            modules = dict(self.named_modules())
            if overflow_module not in modules:
                raise ValueError(f"`overflow_module` {overflow_module!r} is not a module of TinyGPT.")
            modules[overflow_module].register_forward_hook(_Scale(1e5))
        if nan_module is not None:
            modules = dict(self.named_modules())
            if nan_module not in modules:
                raise ValueError(f"`nan_module` {nan_module!r} is not a module of TinyGPT.")
            modules[nan_module].register_forward_hook(self._nan_hook)

    def _nan_hook(self, module: nn.Module, args: Any, output: Tensor) -> Tensor:
        """Bug 23 inside a module: its output becomes NaN on one rank (or all) from ``nan_at_step``."""
        hp = self.hparams
        trainer = self._trainer
        if trainer is None or not self.training or trainer.global_step < hp.nan_at_step:
            return output
        if hp.nan_module_rank is not None and trainer.global_rank != hp.nan_module_rank:
            return output
        return output * float("nan")

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def configure_model(self) -> None:
        """Under ``ModelParallelStrategy`` (FSDP2), shard each block and the root over the data-parallel mesh."""
        mesh = self.device_mesh
        if mesh is None:
            return
        from torch.distributed.fsdp import fully_shard

        dp_mesh = mesh["data_parallel"] if "data_parallel" in (mesh.mesh_dim_names or ()) else mesh
        for block in self.blocks:
            fully_shard(block, mesh=dp_mesh)
        fully_shard(self, mesh=dp_mesh)

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        """Logits ``(batch, time, vocab)`` (probabilities when ``softmax_output`` is set: bug 1)."""
        t = input_ids.shape[1]
        pos = torch.arange(t, device=input_ids.device)
        x = self.tok_emb(input_ids) + self.pos_emb(pos)
        for block in self.blocks:
            x = block(x, attention_mask)
        logits = self.head(self.ln_f(x))
        if self.hparams.softmax_output:
            return logits.softmax(-1)
        return logits

    def loss(self, logits: Tensor, labels: Tensor) -> Tensor:
        if self.hparams.unshifted_labels:  # bug 9
            return F.cross_entropy(logits.flatten(0, 1), labels.flatten().long(), ignore_index=IGNORE_INDEX)
        return F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten().long(), ignore_index=IGNORE_INDEX)

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        hp = self.hparams
        step = self.trainer.global_step
        rank = self.trainer.global_rank
        if hp.slow_rank is not None and rank == hp.slow_rank:
            time.sleep(hp.slow_rank_s)  # bug 18
        if hp.perturb_rank is not None and rank == hp.perturb_rank and step == hp.perturb_at_step:
            with torch.no_grad():  # bug 17: one replica silently diverges
                local = self.ln_f.weight.to_local() if hasattr(self.ln_f.weight, "to_local") else self.ln_f.weight
                local.add_(0.5)
        logits = self(batch["input_ids"], batch.get("attention_mask"))
        loss = self.loss(logits, batch["labels"])
        if hp.nan_on_rank is not None and rank == hp.nan_on_rank and step >= hp.nan_at_step:
            loss = loss * float("nan")  # bug 23
        self.log("train/loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        logits = self(batch["input_ids"], batch.get("attention_mask"))
        self.log("val/loss", self.loss(logits, batch["labels"]), prog_bar=True)

    def on_train_epoch_start(self) -> None:
        if self.hparams.eval_mode:  # bug 21
            self.eval()

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        if self.hparams.drop_optimizer_state:  # bug 22
            checkpoint.pop("optimizer_states", None)
            checkpoint.pop("lr_schedulers", None)

    def configure_optimizers(self) -> Any:
        hp = self.hparams
        named = [(n, p) for n, p in self.named_parameters() if p.requires_grad]
        if hp.head_not_in_optimizer:  # bug 10
            named = [(n, p) for n, p in named if not n.startswith("head.")]
        if hp.adam_l2:  # bug 20: L2 through Adam instead of decoupled decay
            optimizer = torch.optim.Adam([p for _, p in named], lr=hp.lr, weight_decay=hp.weight_decay)
        elif hp.decay_norms:  # bug 20: decay on everything, norms and biases included
            optimizer = torch.optim.AdamW([p for _, p in named], lr=hp.lr, weight_decay=hp.weight_decay)
        else:
            decay = [p for n, p in named if p.ndim >= 2 and "emb" not in n]
            no_decay = [p for n, p in named if not (p.ndim >= 2 and "emb" not in n)]
            optimizer = torch.optim.AdamW(
                [{"params": decay, "weight_decay": hp.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
                lr=hp.lr,
                betas=(0.9, 0.95),
            )
        warmup = max(1, hp.warmup_steps)
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / warmup))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}
