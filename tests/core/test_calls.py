"""The step's one recording of the calls ``training_step`` makes (core/calls.py), on real Trainers: every asker of a
batch reads the same recording, the hooks go before backward, the tensors go once every asker is done, and the user's
``training_step`` runs once per batch."""

from __future__ import annotations

import lightning.pytorch as pl
import torch

from lightning_tfdebug.core.calls import record_step, step_recording
from lightning_tfdebug.demo import TinyGPT, TinyTextDataModule
from lightning_tfdebug.primitives.calls import takes_tokens
from tests.helpers import SMALL, make_trainer


class CountingGPT(TinyGPT):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.steps = 0

    def training_step(self, batch, batch_idx):
        self.steps += 1
        return super().training_step(batch, batch_idx)


class Asker(pl.Callback):
    """Asks for the recording at every batch's start and reads it before backward."""

    def __init__(self, want=None):
        self.want = want
        self.recordings, self.calls, self.hooks_before_backward = [], [], []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.recordings.append(record_step(trainer, pl_module, batch, self, self.want))

    def on_before_backward(self, trainer, pl_module, loss):
        recording = self.recordings[-1]
        assert step_recording(trainer, recording.key[1]) is recording
        self.calls.append(recording.calls())
        self.hooks_before_backward.append(sum(len(m._forward_hooks) for m in pl_module.modules()))
        recording.done(self)


def test_every_asker_reads_one_recording_and_the_step_runs_once(tmp_path):
    first, second = Asker(), Asker(want=takes_tokens)
    model = CountingGPT(**SMALL)
    trainer = make_trainer(tmp_path, [first, second], max_steps=3)
    trainer.fit(model, TinyTextDataModule(batch_size=4))
    assert model.steps == 3  # the user's training_step ran once per batch: nothing replays it
    assert [id(r) for r in first.recordings] == [id(r) for r in second.recordings]  # one recording per batch
    assert len({id(r) for r in first.recordings}) == 3
    # both read the same calls: the model's own forward (depth 0) and, kept for the second asker, nothing deeper
    # that takes no tokens; the first reader removed every hook
    for a, b in zip(first.calls, second.calls, strict=True):
        assert [id(c) for c in a] == [id(c) for c in b]
        assert a and a[0].module is model and a[0].depth == 0
        assert isinstance(a[0].output, torch.Tensor) and a[0].output.shape[-1] == model.head.out_features
    assert first.hooks_before_backward == [0, 0, 0] and second.hooks_before_backward == [0, 0, 0]
    # once every asker is done, the recorded outputs are let go
    assert all(r.calls() == [] and not r.recording for r in first.recordings)


def test_an_asker_that_never_reads_does_not_hold_the_next_batch(tmp_path):
    class Forgets(pl.Callback):
        def __init__(self):
            self.recordings = []

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            self.recordings.append(record_step(trainer, pl_module, batch, self))

    forgets = Forgets()
    model = CountingGPT(**SMALL)
    trainer = make_trainer(tmp_path, [forgets], max_steps=2)
    trainer.fit(model, TinyTextDataModule(batch_size=4))
    earlier, last = forgets.recordings
    assert not earlier.recording and earlier.calls() == []  # the next batch's recording let the earlier one go
    assert last.recording  # nobody read the last one: its hooks are still on until the next fit releases it
    last.release()
    assert sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules()) == 0


def test_spike_guard_lets_the_recording_go_when_its_first_step_returns_none(tmp_path):
    """SpikeGuard asks for the first batch's recording and reads it before backward; a first step that returns None
    has no backward, so the hooks go at the batch's end instead of staying on for later forwards."""
    from lightning_tfdebug import SpikeGuard

    class SkipsFirst(CountingGPT):
        def training_step(self, batch, batch_idx):
            loss = super().training_step(batch, batch_idx)
            return None if batch_idx == 0 else loss

    class HooksAtBatchEnd(pl.Callback):
        def __init__(self):
            self.hooks = []

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.hooks.append(sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in pl_module.modules()))

    model, after = SkipsFirst(**SMALL), HooksAtBatchEnd()
    trainer = make_trainer(tmp_path, [SpikeGuard(), after], max_steps=2)
    trainer.fit(model, TinyTextDataModule(batch_size=4))
    assert len(after.hooks) == model.steps >= 2 and set(after.hooks) == {0}  # the skipped batch left no hook behind
