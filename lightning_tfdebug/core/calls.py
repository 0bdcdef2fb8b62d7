"""The one record of a step's model calls: the module calls the user's real ``training_step`` makes, recorded once per
step for every member that asks (:func:`record_step`), read by each (:meth:`StepRecording.calls`) and let go when the
last has read (:meth:`StepRecording.done`). Nothing replays ``training_step``: the probes replay recorded model calls.

The call record and its finder are pure (:mod:`lightning_tfdebug.primitives.calls`,
:mod:`lightning_tfdebug.primitives.call_finder`); this module only ties one recording to one Trainer step.

Cost: on a recording step, a forward pre-hook and a forward hook on every module for the step's forward (removed by
the first reader, before backward); the outputs and arguments of the kept calls live until every asker has read
them. A step that records nothing pays nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
from torch import nn

from lightning_tfdebug.core.guard import model_is_compiled
from lightning_tfdebug.core.model import in_training_step
from lightning_tfdebug.core.step import step_state
from lightning_tfdebug.primitives.calls import CallRecorder, RecordedCall

Want = Callable[[nn.Module, tuple[Any, ...], dict[str, Any]], bool]
"""Which inner calls an asker wants kept (the outermost calls of ``training_step`` are always kept)."""


def compiled_boundaries(pl_module: pl.LightningModule) -> list[nn.Module]:
    """The modules whose hooks run outside compiled code: the LightningModule itself (a compiled ``forward`` is
    called by its eager ``__call__``) and every ``torch.compile`` wrapper (``OptimizedModule``) inside it."""
    try:
        from torch._dynamo.eval_frame import OptimizedModule
    except ImportError:  # pragma: no cover
        return [pl_module]
    return [pl_module, *(m for m in pl_module.modules() if isinstance(m, OptimizedModule) and m is not pl_module)]


class StepRecording:
    """The module calls of one batch's real ``training_step``, recorded for the members that asked.

    Attributes:
        key: ``(global_step, batch)`` the recording belongs to (the batch compared by identity).
        compiled: the model is compiled: only calls at the boundaries of compiled code were recorded
            (:func:`compiled_boundaries`), never inner ones (their hooks would make Dynamo recompile).
        returned: what ``training_step`` returned, once a reader has it (:meth:`note_returned`); None before.
    """

    def __init__(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any) -> None:
        self.key = (trainer.global_step, batch)
        self.compiled = model_is_compiled(trainer, pl_module)
        self.returned: Any = None
        self._wants: list[Want] = []
        self._askers: set[int] = set()
        self._calls: list[RecordedCall] | None = None
        step = trainer.global_step

        def keep() -> bool:  # inside this step's training_step: not a probe's forward, nor a later step's (an asker
            return in_training_step(pl_module) and trainer.global_step == step  # that never read holds nothing more)

        root: nn.Module = pl_module
        self._recorder: CallRecorder | None = CallRecorder(root, keep=keep, nested=True, want=self._wanted)
        # under DDP Lightning calls training_step through the module (args: the batch, its index): not a level
        self._recorder.transparent = lambda module, args, _: module is pl_module and bool(args) and args[0] is batch
        if self.compiled:
            self._recorder.modules = compiled_boundaries(pl_module)
        self._recorder.start()

    def _wanted(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
        return any(want(module, args, kwargs) for want in self._wants)

    def ask(self, asker: object, want: Want | None) -> None:
        """``asker`` will read this recording; ``want`` keeps the inner calls it needs."""
        self._askers.add(id(asker))
        if want is not None:
            self._wants.append(want)

    @property
    def recording(self) -> bool:
        """Whether the hooks are still on (no reader has stopped them)."""
        return self._recorder is not None

    def calls(self) -> list[RecordedCall]:
        """The recorded calls in the order they started; the first reader stops the hooks (call it once the forward
        is over: from ``on_before_backward`` or the batch's end). Empty once every asker is done."""
        if self._recorder is not None:
            self._calls = self._recorder.stop()
            self._recorder = None
        return list(self._calls or [])

    def note_returned(self, returned: Any) -> None:
        """Keep what ``training_step`` returned (its loss) for the readers of this recording."""
        if returned is not None:
            self.returned = returned

    def done(self, asker: object) -> None:
        """``asker`` has read what it needed; when every asker has, the calls (outputs, arguments) are let go."""
        self._askers.discard(id(asker))
        if not self._askers:
            self.release()

    def release(self) -> None:
        """Stop the hooks and let every recorded tensor go."""
        if self._recorder is not None:
            self._recorder.stop()
            self._recorder = None
        self._calls, self.returned = [], None


def record_step(
    trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, asker: object, want: Want | None = None
) -> StepRecording:
    """Ask for the calls this batch's ``training_step`` makes, from ``on_train_batch_start``: the first asker of the
    batch starts the recording, later ones join it (``want``: the inner calls an asker needs kept)."""
    state = step_state(trainer)
    current = state.recording
    if not isinstance(current, StepRecording) or current.key[0] != trainer.global_step or current.key[1] is not batch:
        if isinstance(current, StepRecording):
            current.release()  # an earlier batch's recording that an asker never finished
        current = state.recording = StepRecording(trainer, pl_module, batch)
    current.ask(asker, want)
    return current


def step_recording(trainer: pl.Trainer, batch: Any) -> StepRecording | None:
    """The recording of ``batch`` at the Trainer's current step, or None."""
    current = step_state(trainer).recording
    if not isinstance(current, StepRecording):
        return None
    step, recorded = current.key
    return current if step == trainer.global_step and recorded is batch else None
