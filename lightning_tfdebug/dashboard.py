"""The pack's TensorBoard dashboard: a custom-scalars layout (the "CUSTOM SCALARS" tab) that puts the series read
together on one chart, built from the ``KEYS`` the running members declare (each key's ``chart``)."""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

from lightning_tfdebug.core.compat import is_lightning_instance
from lightning_tfdebug.core.io import refused
from lightning_tfdebug.primitives.keys import Key

Chart = list[Any]  # ["Multiline", [regex, ...]] or ["Margin", [value, lower, upper]]
Layout = dict[str, dict[str, Chart]]

CATEGORIES: dict[str, str] = {
    "GradNormMonitor": "tfdebug: gradients and updates",
    "UpdateRatio": "tfdebug: gradients and updates",
    "LossAtInit": "tfdebug: loss and schedule",
    "OptimizerAudit": "tfdebug: loss and schedule",
    "DeadActivation": "tfdebug: activations",
    "ThroughputMonitor": "tfdebug: throughput and data",
    "BatchGuard": "tfdebug: throughput and data",
    "ScalerWatch": "tfdebug: precision",
    "NaNFirstFrame": "tfdebug: precision",
    "PerRankLogger": "tfdebug: ranks",
    "MaskProbe": "tfdebug: masks and targets",
}
"""The dashboard category of each member's charts, in the order the categories are shown."""


def member_charts(keys: Iterable[Key]) -> dict[str, list[str]]:
    """``{chart title: [tag regex, ...]}`` from a member's declared keys; a key family (``grad_norm/<group>``) leaves
    out the literal keys drawn on other charts (``grad_norm/total``)."""
    keys = tuple(keys)
    charts: dict[str, list[str]] = {}
    for key in keys:
        if not key.chart:
            continue
        elsewhere = [k.name for k in keys if "<" not in k.name and k.chart != key.chart and key.matches(k.name)]
        guard = f"(?!(?:{'|'.join(re.escape(n) for n in elsewhere)})$)" if elsewhere else ""
        charts.setdefault(key.chart, []).append(f"^{guard}{key.pattern()}$")
    return charts


def dashboard_layout(members: Mapping[str, Any], update_groups: Iterable[str] = ()) -> Layout:
    """The custom-scalars layout for the pack members that run, derived from their declared ``KEYS``.

    Args:
        members: ``{class name: the callback or its class}`` of the members that run; charts of absent members are
            left out.
        update_groups: UpdateRatio's parameter groups: one margin chart each (the ratio inside the healthy band).

    Returns:
        ``{category: {chart title: ["Multiline", [tag regex, ...]] | ["Margin", [value, lower, upper]]}}``.
    """
    layout: Layout = {}
    for category in dict.fromkeys(CATEGORIES.values()):
        charts: dict[str, Chart] = {}
        for name, member in members.items():
            if CATEGORIES.get(name) != category:
                continue
            for title, patterns in member_charts(getattr(member, "KEYS", ())).items():
                charts[title] = ["Multiline", patterns]
            if name == "UpdateRatio":
                for group in ("total", *update_groups):
                    charts[f"update ratio: {group}"] = [
                        "Margin",
                        [f"update_ratio/{group}", "update_ratio/band/low", "update_ratio/band/high"],
                    ]
        if charts:
            layout[category] = charts
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
