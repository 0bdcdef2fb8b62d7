"""CheckpointAudit's readings without a Trainer (functional/checkpoints.py): step counts, checksums, restored state."""

import torch
from torch import nn

from lightning_tfdebug.functional import checkpoints as ck


def test_max_step_and_checksums():
    assert ck.max_step({0: {"step": torch.tensor(3.0)}, 1: {"step": 5}, 2: {}}) == 5.0
    assert ck.max_step({}) is None
    assert ck.checksums([torch.tensor([1.0, 2.0])]) == [(3.0, 5.0)]
    assert ck.checksums([]) == []


def test_restored_state_reads_weights_optimizers_scale_and_step():
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    checkpoint = {
        "state_dict": {**model.state_dict(), "counter": torch.tensor(3)},  # an integer buffer is not checksummed
        "optimizer_states": [optimizer.state_dict()],
        "MixedPrecision": {"scale": 1024.0, "growth_factor": 2.0},
        "global_step": 7,
    }
    restored = ck.restored_state(checkpoint)
    assert restored["names"] == ["weight", "bias"] and restored["dtypes"]["bias"] == "torch.float32"
    assert restored["sums"] == ck.checksums([model.weight, model.bias])
    assert (restored["steps"], restored["lrs"], restored["scale"], restored["global_step"]) == (
        [1.0],
        [[1e-3]],
        1024.0,
        7,
    )
