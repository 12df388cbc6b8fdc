"""The seed's protocol, simulated: grow the image edge until the step no longer fits, first without
LMS, then with it; predicted data rate (pixels/s or voxels/s) at every size."""

from __future__ import annotations

import functools
import logging
import os
import time
from typing import TYPE_CHECKING, Any

import torch
from tqdm import tqdm

from lms.analysis import device_spec as lookup_spec
from lms.analysis import simulate, trace_step
from lms.core.errors import PlanInfeasibleError, StepFailedError
from lms.core.units import check_counts, format_bytes, parse_bytes
from lms.harness.zoo import BatchRejectedError, zoo_model
from lms.orchestration.split import faster_in_slabs, fit_in_slabs
from lms.planning import plan_auto

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["sweep", "plot_sweep"]

log = logging.getLogger("lms.harness.sweep")

_FIND_START_TRIES = 64
"""Sizes a sweep without a start passes over, at most, before it gives up on the model."""


# Long by design: the seed's protocol as one loop, each size traced, simulated and planned, the
# point written as it is measured.
def sweep(
    model: str,
    *,
    gpu_memory: int | str,
    step: int,
    batch_size: int = 1,
    start: int | None = None,
    device_spec: str = "v100-32gb",
    amp: bool = False,
    max_size: int | None = None,
    progress: bool = True,
    free_held: bool = False,
    slabs: bool = True,
) -> dict[str, Any]:
    """Sweep edge sizes ``start, start+step, ...`` until even LMS cannot fit the step; with
    ``free_held``, plans may empty what the step's code holds (`lms.LMSConfig.free_held`); with
    ``slabs``, where no plan of the whole step fits, submodules may run in slabs
    (`lms.LMSConfig.slabs`), and the overhead is over the step run whole.
    Without ``start``, the sweep starts at ``step`` and passes over the sizes the model itself
    rejects (a U-Net below its smallest input), up to the first it takes, saying so in one line.

    Returns a JSON-ready dict with ``max_size_without_lms``, ``max_size_with_lms`` and ``points``;
    a size the model rejects after one it took ends the sweep, named in ``rejected``.

    Raises:
        ValueError: a step or start below 1, no memory, or a batch the model cannot train on.
        StepFailedError, BatchRejectedError: the model rejects the given ``start``, or every
            size up to ``max_size`` (or `_FIND_START_TRIES` sizes) when it starts on its own.
    """
    entry = zoo_model(model)
    entry.check_batch(batch_size)
    check_counts(step=step, start=step if start is None else start)
    budget = parse_bytes(gpu_memory, field="gpu_memory", positive=True)
    spec = lookup_spec(device_spec, memory=budget)
    half = amp
    size = start or step
    points: list[dict[str, Any]] = []
    max_plain = max_lms = None
    bar = tqdm(desc=f"sweep {model}", unit="size", disable=not progress)
    rejected: list[int] = []
    stopped: dict[str, Any] | None = None
    while max_size is None or size <= max_size:
        started = time.perf_counter()
        traced = functools.partial(
            trace_step,
            entry.build,
            _batch_of(entry, size, batch_size),
            entry.step_fn,
            device="cpu",
            autocast=torch.bfloat16 if amp else None,
            name=model,
            card_kernels=not spec.cpu_scratch,
        )
        try:
            trace = traced()
        except (StepFailedError, BatchRejectedError) as error:
            # Note: [A sweep finds its own start]
            # Below some size a model cannot run its step (a U-Net pools its input down to one
            # voxel, and its norms need more). Without a given start, those sizes are passed
            # over up to the first the model takes; a start the user gave is an error of its
            # own. Above some size a model may refuse again (a ViT built for 224 px, a window
            # that no longer tiles the input): the sweep ends there with what it found, the
            # size and the model's reason in its result (``rejected``), and its limits are
            # then the model's, not the memory's.
            if points:
                stopped = {"size": size, "error": _first_line(error)}
                log.warning(
                    "[LMS] %s rejects size %d (%s); the sweep ends at %d",
                    model,
                    size,
                    stopped["error"],
                    points[-1]["size"],
                )
                break
            if start is not None or len(rejected) >= _FIND_START_TRIES:
                raise
            rejected.append(size)
            if len(rejected) == 1:
                first_error = str(error).removeprefix("lms: ")
            size += step
            continue
        if rejected and not points:
            log.info(
                "[LMS] %s rejects sizes %s (%s); the sweep starts at %d",
                model,
                _span(rejected),
                _first_line(first_error),
                size,
            )
        plain = simulate(trace, None, spec, half=half)
        elements = batch_size * entry.elements(size)
        point: dict[str, Any] = {
            "size": size,
            "elements": elements,
            "peak_bytes": plain.peak_bytes,
            "largest_op_bytes": trace.largest_op.working_set_bytes,
            "fits_without_lms": plain.peak_bytes <= budget,
            "rate_without_lms": elements / plain.step_s,
        }
        if point["fits_without_lms"]:
            max_plain = size
            point.update(
                fits_with_lms=True,
                lms_peak_bytes=plain.peak_bytes,
                predicted_overhead=0.0,
                rate_with_lms=elements / plain.step_s,
                offloaded_bytes=0,
            )
        else:
            whole_step_s = plain.step_s
            trace = fit_in_slabs(
                traced, spec, budget, half=half, free_held=free_held, trace=trace, allowed=slabs
            )
            try:
                plan = plan_auto(trace, spec, budget, half=half, free_held=free_held)
            except PlanInfeasibleError as error:
                point.update(fits_with_lms=False, min_budget_bytes=error.min_budget_bytes)
                points.append(point)
                bar.update(1)
                log.info("[LMS] %s at %d: %s", model, size, str(error).removeprefix("lms: "))
                break
            planned = simulate(trace, plan, spec, half=half)
            trace, plan, planned = faster_in_slabs(
                traced,
                trace,
                (plan, planned),
                functools.partial(_plan, spec=spec, budget=budget, half=half, free_held=free_held),
                spec,
                half=half,
                allowed=slabs,
            )
            if trace.slabs:
                point["slabs"] = dict(trace.slabs)
            point.update(
                fits_with_lms=True,
                lms_peak_bytes=planned.peak_bytes,
                # over the step run whole: what running in slabs costs is part of the overhead
                predicted_overhead=planned.step_s / whole_step_s - 1,
                rate_with_lms=elements / planned.step_s,
                offloaded_bytes=planned.offloaded_bytes,
            )
            max_lms = size
        point["seconds"] = time.perf_counter() - started
        points.append(point)
        bar.update(1)
        bar.set_postfix(size=size, peak=format_bytes(plain.peak_bytes))
        size += step
    bar.close()
    if max_lms is None:
        max_lms = max_plain
    ratio = entry.elements(max_lms) / entry.elements(max_plain) if max_plain and max_lms else None
    result = {
        "model": model,
        "unit": entry.unit,
        "device_spec": spec.to_dict(),
        "gpu_memory_bytes": budget,
        "batch_size": batch_size,
        "step": step,
        "amp": amp,
        "free_held": free_held,
        "max_size_without_lms": max_plain,
        "max_size_with_lms": max_lms,
        "elements_ratio": ratio,
        "rejected": stopped,
        "points": points,
    }
    log.info(
        "[LMS] %s on %s: largest size without LMS %s, with LMS %s (%s the %s)%s",
        model,
        format_bytes(budget),
        max_plain,
        max_lms,
        f"{ratio:.1f}x" if ratio else "n/a",
        entry.unit,
        f"; the model rejects {stopped['size']}, so these are its limits" if stopped else "",
    )
    return result


def _plan(trace: Any, *, spec: Any, budget: int, half: bool, free_held: bool) -> Any:
    return plan_auto(trace, spec, budget, half=half, free_held=free_held)


def _first_line(error: BaseException | str) -> str:
    """The model's error in one line, without where it was raised."""
    return str(error).removeprefix("lms: ").split("\n")[0].split(" (at ")[0][:200]


def _span(sizes: list[int]) -> str:
    return str(sizes[0]) if len(sizes) == 1 else f"{sizes[0]} to {sizes[-1]}"


def _batch_of(entry: Any, size: int, batch_size: int) -> Any:
    return lambda: entry.make_batch(size, batch_size)


def plot_sweep(result: dict[str, Any], path: str | os.PathLike[str]) -> Figure:
    """PNG of the predicted data rate against the edge size, without and with LMS."""
    from matplotlib.figure import Figure

    unit = result["unit"]
    scale, label = (1e6, f"mega{unit}/s") if unit != "tokens" else (1e3, "ktokens/s")
    points = result["points"]
    plain = [(p["size"], p["rate_without_lms"] / scale) for p in points if p["fits_without_lms"]]
    with_lms = [
        (p["size"], p["rate_with_lms"] / scale)
        for p in points
        if p.get("fits_with_lms") and not p["fits_without_lms"]
    ]
    fig = Figure(figsize=(9, 5))
    ax = fig.subplots()
    if plain:
        ax.plot(*zip(*plain, strict=True), "o-", label="without LMS", color="tab:red")
    if with_lms:
        ax.plot(*zip(*with_lms, strict=True), "s-", label="with LMS", color="tab:blue")
    edge = {"voxels": "volume edge (voxels)", "tokens": "sequence length (tokens)"}
    ax.set_xlabel(edge.get(unit, "image edge (pixels)"))
    ax.set_ylabel(f"predicted data rate ({label})")
    ax.set_ylim(bottom=0)
    spec = result["device_spec"]
    ax.set_title(
        f"{result['model']}, batch {result['batch_size']}, {spec['name']} limited to "
        f"{result['gpu_memory_bytes'] / 2**30:.0f} GiB ({spec['link']})"
        + (", free_held" if result.get("free_held") else "")
    )
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return fig
