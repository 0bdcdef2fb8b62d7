"""CheckpointAudit's rules without a Trainer (functional/ck.py): each rule on plain values and
checkpoint-shaped dicts, its verdict on the harmful side and None (or nothing) on the healthy side."""

import pytest
import torch
from torch import nn

from lightning_tfdebug.functional import checkpoint_checks as ck
from lightning_tfdebug.functional import resume_checks
from lightning_tfdebug.functional.checkpoints import restored_state
from lightning_tfdebug.rules import rule

PATH = "/runs/ckpt/epoch=0-step=7.ckpt"


def severity(verdict):
    """The severity a verdict's finding takes: its own, else its rule's."""
    return verdict.severity or rule(verdict.code).severity


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


# ------------------------------------------------------------------------------------------------------ saved files
def test_a_complete_checkpoint_has_no_problems():
    model, optimizer = trained()
    assert ck.content_problems(full_checkpoint(model, optimizer), expected_of(model, optimizer), PATH) == []


def test_each_missing_part_is_named():
    model, optimizer = trained()
    expected = expected_of(model, optimizer)
    checkpoint = full_checkpoint(model, optimizer)
    checkpoint["state_dict"] = {"weight": torch.zeros(5, 4)}  # bias missing, weight of the wrong shape
    del checkpoint["optimizer_states"], checkpoint["lr_schedulers"], checkpoint["loops"]
    checkpoint["callbacks"] = {}
    verdicts = ck.content_problems(checkpoint, {**expected, "scaler_key": "MixedPrecision"}, PATH)
    assert [v.code for v in verdicts] == ["TFD701", "TFD702", "TFD703", "TFD705", "TFD706", "TFD707", "TFD708"]
    assert {severity(v) for v in verdicts[:-1]} == {"error"} and severity(verdicts[-1]) == "warning"
    assert all(v.hint or rule(v.code).hint for v in verdicts) and [v.key for v in verdicts] == [
        v.code for v in verdicts
    ]
    assert verdicts[0].evidence == {"missing": ["bias"], "count": 1, "path": PATH}
    assert all(v.message.endswith(" (file epoch=0-step=7.ckpt)") for v in verdicts)
    assert verdicts[0].message.startswith("The checkpoint lacks weights for 1 of the model's 2 tensors: bias.")
    assert "weight [5, 4] != [3, 4]" in verdicts[1].message and "(key `MixedPrecision`)" in verdicts[4].message
    assert "lacks loop progress (loops.fit_loop): a resume restarts" in verdicts[5].message


def test_weights_rule_without_a_state_dict_and_with_many_missing():
    [none] = ck.weights_problems({}, {"a": [1]}, PATH)
    assert none.code == "TFD701" and "holds no `state_dict`" in none.message and none.evidence == {"path": PATH}
    params = {f"w{i}": [2] for i in range(10)}
    [many] = ck.weights_problems({"state_dict": {}}, params, PATH)
    assert many.evidence["count"] == 10 and "w7 ..." in many.message
    assert ck.weights_problems({"state_dict": {"a": torch.zeros(1)}}, {"a": [1]}, PATH) == []


def test_incomplete_optimizer_state_and_wrong_step():
    model, optimizer = trained()
    checkpoint = full_checkpoint(model, optimizer)
    state = optimizer.state_dict()
    checkpoint["optimizer_states"] = [{**state, "state": {0: state["state"][0]}}]
    checkpoint["global_step"] = 6
    incomplete, wrong_step = ck.content_problems(checkpoint, expected_of(model, optimizer), PATH)
    assert (incomplete.code, wrong_step.code) == ("TFD704", "TFD707")
    assert incomplete.evidence == {"optimizer": 0, "groups": 1, "params_with_state": 1, "path": PATH}
    assert "1 of 1 param groups, state for 1 of 2 parameters." in incomplete.message
    assert wrong_step.evidence == {"saved": 6, "expected": 7, "path": PATH}
    assert wrong_step.message.startswith("The checkpoint's global_step is 6 but it was saved at step 7.")


def test_optimizer_scheduler_scaler_and_callback_rules_on_plain_values():
    no_steps = {"param_groups": [{}], "state": {0: {"exp_avg": 1}}}
    [verdict] = ck.optimizer_problems(
        {"optimizer_states": [no_steps]}, [{"groups": 1, "with_state": 1, "has_step": True}], PATH
    )
    assert verdict.code == "TFD704" and ", no step counts" in verdict.message
    assert ck.optimizer_problems({}, [], PATH) == []
    assert ck.scheduler_problem({"lr_schedulers": [{}]}, 1, PATH) is None
    assert ck.scheduler_problem({"lr_schedulers": []}, 1, PATH).evidence == {
        "saved": 0,
        "expected": 1,
        "path": PATH,
    }
    assert ck.scheduler_problem({}, 0, PATH) is None
    assert ck.scaler_problem({"P": {"scale": 2.0}}, "P", PATH) is None and ck.scaler_problem({}, None, PATH) is None
    assert ck.scaler_problem({"P": {}}, "P", PATH).code == "TFD706"
    assert ck.callbacks_problem({"callbacks": {"A": {}}}, ["A"], PATH) is None
    assert ck.callbacks_problem({}, ["A", "B"], PATH).evidence == {"missing": ["A", "B"], "path": PATH}


# ------------------------------------------------------------------------------------------------ files not checked
def test_weights_only_files_are_info_when_the_run_can_resume_and_a_warning_when_not():
    kept = ck.weights_only_checkpoint(PATH, ["ModelCheckpoint(/runs/full)"], False, 2)
    assert (kept.code, severity(kept), kept.key) == ("TFD709", "info", "weights_only")
    assert "while ModelCheckpoint(/runs/full) keeps full checkpoints to resume from" in kept.message
    written = ck.weights_only_checkpoint(PATH, [], True, 1)
    assert severity(written) == "info" and "this run also wrote a full one" in written.message
    lost = ck.weights_only_checkpoint(PATH, [], False, 1)
    assert severity(lost) == "warning" and lost.evidence == {"path": PATH, "resumable_savers": [], "resumable": False}
    assert "(1 checkpoint callback(s), none saving full checkpoints)" in lost.message and "save_last=True" in lost.hint


def test_checkpoints_not_checked_unreadable_and_damaged():
    skipped = ck.checkpoint_not_checked("(last save)", "it was written elsewhere")
    assert (
        skipped.message == "Checkpoint (last save) not checked: it was written elsewhere."
        and skipped.key == "not_checked"
    )
    unreadable = ck.unreadable_checkpoint(PATH, KeyError("x"))
    assert unreadable.key == PATH and unreadable.message.endswith("could not be opened for checking: KeyError: 'x'")
    damaged = ck.damaged_checkpoint(PATH, 100, RuntimeError("PytorchStreamReader failed\nmore"))
    assert (damaged.code, severity(damaged), damaged.key) == ("TFD716", "error", f"damaged:{PATH}")
    assert damaged.evidence == {"path": PATH, "bytes": 100, "error": "RuntimeError: PytorchStreamReader failed"}
    assert (
        "(100 bytes) cannot be read back: it is truncated or corrupt (PytorchStreamReader failed)." in damaged.message
    )


def test_sharded_directories_from_their_reading():
    complete = ck.ShardedReading("/d", needed={"a.distcp": 10}, sizes={"a.distcp": 10})
    assert ck.sharded_problems(complete) == []
    [unfinished] = ck.sharded_problems(ck.ShardedReading("/d", has_metadata=False))
    assert "has no `.metadata`" in unfinished.message and unfinished.key == "sharded:/d"
    reading = ck.ShardedReading("/d", needed={"a.distcp": 10, "b.distcp": 5}, sizes={"a.distcp": 4, "b.distcp": None})
    [incomplete] = ck.sharded_problems(reading)
    assert incomplete.evidence == {"path": "/d", "missing": ["b.distcp"], "short": ["a.distcp"], "files": 2}
    [cut] = ck.sharded_problems(ck.ShardedReading("/d", metadata_path="/d/.metadata", metadata_bytes=3,
                                                  metadata_error=EOFError("cut")))  # fmt: skip
    assert cut.key == "sharded:/d" and cut.evidence["path"] == "/d/.metadata"


# ---------------------------------------------------------------------------------------------------------- resumes
def test_loading_a_checkpoint_without_optimizer_or_scheduler_state():
    model, optimizer = trained()
    checkpoint = full_checkpoint(model, optimizer)
    assert resume_checks.load_problems(checkpoint) == []
    del checkpoint["optimizer_states"], checkpoint["lr_schedulers"]
    verdicts = resume_checks.load_problems(checkpoint)
    assert [(v.code, v.key) for v in verdicts] == [("TFD703", "resume"), ("TFD705", "resume")]
    assert verdicts[0].message.startswith("Resuming from a checkpoint without optimizer state")
    del checkpoint["loops"]  # a weights-only file: nothing is expected of it
    assert resume_checks.load_problems(checkpoint) == []


def live(restored, **changes):
    return {**restored, **changes}


def test_resume_matches_the_restored_state():
    model, optimizer = trained()
    restored = restored_state(full_checkpoint(model, optimizer))
    assert restored["steps"] == [1.0] and restored["lrs"] == [[1e-3]] and restored["global_step"] == 7

    def problems(**changes):
        return [v.code for v in resume_checks.resume_problems(restored, live(restored, **changes), 1e-5)]

    assert problems() == []
    moved = [(a + 1.0, b) for a, b in restored["sums"]]
    assert problems(sums=moved) == ["TFD710"]
    assert problems(dtypes={n: "torch.float16" for n in restored["names"]}) == ["TFD710"]
    assert problems(steps=[None], lrs=[[2e-3]], global_step=0) == ["TFD711", "TFD712", "TFD714"]


def test_each_resume_rule_on_plain_numbers():
    restored = {"names": ["w", "b"], "dtypes": {"w": "torch.float32", "b": "torch.float32"},
                "sums": [(1.0, 2.0), (3.0, 4.0)], "steps": [5.0], "lrs": [[0.1, 0.2]], "scale": 1024.0,
                "global_step": 10}  # fmt: skip
    same = dict(restored)
    assert resume_checks.weights_after_resume(restored, same, 1e-5) is None
    within = live(restored, sums=[(1.0 + 1e-6, 2.0), (3.0, 4.0)])
    assert resume_checks.weights_after_resume(restored, within, 1e-5) is None  # inside the tolerance
    moved = resume_checks.weights_after_resume(restored, live(restored, sums=[(1.1, 2.0), (3.0, 4.0)]), 1e-5)
    assert moved.code == "TFD710" and moved.evidence == {"differ": ["w"], "dtype_changed": []}
    assert "1 tensors differ from the checkpoint (w)" in moved.message
    halved = resume_checks.weights_after_resume(
        restored, live(restored, dtypes={"w": "torch.float16", "b": "torch.float32"}), 1e-5
    )
    assert "1 changed dtype (w: torch.float32 -> torch.float16)" in halved.message
    # a restored weight the live module lacks is compared by name, not by position
    fewer = live(restored, names=["b"], dtypes={"b": "torch.float32"}, sums=[(3.0, 4.0)])
    assert resume_checks.weights_after_resume(restored, fewer, 1e-5) is None
    [step] = resume_checks.steps_after_resume(restored, live(restored, steps=[0.0]))
    assert step.evidence == {"optimizer": 0, "saved": 5.0, "now": 0.0}
    assert resume_checks.steps_after_resume({"steps": [None]}, {"steps": [0.0]}) == []
    [lr] = resume_checks.learning_rates_after_resume(restored, live(restored, lrs=[[0.1, 0.3]]))
    assert lr.message == "Optimizer 0's learning rates after resume are [0.1, 0.3], the checkpoint holds [0.1, 0.2]."
    assert (
        resume_checks.learning_rates_after_resume(restored, live(restored, lrs=[[0.1]])) == []
    )  # param groups rebuilt
    scale = resume_checks.scale_after_resume(restored, live(restored, scale=65536.0))
    assert scale.message == "The GradScaler's scale after resume is 65536, the checkpoint holds 1024."
    assert resume_checks.scale_after_resume(restored, live(restored, scale=None)) is None
    step = resume_checks.global_step_after_resume(restored, live(restored, global_step=0))
    assert step.message == "The global step after resume is 0, the checkpoint was saved at 10."
    assert resume_checks.global_step_after_resume({"global_step": None}, {"global_step": 0}) is None


@pytest.mark.parametrize("now, found", [(2.0005, False), (2.5, True)])
def test_probe_loss_after_resume(now, found):
    verdict = resume_checks.probe_loss_problem(2.0, now, 7, 1e-3)
    assert (verdict is not None) == found
    if found:
        assert verdict.code == "TFD715" and verdict.evidence == {"saved": 2.0, "now": 2.5, "saved_step": 7}
        assert verdict.message == (
            "The model's output on the probe rows right after resuming is 2.5; at save time (step 7) it was 2."
        )
