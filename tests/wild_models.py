"""Models written the way users write them, for the probes that must reach them (issue "Reach the models users
actually write"): tuple batches, ``forward(src, tgt)``, log-probabilities flattened to ``(N*T, V)`` with an NLL loss,
a LightningModule without ``forward`` whose ``training_step`` calls ``logits, loss = self.model(x, y)``.

Each comes with a ``bug`` switch that injects a leak, and the healthy default is the control. Nothing is downloaded:
data are generated.
"""

from __future__ import annotations

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

from tests.healthy_models import periodic_text

BOS = 1


def stream_pairs(rows: int = 64, length: int = 24, batch_size: int = 8) -> DataLoader:
    """``(inputs, target)`` tuple batches of a language-model stream: target is the inputs shifted by one."""
    text = periodic_text(rows, length + 1)
    return _batched(text[:, :-1], text[:, 1:], batch_size)


def cipher_pairs(rows: int = 64, length: int = 12, vocab: int = 40, batch_size: int = 8) -> DataLoader:
    """``(source, labels)`` tuple batches of a sequence-to-sequence task: each label is its source token under a
    fixed substitution (a cipher), so no label equals its source token."""
    g = torch.Generator().manual_seed(0)
    src = torch.randint(2, vocab, (rows, length), generator=g)
    labels = (src - 2 + 7) % (vocab - 2) + 2
    return _batched(src, labels, batch_size)


def _batched(a: torch.Tensor, b: torch.Tensor, batch_size: int) -> DataLoader:
    """Tuple batches built once: loading costs nothing next to these tiny models' steps (as with pre-tokenized data;
    per-row indexing and collation would be a fifth of such a step, which ThroughputMonitor rightly reports)."""
    a, b = a.contiguous(), b.contiguous()
    batches = [(a[i : i + batch_size], b[i : i + batch_size]) for i in range(0, len(a), batch_size)]
    return DataLoader(batches, batch_size=None, shuffle=False)


# --------------------------------------------------------------------------------------- the Lightning demo, as is
def lightning_demo_transformer(vocab: int = 259) -> pl.LightningModule:
    """``lightning.pytorch.demos.LightningTransformer``, the example many users start from, unchanged except that it
    downloads nothing: ``forward(inputs, target)`` on ``nn.Transformer``, log-probabilities flattened to ``(N*T, V)``,
    ``nll_loss`` against ``target.view(-1)``, SGD at a constant learning rate. Its decoder is fed ``target`` (the
    labels at their own positions) and its encoder sees the whole input: both leak what the model must predict."""
    from lightning.pytorch.demos import LightningTransformer

    class Offline(LightningTransformer):
        def prepare_data(self) -> None:  # the demo downloads WikiText-2 here
            return None

    torch.manual_seed(0)
    return Offline(vocab_size=vocab)


# ------------------------------------------------------------------------------------ forward(src, tgt) seq2seq
class Seq2SeqNet(nn.Module):
    """An ``nn.Transformer`` encoder-decoder with ``forward(src, tgt)`` returning log-probabilities ``(N*T, V)``."""

    def __init__(self, vocab: int = 40, d: int = 32, causal_decoder: bool = True) -> None:
        super().__init__()
        self.vocab, self.d, self.causal_decoder = vocab, d, causal_decoder
        self.embed = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(64, d)
        self.transformer = nn.Transformer(d, 2, 1, 1, 64, dropout=0.0, batch_first=True)
        self.head = nn.Linear(d, vocab)

    def forward(self, src: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
        def embed(x: torch.Tensor) -> torch.Tensor:
            return self.embed(x) + self.pos(torch.arange(x.shape[1], device=x.device))

        t = tgt.shape[1]
        mask = nn.Transformer.generate_square_subsequent_mask(t) if self.causal_decoder else None
        out = self.transformer(embed(src), embed(tgt), tgt_mask=mask, tgt_is_causal=self.causal_decoder)
        return F.log_softmax(self.head(out), dim=-1).view(-1, self.vocab)


class Seq2SeqModule(pl.LightningModule):
    """A cipher with teacher forcing: the decoder reads the labels shifted right (BOS first).

    ``bug``: ``"unshifted_decoder_input"`` feeds the labels themselves to the decoder; ``"no_decoder_mask"`` drops
    the decoder's causal mask."""

    def __init__(self, vocab: int = 40, bug: str | None = None) -> None:
        super().__init__()
        self.bug = bug
        self.model = Seq2SeqNet(vocab, causal_decoder=bug != "no_decoder_mask")

    def forward(self, src: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
        return self.model(src, tgt)

    def training_step(self, batch, batch_idx):
        src, labels = batch
        if self.bug == "unshifted_decoder_input":
            tgt = labels
        else:
            tgt = torch.cat([torch.full_like(labels[:, :1], BOS), labels[:, :-1]], dim=1)
        out = self(src, tgt)
        return F.nll_loss(out, labels.reshape(-1))

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=3e-3)


# ------------------------------------------------------------------------------- a small GPT, wrapped the usual way
class MiniGPT(nn.Module):
    """A small GPT in the style widely copied: ``forward(idx, targets=None)`` returns ``(logits, loss)``; without
    targets only the last position's logits (what generation needs)."""

    def __init__(self, vocab: int = 259, block_size: int = 32, d: int = 32, causal: bool = True) -> None:
        super().__init__()
        self.block_size, self.causal = block_size, causal
        self.wte = nn.Embedding(vocab, d)
        self.wpe = nn.Embedding(block_size, d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
        self.ln1, self.ln2, self.ln_f = nn.LayerNorm(d), nn.LayerNorm(d), nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.n_head = 2

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        b, t = idx.shape
        x = self.wte(idx) + self.wpe(torch.arange(t, device=idx.device))
        q, k, v = self.qkv(self.ln1(x)).split(x.shape[-1], dim=2)
        q, k, v = (z.view(b, t, self.n_head, -1).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, -1))
        x = x + self.mlp(self.ln2(x))
        x = self.ln_f(x)
        if targets is None:
            return self.lm_head(x[:, [-1], :]), None
        logits = self.lm_head(x)
        return logits, F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1), ignore_index=-1)


class MiniGPTModule(pl.LightningModule):
    """No ``forward``: ``training_step`` calls ``logits, loss = self.model(x, y)``. ``bug="no_causal_mask"``."""

    def __init__(self, bug: str | None = None) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model = MiniGPT(causal=bug != "no_causal_mask")

    def training_step(self, batch, batch_idx):
        x, y = batch
        _logits, loss = self.model(x, y)  # the usual `logits, loss = self.model(x, y)`
        return loss

    def configure_optimizers(self):
        # decay on matrices only, as such GPTs configure it
        params = [p for p in self.parameters() if p.requires_grad]
        groups = [
            {"params": [p for p in params if p.ndim >= 2], "weight_decay": 0.1},
            {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
        ]
        return torch.optim.AdamW(groups, lr=1e-3)


# ------------------------------------------------------------------------------- Hugging Face, labels inside the call
class HFSeq2Seq(pl.LightningModule):
    """T5 on dict batches with the labels passed in (the model shifts them right for its decoder).

    ``bug="decoder_input_is_labels"`` also passes the labels themselves as ``decoder_input_ids``."""

    def __init__(self, bug: str | None = None) -> None:
        super().__init__()
        from tests.healthy_models import hf_model

        self.bug = bug
        self.model = hf_model("t5")

    def training_step(self, batch, batch_idx):
        extra = {}
        if self.bug == "decoder_input_is_labels":
            extra["decoder_input_ids"] = batch["labels"].masked_fill(batch["labels"] == -100, 0)
        return self.model(**batch, **extra).loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)
