"""`lms.analyze`: trace a step with fake tensors, simulate it without and with LMS, report."""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from lms.analysis.simulate import SimResult, runtime_plan, share_of_peak, simulate
from lms.analysis.trace import StepFn, trace_step
from lms.core.config import AUTO_MIN_OFFLOAD_BYTES
from lms.core.devices import LINK_MARGIN, DeviceSpec, device_spec
from lms.core.errors import PlanInfeasibleError
from lms.core.plan import Plan
from lms.core.records import Trace
from lms.core.units import parse_bytes, parse_share
from lms.orchestration.split import faster_in_slabs, fit_in_slabs

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["analyze", "Report"]

log = logging.getLogger("lms.analysis")


@dataclasses.dataclass(frozen=True)
class Report:
    """The analysis of one step on one device: trace, plan and both simulations."""

    trace: Trace
    spec: DeviceSpec
    budget_bytes: int
    plain: SimResult
    plan: Plan | None
    planned: SimResult | None
    trace_seconds: float
    tune_seconds: float
    free_held: bool = False
    """Whether plans may empty what the step's code holds (`analyze`'s ``free_held``)."""
    slow_link: SimResult | None = None
    """The plan simulated with the link and the disk at `LINK_MARGIN` of their rates, where it
    moves data over them (Note [A plan's margin on the link])."""
    half: bool = False
    """Whether matmuls and convolutions were priced at the half-precision rate (autocast)."""

    @property
    def needed(self) -> bool:
        """Whether the step needs LMS to fit."""
        return self.plain.peak_bytes > self.budget_bytes

    @property
    def fits(self) -> bool:
        """Whether the step fits: as it is, or with the plan."""
        if not self.needed:
            return True
        return self.planned is not None and self.planned.peak_bytes <= self.budget_bytes

    def lines(self) -> list[str]:
        """The `[LMS]` information lines."""
        from lms.report.text import info_lines

        return info_lines(
            self.trace,
            self.spec,
            self.plain,
            self.plan,
            self.planned,
            budget_bytes=self.budget_bytes,
            free_held=self.free_held,
            slow_link=self.slow_link,
        )

    def log(self, logger: logging.Logger = log) -> None:
        """Log the information lines at INFO."""
        for line in self.lines():
            logger.info("%s", line)

    def plot(self, path: str | os.PathLike[str]) -> Figure:
        """Write the simulated memory graph (PNG); the figure too (`lms.report.plot`)."""
        from lms.report.plot import plot_memory

        return plot_memory(
            path,
            self.plain,
            self.planned if self.needed else None,
            budget_bytes=self.budget_bytes,
            title=f"{self.trace.name} on {self.spec.name}: simulated device memory",
        )

    def save_html(self, path: str | os.PathLike[str]) -> None:
        """Write one self-contained page (`lms.report.html`): the lines, device memory with and
        without the plan (zoomable), the copies and the plan's table of saved storages."""
        from lms.report.html import write_html

        write_html(
            path,
            title=f"{self.trace.name} on {self.spec.name}",
            lines=self.lines(),
            trace=self.trace,
            spec=self.spec,
            budget_bytes=self.budget_bytes,
            plain=self.plain,
            plan=self.plan,
            planned=self.planned if self.needed else None,
            half=self.half,
        )

    def save_snapshot(self, path: str | os.PathLike[str], *, with_lms: bool = True) -> None:
        """Write a memory_viz snapshot (pickle; JSON when the path ends in .json)."""
        from lms.report.memviz import save_snapshot

        result = self.planned if with_lms and self.planned is not None else self.plain
        save_snapshot(path, self.trace, result)

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready summary."""
        largest = self.trace.largest_op
        planned = self.planned if self.needed else None
        return {
            "model": self.trace.name,
            "input_shapes": [list(s) for s in self.trace.input_shapes],
            "device_spec": self.spec.name,
            "spec": self.spec.with_op_timings(None).to_dict(),  # Note [A device spec from a file]
            "gpu_memory_bytes": self.budget_bytes,
            "peak_bytes": self.plain.peak_bytes,
            "peak_tensor_bytes": self.plain.peak_tensor_bytes,
            "lms_needed": self.needed,
            "lms_peak_bytes": planned.peak_bytes if planned else self.plain.peak_bytes,
            "fits": self.fits,
            "num_ops": len(self.trace.ops),
            "num_edges": self.trace.num_edges,
            "num_levels": self.trace.num_levels,
            "movable_storages": len(self.trace.entries()),
            "param_bytes": self.trace.param_bytes,
            "largest_op": {
                "name": largest.name,
                "module": largest.module,
                "bytes": largest.working_set_bytes,
            },
            "trace_seconds": self.trace_seconds,
            "tune_seconds": self.tune_seconds,
            "offloaded_bytes": planned.offloaded_bytes if planned else 0,
            "offloaded_tensors": planned.offloaded_tensors if planned else 0,
            "host_peak_bytes": planned.host_peak_bytes if planned else 0,
            "disk_peak_bytes": planned.disk_peak_bytes if planned else 0,
            "host_memory_bytes": self.spec.host_memory_bytes,
            "predicted_step_s": (planned or self.plain).step_s,
            "predicted_overhead": planned.overhead if planned else 0.0,
            "predicted_overhead_slow_link": self.slow_link.overhead if self.slow_link else None,
            "plan": dataclasses.asdict(self.plan) if self.plan and planned else None,
        }


def analyze(
    model: torch.nn.Module | Callable[[], torch.nn.Module],
    batch: Any,
    step_fn: StepFn | None = None,
    *,
    gpu_memory: int | str | None = None,
    device_spec: DeviceSpec | str = "v100-32gb",
    host_memory: int | str | None = None,
    autocast: torch.dtype | None = None,
    optimizer: Callable[[Any], torch.optim.Optimizer] | None = None,
    planner: Callable[[Trace, DeviceSpec, int], Plan] | str | None = None,
    min_offload_bytes: int = AUTO_MIN_OFFLOAD_BYTES,
    name: str = "model",
    free_held: bool = False,
    slabs: bool = True,
) -> Report:
    """Trace one training step with fake tensors and predict its memory with and without LMS.

    Args:
        model: a module, or a function that builds one (built under fake tensors: no memory).
        batch: the input tensors (as `trace_step` takes them), or a function that makes them.
        step_fn: ``step_fn(model, batch)`` runs forward, loss and backward.
        gpu_memory: device memory the step may use (default: the spec's whole memory), or a
            share of the step's simulated peak without offload (``"60%"``), as `lms.LMS` takes
            its budget (`lms.analysis.simulate.share_of_peak`).
        device_spec: a `DeviceSpec` or its name (see `lms.core.devices.DEVICES`); "local"
            for this machine's device with its rates measured
            (`lms.orchestration.local.local_device_spec`).
        host_memory: host memory for offloaded data; beyond it the plan spills to disk (default:
            the spec's, unlimited for the named specs).
        autocast: trace under autocast to this dtype.
        optimizer: builds an optimizer whose ``step()`` ends the step.
        planner: ``planner(trace, spec, budget) -> Plan``; default: `lms.planning.plan_auto`.
            ``"runtime"`` simulates what `lms.LMS` does on its own, without a plan.
        min_offload_bytes: as in `lms.LMS`.
        name: the model's name in reports.
        free_held: plans may empty what the step's code holds, as `lms.LMS` with
            ``free_held=True`` does (Note [Emptying what the code holds]).
        slabs: where no plan of the whole step fits, plan it with submodules in slabs, as
            `lms.LMS` does (Note [Which submodules run in slabs]).

    Raises:
        ValueError: ``gpu_memory`` is not a size above 0 or a percent in (0, 100], before
            anything is traced.
    """
    spec = device_spec if isinstance(device_spec, DeviceSpec) else _spec(device_spec)
    if host_memory is not None:
        spec = spec.with_host_memory(host_memory)
    share = parse_share(gpu_memory, field="gpu_memory")  # then set from the traced step
    budget = (
        spec.memory_bytes
        if gpu_memory is None or share is not None
        else parse_bytes(gpu_memory, field="gpu_memory", positive=True)
    )
    started = time.perf_counter()
    half = autocast in (torch.float16, torch.bfloat16)
    traced = functools.partial(
        trace_step,
        model,
        batch,
        step_fn,
        autocast=autocast,
        optimizer=optimizer,
        min_offload_bytes=min_offload_bytes,
        name=name,
        card_kernels=not spec.cpu_scratch,  # a GPU's spec (Note [A card's attention and ...])
    )
    whole = traced()
    if share is not None:  # a share of the step's own peak without offload, as LMS takes one
        budget = share_of_peak(whole, spec, share, half=half)
    trace = fit_in_slabs(
        traced, spec, budget, half=half, free_held=free_held, trace=whole, allowed=slabs
    )
    trace_seconds = time.perf_counter() - started
    if device_spec == "local":
        from lms.orchestration.local import with_local_timings

        spec = with_local_timings(spec, trace, torch.device(trace.device), budget)
    return report_for(
        trace,
        spec,
        budget,
        planner=planner,
        half=half,
        trace_seconds=trace_seconds,
        free_held=free_held,
        trace_with=traced if slabs and device_spec != "local" else None,
    )


def report_for(
    trace: Trace,
    spec: DeviceSpec,
    budget: int,
    *,
    planner: Callable[[Trace, DeviceSpec, int], Plan] | str | None = None,
    half: bool = False,
    trace_seconds: float = 0.0,
    free_held: bool = False,
    trace_with: Callable[..., Trace] | None = None,
) -> Report:
    """Simulate a traced step without LMS and, when it does not fit, plan and simulate with it.
    With ``trace_with`` (``trace_with(slabs=...)`` traces the step again with submodules in
    slabs), a plan found is tried with submodules in slabs too, and the faster stands
    (`lms.orchestration.split.faster_in_slabs`).

    Logs the `[LMS]` lines and returns the `Report`; ``planner`` and ``free_held`` are as in
    `analyze`.
    """
    plain = simulate(trace, None, spec, half=half)
    # The analysis comes first, as in TFLMS v2; the planner's own lines follow it.
    head = Report(trace, spec, budget, plain, None, None, trace_seconds, 0.0, free_held).lines()
    for line in head:
        log.info("%s", line)
    plan = planned = None
    started = time.perf_counter()
    if plain.peak_bytes > budget:
        try:
            if planner == "runtime":
                plan = runtime_plan(trace, budget)
            elif callable(planner):
                plan = planner(trace, spec, budget)
            else:
                from lms.planning import plan_auto

                plan = plan_auto(trace, spec, budget, half=half, free_held=free_held)
        except PlanInfeasibleError as error:
            log.info("[LMS] %s", str(error).removeprefix("lms: "))
            from lms.planning.candidates import Candidates

            # everything a plan may move, as the smallest-memory plan moves it
            everything = range(len(trace.entries()))
            candidates = Candidates(trace, spec, budget, half=half, free_held=free_held)
            plan = candidates.plan(everything, ahead=1, sync_mode=3, source="infeasible")
        planned = simulate(trace, plan, spec, half=half)
        if trace_with is not None and plan.source != "infeasible" and planner is None:

            def replan(step: Trace) -> Plan:
                from lms.planning import plan_auto

                return plan_auto(step, spec, budget, half=half, free_held=free_held)

            trace, plan, planned = faster_in_slabs(
                trace_with, trace, (plan, planned), replan, spec, half=half
            )
            plain = simulate(trace, None, spec, half=half)
        # Note [The first step prefetches in the traced order]: a plan handed to `LMS(plan=...)`
        # from here prefetches its first step as the simulation did.
        plan = dataclasses.replace(
            plan,
            predicted_peak_bytes=planned.peak_bytes,
            predicted_overhead=planned.overhead,
            use_order=trace.use_order,
            slabs=trace.slabs,
        )
    tune_seconds = time.perf_counter() - started
    slow_link = None
    if planned is not None and (planned.offloaded_bytes or planned.relieved_bytes):
        slow_link = simulate(trace, plan, spec.with_link_scaled(LINK_MARGIN), half=half)
    report = Report(
        trace,
        spec,
        budget,
        plain,
        plan,
        planned,
        trace_seconds,
        tune_seconds,
        free_held,
        slow_link,
        half,
    )
    for line in report.lines()[len(head) :]:
        log.info("%s", line)
    return report


def _spec(name: str) -> DeviceSpec:
    if name != "local":
        return device_spec(name)
    from lms.orchestration.local import local_device_spec

    return local_device_spec(torch.device("cuda" if torch.cuda.is_available() else "cpu"))
