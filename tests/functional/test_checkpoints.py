"""CheckpointAudit's checks without a Trainer (functional/checkpoints.py), on real checkpoint-shaped dicts."""

import torch
from torch import nn

from lightning_tfdebug.functional import checkpoints as ck


def trained():
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    return model, optimizer


def full_checkpoint(model, optimizer):
    return {
        "state_dict": model.state_dict(),
        "optimizer_states": [optimizer.state_dict()],
        "lr_schedulers": [{}],
        "global_step": 7,
        "epoch": 0,
        "loops": {"fit_loop": {}},
        "callbacks": {"A": {}},
    }


def expected_of(model, optimizer):
    return {
        "global_step": 7,
        "params": {k: list(v.shape) for k, v in model.state_dict().items()},
        "optimizers": [{"groups": 1, "with_state": 2, "has_step": True}],
        "schedulers": 1,
        "scaler_key": None,
        "callbacks": ["A"],
    }


def test_a_complete_checkpoint_has_no_problems():
    model, optimizer = trained()
    assert ck.content_problems(full_checkpoint(model, optimizer), expected_of(model, optimizer)) == []


def test_each_missing_part_is_named():
    model, optimizer = trained()
    expected = expected_of(model, optimizer)
    checkpoint = full_checkpoint(model, optimizer)
    checkpoint["state_dict"] = {"weight": torch.zeros(5, 4)}  # bias missing, weight of the wrong shape
    del checkpoint["optimizer_states"], checkpoint["lr_schedulers"], checkpoint["loops"]
    checkpoint["callbacks"] = {}
    verdicts = ck.content_problems(checkpoint, {**expected, "scaler_key": "MixedPrecision"})
    assert [v.code for v in verdicts] == ["TFD701", "TFD702", "TFD703", "TFD705", "TFD706", "TFD707", "TFD708"]
    assert {v.severity for v in verdicts[:-1]} == {"error"} and verdicts[-1].severity == "warning"
    assert all(v.hint for v in verdicts)
    assert verdicts[0].evidence == {"missing": ["bias"], "count": 1}


def test_incomplete_optimizer_state_and_wrong_step():
    model, optimizer = trained()
    checkpoint = full_checkpoint(model, optimizer)
    state = optimizer.state_dict()
    checkpoint["optimizer_states"] = [{**state, "state": {0: state["state"][0]}}]
    checkpoint["global_step"] = 6
    codes = [v.code for v in ck.content_problems(checkpoint, expected_of(model, optimizer))]
    assert codes == ["TFD704", "TFD707"]


def test_loading_a_checkpoint_without_optimizer_or_scheduler_state():
    model, optimizer = trained()
    checkpoint = full_checkpoint(model, optimizer)
    assert ck.load_problems(checkpoint) == []
    del checkpoint["optimizer_states"], checkpoint["lr_schedulers"]
    assert [v.code for v in ck.load_problems(checkpoint)] == ["TFD703", "TFD705"]
    del checkpoint["loops"]  # a weights-only file: nothing is expected of it
    assert ck.load_problems(checkpoint) == []


def test_resume_matches_the_restored_state():
    model, optimizer = trained()
    restored = ck.restored_state(full_checkpoint(model, optimizer))
    assert restored["steps"] == [1.0] and restored["lrs"] == [[1e-3]] and restored["global_step"] == 7

    def problems(weights=None, steps=(1.0,), lrs=((1e-3,),), step=7):
        verdicts = ck.resume_problems(
            restored, weights or model.state_dict(), list(steps), [list(x) for x in lrs], None, step, 1e-5
        )
        return [v.code for v in verdicts]

    assert problems() == []
    assert problems(weights={k: v + 1 for k, v in model.state_dict().items()}) == ["TFD710"]
    assert problems(weights={k: v.half() for k, v in model.state_dict().items()}) == ["TFD710"]
    assert problems(steps=(None,), lrs=((2e-3,),), step=0) == ["TFD711", "TFD712", "TFD714"]


def test_probe_loss_after_resume():
    assert ck.probe_loss_problem(2.0, 2.0005, 7, 1e-3) is None
    verdict = ck.probe_loss_problem(2.0, 2.5, 7, 1e-3)
    assert verdict.code == "TFD715" and verdict.evidence == {"saved": 2.0, "now": 2.5, "saved_step": 7}


def test_max_step_and_checksums():
    assert ck.max_step({0: {"step": torch.tensor(3.0)}, 1: {"step": 5}, 2: {}}) == 5.0
    assert ck.max_step({}) is None
    assert ck.checksums([torch.tensor([1.0, 2.0])]) == [(3.0, 5.0)]
