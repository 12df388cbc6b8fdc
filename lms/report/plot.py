"""Simulated memory graphs: device memory over the step with and without LMS, and host memory."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from lms.analysis.simulate import SimResult

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["plot_memory"]

GiB = 1024**3


def plot_memory(
    path: str | os.PathLike[str],
    plain: SimResult,
    planned: SimResult | None,
    *,
    budget_bytes: int,
    title: str,
) -> Figure:
    """Write a PNG: device memory against the budget (top), offloaded bytes on host (bottom);
    the figure too. Drawn on a figure of its own, with no pyplot state and no backend set."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 6.5))
    top, bottom = fig.subplots(2, 1, sharex=False, gridspec_kw={"height_ratios": [3, 1.4]})

    def draw(axes, result: SimResult, values: tuple[int, ...], **style) -> None:  # type: ignore[no-untyped-def]
        ms = [t * 1e3 for t in result.timeline_s]
        axes.step(ms, [b / GiB for b in values], where="post", **style)

    draw(
        top,
        plain,
        plain.device_bytes,
        color="tab:red",
        label=f"without LMS (peak {plain.peak_bytes / GiB:.1f} GiB)",
    )
    if planned is not None:
        draw(
            top,
            planned,
            planned.device_bytes,
            color="tab:blue",
            label=f"with LMS (peak {planned.peak_bytes / GiB:.1f} GiB)",
        )
        draw(
            bottom,
            planned,
            planned.host_bytes,
            color="tab:green",
            label="offloaded data held on host / disk",
        )
    top.axhline(budget_bytes / GiB, color="black", linestyle="--", label="budget")
    top.set_ylabel("device memory (GiB, tensors)")
    top.set_title(title)
    top.legend(loc="upper right")
    bottom.set_xlabel("simulated time in the step (ms)")
    bottom.set_ylabel("host (GiB)")
    if planned is not None:
        bottom.legend(loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return fig
