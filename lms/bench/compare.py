"""`lms bench`: the seed's sweep measured for real, LMS beside no offload and the peers.

Each (size, method) runs in its own process, so that one run's memory cannot hide another's. A
method reaches a size when its steps ran and its measured peak stayed within the budget (on a GPU
the budget is enforced with `torch.cuda.set_per_process_memory_fraction`; on the CPU it is checked
against the growth of resident memory).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from tqdm import tqdm

from lms._units import format_bytes, format_rate, parse_bytes

__all__ = ["bench", "plot_bench", "child_main"]

log = logging.getLogger("lms.bench")

_CHILD = "from lms.bench.compare import child_main; child_main()"


def child_main() -> None:
    """Run one measurement from a JSON argument; print its JSON result (or the failure)."""
    import torch

    from lms.train import train

    args = json.loads(sys.argv[1])
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
            method=args["method"],
            budget=budget,
            amp=args["amp"],
            progress=False,
        )
        print(json.dumps({"ok": True, **dataclasses.asdict(result)}))
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
    timeout_s: float = 900,
    time_limit_s: float | None = None,
    on_point: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """Measure every method at every size; stop a method after its first size that fails.

    Args:
        time_limit_s: start no run after this many seconds; the runs left out are listed in the
            result's ``not_run``.
        on_point: called with the summary so far after each run (to keep partial results).
    """
    from lms.zoo import zoo_model

    zoo_model(model).check_batch(batch_size)  # before any run starts
    limit = parse_bytes(budget, field="budget") if budget is not None else None
    points: list[dict[str, Any]] = []
    failed: set[str] = set()
    not_run: list[dict[str, Any]] = []
    started = time.perf_counter()
    runs = [(size, method) for size in sizes for method in methods]
    for size, method in tqdm(runs, desc=f"bench {model}", unit="run"):
        if method in failed:
            continue
        if time_limit_s is not None and time.perf_counter() - started > time_limit_s:
            not_run.append({"size": size, "method": method})
            continue
        arguments = {
            "model": model,
            "size": size,
            "batch_size": batch_size,
            "steps": steps,
            "method": method,
            "budget": limit,
            "amp": amp,
        }
        run: dict[str, Any]
        try:
            done = subprocess.run(
                [sys.executable, "-c", _CHILD, json.dumps(arguments)],
                capture_output=True,
                text=True,
                timeout=timeout_s,
            )
            lines = done.stdout.strip().splitlines()
            run = (
                json.loads(lines[-1])
                if lines
                else {
                    "ok": False,
                    "error": (done.stderr.strip().splitlines() or ["no output"])[-1],
                }
            )
        except subprocess.TimeoutExpired:
            run = {"ok": False, "error": f"timed out after {timeout_s:.0f} s"}
        within = run.get("ok") and (limit is None or run["peak_bytes"] <= limit)
        point = {"size": size, "method": method, "fits": bool(within), **run}
        points.append(point)
        if not within:
            failed.add(method)
        log.info(
            "[LMS] %s %d %s: %s",
            model,
            size,
            method,
            f"{run['step_s']:.3f} s/step, {format_rate(run['elements_per_s'], run['unit'])}, "
            f"peak {format_bytes(run['peak_bytes'])}" + ("" if within else " (over budget)")
            if run.get("ok")
            else run.get("error", "failed"),
        )
        if on_point is not None:
            on_point(summarize(model, points, limit, methods))
    if not_run:
        log.info("[LMS] %s: %d runs left out by the time limit", model, len(not_run))
    return {**summarize(model, points, limit, methods), "not_run": not_run}


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


def plot_bench(result: dict[str, Any], path: str | os.PathLike[str]) -> None:
    """PNG of the measured data rate against the edge size, one line per method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 5))
    unit = "pixels"
    for method in result["largest_size"]:
        fitting = [p for p in result["points"] if p["method"] == method and p["fits"]]
        if not fitting:
            continue
        unit = fitting[0]["unit"]
        ax.plot(
            [p["size"] for p in fitting],
            [p["elements_per_s"] / 1e6 for p in fitting],
            "o-",
            label=method,
        )
    ax.set_xlabel("image edge")
    ax.set_ylabel(f"measured data rate (mega{unit}/s)")
    ax.set_ylim(bottom=0)
    budget = result["budget_bytes"]
    ax.set_title(
        f"{result['model']}: measured, budget {format_bytes(budget) if budget else 'none'}"
    )
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
