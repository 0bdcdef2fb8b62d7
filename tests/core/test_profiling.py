import pytest
import torch

from lightning_tfdebug.core.profiling import FlopCount, StepProfiler, check_profile_steps


@pytest.mark.parametrize("steps", [None, [0, 1], (3, 10)])
def test_good_profile_steps_are_accepted(steps):
    check_profile_steps(steps)


@pytest.mark.parametrize("steps", [[1], [2, 2], [3, 1], [-1, 2], [0.0, 2], [True, 2], "0-2", {0: 2}])
def test_bad_profile_steps_name_the_setting(steps):
    with pytest.raises(ValueError, match=r"`profile_steps` must be \[start, stop\]"):
        check_profile_steps(steps)


def test_the_profiler_runs_over_its_steps_only_and_writes_a_trace_and_a_table(tmp_path):
    profiler = StepProfiler((2, 4), row_limit=5)
    profiler.maybe_start(1, cuda=False)
    assert profiler._running is None  # not its first step
    profiler.maybe_start(2, cuda=False)
    torch.randn(32, 32) @ torch.randn(32, 32)
    profiler.maybe_stop(2, str(tmp_path), rank=0, cuda=False)  # step 3 is still in the range
    assert not list(tmp_path.iterdir())
    profiler.maybe_stop(3, str(tmp_path), rank=0, cuda=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank0-top_ops.txt", "rank0.pt.trace.json"]
    table = (tmp_path / "rank0-top_ops.txt").read_text()
    assert table.startswith("optimizer steps 2 to 3, rank 0") and "aten::mm" in table
    StepProfiler(None, 5).maybe_start(0, cuda=False)  # never: nothing to start


def test_flops_are_counted_per_token_position_while_open():
    count = FlopCount()
    assert count.stop() is None and not count.counting
    count.start(positions=4)
    assert count.counting
    torch.ones(4, 8) @ torch.ones(8, 16)  # 2 * 4 * 8 * 16 FLOPs over 4 positions
    assert count.stop() == 2 * 8 * 16 and not count.counting
    count.start(positions=4)
    torch.ones(3) + 1  # nothing FlopCounterMode counts
    assert count.stop() is None
