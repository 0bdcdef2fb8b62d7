import warnings

import lightning.pytorch as pl
import pytest
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from lightning_tfdebug.core.scalars import ScalarSink, write_scalars
from lightning_tfdebug.findings import TFDebugWarning


def trainer_with(*loggers) -> pl.Trainer:
    return pl.Trainer(logger=list(loggers), enable_progress_bar=False, enable_model_summary=False)


def scalars(log_dir) -> dict[str, list[tuple[int, float]]]:
    events = EventAccumulator(str(log_dir))
    events.Reload()
    return {tag: [(e.step, pytest.approx(e.value)) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def test_one_event_to_tensorboard_reads_back_as_separate_scalars_and_reaches_callback_metrics(tmp_path):
    logger = TensorBoardLogger(tmp_path, name="tb")
    trainer = trainer_with(logger)
    write_scalars(trainer, {"grad_norm/total": 2.5, "update_ratio/blocks.0": 1e-3}, step=7)
    write_scalars(trainer, {}, step=8)  # nothing: nothing written
    logger.experiment.flush()
    assert scalars(logger.log_dir) == {"grad_norm/total": [(7, 2.5)], "update_ratio/blocks.0": [(7, 1e-3)]}
    assert float(trainer.callback_metrics["grad_norm/total"]) == 2.5


class Refusing(CSVLogger):
    def log_metrics(self, metrics, step=None):
        raise RuntimeError("disk full")


def test_a_refusing_logger_does_not_keep_the_others_from_the_scalars(tmp_path):
    good = TensorBoardLogger(tmp_path, name="tb")
    trainer = trainer_with(Refusing(tmp_path / "csv"), good)
    with pytest.raises(RuntimeError, match="disk full"):  # raised after the other logger has them
        write_scalars(trainer, {"a/b": 1.0}, step=1)
    good.experiment.flush()
    assert scalars(good.log_dir) == {"a/b": [(1, 1.0)]}


def test_the_sink_writes_once_per_step_the_latest_value_and_warns_once_for_a_refusing_logger(tmp_path):
    good = TensorBoardLogger(tmp_path, name="tb")
    trainer = trainer_with(good, Refusing(tmp_path / "csv"))
    sink = ScalarSink()
    sink.depth += 1
    assert sink.open and not sink.pending
    sink.add(3, {"a/x": 1, "a/y": 2.0})
    sink.add(3, {"a/x": 5.0})
    sink.add(2, {"a/x": 9.0})
    with pytest.warns(TFDebugWarning, match=r"a logger refused the pack's scalars of step 3 \(RuntimeError"):
        sink.flush(trainer)
    assert not sink.pending
    sink.add(4, {"a/x": 1.0})
    with warnings.catch_warnings():
        warnings.simplefilter("error", TFDebugWarning)
        sink.flush(trainer)  # the second refusal is not warned again
    good.experiment.flush()
    assert scalars(good.log_dir)["a/x"] == [(3, 5.0), (2, 9.0), (4, 1.0)] and scalars(good.log_dir)["a/y"] == [(3, 2.0)]
    with pytest.raises(ValueError):
        sink.add(5, {"a/x": "not a number"})
    sink.clear()
    assert not sink.open and not sink.pending
