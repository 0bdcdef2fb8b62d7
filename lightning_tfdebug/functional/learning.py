"""One reading of "has this model learned?", shared by every callback that needs it, without a Trainer.

The loss of a classifier over V classes has two landmarks the pack already measures: ``ln(V)``, the loss of a model
that knows nothing (uniform predictions), and the supervised labels' unigram entropy ``H``, the loss of a model that
learned the classes' frequencies and nothing else. A model's *progress* is where its loss sits between them:

    progress(L) = (ln(V) - L) / (ln(V) - H)

0 knows nothing, 1 knows the frequencies, above 1 uses its context. Whatever its initialisation, an untrained model
starts near ``ln(V)`` (at or above it: PyTorch's default initialisation gives wider logits than GPT-style std 0.02,
and a loss a little above ``ln(V)``); a fine-tune starts from weights that learned at least the frequencies. So:

* :func:`trained_before`: the run's first measured loss has made :data:`TRAINED_PROGRESS` of the way from ``ln(V)``
  to ``H`` (weights trained before this run: a fine-tune, or a run resumed without the callback's state);
* :func:`learned`: that, or the latest loss is below ``H`` by :data:`BEYOND_FREQUENCIES` of the way (the model
  learned in this run, beyond the frequencies that any model at any learning rate picks up first).

Figures (first measured loss, ``tests/healthy_models.py``'s byte corpus, ln V = 5.56, H = 2.83 to 3.05):

| run | first loss / ln V | progress |
| --- | --- | --- |
| untrained, lr 1e-8: TinyGPT (std 0.02), GPT-2, Llama, BERT (HF init) | 0.997 to 1.000 | 0.00 to 0.006 |
| untrained, PyTorch default init: ``nn.TransformerEncoder`` LM | 1.036 | -0.08 |
| untrained, T5 (HF init) | 1.058 | -0.12 |
| fine-tunes of ``pretrain`` (60 steps, full and LoRA): TinyGPT, encoder LM, GPT-2, Llama, BERT | 0.18-0.54 | 0.98-1.8 |
| fine-tunes of ``pretrain``, full and LoRA: T5 (slowest to pretrain) | 0.64 to 0.67 | 0.67 to 0.71 |

The line at progress 0.35 sits 0.34 above the highest untrained run and 0.32 below the lowest fine-tune (T5: 60 steps
of pretraining took it two thirds of the way; a masked LM and a GPT-2 LoRA fine-tune start at the unigram entropy).
When the labels could not be counted, ``H`` is taken as ``ln(V) / 2`` (:data:`ASSUMED_UNIGRAM_FRACTION`; the byte
corpus measures 0.51 to 0.55 of ``ln(V)``): the fine-tunes then read 0.66 or more, the untrained runs 0.01 or less.
"""

from __future__ import annotations

import math

TRAINED_PROGRESS = 0.35
"""The first measured loss of weights trained before this run has made at least this much of the way from ln(V) to
the unigram entropy (measured: fine-tunes 0.67 and more, untrained models of six families and three inits 0.006 and
less)."""
BEYOND_FREQUENCIES = 0.1
"""A model learned in this run when its latest loss is below the unigram entropy by this fraction of the way from
ln(V) (progress 1.1): learning the frequencies alone is what even a learning rate 100x too low does first."""
ASSUMED_UNIGRAM_FRACTION = 0.5
"""The unigram entropy assumed, as a fraction of ln(V), when the labels could not be counted."""
MIN_SPAN = 0.05
"""The way from ln(V) to the unigram entropy counts as at least this fraction of ln(V) (labels near uniform: the
frequencies teach nothing, and any fall below ln(V) is learning)."""


def progress(loss: float, ln_vocab: float, unigram_entropy: float = math.nan) -> float:
    """Where ``loss`` sits from ``ln_vocab`` (0) to the labels' ``unigram_entropy`` (1); NaN when the loss or ln(V) is
    not known. An unknown unigram entropy is taken as :data:`ASSUMED_UNIGRAM_FRACTION` of ln(V)."""
    if not (math.isfinite(loss) and math.isfinite(ln_vocab) and ln_vocab > 0):
        return math.nan
    unigram = unigram_entropy if math.isfinite(unigram_entropy) else ASSUMED_UNIGRAM_FRACTION * ln_vocab
    span = max(ln_vocab - unigram, MIN_SPAN * ln_vocab)
    return (ln_vocab - loss) / span


def trained_before(first_loss: float, ln_vocab: float, unigram_entropy: float = math.nan) -> bool | None:
    """Whether the weights were trained before this run: the first measured loss made :data:`TRAINED_PROGRESS` of the
    way from ln(V) to the unigram entropy. None when it cannot be told (no loss, no vocabulary size)."""
    value = progress(first_loss, ln_vocab, unigram_entropy)
    return None if math.isnan(value) else value >= TRAINED_PROGRESS


def learned(first_loss: float, latest_loss: float, ln_vocab: float, unigram_entropy: float = math.nan) -> bool | None:
    """Whether the model has learned: it was trained before this run (:func:`trained_before`), or its latest loss is
    below the unigram entropy by :data:`BEYOND_FREQUENCIES` of the way (it learned in this run, beyond the
    frequencies). None when neither loss can be read against ln(V)."""
    before = trained_before(first_loss, ln_vocab, unigram_entropy)
    now = progress(latest_loss, ln_vocab, unigram_entropy)
    if before is None and math.isnan(now):
        return None
    return bool(before) or (not math.isnan(now) and now >= 1.0 + BEYOND_FREQUENCIES)
