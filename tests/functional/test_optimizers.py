"""What OptimizerAudit reads from optimizers and modules, on plain torch objects (no Trainer)."""

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from lightning_tfdebug.functional.optimizers import (
    group_label,
    is_transformer,
    modules_left_in_eval,
    parameters_norm,
    read_lrs,
    read_schedules,
    read_wiring,
    replay_schedule,
    snapshot_step,
    stale_grad_flags,
)


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 4)
        self.norm = nn.LayerNorm(4)
        self.proj = nn.Linear(4, 4)
        self.head = nn.Linear(4, 10, bias=False)
        self.drop = nn.Dropout(0.1)


def test_the_wiring_reading_names_each_group_and_each_misplaced_parameter():
    model = Tiny()
    model.norm.bias.requires_grad_(False)
    stranger = nn.Parameter(torch.zeros(3))
    decayed = [model.emb.weight, model.norm.weight, model.norm.bias, model.proj.weight, model.proj.bias]
    optimizer = torch.optim.AdamW(
        [
            {"params": decayed, "weight_decay": 0.1, "name": "decay"},
            {"params": [stranger], "weight_decay": 0.0},
        ],
        lr=1e-3,
        eps=1e-6,
    )
    optimizer.param_groups[1]["params"].append(model.proj.weight)  # also in the first group (torch refuses it as input)
    wiring = read_wiring(model, [optimizer])
    reading = wiring.reading
    decay, plain = reading.groups
    assert (decay.label, decay.optimizer, decay.weight_decay, decay.lr, decay.eps) == (
        "decay",
        "AdamW",
        0.1,
        1e-3,
        1e-6,
    )
    assert decay.decayed_1d == ("norm.weight", "proj.bias")  # the frozen norm.bias gets no decay
    assert decay.decayed_embeddings == ("emb.weight",) and not decay.float16
    assert (plain.label, plain.weight_decay, plain.decayed_1d) == ("group1", 0.0, ())
    assert reading.missing == ("head.weight",)
    assert reading.twice == ("proj.weight",)
    assert reading.frozen == ("norm.bias",) and wiring.frozen_ids == {id(model.norm.bias)}
    assert reading.strangers == 1
    assert [id(p) for p in wiring.decayed_1d] == [id(model.norm.weight), id(model.proj.bias)]
    assert wiring.decay_groups == [optimizer.param_groups[0]]
    assert wiring.decay_rate() == pytest.approx(1e-4)


def test_the_peak_lr_is_the_schedulers_initial_lr_and_sgd_has_no_eps():
    model = nn.Linear(2, 2).half()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 0.01)  # records initial_lr 0.1, sets lr to 1e-3
    [group] = read_wiring(model, [optimizer]).reading.groups
    assert group.lr == pytest.approx(0.1) and group.eps is None and group.float16


def test_group_labels_and_the_lrs_they_key():
    assert group_label(0, 1, {"name": "no_decay"}, several=False) == "no_decay"
    assert group_label(1, 0, {}, several=True) == "opt1.group0"
    first = torch.optim.AdamW(nn.Linear(2, 2).parameters(), lr=1e-3)
    second = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=torch.tensor(0.5))
    assert read_lrs([first]) == {"group0": pytest.approx(1e-3)}
    assert read_lrs([first, second]) == {"opt0.group0": pytest.approx(1e-3), "opt1.group0": 0.5}


def test_the_schedules_reading():
    optimizer = torch.optim.AdamW(nn.Linear(2, 2).parameters(), lr=1e-3)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 0.01)
    configs = [SimpleNamespace(scheduler=schedule, interval="epoch"), SimpleNamespace(scheduler=object(), interval="x")]
    reading = read_schedules(configs)
    assert (reading.base_lr, reading.intervals, reading.names) == (pytest.approx(1e-3), ("epoch",), ("LambdaLR",))
    assert read_schedules([]) is None


def test_transformers_and_modules_left_in_eval():
    assert is_transformer(nn.Sequential(nn.MultiheadAttention(4, 2)))
    assert not is_transformer(Tiny())
    model = Tiny()
    assert modules_left_in_eval(model) == []
    model.drop.eval()
    model.norm.eval()  # no mode-dependent behaviour
    assert modules_left_in_eval(model) == ["drop"]
    model.drop.p = 0.0  # drops nothing
    assert modules_left_in_eval(model) == []


def test_gradients_left_from_the_previous_step():
    model = Tiny()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    assert stale_grad_flags([optimizer]) is None  # no .grad anywhere: nothing is read
    model.emb.weight.grad = torch.zeros_like(model.emb.weight)
    assert stale_grad_flags([optimizer]).tolist() == [False]  # zeroed in place
    model.emb.weight.grad[0, 0] = 1.0
    assert stale_grad_flags([optimizer]).tolist() == [True]


def test_snapshots_see_a_changed_byte_and_skip_groups_without_an_lr_or_a_gradient():
    model = Tiny()
    model.norm.weight.requires_grad_(False)
    optimizer = torch.optim.SGD(
        [{"params": [model.proj.weight, model.norm.weight]}, {"params": [model.head.weight], "lr": 0.0}], lr=0.1
    )
    names = {id(p): n for n, p in model.named_parameters()}
    assert snapshot_step(optimizer, names, set()) == ([], [], 0)  # no gradient yet
    model.proj.weight.grad = torch.ones_like(model.proj.weight)
    model.head.weight.grad = torch.ones_like(model.head.weight)
    snaps, frozen, unfit = snapshot_step(optimizer, names, {id(model.norm.weight)})
    assert [s.name for s in snaps] == ["proj.weight"] and [s.name for s in frozen] == ["norm.weight"]
    assert snaps[0].changed().item() == 0.0 and unfit == 0
    optimizer.step()
    assert snaps[0].changed().item() == 1.0 and frozen[0].changed().item() == 0.0


def test_the_probe_of_a_group_is_its_first_parameter_that_fits_the_memory_budget():
    model = Tiny()
    optimizer = torch.optim.SGD([model.emb.weight, model.proj.weight, model.norm.weight], lr=0.1)
    for p in optimizer.param_groups[0]["params"]:
        p.grad = torch.ones_like(p)
    names = {id(p): n for n, p in model.named_parameters()}
    # the embedding (40 floats: 200 bytes with the comparison's mask) does not fit 100 bytes; the 4x4 matrix (80) does
    [snap], _, unfit = snapshot_step(optimizer, names, set(), budget=100)
    assert snap.name == "proj.weight" and unfit == 0
    assert snapshot_step(optimizer, names, set(), budget=10) == ([], [], 1)  # none fits: the group is counted


def config(make, interval="step"):
    optimizer = torch.optim.AdamW([nn.Parameter(torch.zeros(2))], lr=1e-3)
    return SimpleNamespace(scheduler=make(optimizer), interval=interval, frequency=1)


def warmup(steps):
    return lambda optimizer: torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / steps))


def test_a_schedule_is_replayed_on_a_copy_without_touching_it():
    long = config(warmup(1000))
    state, lr = str(long.scheduler.state_dict()), long.scheduler.optimizer.param_groups[0]["lr"]
    course = replay_schedule(long, 0, 100, steps_per_epoch=10)
    assert (course.half_step, course.peak_step, course.rises) == (499, 999, True)
    assert course.run_max == pytest.approx(1.01e-4) and course.peak == 1e-3
    assert str(long.scheduler.state_dict()) == state and long.scheduler.optimizer.param_groups[0]["lr"] == lr
    # stepped once per epoch of 10 optimizer steps, a 10-step warm-up takes 100 optimizer steps
    assert replay_schedule(config(warmup(10), "epoch"), 0, 200, steps_per_epoch=10).half_step == 40
    # a short warm-up stops at its top; a decay has its peak at once; a constant factor never rises
    short = replay_schedule(config(warmup(10)), 0, 10**6, steps_per_epoch=10)
    assert (short.half_step, short.peak_step, short.replayed) == (4, 9, 10)
    cosine = replay_schedule(config(lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, 100)), 0, 100, 10)
    assert (cosine.peak_step, cosine.rises) == (0, False)
    flat = replay_schedule(config(lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda s: 0.1)), 0, 100, 10)
    assert (flat.half_step, flat.rises, flat.replayed) == (None, False, 100)
    # not told: an unbounded run, a scheduler that needs a metric, an epoch of unknown length
    assert replay_schedule(long, 0, float("inf"), 10) is None
    assert replay_schedule(config(torch.optim.lr_scheduler.ReduceLROnPlateau), 0, 100, 10) is None
    assert replay_schedule(config(warmup(10), "epoch"), 0, 100, float("inf")) is None


def test_the_norm_over_several_parameters():
    params = [torch.full((4,), 1.0), torch.full((5,), 2.0), torch.empty(0)]
    assert parameters_norm(params).item() == pytest.approx((4 + 5 * 4) ** 0.5)
    assert parameters_norm([]) is None
