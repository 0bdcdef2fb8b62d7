"""The guard around every hook of the pack's callbacks: a callback's own failure never ends training (it stands
aside, reported once), a batch hook with no work on this step is skipped, and the model calls the pack makes run
eagerly. :class:`~lightning_tfdebug.core.base.DebugCallback` wraps every hook a subclass defines here, once."""

from __future__ import annotations

import contextlib
import functools
import sys
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import lightning.pytorch as pl
import torch

from lightning_tfdebug.core.compat import Callback
from lightning_tfdebug.findings import TFDebugError

if TYPE_CHECKING:
    from lightning_tfdebug.core.base import DebugCallback

# Lightning's hooks: every `on_*` method of `Callback`, plus `setup` and `teardown`.
_HOOKS = frozenset(n for n in dir(Callback) if n.startswith("on_") or n in ("setup", "teardown"))
# Hooks that still run after a callback failed, so it can remove its module hooks and release what it holds.
_CLEANUP_HOOKS = frozenset({"teardown", "on_train_end", "on_fit_end", "on_exception"})
#: The hooks Lightning calls within one training batch, from its start to its end: the ones the pack dispatches per
#: step (:meth:`DebugCallback.busy_at`).
BATCH_HOOKS = (
    "on_train_batch_start",
    "on_before_backward",
    "on_after_backward",
    "on_before_zero_grad",
    "on_before_optimizer_step",
    "on_train_batch_end",
)


class TFDebugCallbackError(RuntimeError):
    """A callback of the pack failed in its own code on one rank of a multi-process run.

    Standing aside on that rank alone would leave the other ranks waiting in the callback's next collective (a hang),
    so the guard ends the run instead; the traceback is in ``<log_dir>/tfdebug/callback-errors-rank<r>.txt``.
    """


@contextlib.contextmanager
def eager_model_calls() -> Iterator[None]:
    """Run the pack's own calls of the user's model (probes, replays) eagerly, even where its code is compiled.

    A probe's shapes differ from the training step's, so a compiled forward would recompile; ``force_eager`` compiles
    nothing and leaves the user's graphs untouched. Costs about 0.2 ms to enter: wrap a probe, never a per-step hook.
    """
    if "torch._dynamo" not in sys.modules:  # nothing in this process compiled anything
        yield
        return
    with torch.compiler.set_stance("force_eager"):
        yield


def model_is_compiled(trainer: pl.Trainer, pl_module: pl.LightningModule) -> bool:
    """Whether ``torch.compile`` wraps the model, a submodule, or replaced a module's ``forward`` (module hooks added
    to such code make Dynamo recompile it)."""
    from lightning_tfdebug.core.model import is_compiled

    if is_compiled(trainer, pl_module):
        return True
    for module in pl_module.modules():
        forward = module.__dict__.get("forward")
        if hasattr(forward, "_torchdynamo_orig_callable") or hasattr(
            getattr(forward, "__func__", None), "_torchdynamo_orig_callable"
        ):
            return True
    return False


def busy_at_step(callback: DebugCallback, step: int | None) -> bool:
    """``callback.busy_at(step)``, asked by the pack for its members and by the guard for a callback on its own; True
    when the step is unknown or ``busy_at`` fails (every hook then runs, and the hook's guard reports the failure)."""
    if step is None:
        return True
    try:
        return bool(callback.busy_at(step))
    except Exception:
        return True


def _guard(name: str, hook: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap one hook method so that an exception from the callback's own code never ends training."""

    batch_hook = name in BATCH_HOOKS
    starts_batch = name == "on_train_batch_start"

    @functools.wraps(hook)
    def guarded(self: DebugCallback, *args: Any, **kwargs: Any) -> Any:
        if self.failure is not None and name not in _CLEANUP_HOOKS:
            return None  # failed earlier: stands aside
        if self._in_hook:  # a hook calling another (`super().setup`): the outer one guards
            return hook(self, *args, **kwargs)
        if batch_hook and self.pack is None and not self._manual_optimization and self._per_step_dispatch:
            # On its own, a callback skips the batch hooks it has no work for on this step, as the pack does for
            # its members: decided once per batch, from the step alone, so every rank skips alike.
            if starts_batch:
                self._busy_batch = busy_at_step(self, args[0].global_step if args else None)
            if not self._busy_batch and name not in type(self).every_batch_hooks:
                return None

        def call() -> Any:
            result = hook(self, *args, **kwargs)
            if name == "on_fit_end":
                self._announce_aside()
                self._close_coverage()
            return result

        return _run_as_hook(self, name, args[0] if args else None, call)

    guarded._tfdebug_guarded = True  # type: ignore[attr-defined]
    return guarded


def _run_as_hook(callback: DebugCallback, hook: str, trainer: Any, call: Callable[[], Any]) -> Any:
    """Run ``call()`` as the callback's hook ``hook``: its own exceptions go to :meth:`DebugCallback.callback_failed`
    and never end training; a :class:`TFDebugError` (``on_finding="raise"``) passes unchanged."""
    callback._in_hook = True
    callback._hook_trainer = trainer  # its step is read only if the callback stands aside
    try:
        return call()
    except TFDebugError:
        raise  # raised on purpose (on_finding="raise"); the same on every rank
    except Exception as err:  # the callback's own failure; BaseException (KeyboardInterrupt) passes
        callback.callback_failed(hook, err, trainer)
        return None
    finally:
        callback._in_hook = False
        callback._hook_trainer = None  # no reference to the Trainer outlives the hook
