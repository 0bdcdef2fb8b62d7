"""MaskProbe's order probes on a model that reads no token ids or returns one output per sequence (the any-inputs
path, :mod:`.any_inputs`): the recorded model call replayed with its input positions permuted (can the model see
order?), with their values replaced by another row's (does the content move the outputs at all?), and with a late
position replaced (are its per-position outputs causal or bidirectional?). The sequence tensors of the call are those
with one row per sample and a common length ``T``: ``(B, T)`` integer ids, masks and per-position labels, ``(B, T, F)``
float features; they are permuted and replaced together. The first and last positions stay in place (a ``[CLS]`` a
pooler reads, a last token) and so do positions where a row is padded.

:class:`OrderWatch` then decides the harm of an order-blind model from its objective (:mod:`.order_checks`): per
position labels that need order (read at the probe), and the losses ``training_step`` returned on a few fixed steps.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from lightning_tfdebug.callbacks.mask_probe.any_inputs import rows_output
from lightning_tfdebug.callbacks.mask_probe.order_checks import (
    DECIDE_STEP,
    EARLY_STEPS,
    LATE_STEPS,
    CausalKindReading,
    LossTrend,
    OrderSeenReading,
    decide_order_blind,
)
from lightning_tfdebug.callbacks.mask_probe.readings import Reading
from lightning_tfdebug.functional.probes import logit_tolerance, max_change
from lightning_tfdebug.functional.verdicts import Verdict
from lightning_tfdebug.primitives.calls import Path, RecordedCall

LABEL_ROWS, LABEL_POSITIONS = 8, 64
"""The rows and positions the per-position labels are read on (pairs of positions with the same inputs)."""


@dataclass(frozen=True)
class Sequences:
    """The call's sequence tensors of one length: ``inputs`` (ids, features), ``masks`` and ``labels`` by path."""

    length: int
    inputs: dict[Path, Tensor]
    masks: dict[Path, Tensor]
    labels: dict[Path, Tensor]
    padded: list[Tensor]  # (B, T) bool per mask: True where a row is padding

    def every(self) -> dict[Path, Tensor]:
        return {**self.inputs, **self.masks, **self.labels}


def _padding(name: str, mask: Tensor) -> Tensor:
    """Where ``mask`` marks padding: the True entries of a bool ``*padding*`` mask (``src_key_padding_mask``), else
    its zeros."""
    return mask if mask.dtype == torch.bool and "padding" in name else mask == 0


def sequences(call: RecordedCall, batch_size: int, positions: int) -> Sequences | str:
    """The call's sequence tensors (those of the length of per-position outputs when there are any, else of its first
    sequence input), or why there are none."""
    groups: dict[int, Sequences] = {}
    for path, t in call.leaves():
        float_features = t.is_floating_point() and t.ndim == 3
        integer_rows = not t.is_floating_point() and not t.is_complex() and t.ndim == 2
        if t.shape[0] != batch_size or not (float_features or integer_rows) or t.shape[1] < 4:
            continue
        group = groups.setdefault(int(t.shape[1]), Sequences(int(t.shape[1]), {}, {}, {}, []))
        name = (call.keyword(path) or "").lower()
        role = "masks" if t.dtype == torch.bool or "mask" in name else "labels" if "label" in name else "inputs"
        getattr(group, role)[path] = t
        if role == "masks":
            group.padded.append(_padding(name, t))
    usable = [g for g in groups.values() if g.inputs]
    if not usable:
        return (
            "the model call takes no sequence of four positions or more ((B, T) ids or (B, T, F) features: an image's "
            "positions are made inside the model)"
        )
    return next((g for g in usable if g.length == positions), usable[0])


def batch_labels(fields: Any, call: RecordedCall) -> Tensor | None:
    """The batch's per-position labels: its labels by name, else its one 2-D integer tensor the call did not take."""
    if isinstance(fields.labels, Tensor):
        return fields.labels
    taken = {id(t) for _, t in call.leaves()}
    others = [
        t
        for t in fields.leaves.values()
        if isinstance(t, Tensor) and t.ndim == 2 and not t.is_floating_point() and t.dtype != torch.bool
        and id(t) not in taken
    ]  # fmt: skip
    return others[0] if len(others) == 1 else None


def _free_positions(seq: Sequences) -> Tensor:
    """The positions the probes move: real in every row (mask 1), and neither the first nor the last, of the sequence
    nor of a row's real tokens. Host sync: the masks, on the probing step only."""
    free = torch.ones(seq.length, dtype=torch.bool)
    free[0] = free[-1] = False
    for padded in seq.padded:
        real = ~padded.cpu()
        free &= real.all(0)
        free[real.int().argmax(1)] = False  # each row's first real position (a [CLS] after left padding)
        free[seq.length - 1 - real.flip(1).int().argmax(1)] = False  # and its last (the token a pooler reads)
    return free.nonzero().flatten()


def _described(call: RecordedCall, seq: Sequences) -> str:
    return ", ".join(f"{call.describe(p)} {tuple(t.shape)}" for p, t in seq.inputs.items())


def probe_order(
    call: RecordedCall, batch_size: int, labels: Tensor | None, ignore_index: int
) -> tuple[list[Reading], str | None]:
    """The order and causal-kind readings of ``call`` (the caller sets eval mode, ``no_grad`` and the RNG), and why the
    order probe could not run (None when it ran). ``labels``: the batch's per-position labels, if any. Replays: four
    at most. Host syncs: the free positions, and whether the permutation changed the inputs (probing step only)."""
    out = rows_output(call.call(), batch_size)
    if out is None:
        return [], "the model call returns no output with one row per sample"
    seq = sequences(call, batch_size, int(out.shape[1]))
    if isinstance(seq, str):
        return [], seq
    per_position = int(out.shape[1]) == seq.length
    if not per_position and out.shape[1] != 1:
        return [], f"the model returns {out.shape[1]} outputs per row for {seq.length} input positions"
    free = _free_positions(seq).to(out.device)
    if free.numel() < 2 or batch_size < 2:
        return [], "fewer than two real positions between the first and the last, or one row"
    order = torch.arange(seq.length, device=out.device)
    order[free] = free.flip(0)
    permuted = {p: t[:, order.to(t.device)] for p, t in seq.every().items()}
    if all(torch.equal(permuted[p], t) for p, t in seq.inputs.items()):  # host sync: probing step only
        return [], "the inputs read the same in the permuted order"
    tolerance = logit_tolerance(out)
    moved = rows_output(call.call(permuted), batch_size)
    if moved is None or moved.shape != out.shape:
        return [], "the permuted call returned outputs of another shape"
    order_change, _ = max_change(out[:, order] if per_position else out, moved)
    columns = free.to(out.device)
    replaced = {p: _replace_columns(t, columns) for p, t in {**seq.inputs, **seq.labels}.items()}
    content = rows_output(call.call(replaced), batch_size)
    content_change = (
        max_change(out, content)[0] if content is not None and content.shape == out.shape else out.new_zeros(())
    )
    need, pair = _labels_need_order(seq, labels, ignore_index)
    readings: list[Reading] = [
        OrderSeenReading(
            order_change, content_change, tolerance, per_position, seq.length, int(free.numel()),
            _described(call, seq), need, pair,
        )
    ]  # fmt: skip
    if per_position:  # causal or bidirectional: the last free position replaced, the outputs before it read
        last = int(free[-1])
        late = rows_output(call.call({p: _replace_columns(t, free[-1:]) for p, t in seq.inputs.items()}), batch_size)
        if late is not None and late.shape == out.shape:
            before = max_change(out[:, :last], late[:, :last])[0]
            at = max_change(out[:, last : last + 1], late[:, last : last + 1])[0]
            readings.append(CausalKindReading(before, at, tolerance, last))
    return readings, None


def _replace_columns(t: Tensor, columns: Tensor) -> Tensor:
    """``t`` with ``columns`` of every row taken from the row before it (the first from the last)."""
    changed = t.clone()
    index = columns.to(t.device)
    changed[:, index] = t.roll(1, 0)[:, index]
    return changed


def _labels_need_order(
    seq: Sequences, labels: Tensor | None, ignore_index: int
) -> tuple[Tensor | None, tuple[Tensor, Tensor, Tensor] | None]:
    """Whether some row holds the same inputs at two supervised positions with different labels (a device bool), and
    the first such ``(row, i, j)``; ``(None, None)`` without per-position labels of the sequences' length."""
    found = [t for t in seq.labels.values()]
    if labels is not None and labels.ndim == 2 and labels.shape[1] == seq.length and not labels.is_floating_point():
        found.append(labels)
    if not found:
        return None, None
    rows, n = min(LABEL_ROWS, found[0].shape[0]), min(LABEL_POSITIONS, seq.length)
    target = found[0][:rows, :n].to(next(iter(seq.inputs.values())).device)
    keys = torch.cat([t[:rows, :n].reshape(rows, n, -1).float() for t in seq.inputs.values()], dim=-1)
    same = (keys[:, :, None, :] == keys[:, None, :, :]).all(-1)  # (rows, n, n): the same inputs at i and j
    supervised = target != ignore_index
    for padded in seq.padded:
        supervised &= ~padded[:rows, :n].to(target.device)
    differ = (target[:, :, None] != target[:, None, :]) & supervised[:, :, None] & supervised[:, None, :]
    hits = (same & differ).flatten()
    first = hits.int().argmax()
    pair = (first // (n * n), first // n % n, first % n)
    return hits.any(), pair


class OrderWatch:
    """The harm of an order-blind model, decided from the losses ``training_step`` returned. :meth:`start` at the
    any-inputs probe (the same step on every rank) fixes the decision step; :meth:`arm` with the host reading of an
    order-blind model; :meth:`add` the loss of the few fixed steps it reads, on the device (no host sync);
    :meth:`decide` once, at the decision step, with one host transfer of two sums."""

    def __init__(self) -> None:
        self.blind: OrderSeenReading | None = None
        self.start_step: int | None = None
        self.decide_at: int | None = None
        self.done = False
        self.step: int | None = None  # the step of the batch in progress (set by the callback's capture)
        self._sums: dict[str, Tensor] = {}
        self._counts: dict[str, int] = {"early": 0, "late": 0}  # losses added (micro-batches)
        self._steps: dict[str, set[int]] = {"early": set(), "late": set()}  # the optimizer steps they came from

    def start(self, step: int, last_step: float) -> None:
        """The any-inputs path ran at ``step``: decide at ``DECIDE_STEP`` steps later, or at the fit's last step."""
        if self.start_step is None:
            self.start_step = step
            self.decide_at = int(min(step + DECIDE_STEP, max(step, last_step)))

    def arm(self, blind: OrderSeenReading) -> None:
        """Watch the losses of a model order-blind (or undecided) at the first probe."""
        self.blind = blind

    def conclude(self, member: Any, again: OrderSeenReading | None) -> Verdict | None:
        """At the decision step: the verdict (dated there), and ``member``'s "positions and order" row when the
        verdict does not mark it. Host sync: two sums, once per fit."""
        reading, verdict = self.decide(member.to_host, again)
        if reading is not None:  # probed: a TFD215 among the row's codes marks it in the report (said before a resume)
            cover_order(member, reading)  # sees order, cannot tell, or order-blind (by design: TFD218, verified)
        return None if verdict is None else dataclasses.replace(verdict, step=self.decide_at)

    def clear_losses(self) -> None:
        """Forget the losses read so far (a decision without a trend)."""
        self._sums.clear()
        self._counts = {"early": 0, "late": 0}

    def records(self, step: int) -> bool:
        """Whether ``step`` is the decision step of an order-blind model: its model call is recorded and probed
        again (a position table initialised to zeros is order-blind at the first step only)."""
        return self.blind is not None and not self.done and step == self.decide_at

    def window(self, step: int) -> list[str]:
        """The loss windows ``step`` belongs to (empty: the step is not read)."""
        if self.blind is None or self.done or self.decide_at is None or self.start_step is None:
            return []
        early = self.start_step <= step < self.start_step + EARLY_STEPS
        late = self.decide_at - LATE_STEPS < step <= self.decide_at
        return [w for w, hit in (("early", early), ("late", late)) if hit]

    def add(self, step: int, loss: Tensor | None) -> None:
        """Add the loss of ``step`` to its windows, on the device (no host sync)."""
        for w in self.window(step) if loss is not None else []:
            value = loss.detach().float().reshape(-1)[0]
            self._sums[w] = self._sums[w] + value if w in self._sums else value
            self._counts[w] += 1
            self._steps[w].add(step)

    def decide(
        self, to_host: Any, again: OrderSeenReading | None = None
    ) -> tuple[OrderSeenReading | None, Verdict | None]:
        """Once: the reading that decides (``again``, the order probe at the decision step, when it decided, else the
        first; None when nothing was armed) and the verdict of an order-blind model (else None). Host sync: one
        transfer of the windows' two sums, once per fit."""
        reading, self.blind, self.done = self.blind, None, True
        if again is not None and again.blind is not None:
            reading = again
        if reading is None or not reading.blind or self.decide_at is None or self.start_step is None:
            return reading, None
        trend = None
        if self._counts["early"] and self._counts["late"]:
            host = to_host(dict(self._sums))  # host sync: once per fit, at the decision
            early, late = host["early"] / self._counts["early"], host["late"] / self._counts["late"]
            steps = self.decide_at - self.start_step
            trend = LossTrend(early, late, len(self._steps["early"]), len(self._steps["late"]), steps)
        self._sums.clear()
        return reading, decide_order_blind(reading, trend)


def conclude(member: Any, watch: OrderWatch, readings: list[Reading], why_not: str | None, noisy: bool) -> None:
    """Cover "positions and order" and "causal mask" of ``member`` (MaskProbe) from the host readings of
    :func:`probe_order`, and arm ``watch`` (started) on an order-blind model (its severity is decided later)."""
    if noisy:  # TFD213: the forward is random in eval mode, every comparison measures its noise
        member.cover("positions and order", "unknown", "the forward is random in eval mode (TFD213)")
        return
    if why_not is not None:
        status = "n/a" if why_not.startswith("the model call takes no sequence") else "unknown"
        member.cover("positions and order", status, f"order probe on the recorded call: {why_not}")
        return
    for r in readings:
        if isinstance(r, OrderSeenReading) and r.blind is False:
            member.cover("positions and order", "verified")
        elif isinstance(r, OrderSeenReading):  # order-blind or undecided: probed again and decided later
            watch.arm(r)
        elif isinstance(r, CausalKindReading) and r.kind == "causal":
            member.cover("causal mask", "verified")
        elif isinstance(r, CausalKindReading) and r.kind == "bidirectional":
            why = (
                f"measured bidirectional: replacing position {r.position} moved the outputs before it by "
                f"{float(r.before):.3g} (tolerance {float(r.tolerance):.2g})"
            )
            member.cover("causal mask", "n/a", why)
            member.cover("label alignment", "n/a", f"{why}: no next-token labels to align")


def cover_order(member: Any, reading: OrderSeenReading) -> None:
    """The "positions and order" row of ``member`` from the reading that decided it (an order-blind model that the
    objective does not need order from: verified, ``TFD218`` says it)."""
    if reading.blind is not None:
        member.cover("positions and order", "verified")
        return
    why = (
        f"permuting the positions moved the outputs by {float(reading.order_change):.3g} (tolerance "
        f"{float(reading.tolerance):.2g}), replacing them by {float(reading.content_change):.3g}: too little to tell"
    )
    member.cover("positions and order", "unknown", why)
