"""The rows BatchGuard compares for train/validation leakage, from the batch to :class:`.leakage_checks.LeakageWatch`:
fingerprinted on the device when read, waiting there until a transfer the callback already makes (training rows:
the checked batch's; validation and test rows: one at the end of their loop), then host arrays that cross ranks
(:meth:`LeakageRows.outbox`) and feed the watch in rank order, so every rank holds the same memories."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import Tensor

from lightning_tfdebug.callbacks.batch_guard.leakage_checks import LeakageWatch
from lightning_tfdebug.callbacks.batch_guard.row_prints import informative, key_halves, row_field, row_keys
from lightning_tfdebug.primitives.batch import StepBatch

MAX_PENDING_ROWS = 1 << 20
"""Training rows waiting on the device (8 bytes each) at most; past it, rows are not remembered until the next
read (a run whose batches have no token ids is read only at its validation and its end)."""

LEAKAGE_CHECK = "train/validation leakage (TFD126, TFD127)"
"""The check's name where it stands aside."""

LEAKAGE_ROW = "train/validation leakage"
"""The check's row of the run's Coverage table."""


def leakage_aside(loop: str) -> tuple[str, str]:
    """Why the check stands aside when a ``loop`` batch shares no field with the training batches, and the setting."""
    return f"a {loop} batch has no field the training batches are compared on", "`input_key` naming the ids of both"


@dataclass(frozen=True)
class PendingRows:
    """One batch's row keys on its device, and where the batch was read (``place``: the columns of its rows but the
    row, which is added per row: training ``(step, rank)``, a loop's ``(loop_step, dataloader, batch, rank)``)."""

    loop: str  # "train", "validation" or "test"
    place: tuple[int, ...]
    keys: Tensor  # (rows,) int64 hashes (row_keys')
    informative: Tensor | None = None  # (rows,) bool, for a loop's rows


def _keys(host: Any) -> np.ndarray:
    """Two 31-bit hashes per row (host floats, exact) as one 62-bit key."""
    pairs = np.asarray(host, dtype=np.float64).reshape(-1, 2).astype(np.int64)
    return (pairs[:, 0] << 31) | pairs[:, 1]


def _places(place: tuple[int, ...], rows: int) -> np.ndarray:
    """``rows`` places: ``place`` with the row index inserted before its last column (the rank)."""
    out = np.empty((rows, len(place) + 1), np.int32)
    out[:, :-2] = place[:-1]
    out[:, -2] = np.arange(rows)
    out[:, -1] = place[-1]
    return out


@dataclass
class LeakageRows:
    """Pending row keys and the host records waiting to cross ranks; :attr:`watch` decides."""

    watch: LeakageWatch = field(default_factory=LeakageWatch)
    trained_field: str | None = None  # what training rows are compared on ("input_ids" or a path)
    pending: list[PendingRows] = field(default_factory=list)
    pending_train_rows: int = 0
    records: dict[str, list[np.ndarray]] = field(default_factory=lambda: {"train": [], "validation": [], "test": []})
    loops: set[str] = field(default_factory=set)  # the loops that have read rows
    pad_ids: tuple[int, ...] | None = None  # the run's padding ids (None: not learned yet), for rows without a mask

    def new_fit(self) -> None:
        """A new fit trains anew: nothing is remembered."""
        self.watch = LeakageWatch(self.watch.max_overlap_fraction)
        self.trained_field, self.pending, self.pending_train_rows, self.loops = None, [], 0, set()
        self.pad_ids = None
        self.records = {"train": [], "validation": [], "test": []}

    def add_trained(self, view: StepBatch, step: int, rank: int, ignore_index: int, aligned: bool) -> None:
        """A training batch's row keys, on its device (every batch, the hot path: kernels only, no sync)."""
        if self.pending_train_rows >= MAX_PENDING_ROWS:
            return
        found = row_field(view, self.trained_field, ignore_index, aligned, self.pad_ids or ())
        if found is None:
            return
        self.trained_field = self.trained_field or found.name
        keys = row_keys(found.rows, found.mask)
        self.pending.append(PendingRows("train", (step, rank), keys))
        self.pending_train_rows += keys.shape[0]

    def add_loop(
        self, loop: str, view: StepBatch, place: tuple[int, int, int, int], ignore_index: int, aligned: bool
    ) -> bool:
        """A validation or test batch's row keys and whether each row is compared, on its device (no sync); False
        when the batch shares no field with the training batches."""
        found = row_field(view, self.trained_field, ignore_index, aligned, self.pad_ids or ())
        if found is None:
            return False
        keys, kept = row_keys(found.rows, found.mask), informative(found.rows, found.mask)
        self.pending.append(PendingRows(loop, place, keys, kept))
        self.loops.add(loop)
        return True

    def device_fields(self, train_only: bool = False) -> tuple[list[PendingRows], dict[str, Tensor]]:
        """The pending rows taken (training rows only with ``train_only``) and their keys as named device tensors
        for the caller's one transfer (``{}`` when none)."""
        taken = [p for p in self.pending if not train_only or p.loop == "train"]
        self.pending = [p for p in self.pending if train_only and p.loop != "train"]
        self.pending_train_rows = sum(p.keys.shape[0] for p in self.pending if p.loop == "train")
        if not taken:
            return [], {}
        device = taken[0].keys.device
        keys = key_halves(torch.cat([p.keys.to(device) for p in taken]))  # once per read, not per batch
        out = {"row_keys": keys}
        loop = [p.informative for p in taken if p.informative is not None]
        if loop:
            out["row_informative"] = torch.cat([t.to(device) for t in loop])
        return taken, out

    def read(self, taken: list[PendingRows], host: dict[str, Any]) -> None:
        """File the taken rows' host values (from :meth:`device_fields`' fields) as records waiting to be merged."""
        if not taken:
            return
        keys = _keys(host["row_keys"])
        kept = np.asarray(host.get("row_informative", []), dtype=np.float64).reshape(-1) > 0
        at = flag = 0
        for p in taken:
            n = p.keys.shape[0]
            record = np.empty((n, len(p.place) + 3), np.int64)
            record[:, 0] = keys[at : at + n]
            record[:, 1:-1] = _places(p.place, n)
            record[:, -1] = 1
            if p.informative is not None:
                record[:, -1] = kept[flag : flag + n]
                flag += n
            self.records[p.loop].append(record)
            at += n

    def outbox(self) -> dict[str, np.ndarray]:
        """This rank's records not yet merged, one array per loop (they leave the box)."""
        out = {}
        for loop, parts in self.records.items():
            if parts:
                out[loop] = np.concatenate(parts)
        self.records = {"train": [], "validation": [], "test": []}
        return out

    def coverage(self, aside: bool) -> tuple[str, str | None, str | None]:
        """The check's Coverage row at the end of a fit (status, reason, setting); ``aside``: a loop's batches shared
        no field with the training batches."""
        if not self.loops:
            return "n/a", "the run has no validation or test loop.", None
        if any(len(rows) for rows in self.watch.loops.values()):
            return "verified", None, None
        if aside:
            return "unknown", "the validation batches share no field with the training batches.", "`input_key`"
        return "unknown", "no validation row was long and varied enough to compare (8 positions, 4 values).", None

    def merge(self, everyone: list[dict[str, np.ndarray]]) -> None:
        """Every rank's records (rank ``r`` at index ``r``) into the watch, training rows first, in rank order."""
        for records in everyone:
            train = records.get("train")
            if train is not None:
                self.watch.add_trained(train[:, 0], train[:, 1:-1].astype(np.int32))
        for records in everyone:
            for loop, rows in records.items():
                if loop != "train":
                    self.loops.add(loop)
                    self.watch.add_compared(loop, rows[:, 0], rows[:, 1:-1].astype(np.int32), rows[:, -1] > 0)
