"""The smallest-memory plan of a step, and the remedies tried where even that does not fit;
the error that names the budget a step needs where none does."""

from __future__ import annotations

import dataclasses
import logging

from lms.analysis.simulate import SimResult
from lms.core.errors import PlanInfeasibleError
from lms.core.plan import Plan
from lms.core.units import format_bytes
from lms.planning.candidates import Candidates
from lms.planning.spans import emptiable

__all__ = ["smallest_plan"]

log = logging.getLogger("lms.planning")


def smallest_plan(candidates: Candidates, first: str = "relieve") -> tuple[Plan, SimResult]:
    """The smallest-memory plan (everything out, copies waited for); raises if it fails.

    When even that does not fit, two remedies are tried, ``first`` ("relieve" or "refetch")
    first and the other only if it alone does not fit: the partial gradients that wait at
    gradient junctions go off the device too (relieve), or tensors that backward reads at
    several places are read back for each use rather than held between uses (refetch). Of
    each, the fewest that fit are kept (in `relieved_junctions` and `refetch`) for the plans
    that follow.
    """
    if first not in ("relieve", "refetch"):
        raise ValueError(f"lms: first must be 'relieve' or 'refetch', not {first!r}")
    found, best = _everything_out(candidates)
    if found is None and first == "refetch":
        found = _fewest_refetches(candidates)
        candidates.refetch = candidates.refetch if found else frozenset()
    if found is None and candidates.trace.junctions:
        candidates.relieved_junctions = frozenset(candidates.trace.junction_ordinals())
        found, relieved = _everything_out(candidates)
        best = min(best, relieved, key=lambda pair: pair[1].peak_bytes)
    found = found or _fewest_refetches(candidates)
    if found is not None:
        return _fewest_relieved(candidates, found) if candidates.relieved_junctions else found
    result = best[1]
    if candidates.refetch:  # nothing fits: the lowest peak is that of all of these together
        everything = candidates.plan(
            range(candidates.num_entries), ahead=1, sync_mode=3, source="minimum"
        )
        result = min(result, candidates.run(everything), key=lambda sim: sim.peak_bytes)
    how = "even with every saved tensor offloaded"
    plain = candidates.run(None)
    if plain.peak_bytes < result.peak_bytes:
        # Tensors saved in backward (a checkpoint's recomputation, a double backward) are
        # read soon after: moving them costs a copy back on top of the peak.
        result = plain
        how = "as it is (moving its saved tensors off the device raises its peak)"
    trace = candidates.trace
    op = trace.ops[result.peak_op] if trace.ops else None
    largest = trace.largest_op
    where = f"{op.name} at {op.module}" if op else "the step"
    remedy = (
        "raise the budget or lower the batch size or the input's size (resolution, sequence length)"
    )
    workspace = candidates.spec.workspace_bytes
    if workspace + trace.weights_and_grads_bytes > candidates.budget_bytes:  # whatever the batch
        beside = (
            f", beside the {format_bytes(workspace)} kept free for libraries" if workspace else ""
        )
        remedy = (
            "the weights, buffers and gradients alone take "
            f"{format_bytes(trace.weights_and_grads_bytes)}{beside}, over the budget whatever "
            "the batch: raise the budget, or shard the weights over processes (FSDP)"
        )
    elif 2 * trace.weights_and_grads_bytes >= result.peak_bytes - workspace:
        # a small batch, whose share of its peak leaves little beside the weights: say so
        remedy = (
            f"the weights, buffers and gradients take {format_bytes(trace.weights_and_grads_bytes)}"
            f" of it whatever the batch, and no plan moves them: {remedy}, or shard the weights "
            "over processes (FSDP)"
        )
    remedy += _free_held_hint(candidates, result.peak_bytes)
    raise PlanInfeasibleError(
        f"lms: budget {format_bytes(candidates.budget_bytes)} is below the "
        f"{format_bytes(result.peak_bytes)} that the step needs {how}: "
        f"{where} runs at that peak (the largest operation, "
        f"{largest.name} at {largest.module}, needs {format_bytes(largest.working_set_bytes)}"
        f" at once); {remedy}",
        op_name=op.name if op else "",
        op_module=op.module if op else "",
        op_bytes=largest.working_set_bytes,
        min_budget_bytes=result.peak_bytes,
    )


def _free_held_hint(candidates: Candidates, needed: int) -> str:
    """What ``free_held`` would change, when it is off and the step's code holds saved
    tensors past forward's last read of them (the end of `smallest_plan`'s message)."""
    if candidates.free_held or not emptiable(candidates.trace):
        return ""
    freeing = dataclasses.replace(
        candidates,
        simulations=0,
        refetch=frozenset(),
        relieved_junctions=frozenset(),
        free_held=True,
    )
    try:
        smallest_plan(freeing)
        outcome = "with it the step fits this budget"
    except PlanInfeasibleError as error:
        if error.min_budget_bytes > 0.99 * needed:  # within rounding of the same floor
            return ""
        outcome = f"with it the step needs {format_bytes(error.min_budget_bytes)}"
    finally:
        candidates.simulations += freeing.simulations
    return (
        ", or set free_held (--free-held), which empties what the step's code holds but "
        f"forward no longer reads: {outcome}"
    )


def _everything_out(
    candidates: Candidates,
) -> tuple[tuple[Plan, SimResult] | None, tuple[Plan, SimResult]]:
    """Everything offloaded, under each way of waiting for copies: the first that fits (or
    None) and the one with the lowest peak."""
    best: tuple[Plan, SimResult] | None = None
    for ahead, sync_mode in ((1, 0), (1, 1), (1, 3)):
        plan = candidates.plan(
            range(candidates.num_entries), ahead=ahead, sync_mode=sync_mode, source="minimum"
        )
        result = candidates.run(plan)
        if best is None or result.peak_bytes < best[1].peak_bytes:
            best = (plan, result)
        if candidates.fits(result):
            return (plan, result), best
    assert best is not None
    return None, best


def _fewest_relieved(
    candidates: Candidates, found: tuple[Plan, SimResult]
) -> tuple[Plan, SimResult]:
    """Back to leaving junctions to autograd, largest first, wherever the step still fits."""
    plan = found[0]
    junctions = candidates.trace.junction_ordinals()
    for ordinal in sorted(candidates.relieved_junctions, key=lambda i: -junctions[i].nbytes):
        candidates.relieved_junctions = candidates.relieved_junctions - {ordinal}
        trial = candidates.plan(
            plan.offload,
            ahead=plan.swapin_ahead,
            sync_mode=plan.sync_mode,
            source=plan.source,
        )
        result = candidates.run(trial)
        if candidates.fits(result):
            found = (trial, result)
        else:
            candidates.relieved_junctions = candidates.relieved_junctions | {ordinal}
    log.info(
        "[LMS] [Planner] %d of %d gradient junctions send their partial gradients off the"
        " device until they are summed",
        len(candidates.relieved_junctions),
        len(junctions),
    )
    return found


def _fewest_refetches(candidates: Candidates) -> tuple[Plan, SimResult] | None:
    """Everything out and read back per use, then back to holding between uses, smallest gap
    first, wherever the step still fits; None when even reading all back per use does not."""
    use_ops = candidates.trace.use_ops()
    entries = candidates.trace.entries()
    many = [i for i, (storage, _, _) in enumerate(entries) if len(use_ops.get(storage, ())) > 1]
    if not many:
        return None
    candidates.refetch = frozenset(many)
    everything = range(candidates.num_entries)

    def attempt() -> tuple[Plan, SimResult] | None:
        plan = candidates.plan(everything, ahead=1, sync_mode=3, source="minimum")
        result = candidates.run(plan)
        return (plan, result) if candidates.fits(result) else None

    found = attempt()
    if found is None:
        return None

    def gap(ordinal: int) -> int:
        ops = use_ops[entries[ordinal][0]]
        return ops[-1] - ops[0]

    for ordinal in sorted(many, key=gap):  # small gaps save least: try dropping them first
        candidates.refetch = candidates.refetch - {ordinal}
        trial = attempt()
        if trial is None:
            candidates.refetch = candidates.refetch | {ordinal}
        else:
            found = trial
    log.info(
        "[LMS] [Planner] %d of %d tensors read at several places in backward are read back"
        " for each use",
        len(candidates.refetch),
        len(many),
    )
    return found
