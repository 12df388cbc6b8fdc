"""`LMS.tune`'s one entry: trace the user's step, plan it for the local device, cache plans by
fingerprint."""

from __future__ import annotations

import dataclasses
import functools
import logging
import shutil
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch

from lms.analysis.simulate import library_kept_bytes, share_of_peak, simulate
from lms.analysis.trace import StepFn, trace_step
from lms.core.devices import FRESH_PAGES_BYTES, DeviceSpec
from lms.core.errors import HostMemoryError, PlanInfeasibleError, SpillError
from lms.core.plan import Plan
from lms.core.records import Trace
from lms.core.units import format_bytes
from lms.core.version import __version__
from lms.orchestration.cache import (
    cache_folder,
    cache_path,
    cached_slabs,
    load_cached,
    load_timings,
    planner_code,
    save_plan,
)
from lms.orchestration.local import local_device_spec, with_local_timings
from lms.orchestration.split import (
    CLIMB_SIMULATIONS,
    faster_in_slabs,
    fit_in_slabs,
    named_slabs,
)
from lms.orchestration.timing import started_early

__all__ = ["TunedStep", "check_offload_room", "tune_plan", "tune_step"]

log = logging.getLogger("lms.orchestration.tuning")


@dataclasses.dataclass(frozen=True)
class TunedStep:
    """A plan and what it was made from: the trace, the spec it was priced on (with the op
    times measured for it, kept beside a plan loaded from the cache), and whether at half
    precision, and the budget it was tuned under in bytes (a share, in the bytes the step's
    peak made it), which the plan's own can be under (`within_room`)."""

    plan: Plan
    trace: Trace
    spec: DeviceSpec
    half: bool
    budget: int


def tune_plan(model: torch.nn.Module, batch: Any, step_fn: StepFn | None, **settings: Any) -> Plan:
    """`tune_step`'s plan alone."""
    return tune_step(model, batch, step_fn, **settings).plan


# Long by design: `LMS.tune`'s one entry, in order: trace, check the cache, time the ops, plan,
# check the room offloading needs, cache; each step reads what the ones before it made.
def tune_step(
    model: torch.nn.Module,
    batch: Any,
    step_fn: StepFn | None,
    *,
    budget_bytes: int | None,
    min_offload_bytes: int,
    autocast: torch.dtype | None = None,
    cache_dir: str | None = None,
    planner: Callable[..., Plan] | None = None,
    tier: str = "auto",
    host_budget_bytes: int | None = None,
    spill_dir: str | None = None,
    free_held: bool = False,
    slabs: bool = True,
    cpu_resident: bool = True,
    budget_share: float | None = None,
) -> TunedStep:
    """Trace ``step_fn(model, batch)`` under fake tensors and plan it for the model's device.

    A plan for the same step, budget and device found in ``cache_dir`` (else ``$LMS_CACHE_DIR``,
    else ``~/.cache/lms/plans``) is used instead of tuned, if it still fits
    (`lms.orchestration.cache`).
    On a GPU, offloaded data beyond ``host_budget_bytes`` is planned into spill files (tier
    "auto"), or refused (tier "host"). ``free_held``: the plan may empty what the step's code
    holds (`lms.LMSConfig.free_held`). ``slabs``: where no plan of the whole step fits, the
    plan may run submodules in slabs (`lms.LMSConfig.slabs`). ``cpu_resident``: on a CPU,
    whether the runtime gives freed memory back as it runs (`lms.LMSConfig.cpu_resident`), which
    sets which storages fault their pages in afresh. ``budget_share``: the budget is that share
    of the traced step's simulated peak without offload (`lms.analysis.simulate.share_of_peak`),
    in place of ``budget_bytes``.

    Raises:
        PlanInfeasibleError: when no plan fits the device budget.
        HostMemoryError: tier "host", when the offloaded data cannot fit in the host budget.
        SpillError: when the spill files the plan needs do not fit on the spill disk.
    """
    from lms.planning import plan_auto

    param = next(model.parameters(), None)
    device = param.device if param is not None else torch.device("cpu")
    spec = priced_spec(device, cpu_resident=cpu_resident)
    # The timing process starts now, once this CPU is measured (it would take a core), to
    # import while the step is traced (Note [The timing process starts early]).
    with started_early():
        if device.type == "cuda" and tier == "auto":
            spec = spec.with_host_memory(host_budget_bytes)
        budget = spec.memory_bytes if budget_bytes is None else budget_bytes
        started = time.perf_counter()
        traced = functools.partial(
            trace_step,
            model,
            batch,
            step_fn,
            device=device,
            autocast=autocast,
            min_offload_bytes=min_offload_bytes,
            name=type(model).__name__,
        )
        trace = traced()
        half = autocast is not None
        if budget_share is not None:
            budget = share_of_peak(trace, spec, budget_share, half=half)
            free = format_bytes(spec.workspace_bytes)
            beside = f", and the {free} kept free for libraries" if spec.workspace_bytes else ""
            log.info(
                "[LMS] budget %.0f%% of the step's peak of tensors without offload (simulated)%s: "
                "%s",
                100 * budget_share,
                beside,
                format_bytes(budget),
            )
        choose: Any = planner or plan_auto
        if device.type == "cuda":  # the card, not its measured rates, which vary run to run
            card = torch.cuda.get_device_properties(device)
            where = f"{card.name}:{card.total_memory}:{spec.host_memory_bytes}"
        else:
            where = f"{spec.name}:{spec.page_mapped_bytes}"
        chooser = getattr(choose, "__qualname__", type(choose).__qualname__)
        setting = (where, __version__, planner_code(), half, chooser, *(["free_held"] * free_held))
        path = cache_path(cache_folder(cache_dir), trace, budget, setting)
        kept = cached_slabs(path) if slabs else ()
        if kept:  # the plan kept was made for the step in slabs: check it against that trace
            trace = traced(slabs=dict(kept))
        # Note [A cached plan keeps its op times]
        priced = spec.with_op_timings(load_timings(path, trace))
        loaded = load_cached(path, trace, priced, budget, half=half, free_held=free_held)
        if loaded is not None:
            plan = loaded
        else:
            trace = fit_in_slabs(
                traced,
                spec,
                budget,
                half=half,
                free_held=free_held,
                trace=trace,
                allowed=slabs,
                refuse=True,
            )
            if trace.compiled:
                # Note: [A compiled graph saves when it ends]
                # The trace runs compiled code eagerly, so the plan counts the tensors eager
                # autograd saves, each offloaded as the op that saves it ends. A graph compiled
                # by inductor saves tensors of its partitioner's choosing, all when the graph
                # ends: they are in memory together until then, whatever the plan. A step
                # follows its plan up to the first save that differs, then the budget's own
                # policy, which moves what each graph saved once it ends. So a model compiled
                # whole holds all of forward's saved tensors at once, and one compiled block by
                # block one block's. Measured: benchmarks/results/README.md, "Compiled models
                # under a budget". Nor does the plan recompute (Note [Compiled models are not
                # replayed]).
                log.warning(
                    "[LMS] The model or the step is compiled: the plan counts the tensors eager "
                    "autograd saves, and recomputes none (a replay would run them uncompiled); "
                    "a compiled graph saves tensors of its own choosing when it ends, all of "
                    "them in memory together until then, and a step that saves others than the "
                    "plan's follows the budget's own policy from there, which cannot move what "
                    "a graph holds while it runs. Compile the model's blocks one by one "
                    "(block.compile()) rather than the whole model, so that each graph holds "
                    "little at once"
                )
            options = {"free_held": True} if free_held else {}
            if trace.slabs:  # only where slabs were allowed
                # More slabs are tried at the spec's rates, and only the step chosen has its ops
                # timed: each trace's timing costs seconds to minutes. Its plan is made again at
                # those times, so the tries search within fewer simulations.
                capped = {"max_simulations": CLIMB_SIMULATIONS} if choose is plan_auto else {}

                def at_rates(step: Trace) -> Plan:
                    return choose(step, spec, budget, half=half, **options, **capped)

                first = at_rates(trace)
                trace, _, _ = faster_in_slabs(
                    traced,
                    trace,
                    (first, simulate(trace, first, spec, half=half)),
                    at_rates,
                    spec,
                    half=half,
                )
            rates, spec = spec, with_local_timings(spec, trace, device, budget)
            try:
                plan = within_room(choose, trace, spec, budget, half=half, **options)
            except PlanInfeasibleError as error:
                if budget_share is None:
                    raise
                raise _share_before_scratch(error, trace, rates, spec, half=half) from None
            # Note [The first step prefetches in the traced order]
            plan = dataclasses.replace(plan, use_order=trace.use_order, slabs=trace.slabs)
        # A cached plan too: the host budget and the spill disk's free space may differ now.
        check_offload_room(
            trace,
            plan,
            spec,
            half=half,
            host_budget_bytes=host_budget_bytes
            if device.type == "cuda" and tier == "host"
            else None,
            spill_dir=spill_dir,
            spills=tier != "host",
        )
        if plan.slabs:  # said each time, since the step's gradients are not the plain step's bits
            log.warning(
                "[LMS] The plan runs %s in slabs (Note [Slabs]): no plan of the whole step fits "
                "%s. Their gradients are within float rounding of the whole module's, not bit "
                "for bit; LMS(slabs=False) (lms --no-slabs) refuses such a budget instead",
                named_slabs(dict(plan.slabs)),
                format_bytes(budget),
            )
        if loaded is not None:
            log.info("[LMS] Loaded the plan for this step from %s", path)
            return TunedStep(plan, trace, priced, half, budget)
        save_plan(plan, path, spec.op_timings)
        mapped = spec.page_mapped_bytes
        log.info(
            "[LMS] Tuned in %.2f s: offload %d of %d saved storages, predicted peak %.2f GiB, "
            "overhead %+.1f%% over a no-offload step of %.4f s%s; saved to %s",
            time.perf_counter() - started,
            len(plan.offload),
            plan.num_entries,
            plan.predicted_peak_bytes / 1024**3,
            100 * plan.predicted_overhead,
            simulate(trace, None, spec, half=half).step_s,
            # Note [The resident set follows the heap under a budget]: a plain step runs faster
            f" with allocations of {format_bytes(mapped)} and more faulted in afresh, as under "
            "this budget (cpu_resident)"
            if device.type != "cuda" and mapped is not None and mapped < FRESH_PAGES_BYTES
            else "",
            path,
        )
        return TunedStep(plan, trace, spec, half, budget)


def check_offload_room(
    trace: Trace,
    plan: Plan,
    spec: DeviceSpec,
    *,
    half: bool = False,
    host_budget_bytes: int | None = None,
    spill_dir: str | None = None,
    spills: bool = True,
) -> None:
    """Refuse, before training, a plan whose offloaded data has nowhere to go.

    Args:
        host_budget_bytes: host memory the offloaded copies must fit in (tier "host"); None
            when they may overflow to disk.
        spill_dir: where spill files go (None: the system's temporary folder).
        spills: whether offloaded data may go to spill files at all (not with tier "host").

    Raises:
        HostMemoryError: the copies held in host memory exceed ``host_budget_bytes``.
        SpillError: the spill files exceed the free space of the spill disk.
    """
    result = simulate(trace, plan, spec, half=half)
    if host_budget_bytes is not None and result.host_peak_bytes > host_budget_bytes:
        raise HostMemoryError(
            f"lms: the plan holds up to {format_bytes(result.host_peak_bytes)} of offloaded data "
            f"in host memory, over the host budget of {format_bytes(host_budget_bytes)}; raise "
            "host_budget, use tier='auto' to spill the rest to disk, or raise the device budget"
        )
    on_disk = result.disk_peak_bytes if spec.name != "cpu" else result.host_peak_bytes
    if on_disk and spills:
        folder = spill_dir or tempfile.gettempdir()
        free = shutil.disk_usage(folder).free
        if on_disk > free:
            raise SpillError(
                f"lms: the plan writes up to {format_bytes(on_disk)} of spill files but {folder} "
                f"has {format_bytes(free)} free; point spill_dir at a larger disk, raise the "
                "host budget, or raise the device budget"
            )
    if result.disk_peak_bytes:
        log.info(
            "[LMS] Host memory holds up to %s of offloaded data; %d tensors (%s at most at "
            "once) go to spill files",
            format_bytes(result.host_peak_bytes),
            len(plan.spill),
            format_bytes(result.disk_peak_bytes),
        )


def within_room(
    choose: Callable[..., Plan], trace: Trace, spec: DeviceSpec, budget: int, **options: Any
) -> Plan:
    """``choose(trace, spec, room, **options)``: the plan of the step's own peak within the room
    ``budget`` leaves beside the buffers the libraries its ops call keep from their first run
    on (Note [Buffers a library keeps] in `lms.orchestration.timing`), which the process holds
    beside the step's tensors from its first step on. Where no plan fits that room but one fits
    ``budget``, that one, with a warning that the first step passes the budget by up to the
    buffers, naming the least budget that holds both.

    Raises:
        PlanInfeasibleError: no plan fits ``budget`` at all.
    """
    kept = library_kept_bytes(trace, spec)
    if not kept:
        return choose(trace, spec, budget, **options)
    try:
        plan = choose(trace, spec, budget - kept, **options)
    except PlanInfeasibleError as error:
        plan = choose(trace, spec, budget, **options)
        log.warning(
            "[LMS] The libraries the step calls keep %s of buffers from its first run on "
            "(measured where its ops were timed), and no plan leaves them room in the budget of "
            "%s: the plan holds the step's own peak to it, and the first step in a process passes "
            "it by up to those buffers. A budget of %s holds both",
            format_bytes(kept),
            format_bytes(budget),
            format_bytes(error.min_budget_bytes + kept),
        )
        return plan
    log.info(
        "[LMS] The libraries the step calls keep %s of buffers from its first run on (measured "
        "where its ops were timed); the plan leaves them room in the budget of %s",
        format_bytes(kept),
        format_bytes(budget),
    )
    return plan


def priced_spec(device: torch.device, *, cpu_resident: bool = False) -> DeviceSpec:
    """The spec a step tuned for ``device`` is priced on before its ops are timed: the device's
    own (`lms.orchestration.local.local_device_spec`), and on a CPU whose runtime keeps freed
    memory (``cpu_resident`` False), glibc's own threshold for fresh pages (Note [Fresh
    pages])."""
    spec = local_device_spec(device)
    if device.type != "cuda" and not cpu_resident:
        spec = dataclasses.replace(spec, page_mapped_bytes=FRESH_PAGES_BYTES)
    return spec


def _share_before_scratch(
    error: PlanInfeasibleError, trace: Trace, rates: DeviceSpec, timed: DeviceSpec, *, half: bool
) -> PlanInfeasibleError:
    """``error``, saying where the scratch its ops took when timed here raises the step's floor
    over the peak without offload that a budget share was taken of. The share is taken before
    the ops are timed, as the plan cache is kept by the budget's bytes; a CPU's half-precision
    matrix products widen their operands into megabytes of scratch, which can put the floor
    over the very peak the share was taken of."""
    before = simulate(trace, None, rates, half=half).peak_bytes
    after = simulate(trace, None, timed, half=half).peak_bytes
    if error.min_budget_bytes <= before:
        return error
    return PlanInfeasibleError(
        f"{error}. The share was taken of the step's peak without offload at the rates, "
        f"{format_bytes(before)}; the scratch its ops take, measured here, raises that peak to "
        f"{format_bytes(after)} and the floor over {format_bytes(before)}: give the budget in "
        f"bytes, at least {format_bytes(error.min_budget_bytes)}",
        op_name=error.op_name,
        op_module=error.op_module,
        op_bytes=error.op_bytes,
        min_budget_bytes=error.min_budget_bytes,
    )
