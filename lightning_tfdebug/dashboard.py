"""The pack's TensorBoard dashboard: a custom-scalars layout (TensorBoard's "CUSTOM SCALARS" tab).

Every callback logs its scalars in one TensorBoard section named after it (``grad_norm/``, ``update_ratio/``,
``dead_activation/``, ``loss_at_init/``, ``throughput/``, ``per_rank/``, ``scaler/``, ``optimizer_audit/``,
``batch_guard/``, ``mask_probe/``, ``nan_first_frame/``). The layout puts the series that are read together on one
chart: gradient norms of every block, update ratios with the healthy band as a margin, dead and saturated fractions
of every layer, the loss against ln V and the unigram entropy, and each per-rank statistic with every rank on one
chart, so a straggler stands out.

:func:`dashboard_layout` builds the layout (a plain dict, TensorBoard's ``add_custom_scalars`` format) from the
members that run; :func:`write_dashboard` writes it to every logger whose experiment can take it (TensorBoard's
``SummaryWriter`` from ``torch.utils.tensorboard`` or tensorboardX; a write the disk refuses warns once, through
:mod:`lightning_tfdebug.core.io`, and never stops training). :func:`read_dashboard` reads it back from an event
directory.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from lightning_tfdebug.core.compat import is_lightning_instance
from lightning_tfdebug.core.io import refused

Chart = list[Any]  # ["Multiline", [regex, ...]] or ["Margin", [value, lower, upper]]
Layout = dict[str, dict[str, Chart]]

# Per-rank statistics PerRankLogger logs as per_rank/<stat>/rank<r>.
_PER_RANK = ("step_time_ms", "busy_ms", "dataloader_wait_ms", "peak_memory_gib", "loss")


def dashboard_layout(members: Iterable[str], update_groups: Iterable[str] = ()) -> Layout:
    """The custom-scalars layout for the pack members named in ``members``.

    Args:
        members: class names of the members that run (e.g. ``"GradNormMonitor"``); charts of absent members are left
            out.
        update_groups: UpdateRatio's parameter groups: one margin chart each (the ratio inside the healthy band).

    Returns:
        ``{category: {chart title: ["Multiline", [tag regex, ...]] | ["Margin", [value, lower, upper]]}}``.
    """
    present = set(members)
    layout: Layout = {}
    if "GradNormMonitor" in present or "UpdateRatio" in present:
        charts: dict[str, Chart] = {}
        if "GradNormMonitor" in present:
            charts["gradient norm per block"] = ["Multiline", [r"grad_norm/(?!total$|clip_frac$|nonfinite$).*"]]
            charts["gradient norm: total, clipped and non-finite"] = [
                "Multiline",
                [r"grad_norm/(total|clip_frac|nonfinite)$"],
            ]
        if "UpdateRatio" in present:
            charts["update ratio per group (band: healthy)"] = [
                "Multiline",
                [r"update_ratio/(?!param_norm/|band/).*", r"update_ratio/band/.*"],
            ]
            charts["parameter norm per group"] = ["Multiline", [r"update_ratio/param_norm/.*"]]
            for group in ("total", *update_groups):
                charts[f"update ratio: {group}"] = [
                    "Margin",
                    [f"update_ratio/{group}", "update_ratio/band/low", "update_ratio/band/high"],
                ]
        layout["tfdebug: gradients and updates"] = charts
    if "LossAtInit" in present or "OptimizerAudit" in present:
        charts = {}
        if "LossAtInit" in present:
            charts["loss against ln V and the unigram entropy"] = [
                "Multiline",
                [r"loss_at_init/(loss|ln_vocab|unigram_entropy)$"],
            ]
        if "OptimizerAudit" in present:
            charts["learning rate per group"] = ["Multiline", [r"optimizer_audit/lr/.*"]]
        layout["tfdebug: loss and schedule"] = charts
    if "DeadActivation" in present:
        layout["tfdebug: activations"] = {
            "dead fraction per layer": ["Multiline", [r"dead_activation/dead_frac/.*"]],
            "saturated fraction per layer": ["Multiline", [r"dead_activation/saturated_frac/.*"]],
            "zero fraction per layer": ["Multiline", [r"dead_activation/zero_frac/.*"]],
        }
    if "ThroughputMonitor" in present or "BatchGuard" in present:
        charts = {}
        if "ThroughputMonitor" in present:
            charts["tokens per second"] = ["Multiline", [r"throughput/tokens_per_sec.*"]]
            charts["step time (ms)"] = ["Multiline", [r"throughput/step_time_ms"]]
            charts["data wait and padding (fraction)"] = [
                "Multiline",
                [r"throughput/dataloader_wait_frac", r"throughput/padding_frac"],
            ]
            charts["model FLOPs utilisation"] = ["Multiline", [r"throughput/mfu"]]
        if "BatchGuard" in present:
            charts["batches"] = ["Multiline", [r"batch_guard/.*"]]
        layout["tfdebug: throughput and data"] = charts
    if "ScalerWatch" in present or "NaNFirstFrame" in present:
        charts = {}
        if "ScalerWatch" in present:
            charts["loss scale"] = ["Multiline", [r"scaler/scale"]]
            charts["skipped steps"] = ["Multiline", [r"scaler/skipped_(steps|frac)"]]
        if "NaNFirstFrame" in present:
            charts["steps skipped for non-finite values"] = ["Multiline", [r"nan_first_frame/skipped_steps"]]
        layout["tfdebug: precision"] = charts
    if "PerRankLogger" in present:
        charts = {f"{stat}: every rank": ["Multiline", [rf"per_rank/{stat}/rank\d+"]] for stat in _PER_RANK}
        charts["spread over ranks"] = ["Multiline", [r"per_rank/.*/max_(over|minus)_.*"]]
        layout["tfdebug: ranks"] = charts
    if "MaskProbe" in present:
        layout["tfdebug: masks and targets"] = {"mask probes": ["Multiline", [r"mask_probe/.*"]]}
    return layout


def _update_groups(trainer: Any, pl_module: Any, update_ratio: Any) -> tuple[str, ...]:
    """UpdateRatio's group names, found the way it will find them (once, at the start of fit)."""
    from lightning_tfdebug.core.groups import build_param_groups, training_model

    try:
        model = training_model(trainer, pl_module)
        return build_param_groups(model, groups=update_ratio.groups, depth=update_ratio.group_depth).group_names
    except Exception:  # the dashboard is a convenience: without group names, the total's margin chart remains
        return ()


def write_dashboard(trainer: Any, pl_module: Any, members: Mapping[str, Any]) -> Layout | None:
    """Write the layout for ``members`` (name -> callback) to every logger that can take it; return it, or None."""
    writers = [
        getattr(logger, "experiment", None)
        for logger in trainer.loggers
        if is_lightning_instance(logger, "TensorBoardLogger")  # of either Lightning package
    ]
    writers = [w for w in writers if callable(getattr(w, "add_custom_scalars", None))]
    if not writers:
        return None
    groups = _update_groups(trainer, pl_module, members["UpdateRatio"]) if "UpdateRatio" in members else ()
    layout = dashboard_layout(members, groups)
    for writer in writers:
        try:
            writer.add_custom_scalars(layout)
            writer.flush()
        except OSError as err:  # the event file refused (full disk, read-only): warned once, training goes on
            refused(getattr(writer, "log_dir", None) or getattr(writer, "logdir", None) or ".", err)
    return layout


def read_dashboard(event_dir: str) -> Layout | None:
    """The last custom-scalars layout written to the event files under ``event_dir``, in the dict format above."""
    import glob
    import os

    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
    from tensorboard.plugins.custom_scalar import layout_pb2

    found: Layout | None = None
    for path in sorted(glob.glob(os.path.join(event_dir, "**", "events.out.tfevents.*"), recursive=True)):
        for event in EventFileLoader(path).Load():
            for value in event.summary.value:
                if value.tag != "custom_scalars__config__":
                    continue
                proto = layout_pb2.Layout()
                proto.ParseFromString(value.tensor.string_val[0])
                found = {}
                for category in proto.category:
                    charts: dict[str, Chart] = {}
                    for chart in category.chart:
                        if chart.HasField("multiline"):
                            charts[chart.title] = ["Multiline", list(chart.multiline.tag)]
                        else:
                            series = chart.margin.series[0]
                            charts[chart.title] = ["Margin", [series.value, series.lower, series.upper]]
                    found[category.title] = charts
    return found
