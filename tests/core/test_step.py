import gc
import weakref

import torch

from lightning_tfdebug.core.step import step_norms, step_state


class FakeTrainer:  # a stand-in with the one attribute the step state reads: the state is keyed by the object
    def __init__(self, step: int) -> None:
        self.global_step = step


def test_each_trainer_has_one_state_that_goes_with_it():
    first, second = FakeTrainer(0), FakeTrainer(0)
    assert step_state(first) is step_state(first) and step_state(first) is not step_state(second)
    step_state(first).warned_no_logger = True
    assert not step_state(second).warned_no_logger
    held = weakref.ref(step_state(first))
    del first
    gc.collect()
    assert held() is None  # the state went with its trainer


def test_norms_are_computed_once_per_step_and_tensors_and_recomputed_after():
    trainer = FakeTrainer(3)
    grads = [torch.tensor([3.0, 4.0]), torch.tensor([1.0])]
    norms = step_norms(trainer, grads)
    assert norms.tolist() == [5.0, 1.0]
    grads[0].mul_(2)  # same step, same tensors: the first reading is shared, not recomputed
    assert step_norms(trainer, grads) is norms
    trainer.global_step = 4
    assert step_norms(trainer, grads).tolist() == [10.0, 1.0]
    assert step_norms(trainer, grads[:1]).tolist() == [10.0]  # other tensors: a new reading
