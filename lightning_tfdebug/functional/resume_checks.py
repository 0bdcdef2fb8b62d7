"""CheckpointAudit's rules on a resume: what ``load_state_dict`` and the restored run disagree on (weights, steps,
learning rates, the loss scale, the global step) and a probe loss that moved since the save. Host values in, verdicts
out; the rules on the saved files are in :mod:`~lightning_tfdebug.functional.checkpoint_checks`."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from lightning_tfdebug.functional.checkpoint_checks import TFD703, TFD705
from lightning_tfdebug.functional.probes import relative_difference
from lightning_tfdebug.functional.verdicts import Rule, Verdict


# ---------------------------------------------------------------------------------------------------------- resumes
def load_problems(checkpoint: Mapping[str, Any]) -> list[Verdict]:
    """A full checkpoint (with ``loops``) being resumed without optimizer (``TFD703``) or scheduler (``TFD705``)
    state."""
    if "loops" not in checkpoint:
        return []
    out = []
    if "optimizer_states" not in checkpoint:
        message = (
            "Resuming from a checkpoint without optimizer state: Adam's moments and step counts restart from zero."
        )
        out.append(TFD703.verdict({}, key="resume", message=message))
    if "lr_schedulers" not in checkpoint:
        message = "Resuming from a checkpoint without LR scheduler state: the schedule restarts from its first step."
        out.append(TFD705.verdict({}, key="resume", message=message))
    return out


TFD710 = Rule(
    "TFD710",
    "error",
    "CheckpointAudit",
    title="weights after resume differ from the checkpoint, or changed dtype",
    headline="weights after resume differ from the checkpoint: {detail}",
    trigger="restored weights differ from the checkpoint (checksums) or changed dtype",
    hint=(
        "Something re-initialises or converts the module after the checkpoint is loaded (`on_fit_start`, `setup`, a "
        "precision change); load weights before building anything that overwrites them."
    ),
    reason="Measured: weights after resume are not the checkpoint's, so the resumed run is another run",
    message="The weights at the start of the resumed training do not match the checkpoint: {detail}.",
    details=(
        "At `on_load_checkpoint` a float64 (sum, sum of squares) checksum of every floating tensor and its dtype is "
        "recorded; at `on_train_start`, after Lightning restored everything, a tensor whose checksums differ by more "
        "than `weight_rtol` (default 1e-5) relative to `max(1, |saved|)`, or whose dtype changed, fires."
    ),
)


# What the checkpoint holds (`functional.checkpoints.restored_state`) against the live objects (`live_state`).
def weights_after_resume(restored: Mapping[str, Any], live: Mapping[str, Any], weight_rtol: float) -> Verdict | None:
    """``TFD710``: weights whose checksums (sum, sum of squares) differ from the checkpoint's beyond ``weight_rtol``,
    or whose dtype changed."""
    saved = dict(zip(restored["names"], restored["sums"]))
    now = dict(zip(live["names"], live["sums"]))
    names = [n for n in live["names"] if n in saved]
    dtype_changed = [n for n in names if live["dtypes"][n] != restored["dtypes"][n]]
    differ = [n for n in names if any(abs(x - y) > weight_rtol * max(1.0, abs(x)) for x, y in zip(saved[n], now[n]))]
    if not differ and not dtype_changed:
        return None
    detail = f"{len(differ)} tensors differ from the checkpoint ({', '.join(differ[:5])})" if differ else ""
    if dtype_changed:
        first = dtype_changed[0]
        change = f"{restored['dtypes'][first]} -> {live['dtypes'][first]}"
        detail += (", " if detail else "") + f"{len(dtype_changed)} changed dtype ({first}: {change})"
    evidence = {"differ": differ[:50], "dtype_changed": dtype_changed[:50]}
    return TFD710.verdict(evidence, key="resume", detail=detail)


TFD711 = Rule(
    "TFD711",
    "error",
    "CheckpointAudit",
    title="optimizer step counts after resume differ from the checkpoint",
    headline="optimizer step counts after resume: {now}, saved {saved}",
    trigger="optimizer step counts after resume differ from the checkpoint",
    hint="The optimizer was rebuilt or its state reset after loading; bias correction restarts.",
    reason=(
        "Measured: the optimizer's step counts changed on resume (bias correction restarts): the resumed run is "
        "another run"
    ),
    message="Optimizer {optimizer}'s step count after resume is {now}, the checkpoint holds {saved}.",
)


def steps_after_resume(restored: Mapping[str, Any], live: Mapping[str, Any]) -> list[Verdict]:
    """``TFD711``: an optimizer's largest step count other than the checkpoint's."""
    return [
        TFD711.verdict({"optimizer": i, "saved": saved, "now": now}, key="resume")
        for i, (saved, now) in enumerate(zip(restored["steps"], live["steps"]))
        if saved is not None and now != saved
    ]


TFD712 = Rule(
    "TFD712",
    "error",
    "CheckpointAudit",
    title="learning rates after resume differ from the checkpoint",
    headline="learning rates after resume: {now}, saved {saved}",
    trigger="learning rates after resume differ from the checkpoint",
    hint=(
        "The scheduler or the param groups were rebuilt after loading, or the LR is set in code that runs after the "
        "restore."
    ),
    reason="Measured: the learning rates changed on resume: the resumed run is not the run saved",
    message="Optimizer {optimizer}'s learning rates after resume are {now}, the checkpoint holds {saved}.",
    details=(
        "At `on_train_start` of a resumed fit: an optimizer's learning rates differ from the checkpoint's by more "
        "than a relative 1e-9 (`|a - b| / max(1, |a|, |b|)`), for the same number of param groups."
    ),
)


def learning_rates_after_resume(restored: Mapping[str, Any], live: Mapping[str, Any]) -> list[Verdict]:
    """``TFD712``: an optimizer's learning rates other than the checkpoint's (same number of param groups)."""
    return [
        TFD712.verdict({"optimizer": i, "saved": saved, "now": now}, key="resume")
        for i, (saved, now) in enumerate(zip(restored["lrs"], live["lrs"]))
        if len(saved) == len(now) and any(relative_difference(a, b) > 1e-9 for a, b in zip(saved, now))
    ]


TFD713 = Rule(
    "TFD713",
    "error",
    "CheckpointAudit",
    title="GradScaler scale after resume differs from the checkpoint",
    headline="GradScaler scale after resume {now:g}, saved {saved:g}",
    trigger="GradScaler scale after resume differs from the checkpoint",
    hint="The precision plugin's scaler was replaced after loading.",
    reason="Measured: the loss scale changed on resume: the resumed run is not the run saved",
    message="The GradScaler's scale after resume is {now:g}, the checkpoint holds {saved:g}.",
)


def scale_after_resume(restored: Mapping[str, Any], live: Mapping[str, Any]) -> Verdict | None:
    """``TFD713``: the GradScaler's scale other than the checkpoint's (when both are known)."""
    saved, now = restored["scale"], live["scale"]
    if saved is None or now is None or relative_difference(now, saved) <= 1e-9:
        return None
    return TFD713.verdict({"saved": saved, "now": now}, key="resume")


TFD714 = Rule(
    "TFD714",
    "error",
    "CheckpointAudit",
    title="global step after resume differs from the checkpoint",
    headline="global step after resume {now}, saved {saved}",
    trigger="global step after resume differs from the checkpoint",
    hint=(
        "The loop state was not restored: the checkpoint has no `loops` entry, or something removed it before "
        "Lightning restored it (an `on_load_checkpoint` that drops it). Resume from a full checkpoint."
    ),
    reason="Measured: the global step changed on resume: schedules and step-based logic follow another run",
    message="The global step after resume is {now}, the checkpoint was saved at {saved}.",
)


def global_step_after_resume(restored: Mapping[str, Any], live: Mapping[str, Any]) -> Verdict | None:
    """``TFD714``: the global step other than the one the checkpoint was saved at."""
    saved, now = restored["global_step"], live["global_step"]
    if not isinstance(saved, int) or now == saved:
        return None
    return TFD714.verdict({"saved": saved, "now": now}, key="resume")


def resume_problems(restored: Mapping[str, Any], live: Mapping[str, Any], weight_rtol: float) -> list[Verdict]:
    """The live objects at the start of a resumed fit against the checkpoint: ``TFD710``-``TFD714``, in code order."""
    found = [
        weights_after_resume(restored, live, weight_rtol),
        *steps_after_resume(restored, live),
        *learning_rates_after_resume(restored, live),
        scale_after_resume(restored, live),
        global_step_after_resume(restored, live),
    ]
    return [v for v in found if v is not None]


TFD715 = Rule(
    "TFD715",
    "error",
    "CheckpointAudit",
    title="the model's output on the probe rows after resuming differs from its output at save time",
    headline="probe-call loss after resume {now:.6g}, at save (step {saved_step}) {saved:.6g}",
    trigger="the stored model call, replayed right after resuming, gives another loss than at save time",
    hint=(
        "The model that trains is not the model that was saved: re-initialised after loading, a different dtype or "
        "precision, or a changed architecture."
    ),
    reason=(
        "Measured: the same model call gives a different output after resuming, so the model restored is not the one "
        "saved"
    ),
    message=(
        "The model's output on the probe rows right after resuming is {now:.6g}; at save time (step {saved_step}) "
        "it was {saved:.6g}."
    ),
    details=(
        "The callback keeps the first model call `training_step` makes on the first batch, its tensors cut to "
        "`probe_rows` (default 2) rows and copied to the host (in its checkpointed state). At each save it replays "
        "that call (eval mode, `no_grad`; never `training_step` itself) and reads the loss the call returns, else a "
        "fingerprint of its outputs in [-1, 1] (a signed sum of up to 4096 of them over the sum of their magnitudes; "
        "another model moves it by about 1/64). Right after resuming the same call is replayed; a "
        "relative difference (`|a - b| / max(1, |a|, |b|)`) above `loss_rtol` (default 1e-3) fires."
    ),
)


def probe_loss_problem(saved: float, now: float, saved_step: int | None, loss_rtol: float) -> Verdict | None:
    """``TFD715``: the loss on the probe batch right after resuming differs from the loss at save time."""
    if relative_difference(now, saved) <= loss_rtol:
        return None
    return TFD715.verdict({"saved": saved, "now": now, "saved_step": saved_step}, key="resume")


BLOCK = ("TFD701", "TFD719")
"""The codes reserved for CheckpointAudit's rules."""

RULES: tuple[Rule, ...] = (
    TFD710,
    TFD711,
    TFD712,
    TFD713,
    TFD714,
    TFD715,
)
"""The rules decided in this module, in code order."""
