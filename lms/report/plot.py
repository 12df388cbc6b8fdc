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

    fig = Figure(figsize=(12, 6.5))
    top, bottom = fig.subplots(2, 1, sharex=False, gridspec_kw={"height_ratios": [3, 1.4]})

    def counted(result: SimResult) -> tuple[list[float], list[float], list[float]]:
        """Times (ms), the bytes the budget counts (tensors and the workspace margin) and the
        tensors alone, in GiB: the curve tops out at the peak the legend gives."""
        margin = result.peak_bytes - max(result.device_bytes, default=0)
        ms = [t * 1e3 for t in result.timeline_s]
        tensors = [b / GiB for b in result.device_bytes]
        return ms, [t + margin / GiB for t in tensors], tensors

    for result, color, name in (
        (plain, "tab:red", "without LMS"),
        (planned, "tab:blue", "with LMS"),
    ):
        if result is None:
            continue
        ms, budgeted, tensors = counted(result)
        top.step(
            ms,
            budgeted,
            where="post",
            color=color,
            label=f"{name} (peak {result.peak_bytes / GiB:.2f} GiB)",
        )
        if budgeted != tensors:
            top.fill_between(ms, tensors, budgeted, step="post", color=color, alpha=0.15)
    if planned is not None:
        bottom.step(
            [t * 1e3 for t in planned.timeline_s],
            [b / GiB for b in planned.host_bytes],
            where="post",
            color="tab:green",
            label="offloaded data held on host / disk",
        )
    top.axhline(budget_bytes / GiB, color="black", linestyle="--", label="budget")
    top.set_ylabel("device memory (GiB)")
    top.set_title(title)
    top.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=9)
    if plain.peak_bytes > max(plain.device_bytes, default=0):
        top.text(
            1.01,
            0.02,
            "shaded: the workspace margin\n(kept free beside the tensors)",
            transform=top.transAxes,
            fontsize=8,
        )
    bottom.set_xlabel("simulated time in the step (ms)")
    bottom.set_ylabel("host (GiB)")
    if planned is not None:
        bottom.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return fig
