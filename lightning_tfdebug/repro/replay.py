"""Replaying a repro bundle: the failing step run again, in a fresh Trainer, from what the bundle holds
(:func:`replay`), and the module rebuilt from a LightningCLI config or a class path (:func:`build_module`)."""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import tempfile
import traceback
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from lightning_tfdebug.repro.bundles import BUNDLE_META, Bundle, BundleError, class_path, load_bundle, restore_rng


# ---------------------------------------------------------------------------------------------- replay
@dataclass
class ReplayResult:
    """What replaying a bundle gave.

    Attributes:
        exception: the exception the replayed step raised, or None.
        traceback: its formatted traceback ("" when none).
        expected_type, expected_message: the exception recorded in the bundle.
        reproduced: True when the replay raised the recorded exception type with the same message.
        notes: what differed from the original run (device, precision, state not restored).
    """

    exception: BaseException | None
    traceback: str
    expected_type: str
    expected_message: str
    notes: list[str] = field(default_factory=list)

    @property
    def reproduced(self) -> bool:
        if self.exception is None:
            return False
        return class_path(self.exception) == self.expected_type and str(self.exception) == self.expected_message


@contextlib.contextmanager
def _quiet_lightning() -> Iterator[None]:
    """Lightning's loggers at WARNING for the duration of a replay, their levels put back after."""
    loggers = [
        logging.getLogger(n) for n in ("lightning.pytorch", "lightning.fabric", "pytorch_lightning", "lightning_fabric")
    ]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.WARNING)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


def _unchanged(batch: Any, *_: Any) -> Any:
    """The batch as it is: the replay's collate function and batch-transfer hooks."""
    return batch


def _restore_training_state(trainer: Any, state: Mapping[str, Any], notes: list[str]) -> None:
    """Load the bundle's optimizer and LR-scheduler states into the replay Trainer's, one by one, in order."""
    optimizers = list(state.get("optimizers") or [])
    schedulers = list(state.get("lr_schedulers") or [])
    if len(optimizers) != len(trainer.optimizers) or len(schedulers) != len(trainer.lr_scheduler_configs):
        notes.append(
            f"the run had {len(optimizers)} optimizer(s) and {len(schedulers)} LR scheduler(s), the replayed module "
            f"configures {len(trainer.optimizers)} and {len(trainer.lr_scheduler_configs)}: their states were not "
            "restored"
        )
        return
    try:
        for optimizer, saved in zip(trainer.optimizers, optimizers):
            optimizer.load_state_dict(saved)
        for config, saved in zip(trainer.lr_scheduler_configs, schedulers):
            config.scheduler.load_state_dict(saved)
    except (ValueError, KeyError, TypeError, RuntimeError) as err:
        notes.append(f"the optimizer or LR-scheduler state does not fit the replayed module ({err}); not restored")


def _replay_callback(bundle: Bundle, notes: list[str], load_state: bool = True) -> Any:
    import lightning.pytorch as pl

    step = int(bundle.meta.get("step", 0))

    class _Restore(pl.Callback):
        def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            # Put the step counter where the run failed, for modules whose behaviour depends on global_step.
            try:  # private Lightning structure; a failure only costs that fidelity
                trainer.fit_loop.epoch_loop.automatic_optimization.optim_progress.optimizer.step.total.completed = step
                trainer.fit_loop.epoch_loop.manual_optimization.optim_step_progress.total.completed = step
            except AttributeError:
                notes.append(f"global_step could not be set to {step}; the replayed step runs as step 0")
            if load_state and bundle.training_state is not None:
                _restore_training_state(trainer, bundle.training_state, notes)
            elif load_state:
                notes.append("the bundle holds no optimizer or LR-scheduler state: they start fresh")

        def on_train_batch_start(
            self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, idx: int
        ) -> None:
            if bundle.rng is not None:
                notes.extend(restore_rng(bundle.rng))

    return _Restore()


def _load_state(module: Any, state: Mapping[str, Tensor], source: str) -> None:
    try:
        module.load_state_dict(state)
    except RuntimeError as err:
        first = str(err).splitlines()[0]
        raise BundleError(
            f"{source} does not fit the module built for the replay ({first} ...): is the module built with the run's "
            "config? Replay with the run's config, or with --fresh-weights / load_state=False."
        ) from None


def _load_module_state(loaded: Bundle, module: Any, notes: list[str]) -> None:
    """Load the bundle's model state into ``module``, or, when it holds none, the checkpoint it names."""
    if loaded.model_state is not None:
        _load_state(module, loaded.model_state, "the bundle's model state")
        return
    ckpt = (loaded.meta.get("model_state") or {}).get("checkpoint")
    if not (ckpt and os.path.isfile(ckpt)):
        notes.append("the bundle holds no model state and names no readable checkpoint: fresh weights")
        return
    try:
        state = torch.load(ckpt, map_location="cpu", weights_only=True)["state_dict"]
    except Exception as err:
        raise BundleError(f"Could not read the checkpoint {ckpt} safely ({err}).") from None
    _load_state(module, state, f"the checkpoint {ckpt}")
    notes.append(f"model state from the last checkpoint {ckpt}, not from the failing step")


def _placement(
    run: Mapping[str, Any], accelerator: str | None, precision: str | None, notes: list[str]
) -> tuple[str, str]:
    """The replay's accelerator and precision: the given ones, else the run's where this machine has them."""
    if accelerator is None:
        ran_on_cuda = "CUDA" in str(run.get("accelerator", ""))
        accelerator = "gpu" if ran_on_cuda and torch.cuda.is_available() else "cpu"
        if ran_on_cuda and accelerator == "cpu":
            notes.append("the run used CUDA; replaying on the CPU (a device-side assert shows as a CPU error here)")
    if precision is None:
        precision = str(run.get("precision") or "32-true")
        if accelerator == "cpu" and precision.startswith("16"):
            notes.append(f"precision {precision} is not available on the CPU; replaying in 32-true")
            precision = "32-true"
    return accelerator, precision


def _fit_one_step(trainer: Any, module: Any, loaded: Bundle, result: ReplayResult) -> None:
    """Train ``module`` on the bundle's batch for one step; what it raises goes into ``result``."""
    from torch.utils.data import DataLoader

    # The batch was saved after it reached the device: do not run the batch-transfer hooks on it a second time.
    saved_hooks = {name: module.__dict__.get(name) for name in ("on_before_batch_transfer", "on_after_batch_transfer")}
    module.on_before_batch_transfer = _unchanged
    module.on_after_batch_transfer = _unchanged
    loader = DataLoader([loaded.batch], batch_size=None, collate_fn=_unchanged)
    try:
        trainer.fit(module, train_dataloaders=loader)
    except Exception as err:
        result.exception = err
        result.traceback = "".join(traceback.format_exception(type(err), err, err.__traceback__))
    finally:
        for name, hook in saved_hooks.items():
            if hook is None:
                module.__dict__.pop(name, None)
            else:
                setattr(module, name, hook)


def replay(
    bundle: str | os.PathLike[str] | Bundle,
    module: Any,
    *,
    accelerator: str | None = None,
    precision: str | None = None,
    load_state: bool = True,
) -> ReplayResult:
    """Run the failing training step of ``bundle`` again on ``module``, in a one-process Trainer, and return what it
    raised. The saved batch was captured on the device, so the batch-transfer hooks are not run again.

    Args:
        bundle: a bundle directory or a loaded :class:`Bundle`.
        module: a freshly built instance of the run's LightningModule.
        accelerator: ``"cpu"``, ``"gpu"``...; default: the run's if available here, else the CPU.
        precision: default: the run's (``16-mixed`` becomes ``32-true`` on the CPU).
        load_state: load the saved model state (or checkpoint) into ``module`` first, and the optimizers' and LR
            schedulers' states (when the bundle holds them) into the replay's, so a failure that depends on them
            (Adam's moments, the LR the schedule reached) replays.

    Raises:
        BundleError: the bundle is unusable or holds no batch.
    """
    import lightning.pytorch as pl

    loaded = bundle if isinstance(bundle, Bundle) else load_bundle(bundle)
    if "batch.pt" not in loaded.meta.get("files", {}):
        why = loaded.meta.get("batch_error") or (
            "the exception happened outside a training batch (validation, data loading or a hook)"
        )
        raise BundleError(
            f"{loaded.path} holds no batch ({why}), so there is no step to replay. Read its traceback in bundle.json."
        )
    notes: list[str] = []
    if loaded.rng is None:
        notes.append("the bundle holds no RNG states (capture_rng=False): dropout and other random ops will differ")
    elif "python" not in loaded.rng:
        notes.append(
            "Python's and NumPy's generator states were not captured (no step ReproCapture probed drew from them); "
            "torch's were restored"
        )
    if load_state:
        _load_module_state(loaded, module, notes)
    accelerator, precision = _placement(loaded.meta.get("run") or {}, accelerator, precision, notes)
    exc = loaded.exception
    if str(exc.get("type", "")).endswith(".TFDebugError"):
        notes.append(
            "the run was stopped by a lightning_tfdebug finding (TFDebugError), often before the forward; the "
            "replay runs without the pack's callbacks, so it shows what the model itself does with this batch"
        )
    result = ReplayResult(None, "", str(exc.get("type", "")), str(exc.get("message", "")), notes)
    # one step: no "GPU available" / tips / limit_train_batches banners; nothing left behind in the temp dir
    with _quiet_lightning(), tempfile.TemporaryDirectory(prefix="tfdebug-replay-") as scratch:
        trainer = pl.Trainer(
            accelerator=accelerator,
            devices=1,
            precision=precision,  # type: ignore[arg-type]
            max_epochs=1,
            limit_train_batches=1,
            limit_val_batches=0,
            num_sanity_val_steps=0,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            callbacks=[_replay_callback(loaded, notes, load_state)],
            default_root_dir=scratch,
        )
        _fit_one_step(trainer, module, loaded, result)
    return result


# --------------------------------------------------------------------------------------------- modules
def import_class(path: str) -> type:
    """The class named by ``"package.module.Class"``."""
    module_name, _, name = path.rpartition(".")
    try:
        obj = getattr(importlib.import_module(module_name), name)
    except (ImportError, AttributeError, ValueError) as err:
        raise BundleError(f"Cannot import {path!r} ({err}).") from None
    if not isinstance(obj, type):
        raise BundleError(f"{path!r} is not a class.")
    return obj


def build_module(
    config: str | os.PathLike[str] | None = None,
    *,
    model_class: str | None = None,
    hparams: Mapping[str, Any] | None = None,
) -> Any:
    """Build a LightningModule from a LightningCLI config's ``model`` section, or from saved hyper-parameters.

    The ``model`` section (``{class_path, init_args}`` or plain arguments of ``model_class``, also under a
    subcommand: ``fit: {model: ...}``) is parsed by jsonargparse, as LightningCLI does. Without one, ``hparams``.

    Raises:
        BundleError: the config cannot be read, the class cannot be imported or is not a LightningModule, or the
            arguments do not fit it.
    """
    import lightning.pytorch as pl
    import yaml
    from jsonargparse import ArgumentParser

    section: Any = None
    if config is not None:
        try:
            with open(config, encoding="utf-8") as f:
                data = yaml.safe_load(f) or {}
        except (OSError, yaml.YAMLError) as err:
            raise BundleError(f"Cannot read the config {config}: {err}") from None
        if not isinstance(data, dict):
            raise BundleError(f"{config} is not a LightningCLI config (a mapping with a 'model' section).")
        if "model" not in data:  # a config written for `python main.py --config c.yaml`: {fit: {model: ...}}
            nested = [v for v in data.values() if isinstance(v, dict) and "model" in v]
            data = nested[0] if len(nested) == 1 else data
        section = data.get("model")
        source = str(config)
    from_config = section is not None
    if section is None:
        # No config, or one without a model section: the hyper-parameters saved in the bundle. LightningCLI adds
        # `_instantiator` (and `_class_path` in subclass mode) to them.
        section = {k: v for k, v in dict(hparams or {}).items() if k not in ("_instantiator", "_class_path")}
        model_class = (hparams or {}).get("_class_path") or model_class
        if model_class is None:
            raise BundleError("No config and no model class: pass --config <LightningCLI yaml>.")
        source = "the hyper-parameters saved in the bundle"
    parser = ArgumentParser(exit_on_error=False)
    if from_config and isinstance(section, dict) and "class_path" in section:
        parser.add_subclass_arguments(pl.LightningModule, "model")
    else:
        if model_class is None:
            raise BundleError(f"{config}'s model section has no class_path; pass --model-class.")
        cls = import_class(model_class)
        if not issubclass(cls, pl.LightningModule):  # a tampered bundle must not get an arbitrary class called
            raise BundleError(f"{model_class!r} is not a LightningModule; refusing to build it.")
        parser.add_class_arguments(cls, "model")
    try:
        parsed = parser.parse_object({"model": section})
        return parser.instantiate_classes(parsed).model
    except Exception as err:
        raise BundleError(f"Could not build the model from {source}: {err}") from None


def replay_with_config(
    bundle_path: str | os.PathLike[str],
    config: str | os.PathLike[str] | None = None,
    *,
    model_class: str | None = None,
    **kwargs: Any,
) -> ReplayResult:
    """Load a bundle, build the module (config or saved hyper-parameters) and :func:`replay` it."""
    bundle = load_bundle(bundle_path)
    run = bundle.meta.get("run") or {}
    module = build_module(config, model_class=model_class or run.get("model_class"), hparams=run.get("hparams"))
    return replay(bundle, module, **kwargs)


def find_bundles(root: str | os.PathLike[str]) -> list[Path]:
    """Every complete bundle under ``root`` (a log dir, its ``tfdebug`` dir or a ``repro`` dir), oldest first."""
    found = [p.parent for p in Path(root).rglob(BUNDLE_META) if not p.parent.name.startswith(".tmp-")]
    return sorted(found, key=lambda p: p.stat().st_mtime)


def describe_exception(exception: BaseException) -> dict[str, Any]:
    return {
        "type": class_path(exception),
        "message": str(exception),
        "traceback": "".join(traceback.format_exception(type(exception), exception, exception.__traceback__)),
    }
