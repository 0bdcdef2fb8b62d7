"""Charts as SVG text, drawn here with no plotting library: lines against the step (with marked steps, horizontal
lines and a logarithmic axis when asked), bars, and the box that says what is missing when there is nothing to draw.

Every chart has one unit on its value axis, its question as its title, and its alt text as the SVG's ``<title>``;
:func:`data_uri` embeds it in a page (``<img src="data:image/svg+xml;base64,...">``).

Example:
    >>> svg = line_chart("Did the loss fall?", "nats", {"loss": [(0, 3.0), (10, 2.0)]}, alt="TFD000: the loss")
    >>> svg.startswith("<svg") and "<title>TFD000: the loss</title>" in svg
    True
"""

from __future__ import annotations

import base64
import math
from collections.abc import Mapping, Sequence
from html import escape

WIDTH, HEIGHT = 720, 260
_LEFT, _RIGHT, _TOP, _BOTTOM = 64, 16, 40, 40
PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd", "#8c564b", "#e377c2", "#17becf", "#7f7f7f", "#bcbd22")
MARK = "#d62728"
Points = Sequence[tuple[float, float]]


def data_uri(svg: str) -> str:
    """``svg`` as a ``data:`` URI an ``<img>`` or a markdown image embeds (no file beside the report)."""
    return "data:image/svg+xml;base64," + base64.b64encode(svg.encode("utf-8")).decode("ascii")


def _number(value: float) -> str:
    if value == 0:
        return "0"
    magnitude = abs(value)
    if magnitude >= 1e5 or magnitude < 1e-3:
        return f"{value:.2g}"
    return f"{value:.4g}"


def nice_ticks(low: float, high: float, count: int = 5) -> list[float]:
    """About ``count`` round values from ``low`` to ``high`` (steps of 1, 2 or 5 times a power of ten)."""
    if not (math.isfinite(low) and math.isfinite(high)):
        return []
    if high <= low:
        return [low]
    raw = (high - low) / max(count - 1, 1)
    power = 10 ** math.floor(math.log10(raw))
    step = next(m * power for m in (1, 2, 5, 10) if m * power >= raw)
    first = math.ceil(low / step - 1e-9) * step
    ticks, value = [], first
    while value <= high + step * 1e-9:
        ticks.append(0.0 if abs(value) < step * 1e-9 else value)
        value += step
    return ticks


class _Frame:
    """The plotting area and the maps from data to pixels."""

    def __init__(self, xs: tuple[float, float], ys: tuple[float, float], log: bool) -> None:
        self.log = log
        x0, x1 = xs if xs[1] > xs[0] else (xs[0] - 1, xs[0] + 1)
        pad = (x1 - x0) * 0.02  # a mark at the last step stays inside the frame
        self.x0, self.x1 = x0 - pad, x1 + pad
        y0, y1 = ys
        if log:
            y0, y1 = math.log10(y0), math.log10(y1)
        if y1 <= y0:
            pad = abs(y0) * 0.1 or 1.0
            y0, y1 = y0 - pad, y1 + pad
        else:
            pad = (y1 - y0) * 0.06
            y0, y1 = y0 - pad, y1 + pad
        self.y0, self.y1 = y0, y1

    def x(self, value: float) -> float:
        return _LEFT + (value - self.x0) / (self.x1 - self.x0) * (WIDTH - _LEFT - _RIGHT)

    def y(self, value: float) -> float:
        v = math.log10(value) if self.log else value
        return HEIGHT - _BOTTOM - (v - self.y0) / (self.y1 - self.y0) * (HEIGHT - _TOP - _BOTTOM)

    def y_ticks(self) -> list[float]:
        if self.log:
            return [10.0**e for e in range(math.ceil(self.y0), math.floor(self.y1) + 1)]
        return nice_ticks(self.y0, self.y1)


def _open(title: str, alt: str) -> list[str]:
    return [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" viewBox="0 0 {WIDTH} {HEIGHT}" '
        f'role="img" font-family="sans-serif" font-size="11">',
        f"<title>{escape(alt)}</title>",
        f'<rect width="{WIDTH}" height="{HEIGHT}" fill="white"/>',
        f'<text x="{WIDTH / 2}" y="18" text-anchor="middle" font-size="13" font-weight="bold">{escape(title)}</text>',
    ]


def _axes(frame: _Frame, unit: str, x_label: str, x_ticks: Sequence[float] | None) -> list[str]:
    out = []
    bottom, right = HEIGHT - _BOTTOM, WIDTH - _RIGHT
    for tick in frame.y_ticks():
        y = frame.y(tick)
        if _TOP - 1 <= y <= bottom + 1:
            out.append(f'<line x1="{_LEFT}" x2="{right}" y1="{y:.1f}" y2="{y:.1f}" stroke="#e5e5e5"/>')
            out.append(f'<text x="{_LEFT - 4}" y="{y + 4:.1f}" text-anchor="end">{_number(tick)}</text>')
    for tick in nice_ticks(frame.x0, frame.x1, 7) if x_ticks is None else x_ticks:
        x = frame.x(tick)
        out.append(f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{bottom}" y2="{bottom + 4}" stroke="#444"/>')
        out.append(f'<text x="{x:.1f}" y="{bottom + 15}" text-anchor="middle">{_number(tick)}</text>')
    out.append(f'<line x1="{_LEFT}" x2="{right}" y1="{bottom}" y2="{bottom}" stroke="#444"/>')
    out.append(f'<line x1="{_LEFT}" x2="{_LEFT}" y1="{_TOP}" y2="{bottom}" stroke="#444"/>')
    out.append(f'<text x="{(_LEFT + right) / 2}" y="{HEIGHT - 6}" text-anchor="middle">{escape(x_label)}</text>')
    scale = " (log scale)" if frame.log else ""
    out.append(
        f'<text x="14" y="{(_TOP + bottom) / 2}" text-anchor="middle" '
        f'transform="rotate(-90 14 {(_TOP + bottom) / 2})">{escape((unit or "value") + scale)}</text>'
    )
    return out


def _legend(names: Sequence[str], colours: Sequence[str]) -> tuple[list[str], int]:
    """Every series' name and colour under the chart, in as many rows as they need; returns the rows' height."""
    out, x, y = [], _LEFT, HEIGHT + 8
    for name, colour in zip(names, colours):
        label = name if len(name) <= 60 else name[:57] + "..."
        width = 22 + 6 * len(label)
        if x + width > WIDTH - _RIGHT and x > _LEFT:
            x, y = _LEFT, y + 14
        out.append(f'<rect x="{x}" y="{y - 4}" width="10" height="3" fill="{colour}"/>')
        out.append(f'<text x="{x + 13}" y="{y}" font-size="10">{escape(label)}</text>')
        x += width
    return out, (y - HEIGHT + 8 if names else 0)


def _grow(out: list[str], extra: int) -> list[str]:
    """The chart ``extra`` pixels taller (its legend rows)."""
    if extra:
        height = HEIGHT + extra
        out[0] = (
            out[0]
            .replace(f'height="{HEIGHT}"', f'height="{height}"')
            .replace(f"0 0 {WIDTH} {HEIGHT}", f"0 0 {WIDTH} {height}")
        )
        out[2] = f'<rect width="{WIDTH}" height="{height}" fill="white"/>'
    return out


def line_chart(
    title: str,
    unit: str,
    series: Mapping[str, Points],
    *,
    alt: str,
    marks: Sequence[tuple[float, str]] = (),
    lines: Sequence[tuple[float, str]] = (),
    log_scale: bool = False,
    x_label: str = "step",
) -> str:
    """Each of ``series`` (``{label: [(step, value), ...]}``) as a line; ``marks``: ``(step, label)`` drawn as dashed
    verticals; ``lines``: ``(value, label)`` drawn as dotted horizontals. Non-finite values break a line; with
    ``log_scale``, values at or below 0 do. Falls back to :func:`missing_chart` when nothing is finite."""
    drawn = {name: [(x, y) for x, y in points if _shown(y, log_scale)] for name, points in series.items()}
    drawn = {name: points for name, points in drawn.items() if points}
    values = [y for points in drawn.values() for _, y in points] + [v for v, _ in lines if _shown(v, log_scale)]
    if not values:
        return missing_chart(title, "no finite value to draw in " + ", ".join(series) if series else "no series", alt)
    steps = [x for points in drawn.values() for x, _ in points] + [x for x, _ in marks]
    frame = _Frame((min(steps), max(steps)), (min(values), max(values)), log_scale)
    out = _open(title, alt) + _axes(frame, unit, x_label, None)
    colours = [PALETTE[i % len(PALETTE)] for i in range(len(series))]
    for (name, points), colour in zip(series.items(), colours):
        out += _polyline(frame, points, colour, log_scale)
        if len(drawn.get(name, ())) <= 20:  # few measurements: each a dot (a line of one point shows nothing)
            out += [
                f'<circle cx="{frame.x(x):.1f}" cy="{frame.y(y):.1f}" r="2.5" fill="{colour}"/>'
                for x, y in drawn.get(name, ())
            ]
    for value, label in lines:
        if _shown(value, log_scale):
            y = frame.y(value)
            out.append(
                f'<line x1="{_LEFT}" x2="{WIDTH - _RIGHT}" y1="{y:.1f}" y2="{y:.1f}" stroke="#555" '
                f'stroke-dasharray="2,3"/>'
            )
            out.append(f'<text x="{_LEFT + 4}" y="{y - 3:.1f}">{escape(label)}</text>')
    for row, (step, label) in enumerate(marks):
        x = frame.x(step)
        out.append(
            f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{_TOP}" y2="{HEIGHT - _BOTTOM}" stroke="{MARK}" '
            f'stroke-dasharray="4,3"/>'
        )
        if label:
            y = _TOP + 10 + 11 * (row % 4)  # neighbouring marks' labels on four rows, not on top of each other
            right = x > WIDTH - _RIGHT - 60  # near the right edge: the label to the left of its line
            anchor = f'x="{x - 3:.1f}" text-anchor="end"' if right else f'x="{x + 3:.1f}"'
            out.append(f'<text {anchor} y="{y}" fill="{MARK}" font-size="10">{escape(label)}</text>')
    legend, extra = _legend(list(series), colours)
    return "\n".join([*_grow(out, extra), *legend, "</svg>"])


def _shown(value: float, log_scale: bool) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value) and (value > 0 or not log_scale)


def _polyline(frame: _Frame, points: Points, colour: str, log_scale: bool) -> list[str]:
    out: list[str] = []
    run: list[str] = []
    for x, y in sorted(points, key=lambda p: p[0]):
        if _shown(y, log_scale):
            run.append(f"{frame.x(x):.1f},{frame.y(y):.1f}")
            continue
        if len(run) > 1:
            out.append(f'<polyline fill="none" stroke="{colour}" stroke-width="1.5" points="{" ".join(run)}"/>')
        run = []
    if len(run) > 1:
        out.append(f'<polyline fill="none" stroke="{colour}" stroke-width="1.5" points="{" ".join(run)}"/>')
    return out


def bar_chart(
    title: str,
    unit: str,
    bars: Sequence[tuple[str, float]],
    *,
    alt: str,
    lines: Sequence[tuple[float, str]] = (),
    x_label: str = "",
    highlight: Sequence[str] = (),
) -> str:
    """One bar per ``(label, value)`` (at most 64, in order); ``lines`` as in :func:`line_chart`; the labels in
    ``highlight`` drawn in the mark colour."""
    bars = [(label, v) for label, v in bars[:64] if _shown(v, False)]
    if not bars:
        return missing_chart(title, "no finite value to draw", alt)
    values = [v for _, v in bars] + [v for v, _ in lines if _shown(v, False)] + [0.0]
    frame = _Frame((0.0, float(len(bars))), (min(values), max(values)), False)
    ticks: list[float] = []
    out = _open(title, alt) + _axes(frame, unit, x_label, ticks)
    width = (WIDTH - _LEFT - _RIGHT) / len(bars)
    zero = frame.y(0.0)
    for i, (label, value) in enumerate(bars):
        x, y = frame.x(float(i)) + width * 0.15, frame.y(value)
        colour = MARK if label in highlight else PALETTE[0]
        out.append(
            f'<rect x="{x:.1f}" y="{min(y, zero):.1f}" width="{width * 0.7:.1f}" height="{abs(zero - y):.1f}" '
            f'fill="{colour}"><title>{escape(label)}: {_number(value)}</title></rect>'
        )
        if len(bars) <= 16:  # the value above its bar: close values read apart, not only as equal heights
            out.append(
                f'<text x="{x + width * 0.35:.1f}" y="{min(y, zero) - 3:.1f}" text-anchor="middle" font-size="10">'
                f"{_number(value)}</text>"
            )
        if len(bars) <= 24:
            room = max(6, int(width / 6))  # characters that fit under the bar
            shown = label if len(label) <= room else label[: room - 1] + "…"
            out.append(
                f'<text x="{x + width * 0.35:.1f}" y="{HEIGHT - _BOTTOM + 14}" text-anchor="middle" font-size="10">'
                f"{escape(shown)}</text>"
            )
    for value, label in lines:
        if _shown(value, False):
            y = frame.y(value)
            out.append(
                f'<line x1="{_LEFT}" x2="{WIDTH - _RIGHT}" y1="{y:.1f}" y2="{y:.1f}" stroke="#555" '
                f'stroke-dasharray="2,3"/>'
            )
            out.append(f'<text x="{_LEFT + 4}" y="{y - 3:.1f}">{escape(label)}</text>')
    return "\n".join([*out, "</svg>"])


def missing_chart(title: str, text: str, alt: str) -> str:
    """No axis: the title and a sentence saying what is missing (a series not logged, a short run)."""
    out = _open(title, alt)
    out[0] = out[0].replace(f'height="{HEIGHT}"', 'height="90"').replace(f"0 0 {WIDTH} {HEIGHT}", f"0 0 {WIDTH} 90")
    out[2] = f'<rect width="{WIDTH}" height="90" fill="#fafafa" stroke="#ccc"/>'
    words, line, rows = text.split(), "", []
    for word in words:
        if len(line) + len(word) > 105:
            rows.append(line)
            line = ""
        line = f"{line} {word}".strip()
    rows.append(line)
    for i, row in enumerate(rows[:4]):
        out.append(f'<text x="{WIDTH / 2}" y="{42 + 14 * i}" text-anchor="middle" fill="#555">{escape(row)}</text>')
    return "\n".join([*out, "</svg>"])
