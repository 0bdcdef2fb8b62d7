import sys
import warnings
from typing import Any

import pytest
import torch
from lightning.pytorch.demos.boring_classes import BoringModel

from lightning_tfdebug import DebugCallback, GradNormMonitor, TFDebugError, TFDebugWarning, read_findings
from lightning_tfdebug.demo import TinyGPT, TinyTextDataModule
from tests.core.emitters import StepEmitter
from tests.helpers import make_trainer, run_distributed


@pytest.mark.parametrize("value", [0, -1, 1.5, True])
def test_every_n_steps_must_be_a_positive_integer(value):
    with pytest.raises((ValueError, TypeError), match="every_n_steps"):
        DebugCallback(every_n_steps=value)


def test_on_finding_names_the_choices():
    with pytest.raises(ValueError, match="'warn', 'stop', 'raise'; got 'crash'"):
        DebugCallback(on_finding="crash")


def test_cadence_defaults_to_log_every_n_steps(tmp_path):
    class Count(DebugCallback):
        steps: list

        def on_train_batch_end(self, trainer, *args):
            self.steps = getattr(self, "steps", [])
            if self.should_measure(trainer):
                self.steps.append(trainer.global_step)

    default, explicit = Count(), Count(every_n_steps=4)
    make_trainer(tmp_path, [default, explicit], max_steps=9, log_every_n_steps=3).fit(BoringModel())
    # on_train_batch_end sees global_step already incremented: steps 1..9
    assert default.steps == [3, 6, 9]
    assert explicit.steps == [4, 8]


def test_warn_writes_the_file_warns_once_and_logs_text(tmp_path):
    emitter = StepEmitter(at_step=2)
    trainer = make_trainer(tmp_path, [emitter], max_steps=5)
    with pytest.warns(TFDebugWarning, match=r"\[TFD399\] WARNING from StepEmitter at step 2"):
        trainer.fit(BoringModel())
    assert trainer.global_step == 5
    files = list((tmp_path / "tb" / "version_0" / "tfdebug").glob("findings-rank0.jsonl"))
    assert len(files) == 1
    [finding] = read_findings(files[0])
    assert finding.code == "TFD399" and finding.step == 2 and finding.source == "StepEmitter"
    assert emitter.findings == [finding]

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tmp_path / "tb" / "version_0"), size_guidance={"tensors": 0})
    acc.Reload()
    assert "tfdebug/TFD399/text_summary" in acc.Tags()["tensors"]


def test_findings_file_is_appended_across_fits(tmp_path):
    for _ in range(2):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            make_trainer(tmp_path, [StepEmitter(at_step=1)], max_steps=3, logger=False).fit(BoringModel())
    assert len(read_findings(tmp_path / "tfdebug" / "findings-rank0.jsonl")) == 2


def test_stop_stops_after_the_current_step(tmp_path):
    trainer = make_trainer(tmp_path, [StepEmitter(at_step=3, on_finding="stop")], max_steps=20)
    with pytest.warns(TFDebugWarning):
        trainer.fit(BoringModel())
    assert trainer.global_step == 3


def test_raise_raises_tfdebug_error_with_the_findings(tmp_path):
    trainer = make_trainer(tmp_path, [StepEmitter(at_step=2, on_finding="raise")], max_steps=20)
    with pytest.raises(TFDebugError, match="TFD399") as info, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(BoringModel())
    assert info.value.findings[0].code == "TFD399"


def test_info_findings_never_stop(tmp_path):
    trainer = make_trainer(tmp_path, [StepEmitter(at_step=2, severity="info", on_finding="raise")], max_steps=6)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(BoringModel())
    assert trainer.global_step == 6


def test_a_model_without_trainable_parameters_makes_the_callback_stand_aside(tmp_path):
    model = TinyGPT(d_model=16, n_layers=1, n_heads=2)
    model.head.weight.requires_grad_(False)

    class Frozen(TinyGPT):
        def configure_optimizers(self):
            return torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)

        def training_step(self, batch, batch_idx):
            return (self(batch["input_ids"]).sum() * 0).requires_grad_()

    frozen = Frozen(d_model=16, n_layers=1, n_heads=2)
    frozen.requires_grad_(False)
    monitor = GradNormMonitor(every_n_steps=1)
    make_trainer(tmp_path, [monitor], max_steps=3).fit(frozen, TinyTextDataModule(batch_size=2))
    assert not monitor.active
    # standing aside is information (the model is not at fault), with the setting that would let it run
    assert monitor.stood_aside["reason"].startswith("the model has no trainable parameters")
    assert monitor.stood_aside["setting"] == "a model with trainable parameters (`requires_grad=True`)"


@pytest.mark.ddp
@pytest.mark.parametrize("on_finding", ["raise", "stop"])
def test_a_finding_on_one_rank_only_stops_every_rank_together(tmp_path, on_finding):
    spec = {
        "strategy": "ddp",
        "model": {"d_model": 16, "n_layers": 1, "n_heads": 2},
        "data": {"batch_size": 4},
        "trainer": {"max_steps": 10},
        "callbacks": [{"class_path": "tests.core.emitters.RankLocalEmitter", "init_args": {"on_finding": on_finding}}],
    }
    results = run_distributed(tmp_path, spec, timeout=120)
    for r in results:
        if on_finding == "raise":
            assert r["error"]["type"] == "TFDebugError", r["error"]
        else:
            assert r["error"] is None and r["global_step"] == 3
    # the rank that saw it names itself; the other learns it happened elsewhere
    assert results[1]["findings"]["RankLocalEmitter"][0]["rank"] == 1
    assert results[0]["findings"]["RankLocalEmitter"] == []


def test_no_logger_warns_once_and_findings_still_reach_the_file(tmp_path):
    with pytest.warns(TFDebugWarning) as record:
        make_trainer(tmp_path, [StepEmitter(at_step=1), GradNormMonitor()], max_steps=3, logger=False).fit(
            BoringModel()
        )
    assert sum("has no logger" in str(w.message) for w in record) == 1
    assert read_findings(tmp_path / "tfdebug" / "findings-rank0.jsonl")[0].code == "TFD399"


@pytest.mark.parametrize("callback_cls", ["GradNormMonitor", "UpdateRatio"])
def test_one_host_transfer_per_measuring_step_and_none_in_between(tmp_path, monkeypatch, callback_cls):
    """Every read of a tensor's value on the host made from the callback's own code (``tolist``, ``item``,
    ``float()``/``int()``/``bool()`` of a tensor), counted with the step it happened on: one per measuring step, each
    moving all of that step's statistics at once, and none on the other steps."""
    import inspect

    import lightning_tfdebug
    from lightning_tfdebug.core import reduction

    module = inspect.getmodule(getattr(lightning_tfdebug, callback_cls)).__file__
    ours = {module, inspect.getmodule(DebugCallback).__file__, reduction.__file__}  # reduction: the named host read
    trainer_ref: dict[str, Any] = {}
    reads: list[tuple[int, int]] = []  # (global_step, values read)

    def spy(name):
        original = getattr(torch.Tensor, name)

        def counted(self, *args, **kwargs):
            caller = sys._getframe(1).f_code.co_filename
            if caller in ours and "trainer" in trainer_ref:
                reads.append((trainer_ref["trainer"].global_step, self.numel()))
            return original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counted)

    for name in ("tolist", "item", "__float__", "__int__", "__bool__"):
        spy(name)
    callback = getattr(lightning_tfdebug, callback_cls)(every_n_steps=5)
    trainer = make_trainer(tmp_path, [callback], max_steps=12)
    trainer_ref["trainer"] = trainer
    trainer.fit(TinyGPT(d_model=16, n_layers=1, n_heads=2), TinyTextDataModule(batch_size=4))
    # read at the end of the measured batch, when global_step has moved on (GradNormMonitor reads before the step)
    steps = sorted({step if callback_cls == "GradNormMonitor" else step - 1 for step, _ in reads})
    assert steps == [0, 5, 10], reads
    assert len(reads) == 3 and all(n > 5 for _, n in reads), reads  # one transfer each, every statistic at once
