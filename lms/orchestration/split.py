"""Choose which submodules run in slabs, and in how many, where no plan of the whole step fits
its budget (Note [Slabs])."""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection

from lms.analysis.simulate import SimResult, simulate
from lms.core.devices import DeviceSpec
from lms.core.errors import PlanInfeasibleError, StepFailedError
from lms.core.plan import Plan
from lms.core.records import Trace
from lms.core.slabs import SplitError
from lms.core.units import format_bytes
from lms.planning.candidates import Candidates
from lms.planning.minimum import smallest_plan

__all__ = [
    "CLIMB_SIMULATIONS",
    "LEAST_OPS_STOPPED",
    "SLAB_COUNTS",
    "faster_in_slabs",
    "fit_in_slabs",
    "named_slabs",
]

log = logging.getLogger("lms.orchestration.split")

SLAB_COUNTS = (4, 8, 16, 32)
"""The counts tried for a submodule, fewest first: each slab is one more pass of its kernels'
launches and one more halo to read again."""

_ROUNDS = 12
"""Traces tried at most: each names the submodule at the new floor's peak, or more slabs."""

LEAST_OPS_STOPPED = 10_000
"""A trace in slabs is stopped past no fewer ops than this, whatever the whole step's count:
tracing an op in slabs took about a millisecond (MONAI's 3D DenseNet-121, 54,792 ops in 52 s),
so a try costs seconds at most below it (Note [Which submodules run in slabs])."""

_REACH = 0.5
"""Slabs are searched only for a budget of at least this share of the whole step's floor (both
without the workspace kept free for libraries, which slabs do not lower): in
the sweeps they lowered it by 28% at the most (the 3D U-Net at 416^3 with free_held, from 44.5
GiB to under 32), and each try is a trace."""


def fit_in_slabs(
    trace_with: Callable[..., Trace],
    spec: DeviceSpec,
    budget: int,
    *,
    half: bool = False,
    free_held: bool = False,
    trace: Trace | None = None,
    allowed: bool = True,
    refuse: bool = False,
) -> Trace:
    """The step's trace to plan: as it is where some plan fits ``budget``, else traced again
    with submodules in slabs until one does.

    Note: [Which submodules run in slabs]
    The least memory a plan of the step needs (every saved tensor out, copies waited for) peaks
    at one op. Where that floor is over the budget, the outermost submodule that op runs in
    (skipping containers that are never called, such as a ``ModuleList``) is run in slabs, if
    it has a convolution over a spatial input; then the step is traced again
    and its floor found again. A submodule named twice gets the next count of `SLAB_COUNTS`.
    Where its slabs stop the trace (past the ops allowed, below, or at an op that will not
    split) or at their most do not fit, the next submodule on the path inside it that
    convolves is tried in its place (slabs do not nest): MONAI's `UNet` and `AttentionUnet`
    hold their whole network in one ``model``, and the block where they peak fits alone.
    It stops at the first trace whose floor fits, so each submodule has the fewest slabs that
    fit (a few slabs may need more than the whole module: each slab's gradient is made apart
    before they are joined; in a 3D U-Net's decoder block, 4 and 8 slabs raised the floor and
    16 fit). It searches only budgets of at least `_REACH` of the whole step's floor, and of at
    least what no slab lowers: the workspace, and the weights, batch and gradients the step
    ends with. Where none fits, the step is planned whole, and the planner's own error says
    why.

    A step whose largest count of slabs is N runs each op of a submodule in slabs about N
    times, with a convolution's halo and a normalization's statistics taken slab by slab
    beside. A trace past 2N times the whole step's ops, and past `LEAST_OPS_STOPPED`, is
    stopped, and the step planned whole: a submodule whose slabs read what came before again
    and again (the concatenated features of a DenseNet, each piece of them made again for each
    read) costs more to trace than its slabs could lower its floor. A small step whose
    submodule in slabs is most of it runs as many ops per op in slabs as a DenseNet does, but
    traces in seconds: that is what the least count is for (MONAI's SegResNet at 128^3, 208 ops
    whole, ran 2404 ops in 1.5 s with one encoder level in 4 slabs). Measured:
    benchmarks/results/README.md, "Traces in slabs".

    Args:
        trace_with: ``trace_with(slabs=...)`` traces the step with the given submodules in
            slabs (as `trace_step` takes them).
        trace: the step traced whole, where the caller has it.
        allowed: False: the step as it is, whatever its floor (`lms.LMSConfig.slabs`).
        refuse: where no trace fits, raise the whole step's error rather than return it. The
            floor is the memory of every saved tensor out, copies waited for, which no op's
            time moves: a budget below it is refused before any op is timed.

    Raises:
        PlanInfeasibleError: with ``refuse``, where no plan fits, even in slabs.
    """
    whole = trace if trace is not None else trace_with(slabs={})
    first = _floor_error(whole, spec, budget, half=half, free_held=free_held)
    # no slab lowers the workspace kept free for libraries, the batch, the weights, nor the
    # gradients the step ends with
    fixed = spec.workspace_bytes + whole.input_bytes + whole.weights_and_grads_bytes
    hopeless = budget < fixed or (
        first is not None
        and budget - spec.workspace_bytes < _REACH * (first.min_budget_bytes - spec.workspace_bytes)
    )
    current, slabs, error = whole, dict[str, int](), first
    refused: set[str] = set()  # whose slabs stopped the trace, or whose most slabs did not fit
    tried: dict[tuple[tuple[str, int], ...], tuple[Trace, PlanInfeasibleError | None]] = {
        (): (whole, first)  # each trace in slabs and why no plan fits it, by its slabs
    }

    def back_from(unit: str) -> tuple[dict[str, int], Trace, PlanInfeasibleError | None]:
        """Slabs as they were before ``unit`` ran in slabs, their trace and its floor's error,
        where that trace was taken; as they are otherwise."""
        kept = {name: count for name, count in slabs.items() if not _nested(name, unit)}
        found = tried.get(tuple(sorted(kept.items())))
        return (kept, *found) if found is not None else (slabs, current, error)

    for _ in range(_ROUNDS if allowed and not hopeless else 0):
        if error is None:
            if slabs:
                log.info(
                    "[LMS] Runs %s in slabs along the first spatial dimension (Note [Slabs]): "
                    "the least a plan needs falls from %s to within the budget of %s; without "
                    "offload, a step in slabs is predicted at %.4f s against %.4f s whole",
                    named_slabs(slabs),
                    format_bytes(first.min_budget_bytes if first else budget),
                    format_bytes(budget),
                    simulate(current, None, spec, half=half).step_s,
                    simulate(whole, None, spec, half=half).step_s,
                )
            return current
        unit = _unit(current, error.op_module, refused)
        if unit is None:
            break
        # slabs do not nest: a submodule replaces the module it lies in
        trial = {name: count for name, count in slabs.items() if not _nested(name, unit)}
        count = slabs.get(unit)
        if count is None:
            trial[unit] = SLAB_COUNTS[0]
        elif count < SLAB_COUNTS[-1]:
            trial[unit] = next(more for more in SLAB_COUNTS if more > count)
        else:
            refused.add(unit)
            slabs, current, error = back_from(unit)
            continue
        try:
            traced = trace_with(slabs=dict(trial), max_ops=_most_ops(whole, trial))
        except (SplitError, StepFailedError) as stopped:  # the module would not run in slabs
            log.info(
                "[LMS] With %s in slabs the step stopped (%s): the submodules of %s are tried",
                named_slabs(trial),
                str(stopped).removeprefix("lms: ").split("\n")[0],
                unit,
            )
            refused.add(unit)
            slabs, current, error = back_from(unit)
            continue
        slabs, current = trial, traced
        error = _floor_error(current, spec, budget, half=half, free_held=free_held)
        tried[tuple(sorted(slabs.items()))] = (current, error)
    if slabs and error is not None:
        log.info(
            "[LMS] In slabs (%s) the least a plan needs is still %s, at %s, over the budget of "
            "%s: the step is planned whole",
            named_slabs(slabs),
            format_bytes(error.min_budget_bytes),
            error.op_module or "an op outside any module",
            format_bytes(budget),
        )
    if first is not None and refuse:
        raise first
    return whole


def _most_ops(whole: Trace, slabs: dict[str, int]) -> int:
    """The most ops a trace of the step with ``slabs`` may run (Note [Which submodules run in
    slabs])."""
    return max(2 * max(slabs.values()) * len(whole.ops), LEAST_OPS_STOPPED)


def named_slabs(slabs: dict[str, int]) -> str:
    """``slabs`` as the `[LMS]` lines name them: ``"conv_0 in 4, upcat_1 in 16"``."""
    return ", ".join(f"{name} in {count}" for name, count in sorted(slabs.items()))


def _floor_error(
    trace: Trace, spec: DeviceSpec, budget: int, *, half: bool, free_held: bool
) -> PlanInfeasibleError | None:
    """Why no plan of ``trace`` fits ``budget``; None where one does."""
    candidates = Candidates(trace, spec, budget, half, free_held=free_held, gaps=free_held)
    if candidates.fits(candidates.run(None)):
        return None
    try:
        smallest_plan(candidates)
    except PlanInfeasibleError as error:
        return error
    return None


def _unit(trace: Trace, module: str, refused: Collection[str] = ()) -> str | None:
    """The outermost submodule on ``module``'s path (a trace's dotted module path, the model's
    class first) that forward called, that is not ``refused`` and that runs a convolution over a
    spatial input, by its name in the model; else None. A ``ModuleList`` on the path is never
    called: the module it holds stands for it."""
    parts = module.split(".")
    for depth in range(2, len(parts) + 1):
        prefix = ".".join(parts[:depth])
        if trace.modules and prefix not in trace.modules:
            continue
        name = ".".join(parts[1:depth])
        if name in refused:
            continue
        convolves = any(
            op.name.startswith("aten.convolution")
            and (op.module == prefix or op.module.startswith(prefix + "."))
            for op in trace.ops
        )
        return name if convolves else None
    return None


def _nested(one: str, other: str) -> bool:
    """Whether submodule ``one`` is ``other``, lies in it, or holds it."""
    return one == other or one.startswith(other + ".") or other.startswith(one + ".")


def faster_in_slabs(
    trace_with: Callable[..., Trace],
    trace: Trace,
    planned: tuple[Plan, SimResult],
    planner: Callable[[Trace], Plan],
    spec: DeviceSpec,
    *,
    half: bool = False,
    allowed: bool = True,
) -> tuple[Trace, Plan, SimResult]:
    """The step, its plan and their simulation, with submodules in more slabs where that is
    predicted faster; a step that runs none in slabs stays whole.

    Note: [Slabs that make a step faster]
    The fewest slabs that fit leave a plan at its floor, moving or recomputing nearly
    everything it saves; more slabs lower the floor and give the plan room. Once a step runs in
    slabs, and so is no longer bitwise the whole module's, the plan found is tried with each
    submodule in twice as many slabs, and with the submodule where that plan peaks in slabs too,
    the step traced and planned again;
    the faster of the two stands, by more than `_FASTER` of its step, and the climb goes on
    from it, `_CLIMBS` times at most; plans within `_WORTH_A_TRY` of their step are left as
    they are. The simulator judges each by its whole step time, slabs' own cost (halos read
    twice, more kernels) included; a step whose time without offload is already no faster is
    not planned. A step that fits whole is never split for speed: its plan keeps the gradients
    bitwise. Each try is a trace and a plan of a step with more ops: `lms.LMS.tune`, which plans
    the step chosen again at its own ops' times, searches each try within
    `CLIMB_SIMULATIONS`.

    Args:
        planned: the plan for ``trace`` and its simulation.
        planner: ``planner(trace)`` plans a trace for the budget (raises
            `PlanInfeasibleError` where none fits).
        allowed: False: ``trace`` and ``planned`` as they are (`lms.LMSConfig.slabs`).
    """
    best = (trace, *planned)
    if not allowed or not trace.slabs or planned[1].overhead < _WORTH_A_TRY:
        return best
    for _ in range(_CLIMBS):
        current, _, result = best
        # every step tried here runs in slabs: each submodule gets twice as many
        slabs = {name: min(2 * count, SLAB_COUNTS[-1]) for name, count in current.slabs}
        peak = current.ops[result.peak_op].module if current.ops else ""
        unit = _unit(current, peak)
        if unit is not None and unit not in slabs:
            slabs[unit] = SLAB_COUNTS[0]
        if slabs == dict(current.slabs):
            break
        # twice the slabs, and one more submodule in the fewest: about 2 x 4 times the ops at
        # the most, and twice that is stopped (Note [Which submodules run in slabs])
        try:
            tried = trace_with(slabs=slabs, max_ops=2 * 2 * SLAB_COUNTS[0] * len(current.ops))
            # no plan of a step is faster than the step without offload
            if simulate(tried, None, spec, half=half).step_s >= result.step_s * (1 - _FASTER):
                break
            plan = planner(tried)
        except (SplitError, StepFailedError, PlanInfeasibleError):
            break
        simulated = simulate(tried, plan, spec, half=half)
        if simulated.step_s >= result.step_s * (1 - _FASTER):
            break
        log.info(
            "[LMS] In slabs (%s) the plan is predicted at %.4f s a step, against %.4f s",
            named_slabs(slabs),
            simulated.step_s,
            result.step_s,
        )
        best = (tried, plan, simulated)
    return best


_FASTER = 0.02
"""How much faster a step in more slabs must be predicted, as a share of its step, to stand:
below it, the simulator's own error decides."""

_CLIMBS = 3
"""Tries at most, each a trace and a plan."""

CLIMB_SIMULATIONS = 2000
"""Simulations of each per-tensor search while `lms.LMS.tune` compares slab counts: a 3D U-Net
in 32 slabs has about 8000 ops, and each simulation of them takes about 11 ms on one core."""

_WORTH_A_TRY = 0.05
"""A plan predicted within this share of its step without offload leaves slabs too little to
win for the trace and the plan they cost."""
