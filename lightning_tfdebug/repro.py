"""Repro bundles: what ReproCapture writes when training fails, and how to replay the failing step.

A bundle is a directory ``step<k>-rank<r>/`` of data only: ``bundle.json`` and ``.pt`` files that are read with
``torch.load(weights_only=True)`` after their checksum is verified (the files are listed in
``docs/callbacks/repro_capture.md``). A modified or truncated bundle raises :class:`BundleError`.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import json
import logging
import os
import platform
import random
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from lightning_tfdebug.core.io import publish_dir, write_text
from lightning_tfdebug.core.step import step_state
from lightning_tfdebug.findings import _jsonable

FORMAT_VERSION = 1
BUNDLE_META = "bundle.json"
_PARTS = ("batch.pt", "rng.pt", "model.pt", "training.pt")  # the data files a bundle may hold, besides its meta


class BundleError(RuntimeError):
    """A bundle that cannot be used: missing, incomplete, modified, or holding something other than data."""


# ------------------------------------------------------------------------------------------------- RNG
def capture_rng(host: bool = True, cpu: torch.Tensor | None = None) -> dict[str, Any]:
    """The states of torch's CPU generator and this process's CUDA generator (if initialised). Host-side, no sync.

    Args:
        host: also Python's and NumPy's global generators (10-40 us to convert, against about 1 us for torch's).
        cpu: the torch CPU state already taken at this batch's start
            (:func:`~lightning_tfdebug.core.batch.step_rng_state`), not copied again.
    """
    state: dict[str, Any] = {"torch": torch.get_rng_state() if cpu is None else cpu}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = [torch.cuda.get_rng_state()]  # the current device
    if host:
        state["python"] = random.getstate()
        try:
            import numpy as np

            state["numpy"] = np.random.get_state()
        except ImportError:  # pragma: no cover - numpy ships with torch wheels
            pass
    return state


def host_rng_moved(state: Mapping[str, Any]) -> bool:
    """Whether Python's or NumPy's global generator drew a number since :func:`capture_rng` took ``state``."""
    if "python" in state and random.getstate() != state["python"]:
        return True
    if "numpy" in state:
        import numpy as np

        _, key, pos, has_gauss, _ = np.random.get_state()
        before = state["numpy"]
        return pos != before[2] or has_gauss != before[3] or not np.array_equal(key, before[1])
    return False


def restore_rng(state: Mapping[str, Any]) -> list[str]:
    """Set every generator from :func:`capture_rng`'s output; returns notes on what could not be restored."""
    notes = []
    if "python" in state:
        version, internal, gauss = state["python"]
        random.setstate((int(version), tuple(int(x) for x in internal), gauss))
    if "torch" in state:
        torch.set_rng_state(state["torch"])
    if "numpy" in state:
        import numpy as np

        np.random.set_state(state["numpy"])
    cuda = state.get("cuda")
    if cuda:
        if torch.cuda.is_available():
            torch.cuda.set_rng_state(cuda[0])  # into the device the replay runs on
        else:
            notes.append("the run's CUDA generator state was not restored (no CUDA device here)")
    return notes


# -------------------------------------------------------------------------------------------- run info
def library_versions() -> dict[str, str]:
    versions = {"python": platform.python_version(), "torch": torch.__version__}
    for name in ("lightning", "numpy", "transformers", "lightning_tfdebug", "torchmetrics"):
        module = sys.modules.get(name)
        if module is None and name in ("lightning", "numpy", "lightning_tfdebug"):
            with contextlib.suppress(ImportError):
                module = importlib.import_module(name)
        if module is not None:
            versions[name] = str(getattr(module, "__version__", "unknown"))
    if torch.cuda.is_available():
        versions["cuda"] = str(torch.version.cuda)
    return versions


def git_commit(cwd: str | None = None) -> dict[str, Any] | None:
    """``{"commit", "dirty"}`` of the git checkout around ``cwd``, or None (no git, not a checkout)."""

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, timeout=5, check=True).stdout

    try:
        commit = git("rev-parse", "HEAD").strip()
        status = git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.SubprocessError):
        return None
    return {"commit": commit, "dirty": bool(status.strip())}


def run_first(trainer: Any, callback: Any) -> None:
    """Put ``callback`` first in ``trainer.callbacks``, so that it holds each batch before another callback can reject
    it (BatchGuard with ``on_finding="raise"``). A new list: Lightning is iterating the current one (``setup``)."""
    if callback in trainer.callbacks and trainer.callbacks[0] is not callback:
        trainer.callbacks = [callback, *(cb for cb in trainer.callbacks if cb is not callback)]


def class_path(obj: Any) -> str:
    cls = obj if isinstance(obj, type) else type(obj)
    return f"{cls.__module__}.{cls.__qualname__}"


def run_info(trainer: Any, pl_module: Any) -> dict[str, Any]:
    """The set-up of a run, as written to ``run.json`` and into every bundle."""
    datamodule = getattr(trainer, "datamodule", None)
    return {
        "seed": os.environ.get("PL_GLOBAL_SEED"),
        "torch_initial_seed": torch.initial_seed(),
        "versions": library_versions(),
        "git": git_commit(),
        "argv": list(sys.argv),
        "world_size": trainer.world_size,
        "num_nodes": trainer.num_nodes,
        "strategy": type(trainer.strategy).__name__,
        "accelerator": type(trainer.accelerator).__name__,
        "precision": str(trainer.precision),
        "accumulate_grad_batches": trainer.accumulate_grad_batches,
        "max_steps": trainer.max_steps,
        "gradient_clip_val": trainer.gradient_clip_val,
        "model_class": class_path(pl_module),
        "hparams": _jsonable(dict(getattr(pl_module, "hparams", {}) or {})),
        "datamodule_class": class_path(datamodule) if datamodule is not None else None,
        "datamodule_hparams": _jsonable(dict(getattr(datamodule, "hparams", {}) or {})) if datamodule else None,
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "host": platform.node(),
    }


def write_json_atomic(path: str | os.PathLike[str], data: Any) -> bool:
    """Write ``data`` as JSON, atomically; False (warned once) when the file system refuses."""
    return write_text(path, json.dumps(_jsonable(data), indent=2))


# --------------------------------------------------------------------------------------------- bundles
def _rebuild(batch: Any, leaf: Callable[[Any, str], Any], path: str = "batch") -> Any:
    """``batch`` with ``leaf(value, path)`` in place of each value that is not a mapping, list or tuple; mappings
    (``BatchEncoding``, ``UserDict``) become dicts and named tuples tuples."""
    if isinstance(batch, Mapping):
        return {k: _rebuild(v, leaf, f"{path}.{k}") for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        items = [_rebuild(v, leaf, f"{path}.{i}") for i, v in enumerate(batch)]
        return items if isinstance(batch, list) else tuple(items)
    return leaf(batch, path)


def to_plain(batch: Any, dropped: list[str], path: str = "batch") -> Any:
    """A copy of ``batch`` made of CPU tensors, dicts, lists, tuples and primitives: what ``weights_only`` loads.
    Anything else is replaced by None and its path added to ``dropped``."""

    def plain(value: Any, where: str) -> Any:
        if isinstance(value, Tensor):
            return value.detach().to("cpu", copy=True).clone()  # the host copy, made only when an exception happened
        if value is None or isinstance(value, (bool, int, float, str, bytes)):
            return value
        if type(value).__module__ == "numpy" and hasattr(value, "shape"):
            return torch.as_tensor(value)
        dropped.append(f"{where} ({type(value).__name__})")
        return None

    return _rebuild(batch, plain, path)


def holds_device_tensors(batch: Any) -> bool:
    """Whether any tensor in ``batch`` lives off the CPU (host metadata only)."""
    if isinstance(batch, Tensor):
        return batch.device.type != "cpu"
    if isinstance(batch, Mapping):
        return any(holds_device_tensors(v) for v in batch.values())
    if isinstance(batch, (list, tuple)):
        return any(holds_device_tensors(v) for v in batch)
    return False


def host_copy(batch: Any) -> Any:
    """A host copy of every tensor in ``batch`` (other values as they are) that a later device-side assert cannot take.

    CUDA tensors are copied into pinned memory with ``non_blocking=True``, queued ahead of the forward; CPU tensors
    are cloned, so in-place edits made by ``training_step`` do not reach the copy.
    """

    def copy(value: Any, _: str) -> Any:
        if not isinstance(value, Tensor):
            return value
        if value.is_cuda:
            out = torch.empty(value.shape, dtype=value.dtype, device="cpu", pin_memory=True)
            return out.copy_(value.detach(), non_blocking=True)  # queued; no host sync
        return value.detach().to("cpu", copy=True)

    return _rebuild(batch, copy)


def share_host_copy(trainer: Any, batch: Any, copy: Any) -> None:
    """Publish the host copy of this step's ``batch`` in the step state, for callbacks that diagnose a failed step."""
    state = step_state(trainer)
    state.host_copy_of, state.host_copy = batch, copy


def shared_host_copy(trainer: Any, batch: Any) -> Any | None:
    """The host copy of ``batch`` published by :func:`share_host_copy`, or None: after a CUDA device-side assert,
    the only copy of the batch that can still be read."""
    state = step_state(trainer)
    return state.host_copy if state.host_copy_of is batch else None


def _sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _save(obj: Any, directory: str, name: str, files: dict[str, str]) -> None:
    target = os.path.join(directory, name)
    with open(target, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    files[name] = _sha256(target)


def state_size_bytes(state: Mapping[str, Any]) -> int:
    return sum(v.numel() * v.element_size() for v in state.values() if isinstance(v, Tensor))


def _host_parts(
    meta: dict[str, Any],
    batch: Any,
    model_state: Mapping[str, Any] | None,
    training_state: Mapping[str, Any] | None,
) -> tuple[Any, dict[str, Tensor] | None, Any]:
    """The batch, the model state and the training state copied to the host, each on its own (after a CUDA
    device-side assert the parts already on the host must still be written); what failed is said in ``meta``."""
    plain_batch = None
    if batch is not None:
        dropped: list[str] = []
        meta.setdefault("batch_type", class_path(batch))
        try:
            plain_batch = to_plain(batch, dropped)
            meta["batch_dropped"] = dropped
        except Exception as err:
            meta["batch_error"] = f"the batch could not be copied to the host: {type(err).__name__}: {err}"
    cpu_state = None
    if model_state is not None:
        try:
            cpu_state = {k: v.detach().to("cpu", copy=True) for k, v in model_state.items()}
        except Exception as err:
            reason = f"the model state could not be copied to the host: {type(err).__name__}: {err}"
            meta["model_state"] = {**(meta.get("model_state") or {}), "saved": False, "reason": reason}
    plain_training = None
    if training_state is not None:
        dropped_training: list[str] = []
        try:
            plain_training = to_plain(dict(training_state), dropped_training, "training_state")
            meta["training_state_dropped"] = dropped_training
        except Exception as err:
            meta["training_state_error"] = f"could not be copied to the host: {type(err).__name__}: {err}"
    return plain_batch, cpu_state, plain_training


def _rng_tensors(rng: Mapping[str, Any], meta: dict[str, Any]) -> dict[str, Any]:
    """What ``rng.pt`` holds (torch's states, NumPy's key as a tensor); Python's and NumPy's scalars go to ``meta``."""
    tensors: dict[str, Any] = {"torch": rng["torch"]}
    if "cuda" in rng:
        tensors["cuda"] = list(rng["cuda"])
    if "numpy" in rng:
        name, key, pos, has_gauss, cached = rng["numpy"]
        tensors["numpy_key"] = torch.as_tensor(key.astype("int64"))
        meta["rng_numpy"] = {"name": name, "pos": int(pos), "has_gauss": int(has_gauss), "cached": float(cached)}
    if "python" in rng:
        version, internal, gauss = rng["python"]
        meta["rng_python"] = {"version": version, "state": list(internal), "gauss": gauss}
    return tensors


def _rng_states(tensors: Mapping[str, Any], meta: Mapping[str, Any]) -> dict[str, Any]:
    """The inverse of :func:`_rng_tensors`: :func:`capture_rng`'s states from ``rng.pt`` and ``meta``."""
    rng: dict[str, Any] = {"torch": tensors["torch"]}
    if "cuda" in tensors:
        rng["cuda"] = tensors["cuda"]
    py = meta.get("rng_python")
    if isinstance(py, dict):
        rng["python"] = (py["version"], py["state"], py["gauss"])
    npy = meta.get("rng_numpy")
    if isinstance(npy, dict) and "numpy_key" in tensors:
        import numpy as np

        key = tensors["numpy_key"].numpy().astype(np.uint32)
        rng["numpy"] = (str(npy["name"]), key, int(npy["pos"]), int(npy["has_gauss"]), float(npy["cached"]))
    return rng


def write_bundle(
    root: str | os.PathLike[str],
    *,
    step: int,
    rank: int,
    meta: dict[str, Any],
    batch: Any = None,
    rng: Mapping[str, Any] | None = None,
    model_state: Mapping[str, Any] | None = None,
    training_state: Mapping[str, Any] | None = None,
) -> str | None:
    """Write a bundle under ``root`` as ``step<k>-rank<r>`` (``-1``, ``-2``... if taken), complete or not at all.

    ``training_state`` (``{"optimizers": [...], "lr_schedulers": [...]}``, their ``state_dict()``s) goes to
    ``training.pt``.

    Returns:
        The bundle's path, or None when the file system refused (a warning says so once; see
        :mod:`lightning_tfdebug.core.io`).
    """
    meta = dict(meta)
    meta.update(format_version=FORMAT_VERSION, step=step, rank=rank)
    parts = _host_parts(meta, batch, model_state, training_state)

    def build(tmp: str) -> None:
        files: dict[str, str] = {}
        rng_part = _rng_tensors(rng, meta) if rng is not None else None
        for name, part in zip(_PARTS, (parts[0], rng_part, *parts[1:])):
            if part is not None:
                _save(part, tmp, name, files)
        meta["files"] = files
        with open(os.path.join(tmp, BUNDLE_META), "w", encoding="utf-8") as f:
            json.dump(_jsonable(meta), f, indent=2)
            f.flush()
            os.fsync(f.fileno())

    return publish_dir(build, os.fspath(root), f"step{step}-rank{rank}")


@dataclass
class Bundle:
    """A loaded bundle: ``meta`` from ``bundle.json``, and the batch, RNG states and model state (or None)."""

    path: str
    meta: dict[str, Any]
    batch: Any = None
    rng: dict[str, Any] | None = None
    model_state: dict[str, Tensor] | None = None
    training_state: dict[str, Any] | None = None

    @property
    def exception(self) -> dict[str, Any]:
        return self.meta.get("exception") or {}


def _load_pt(directory: str, name: str, expected_sha: str) -> Any:
    target = os.path.join(directory, name)
    if not os.path.isfile(target):
        raise BundleError(f"{target} is missing: the bundle is incomplete.")
    if _sha256(target) != expected_sha:
        raise BundleError(
            f"{target} does not match the checksum recorded in {BUNDLE_META}: the bundle was modified or damaged. "
            "Refusing to load it."
        )
    try:
        return torch.load(target, map_location="cpu", weights_only=True)
    except Exception as err:  # UnpicklingError and friends: anything that is not plain tensors and containers
        raise BundleError(
            f"Refusing to load {target}: it holds objects other than tensors and plain containers, which a bundle "
            f"never contains (torch.load(weights_only=True) said: {str(err).splitlines()[0]})."
        ) from None


def load_bundle(path: str | os.PathLike[str], *, load_model: bool = True) -> Bundle:
    """Read a bundle written by :func:`write_bundle`, as data only.

    Raises:
        BundleError: if the directory, its ``bundle.json`` or a listed file is missing, a checksum differs, or a file
            holds anything but tensors and plain containers.
    """
    directory = os.fspath(path)
    meta_path = os.path.join(directory, BUNDLE_META)
    if not os.path.isfile(meta_path):
        raise BundleError(f"{directory} is not a repro bundle: it has no {BUNDLE_META}.")
    try:
        with open(meta_path, encoding="utf-8") as f:
            meta = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise BundleError(f"{meta_path} is not valid JSON ({err}).") from None
    if not isinstance(meta, dict) or meta.get("format_version") != FORMAT_VERSION:
        raise BundleError(f"{meta_path} is not a bundle of format version {FORMAT_VERSION}.")
    files = meta.get("files")
    if not isinstance(files, dict) or not all(isinstance(v, str) for v in files.values()):
        raise BundleError(f"{meta_path} has no valid 'files' table.")
    for name in files:
        if name not in _PARTS:
            raise BundleError(f"{meta_path} lists an unexpected file {name!r}.")
    bundle = Bundle(directory, meta)
    if "batch.pt" in files:
        bundle.batch = _load_pt(directory, "batch.pt", files["batch.pt"])
    if "rng.pt" in files:
        bundle.rng = _rng_states(_load_pt(directory, "rng.pt", files["rng.pt"]), meta)
    if load_model and "model.pt" in files:
        bundle.model_state = _load_pt(directory, "model.pt", files["model.pt"])
    if load_model and "training.pt" in files:
        bundle.training_state = _load_pt(directory, "training.pt", files["training.pt"])
    return bundle


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


__all__ = [
    "Bundle",
    "BundleError",
    "ReplayResult",
    "build_module",
    "capture_rng",
    "find_bundles",
    "host_rng_moved",
    "load_bundle",
    "replay",
    "replay_with_config",
    "restore_rng",
    "run_info",
    "share_host_copy",
    "shared_host_copy",
    "write_bundle",
]


def replay_spike(bundle: Bundle, module: Any, load_state: bool = True) -> tuple[list[float], list[float], list[str]]:
    """Re-run a SpikeGuard bundle's model call on its batch (``no_grad``, eval mode, the bundle's CPU RNG state) and
    return ``(per-sample losses now, per-sample losses recorded, notes)``.

    Raises:
        BundleError: the bundle holds no replayable model call, or its module path is not in ``module``.
    """
    from lightning_tfdebug.functional.spikes import per_sample_losses
    from lightning_tfdebug.primitives.calls import read_logits

    meta, saved = bundle.meta, bundle.batch if isinstance(bundle.batch, dict) else {}
    expected = meta.get("per_sample_losses")
    if "call_args" not in saved or "targets" not in saved or not isinstance(expected, list):
        raise BundleError(f"{bundle.path} holds no replayable model call ({meta.get('attribution_error')}).")
    notes: list[str] = []
    if load_state and bundle.model_state is not None:
        _load_state(module, bundle.model_state, "the bundle's model state")
    else:
        checkpoint = (meta.get("model_state") or {}).get("checkpoint")
        notes.append(f"weights not in the bundle; nearest checkpoint: {checkpoint}" if checkpoint else "fresh weights")
    try:
        target = module.get_submodule(meta.get("call_module") or "")
    except AttributeError as err:
        raise BundleError(f"the module has no submodule {meta.get('call_module')!r} ({err}).") from None
    if bundle.rng is not None:
        notes.extend(restore_rng(bundle.rng))
    args, kwargs = saved["call_args"]["args"], saved["call_args"]["kwargs"]
    module.eval()
    with torch.no_grad():
        output = target(*args, **kwargs)
    batch_size = len(expected)
    logits = read_logits(output, batch_size)
    if logits is None:
        raise BundleError("the replayed model call returned no logits.")
    losses = per_sample_losses(logits, saved["targets"].to(logits.device), int(meta.get("shift", 1)), -100)
    return [float(v) for v in losses.tolist()], [float(v) for v in expected], notes
