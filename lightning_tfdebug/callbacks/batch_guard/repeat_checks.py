"""BatchGuard's rules across batches, from the fingerprints of the batches read: repeats inside an epoch
(``TFD121``), batches that come back sooner than the data allows (``TFD123``), and a resume that restarts its epoch
(``TFD125``).

Each tracker records (``record``) apart from deciding (``verdict``); ``add`` does both, in that order.
:class:`FingerprintMemory` holds every different batch of the fit by fingerprint (the step it was first read), so a
later check can ask whether another batch was trained on.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

from torch import Tensor

from lightning_tfdebug.callbacks.batch_guard.loaders import EpochData
from lightning_tfdebug.functional.batches import device_fingerprint, host_fingerprint
from lightning_tfdebug.functional.verdicts import Rule, Verdict

STREAM_REPEAT_WINDOW = 16
"""From a stream, a repeat counts only this close (a stream may cycle its data)."""

MAX_EPOCH_PRINTS = 100_000
"""Fingerprints kept per epoch for ``TFD121``, and per fit for ``TFD123`` (a few MB at most)."""

MIN_EXCESS_REPEATS = 3
"""``TFD121`` and ``TFD123`` need at least this many repeated batches."""


# ------------------------------------------------------------------------------------------------------ within an epoch


TFD121 = Rule(
    "TFD121",
    "warning",
    "BatchGuard",
    title="batches of one epoch repeat earlier batches of that epoch token for token",
    headline="{repeated} of {checked} batches of epoch {epoch} repeat earlier ones token for token",
    trigger=(
        "over `max_repeated_fraction` of an epoch's batches (and 3) equal an earlier one of it (a stream: within 16)"
    ),
    details=(
        "Every batch gets a fingerprint (a hash of its token ids, on the device, read with the next value-checked "
        "batch's transfer, so the finding may come a few steps after the repeat). Within one epoch, more than "
        "`max_repeated_fraction` (default 0.1) of the batches read so far, and at least 3, are identical to an "
        "earlier batch of the same epoch; for a stream (an IterableDataset or any iterable that is not a DataLoader "
        "over a map-style dataset) only a repeat within 16 batches counts. Up to 100,000 fingerprints per epoch are "
        "kept."
    ),
    hint=(
        "Within one epoch a sampler draws every sample once, so identical batches mean the data is read more than "
        "once: an IterableDataset read by several DataLoader workers that do not split the stream (shard it with "
        "torch.utils.data.get_worker_info()), a Dataset whose __getitem__ ignores its index, a sampler with "
        "replacement, or duplicated rows in the data."
    ),
    reason="Measured in this run: one epoch trains on duplicates instead of the data",
    message=(
        "{repeated} of the {checked} batches checked so far in epoch {epoch} (rank {rank}) repeat an earlier batch of "
        "the same epoch token for token; the first, at step {step}, repeats step {repeats_step}."
    ),
)


class Seen(NamedTuple):
    """Where a fingerprint was read in its epoch."""

    index: int  # the how-many-th batch of the epoch (from 0)
    step: int


@dataclass
class RepeatTracker:
    """``TFD121``: batches of one epoch that repeat an earlier batch of that epoch, token for token, fed in order.

    A sampler draws each sample once per epoch, so any repeat is suspect; a stream may cycle its data, so there only
    repeats within :data:`STREAM_REPEAT_WINDOW` batches count.
    """

    max_repeated_fraction: float = 0.1
    epoch: int = -1
    checked: int = 0
    repeated: int = 0
    first_repeat: tuple[int, int] | None = None  # (step, step of the earlier identical batch)
    prints: dict[int, Seen] = field(default_factory=dict)  # fingerprint -> where it was read in this epoch

    def record(self, epoch: int, step: int, fingerprint: int, stream: bool) -> bool:
        """Count the batch of ``step``; whether it repeats an earlier batch of its epoch."""
        if epoch != self.epoch:
            self.epoch, self.checked, self.repeated = epoch, 0, 0
            self.prints.clear()
        earlier = self.prints.get(fingerprint)
        repeats = earlier is not None and (not stream or self.checked - earlier.index <= STREAM_REPEAT_WINDOW)
        if repeats:
            assert earlier is not None
            self.repeated += 1
            self.first_repeat = self.first_repeat or (step, earlier.step)
        if len(self.prints) < MAX_EPOCH_PRINTS or fingerprint in self.prints:
            self.prints[fingerprint] = Seen(self.checked, step)
        self.checked += 1
        return repeats

    def verdict(self, step: int, rank: int = 0) -> Verdict | None:
        """``TFD121`` once the epoch's repeats reach :data:`MIN_EXCESS_REPEATS` and ``max_repeated_fraction``."""
        if self.repeated < MIN_EXCESS_REPEATS or self.repeated <= self.max_repeated_fraction * self.checked:
            return None
        first_step, earlier_step = self.first_repeat or (step, -1)
        evidence = {"epoch": self.epoch, "checked": self.checked, "repeated": self.repeated}
        evidence |= {"step": first_step, "repeats_step": earlier_step}
        return TFD121.verdict(evidence, step=step, rank=rank)

    def add(self, epoch: int, step: int, fingerprint: int, stream: bool, rank: int = 0) -> Verdict | None:
        """Count the batch of ``step`` and decide; its verdict belongs to that step."""
        self.record(epoch, step, fingerprint, stream)
        return self.verdict(step, rank)


# -------------------------------------------------------------------------------------------------------- across epochs


@dataclass
class FingerprintMemory:
    """Every different batch a fit has read, by fingerprint: the step it was first read at. Full past
    :data:`MAX_EPOCH_PRINTS` different batches (``saturated``): a fingerprint not in it may then have been read."""

    seen: dict[int, int] = field(default_factory=dict)  # fingerprint -> step first read
    saturated: bool = False

    def first_read(self, fingerprint: int) -> int | None:
        """The step the batch of ``fingerprint`` was first read at; None when it was not (or not kept)."""
        return self.seen.get(fingerprint)

    def remember(self, fingerprint: int, step: int) -> None:
        """Keep ``fingerprint`` (read at ``step``) unless it is known or the memory is full."""
        if fingerprint in self.seen:
            return
        self.saturated = self.saturated or len(self.seen) >= MAX_EPOCH_PRINTS
        if not self.saturated:
            self.seen[fingerprint] = step


TFD123 = Rule(
    "TFD123",
    "warning",
    "BatchGuard",
    title="the same batches come back sooner than the data allows",
    headline="the same batches come back sooner than the data allows (from step {repeats_step})",
    trigger=(
        "fewer different batches than min(read, the DataLoader's length) by 3 and `max_repeated_fraction` of it, or "
        "repeats inside epochs summed to as many; silent once TFD121 has spoken"
    ),
    details=(
        "From the same fingerprints as `TFD121`, across the fit: with a map-style DataLoader of `N` batches per epoch"
        " (its length, before any Trainer limit), after `read` batches the number of different ones falls short of "
        "`min(read, N)` by at least 3 and by more than `max_repeated_fraction` (default 0.1) of `min(read, N)`; or "
        "the repeats inside epochs summed over the run reach 3 and more than `max_repeated_fraction` of the batches "
        "read. Silent once `TFD121` has fired; the epoch restarted by a mid-epoch resume (`TFD125`) is not counted; "
        "streams are left to `TFD121`. The message names `overfit_batches` / `limit_train_batches` when the Trainer "
        "sets either."
    ),
    hint=(
        "Remove Trainer(overfit_batches=...) or a limit_train_batches on an unshuffled DataLoader left on from "
        "debugging (every epoch then reads the same first batches); otherwise find what makes the data repeat: a "
        "Dataset whose __getitem__ ignores its index, a DataLoader or sampler that yields the same batch."
    ),
    reason="evidence of harm in this run: the model memorises a fraction of its data and never reads the rest",
    message=(
        "{what}: the same batches come back sooner than the data allows ({repeats_within_epochs} of them repeat a "
        "batch of their own epoch; the first repeat, at step {step}, repeats step {repeats_step}).{cause}"
    ),
)


@dataclass
class RepeatPeriod:
    """``TFD123``: the same batches come back sooner than the data allows, across epochs; fed in order.

    A map-style DataLoader of ``N`` batches delivers ``min(read, N)`` different batches in its first ``read``, whatever
    the sampler. The excess ``min(read, N) - distinct`` must reach :data:`MIN_EXCESS_REPEATS` and exceed
    ``max_repeated_fraction`` of ``min(read, N)``; or the repeats inside epochs (``TFD121``'s reading) summed over the
    run reach as many (epochs of two batches never hold three repeats each).
    """

    max_repeated_fraction: float = 0.1
    read: int = 0
    memory: FingerprintMemory = field(default_factory=FingerprintMemory)
    within: int = 0  # batches that repeated an earlier batch of their own epoch, summed over epochs
    first_repeat: tuple[int, int] | None = None  # (step, step of the earlier identical batch)

    def record(self, step: int, fingerprint: int, within_epoch: bool = False) -> None:
        """Count the batch of ``step``; ``within_epoch``: it repeats one of its own epoch."""
        self.read += 1
        self.within += int(within_epoch)
        earlier = self.memory.first_read(fingerprint)
        if earlier is None:
            self.memory.remember(fingerprint, step)
        elif self.first_repeat is None:
            self.first_repeat = (step, earlier)

    def verdict(
        self, step: int, loader_length: int | None, per_epoch: int | None, setting: str | None, rank: int = 0
    ) -> Verdict | None:
        """``TFD123`` from what was recorded. ``loader_length``: batches per epoch before any Trainer limit (None: a
        stream); ``per_epoch``, ``setting``: :class:`~lightning_tfdebug.callbacks.batch_guard.loaders.EpochData`'s."""
        distinct = len(self.memory.seen)
        known = loader_length is not None and loader_length > 0 and not self.memory.saturated
        allowed = min(self.read, loader_length) if known and loader_length else self.read
        excess = allowed - distinct if known else 0
        early = excess >= MIN_EXCESS_REPEATS and excess > self.max_repeated_fraction * allowed
        inside = self.within >= MIN_EXCESS_REPEATS and self.within > self.max_repeated_fraction * self.read
        if not (early or inside):
            return None
        return self._verdict(step, loader_length if known else None, per_epoch, setting, rank)

    def add(
        self,
        step: int,
        fingerprint: int,
        loader_length: int | None,
        *,
        within_epoch: bool = False,
        per_epoch: int | None = None,
        setting: str | None = None,
        rank: int = 0,
    ) -> Verdict | None:
        """Count the batch of ``step`` (:meth:`record`) and decide (:meth:`verdict`)."""
        self.record(step, fingerprint, within_epoch)
        return self.verdict(step, loader_length, per_epoch, setting, rank)

    def _verdict(self, step: int, length: int | None, per_epoch: int | None, setting: str | None, rank: int) -> Verdict:
        first_step, earlier_step = self.first_repeat or (step, -1)
        distinct = len(self.memory.seen)
        if length is not None:
            what = (
                f"Rank {rank} read {self.read} batches and only {distinct} of them are different, while its training "
                f"DataLoader holds {length} batches per epoch"
            )
        else:
            what = f"Rank {rank} read {self.read} batches from a stream and {self.within} repeat a recent one"
        if setting is not None:
            per = f"{per_epoch} batch(es)" if per_epoch is not None else "the same batches"
            cause = (
                f" {setting} is set: every epoch reads the same {per} of the {length} the DataLoader holds, and"
                " the loss falls by memorising them."
            )
        else:
            cause = (
                " No Trainer limit is set: the data itself repeats (a Dataset whose __getitem__ ignores its index, a "
                "DataLoader or sampler that yields the same batch)."
            )
        evidence = {"read": self.read, "distinct": distinct, "repeats_within_epochs": self.within}
        evidence |= {"loader_length": length, "batches_per_epoch": per_epoch, "setting": setting}
        evidence |= {"step": first_step, "repeats_step": earlier_step}
        return TFD123.verdict(evidence, step=step, what=what, cause=cause)


# ------------------------------------------------------------------------------------------------------- both, in order


@dataclass(frozen=True)
class PendingPrint:
    """One batch's fingerprint waiting to be read."""

    epoch: int
    step: int
    data: EpochData
    fingerprint: Any  # a host int for a CPU batch, else a device scalar read with the next checked batch's transfer


@dataclass
class BatchRepeats:
    """``TFD121`` and ``TFD123`` from the fingerprints of the batches read, in order.

    Fingerprints wait in :attr:`pending` until they reach the host (device ones with a checked batch's transfer);
    :meth:`read` feeds them to :class:`RepeatTracker` and :class:`RepeatPeriod`. ``TFD123`` stays silent once
    ``TFD121`` has named the repeats, and does not count the epoch a mid-epoch resume restarted (``TFD125``'s).
    """

    max_repeated_fraction: float = 0.1
    pending: list[PendingPrint] = field(default_factory=list)
    spoken: bool = False  # TFD121 was reached
    resumed_epoch: int | None = None  # the epoch a resume restarted mid-way: not counted for TFD123

    def __post_init__(self) -> None:
        self.within = RepeatTracker(self.max_repeated_fraction)
        self.new_fit()

    def new_fit(self) -> None:
        """A new fit reads its data anew: the run-long count starts over."""
        self.period = RepeatPeriod(self.max_repeated_fraction)
        self.spoken, self.resumed_epoch = False, None

    @property
    def trained(self) -> FingerprintMemory:
        """The different training batches this fit has read, by fingerprint (those read so far)."""
        return self.period.memory

    def add(self, epoch: int, step: int, data: EpochData, ids: Tensor) -> None:
        """Fingerprint the batch of ``step`` (every batch, on the hot path): a CPU batch from its bytes (a host int),
        else on its device with no sync, read with the next checked batch."""
        fingerprint = host_fingerprint(ids)
        self.pending.append(
            PendingPrint(epoch, step, data, device_fingerprint(ids) if fingerprint is None else fingerprint)
        )

    def take(self) -> list[PendingPrint]:
        """The fingerprints not yet read, in order; none are pending afterwards."""
        prints, self.pending = self.pending, []
        return prints

    @staticmethod
    def on_device(prints: list[PendingPrint]) -> list[Any]:
        """The device fingerprints of ``prints``, in order (what :meth:`read` expects back on the host)."""
        return [p.fingerprint for p in prints if isinstance(p.fingerprint, Tensor)]

    def read(self, prints: list[PendingPrint], device_values: list[float], rank: int = 0) -> list[Verdict]:
        """Verdicts from ``prints``, the device ones' values in ``device_values`` (in :meth:`on_device`'s order)."""
        values = iter(device_values)
        out: list[Verdict] = []
        for p in prints:
            epoch, step, data = p.epoch, p.step, p.data
            fingerprint = int(next(values) if isinstance(p.fingerprint, Tensor) else p.fingerprint)
            repeats = self.within.record(epoch, step, fingerprint, data.stream)
            found = self.within.verdict(step, rank)
            self.spoken = self.spoken or found is not None
            period = None
            if epoch != self.resumed_epoch:
                self.period.record(step, fingerprint, within_epoch=repeats)
                length = None if data.stream else data.loader_length
                period = self.period.verdict(step, length, data.per_epoch, data.setting, rank)
            out += [v for v in (found, None if self.spoken else period) if v is not None]
        return out


# ------------------------------------------------------------------------------------------------------------- a resume


TFD125 = Rule(
    "TFD125",
    "warning",
    "BatchGuard",
    title="resumed mid-epoch with a DataLoader that cannot restore its position",
    headline="resumed mid-epoch at batch {start} of {per_epoch}: the DataLoader restarts its epoch",
    trigger=(
        "a fit resumes at batch S > 0 of an epoch and a training DataLoader has no `state_dict`/`load_state_dict`; "
        "info when it shuffles"
    ),
    details=(
        "At the fit's first batch, read from the Trainer: the loop resumes at batch `S` of an `N`-batch epoch with `0"
        " < S < N`, and a training DataLoader has no `state_dict` / `load_state_dict` (not a stream, `N` known). A "
        "warning when the loader keeps a fixed order (batches `0..min(S, N-S)-1` train twice and as many at the end "
        "are never read); info when it shuffles (about `(N-S)·S/N` batches' worth of samples repeat). Silent for a "
        "checkpoint at an epoch's end."
    ),
    hint=(
        "Use a DataLoader that Lightning restores (torchdata's StatefulDataLoader, or any loader with state_dict / "
        "load_state_dict), or resume from checkpoints saved at epoch ends (ModelCheckpoint(every_n_epochs=1, "
        "save_on_train_epoch_end=True))."
    ),
    reason="evidence of harm in this run: the resumed epoch trains some batches twice and skips others",
    message=(
        "The fit resumed at batch {start} of a {per_epoch}-batch epoch (step {step}, epoch {epoch}, rank {rank}), and "
        "the training DataLoader cannot restore its position: Lightning restarts it from the epoch's first batch. "
        "{effect}"
    ),
)


def _batch_range(first: int, last: int) -> str:
    return f"batch {first}" if first == last else f"batches {first}-{last}"


def resumed_mid_epoch(start: int, step: int, epoch: int, rank: int, data: EpochData) -> Verdict | None:
    """``TFD125``: the fit's first batch is batch ``start`` > 0 of its epoch (a resume) and the loader restarts.

    The loader yields its batches ``0..N-S-1`` as the epoch's ``S..N-1``: in a fixed order batches
    ``0..min(S, N-S)-1`` train twice and as many at the end are never read; shuffled, a new order is drawn and about
    ``(N-S)·S/N`` batches' worth of samples repeat. Silent for a stateful loader, a stream, an unknown epoch length.
    """
    n = data.per_epoch
    if start <= 0 or data.stateful or data.stream or n is None or start >= n:
        return None
    twice = min(start, n - start)
    evidence = {"start": start, "per_epoch": n, "step": step, "epoch": epoch, "in_order": data.in_order}
    if data.in_order:
        evidence |= {"repeated": [0, twice - 1], "skipped": [n - twice, n - 1]}
        effect = (
            f"In its fixed order, {_batch_range(0, twice - 1)} of the epoch train a second time and "
            f"{_batch_range(n - twice, n - 1)} are never read in it ({twice} each)."
        )
        return TFD125.verdict(evidence, rank=rank, effect=effect)
    expected = (n - start) * start / n
    evidence["expected_repeated"] = expected
    effect = (
        f"The remaining {n - start} batches are drawn in a new order from the whole dataset: about {expected:.0f} "
        "batches' worth of samples trained before the checkpoint train again this epoch, and as many are not read in "
        "it."
    )
    return TFD125.verdict(evidence, severity="info", rank=rank, effect=effect)
