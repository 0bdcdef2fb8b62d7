"""BatchGuard's train/validation leakage rules: validation (``TFD126``) or test (``TFD127``) rows that are rows the
model trained on.

Every row of every training batch is remembered by its 62-bit fingerprint (:mod:`.row_prints`), with the step and row
it was first read at; every informative row of the validation (Lightning's sanity check included) and test batches
likewise, with the batch and row it was read at. A row seen on both sides is an overlapping row, whichever side was
read first: the sanity check's rows are compared with the training rows read after them. The memories are host
NumPy arrays kept sorted (a lookup is a binary search), bounded by :data:`MAX_REMEMBERED_ROWS` rows each: past it,
both sides keep only the rows whose key ends in one more zero bit (the same rows on both sides, so the share stays an
unbiased estimate from the rows kept).

State per remembered row: 8 bytes of key and 12 of place (step, row, rank) for a training row; 8 of key, 20 of place
(step of the loop, dataloader, batch, row, rank), 1 flag and 12 of the matching training place for a compared row.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from lightning_tfdebug.callbacks.batch_guard.row_prints import MIN_DISTINCT_TOKENS, MIN_ROW_TOKENS
from lightning_tfdebug.functional.verdicts import Rule, Verdict

MAX_REMEMBERED_ROWS = 262_144
"""Rows kept per memory (training, validation, test) before the memories sample by key (about 5 MB for the
training rows, 16 MB for all three full)."""

MAX_OVERLAP_FRACTION = 0.1
"""``TFD126``/``TFD127`` above this share of the compared rows overlapping (BatchGuard's `max_overlap_fraction`)."""

MIN_OVERLAP_ROWS = 3
"""``TFD126``/``TFD127`` need at least this many overlapping rows (one natural duplicate among a few rows is not a
share)."""

TRAINED_COLUMNS = ("step", "row", "rank")
COMPARED_COLUMNS = ("loop_step", "dataloader", "batch", "row", "rank")

_DETAILS = (
    "Every row of every training batch is fingerprinted on its device (62-bit key over its real positions, the "
    "attention mask's non-zero entries or, without a mask, the positions not holding the run's padding id, so padding "
    "and batch size do not change it; a masked LM's masked positions take their label back; a field other than token "
    "ids by its first 256 values) and read with BatchGuard's checked-batch transfer. Validation and test rows are "
    "fingerprinted in their loop and read once at its end. Compared: rows with at least "
    f"{MIN_ROW_TOKENS} real positions and {MIN_DISTINCT_TOKENS} different values (all-padding rows, rows of special "
    "tokens and short repeated rows recur in healthy data and are not compared). Fires when at least "
    f"{MIN_OVERLAP_ROWS} compared rows, and more than `max_overlap_fraction` (default {MAX_OVERLAP_FRACTION:.0%}) of "
    "them, equal a row trained on (before or after them), decided at the loop's end, on checked steps (one process) "
    "and at the end of training; under DDP every rank's rows are gathered at those points (not on training steps), "
    f"so a row one rank validates and another trained on counts. Memory: {MAX_REMEMBERED_ROWS} rows per side, then "
    "sampled by key. Batches of another structure are compared on the token ids, else on the training field's path."
)

_HINT = (
    "Check what the {loop} DataLoader reads: a `{hook}` that returns the training split (or the training DataLoader "
    "itself), a split made after shuffling with another seed, or a held-out set built from the same documents. Split "
    "the data once, by document, before tokenizing, and de-duplicate across the splits."
)

TFD126 = Rule(
    "TFD126",
    "error",
    "BatchGuard",
    title="validation rows are rows the model trained on",
    headline="{overlapping} of {compared} validation rows were trained on ({share:.1%})",
    trigger=(
        f"over `max_overlap_fraction` (and {MIN_OVERLAP_ROWS}) of the informative validation rows (the sanity check's "
        "included) equal training rows read before or after them"
    ),
    hint=_HINT.format(loop="validation", hook="val_dataloader"),
    reason=(
        "A rule that always holds: a validation loss measured on training rows hides overfitting, and early stopping "
        "or checkpoint selection on it picks the wrong model"
    ),
    message=(
        "{share:.0%} of the validation rows compared ({overlapping} of {compared}) are rows the model trained on: the "
        "first, row {val_row} of {val_batch}, is row {train_row} of the training batch of step {train_step} (rank "
        "{train_rank})."
    ),
    details=_DETAILS,
)

TFD127 = Rule(
    "TFD127",
    "error",
    "BatchGuard",
    title="test rows are rows the model trained on",
    headline="{overlapping} of {compared} test rows were trained on ({share:.1%})",
    trigger=(
        f"over `max_overlap_fraction` (and {MIN_OVERLAP_ROWS}) of the informative test rows equal training rows of the "
        "fit this BatchGuard watched"
    ),
    hint=_HINT.format(loop="test", hook="test_dataloader"),
    reason="A rule that always holds: a test score measured on training rows overstates what the model generalises",
    message=(
        "{share:.0%} of the test rows compared ({overlapping} of {compared}) are rows the model trained on: the first, "
        "row {val_row} of {val_batch}, is row {train_row} of the training batch of step {train_step} (rank "
        "{train_rank})."
    ),
    details=_DETAILS,
)

LOOP_RULES = {"validation": TFD126, "test": TFD127}


def loop_batch_name(loop: str, loop_step: int, dataloader: int, batch: int, rank: int) -> str:
    """The validation or test batch a finding names (``loop_step`` -1: Lightning's sanity check)."""
    loader = f", dataloader {dataloader}" if dataloader else ""
    if loop == "validation" and loop_step < 0:
        return f"sanity-check batch {batch} (rank {rank}{loader})"
    return f"{loop} batch {batch} of the {loop} run at step {loop_step} (rank {rank}{loader})"


@dataclass
class RowMemory:
    """Rows by key, sorted; ``places`` holds where each was first read (one int32 row of columns per key)."""

    columns: int
    keys: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    places: np.ndarray = field(init=False)

    def __post_init__(self) -> None:
        self.places = np.zeros((0, self.columns), np.int32)

    def __len__(self) -> int:
        return len(self.keys)

    def find(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """For each of ``keys``: whether it is remembered, and its index here (meaningful where it is)."""
        at = np.searchsorted(self.keys, keys)
        inside = at < len(self.keys)
        found = np.zeros(len(keys), bool)
        found[inside] = self.keys[at[inside]] == keys[inside]
        return found, at

    def insert(self, keys: np.ndarray, places: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Remember the rows of ``keys`` not yet remembered (the first of equal keys); returns the keys and places
        inserted."""
        if len(keys) == 0:
            return keys, places
        unique, first = np.unique(keys, return_index=True)  # sorted, each key's first occurrence
        places = places[first]
        found, at = self.find(unique)
        new, new_places, at = unique[~found], places[~found], at[~found]
        self.keys = np.insert(self.keys, at, new)
        self.places = np.insert(self.places, at, new_places, axis=0)
        return new, new_places

    def keep(self, kept: np.ndarray) -> None:
        """Keep only the rows where ``kept`` is True."""
        self.keys, self.places = self.keys[kept], self.places[kept]


@dataclass
class ComparedRows(RowMemory):
    """One loop's rows (validation or test) and, for each, the training place it matched (``matched`` False: none)."""

    matched: np.ndarray = field(default_factory=lambda: np.zeros(0, bool))
    train_places: np.ndarray = field(default_factory=lambda: np.zeros((0, len(TRAINED_COLUMNS)), np.int32))
    excluded: int = 0  # rows read but not compared (too short or too uniform)

    def insert(self, keys: np.ndarray, places: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        before = self.keys
        new, new_places = super().insert(keys, places)
        if len(new):  # the parallel arrays follow the keys' new order
            at = np.searchsorted(before, new)
            self.matched = np.insert(self.matched, at, False)
            self.train_places = np.insert(self.train_places, at, np.zeros((len(new), 3), np.int32), axis=0)
        return new, new_places

    def keep(self, kept: np.ndarray) -> None:
        super().keep(kept)
        self.matched, self.train_places = self.matched[kept], self.train_places[kept]

    def mark(self, keys: np.ndarray, train_places: np.ndarray) -> None:
        """Rows whose key is one of ``keys`` (training rows) overlap, first with the place given."""
        found, at = self.find(keys)
        at, train_places = at[found], train_places[found]
        fresh = ~self.matched[at]
        self.matched[at[fresh]] = True
        self.train_places[at[fresh]] = train_places[fresh]


@dataclass
class LeakageWatch:
    """``TFD126``/``TFD127``: the training rows and each loop's rows, by key; fed host arrays in any order.

    ``level``: the memories keep only keys whose low ``level`` bits are zero (0: every key), raised when one is full.
    """

    max_overlap_fraction: float = MAX_OVERLAP_FRACTION
    max_rows: int = MAX_REMEMBERED_ROWS
    level: int = 0
    trained: RowMemory = field(default_factory=lambda: RowMemory(len(TRAINED_COLUMNS)))
    loops: dict[str, ComparedRows] = field(default_factory=dict)

    def _kept(self, keys: np.ndarray) -> np.ndarray:
        return (keys & ((1 << self.level) - 1)) == 0

    def _bound(self) -> None:
        while max([len(self.trained), *map(len, self.loops.values())]) > self.max_rows:
            self.level += 1  # keep half: the same keys on every side
            for memory in (self.trained, *self.loops.values()):
                memory.keep(self._kept(memory.keys))

    def add_trained(self, keys: np.ndarray, places: np.ndarray) -> None:
        """Training rows (keys, and places by :data:`TRAINED_COLUMNS`)."""
        kept = self._kept(keys)
        new, new_places = self.trained.insert(keys[kept], places[kept])
        for rows in self.loops.values():
            rows.mark(new, new_places)
        self._bound()

    def add_compared(self, loop: str, keys: np.ndarray, places: np.ndarray, informative: np.ndarray) -> None:
        """Rows of ``loop`` (keys, places by :data:`COMPARED_COLUMNS`, whether each is informative enough)."""
        rows = self.loops.setdefault(loop, ComparedRows(len(COMPARED_COLUMNS)))
        rows.excluded += int((~informative).sum())
        kept = self._kept(keys) & informative
        new, _ = rows.insert(keys[kept], places[kept])
        found, at = self.trained.find(new)
        rows.mark(new[found], self.trained.places[at[found]])
        self._bound()

    def verdict(self, loop: str, step: int) -> Verdict | None:
        """``TFD126`` (validation) or ``TFD127`` (test) from what was added, at ``step``."""
        rows = self.loops.get(loop)
        if rows is None or loop not in LOOP_RULES:
            return None
        compared, overlapping = len(rows), int(rows.matched.sum())
        if overlapping < MIN_OVERLAP_ROWS or overlapping <= self.max_overlap_fraction * compared:
            return None
        hits = np.flatnonzero(rows.matched)
        places = rows.places[hits]
        first = hits[np.lexsort(places.T[::-1])[0]]  # the earliest compared row: by loop step, loader, batch, row
        loop_step, loader, batch, row, rank = (int(v) for v in rows.places[first])
        train_step, train_row, train_rank = (int(v) for v in rows.train_places[first])
        evidence = {"loop": loop, "overlapping": overlapping, "compared": compared, "share": overlapping / compared}
        evidence |= {"not_compared": rows.excluded, "sampling_bits": self.level}
        evidence |= {"val_step": loop_step, "dataloader": loader, "val_batch_idx": batch, "val_row": row}
        evidence |= {"val_rank": rank, "train_step": train_step, "train_row": train_row, "train_rank": train_rank}
        val_batch = loop_batch_name(loop, loop_step, loader, batch, rank)
        return LOOP_RULES[loop].verdict(evidence, step=step, val_batch=val_batch)
