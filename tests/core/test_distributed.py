"""Sharded statistics reduced by name over real gloo process groups, against full-tensor references."""

import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lightning_tfdebug.core.distributed import plan_sharding
from lightning_tfdebug.core.reduction import reduce_now
from lightning_tfdebug.functional.norms import grouped_sq_norms
from lightning_tfdebug.primitives.tensors import clean_param_name


def _worker(rank: int, world: int, init_file: str, out_dir: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        torch.manual_seed(0)  # same full tensors on every rank
        full = [torch.randn(6, 3), torch.randn(1, 5), torch.randn(4), torch.randn(2, 2)]
        full[2][1] = float("inf")
        mesh = init_device_mesh("cpu", (world,))
        params = [
            distribute_tensor(full[0], mesh, [Shard(0)]),
            distribute_tensor(full[1], mesh, [Shard(0)]),  # one row over two ranks: rank 1's shard is empty
            distribute_tensor(full[2], mesh, [Replicate()]),
            full[3],  # a plain (replicated) tensor beside DTensors
        ]
        plan = plan_sharding(params)
        local = [p.to_local() if hasattr(p, "to_local") else p for p in params]
        group_sq, flags = grouped_sq_norms(
            local, torch.tensor([0, 0, 1, 1]), 2, weights=torch.tensor(plan.weights, dtype=torch.float32)
        )
        reduced = reduce_now(
            torch.device("cpu"), sums={"group_sq": group_sq}, maxes={"nonfinite": flags}, across_ranks=plan.sharded
        )
        sums, maxes = reduced.sums["group_sq"], reduced.maxes["nonfinite"]
        torch.save(
            {
                "sharded": plan.sharded,
                "weights": plan.weights,
                "sums": sums,
                "maxes": maxes,
                "numel1": local[1].numel(),
            },
            os.path.join(out_dir, f"rank{rank}.pt"),
        )
    finally:
        dist.destroy_process_group()


@pytest.mark.ddp
def test_sharded_sums_count_every_element_once_with_mixed_shards_and_an_empty_shard(tmp_path):
    init_file = tempfile.mktemp(dir=tmp_path)
    mp.start_processes(_worker, args=(2, init_file, str(tmp_path)), nprocs=2, join=True, start_method="spawn")
    torch.manual_seed(0)
    full = [torch.randn(6, 3), torch.randn(1, 5), torch.randn(4), torch.randn(2, 2)]
    expected_0 = full[0].square().sum() + full[1].square().sum()
    for rank in range(2):
        r = torch.load(tmp_path / f"rank{rank}.pt")
        assert r["sharded"] and r["weights"] == (1.0, 1.0, 0.5, 0.5)
        torch.testing.assert_close(r["sums"][0], expected_0.double())
        assert r["sums"][1].item() == float("inf")  # the replicated tensor holding an inf
        assert r["maxes"].tolist() == [0.0, 0.0, 1.0, 0.0]
    assert torch.load(tmp_path / "rank1.pt")["numel1"] == 0


def test_single_process_needs_no_collective():
    plan = plan_sharding([torch.zeros(3), torch.zeros(2)])
    assert not plan.sharded and plan.weights == (1.0, 1.0)
    reduced = reduce_now(torch.device("cpu"), sums={"s": torch.ones(2)}, maxes={"m": torch.zeros(1)})
    assert reduced.sums["s"].tolist() == [1.0, 1.0] and reduced.maxes["m"].tolist() == [0.0]


def test_wrapper_segments_are_removed_from_names():
    name = "_forward_module._fsdp_wrapped_module.blocks.0._checkpoint_wrapped_module.attn._orig_mod.qkv.weight"
    assert clean_param_name(name) == "blocks.0.attn.qkv.weight"
    assert clean_param_name("module.blocks.1.mlp.fc.bias") == "blocks.1.mlp.fc.bias"
