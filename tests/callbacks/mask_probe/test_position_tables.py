"""The position-table decision (TFD216) on small hand-built models, without a Trainer: one watched forward pass, the
tables it read and the indices it looked them up with."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn

from lightning_tfdebug.callbacks.mask_probe.call_probes import measure_tables, watched_tables
from lightning_tfdebug.callbacks.mask_probe.position_checks import (
    PositionTable,
    PositionTablesReading,
    decide_position_tables,
)
from lightning_tfdebug.primitives.calls import TableReads

V, D, T = 50, 16, 12


class Learned(nn.Module):
    """Token + learned position table (+ a 2-row token-type table looked up with zeros, as BERT's)."""

    def __init__(self, positions: str = "arange") -> None:
        super().__init__()
        self.tok = nn.Embedding(V, D)
        self.pos = nn.Embedding(32, D)
        self.token_type = nn.Embedding(2, D)
        self.head = nn.Linear(D, V)
        self.positions = positions

    def forward(self, ids: Tensor, mask: Tensor) -> Tensor:
        b, t = ids.shape
        if self.positions == "zeros":
            pos = torch.zeros_like(ids)
        elif self.positions == "left_padded":  # Hugging Face's: mask cumsum - 1, pads at 1
            pos = (mask.cumsum(1) - 1).masked_fill(mask == 0, 1)
        elif self.positions == "packed":  # two documents per row, positions restart at the second
            pos = torch.cat([torch.arange(t // 2), torch.arange(t - t // 2)]).expand(b, t)
        else:
            pos = torch.arange(t).expand(b, t)
        h = self.tok(ids) + self.token_type(torch.zeros_like(ids))
        if self.positions != "never":
            h = h + self.pos(pos)
        return self.head(h)


class HeldParameter(nn.Module):
    """A hand-written model holding its position table as a parameter."""

    def __init__(self, used: bool) -> None:
        super().__init__()
        self.embed = nn.Embedding(V, D)
        self.pos_table = nn.Parameter(torch.randn(1, 32, D))
        self.head = nn.Linear(D, V)
        self.used = used

    def forward(self, ids: Tensor, mask: Tensor) -> Tensor:
        h = self.embed(ids)
        if self.used:
            h = h + self.pos_table[:, : ids.shape[1]]
        return self.head(h)


class Relative(nn.Module):
    """No absolute table: a T5-style relative bias (an embedding of heads' width over bucketed distances)."""

    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(V, D)
        self.bias = nn.Embedding(32, 2)
        self.head = nn.Linear(D, V)

    def forward(self, ids: Tensor, mask: Tensor) -> Tensor:
        t = ids.shape[1]
        buckets = (torch.arange(t)[None, :] - torch.arange(t)[:, None]).clamp(0, 31)
        scores = self.bias(buckets).mean(-1)  # (t, t)
        h = scores.softmax(-1) @ self.tok(ids)
        return self.head(h)


def verdict(model: nn.Module, ids: Tensor, mask: Tensor):
    named = watched_tables(model)
    watcher = TableReads(list(named.values()))
    with torch.no_grad(), watcher:
        model(ids, mask)
    reading = measure_tables(named, watcher.use, ids)
    return None if reading is None else decide_position_tables(reading)


def batch(left_pad: int = 0) -> tuple[Tensor, Tensor]:
    ids = torch.randint(0, V, (2, T), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[:, :left_pad] = 0
    return ids, mask


def test_position_ids_all_zero_are_flagged():
    v = verdict(Learned("zeros"), *batch())
    assert v is not None and v.code == "TFD216"
    assert v.evidence["kind"] == "constant" and v.evidence["table"] == "pos.weight" and v.evidence["rows"] == 32


@pytest.mark.parametrize("model", [Learned("never"), HeldParameter(used=False)], ids=["embedding", "parameter"])
def test_a_position_table_never_read_is_flagged(model):
    v = verdict(model, *batch())
    assert v is not None and v.code == "TFD216" and v.evidence["kind"] == "unread"


@pytest.mark.parametrize(
    ("model", "left_pad"),
    [
        (Learned("arange"), 0),
        (Learned("left_padded"), 4),
        (Learned("packed"), 0),
        (HeldParameter(used=True), 0),
        (Relative(), 0),
    ],
    ids=["arange", "left_padded", "packed", "held_parameter", "relative_bias"],
)
def test_positions_that_vary_or_no_table_are_silent(model, left_pad):
    assert verdict(model, *batch(left_pad)) is None


def test_a_table_shorter_than_the_sequence_is_not_a_position_table():
    # the 2-row token-type table looked up with zeros (BERT) is not one; nor is a 32-row table for 40 tokens
    ids = torch.randint(0, V, (2, 40))
    assert verdict(Learned("zeros"), ids, torch.ones_like(ids)) is None


def test_one_token_decides_nothing():
    reading = PositionTablesReading((PositionTable("pos", 32, True, True, True),), 1, "tok")
    assert decide_position_tables(reading) is None
