"""BatchGuard's rules across batches: batches that repeat sooner than the data allows, length shifts, and a
resume that replays or skips part of an epoch. The trackers record each batch (``update``); the rules read them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch import Tensor

from lightning_tfdebug.callbacks.batch_guard.readings import MAX_EPOCH_PRINTS, MIN_EXCESS_REPEATS, STREAM_REPEAT_WINDOW
from lightning_tfdebug.functional.batches import EpochData, device_fingerprint, host_fingerprint, length_shift
from lightning_tfdebug.functional.verdicts import Rule, Verdict

# ------------------------------------------------------------------------------------------------ across batches
TFD121 = Rule(
    "TFD121",
    "warning",
    "BatchGuard",
    title="batches of one epoch repeat earlier batches of that epoch token for token",
    trigger=(
        "over `max_repeated_fraction` of an epoch's batches (and 3) equal an earlier one of it (a stream: within 16)"
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
    prints: dict[int, tuple[int, int]] = field(default_factory=dict)  # fingerprint -> (checked index, step)

    def add(self, epoch: int, step: int, fingerprint: int, stream: bool, rank: int = 0) -> Verdict | None:
        """Count the batch of ``step``; its verdict belongs to that step."""
        if epoch != self.epoch:
            self.epoch, self.checked, self.repeated = epoch, 0, 0
            self.prints.clear()
        earlier = self.prints.get(fingerprint)
        if earlier is not None and (not stream or self.checked - earlier[0] <= STREAM_REPEAT_WINDOW):
            self.repeated += 1
            self.first_repeat = self.first_repeat or (step, earlier[1])
        if len(self.prints) < MAX_EPOCH_PRINTS or fingerprint in self.prints:
            self.prints[fingerprint] = (self.checked, step)
        self.checked += 1
        if self.repeated < 3 or self.repeated <= self.max_repeated_fraction * self.checked:
            return None
        first_step, earlier_step = self.first_repeat or (step, -1)
        evidence = {"epoch": epoch, "checked": self.checked, "repeated": self.repeated}
        evidence |= {"step": first_step, "repeats_step": earlier_step}
        return TFD121.verdict(evidence, step=step, rank=rank)


TFD120 = Rule(
    "TFD120",
    "warning",
    "BatchGuard",
    title="the length distribution moved away from the early batches",
    trigger="a window's mean real length moved from the first window's by over `length_shift_tolerance` and one std",
    hint=(
        "The data changed under the run: a new shard or source, a tokenizer swap, sorted or curriculum data, or a "
        "truncation setting that differs between files."
    ),
    reason="Measured in this run: later batches differ from the early ones (data sorted or grouped)",
    message=(
        "{where}: the mean sequence length of the last {size} checked batches is {window_mean:.1f}, against "
        "{reference_mean:.1f} (std {reference_std:.1f}) in the first ones."
    ),
)


@dataclass
class LengthWindow:
    """``TFD120``: the mean real sequence length of a window of checked batches against the first window."""

    size: int = 50
    tolerance: float = 0.5
    reference: dict[str, float] | None = None  # {"mean", "std"} of real lengths in the first window
    sums: list[float] = field(default_factory=lambda: [0.0, 0.0, 0.0, 0])  # sequences, sum, sum of squares, batches

    def add(self, s: dict[str, float], where: str) -> Verdict | None:
        w = self.sums
        w[0] += s["sequences"]
        w[1] += s["length_sum"]
        w[2] += s["length_sq_sum"]
        w[3] += 1
        if w[3] < self.size:
            return None
        mean = w[1] / max(w[0], 1.0)
        std = max(w[2] / max(w[0], 1.0) - mean * mean, 0.0) ** 0.5
        self.sums = [0.0, 0.0, 0.0, 0]
        if self.reference is None:
            self.reference = {"mean": mean, "std": std}
            return None
        ref = self.reference
        if not length_shift(ref["mean"], ref["std"], mean, self.tolerance):
            return None
        evidence = {"window_mean": mean, "reference_mean": ref["mean"], "reference_std": ref["std"]}
        return TFD120.verdict(evidence, where=where, size=self.size)


TFD123 = Rule(
    "TFD123",
    "warning",
    "BatchGuard",
    title="the same batches come back sooner than the data allows",
    trigger=(
        "fewer different batches than min(read, the DataLoader's length) by 3 and `max_repeated_fraction` of it, or "
        "repeats inside epochs summed to as many; silent once TFD121 has spoken"
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
    seen: dict[int, int] = field(default_factory=dict)  # fingerprint -> step first read
    within: int = 0  # batches that repeated an earlier batch of their own epoch, summed over epochs
    first_repeat: tuple[int, int] | None = None  # (step, step of the earlier identical batch)
    saturated: bool = False  # more than MAX_EPOCH_PRINTS different batches: the data does not repeat early

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
        """Count the batch of ``step``. ``loader_length``: batches per epoch before any Trainer limit (None: a
        stream); ``within_epoch``: it repeats one of its own epoch; ``per_epoch``, ``setting``: :class:`EpochData`'s."""
        self.read += 1
        self.within += int(within_epoch)
        earlier = self.seen.get(fingerprint)
        if earlier is None:
            self.saturated = self.saturated or len(self.seen) >= MAX_EPOCH_PRINTS
            if not self.saturated:
                self.seen[fingerprint] = step
        elif self.first_repeat is None:
            self.first_repeat = (step, earlier)
        known = loader_length is not None and loader_length > 0 and not self.saturated
        allowed = min(self.read, loader_length) if known and loader_length else self.read
        excess = allowed - len(self.seen) if known else 0
        early = excess >= MIN_EXCESS_REPEATS and excess > self.max_repeated_fraction * allowed
        inside = self.within >= MIN_EXCESS_REPEATS and self.within > self.max_repeated_fraction * self.read
        if not (early or inside):
            return None
        return self._verdict(step, loader_length if known else None, per_epoch, setting, rank)

    def _verdict(self, step: int, length: int | None, per_epoch: int | None, setting: str | None, rank: int) -> Verdict:
        first_step, earlier_step = self.first_repeat or (step, -1)
        distinct = len(self.seen)
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


#: One batch's fingerprint waiting to be read: (epoch, step, the epoch's data, the fingerprint: a host int for a CPU
#: batch, else a device scalar read with the next checked batch's transfer)
PendingPrint = tuple[int, int, EpochData, Any]


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

    def add(self, epoch: int, step: int, data: EpochData, ids: Tensor) -> None:
        """Fingerprint the batch of ``step`` (every batch, on the hot path): a CPU batch from its bytes (a host int),
        else on its device with no sync, read with the next checked batch."""
        fingerprint = host_fingerprint(ids)
        self.pending.append((epoch, step, data, device_fingerprint(ids) if fingerprint is None else fingerprint))

    def take(self) -> list[PendingPrint]:
        """The fingerprints not yet read, in order; none are pending afterwards."""
        prints, self.pending = self.pending, []
        return prints

    @staticmethod
    def on_device(prints: list[PendingPrint]) -> list[Any]:
        """The device fingerprints of ``prints``, in order (what :meth:`read` expects back on the host)."""
        return [p[3] for p in prints if isinstance(p[3], Tensor)]

    def read(self, prints: list[PendingPrint], device_values: list[float], rank: int = 0) -> list[Verdict]:
        """Verdicts from ``prints``, the device ones' values in ``device_values`` (in :meth:`on_device`'s order)."""
        values = iter(device_values)
        out: list[Verdict] = []
        for epoch, step, data, fingerprint in prints:
            fingerprint = int(next(values) if isinstance(fingerprint, Tensor) else fingerprint)
            earlier = self.within.repeated if self.within.epoch == epoch else 0  # the tracker resets per epoch
            found = self.within.add(epoch, step, fingerprint, data.stream, rank)
            self.spoken = self.spoken or found is not None
            period = None
            if epoch != self.resumed_epoch:
                period = self.period.add(
                    step,
                    fingerprint,
                    None if data.stream else data.loader_length,
                    within_epoch=self.within.repeated > earlier,  # this batch repeats one of its own epoch
                    per_epoch=data.per_epoch,
                    setting=data.setting,
                    rank=rank,
                )
            out += [v for v in (found, None if self.spoken else period) if v is not None]
        return out


def _batch_range(first: int, last: int) -> str:
    return f"batch {first}" if first == last else f"batches {first}-{last}"


TFD125 = Rule(
    "TFD125",
    "warning",
    "BatchGuard",
    title="resumed mid-epoch with a DataLoader that cannot restore its position",
    trigger=(
        "a fit resumes at batch S > 0 of an epoch and a training DataLoader has no `state_dict`/`load_state_dict`; "
        "info when it shuffles"
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


BLOCK = ("TFD101", "TFD129")
"""The codes reserved for BatchGuard's rules."""

RULES: tuple[Rule, ...] = (
    TFD120,
    TFD121,
    TFD123,
    TFD125,
)
"""The rules decided in this module, in code order."""
