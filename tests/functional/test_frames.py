import json
import math
from collections import namedtuple
from dataclasses import dataclass

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from lightning_tfdebug.functional.frame_reports import format_frames
from lightning_tfdebug.functional.frames import (
    Entry,
    FrameRecorder,
    abs_range,
    iter_float_tensors,
    weight_ranges,
    window,
)

Pair = namedtuple("Pair", "first second")


@dataclass
class Output:
    hidden: torch.Tensor
    mask: torch.Tensor
    extra: tuple


def test_nested_outputs_are_walked_and_non_float_tensors_skipped():
    out = {
        "logits": torch.ones(2),
        "ids": torch.ones(2, dtype=torch.long),
        "pair": Pair(torch.ones(1), None),
        "dc": Output(torch.ones(3), torch.ones(3, dtype=torch.bool), (torch.ones(1), "text", torch.empty(0))),
    }
    labels = [label for label, _ in iter_float_tensors(out, "output")]
    assert labels == ["output['logits']", "output['pair'].first", "output['dc'].hidden", "output['dc'].extra[0]"]


def test_abs_range_propagates_nan_and_inf_without_copying_to_the_host():
    lo, hi = abs_range(torch.tensor([-3.0, 0.5, 2.0]))
    assert (lo.item(), hi.item()) == (0.5, 3.0) and lo.dtype == torch.float32
    assert math.isnan(abs_range(torch.tensor([1.0, float("nan")]))[1].item())
    assert math.isinf(abs_range(torch.tensor([1.0, float("-inf")], dtype=torch.float16))[1].item())


def test_headroom_is_how_far_abs_max_can_grow_before_overflow():
    entry = Entry("output", "float16", 0.1, 65504.0 / 4)
    assert entry.headroom()["fp16"] == pytest.approx(4.0)
    assert Entry("output", "float16", 0.0, float("inf")).headroom() == {"fp16": None, "bf16": None}


class TupleModule(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        y = self.lin(x)
        return y, torch.arange(3)  # a float tensor and an integer one


class DictModule(nn.Module):
    def forward(self, x):
        return {"out": x * 2, "log": (x - 10).log()}  # the second entry is nan


class DataclassModule(nn.Module):
    def forward(self, x):
        return Output(x + 1, x > 0, (x,))


class Net(nn.Module):
    def __init__(self, use_checkpoint: str | None = None):
        super().__init__()
        self.a = TupleModule()
        self.b = DictModule()
        self.c = DataclassModule()
        self.use_checkpoint = use_checkpoint

    def forward(self, x):
        if self.use_checkpoint:
            y, _ = checkpoint(self.a, x, use_reentrant=self.use_checkpoint == "reentrant")
        else:
            y, _ = self.a(x)
        d = self.b(y)
        return self.c(d["out"]).hidden.sum()


def test_recorder_names_the_first_nonfinite_frame_and_its_tensor():
    net = Net()
    with FrameRecorder(net) as recorder:
        net(torch.ones(2, 4)).backward()
    forward = recorder.frames("forward")
    assert [f.module for f in forward] == ["a.lin", "a", "b", "c", "<root>"]
    assert [e.label for e in forward[1].entries] == ["input[0]", "output[0]"]  # the integer output is skipped
    assert [e.label for e in forward[3].entries] == ["input[0]", "output.hidden", "output.extra[0]"]
    assert recorder.first_nonfinite("forward") == 2
    assert not forward[2].finite and [e.label for e in forward[2].entries if not e.finite] == ["output['log']"]
    backward = recorder.frames("backward")
    assert backward and all(f.finite for f in backward) and recorder.first_nonfinite("backward") is None


@pytest.mark.parametrize("mode", ["reentrant", "non_reentrant"])
def test_activation_checkpointing_does_not_count_frames_twice(mode):
    counts = {}
    for use in (None, mode):
        net = Net(use_checkpoint=use)
        x = torch.ones(2, 4, requires_grad=True)
        with FrameRecorder(net) as recorder:
            net(x).backward()
        counts[use] = (recorder.count("forward"), [f.module for f in recorder.frames("forward")])
    assert counts[None] == counts[mode]


def test_hooks_exist_only_while_attached_and_detach_is_idempotent():
    net = Net()
    recorder = FrameRecorder(net).attach()
    assert sum(len(m._forward_hooks) for m in net.modules()) == 5
    recorder.detach()
    recorder.detach()
    assert sum(len(m._forward_hooks) for m in net.modules()) == 0
    with pytest.raises(RuntimeError), FrameRecorder(net):
        raise RuntimeError("boom")
    assert sum(len(m._forward_hooks) for m in net.modules()) == 0


def test_disabled_recorder_records_nothing():
    net = Net()
    with FrameRecorder(net) as recorder:
        recorder.enabled = False
        net(torch.ones(2, 4))
    assert recorder.records == [] and recorder.first_nonfinite("forward") is None


def test_weights_ring_window_and_report_text():
    lin = nn.Linear(3, 2)
    with torch.no_grad():
        lin.weight.fill_(-2.0)
        lin.bias.fill_(0.5)
    assert [(e.label, e.abs_min, e.abs_max) for e in weight_ranges(lin)] == [("weight", 2.0, 2.0), ("bias", 0.5, 0.5)]
    assert window(first=30, max_frames=21) == (10, 31)
    assert window(first=3, max_frames=21) == (0, 4)
    net = Net()
    with FrameRecorder(net) as recorder:
        net(torch.ones(2, 4))
    lines = format_frames("frames", recorder.frames("forward"))
    assert any("<-- non-finite" in line and line.startswith("[2] b DictModule") for line in lines)
    # a frame's dict is strict JSON (a non-finite number is written as its name), as the report's JSON file needs
    document = json.dumps({"x": [f.to_dict() for f in recorder.frames("forward")]}, allow_nan=False)
    assert json.loads(document)["x"][2]["entries"][-1]["abs_max"] == "nan"
    assert lines[0] == "frames"


def test_frame_flags_name_the_first_nonfinite_output_with_one_sum_per_tensor():
    from lightning_tfdebug.functional.frames import FrameFlags, output_sum

    net = Net()
    with FrameFlags(net) as flags:
        net(torch.ones(2, 4)).backward()
    assert [flags.names[i] for i in flags.indices] == ["a.lin", "a", "b", "b", "c", "c", "<root>"]
    assert flags.labels[2:4] == ["output['out']", "output['log']"]
    assert all(s.ndim == 0 and s.dtype == torch.float32 for s in flags.sums)
    assert flags.nonfinite().item() == 1.0 and flags.first_nonfinite() == (3, "b", "DictModule", "output['log']")
    assert sum(len(m._forward_hooks) for m in net.modules()) == 0
    flags.clear()
    assert flags.nonfinite() is None and flags.first_nonfinite() is None
    flags.record_value("training_step", "loss", torch.tensor(float("inf")))
    assert flags.first_nonfinite() == (0, "training_step", "-", "loss")
    assert math.isinf(output_sum(torch.full((2,), 3e38)).item())  # a finite overflow: only a suspicion


@pytest.mark.parametrize("mode", ["reentrant", "non_reentrant"])
def test_frame_flags_skip_checkpoint_recomputation_and_pause_when_disabled(mode):
    from lightning_tfdebug.functional.frames import FrameFlags

    counts = {}
    for use in (None, mode):
        net = Net(use_checkpoint=use)
        with FrameFlags(net) as flags:
            net(torch.ones(2, 4, requires_grad=True)).backward()
        counts[use] = [flags.names[i] for i in flags.indices]
    assert counts[None] == counts[mode]
    with FrameFlags(net) as flags:
        flags.enabled = False
        net(torch.ones(2, 4))
    assert flags.count() == 0


def test_replay_frames_restores_gradients_and_generators_and_reports_its_error():
    from lightning_tfdebug.functional.frame_reports import replay_frames, rng_state
    from lightning_tfdebug.functional.frames import LOSS_FRAME

    net = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.5))
    params = list(net.parameters())
    own = [torch.full_like(p, 7.0) for p in params]
    for p, g in zip(params, own):
        p.grad = g
    micro = [(torch.ones(2, 4), 0, rng_state(torch.device("cpu")))]
    torch.rand(1)  # the generator moved on since the batch's state was taken

    def run_step(batch, batch_idx):
        return net(batch).sum() * float("nan")

    before = torch.get_rng_state()
    recorder, flags, error = replay_frames(net, torch.device("cpu"), micro, run_step, params, flags=True)
    assert error is None and torch.equal(torch.get_rng_state(), before)  # put back after the replay
    assert all(p.grad is g for p, g in zip(params, own))  # the step's own gradients, untouched
    assert recorder.count("forward") == 4 and recorder.frames("forward")[-1].module == LOSS_FRAME
    assert flags is not None and flags.first_nonfinite()[1] == LOSS_FRAME
    assert recorder.first_nonfinite("backward") is not None

    def failing(batch, batch_idx):
        raise RuntimeError("boom")

    recorder, flags, error = replay_frames(net, torch.device("cpu"), micro, failing, params)
    assert error == "RuntimeError: boom" and flags is None and all(p.grad is g for p, g in zip(params, own))
    assert not any(m._forward_hooks for m in net.modules())  # hooks removed
