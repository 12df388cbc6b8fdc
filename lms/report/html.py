"""One self-contained HTML page of an analysis: the `[LMS]` lines, device memory over the step with
and without the plan (zoomable), the copies' timeline and the plan's table of saved storages.

Note: [A report that works offline]
The page holds everything it shows: inline SVG for the graphs, a few lines of script for zoom
(the mouse wheel over a graph narrows or widens its time axis, a double click resets it), no
fonts, styles or scripts fetched from anywhere, so it opens from a file on a machine without a
network, as a pickled memory_viz snapshot does not.
"""

from __future__ import annotations

import html
import os
from collections.abc import Sequence

from lms.analysis.clock import Clock
from lms.analysis.simulate import SimResult, op_seconds
from lms.core.devices import DeviceSpec
from lms.core.plan import Plan
from lms.core.records import Trace
from lms.core.units import format_bytes

__all__ = ["write_html"]

_WIDTH, _HEIGHT = 1000, 260
_SCRIPT = """
for (const svg of document.querySelectorAll('svg.zoom')) {
  const full = svg.getAttribute('viewBox').split(' ').map(Number);
  svg.addEventListener('wheel', (event) => {
    event.preventDefault();
    const box = svg.getAttribute('viewBox').split(' ').map(Number);
    const at = box[0] + box[2] * (event.offsetX / svg.clientWidth);
    const wanted = box[2] * (event.deltaY > 0 ? 1.25 : 0.8);
    const width = Math.min(full[2], Math.max(full[2] / 1000, wanted));
    const left = Math.min(
      Math.max(full[0], at - (at - box[0]) * width / box[2]), full[0] + full[2] - width);
    svg.setAttribute('viewBox', [left, box[1], width, box[3]].join(' '));
  });
  svg.addEventListener('dblclick', () => {
    svg.setAttribute('viewBox', full.join(' '));
    window.getSelection().removeAllRanges();
  });
}
"""


def _steps(
    times_s: Sequence[float], values: Sequence[float], end_s: float, low: float, top: float
) -> str:
    """SVG polyline points of a step function over the graph's box, whose height spans ``low``
    to ``top``."""
    if not times_s or top <= low or end_s <= 0:
        return ""
    points, last = [], values[0]
    for time_s, value in zip(times_s, values, strict=True):
        x = _WIDTH * time_s / end_s
        points += [f"{x:.2f},{_y(last, low, top):.2f}", f"{x:.2f},{_y(value, low, top):.2f}"]
        last = value
    points.append(f"{_WIDTH:.2f},{_y(last, low, top):.2f}")
    return " ".join(points)


def _y(value: float, low: float, top: float) -> float:
    return _HEIGHT * (1 - (value - low) / (top - low))


def _memory_svg(plain: SimResult, planned: SimResult | None, budget_bytes: int) -> str:
    results = [r for r in (plain, planned) if r is not None]
    end_s = max(r.timeline_s[-1] if r.timeline_s else 0.0 for r in results) or 1.0
    top = 1.05 * max(budget_bytes, *(r.peak_bytes for r in results))
    # the axis starts below the lowest curve rather than at zero: the workspace margin, counted
    # all step, would otherwise flatten the step's own changes against the top
    lowest = min(
        (
            r.peak_bytes - max(r.device_bytes) + min(r.device_bytes)
            for r in results
            if r.device_bytes
        ),
        default=0,
    )
    low = max(0.0, min(lowest, budget_bytes) - 0.05 * top)
    lines = []
    for result, color, name in (
        (plain, "#c0392b", "without LMS"),
        (planned, "#2471a3", "with LMS"),
    ):
        if result is None:
            continue
        margin = result.peak_bytes - max(result.device_bytes, default=0)
        counted = [b + margin for b in result.device_bytes]
        lines.append(
            f'<polyline class="memory" data-name="{name}" data-peak="{result.peak_bytes}" '
            f'fill="none" stroke="{color}" stroke-width="1.5" vector-effect="non-scaling-stroke" '
            f'points="{_steps(result.timeline_s, counted, end_s, low, top)}"/>'
        )
    y = _y(budget_bytes, low, top)
    lines.append(
        f'<line class="budget" data-bytes="{budget_bytes}" x1="0" x2="{_WIDTH}" y1="{y:.2f}" '
        f'y2="{y:.2f}" stroke="black" stroke-dasharray="6 4" vector-effect="non-scaling-stroke"/>'
    )
    return (
        f'<svg class="zoom" id="memory" viewBox="0 0 {_WIDTH} {_HEIGHT}" '
        f'preserveAspectRatio="none" width="100%" height="{_HEIGHT}">{"".join(lines)}</svg>'
        f"<p>Device memory over {end_s * 1e3:.1f} ms of simulated step, tensors and the workspace "
        "margin (what the budget counts): red without LMS "
        f"(peak {format_bytes(plain.peak_bytes)}), "
        + (
            f"blue with the plan (peak {format_bytes(planned.peak_bytes)}), "
            if planned is not None
            else ""
        )
        + f"dashed the budget ({format_bytes(budget_bytes)}). The vertical axis runs from "
        f"{format_bytes(int(low))} to {format_bytes(int(top))}. Scroll to zoom, double-click to "
        "reset.</p>"
    )


def _copies_svg(trace: Trace, plan: Plan, spec: DeviceSpec, half: bool) -> str:
    write_log = bool(plan.recompute)
    clock = Clock(trace, plan, spec, op_seconds(trace, spec, half, write_log=write_log))
    end_s = clock.end_s or 1.0
    entries = clock.entries
    lanes = (("out", 10, "#e67e22"), ("in", 40, "#27ae60"))
    bars = clock.copy_spans()
    rects = []
    for direction, ordinal, start_s, end in bars:
        y, color = next((y, c) for name, y, c in lanes if name == direction)
        x = _WIDTH * start_s / end_s
        width = max(_WIDTH * (end - start_s) / end_s, 0.5)
        rects.append(
            f'<rect class="copy" data-direction="{direction}" data-ordinal="{ordinal}" '
            f'x="{x:.2f}" y="{y}" width="{width:.2f}" height="24" fill="{color}">'
            f"<title>{direction} #{ordinal}, {format_bytes(entries[ordinal][1])}, "
            f"{start_s * 1e3:.2f} to {end * 1e3:.2f} ms</title></rect>"
        )
    return (
        f'<svg class="zoom" id="copies" viewBox="0 0 {_WIDTH} 74" preserveAspectRatio="none" '
        f'width="100%" height="74">{"".join(rects)}</svg>'
        "<p>Copies over the step: out to host memory or disk (orange, top), back in (green, "
        "bottom).</p>"
    )


def _plan_table(trace: Trace, plan: Plan | None) -> str:
    offload = set(plan.offload) if plan else set()
    recompute = set(plan.recompute) if plan else set()
    spill = set(plan.spill) if plan else set()
    rows = []
    for ordinal, (storage, nbytes, save_op) in enumerate(trace.entries()):
        record = trace.storages[storage]
        made = trace.ops[record.alloc_op] if record.alloc_op >= 0 else None
        if ordinal in recompute:
            choice = "recompute"
        elif ordinal in offload:
            choice = "offload to disk" if ordinal in spill else "offload"
        else:
            choice = "keep"
        rows.append(
            f'<tr class="{choice.split()[0]}"><td>{ordinal}</td>'
            f"<td>{html.escape(made.name if made else 'before the step')}</td>"
            f"<td>{html.escape(made.module if made else '')}</td>"
            f'<td data-bytes="{nbytes}">{format_bytes(nbytes)}</td><td>{save_op}</td>'
            f"<td>{choice}</td></tr>"
        )
    return (
        '<table id="plan"><thead><tr><th>#</th><th>made by</th><th>module</th><th>size</th>'
        f"<th>saved at op</th><th>plan</th></tr></thead><tbody>{''.join(rows)}</tbody></table>"
    )


def write_html(
    path: str | os.PathLike[str],
    *,
    title: str,
    lines: Sequence[str],
    trace: Trace,
    spec: DeviceSpec,
    budget_bytes: int,
    plain: SimResult,
    plan: Plan | None,
    planned: SimResult | None,
    half: bool = False,
) -> None:
    """Write the report page (Note [A report that works offline])."""
    copies = _copies_svg(trace, plan, spec, half) if plan is not None and planned else ""
    body = (
        f"<h1>{html.escape(title)}</h1>"
        f'<pre id="lines">{html.escape(chr(10).join(lines))}</pre>'
        "<h2>Device memory</h2>"
        + _memory_svg(plain, planned, budget_bytes)
        + ("<h2>Copies</h2>" + copies if copies else "")
        + "<h2>Saved storages and the plan</h2>"
        + _plan_table(trace, plan if planned else None)
    )
    style = (
        "body{font-family:sans-serif;margin:1.5em;max-width:1100px}"
        "svg{border:1px solid #ccc;background:#fff}pre{background:#f6f6f6;padding:.6em;"
        "overflow-x:auto}table{border-collapse:collapse;font-size:90%}td,th{padding:2px 8px;"
        "border-bottom:1px solid #eee;text-align:left}tr.offload{background:#fdf2e9}"
        "tr.recompute{background:#eaf2f8}"
    )
    page = (
        f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><title>'
        f"{html.escape(title)}</title><style>{style}</style></head><body>{body}"
        f"<script>{_SCRIPT}</script></body></html>"
    )
    with open(path, "w", encoding="utf-8") as handle:
        handle.write(page)
