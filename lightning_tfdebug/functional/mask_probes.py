"""MaskProbe's probes, without a Trainer: the inputs each probe builds, and :class:`MaskProbes`, the probes of one
probing step, each turning calls of the model into readings of :mod:`lightning_tfdebug.functional.mask_checks`
(device scalars until the probe's one host transfer, :func:`on_host`).

The model is called through :mod:`lightning_tfdebug.functional.call_probes`: the recorded call ``training_step`` makes,
or the forward by its signature. The tensor comparisons themselves (tolerances, largest logit change, alignment
losses) are in :mod:`lightning_tfdebug.functional.probes`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor, nn

from lightning_tfdebug.core.batch import is_id_tensor, logits_of, loss_of
from lightning_tfdebug.core.calls import ModelCall, TableReads, read_objective, replace_leaves, tensor_leaves
from lightning_tfdebug.functional.call_probes import (
    CallError,
    ModelCaller,
    call_logits,
    call_vocab,
    caller_logits,
    measure_leaks,
    measure_tables,
    watched_tables,
)
from lightning_tfdebug.functional.mask_checks import (
    CONTEXT_LIMIT,
    ORDER_STEPS,
    AlignmentReading,
    CausalReading,
    KvCacheReading,
    OrderReading,
    PaddingReading,
    PadSideReading,
    Reading,
    RepeatReading,
    alignment_not_checked,
    context_failure,
    context_limit_runs,
    decide_objective,
    kv_cache_unusable,
    unpadded_mask,
)
from lightning_tfdebug.functional.probes import (
    alignment_losses,
    causal_valid_positions,
    labels_relation,
    logit_tolerance,
    max_change,
    padding_side,
    random_ids_like,
    replace_after,
)
from lightning_tfdebug.functional.verdicts import Verdict

# Relative tolerance of "the loss training_step returned equals the loss recomputed from the same logits".
_ALIGN_RTOL = {torch.float64: 1e-9, torch.float32: 2e-5}
_ALIGN_RTOL_HALF = 1e-3


# -------------------------------------------------------------------------------------------------- reading the batch
def no_token_ids_reason(leaves: dict[str, Any], input_key: str | int | None) -> str:
    """Why the batch gives the token probes no ids, in the words of what it holds (``leaves``: the batch's leaves by
    path, from :func:`~lightning_tfdebug.core.batch.flatten_batch`)."""
    tensors = {path: value for path, value in leaves.items() if isinstance(value, Tensor)}

    def named(path: str) -> str:
        return f"`{path}`" if path else "the batch itself"

    described = ", ".join(
        f"{named(path)} {str(t.dtype).replace('torch.', '')} {tuple(t.shape)}" for path, t in list(tensors.items())[:4]
    )
    if input_key is not None:
        return (
            f"`input_key={input_key!r}` names no 2-D integer tensor of the batch (it holds "
            f"{described or 'no tensor'}); the token probes need the token ids."
        )
    if tensors and not any(is_id_tensor(t) for t in tensors.values()):
        return (
            f"the batch holds no integer tensor, only {described} (embeddings or features fed to the model "
            "directly?): the token probes perturb token ids, and there are none to perturb."
        )
    return (
        f"the batch holds no 2-D integer token ids by name or position (it holds {described or 'no tensor'}); "
        "the token probes need them."
    )


# ------------------------------------------------------------------------------------------------ probe constructions
def kind_aside(kind: str) -> tuple[str, str]:
    """Why causality and target alignment are not probed on a model of ``kind`` (see ``MaskProbes.decide_causal``),
    and the setting that would let them run."""
    if kind == "encoder-decoder":
        return (
            "no argument of the encoder-decoder's call carries the labels as the decoder's input (`decoder_input_ids`, "
            "or `labels` the model shifts itself), and its encoder's input is seen by every position by design",
            "`labels_key`",
        )
    return (
        "the model's kind cannot be told (no Hugging Face config, no labels to read its objective from), and a "
        "decoder's causality probe would perturb an input that an encoder lets every position see",
        "`model_kind` (or `causal`)",
    )


def causal_cut(length: int) -> int:
    """The last position whose logits must not move when the tokens after it are replaced (the middle)."""
    return length // 2 - 1


def masked_block(input_ids: Tensor, generator: torch.Generator) -> tuple[Tensor, Tensor, int] | None:
    """``(mask, other_ids, k)``: a mask hiding a block of ``k`` (a quarter of the) positions after the first, and a
    copy of the ids whose masked positions hold other ids. None when the sequence is too short to keep 2 real
    positions.

    Position 0 stays real so that no query has every key masked (a fully masked softmax row is NaN in many
    implementations, and would leak into later layers whatever the mask does); with a causal model the real positions
    after the block are the ones that test the mask.
    """
    b, t = input_ids.shape
    k = max(1, t // 4)
    if t - k < 2:
        return None
    mask = torch.ones_like(input_ids)
    mask[:, 1 : 1 + k] = 0
    other = input_ids.clone()
    other[:, 1 : 1 + k] = random_ids_like(input_ids, (b, k), generator)
    return mask, other, k


def probe_padding_side(setting: Literal["auto", "right", "left"], attention_mask: Tensor | None) -> str:
    """The side to add padding on: ``setting``, or with ``"auto"`` the side the batch pads (right when it does not
    pad or has no mask). Host sync when it reads the mask (probe step only)."""
    if setting != "auto":
        return setting
    detected = padding_side(attention_mask) if attention_mask is not None else "none"
    return "left" if detected == "left" else "right"


def padding_extra(length: int, context_limit: int | None) -> tuple[int, int]:
    """``(length, extra)``: the padding to add (a quarter of the positions) and the sequence length cut so that the
    padded sequence stays within ``context_limit``. A length under 2 means there is no room for the probe."""
    extra = max(1, length // 4)
    if context_limit is not None and length + extra > context_limit:
        length = context_limit - extra
    return length, extra


def add_padding(
    input_ids: Tensor, real: Tensor, side: str, extra: int, generator: torch.Generator
) -> tuple[Tensor, Tensor, slice]:
    """``(ids, mask, keep)``: ``extra`` padding positions (random ids, mask 0) added on ``side``; ``keep`` selects the
    original positions in the longer sequence's time dimension."""
    pad_ids = random_ids_like(input_ids, (input_ids.shape[0], extra), generator)
    pad_mask = torch.zeros_like(pad_ids)
    t = input_ids.shape[1]
    if side == "right":
        return torch.cat([input_ids, pad_ids], 1), torch.cat([real, pad_mask], 1), slice(0, t)
    return torch.cat([pad_ids, input_ids], 1), torch.cat([pad_mask, real], 1), slice(extra, extra + t)


def long_row(row: Tensor, length: int) -> Tensor:
    """``row`` ``(1, T)`` repeated to at least ``length`` tokens (the context-limit probes cut it)."""
    return row.repeat(1, -(-length // row.shape[1]))


def alignment_rtol(logits_dtype: torch.dtype, loss_dtype: torch.dtype | None = None) -> float:
    """Relative tolerance of "the returned loss equals the loss recomputed from the same logits". A loss computed in
    bf16/fp16 carries a few units of that dtype's rounding."""
    rtol = _ALIGN_RTOL.get(logits_dtype, _ALIGN_RTOL_HALF)
    if loss_dtype is not None and loss_dtype.is_floating_point:
        rtol = max(rtol, 4 * torch.finfo(loss_dtype).eps)
    return rtol


# --------------------------------------------------------------------------------------------------------- token order
def order_probe_position(attention_mask: Tensor | None, length: int) -> int | None:
    """The position whose output the token-order check reads: the last one real in every probe row (right padding),
    None when the rows pad on the left or fewer than 4 positions are real everywhere. Host sync: probe steps only."""
    if attention_mask is None:
        return length - 1 if length >= 4 else None
    real = attention_mask.bool()
    if not bool(real[:, 0].all()):
        return None
    prefix = real.long().cumprod(dim=1).sum(dim=1)  # leading real positions per row
    p = int(prefix.min()) - 1
    return p if p >= 3 else None


def reorder_prefix(input_ids: Tensor, position: int) -> Tensor:
    """A copy of ``input_ids`` whose tokens before ``position`` are in reverse order (the token at it and after it
    unchanged)."""
    out = input_ids.clone()
    out[:, :position] = input_ids[:, :position].flip(1)
    return out


def on_host(readings: list[Reading], to_host: Callable[[dict[str, Tensor]], dict[str, float]]) -> list[Reading]:
    """``readings`` with every device scalar replaced by its host value, moved by ``to_host`` in one transfer (the
    probe's one host sync)."""
    leaves = tensor_leaves(list(readings))
    host = to_host({str(i): t for i, (_, t) in enumerate(leaves)})
    return replace_leaves(list(readings), {path: host[str(i)] for i, (path, _) in enumerate(leaves)})


# ------------------------------------------------------------------------------------------------ one probing step
@dataclass(frozen=True)
class ProbeSettings:
    """What the probes take of MaskProbe's arguments: the rows and the longest sequence they use, whether the padding
    probes run and on which side they pad, and the label value that is not supervised."""

    probe_rows: int = 2
    probe_length: int = 64
    check_padding: bool = True
    padding_side: Literal["auto", "right", "left"] = "auto"
    ignore_index: int = -100


class MaskProbes:
    """The probes of one probing step, through one way of calling the model: the recorded call (a
    :class:`~lightning_tfdebug.core.calls.ModelCall`) or the forward by signature (a
    :class:`~lightning_tfdebug.functional.call_probes.ModelCaller`).

    Each probe appends its readings to :attr:`readings` (device scalars until the caller's one host transfer), the
    host numbers it logs to :attr:`logged`, and the verdicts of facts read on the host while probing (a padded batch
    the model is called without a mask, the context limit) to :attr:`verdicts`, in the order they were read.
    :attr:`settled` names the pending checks (``"alignment"``, ``"order"``) found unable to run on this model. Run
    under ``no_grad`` with the model in eval mode; every tensor a probe feeds the model holds only ids of the batch.

    Args:
        model: the recorded call or the caller.
        input_ids: the batch's token ids (a recorded call's replacements are drawn from them and its own tokens).
        generator: the random source of every replacement (seeded per step, so every rank draws the same).
        settings: the probe rows and length, the padding probes, the ignored label value.
        mask_key: where the batch holds its mask (evidence of ``TFD204``).
        causal: the model is a decoder (the causality probe runs); see :meth:`decide_causal`.
    """

    def __init__(
        self,
        model: ModelCall | ModelCaller,
        input_ids: Tensor,
        generator: torch.Generator,
        settings: ProbeSettings,
        mask_key: str | None = None,
        causal: bool = True,
    ) -> None:
        self.found = model if isinstance(model, ModelCall) else None
        self.caller = model if isinstance(model, ModelCaller) else None
        self.vocab = None if self.found is None else call_vocab(self.found, input_ids)
        self.generator, self.causal, self.mask_key = generator, causal, mask_key
        self.probe_rows, self.probe_length = settings.probe_rows, settings.probe_length
        self.check_padding, self.padding_side = settings.check_padding, settings.padding_side
        self.ignore_index = settings.ignore_index
        self.readings: list[Reading] = []
        self.verdicts: list[Verdict] = []
        self.logged: dict[str, float] = {}
        self.settled: set[str] = set()
        self.kind = self.found.kind if self.found is not None else "unknown"  # the caller's: set by MaskProbe
        self.aside: tuple[str, str] | None = None  # why causality and alignment are not probed, the setting to set

    # ------------------------------------------------------------------ access
    def logits(self, input_ids: Tensor, attention_mask: Tensor | None) -> Tensor:
        """The model's logits ``(B, T, V)`` on ``input_ids``: the probes' logits function."""
        if self.found is not None:
            assert self.vocab is not None
            return call_logits(self.found, self.vocab, input_ids, attention_mask, self.generator)
        assert self.caller is not None
        return caller_logits(self.caller, input_ids, attention_mask)

    def rows(self, t: Tensor | None) -> Tensor | None:
        """The probe rows of ``t``: its first ``probe_rows`` rows, cut to ``probe_length`` unless other tensors of
        the recorded call have the sequence's length."""
        if t is None:
            return None
        if self.found is not None and not self.found.time_cut_safe:
            return t[: self.probe_rows]  # other tensors of the call have the sequence's length: keep it whole
        return t[: self.probe_rows, : self.probe_length]

    def columns(self, t: Tensor | None) -> Tensor | None:
        """``t`` (shaped like the batch's ids) cut to the columns the recorded call received (token rows sliced in
        the step or the model, ``rows[:, :-1]``): the tokens the probes perturb."""
        return self.found.columns(t) if self.found is not None and self.found.sliced else t

    @property
    def resizable(self) -> bool:
        """Whether the probes may change the ids' length: the call takes the ids (or their slice) and no other
        sequence of their length (a decoder input), so a longer row says something certain about the model."""
        return self.found is None or (self.found.primary is not None and not self.found.companions())

    def decide_causal(self, input_ids: Tensor, labels: Tensor | None) -> tuple[bool, bool]:
        """``(decoder, alignment applies)``, read from what the labels ask the model to predict (``TFD212`` into
        :attr:`verdicts` for an encoder); sets :attr:`causal`. Neither probe runs (:attr:`aside` says why) for an
        encoder-decoder whose call has no decoder input carrying the labels, nor for a model of unknown kind without
        labels: their only probe would perturb an input that every position may see."""
        found = self.found
        unknown = self.kind == "unknown" and labels is None  # (the ids' next tokens as labels assume a decoder)
        if found is not None and found.related() and not unknown:
            # some argument of the model call carries the labels: there are tokens the model must not see. The
            # target-alignment check applies when the token ids themselves carry them (a decoder-only model).
            self.causal = True
            return True, found.primary in found.related()
        if self.kind == "encoder-decoder" or unknown:
            self.aside = kind_aside(self.kind)
            self.causal = False
            return False, False
        if labels is None:
            self.causal = self.kind != "encoder"  # no token labels to read the objective from: the kind says it
            return self.causal, self.causal
        objective = found.objective if found is not None else None
        if objective is None:
            objective = read_objective(input_ids, labels, self.ignore_index)  # host sync: once per fit
        verdict = decide_objective(objective)
        self.verdicts += [verdict] if verdict is not None else []
        self.causal = verdict is None
        return self.causal, self.causal

    # ------------------------------------------------------------------ probes
    def masks(self, input_ids: Tensor, attention_mask: Tensor | None, context_limit: int | None) -> None:
        """Determinism, causality (or the target leaks of a recorded call whose arguments carry the labels) and the
        padding probes, on the call's tokens (:meth:`columns`)."""
        found = self.found
        leaks = found is not None and (found.primary is None or bool(self.causal and found.related()))
        if leaks:
            assert found is not None and self.vocab is not None
            rows = min(self.probe_rows, found.batch_size)
            self.readings += measure_leaks(found, self.vocab, rows, self.generator)
            if found.primary is None:
                return  # the call takes tensors derived from the ids, neither the ids nor a slice: only the leaks
        ids, mask = self.rows(input_ids), self.rows(attention_mask)
        assert ids is not None
        ones = torch.ones_like(ids)
        base = self.logits(ids, ones)
        tolerance = logit_tolerance(base)
        if not leaks:  # the same tokens again: every comparison below assumes an eval forward is a function of them
            change, where = max_change(base, self.logits(ids, ones))
            self.readings.append(RepeatReading(change, where[0], where[1], tolerance))
        b, t = ids.shape
        encoder_ids = self.kind == "encoder-decoder"  # an encoder's input: every position may see it
        if self.causal and t >= 2 and not leaks and not encoder_ids:  # tokens after the middle replaced: outputs hold
            cut = causal_cut(t)
            changed = self.logits(replace_after(ids, cut, self.generator), ones)
            change, where = max_change(base, changed, causal_valid_positions(b, t, cut, ids.device))
            self.readings.append(CausalReading(change, where[0], where[1], cut, t, tolerance))
        if self.check_padding:
            self._padding(ids, mask, attention_mask, int(input_ids.shape[1]), tolerance, context_limit)

    def _padding(
        self,
        ids: Tensor,
        mask: Tensor | None,
        mask_full: Tensor | None,
        full_length: int,
        tolerance: Tensor,
        context_limit: int | None,
    ) -> None:
        target = self.found if self.found is not None else self.caller
        assert target is not None
        if self.found is not None and self.found.mask_opaque:
            return  # a mask reaches the model in an encoding of its own (additive, other shape): not probed
        if not target.takes_mask:
            if mask_full is not None and bool((mask_full == 0).any()):  # host sync: probe step only
                self.verdicts.append(unpadded_mask(self.mask_key))
            return
        if mask_full is None and not target.mask_named:
            return  # only `**kwargs` could take a mask, and the batch has none: nothing claims mask support
        block = masked_block(ids, self.generator)  # positions after the first marked as padding, their ids changed
        if block is not None:
            masked, other, k = block
            first, second = self.logits(ids, masked), self.logits(other, masked)
            change, where = max_change(first, second, masked.bool() if first.shape[:2] == masked.shape else None)
            every, where_every = max_change(first, second) if first.shape == second.shape else (change, where)
            self.readings.append(PaddingReading(change, where[1], every, where_every[1], k, tolerance))
        if self.found is not None and self.found.companions():
            return  # another sequence of the call has the ids' length (a decoder input): padding the ids says nothing
        side = probe_padding_side(self.padding_side, mask_full)  # host sync on "auto": probe step only
        real = mask if mask is not None else torch.ones_like(ids)
        # Learned from configuration, else from the batch: a padded probe never exceeds the configured context limit,
        # nor, when none is known, the batch's own length (what the training step feeds the model anyway).
        t, extra = padding_extra(int(ids.shape[1]), context_limit or full_length)
        if t < 2:
            return
        ids, real = ids[:, :t], real[:, :t]
        plain = self.logits(ids, real)
        longer_ids, longer_mask, keep = add_padding(ids, real, side, extra, self.generator)
        try:
            longer = self.logits(longer_ids, longer_mask)[:, keep]
        except CallError:
            raise
        except Exception:  # the longer sequence is past the model's real limit: the position checks report that
            return
        if longer.shape == plain.shape:  # (else the outputs do not follow the ids' positions)
            change, where = max_change(plain, longer, real.bool())
            self.readings.append(PadSideReading(change, where[1], side, extra, logit_tolerance(plain)))

    def positions(
        self,
        input_ids: Tensor,
        context_limit: int | None,
        source: str,
        incremental: Callable[[Tensor], Any] | None = None,
    ) -> None:
        """Incremental decoding (``incremental(ids)``: the logits decoded with the model's cache) and the context
        limit (read from ``source``): a sequence exactly at it must run; nothing longer is ever sent.

        Raises:
            CallError: when the model cannot be called the way the probes call it.
        """
        if not self.resizable:
            return  # the call takes other sequences shaped like the ids: a longer row says nothing certain about them
        if incremental is not None:
            ids = self.rows(input_ids)
            assert ids is not None
            self._kv_cache(ids, incremental)
        if context_limit is None:
            return
        self.logged[CONTEXT_LIMIT.name] = float(context_limit)
        row = long_row(input_ids[:1], context_limit + 1)[:, :context_limit]
        try:
            self.logits(row, torch.ones_like(row))
        except CallError:
            raise
        except Exception as err:  # the model fails within its own limit: that is the finding
            self.verdicts.append(context_failure(context_limit, err))
            return
        # Never past the limit: a sequence the model cannot take fails natively in compiled code (an inductor kernel
        # aborts the process) and as a device-side assert on CUDA, neither of which any handler can catch.
        self.verdicts.append(context_limit_runs(context_limit, source=source))

    def _kv_cache(self, ids: Tensor, incremental: Callable[[Tensor], Any]) -> None:
        full = self.logits(ids, torch.ones_like(ids))
        decoded = logits_of(incremental(ids))
        if decoded is None or decoded.shape != full.shape:
            shape = None if decoded is None else tuple(decoded.shape)
            self.verdicts.append(kv_cache_unusable(shape=shape, expected=tuple(full.shape)))
            return
        diff = (decoded.float() - full.float()).abs().amax(dim=-1).amax(dim=0)  # (T,)
        tolerance = logit_tolerance(full)
        self.readings.append(KvCacheReading(diff.max(), (diff > tolerance).float().argmax(), tolerance))

    def tables(self, model: nn.Module, input_ids: Tensor, attention_mask: Tensor | None) -> None:
        """Position tables: one forward pass of the probe rows watching every embedding weight and hand-held table
        parameter of ``model`` (``TFD216``)."""
        ids, mask = self.rows(input_ids), self.rows(attention_mask)
        assert ids is not None
        named = watched_tables(model)
        if ids.shape[1] < 2 or not named:
            return
        watcher = TableReads(list(named.values()))
        try:
            with watcher:
                self.logits(ids, torch.ones_like(ids) if mask is None else mask)
        except Exception:  # the other probes ran on this call: a failure here only means this check cannot run
            return
        reading = measure_tables(named, watcher.use, ids)  # host sync (probe step, once per fit)
        self.readings += [reading] if reading is not None else []

    def alignment(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None,
        labels: Tensor | None,
        step_output: Callable[[], Any] | None,
        automatic: bool,
        last_try: bool,
    ) -> None:
        """The target alignment: the loss ``training_step`` returned on the whole rows (``step_output()``: what it
        returned, the recording replay's or a replay of its own) against the logits of the recorded call it came
        from, or of the forward by signature. Settled without a reading when there is no scalar loss to compare
        (``TFD210`` unless a manual-optimization step returned none), or when the step cannot be called
        (``step_output`` None: a manual-optimization step steps its optimizers)."""
        if step_output is None or self.kind == "encoder-decoder":  # (its alignment is probed through the decoder input)
            self.settled.add("alignment")
            return
        try:
            returned = loss_of(step_output())
        except Exception as err:  # a training_step that cannot be replayed (dataloader_iter, side effects)
            self.settled.add("alignment")
            self.verdicts.append(
                alignment_not_checked(f"calling `training_step` on the batch failed ({type(err).__name__})")
            )
            return
        if returned is None or returned.numel() != 1:
            self.settled.add("alignment")
            if returned is not None or automatic:  # a manual training_step need not return its loss
                self.verdicts.append(alignment_not_checked("`training_step` did not return a scalar loss"))
            return
        if labels is None:  # no labels: the ids stand for them (padding not supervised)
            labels = (
                input_ids if attention_mask is None else input_ids.masked_fill(attention_mask == 0, self.ignore_index)
            )
        offset = 0
        if self.found is None:
            logits = self.logits(input_ids, attention_mask)
        else:  # the logits of the very call whose loss training_step returned; output p stands at row p + ids_start
            logits, offset = self.found.logits(), self.found.ids_start
            expected = len(range(labels.shape[1])[self.found.ids_start : self.found.ids_stop])
            if logits is None or tuple(logits.shape[:2]) != (labels.shape[0], expected):
                self.settled.add("alignment")  # outputs not position-aligned with the labels: nothing to compare
                return
        losses = alignment_losses(logits, labels, self.ignore_index, offset=offset)
        relation = labels_relation(input_ids, labels, self.ignore_index)  # host syncs: probe step only
        rtol = alignment_rtol(logits.dtype, returned.dtype)
        shifted, unshifted, shifted2 = losses["shifted"], losses["unshifted"], losses["shifted2"]
        reading = AlignmentReading(returned.detach().float(), shifted, unshifted, shifted2, relation, rtol, last_try)
        self.readings.append(reading)

    def order(self, input_ids: Tensor, attention_mask: Tensor | None, step: int) -> None:
        """Token order: reverse the tokens before a position, and separately replace them; a model that positions
        reach must move that position's output under the first, not only under the second."""
        if self.found is not None and self.found.primary is None:
            self.settled.add("order")  # the call takes tensors derived from the ids: no position of them to hold
            return
        ids, mask = self.rows(input_ids), self.rows(attention_mask)
        assert ids is not None
        position = order_probe_position(mask, ids.shape[1])  # host sync: probe step only
        if position is None:
            return
        real = torch.ones_like(ids) if mask is None else mask  # only the tokens before `position` change
        try:
            base = self.logits(ids, real)
            reordered = self.logits(reorder_prefix(ids, position), real)
            replaced = ids.clone()
            replaced[:, :position] = replace_after(ids[:, :position], -1, self.generator)
            content = self.logits(replaced, real)
        except Exception:  # the other probes ran on this call: a failure here only means this check cannot run
            self.settled.add("order")
            return
        if reordered.shape != base.shape or content.shape != base.shape:
            self.settled.add("order")
            return
        at = min(position, base.shape[1] - 1)  # an encoder-decoder's outputs follow its decoder
        order = (reordered[:, at] - base[:, at]).float().abs().max()
        content_change = (content[:, at] - base[:, at]).float().abs().max()
        last_try = step >= ORDER_STEPS[-1]
        self.readings.append(OrderReading(order, content_change, position, logit_tolerance(base), step, last_try))
