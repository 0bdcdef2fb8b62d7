"""MaskProbe's probes without a Trainer: :class:`MaskProbes` turns calls of the model into the readings of
:mod:`~lightning_tfdebug.functional.mask_checks`."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor, nn

from lightning_tfdebug.callbacks.mask_probe import kind_checks
from lightning_tfdebug.callbacks.mask_probe.alignment_checks import (
    AlignmentReading,
    alignment_not_checked,
    kv_cache_unusable,
)
from lightning_tfdebug.callbacks.mask_probe.call_probes import (
    CallError,
    ModelCaller,
    call_logits,
    call_vocab,
    caller_logits,
    measure_leaks,
    measure_tables,
    watched_tables,
)
from lightning_tfdebug.callbacks.mask_probe.leak_checks import (
    CROSS_SAMPLE_ASIDE,
    CausalReading,
    CrossSampleReading,
    RepeatReading,
)
from lightning_tfdebug.callbacks.mask_probe.padding_checks import PaddingReading, PadSideReading, unpadded_mask
from lightning_tfdebug.callbacks.mask_probe.position_checks import (
    KvCacheReading,
    OrderReading,
    context_failure,
    context_limit_runs,
)
from lightning_tfdebug.callbacks.mask_probe.readings import CONTEXT_LIMIT, ORDER_STEPS, Reading
from lightning_tfdebug.functional.probes import (
    alignment_losses,
    causal_valid_positions,
    labels_relation,
    logit_tolerance,
    max_change,
    other_ids,
    padding_side,
    replace_after,
)
from lightning_tfdebug.functional.special_ids import learn_special_ids
from lightning_tfdebug.functional.verdicts import Verdict
from lightning_tfdebug.primitives.batch import is_id_tensor, logits_of, loss_of
from lightning_tfdebug.primitives.calls import ModelCall, TableReads, read_objective, replace_leaves, tensor_leaves

# Relative tolerance of "the loss training_step returned equals the loss recomputed from the same logits".
_ALIGN_RTOL = {torch.float64: 1e-9, torch.float32: 2e-5}
_ALIGN_RTOL_HALF = 1e-3


# -------------------------------------------------------------------------------------------------- reading the batch
def no_token_ids_reason(leaves: dict[str, Any], input_key: str | int | None) -> str:
    """Why the batch gives the token probes no ids, naming what it holds (``leaves``: its leaves by path)."""
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
    """``(why, setting)``: causality and target alignment are not probed on a model of ``kind``."""
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


def known_special_ids(sources: list[tuple[str, Any]]) -> tuple[int, ...]:
    """Every special id in ``sources``: BatchGuard's, a tokenizer's ``all_special_ids`` and ``mask_token_id``, and a
    config's ``decoder_start_token_id``."""
    found = set(learn_special_ids(sources).ordered())
    for _, source in sources:
        for attr in ("all_special_ids", "mask_token_id", "decoder_start_token_id"):
            try:
                value = getattr(source, attr, None)
            except Exception:  # a tokenizer property that complains about an unset token
                continue
            values = value if isinstance(value, (list, tuple)) else [value]
            found.update(v for v in values if isinstance(v, int) and not isinstance(v, bool) and v >= 0)
    return tuple(sorted(found))


def ordinary_ids(ids: Tensor, attention_mask: Tensor | None, special: tuple[int, ...]) -> tuple[Tensor, Tensor | None]:
    """``(pool, padding)``: the probes' replacement ids (the batch's real ids, neither ``special`` nor padding; all of
    them when fewer than 2 remain) and the batch's padding value (None: it does not pad). Host syncs: probe steps."""
    real = ids if attention_mask is None else ids[attention_mask.bool()]
    padded = None if attention_mask is None else ids[~attention_mask.bool()]
    banned = torch.tensor(special, dtype=ids.dtype, device=ids.device)
    if padded is not None and padded.numel():
        banned = torch.cat([banned, padded.unique()])
    every = real.unique() if real.numel() else ids.unique()
    pool = every[~torch.isin(every, banned)]
    padding = padded.mode().values if padded is not None and padded.numel() else None
    return (pool if pool.numel() >= 2 else every), padding


def masked_block(ids: Tensor, pool: Tensor, generator: torch.Generator) -> tuple[Tensor, Tensor, Tensor, int] | None:
    """``(mask, first, second, k)``: a mask hiding ``k`` (a quarter of the) positions after the first (position 0
    stays real: a fully masked softmax row is NaN), and two copies of the ids holding different ordinary ids of
    ``pool`` there. None when fewer than 2 real positions would remain."""
    t = ids.shape[1]
    k = max(1, t // 4)
    if t - k < 2:
        return None
    mask = torch.ones_like(ids)
    mask[:, 1 : 1 + k] = 0
    first, second = ids.clone(), ids.clone()
    first[:, 1 : 1 + k] = other_ids(pool, ids[:, 1 : 1 + k], generator)
    second[:, 1 : 1 + k] = other_ids(pool, first[:, 1 : 1 + k], generator)
    return mask, first, second, k


def padding_extra(length: int, context_limit: int | None) -> tuple[int, int]:
    """``(length, extra)``: the padding to add (a quarter) and the length that keeps the padded sequence within
    ``context_limit`` (under 2: no room for the probe)."""
    extra = max(1, length // 4)
    if context_limit is not None and length + extra > context_limit:
        length = context_limit - extra
    return length, extra


def add_padding(ids: Tensor, real: Tensor, side: str, pad_ids: Tensor) -> tuple[Tensor, Tensor, slice]:
    """``(ids, mask, keep)``: the ``(B, extra)`` ``pad_ids`` added on ``side`` with mask 0; ``keep`` selects the
    original positions in the longer sequence's time dimension."""
    pad_mask = torch.zeros_like(pad_ids)
    t, extra = ids.shape[1], pad_ids.shape[1]
    if side == "right":
        return torch.cat([ids, pad_ids], 1), torch.cat([real, pad_mask], 1), slice(0, t)
    return torch.cat([pad_ids, ids], 1), torch.cat([pad_mask, real], 1), slice(extra, extra + t)


def long_row(row: Tensor, length: int) -> Tensor:
    """``row`` ``(1, T)`` repeated to at least ``length`` tokens (the context-limit probes cut it)."""
    return row.repeat(1, -(-length // row.shape[1]))


def alignment_rtol(logits_dtype: torch.dtype, loss_dtype: torch.dtype | None = None) -> float:
    """Relative tolerance of "the returned loss equals the loss recomputed from the same logits" (a bf16/fp16 loss
    carries a few units of that dtype's rounding)."""
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


def on_host(readings: list[Reading], to_host: Callable[[dict[str, Tensor]], dict[str, float]]) -> list[Reading]:
    """``readings`` with every device scalar moved to the host by ``to_host`` in one transfer (the probe's sync)."""
    leaves = tensor_leaves(list(readings))
    host = to_host({str(i): t for i, (_, t) in enumerate(leaves)})
    return replace_leaves(list(readings), {path: host[str(i)] for i, (path, _) in enumerate(leaves)})


# ------------------------------------------------------------------------------------------------ one probing step
@dataclass(frozen=True)
class ProbeSettings:
    """What the probes take of MaskProbe's arguments."""

    probe_rows: int = 2
    probe_length: int = 64
    check_padding: bool = True
    padding_side: Literal["auto", "right", "left"] = "auto"
    ignore_index: int = -100


class MaskProbes:
    """The probes of one probing step (under ``no_grad``, the model in eval mode). Each probe appends to
    :attr:`readings` (device scalars), :attr:`logged` (host numbers), :attr:`verdicts` (facts read while probing) and
    :attr:`settled` (pending checks that cannot run).

    Args:
        model: the recorded call or the caller.
        input_ids: the batch's token ids (a recorded call's replacements are drawn from them and its own tokens).
        generator: the random source of every replacement (seeded per step, so every rank draws the same).
        settings: the probe rows and length, the padding probes, the ignored label value.
        mask_key: where the batch holds its mask (evidence of ``TFD204``).
        causal: the model is a decoder (the causality probe runs); see :meth:`decide_causal`.
        attention_mask: the batch's mask (which ids pad, kept out of the replacements).
        special_ids: the special ids the pack knows (:func:`known_special_ids`), kept out of the replacements.
        cross_sample: run the cross-sample probe with :meth:`masks` (once per fit).
    """

    def __init__(
        self,
        model: ModelCall | ModelCaller,
        input_ids: Tensor,
        generator: torch.Generator,
        settings: ProbeSettings,
        mask_key: str | None = None,
        causal: bool = True,
        attention_mask: Tensor | None = None,
        special_ids: tuple[int, ...] = (),
        cross_sample: bool = False,
    ) -> None:
        self.found = model if isinstance(model, ModelCall) else None
        self.caller = model if isinstance(model, ModelCaller) else None
        self.pool, self.pad_value = ordinary_ids(input_ids, attention_mask, special_ids)
        self.vocab = None if self.found is None else call_vocab(self.found, input_ids)
        if self.vocab is not None and (kept := self.vocab[torch.isin(self.vocab, self.pool)]).numel() >= 2:
            self.vocab = kept  # the call's other token tensors (decoder inputs) hold ids of their own
        self.cross_sample = cross_sample
        self.not_run: list[tuple[str, str, str]] = []  # (check, reason, setting) of checks that could not run
        self.generator, self.causal, self.mask_key = generator, causal, mask_key
        self.settings = settings
        self.ignore_index = settings.ignore_index
        self.readings: list[Reading] = []
        self.verdicts: list[Verdict] = []
        self.logged: dict[str, float] = {}
        self.settled: set[str] = set()
        self.kind = self.found.kind if self.found is not None else "unknown"  # the caller's: set by MaskProbe
        self.aside: tuple[str, str] | None = None  # why causality and alignment are not probed, the setting to set
        self.alignment_na: str | None = None  # why label alignment does not apply (a causal token classifier)

    # ------------------------------------------------------------------ access
    def logits(self, input_ids: Tensor, attention_mask: Tensor | None) -> Tensor:
        """The model's logits ``(B, T, V)`` on ``input_ids``: the probes' logits function."""
        if self.found is not None:
            assert self.vocab is not None
            return call_logits(self.found, self.vocab, input_ids, attention_mask, self.generator)
        assert self.caller is not None
        return caller_logits(self.caller, input_ids, attention_mask)

    def rows(self, t: Tensor | None) -> Tensor | None:
        """The probe rows of ``t``: its first ``probe_rows`` rows, cut to ``probe_length`` where that is safe."""
        if t is None:
            return None
        if self.found is not None and not self.found.time_cut_safe:
            return t[: self.settings.probe_rows]  # other tensors of the call have the sequence's length: keep it whole
        return t[: self.settings.probe_rows, : self.settings.probe_length]

    def columns(self, t: Tensor | None) -> Tensor | None:
        """``t`` (shaped like the batch's ids) cut to the columns the recorded call received (those probed)."""
        return self.found.columns(t) if self.found is not None and self.found.sliced else t

    @property
    def resizable(self) -> bool:
        """Whether the probes may change the ids' length: no other sequence of the call has it (a decoder input)."""
        return self.found is None or self.found.resizable

    def decide_causal(
        self,
        input_ids: Tensor,
        labels: Tensor | None,
        model: nn.Module | None = None,
        cover: Callable[[str, str, str], None] | None = None,
    ) -> tuple[bool, bool]:
        """``(decoder, alignment applies)``, from what the labels ask the model to predict, and where they ask for no
        next token, from the kind measured (:mod:`.kind_checks`: ``TFD210`` at warning, ``TFD212``); sets
        :attr:`causal`, :attr:`alignment_na`, and :attr:`aside` when neither probe applies (see
        ``docs/callbacks/mask_probe.md``, model kinds). ``model``: the module (its token embedding's rows); ``cover``:
        MaskProbe's ``cover(check, status, reason)``, told that label alignment does not apply to a token classifier."""
        causal, aligned = self._decide_causal(input_ids, labels, model)
        if self.alignment_na is not None and cover is not None:
            cover("label alignment", "n/a", self.alignment_na)
        return causal, aligned

    def _decide_causal(self, input_ids: Tensor, labels: Tensor | None, model: nn.Module | None) -> tuple[bool, bool]:
        found = self.found
        unknown = self.kind == "unknown" and labels is None  # (the ids' next tokens as labels assume a decoder)
        if found is not None and found.related() and not unknown:
            # some argument of the model call carries the labels: there are tokens the model must not see. The
            # target-alignment check applies when the token ids themselves carry them (a decoder-only model).
            self.causal = True
            aligned = found.primary in found.related()
            loss_only = all(s.label_like for s in found.related()) and self.kind != "encoder-decoder"
            if not aligned and labels is not None and loss_only:
                # the labels reach the call for its loss only, and the ids carry none of them: a model measured causal
                # has misaligned labels (a bidirectional one keeps the leak probes of the labels it is passed)
                objective = found.objective or read_objective(input_ids, labels, self.ignore_index)  # host sync: once
                judged = None if objective.next_token else kind_checks.judge(self, input_ids, labels, objective, model)
                if judged is not None and judged.causal:
                    self.verdicts += [judged.verdict] if judged.verdict is not None else []
                    self.alignment_na = judged.not_applicable
            if not aligned and self.kind == "encoder-decoder":
                self.alignment_na = (
                    "an encoder-decoder: its labels are the decoder's targets, which the leak probe checks against the "
                    "decoder's inputs (target leak into the inputs)"
                )
            return True, aligned
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
        if objective.next_token:
            self.causal = True
            return True, True
        # labels of no next-token objective: the kind is measured, and the labels judged against it
        judged = kind_checks.judge(self, input_ids, labels, objective, model)
        self.verdicts += [judged.verdict] if judged.verdict is not None else []
        self.causal, self.alignment_na = judged.causal, judged.not_applicable
        return self.causal, False

    # ------------------------------------------------------------------ probes
    def masks(self, input_ids: Tensor, attention_mask: Tensor | None, context_limit: int | None) -> None:
        """Determinism, causality (or the target leaks through the call's arguments) and the padding probes."""
        found = self.found
        leaks = found is not None and (found.primary is None or bool(self.causal and found.related()))
        if leaks:
            assert found is not None and self.vocab is not None
            rows = min(self.settings.probe_rows, found.batch_size)
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
        if self.cross_sample:
            self._cross_sample(ids, ones, base, tolerance)
        b, t = ids.shape
        encoder_ids = self.kind == "encoder-decoder"  # an encoder's input: every position may see it
        if self.causal and t >= 2 and not leaks and not encoder_ids:  # tokens after the middle replaced: outputs hold
            cut = causal_cut(t)
            changed = self.logits(replace_after(ids, cut, self.generator, self.pool), ones)
            change, where = max_change(base, changed, causal_valid_positions(b, t, cut, ids.device))
            self.readings.append(CausalReading(change, where[0], where[1], cut, t, tolerance))
        if self.settings.check_padding:
            self._padding(ids, mask, attention_mask, int(input_ids.shape[1]), tolerance, context_limit)

    def _cross_sample(self, ids: Tensor, real: Tensor, base: Tensor, tolerance: Tensor) -> None:
        """One sample's tokens replaced: the other samples' logits must not move (one forward of the probe rows)."""
        if ids.shape[0] < 2:
            self.not_run.append(CROSS_SAMPLE_ASIDE)
            return
        changed = ids.clone()
        changed[0] = other_ids(self.pool, ids[0], self.generator)
        moved = self.logits(changed, real)
        if moved.shape == base.shape:
            change, where = max_change(base[1:], moved[1:])
            self.readings.append(CrossSampleReading(change, where[0] + 1, where[1], tolerance))

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
        if mask_full is None and not target.mask_named:
            return  # no mask reaches the model, or only `**kwargs` could take one, and the batch has none
        layout = padding_side(mask_full) if mask_full is not None else "none"  # host sync: probe step only
        if not target.takes_mask:
            if layout != "none":
                self.verdicts.append(unpadded_mask(self.mask_key, layout, self.causal))
            return
        block = masked_block(ids, self.pool, self.generator)  # a block marked as padding, holding other ids twice
        if block is not None:
            masked, first_ids, second_ids, k = block
            first, second = self.logits(first_ids, masked), self.logits(second_ids, masked)
            change, where = max_change(first, second, masked.bool() if first.shape[:2] == masked.shape else None)
            every, where_every = max_change(first, second) if first.shape == second.shape else (change, where)
            self.readings.append(PaddingReading(change, where[1], every, where_every[1], k, tolerance, layout))
        if not self.resizable:
            return  # another sequence of the call has the ids' length (a decoder input): padding the ids says nothing
        side = self.settings.padding_side
        if side == "auto":
            side = "left" if layout == "left" else "right"
        real = mask if mask is not None else torch.ones_like(ids)
        # Learned from configuration, else from the batch: a padded probe never exceeds the configured context limit,
        # nor, when none is known, the batch's own length (what the training step feeds the model anyway).
        t, extra = padding_extra(int(ids.shape[1]), context_limit or full_length)
        if t < 2:
            return
        ids, real = ids[:, :t], real[:, :t]
        plain = self.logits(ids, real)
        pad_ids = other_ids(self.pool, ids[:, :extra], self.generator)  # the batch's own padding value if it pads
        pad_ids = pad_ids if self.pad_value is None else torch.full_like(pad_ids, int(self.pad_value))
        longer_ids, longer_mask, keep = add_padding(ids, real, side, pad_ids)
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
        kv_cache_fn: Callable[[nn.Module, Tensor], Any] | Exception | None = None,
        module: nn.Module | None = None,
    ) -> None:
        """Incremental decoding (``kv_cache_fn(module, ids)``, or the error importing it raised) and the context limit
        (read from ``source``): a sequence exactly at it must run; nothing longer is ever sent.

        Raises:
            CallError: when the model cannot be called the way the probes call it.
        """
        if not self.resizable:
            return  # the call takes other sequences shaped like the ids: a longer row says nothing certain about them
        if isinstance(kv_cache_fn, Exception):
            self.verdicts.append(kv_cache_unusable(error=kv_cache_fn))
        elif kv_cache_fn is not None:
            ids = self.rows(input_ids)
            assert ids is not None
            self._kv_cache(ids, lambda rows: kv_cache_fn(module, rows))
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
        """Position tables: one forward pass of the probe rows watching ``model``'s candidate tables (``TFD216``)."""
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
        """The target alignment: the loss ``training_step`` returned (``step_output()``; None: it cannot be called)
        against the logits of the call it came from. Settled without a reading when there is no scalar loss."""
        if step_output is None or self.kind == "encoder-decoder":
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
        relation = labels_relation(input_ids, labels, self.ignore_index)  # host sync: probe step only
        rtol = alignment_rtol(logits.dtype, returned.dtype)
        returned = returned.detach().float()
        self.readings.append(AlignmentReading(returned, **losses, relation=relation, rtol=rtol, last_try=last_try))

    def order(self, input_ids: Tensor, attention_mask: Tensor | None, step: int) -> None:
        """Token order: reverse the tokens before a position, and separately replace them (``TFD215``)."""
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
            reversed_ids, replaced_ids = ids.clone(), ids.clone()
            reversed_ids[:, :position] = ids[:, :position].flip(1)
            replaced_ids[:, :position] = replace_after(ids[:, :position], -1, self.generator, self.pool)
            reordered, content = self.logits(reversed_ids, real), self.logits(replaced_ids, real)
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
