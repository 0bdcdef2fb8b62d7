"""Transformers that do not read token ids or return per-token logits over a vocabulary (issue 43), with their data and
their bugs, for the healthy and bug matrices (``tests/healthy_models.py``, ``tests/bug_models.py``).

Families (``tests.healthy_models.KIND_FAMILIES``), each tiny, on generated data, trained on CPU in seconds:

* ``float_encoder``: a from-scratch ``nn.TransformerEncoder`` fed float one-hot vectors ``(B, T, V)`` with a learned
  position table; per-token classification of the token one position earlier (cyclically) in rows that are random
  permutations of the V symbols: an order-dependent task (:class:`FloatTokenEncoder`, tuple batches);
* ``vit``: a ViT over 4x4 patches of 16x16 generated images, class = the quadrant that holds a bright blob; ``(B, C)``
  logits from a class token (:class:`PatchViT`, dict batches ``pixel_values``/``labels``);
* ``bert_cls``: Hugging Face ``BertForSequenceClassification`` from a tiny config, ``(B, C)`` logits; the class is
  that of the first token after ``[CLS]`` in a row that is a random permutation of 16 symbols, so only the order tells
  it (:class:`SeqClassifier`, dict batches as a tokenizer gives);
* ``seq2seq_reverse``: ``torch.nn.Transformer`` whose call takes the source ids and mask, the decoder ids, the decoder
  mask and keyword ``labels`` (one length), and returns ``{"loss", "logits"}``; task: reverse the source
  (:class:`ReverseTransformer`);
* ``set_max``: an encoder without any positional information, mean-pooled: the largest element of a set, a task that
  does not depend on order (:class:`SetMaxModel`; order-blind by design, healthy).

Bugs, all off by default: ``eval_dropout`` (a functional ``F.dropout(h, p)`` whose ``training`` is left at its
default True: the forward is random in eval mode); ``positions=False`` (no positional information on an order-dependent
task); ``wrong_rows`` in :func:`kind_data` (the collate rolls the labels by one row); ``leak`` (the decoder is fed its
own targets unshifted). Every module computes its loss in :meth:`KindModule.loss`, so a plain-torch loop
(:func:`train_plain`) trains it without a Trainer.
"""

from __future__ import annotations

import math
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset

from tests.healthy_models import KIND_FAMILIES, adamw_with_warmup

CLASSES: dict[str, int] = {"float_encoder": 16, "vit": 4, "bert_cls": 4, "seq2seq_reverse": 16, "set_max": 12}
"""The classes each family predicts among (per token or per sequence): chance is ``ln`` of this."""
IGNORE = -100
WIDTH = 32


def _encoder(layers: int = 2, dropout: float = 0.0) -> nn.TransformerEncoder:
    layer = nn.TransformerEncoderLayer(WIDTH, 2, 2 * WIDTH, dropout=dropout, batch_first=True, norm_first=True)
    return nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)


class KindModule(pl.LightningModule):
    """AdamW with a warm-up (the matrices' optimiser); ``loss(batch)`` is the whole step, ``training_step`` logs it."""

    def __init__(self, lr: float = 2e-3, warmup_steps: int = 10) -> None:
        super().__init__()
        self.lr, self.warmup_steps = lr, warmup_steps

    def loss(self, batch: Any) -> Tensor:
        raise NotImplementedError

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        loss = self.loss(batch)
        self.log("loss", loss)
        return loss

    def configure_optimizers(self):
        return adamw_with_warmup(self, self.lr, self.warmup_steps)


# -------------------------------------------------------------------------------------------------- float_encoder
class FloatTokenEncoder(KindModule):
    """A bidirectional encoder over float one-hot vectors ``(B, T, V)``: a linear input layer, a learned position
    table (``positions=False``: none), two layers, per-token logits ``(B, T, V)``. Batches ``(features, labels)``.

    Args:
        positions: a position table (False: none, bug 2: order-blind on an order-dependent task).
        eval_dropout: ``F.dropout(h, eval_dropout)`` after the input layer, with ``training`` at its default True
            (bug 1: random in eval mode). 0: none.
        dropout: the encoder layers' own ``nn.Dropout`` (off in eval mode, as it should be).
    """

    def __init__(
        self,
        lr: float = 1e-2,
        warmup_steps: int = 10,
        symbols: int = 16,
        positions: bool = True,
        eval_dropout: float = 0.0,
        dropout: float = 0.0,
    ) -> None:
        super().__init__(lr, warmup_steps)
        self.positions, self.eval_dropout = positions, eval_dropout
        self.inp = nn.Linear(symbols, WIDTH)
        self.pos = nn.Parameter(torch.randn(symbols, WIDTH)) if positions else None  # bug 2: no table at all
        self.encoder = _encoder(dropout=dropout)
        self.out = nn.Linear(WIDTH, symbols)

    def forward(self, features: Tensor) -> Tensor:
        h = self.inp(features)
        if self.pos is not None:
            h = h + self.pos[: features.shape[1]]
        if self.eval_dropout:
            h = F.dropout(h, self.eval_dropout)  # the bug: `training` defaults to True, so eval mode is random too
        return self.out(self.encoder(h))

    def loss(self, batch: Any) -> Tensor:
        features, labels = batch
        logits = self(features)
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE)


class SymbolRows(Dataset):
    """Rows of random symbols whose labels depend on their order. ``float_encoder``: ``symbols`` symbols as one-hot
    float features, each position labelled ``(symbol + position) mod symbols`` (a shuffled row is labelled
    otherwise). ``bert_cls``: ``[CLS]`` + 16 filler ids with one marker id at a random position; the label is the
    quarter of the row that holds the marker (the same ids in another order have another label)."""

    def __init__(self, kind: str, rows: int = 4096, symbols: int = 16, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.kind, self.symbols = kind, symbols
        self.rows = torch.randint(0, symbols, (rows, symbols), generator=g)
        self.marker_at = torch.randint(0, 16, (rows,), generator=g)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> Any:
        row = self.rows[i]
        if self.kind == "float_encoder":
            return F.one_hot(row, self.symbols).float(), (row + torch.arange(len(row))) % self.symbols
        ids = row + SeqClassifier.FILLER
        ids[self.marker_at[i]] = SeqClassifier.MARKER
        ids = torch.cat([torch.tensor([SeqClassifier.CLS]), ids])
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": self.marker_at[i] // 4}


# ------------------------------------------------------------------------------------------------------------ vit
class PatchViT(KindModule):
    """A ViT: 4x4 patches of a ``(B, 1, 16, 16)`` image through a linear layer, a class token, a learned position
    table, two encoder layers (``nn.Dropout`` 0.1, off in eval mode), ``(B, C)`` logits from the class token; its own
    loss when given ``labels``. Batches ``{"pixel_values", "labels"}``.

    Args:
        eval_dropout: ``F.dropout`` on the patch embeddings with ``training`` at its default True (bug 1).
    """

    def __init__(self, lr: float = 5e-3, warmup_steps: int = 10, eval_dropout: float = 0.0, patch: int = 4) -> None:
        super().__init__(lr, warmup_steps)
        self.patch, self.eval_dropout = patch, eval_dropout
        self.embed = nn.Linear(patch * patch, WIDTH)
        self.pos = nn.Parameter(torch.randn((16 // patch) ** 2, WIDTH))
        self.encoder = _encoder(dropout=0.1)
        self.norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, CLASSES["vit"])

    def forward(self, pixel_values: Tensor) -> Tensor:
        b, p = pixel_values.shape[0], self.patch
        patches = pixel_values.unfold(2, p, p).unfold(3, p, p).reshape(b, -1, p * p)
        h = self.embed(patches)
        if self.eval_dropout:
            h = F.dropout(h, self.eval_dropout)  # the bug: random in eval mode too
        return self.head(self.norm(self.encoder(h + self.pos)).mean(1))

    def loss(self, batch: Any) -> Tensor:
        return F.cross_entropy(self(batch["pixel_values"]), batch["labels"])


class BlobImages(Dataset):
    """``(1, 16, 16)`` images of faint noise with one bright 3x3 blob at a random place; the label is the quadrant
    that holds it (0 top-left, 1 top-right, 2 bottom-left, 3 bottom-right)."""

    def __init__(self, rows: int = 4096, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.images = 0.1 * torch.randn(rows, 1, 16, 16, generator=g)
        self.labels = torch.randint(0, 4, (rows,), generator=g)
        corner = torch.randint(0, 6, (rows, 2), generator=g)  # the blob's top-left inside its quadrant
        for i in range(rows):
            y = corner[i, 0] + 8 * (self.labels[i] // 2)
            x = corner[i, 1] + 8 * (self.labels[i] % 2)
            self.images[i, 0, y : y + 3, x : x + 3] += 1.0

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> dict[str, Tensor]:
        return {"pixel_values": self.images[i], "labels": self.labels[i]}


# ------------------------------------------------------------------------------------------------------- bert_cls
def tiny_bert_classifier() -> nn.Module:
    """``BertForSequenceClassification`` from a tiny config (width 64, four heads, no dropout), freshly initialised
    (at width 32 it needed a learning rate at which it diverged, as the pack said)."""
    import transformers

    config = transformers.BertConfig(
        vocab_size=20,
        hidden_size=2 * WIDTH,
        intermediate_size=4 * WIDTH,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=32,
        num_labels=CLASSES["bert_cls"],
        pad_token_id=0,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    return transformers.BertForSequenceClassification(config)


class SeqClassifier(KindModule):
    """Hugging Face ``BertForSequenceClassification`` (tiny config) on dict batches; the model computes its loss.

    Args:
        positions: False passes ``position_ids`` of zeros (bug 2: the model cannot see order).
    """

    CLS, MARKER, FILLER = 1, 3, 4

    def __init__(self, lr: float = 2e-3, warmup_steps: int = 10, positions: bool = True) -> None:
        super().__init__(lr, warmup_steps)
        self.positions = positions
        self.model = tiny_bert_classifier()

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None, labels: Tensor | None = None) -> Any:
        extra = {} if self.positions else {"position_ids": torch.zeros_like(input_ids)}
        return self.model(input_ids=input_ids, attention_mask=attention_mask, labels=labels, **extra)

    def loss(self, batch: Any) -> Tensor:
        return self(**batch).loss


# ------------------------------------------------------------------------------------------------ seq2seq_reverse
PAD, BOS, EOS = 0, 1, 2


class ReverseTransformer(KindModule):
    """``torch.nn.Transformer`` (two encoder and two decoder layers) with a shared embedding and learned position
    tables. Its call takes ``input_ids``, ``attention_mask``, ``decoder_input_ids``, ``decoder_attention_mask`` and
    keyword ``labels`` (decoder ids, decoder mask and labels share one length) and returns ``{"loss", "logits"}``
    (only the logits without labels).

    Args:
        leak: the step feeds the decoder its own targets unshifted (the labels, padding as ``PAD``) instead of the
            batch's ``decoder_input_ids`` (bug 5: position t sees the token it must predict).
    """

    def __init__(self, lr: float = 3e-3, warmup_steps: int = 10, leak: bool = False, context: int = 16) -> None:
        super().__init__(lr, warmup_steps)
        self.leak = leak
        vocab = CLASSES["seq2seq_reverse"]
        self.embed = nn.Embedding(vocab, WIDTH)
        self.src_pos = nn.Parameter(torch.randn(context, WIDTH))
        self.tgt_pos = nn.Parameter(torch.randn(context, WIDTH))
        self.transformer = nn.Transformer(WIDTH, 2, 2, 2, 2 * WIDTH, dropout=0.0, batch_first=True)
        self.out = nn.Linear(WIDTH, vocab)

    def forward(
        self,
        input_ids: Tensor,
        attention_mask: Tensor,
        decoder_input_ids: Tensor,
        decoder_attention_mask: Tensor,
        labels: Tensor | None = None,
    ) -> Any:
        s, t = input_ids.shape[1], decoder_input_ids.shape[1]
        src = self.embed(input_ids) + self.src_pos[:s]
        tgt = self.embed(decoder_input_ids) + self.tgt_pos[:t]
        causal = nn.Transformer.generate_square_subsequent_mask(t, device=tgt.device)
        h = self.transformer(
            src,
            tgt,
            tgt_mask=causal,
            tgt_is_causal=True,
            src_key_padding_mask=attention_mask == 0,
            memory_key_padding_mask=attention_mask == 0,
            tgt_key_padding_mask=decoder_attention_mask == 0,
        )
        logits = self.out(h)
        if labels is None:
            return logits
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE)
        return {"loss": loss, "logits": logits}

    def loss(self, batch: Any) -> Tensor:
        if self.leak:  # the bug: the decoder reads the labels themselves
            batch = {**batch, "decoder_input_ids": batch["labels"].masked_fill(batch["labels"] == IGNORE, PAD)}
        return self(**batch)["loss"]


class ReverseRows(Dataset):
    """Sources of 5 to 12 symbols (ids 3..15); the target is the source reversed, then ``EOS``."""

    def __init__(self, rows: int = 4096, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        lengths = torch.randint(5, 13, (rows,), generator=g)
        self.rows = [torch.randint(3, CLASSES["seq2seq_reverse"], (int(n),), generator=g) for n in lengths]

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> Tensor:
        return self.rows[i]


def _pad(rows: list[Tensor]) -> tuple[Tensor, Tensor]:
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), PAD, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = r
    return ids, (ids != PAD).long()


def reverse_collate(rows: list[Tensor]) -> dict[str, Tensor]:
    """Right-padded sources and targets; the decoder reads ``BOS`` + the target without its last token."""
    sources, mask = _pad(rows)
    targets, target_mask = _pad([torch.cat([r.flip(0), torch.tensor([EOS])]) for r in rows])
    decoder = torch.cat([torch.full((len(rows), 1), BOS), targets[:, :-1]], dim=1) * target_mask
    return {
        "input_ids": sources,
        "attention_mask": mask,
        "decoder_input_ids": decoder,
        "decoder_attention_mask": target_mask,
        "labels": targets.masked_fill(target_mask == 0, IGNORE),
    }


# -------------------------------------------------------------------------------------------------------- set_max
class SetMaxModel(KindModule):
    """An encoder with no positional information, mean-pooled to ``(B, C)`` logits: the largest element of a set of
    ids. Order-blind by design, on a task that does not depend on order. Batches ``(ids, labels)``."""

    def __init__(self, lr: float = 2e-3, warmup_steps: int = 10) -> None:
        super().__init__(lr, warmup_steps)
        self.embed = nn.Embedding(CLASSES["set_max"], WIDTH)
        self.encoder = _encoder()
        self.head = nn.Linear(WIDTH, CLASSES["set_max"])

    def forward(self, ids: Tensor) -> Tensor:
        return self.head(self.encoder(self.embed(ids)).mean(1))

    def loss(self, batch: Any) -> Tensor:
        ids, labels = batch
        return F.cross_entropy(self(ids), labels)


class SetRows(Dataset):
    """Sets of 6 ids drawn from 12; the label is the largest."""

    def __init__(self, rows: int = 4096, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, CLASSES["set_max"], (rows, 6), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> tuple[Tensor, Tensor]:
        return self.ids[i], self.ids[i].max()


# ----------------------------------------------------------------------------------------------------- the families
def build_kind(family: str, lr: float | None = None, warmup_steps: int = 10, **bugs: Any) -> KindModule:
    """A fresh module of ``family`` (its own learning rate unless ``lr``), with ``bugs`` (its constructor's flags)."""
    kwargs = {"warmup_steps": warmup_steps, **bugs, **({} if lr is None else {"lr": lr})}
    classes = {
        "float_encoder": FloatTokenEncoder,
        "vit": PatchViT,
        "bert_cls": SeqClassifier,
        "seq2seq_reverse": ReverseTransformer,
        "set_max": SetMaxModel,
    }
    if family not in classes:
        raise ValueError(f"`family` must be one of {KIND_FAMILIES}; got {family!r}.")
    return classes[family](**kwargs)


def _wrong_rows(collate: Any) -> Any:
    """Bug 3: the collate joins each row to the labels of the row before it (``roll(1)`` along the batch)."""

    def rolled(samples: list[Any]) -> Any:
        batch = collate(samples)
        if isinstance(batch, dict):
            return {**batch, "labels": batch["labels"].roll(1, dims=0)}
        inputs, labels = batch
        return inputs, labels.roll(1, dims=0)

    return rolled


BATCH: dict[str, int] = {"vit": 32, "bert_cls": 32}
"""Batch sizes other than 16."""


def kind_data(family: str, batch_size: int | None = None, wrong_rows: bool = False, seed: int = 0) -> DataLoader:
    """The shuffled training data of ``family`` (:data:`BATCH`); ``wrong_rows``: the labels rolled by one row (bug
    3)."""
    from torch.utils.data import default_collate

    datasets = {
        "float_encoder": lambda: SymbolRows("float_encoder", seed=seed),
        "vit": lambda: BlobImages(seed=seed),
        "bert_cls": lambda: SymbolRows("bert_cls", seed=seed),
        "seq2seq_reverse": lambda: ReverseRows(seed=seed),
        "set_max": lambda: SetRows(seed=seed),
    }
    collate = reverse_collate if family == "seq2seq_reverse" else default_collate
    if wrong_rows:
        collate = _wrong_rows(collate)
    g = torch.Generator().manual_seed(seed)
    size = batch_size or BATCH.get(family, 16)
    return DataLoader(
        datasets[family](), batch_size=size, shuffle=True, collate_fn=collate, drop_last=True, generator=g
    )


def chance(family: str) -> float:
    """``ln C``: the loss of uniform predictions over the family's classes."""
    return math.log(CLASSES[family])


def train_plain(module: KindModule, loader: DataLoader, steps: int) -> list[float]:
    """Plain torch (no Trainer): AdamW with the module's warm-up, ``steps`` steps; the loss at every step."""
    config = module.configure_optimizers()
    optimizer, schedule = config["optimizer"], config["lr_scheduler"]["scheduler"]
    module.train()
    losses: list[float] = []
    while len(losses) < steps:
        for batch in loader:
            loss = module.loss(batch)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            schedule.step()
            losses.append(loss.item())
            if len(losses) == steps:
                break
    return losses
