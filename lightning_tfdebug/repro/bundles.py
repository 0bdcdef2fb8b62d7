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
import os
import platform
import random
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
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
