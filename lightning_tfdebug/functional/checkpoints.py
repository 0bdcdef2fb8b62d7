"""CheckpointAudit's checks, without a Trainer: what a saved checkpoint file must hold, what a checkpoint being
loaded lacks, and whether the live objects right after a resume match what the checkpoint held.

Every check returns :class:`~lightning_tfdebug.functional.verdicts.Verdict` objects (error severity unless noted)
that the callback emits; the inputs are loaded checkpoint dicts and plain host values read from the live objects.
"""

from __future__ import annotations

import os
import pickle
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from lightning_tfdebug.findings import Severity
from lightning_tfdebug.functional.probes import relative_difference
from lightning_tfdebug.functional.verdicts import Verdict

HINT_WEIGHTS = "Save with `trainer.save_checkpoint` / ModelCheckpoint; check `on_save_checkpoint` overrides."
HINT_STATE = (
    "Something drops it from the checkpoint: `save_weights_only=True`, or an `on_save_checkpoint` override that pops "
    "`optimizer_states` / `lr_schedulers`. Resume needs them for the same training run."
)


def _verdict(code: str, message: str, evidence: dict[str, Any], hint: str, severity: Severity = "error") -> Verdict:
    return Verdict(code, message, evidence, hint=hint, severity=severity)


def resumable_savers(savers: Sequence[Any]) -> list[str]:
    """The checkpoint callbacks (``ModelCheckpoint`` or alike, read by attribute) that keep full checkpoints this run
    can resume from: not ``save_weights_only`` and keeping something (``save_top_k != 0`` or ``save_last``). Each is
    named by its class and directory. Host attributes only."""
    out = []
    for saver in savers:
        if getattr(saver, "save_weights_only", False):
            continue
        if getattr(saver, "save_top_k", 1) == 0 and not getattr(saver, "save_last", False):
            continue
        where = getattr(saver, "dirpath", None)
        out.append(f"{type(saver).__name__}({where})" if where else type(saver).__name__)
    return out


def max_step(state: Mapping[Any, Any]) -> float | None:
    """Largest ``step`` count over an optimizer's per-parameter states (host floats; resume / save time only)."""
    steps = []
    for entry in state.values():
        if isinstance(entry, Mapping) and "step" in entry:
            step = entry["step"]
            steps.append(float(step.item() if isinstance(step, Tensor) else step))  # host sync: save/resume only
    return max(steps) if steps else None


def checksums(tensors: Sequence[Tensor]) -> list[tuple[float, float]]:
    """(sum, sum of squares) of every tensor in float64, moved to the host in one transfer."""
    if not tensors:
        return []
    with torch.no_grad():
        device = tensors[0].device
        stats = torch.stack(
            [torch.stack([t.detach().double().sum(), t.detach().double().square().sum()]).to(device) for t in tensors]
        )
    return [tuple(row) for row in stats.tolist()]  # host sync: one per resume


# ------------------------------------------------------------------------------------------------------ saved files
def content_problems(checkpoint: Mapping[str, Any], expected: Mapping[str, Any]) -> list[Verdict]:
    """Compare a loaded checkpoint with what it must hold (:func:`expected` of the callback at save time: ``params``
    names and shapes, ``optimizers`` with ``groups`` / ``with_state`` / ``has_step``, ``schedulers``, ``scaler_key``,
    ``callbacks``, ``global_step``). Returns ``TFD701``-``TFD708`` verdicts, errors but ``TFD708``."""
    problems: list[Verdict] = []
    saved = checkpoint.get("state_dict")
    params: Mapping[str, list[int]] = expected.get("params", {})
    if not isinstance(saved, Mapping):
        problems.append(_verdict("TFD701", "The checkpoint holds no `state_dict` (model weights).", {}, HINT_WEIGHTS))
    else:
        missing = [k for k in params if k not in saved]
        wrong = [
            f"{k} {list(saved[k].shape)} != {params[k]}"
            for k in params
            if k in saved and isinstance(saved[k], Tensor) and list(saved[k].shape) != params[k]
        ]
        if missing:
            problems.append(
                _verdict(
                    "TFD701",
                    f"The checkpoint lacks weights for {len(missing)} of the model's {len(params)} tensors: "
                    f"{', '.join(missing[:8])}{' ...' if len(missing) > 8 else ''}.",
                    {"missing": missing[:50], "count": len(missing)},
                    HINT_WEIGHTS,
                )
            )
        if wrong:
            problems.append(
                _verdict(
                    "TFD702",
                    f"{len(wrong)} saved tensors have the wrong shape: {'; '.join(wrong[:5])}.",
                    {"mismatches": wrong[:50]},
                    "Save the full (gathered) tensors, or check the model was not rebuilt between save and load.",
                )
            )
    n_opt = len(expected.get("optimizers", []))
    states = checkpoint.get("optimizer_states")
    if n_opt and (not isinstance(states, list) or len(states) < n_opt):
        have = len(states) if isinstance(states, list) else 0
        problems.append(
            _verdict(
                "TFD703",
                f"The checkpoint holds optimizer state for {have} of {n_opt} optimizers: a resume restarts Adam's "
                "moments and step counts from zero.",
                {"saved": have, "expected": n_opt},
                HINT_STATE,
            )
        )
    elif n_opt:
        for i, (exp, state) in enumerate(zip(expected["optimizers"], states)):
            groups = len(state.get("param_groups", [])) if isinstance(state, Mapping) else 0
            per_param = state.get("state", {}) if isinstance(state, Mapping) else {}
            saved_with_state = sum(1 for s in per_param.values() if isinstance(s, Mapping) and s)
            no_step = exp["has_step"] and max_step(per_param) is None
            if groups != exp["groups"] or saved_with_state < exp["with_state"] or no_step:
                problems.append(
                    _verdict(
                        "TFD704",
                        f"Optimizer {i}'s saved state is incomplete: {groups} of {exp['groups']} param groups, "
                        f"state for {saved_with_state} of {exp['with_state']} parameters"
                        f"{', no step counts' if no_step else ''}.",
                        {"optimizer": i, "groups": groups, "params_with_state": saved_with_state},
                        HINT_STATE,
                    )
                )
    n_sched = int(expected.get("schedulers", 0))
    scheds = checkpoint.get("lr_schedulers")
    if n_sched and (not isinstance(scheds, list) or len(scheds) < n_sched):
        have = len(scheds) if isinstance(scheds, list) else 0
        problems.append(
            _verdict(
                "TFD705",
                f"The checkpoint holds LR scheduler state for {have} of {n_sched} schedulers: a resume restarts the "
                "schedule (warm-up again from its first step).",
                {"saved": have, "expected": n_sched},
                HINT_STATE,
            )
        )
    scaler_key = expected.get("scaler_key")
    if scaler_key and not (isinstance(checkpoint.get(scaler_key), Mapping) and "scale" in checkpoint[scaler_key]):
        problems.append(
            _verdict(
                "TFD706",
                f"The checkpoint lacks the fp16 GradScaler state (key `{scaler_key}`): a resume restarts the loss "
                "scale at its initial value and skips steps while it backs off again.",
                {"key": scaler_key},
                HINT_STATE,
            )
        )
    loops = checkpoint.get("loops")
    missing_progress = [k for k in ("global_step", "epoch") if k not in checkpoint]
    if not (isinstance(loops, Mapping) and "fit_loop" in loops):
        missing_progress.append("loops.fit_loop")
    if missing_progress:
        problems.append(
            _verdict(
                "TFD707",
                f"The checkpoint lacks loop progress ({', '.join(missing_progress)}): "
                "a resume restarts the epoch and step counters and the data order.",
                {"missing": missing_progress},
                HINT_STATE,
            )
        )
    elif "global_step" in expected and checkpoint.get("global_step") != expected["global_step"]:
        problems.append(
            _verdict(
                "TFD707",
                f"The checkpoint's global_step is {checkpoint.get('global_step')} but it was saved at step "
                f"{expected['global_step']}.",
                {"saved": checkpoint.get("global_step"), "expected": expected["global_step"]},
                HINT_STATE,
            )
        )
    saved_callbacks = checkpoint.get("callbacks")
    want = expected.get("callbacks", [])
    lost = [k for k in want if not isinstance(saved_callbacks, Mapping) or k not in saved_callbacks]
    if lost:
        problems.append(
            _verdict(
                "TFD708",
                f"The checkpoint lacks the state of {len(lost)} callbacks: {', '.join(lost[:5])}.",
                {"missing": lost},
                "Something removed `checkpoint['callbacks']` entries (an `on_save_checkpoint` override?); early "
                "stopping, checkpointing and the pack's callbacks lose their history on resume.",
                severity="warning",
            )
        )
    return problems


# ---------------------------------------------------------------------------------------------------------- resumes
def load_problems(checkpoint: Mapping[str, Any]) -> list[Verdict]:
    """A full checkpoint (with ``loops``) being resumed without optimizer (``TFD703``) or scheduler (``TFD705``)
    state."""
    out: list[Verdict] = []
    if "loops" not in checkpoint:
        return out
    if "optimizer_states" not in checkpoint:
        out.append(
            _verdict(
                "TFD703",
                "Resuming from a checkpoint without optimizer state: Adam's moments and step counts restart from zero.",
                {},
                HINT_STATE,
            )
        )
    if "lr_schedulers" not in checkpoint:
        out.append(
            _verdict(
                "TFD705",
                "Resuming from a checkpoint without LR scheduler state: the schedule restarts from its first step.",
                {},
                HINT_STATE,
            )
        )
    return out


def restored_state(checkpoint: Mapping[str, Any]) -> dict[str, Any]:
    """What a checkpoint being loaded holds, for :func:`resume_problems`: the floating weights' names, dtypes and
    checksums, every optimizer's largest step count and learning rates, the GradScaler's scale, the global step."""
    weights = checkpoint.get("state_dict", {})
    names = [k for k, v in weights.items() if isinstance(v, Tensor) and v.is_floating_point()]
    states = [s for s in checkpoint.get("optimizer_states", []) if isinstance(s, Mapping)]
    scale = None
    for value in checkpoint.values():
        if isinstance(value, Mapping) and "scale" in value and "growth_factor" in value:
            scale = float(value["scale"])
    return {
        "names": names,
        "dtypes": {k: str(weights[k].dtype) for k in names},
        "sums": checksums([weights[k] for k in names]),
        "steps": [max_step(s.get("state", {})) for s in states],
        "lrs": [[float(g["lr"]) for g in s.get("param_groups", [])] for s in states],
        "scale": scale,
        "global_step": checkpoint.get("global_step"),
    }


def resume_problems(
    restored: Mapping[str, Any],
    weights: Mapping[str, Tensor],
    optimizer_steps: Sequence[float | None],
    learning_rates: Sequence[Sequence[float]],
    scale: float | None,
    global_step: int,
    weight_rtol: float,
) -> list[Verdict]:
    """The live objects at the start of a resumed fit against :func:`restored_state`: the module's ``weights``
    (``TFD710``), each optimizer's largest step count (``TFD711``) and learning rates (``TFD712``), the GradScaler's
    ``scale`` (``TFD713``) and the ``global_step`` (``TFD714``)."""
    out: list[Verdict] = []
    names = [n for n in restored["names"] if n in weights]
    dtype_changed = [n for n in names if str(weights[n].dtype) != restored["dtypes"][n]]
    now = checksums([weights[n] for n in names])
    differ = [
        n
        for n, a, b in zip(names, restored["sums"], now)
        if any(abs(x - y) > weight_rtol * max(1.0, abs(x)) for x, y in zip(a, b))
    ]
    if differ or dtype_changed:
        detail = f"{len(differ)} tensors differ from the checkpoint ({', '.join(differ[:5])})" if differ else ""
        if dtype_changed:
            first = dtype_changed[0]
            detail += (", " if detail else "") + (
                f"{len(dtype_changed)} changed dtype ({first}: {restored['dtypes'][first]} -> {weights[first].dtype})"
            )
        out.append(
            _verdict(
                "TFD710",
                f"The weights at the start of the resumed training do not match the checkpoint: {detail}.",
                {"differ": differ[:50], "dtype_changed": dtype_changed[:50]},
                "Something re-initialises or converts the module after the checkpoint is loaded (`on_fit_start`, "
                "`setup`, a precision change); load weights before building anything that overwrites them.",
            )
        )
    for i, (saved, now_step) in enumerate(zip(restored["steps"], optimizer_steps)):
        if saved is not None and now_step != saved:
            out.append(
                _verdict(
                    "TFD711",
                    f"Optimizer {i}'s step count after resume is {now_step}, the checkpoint holds {saved}.",
                    {"optimizer": i, "saved": saved, "now": now_step},
                    "The optimizer was rebuilt or its state reset after loading; bias correction restarts.",
                )
            )
    for i, (saved_lrs, now_lrs) in enumerate(zip(restored["lrs"], learning_rates)):
        if len(saved_lrs) == len(now_lrs) and any(relative_difference(a, b) > 1e-9 for a, b in zip(saved_lrs, now_lrs)):
            out.append(
                _verdict(
                    "TFD712",
                    f"Optimizer {i}'s learning rates after resume are {now_lrs}, the checkpoint holds {saved_lrs}.",
                    {"optimizer": i, "saved": saved_lrs, "now": now_lrs},
                    "The scheduler or the param groups were rebuilt after loading, or the LR is set in code that "
                    "runs after the restore.",
                )
            )
    scale_saved = restored["scale"]
    if scale_saved is not None and scale is not None and relative_difference(scale, scale_saved) > 1e-9:
        out.append(
            _verdict(
                "TFD713",
                f"The GradScaler's scale after resume is {scale:g}, the checkpoint holds {restored['scale']:g}.",
                {"saved": restored["scale"], "now": scale},
                "The precision plugin's scaler was replaced after loading.",
            )
        )
    saved_step = restored["global_step"]
    if isinstance(saved_step, int) and global_step != saved_step:
        out.append(
            _verdict(
                "TFD714",
                f"The global step after resume is {global_step}, the checkpoint was saved at {saved_step}.",
                {"saved": saved_step, "now": global_step},
                "The loop state was not restored: the checkpoint has no `loops` entry, or something removed it "
                "before Lightning restored it (an `on_load_checkpoint` that drops it). Resume from a full "
                "checkpoint.",
            )
        )
    return out


def probe_loss_problem(saved: float, now: float, saved_step: int | None, loss_rtol: float) -> Verdict | None:
    """``TFD715``: the loss on the probe batch right after resuming differs from the loss at save time."""
    if relative_difference(now, saved) <= loss_rtol:
        return None
    return _verdict(
        "TFD715",
        f"The loss on the probe batch right after resuming is {now:.6g}; at save time (step {saved_step}) it was "
        f"{saved:.6g}.",
        {"saved": saved, "now": now, "saved_step": saved_step},
        "The model that trains is not the model that was saved: re-initialised after loading, a different dtype or "
        "precision, or a changed architecture.",
    )


# ---------------------------------------------------------------------------------------------------- opening files
HINT_DAMAGED = (
    "A full disk, a quota, or a process killed while saving leaves such a file: free space and resume from an "
    "earlier checkpoint that checks out."
)


class DamagedCheckpoint(Exception):
    """A checkpoint that cannot be read back: its :class:`Verdict` (``TFD716``) says why."""

    def __init__(self, verdict: Verdict) -> None:
        super().__init__(verdict.message)
        self.verdict = verdict


def _torch_load(path: str, weights_only: bool) -> Any:
    try:  # memory-mapped where the format allows: checking keys and shapes reads no tensor data
        return torch.load(path, map_location="cpu", weights_only=weights_only, mmap=True)
    except RuntimeError as err:
        if "mmap" not in str(err).lower() and "legacy" not in str(err).lower():
            raise
        return torch.load(path, map_location="cpu", weights_only=weights_only)  # legacy (non-zip) format


def load_checkpoint(path: str, *, written_by_this_run: bool) -> tuple[Any, bool]:
    """Open a checkpoint file safely: ``(checkpoint, weights_only)``.

    ``torch.load(weights_only=True)`` first: tensors and plain containers, no code runs. Only a file this run wrote
    itself (its content came from this process: hyper-parameters, callback state that hold other objects) falls
    back to a full unpickling; any other file that needs one is refused.

    Raises:
        DamagedCheckpoint: the file is empty, cut short or not a valid archive (``TFD716``).
        pickle.UnpicklingError: a file not written by this run holds objects other than data.
    """
    size = os.path.getsize(path)
    try:
        return _torch_load(path, weights_only=True), True
    except pickle.UnpicklingError:  # holds objects other than data (`weights_only` refused them)
        if not written_by_this_run:
            raise
    except (RuntimeError, EOFError, OSError, ValueError) as err:
        raise DamagedCheckpoint(damaged_verdict(path, size, err)) from None
    try:
        return _torch_load(path, weights_only=False), False
    except (RuntimeError, EOFError, ValueError, pickle.UnpicklingError) as err:
        raise DamagedCheckpoint(damaged_verdict(path, size, err)) from None


def damaged_verdict(path: str, size: int, error: BaseException) -> Verdict:
    """``TFD716``: the checkpoint file at ``path`` (``size`` bytes) could not be read back."""
    first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return _verdict(
        "TFD716",
        f"Checkpoint {path} ({size} bytes) cannot be read back: it is truncated or corrupt ({first}).",
        {"path": path, "bytes": size, "error": f"{type(error).__name__}: {first}"},
        HINT_DAMAGED,
    )


def sharded_problems(directory: str) -> list[Verdict]:
    """Whether a distributed-checkpoint (``torch.distributed.checkpoint``) directory is complete.

    Reads only its ``.metadata`` (no tensor data): the metadata must exist and load, and every shard file it lists
    must exist and be long enough for every item it is said to hold. Returns ``TFD716`` verdicts (empty: complete).
    """
    from torch.distributed.checkpoint import FileSystemReader

    meta_path = os.path.join(directory, ".metadata")
    if not os.path.isfile(meta_path):
        return [
            _verdict(
                "TFD716",
                f"Sharded checkpoint {directory} has no `.metadata`: the save did not finish (rank 0 writes it last).",
                {"path": directory},
                HINT_DAMAGED,
            )
        ]
    try:
        metadata = FileSystemReader(directory).read_metadata()
    except Exception as err:  # a cut or foreign metadata file
        return [damaged_verdict(meta_path, os.path.getsize(meta_path), err)]
    needed: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        relative = getattr(info, "relative_path", None)
        if relative is not None:
            end = int(getattr(info, "offset", 0)) + int(getattr(info, "length", 0))
            needed[relative] = max(needed.get(relative, 0), end)
    missing = sorted(name for name in needed if not os.path.isfile(os.path.join(directory, name)))
    short = sorted(
        name
        for name, end in needed.items()
        if name not in missing and os.path.getsize(os.path.join(directory, name)) < end
    )
    if not missing and not short:
        return []
    return [
        _verdict(
            "TFD716",
            f"Sharded checkpoint {directory} is incomplete: "
            + "; ".join(
                part
                for part in (
                    f"{len(missing)} shard file(s) its metadata lists are missing ({', '.join(missing[:4])})"
                    if missing
                    else "",
                    f"{len(short)} shard file(s) are shorter than the items they hold ({', '.join(short[:4])})"
                    if short
                    else "",
                )
                if part
            )
            + ".",
            {"path": directory, "missing": missing, "short": short, "files": len(needed)},
            HINT_DAMAGED,
        )
    ]
