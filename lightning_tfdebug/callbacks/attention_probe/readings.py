"""What AttentionProbe reads during one replay of the model call: every attention softmax, as per-layer numbers.

:class:`AttentionCapture` is a :class:`~torch.overrides.TorchFunctionMode` that sees each ``torch.softmax`` /
``F.softmax`` / ``Tensor.softmax`` over the last dimension whose output is shaped like attention probabilities
(``(B, H, T, S)``, or ``(B*H, T, S)`` inside ``nn.MultiheadAttention``), and each fused attention call (which cannot
be read). :func:`measure` turns one probability tensor into a few device scalars at once, so no tensor outlives the
call. Pure torch: imports nothing of the package above ``primitives``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

MASKED_SCORE = -5e3
"""A score at or below this is a masked key (``-inf``, ``finfo.min``, ``-1e9`` or an additive ``-1e4`` mask): no
unmasked attention score of a model at init comes near it, even ``q.k * sqrt(d)`` at d = 1024."""

_SOFTMAX = {torch.softmax, F.softmax, Tensor.softmax}
_FUSED = {F.scaled_dot_product_attention}
for _name in ("_transformer_encoder_layer_fwd", "_native_multi_head_attention", "_fused_sdp_choice"):
    if hasattr(torch, _name):
        _FUSED.add(getattr(torch, _name))


@dataclass
class LayerReading:
    """One attention softmax of one replay: device scalars until :meth:`host` (floats after it).

    Attributes:
        layer: the qualified name of the module that ran the softmax (with ``#i`` when it ran several).
        entropy: mean entropy of the attention rows, in nats (rows with no unmasked key are left out).
        uniform: mean entropy the same mask gives with uniform scores: the mean of ln(unmasked keys per row).
        spread: standard deviation of the content part of the scores (scores centred per row, minus their mean over
            the batch rows: what a positional bias such as ALiBi or T5's relative bias adds is the same for every
            row and drops out); None with a single batch row.
        keys: mean number of unmasked keys per row.
        head_dim: the head dimension read from the module, when it names one.
    """

    layer: str
    entropy: Any
    uniform: Any
    spread: Any
    keys: Any
    head_dim: int | None = None


def measure(layer: str, probs: Tensor, scores: Tensor | None, head_dim: int | None) -> LayerReading:
    """The reading of one probability tensor over its last dim; ``scores`` (the softmax input) gives the mask, else
    the keys with zero probability are the masked ones. The centred scores are ``log p`` (equal to the scores minus
    their row's log-sum-exp), so a model's probabilities alone are enough."""
    p = probs.detach().float().flatten(0, -4) if probs.ndim > 4 else probs.detach().float()
    valid = p > 0 if scores is None else scores.detach().reshape(p.shape) > MASKED_SCORE
    valid = valid & torch.isfinite(p)
    count = valid.sum(-1)
    rows = count > 0
    logp = torch.where(valid, p.clamp_min(torch.finfo(torch.float32).tiny).log(), torch.zeros_like(p))
    entropy = -(p * logp).where(valid, torch.zeros_like(p)).sum(-1)
    n_rows = rows.sum().clamp_min(1)
    mean_entropy = entropy.where(rows, torch.zeros_like(entropy)).sum() / n_rows
    uniform = count.clamp_min(1).float().log().where(rows, torch.zeros_like(entropy)).sum() / n_rows
    keys = count.float().where(rows, torch.zeros_like(entropy)).sum() / n_rows
    centred = logp - (logp * valid).sum(-1, keepdim=True) / count.clamp_min(1).unsqueeze(-1)
    spread = None
    if p.shape[0] >= 2:  # the content part: deviation from the batch mean where every row has the key unmasked
        everywhere = valid.all(0)
        deviation = centred - centred.mean(0, keepdim=True)
        cells = everywhere.sum().clamp_min(1) * (p.shape[0] - 1)
        spread = ((deviation.square() * everywhere).sum() / cells).sqrt()
    return LayerReading(layer, mean_entropy, uniform, spread, keys, head_dim)


def find_head_dim(module: nn.Module | None) -> int | None:
    """The head dimension a module names (``head_dim``, ``head_size``, ``d_head``..., or width / heads), else None."""
    if module is None:
        return None
    for name in ("head_dim", "head_size", "d_head", "attention_head_size", "d_k", "key_value_proj_dim"):
        value = getattr(module, name, None)
        if isinstance(value, int) and value > 0:
            return value
    width_heads = getattr(module, "n_heads", None), getattr(getattr(module, "qkv", None), "in_features", None)
    if isinstance(width_heads[0], int) and isinstance(width_heads[1], int) and width_heads[1] % width_heads[0] == 0:
        return width_heads[1] // width_heads[0]  # a fused q/k/v projection of the model width
    for width, heads in (("embed_dim", "num_heads"), ("n_embd", "n_head"), ("d_model", "n_heads"),
                         ("hidden_size", "num_heads"), ("d_model", "num_heads")):  # fmt: skip
        w, h = getattr(module, width, None), getattr(module, heads, None)
        if isinstance(w, int) and isinstance(h, int) and h > 0 and w % h == 0:
            return w // h
    return None


class AttentionCapture(torch.overrides.TorchFunctionMode):
    """During one replay: a reading per attention softmax, and the modules that ran fused attention.

    Args:
        where: the qualified name of the module running now, and the module (a stack the caller keeps).
        batch_size: rows of the replayed call; a 4-D softmax output must have it as its first dimension.
        inside_mha: whether an ``nn.MultiheadAttention`` is running now (its softmax is ``(B*H, T, S)``).
    """

    def __init__(self, where: Callable[[], tuple[str, nn.Module | None]], batch_size: int,
                 inside_mha: Callable[[], bool]) -> None:  # fmt: skip
        super().__init__()
        self.where, self.batch_size, self.inside_mha = where, batch_size, inside_mha
        self.readings: list[LayerReading] = []
        self.fused: list[str] = []
        self._seen: dict[str, int] = {}

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func in _FUSED:
            self.fused.append(self.where()[0])
        elif func is F.multi_head_attention_forward:  # one torch function: its inner softmax runs without the mode
            weights = out[1] if isinstance(out, tuple) and len(out) == 2 else None
            if isinstance(weights, Tensor) and weights.ndim == 4:  # per head, as the replay asks for
                self._add(weights, None)
        elif func in _SOFTMAX and args and isinstance(args[0], Tensor) and isinstance(out, Tensor):
            x = args[0]
            dim = kwargs.get("dim", args[1] if len(args) > 1 else None)
            if self._is_attention(x, out, dim):
                self._add(out, x)
        return out

    def _add(self, probs: Tensor, scores: Tensor | None) -> None:
        name, module = self.where()
        index = self._seen.get(name, 0)
        self._seen[name] = index + 1
        label = name if index == 0 else f"{name}#{index}"
        self.readings.append(measure(label, probs, scores, find_head_dim(module)))

    def _is_attention(self, x: Tensor, out: Tensor, dim: Any) -> bool:
        if not out.is_floating_point() or not isinstance(dim, int) or dim not in (-1, x.ndim - 1) or out.shape[-1] < 2:
            return False
        if out.ndim == 4:
            return out.shape[0] == self.batch_size
        return out.ndim == 3 and self.inside_mha()
