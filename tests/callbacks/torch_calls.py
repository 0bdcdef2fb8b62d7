"""Count the torch calls a callback's own hooks make, step by step, in a real fit: a test of "nothing runs on a step
that does not measure" (no tensor op, no host sync, no hook)."""

from __future__ import annotations

from collections import Counter

from lightning.pytorch.callbacks import Callback
from torch.overrides import TorchFunctionMode

HOOKS = ("on_train_batch_start", "on_before_backward", "on_after_backward", "on_train_batch_end")


class _Count(TorchFunctionMode):
    def __init__(self, counts: Counter, step: int) -> None:
        super().__init__()
        self.counts, self.step = counts, step

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.counts[self.step] += 1
        return func(*args, **(kwargs or {}))


class _Open(Callback):
    def __init__(self, window: TorchCalls) -> None:
        self.window = window

    def __getattribute__(self, name):
        if name in HOOKS:
            return lambda trainer, *args: self.window._open(name)
        return super().__getattribute__(name)


class _Close(Callback):
    def __init__(self, window: TorchCalls) -> None:
        self.window = window

    def __getattribute__(self, name):
        if name in HOOKS:
            return lambda trainer, *args: self.window._close()
        return super().__getattribute__(name)


class TorchCalls:
    """``[*window.around(callback)]`` as the Trainer's callbacks: Lightning calls each hook of the callbacks in list
    order, so between the opening and the closing callback only ``callback``'s own hook runs; ``counts[i]`` is the
    number of torch functions and tensor methods (``.item()`` and ``.tolist()`` included) its hooks called for the
    ``i``-th training batch (the optimizer step before it, without gradient accumulation)."""

    def __init__(self) -> None:
        self.counts: Counter = Counter()
        self._mode: _Count | None = None
        self._batch = -1

    def around(self, callback: Callback) -> list[Callback]:
        return [_Open(self), callback, _Close(self)]

    def _open(self, hook: str) -> None:
        if hook == "on_train_batch_start":
            self._batch += 1
        self._mode = _Count(self.counts, self._batch)
        self._mode.__enter__()

    def _close(self) -> None:
        if self._mode is not None:
            self._mode.__exit__(None, None, None)
            self._mode = None
