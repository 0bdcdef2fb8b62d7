"""A byte-level tokenizer, a generated corpus and a DataModule for the tiny transformer.

Nothing is downloaded: the corpus comes from a small seeded grammar, learnable and identical on every machine. The
bug-zoo flags of :class:`TinyTextDataModule` (off by default) are tabled in ``docs/demo.md``.
"""

from __future__ import annotations

import random
import time
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset

IGNORE_INDEX = -100


class ByteTokenizer:
    """UTF-8 bytes plus three special tokens: ``pad`` (256), ``bos`` (257), ``eos`` (258). Vocab size 259."""

    pad_id = 256
    bos_id = 257
    eos_id = 258
    vocab_size = 259

    def encode(self, text: str, add_special: bool = True) -> list[int]:
        ids = list(text.encode("utf-8"))
        return [self.bos_id, *ids, self.eos_id] if add_special else ids

    def decode(self, ids: Any, skip_special: bool = True) -> str:
        if isinstance(ids, Tensor):
            ids = ids.tolist()
        out = bytearray()
        names = {self.pad_id: "<pad>", self.bos_id: "<bos>", self.eos_id: "<eos>"}
        for i in ids:
            if 0 <= i < 256:
                out.append(i)
            elif not skip_special and i in names:
                out.extend(names[i].encode())
        return out.decode("utf-8", errors="replace")


_SUBJECTS = ["the cat", "a dog", "the old man", "my sister", "the robot", "a small bird", "the teacher", "our team"]
_VERBS = ["sees", "likes", "carries", "paints", "follows", "builds", "finds", "remembers"]
_OBJECTS = ["the red ball", "a green box", "the tall tree", "a quiet river", "the blue door", "a warm bowl of soup"]
_PLACES = ["in the park", "near the sea", "at home", "under the bridge", "on the hill", "by the window"]
_TIMES = ["every morning", "at night", "on sunday", "after lunch", "in winter", "today"]


def generate_corpus(n_documents: int = 2000, seed: int = 0) -> list[str]:
    """Documents of one to four sentences from a small grammar; deterministic for a given seed."""
    rng = random.Random(seed)
    docs = []
    for _ in range(n_documents):
        sentences = []
        for _ in range(rng.randint(1, 4)):
            parts = [rng.choice(_SUBJECTS), rng.choice(_VERBS), rng.choice(_OBJECTS)]
            if rng.random() < 0.6:
                parts.append(rng.choice(_PLACES))
            if rng.random() < 0.4:
                parts.append(rng.choice(_TIMES))
            sentences.append(" ".join(parts) + ".")
        docs.append(" ".join(sentences).capitalize())
    return docs


class TextDataset(Dataset):
    """Tokenized documents, each truncated to ``max_length`` tokens."""

    def __init__(self, docs: list[str], tokenizer: ByteTokenizer, max_length: int, slow_getitem_s: float = 0.0):
        self.samples = [tokenizer.encode(d)[:max_length] for d in docs]
        self.slow_getitem_s = slow_getitem_s

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> list[int]:
        if self.slow_getitem_s:
            time.sleep(self.slow_getitem_s)  # bug 19: a slow dataset
        return self.samples[i]


class Collator:
    """Right-pads a list of token lists into ``{input_ids, attention_mask, labels}``; injects batch bugs."""

    def __init__(self, tokenizer: ByteTokenizer, context_length: int, **bugs: Any) -> None:
        self.tokenizer = tokenizer
        self.context_length = context_length
        self.bugs = bugs
        self.calls = 0

    def _every(self, name: str) -> bool:
        k = self.bugs.get(name) or 0
        return k > 0 and self.calls % k == 0  # the k-th, 2k-th, ... batch

    def __call__(self, samples: list[list[int]]) -> dict[str, Tensor]:
        self.calls += 1
        tok = self.tokenizer
        if self._every("long_batch_every"):  # bug 4: longer than the position table
            samples = [s + [ord("a")] * (self.context_length + 8 - len(s)) for s in samples]
        width = max(len(s) for s in samples)
        ids = torch.full((len(samples), width), tok.pad_id, dtype=torch.long)
        mask = torch.zeros((len(samples), width), dtype=torch.long)
        for i, s in enumerate(samples):
            ids[i, : len(s)] = torch.tensor(s)
            mask[i, : len(s)] = 1
        labels = ids.clone()
        if not self.bugs.get("pad_labels_supervised"):  # bug 3 when set
            labels[mask == 0] = IGNORE_INDEX
        if self.bugs.get("all_labels_ignored"):  # bug 2
            labels.fill_(IGNORE_INDEX)
        if self._every("bad_token_every"):  # bug 5
            ids[0, 1] = tok.vocab_size + 3
        batch = {"input_ids": ids, "attention_mask": mask, "labels": labels}
        if self._every("dtype_drift_every"):  # bug 6
            batch["labels"] = labels.to(torch.int32)
            batch["attention_mask"] = mask.float()
        if self._every("squeeze_batch_every"):  # bug 6: a batch of one squeezed to 1-D
            batch = {k: v[0] for k, v in batch.items()}
        return batch


class TinyTextDataModule(pl.LightningDataModule):
    """Generated text for :class:`~lightning_tfdebug.demo.TinyGPT`.

    Args:
        batch_size: sequences per batch.
        context_length: maximum tokens per sequence (must not exceed the model's).
        n_documents: size of the generated corpus.
        seed: corpus seed.
        num_workers: DataLoader workers.
        all_labels_ignored, pad_labels_supervised, long_batch_every, bad_token_every, dtype_drift_every,
        squeeze_batch_every, slow_getitem_s: bug-zoo injections (``docs/demo.md``).
    """

    def __init__(
        self,
        batch_size: int = 16,
        context_length: int = 64,
        n_documents: int = 2000,
        seed: int = 0,
        num_workers: int = 0,
        all_labels_ignored: bool = False,
        pad_labels_supervised: bool = False,
        long_batch_every: int = 0,
        bad_token_every: int = 0,
        dtype_drift_every: int = 0,
        squeeze_batch_every: int = 0,
        slow_getitem_s: float = 0.0,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.tokenizer = ByteTokenizer()
        self.collator = Collator(
            self.tokenizer,
            context_length,
            all_labels_ignored=all_labels_ignored,
            pad_labels_supervised=pad_labels_supervised,
            long_batch_every=long_batch_every,
            bad_token_every=bad_token_every,
            dtype_drift_every=dtype_drift_every,
            squeeze_batch_every=squeeze_batch_every,
        )
        docs = generate_corpus(n_documents, seed)
        split = max(1, len(docs) // 20)
        self.train_set = TextDataset(docs[split:], self.tokenizer, context_length, slow_getitem_s)
        self.val_set = TextDataset(docs[:split], self.tokenizer, context_length)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(
            self.train_set,
            batch_size=self.hparams.batch_size,
            shuffle=True,
            collate_fn=self.collator,
            num_workers=self.hparams.num_workers,
            drop_last=True,
        )

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=self.hparams.batch_size, collate_fn=self.collator)
