"""StallWatchdog's rules with plain values: what a stack waits in, the default ``stall_after``, the phases allowed
generously, and the verdicts that name the rank behind or the mismatched collectives."""

from __future__ import annotations

import pytest

from lightning_tfdebug.functional.stall_checks import (
    DEFAULT_FLOOR_S,
    PHASE_ALLOWANCE_S,
    Frame,
    RankRecord,
    allowance,
    classify_stack,
    default_stall_after,
    phase_kind,
    stall_verdicts,
)

SITE = "/venv/lib/python3.11/site-packages"
LOOP = Frame(f"{SITE}/lightning/pytorch/loops/training_epoch_loop.py", 352, "advance", True)
SCRIPT = Frame("/home/me/train.py", 80, "main")


def lib(path: str, function: str, line: int = 1) -> Frame:
    return Frame(f"{SITE}/{path}", line, function, True)


def test_a_stack_in_the_users_step_is_named_by_its_innermost_frame():
    stack = [SCRIPT, LOOP, Frame("/home/me/model.py", 41, "training_step"), Frame("/home/me/data.py", 9, "next_row")]
    wait = classify_stack(stack, distributed=True)
    assert (wait.kind, wait.text) == ("code", "in next_row (me/data.py:9)")


def test_a_lock_in_library_code_names_the_users_frame_that_took_it():
    stack = [SCRIPT, LOOP, Frame("/home/me/model.py", 41, "training_step"), lib("../threading.py", "wait", 327)]
    wait = classify_stack(stack, distributed=False)
    assert wait.kind == "code" and wait.text.startswith("in training_step (me/model.py:41), inside wait")


def test_collectives_are_named_with_their_caller():
    c10d = "torch/distributed/distributed_c10d.py"
    hook = Frame("/home/me/callbacks.py", 12, "on_train_batch_end")
    barrier = classify_stack([SCRIPT, LOOP, hook, lib(c10d, "barrier"), lib(c10d, "_barrier_impl")], True)
    assert barrier.kind == "barrier"
    assert barrier.text == "a barrier (torch.distributed.barrier), called from on_train_batch_end (me/callbacks.py:12)"
    sigterm = lib("lightning/pytorch/loops/training_epoch_loop.py", "_broadcast_sigterm_tensor", 265)
    stack = [SCRIPT, LOOP, sigterm, lib("torch/distributed/c10d_logger.py", "wrapper"), lib(c10d, "broadcast")]
    broadcast = classify_stack(stack, True)
    assert broadcast.kind == "collective" and "torch.distributed.broadcast), called from _broadcast_sigterm" in (
        broadcast.text
    )


def test_backward_is_a_collective_wait_only_with_several_ranks():
    stack = [SCRIPT, LOOP, lib("torch/autograd/graph.py", "_engine_run_backward")]
    assert classify_stack(stack, distributed=True).kind == "backward"
    assert classify_stack(stack, distributed=False).kind == "code"


@pytest.mark.parametrize(
    "path, function, kind",
    [
        ("torch/_dynamo/convert_frame.py", "_compile", "compile"),
        ("torch/_inductor/compile_fx.py", "compile_fx", "compile"),
        ("torch/serialization.py", "save", "checkpoint"),
        ("torch/profiler/profiler.py", "export_chrome_trace", "profiler"),
        ("torch/utils/data/dataloader.py", "_try_get_data", "dataloader"),
    ],
)
def test_long_phases_are_recognised_on_the_stack(path, function, kind):
    assert classify_stack([SCRIPT, LOOP, lib(path, function)], distributed=True).kind == kind


def test_the_default_stall_after_follows_the_runs_batch_times():
    assert default_stall_after([]) == DEFAULT_FLOOR_S  # before a batch has ended
    assert default_stall_after([0.05] * 50) == DEFAULT_FLOOR_S  # sub-second steps: within two minutes
    assert default_stall_after([8.0, 10.0, 12.0]) == 200.0  # 20 median batches
    assert default_stall_after([1.0] * 20 + [60.0]) == 180.0  # 3x the slowest (a loaded machine)


@pytest.mark.parametrize(
    "phase, wait, profiling, kind",
    [
        ("training step", "code", False, None),
        ("first training step", "code", False, "first step"),
        ("training step", "compile", False, "compile"),  # a recompilation later in the run
        ("validation", "code", False, "validation"),
        ("sanity check", None, False, "validation"),
        ("checkpoint save", "code", False, "checkpoint"),
        ("between batches", "checkpoint", False, "checkpoint"),
        ("training step", "code", True, "profiler"),
        ("set-up", None, False, "set-up"),
        ("epoch start", None, False, "set-up"),
        ("fit end", None, False, "end"),
    ],
)
def test_phases_that_take_long_get_their_allowance(phase, wait, profiling, kind):
    assert phase_kind(phase, wait, profiling) == kind
    expected = max(2.0, PHASE_ALLOWANCE_S[kind]) if kind else 2.0
    assert allowance(2.0, kind) == expected


def test_one_process_names_its_own_frame():
    own = RankRecord(0, 7, "training step", 95.0, "code", "in next_row (me/data.py:9)")
    [verdict] = stall_verdicts(own, None, world_size=1, stacks="s.txt")
    assert verdict.code == "TFD520" and verdict.step == 7
    assert verdict.message == (
        "No progress for 95.0 s on rank 0 at step 7 (training step): in next_row (me/data.py:9). Stacks: s.txt"
    )


def test_the_rank_behind_is_named_and_the_others_wait_in_the_all_reduce():
    all_reduce = "backward, where DDP's gradient all-reduce waits for every rank"
    own = RankRecord(0, 20, "backward", 91.0, "backward", all_reduce)
    others = [
        RankRecord(1, 20, "training step", 92.0, "code", "in next_row (me/data.py:9)"),
        RankRecord(2, 20, "backward", 90.0, "backward", all_reduce),
    ]
    [verdict] = stall_verdicts(own, others, world_size=3, stacks="s.txt")
    assert verdict.code == "TFD520" and verdict.evidence["behind"] == [1]
    assert "Behind: rank 1 at step 20 (training step, in next_row (me/data.py:9))." in verdict.message
    assert f"The others wait: rank 0 at step 20 ({all_reduce}); rank 2 at step 20 ({all_reduce})." in verdict.message


def test_a_rank_at_an_earlier_step_is_behind_even_when_the_others_wait_in_plain_code():
    """Under NCCL the collectives are asynchronous: a rank that waits for another runs on into the next step and
    blocks at a host sync anywhere (here a logging `.item()`); the step tells who is behind."""
    own = RankRecord(0, 5, "training step", 91.0, "code", "in log_loss (me/model.py:60)")
    stuck = RankRecord(1, 4, "training step", 93.0, "code", "in next_row (me/data.py:9)")
    [verdict] = stall_verdicts(own, [stuck], world_size=2, stacks="s.txt")
    assert verdict.evidence["behind"] == [1], verdict.message
    assert "Behind: rank 1 at step 4" in verdict.message and "The others wait: rank 0 at step 5" in verdict.message


def test_ranks_in_different_collectives_are_mismatched():
    own = RankRecord(0, 3, "between batches", 5.0, "barrier", "a barrier (torch.distributed.barrier)")
    other = RankRecord(1, 3, "between batches", 5.0, "collective", "a collective (torch.distributed.broadcast)")
    [verdict] = stall_verdicts(own, [other], world_size=2, stacks="s.txt")
    assert verdict.code == "TFD521" and verdict.evidence["mismatched"] is True
    assert "rank 0 at step 3" in verdict.message and "rank 1 at step 3" in verdict.message


def test_every_rank_in_the_same_collective_is_not_a_mismatch():
    where = "backward, where DDP's gradient all-reduce waits for every rank"
    own = RankRecord(0, 3, "backward", 5.0, "backward", where)
    [verdict] = stall_verdicts(own, [RankRecord(1, 3, "backward", 5.0, "backward", where)], 2, "s.txt")
    assert verdict.code == "TFD520" and verdict.evidence["behind"] == []


def test_a_store_that_cannot_be_read_is_said_and_a_missing_rank_is_named():
    own = RankRecord(0, 3, "backward", 5.0, "backward", "backward")
    [unread] = stall_verdicts(own, None, world_size=2, stacks="s.txt", unreadable="DistStoreError: timeout")
    assert "could not be read (DistStoreError: timeout)" in unread.message
    [missing] = stall_verdicts(own, [], world_size=2, stacks="s.txt")
    assert "No record from rank(s) 1" in missing.message
