"""The pack's one reduction per measuring step (core/reduction.py), over real gloo groups, against plain references."""

import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lightning_tfdebug.core.reduction import (
    Reduced,
    StepReduction,
    declaration,
    host_fields,
    payload_slots,
    reduce_declarations,
    reduce_now,
)


class _Owner:
    """Stands in for a callback: what the reduction calls back (``conclude``) after its collective."""

    def __init__(self) -> None:
        self.got: list[Reduced] = []

    def conclude(self, trainer, then, reduced):
        then(reduced)


def _values(rank: int) -> dict[str, list[float]]:
    """Two members' declarations on ``rank``: counts, flags, a maximum and rows that differ by rank."""
    return {
        "a_sums": [1.0 + rank, 10.0 * rank],
        "a_anys": [float(rank == 1), 0.0, 1.0],
        "a_maxes": [float(-rank), 3.0 * rank],
        "b_sums": [2.0**53 - 1 if rank == 0 else 0.0],  # float64: exact where float32 would round
        "b_rows": [float(rank), 2.0**40 + rank],
    }


def _named_b_rows(rank: int) -> dict[str, object]:
    """Member b's row declared by name: a host number and a device scalar, as a callback declares them."""
    values = _values(rank)["b_rows"]
    return {"rank": values[0], "big": torch.tensor(values[1], dtype=torch.float64)}


def _worker(rank: int, world: int, init_file: str, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        v = _values(rank)
        a, b = _Owner(), _Owner()
        reduction = StepReduction()
        device = torch.device("cpu")
        a_fields = {
            "sums": {"count": v["a_sums"][0], "total": torch.tensor(v["a_sums"][1])},
            "anys": {"flags": torch.tensor(v["a_anys"])},
            "maxes": {"low": v["a_maxes"][0], "high": torch.tensor(v["a_maxes"][1])},
        }
        reduction.add(declaration(a, a.got.append, device, **a_fields))
        b_sums = {"big": torch.tensor(v["b_sums"], dtype=torch.float64).reshape(())}
        reduction.add(declaration(b, b.got.append, device, sums=b_sums, rows=_named_b_rows(rank)))
        calls = []
        original = dist.all_reduce

        def counted(*args, **kwargs):
            calls.append("all_reduce")
            return original(*args, **kwargs)

        dist.all_reduce = counted
        try:
            reduction.run(trainer=None)
        finally:
            dist.all_reduce = original
        torch.save(
            {"a": a.got[0], "b": b.got[0], "calls": calls, "slots": reduction.last_slots, "left": reduction.pending},
            os.path.join(out_dir, f"rank{rank}.pt"),
        )
    finally:
        dist.destroy_process_group()


@pytest.mark.ddp
@pytest.mark.slow
@pytest.mark.ci  # three spawned processes (~60 s on 2 cores): CI's main lane runs it beside the matrices
@pytest.mark.parametrize("world", [3])
def test_one_all_reduce_serves_every_member_with_sums_flags_maxima_and_rows(tmp_path, world):
    init_file = tempfile.mktemp(dir=tmp_path)
    mp.start_processes(_worker, args=(world, init_file, str(tmp_path)), nprocs=world, join=True, start_method="spawn")
    ranks = [_values(r) for r in range(world)]
    for rank in range(world):
        r = torch.load(tmp_path / f"rank{rank}.pt", weights_only=False)
        assert r["calls"] == ["all_reduce"] and r["left"] == []  # one collective for both members
        a, b = r["a"].host(), r["b"].host()
        assert a.sums == {"count": sum(v["a_sums"][0] for v in ranks), "total": sum(v["a_sums"][1] for v in ranks)}
        assert a.anys == {"flags": [1.0, 0.0, 1.0]}
        assert a.maxes == {"low": max(v["a_maxes"][0] for v in ranks), "high": max(v["a_maxes"][1] for v in ranks)}
        assert a.rows == {} and a.per_rank() == [{}] * world
        assert b.sums == {"big": 2.0**53 - 1}  # float64: exact where float32 would round
        assert b.rows == {"rank": [float(r) for r in range(world)], "big": [2.0**40 + r for r in range(world)]}
        assert b.per_rank() == [{"rank": v["b_rows"][0], "big": v["b_rows"][1]} for v in ranks]  # every rank's, exactly
        assert b.maxes == {} and b.anys == {}
        # per rank: 2 + 1 sums, 3 flags, world x (2 maxima + 2 row values), one failure count per member
        assert r["slots"] == 8 + world * 4


def test_a_single_process_needs_no_collective_and_keeps_its_values():
    got: list[Reduced] = []
    owner = _Owner()
    fields = {"sums": {"pair": [1, 2]}, "anys": {"off": 0.0, "on": 3.0}, "maxes": {"peak": 5}, "rows": {"seen": 7}}
    declared = declaration(owner, got.append, torch.device("cpu"), **fields)
    [reduced] = reduce_declarations([declared])
    assert reduced.sums["pair"].tolist() == [1.0, 2.0] and reduced.sums["pair"].dtype == torch.float64
    assert reduced.anys["off"].item() == 0.0 and reduced.anys["on"].item() == 1.0
    assert reduced.maxes["peak"].item() == 5.0 and reduced.rows["seen"].tolist() == [7.0]  # (world,) per scalar field
    assert payload_slots([declared], 1024) == 5 + 1024 * 2
    empty = declaration(owner, got.append, torch.device("cpu"), sums={})
    assert empty.sums.numel() == 0 and reduce_declarations([empty])[0].sums == {}


def test_fields_keep_their_shapes_and_are_read_by_name_whatever_their_order():
    counts = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    reduced = reduce_now(torch.device("cpu"), sums={"counts": counts, "n": 4}, rows={"grid": torch.ones(2, 2)})
    assert reduced.sums["counts"].shape == (2, 3) and reduced.sums["counts"].tolist() == counts.tolist()
    assert reduced.rows["grid"].shape == (1, 2, 2)
    host = reduced.host()
    assert host.sums == {"counts": [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]], "n": 4.0}
    assert host.per_rank() == [{"grid": [[1.0, 1.0], [1.0, 1.0]]}]
    # a field added first does not shift the others: they are read by name
    more = reduce_now(torch.device("cpu"), sums={"extra": torch.ones(5), "counts": counts, "n": 4}).host()
    assert more.sums["counts"] == host.sums["counts"] and more.sums["n"] == 4.0


def test_a_positional_vector_is_refused_with_what_to_do():
    with pytest.raises(TypeError, match=r"mapping \{name: value\}"):
        declaration(_Owner(), None, torch.device("cpu"), sums=[1.0, 2.0])
    with pytest.raises(TypeError, match="rows"):
        reduce_now(torch.device("cpu"), rows=torch.ones(3))


def test_host_fields_moves_scalars_and_vectors_in_one_transfer():
    values = {"a": torch.tensor(2.0), "b": torch.tensor([1.0, 3.0]), "c": 0.5}
    assert host_fields(values) == {"a": 2.0, "b": [1.0, 3.0], "c": 0.5}
    assert host_fields({"x": 1}) == {"x": 1.0}


def test_a_row_declared_by_name_keeps_its_dataclass_order_and_reads_back_by_field():
    import dataclasses

    from lightning_tfdebug.core.reduction import row_fields

    @dataclasses.dataclass(frozen=True)
    class Row:
        tokens: float
        wall_s: float
        peak: float

    owner, got = _Owner(), []
    values = {"peak": 3.0, "tokens": torch.tensor(7, dtype=torch.int64), "wall_s": 0.5}  # any order, any kind
    declared = declaration(owner, got.append, torch.device("cpu"), rows=row_fields(Row, values))
    assert declared.layout.rows.names == ("tokens", "wall_s", "peak") and declared.rows.tolist() == [7.0, 0.5, 3.0]
    [reduced] = reduce_declarations([declared])
    assert [Row(**r) for r in reduced.host().per_rank()] == [Row(7.0, 0.5, 3.0)]
    with pytest.raises(KeyError, match="wall_s"):
        row_fields(Row, {"tokens": 1.0, "peak": 2.0})
    with pytest.raises(KeyError, match="has no field"):
        row_fields(Row, {**values, "extra": 1.0})
