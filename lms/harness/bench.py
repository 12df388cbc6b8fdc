"""`lms bench`: the seed's sweep measured for real, LMS beside no offload and the peers.

Each (size, method) runs in its own process, so that one run's memory cannot hide another's. A
method reaches a size when its steps ran and its measured peak stayed within the budget (on a GPU
the budget is enforced with `torch.cuda.set_per_process_memory_fraction`; on the CPU it is checked
against the weights, buffers and batch a step starts with plus its growth of the C heap in use:
Note [The C heap in use, not the resident set, measures a CPU step]).

Note: [A bench runs every method on the same heap]
On a CPU every method is judged by the heap in use, and runs on glibc's own allocator setting,
LMS too (``cpu_resident=False``). With a budget, LMS alone would otherwise fix glibc's mmap
threshold so that the resident set holds the budget too (Note [The resident set follows the heap
under a budget]), and fault its large allocations in afresh every step: a cost that the peers,
held to the heap in use alone, never pay. Its steps would then be timed against theirs under
another allocator. Measurements: benchmarks/results/README.md, "The resident set under a CPU
budget".
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import os
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from tqdm import tqdm

from lms.core.units import check_counts, format_bytes, format_rate, parse_bytes, parse_share

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["bench", "plot_bench", "child_main", "BENCH_METHODS"]

log = logging.getLogger("lms.bench")

_CHILD = "from lms.harness.bench import child_main; child_main()"
BENCH_METHODS = (
    "none",
    "lms",
    "lms_free_held",
    "save_on_cpu",
    "checkpoint",
    "hf_checkpoint",
    "hf_offload",
    "compile_budget",
)
"""`lms train`'s methods, and "lms_free_held": LMS whose plans may empty what the step's code
holds (`lms.LMSConfig.free_held`)."""


def child_main() -> None:
    """Run one measurement from a JSON argument; print its JSON result (or the failure)."""
    import torch

    from lms.harness.train import train

    args = json.loads(sys.argv[1])
    method = args["method"]
    budget = args["budget"]
    if budget is not None and torch.cuda.is_available():
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, budget / total))
    try:
        result = train(
            args["model"],
            size=args["size"],
            batch_size=args["batch_size"],
            steps=args["steps"],
            method=method.removesuffix("_free_held"),
            budget=budget,
            amp=args["amp"],
            progress=False,
            free_held=method == "lms_free_held",
            cpu_resident=False,  # Note [A bench runs every method on the same heap]
        )
        print(json.dumps({"ok": True, **dataclasses.asdict(result), "method": method}))
    except (torch.OutOfMemoryError, MemoryError, RuntimeError) as error:
        print(json.dumps({"ok": False, "error": f"{type(error).__name__}: {error}"[:500]}))


def bench(
    model: str,
    *,
    sizes: Sequence[int],
    budget: int | str | None,
    methods: Sequence[str] = ("none", "lms", "save_on_cpu", "checkpoint"),
    batch_size: int = 1,
    steps: int = 3,
    amp: bool = False,
    repeats: int = 1,
    timeout_s: float = 900,
    time_limit_s: float | None = None,
    on_point: Callable[[dict[str, Any]], None] | None = None,
    progress: bool = True,
) -> dict[str, Any]:
    """Measure every method at every size; stop a method after its first size that fails.

    Args:
        repeats: runs of each method at each size, the methods' order rotated each round so
            that none always runs first; a point keeps the median step time (``step_s_runs``
            has them all) and fits only if every run did.
        time_limit_s: start no run after this many seconds; the runs left out are listed in the
            result's ``not_run``.
        on_point: called with the summary so far after each point (to keep partial results).
    """
    from lms.harness.train import hugging_face_checkpointing
    from lms.harness.zoo import on_meta, zoo_model

    entry = zoo_model(model)
    entry.check_batch(batch_size)  # before any run starts
    check_counts(steps=steps, repeats=repeats)
    unknown = [method for method in methods if method not in BENCH_METHODS]
    if unknown or not methods:
        raise ValueError(
            f"lms: methods={list(methods)} must name one or more of {', '.join(BENCH_METHODS)}"
        )
    if min(sizes, default=0) < 1:
        raise ValueError(f"lms: sizes={list(sizes)} must be one or more edges of at least 1")
    if parse_share(budget) is not None:  # one memory for every size, as a card has
        raise ValueError(
            f"lms: budget={budget!r} is a share of one step's peak, but a bench runs every size "
            "in the same memory: give it in bytes (e.g. '32GiB'); lms train takes a share"
        )
    limit = parse_bytes(budget, field="budget") if budget is not None else None
    hugging_face = [m for m in ("hf_checkpoint", "hf_offload") if m in methods]
    if hugging_face:  # refused before any run, as the run would refuse it
        probe = on_meta(entry.build)
        for method in hugging_face:
            hugging_face_checkpointing(probe, model, offload=method == "hf_offload")
    points: list[dict[str, Any]] = []
    failed: set[str] = set()
    not_run: list[dict[str, Any]] = []
    started = time.perf_counter()
    bar = tqdm(
        total=len(sizes) * len(methods) * repeats,
        desc=f"bench {model}",
        unit="run",
        disable=not progress,
    )
    for size in sizes:
        runs: dict[str, list[dict[str, Any]]] = {method: [] for method in methods}
        for round_ in range(repeats):
            turn = round_ % len(methods)
            for method in [*methods[turn:], *methods[:turn]]:
                done = runs[method]
                skip = method in failed or bool(done and not _fits(done[-1], limit))
                if not skip and time_limit_s is not None:
                    skip = time.perf_counter() - started > time_limit_s
                    if skip and {"size": size, "method": method} not in not_run:
                        not_run.append({"size": size, "method": method})
                if not skip:
                    bar.set_postfix(size=size, method=method)
                    arguments = {
                        "model": model,
                        "size": size,
                        "batch_size": batch_size,
                        "steps": steps,
                        "method": method,
                        "budget": limit,
                        "amp": amp,
                    }
                    done.append(_run(arguments, timeout_s))
                bar.update()
        for method in methods:
            if not runs[method]:
                continue
            point = _point(size, method, runs[method], limit)
            points.append(point)
            if not point["fits"]:
                failed.add(method)
            log.info("[LMS] %s %d %s: %s", model, size, method, _describe(point))
            if on_point is not None:
                on_point(summarize(model, points, limit, methods))
    bar.close()
    if not_run:
        log.info("[LMS] %s: %d runs left out by the time limit", model, len(not_run))
    return {**summarize(model, points, limit, methods), "not_run": not_run}


def _run(arguments: dict[str, Any], timeout_s: float) -> dict[str, Any]:
    """One measurement in a fresh process: its JSON result, or why it failed."""
    try:
        done = subprocess.run(
            [sys.executable, "-c", _CHILD, json.dumps(arguments)],
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
    except subprocess.TimeoutExpired:  # killed: its spill folder is left (the next run's too)
        _remove_stale_spills()
        return {"ok": False, "error": f"timed out after {timeout_s:.0f} s"}
    if done.returncode < 0:  # killed by a signal, the out-of-memory killer's say
        _remove_stale_spills()
    lines = done.stdout.strip().splitlines()
    if lines:
        result: dict[str, Any] = json.loads(lines[-1])
        return result
    return {"ok": False, "error": (done.stderr.strip().splitlines() or ["no output"])[-1]}


def _remove_stale_spills() -> None:
    """Remove the spill folder of a run that was killed (its runtime spills to the default spill
    directory): Note [Spill folders of processes that were killed]."""
    import tempfile

    from lms.runtime.disk import remove_stale_folders

    remove_stale_folders(tempfile.gettempdir())


def _describe(point: dict[str, Any]) -> str:
    if not point.get("ok"):
        return str(point.get("error", "failed"))
    rate = format_rate(point["elements_per_s"], point["unit"])
    over = "" if point["fits"] else " (over budget)"
    text = f"{point['step_s']:.3f} s/step, {rate}, peak {format_bytes(point['peak_bytes'])}{over}"
    plan = point.get("plan") or {}
    if "base_step_s" in plan:  # what the plan was priced against, and what it predicted
        text += (
            f"; predicted {plan['predicted_step_s']:.3f} s against a no-offload step of "
            f"{plan['base_step_s']:.3f} s"
        )
    return text


def _fits(run: dict[str, Any], limit: int | None) -> bool:
    return bool(run.get("ok")) and (limit is None or run["peak_bytes"] <= limit)


def _point(size: int, method: str, runs: list[dict[str, Any]], limit: int | None) -> dict[str, Any]:
    """One method at one size over its runs: the median run's figures, the highest peak."""
    if not all(_fits(run, limit) for run in runs):
        failing = next(run for run in runs if not _fits(run, limit))
        return {"size": size, "method": method, "fits": False, **failing}
    ordered = sorted(runs, key=lambda run: run["step_s"])
    median = ordered[(len(ordered) - 1) // 2]
    return {
        "size": size,
        "method": method,
        "fits": True,
        **median,
        "peak_bytes": max(run["peak_bytes"] for run in runs),
        "step_s_runs": [run["step_s"] for run in runs],
    }


def summarize(
    model: str, points: list[dict[str, Any]], limit: int | None, methods: Sequence[str]
) -> dict[str, Any]:
    """Largest size each method reaches, and slowdowns against no offload where both fit."""
    largest = {
        m: max((p["size"] for p in points if p["method"] == m and p["fits"]), default=None)
        for m in methods
    }
    plain = {p["size"]: p["step_s"] for p in points if p["method"] == "none" and p["fits"]}
    slowdown: dict[str, dict[str, float]] = {}
    for method in methods:
        if method == "none":
            continue
        slowdown[method] = {
            str(p["size"]): p["step_s"] / plain[p["size"]] - 1
            for p in points
            if p["method"] == method and p["fits"] and p["size"] in plain
        }
    return {
        "model": model,
        "budget_bytes": limit,
        "largest_size": largest,
        "slowdown_vs_none": slowdown,
        "points": points,
    }


def plot_bench(result: dict[str, Any], path: str | os.PathLike[str]) -> Figure:
    """PNG of the measured data rate against the edge size, one line per method."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(9, 5))
    ax = fig.subplots()
    unit = "pixels"
    markers = itertools.cycle("os^Dv")  # a shape a method: equal rates stay visible
    for method, marker in zip(result["largest_size"], markers, strict=False):
        fitting = [p for p in result["points"] if p["method"] == method and p["fits"]]
        if not fitting:
            continue
        unit = fitting[0]["unit"]
        ax.plot(
            [p["size"] for p in fitting],
            [p["elements_per_s"] / 1e6 for p in fitting],
            f"{marker}-",
            label=method,
            fillstyle="none",
            markersize=8,
        )
    ax.set_xlabel("image edge")
    ax.set_ylabel(f"measured data rate (mega{unit}/s)")
    ax.set_ylim(0, ax.get_ylim()[1] * 1.05)  # room above the highest marker
    budget = result["budget_bytes"]
    ax.set_title(
        f"{result['model']}: measured, budget {format_bytes(budget) if budget else 'none'}"
    )
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return fig
