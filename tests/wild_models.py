"""Models written the way users write them, for the probes that must reach them (issue "Reach the models users
actually write"): tuple batches, ``forward(src, tgt)``, log-probabilities flattened to ``(N*T, V)`` with an NLL loss,
a LightningModule without ``forward`` whose ``training_step`` calls ``logits, loss = self.model(x, y)``.

Each comes with a ``bug`` switch that injects a leak, and the healthy default is the control. Nothing is downloaded:
data are generated.
"""

from __future__ import annotations

import math

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


# ------------------------------------------------------------------- token rows and loss-only wrappers (bug-zoo row 33)
def token_rows(
    rows: int = 64, length: int = 24, batch_size: int = 8, as_list: bool = False, padded: bool = False
) -> DataLoader:
    """Batches that are one integer tensor of token rows ``(B, length + 1)``, no labels (or, ``as_list``, a list
    whose first item is that tensor, as ``TensorDataset`` gives): the step or the model shifts the rows itself.
    ``padded``: ``{"input_ids", "attention_mask"}`` dicts, every other row right-padded (id 0) by 1 to 8 tokens."""
    text = periodic_text(rows, length + 1).contiguous()
    if padded:
        g = torch.Generator().manual_seed(0)
        cut = length + 1 - torch.randint(1, 9, (rows, 1), generator=g) * (torch.arange(rows)[:, None] % 2)
        mask = (torch.arange(length + 1) < cut).long()
        text = text.masked_fill(mask == 0, 0)
        batches = [
            {"input_ids": text[i : i + batch_size], "attention_mask": mask[i : i + batch_size]}
            for i in range(0, len(text), batch_size)
        ]
        return DataLoader(batches, batch_size=None, shuffle=False)
    batches = [text[i : i + batch_size] for i in range(0, len(text), batch_size)]
    return DataLoader([[b] for b in batches] if as_list else batches, batch_size=None, shuffle=False)


class RowNet(nn.Module):
    """A library's stack: the same constructor builds the decoder (``causal=True``) or the encoder (``causal=False``,
    no mask: every position sees the whole sequence). ``forward(ids)`` returns ``(logits, cache)`` (the cache: each
    layer's output, for generation), or only the logits with ``with_cache=False``; ``probabilities``: softmax
    probabilities instead of logits (bug-zoo row 1, when the loss applies cross-entropy to them). An
    ``attention_mask`` (1 = real token) keeps padding out of the attention, unless ``ignore_mask`` (bug-zoo row 8)."""

    def __init__(
        self,
        vocab: int = 259,
        d: int = 32,
        layers: int = 2,
        context: int = 64,
        causal: bool = True,
        with_cache: bool = True,
        probabilities: bool = False,
        ignore_mask: bool = False,
    ) -> None:
        super().__init__()
        self.causal, self.with_cache, self.probabilities = causal, with_cache, probabilities
        self.ignore_mask = ignore_mask
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(context, d)
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(d, 2, 4 * d, dropout=0.0, batch_first=True, norm_first=True)
            for _ in range(layers)
        )
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, ids: torch.Tensor, attention_mask: torch.Tensor | None = None):
        t = ids.shape[1]
        x = self.tok(ids) + self.pos(torch.arange(t, device=ids.device))
        mask = nn.Transformer.generate_square_subsequent_mask(t, device=ids.device) if self.causal else None
        padding = None
        if attention_mask is not None and not self.ignore_mask:
            padding = torch.zeros(attention_mask.shape, device=ids.device).masked_fill(attention_mask == 0, -math.inf)
        cache = []
        for layer in self.layers:
            x = layer(x, src_mask=mask, src_key_padding_mask=padding, is_causal=self.causal)
            cache.append(x)
        logits = self.head(self.norm(x))
        if self.probabilities:
            logits = logits.softmax(-1)
        return (logits, cache) if self.with_cache else logits


class ShiftInsideWrapper(nn.Module):
    """A loss-only wrapper: takes the token rows, shifts them itself (inputs ``rows[:, :-1]``, targets ``rows[:, 1:]``),
    calls its inner network and returns only the loss. ``unshifted``: the targets are the inputs themselves."""

    def __init__(self, net: nn.Module, unshifted: bool = False) -> None:
        super().__init__()
        self.net, self.unshifted = net, unshifted

    def forward(self, rows: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        x = rows[:, :-1]
        y = x if self.unshifted else rows[:, 1:]
        if attention_mask is None:
            logits, _cache = self.net(x)
        else:  # padded rows: the mask is sliced with the ids, and padding is not a target
            logits, _cache = self.net(x, attention_mask=attention_mask[:, :-1])
            y = y.masked_fill(attention_mask[:, 1:] == 0, -100)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


class DropLastLogitWrapper(nn.Module):
    """A loss-only wrapper that feeds the whole row and drops the last output: ``logits[:, :-1]`` against
    ``rows[:, 1:]``. ``unshifted``: against ``rows[:, :-1]``."""

    def __init__(self, net: nn.Module, unshifted: bool = False) -> None:
        super().__init__()
        self.net, self.unshifted = net, unshifted

    def forward(self, rows: torch.Tensor) -> torch.Tensor:
        logits, _cache = self.net(rows)
        y = rows[:, :-1] if self.unshifted else rows[:, 1:]
        return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), y.reshape(-1))


STYLES = ("shift_inside", "drop_last", "step_slices")


class TokenRowLM(pl.LightningModule):
    """A language model trained on token rows ``(B, T+1)`` without labels, in the three shapes users write.

    ``style``: ``"shift_inside"`` (``training_step`` returns ``self.model(batch)``, a wrapper that slices the rows,
    calls the inner network, a grandchild of this module, and returns only the loss), ``"drop_last"`` (the same with
    a wrapper that feeds the whole row and drops the last logit), ``"step_slices"`` (``x, y = batch[:, :-1],
    batch[:, 1:]; logits = self.model(x)`` in the step). ``bug``: ``"encoder"`` builds the stack without its causal
    mask (the library's encoder used as a causal LM: it sees the future); ``"unshifted"`` scores each position on its
    own token; ``"probabilities"``: the inner network returns softmax probabilities, scored by cross-entropy again;
    ``"mask_ignored"``: the inner network ignores the attention mask of padded rows (``token_rows(padded=True)``:
    ``{"input_ids", "attention_mask"}`` batches, the wrapper slices both)."""

    def __init__(self, style: str = "shift_inside", bug: str | None = None, lr: float = 3e-3) -> None:
        super().__init__()
        if style not in STYLES or bug not in (None, "encoder", "unshifted", "probabilities", "mask_ignored"):
            raise ValueError(f"style={style!r}, bug={bug!r}")
        self.style, self.bug, self.lr = style, bug, lr
        torch.manual_seed(0)
        net = RowNet(
            causal=bug != "encoder",
            with_cache=style != "step_slices",
            probabilities=bug == "probabilities",
            ignore_mask=bug == "mask_ignored",
        )
        unshifted = bug == "unshifted"
        if style == "shift_inside":
            self.model: nn.Module = ShiftInsideWrapper(net, unshifted)
        elif style == "drop_last":
            self.model = DropLastLogitWrapper(net, unshifted)
        else:
            self.model = net

    def training_step(self, batch, batch_idx):
        if isinstance(batch, dict):  # padded rows
            return self.model(batch["input_ids"], batch["attention_mask"])
        rows = batch[0] if isinstance(batch, (list, tuple)) else batch
        if self.style != "step_slices":
            return self.model(rows)
        x, y = rows[:, :-1], rows[:, 1:]
        logits = self.model(x)
        target = x if self.bug == "unshifted" else y
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))

    def configure_optimizers(self):
        decay = [p for p in self.parameters() if p.ndim >= 2]  # no decay on norms and biases
        rest = [p for p in self.parameters() if p.ndim < 2]
        return torch.optim.AdamW(
            [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}], lr=self.lr
        )


class EmbeddingRowsLM(pl.LightningModule):
    """Bad input for the token probes: the batch is float vectors ``(B, T+1, d)`` (embeddings fed directly), no integer
    tensor at all; the model predicts each next vector (mean squared error)."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        layer = nn.TransformerEncoderLayer(d, 2, 2 * d, dropout=0.0, batch_first=True)
        self.net = nn.TransformerEncoder(layer, 1, enable_nested_tensor=False)

    def training_step(self, batch, batch_idx):
        x, y = batch[:, :-1], batch[:, 1:]
        t = x.shape[1]
        mask = nn.Transformer.generate_square_subsequent_mask(t)
        return F.mse_loss(self.net(x, mask=mask, is_causal=True), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def embedding_rows(rows: int = 32, length: int = 12, d: int = 16, batch_size: int = 8) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    vectors = torch.randn(rows, length + 1, d, generator=g)
    return DataLoader([vectors[i : i + batch_size] for i in range(0, rows, batch_size)], batch_size=None)
