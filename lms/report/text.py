"""`[LMS]` information lines in the spirit of TFLMS v2's, from a trace and simulations."""

from __future__ import annotations

from collections.abc import Iterable

from lms.analysis.simulate import SimResult
from lms.core.devices import LINK_MARGIN, DeviceSpec
from lms.core.plan import Plan
from lms.core.recipes import recipes
from lms.core.records import Trace
from lms.core.units import format_bytes

__all__ = ["info_lines"]

_MATRIX_PRODUCTS = frozenset(f"aten.{name}.default" for name in ("mm", "addmm", "bmm", "baddbmm"))
"""The ops whose outputs the `[LMS]` lines count as matrix products' when a plan replays them."""


# Long by design: the `[LMS]` lines of a report in the order they print, one block each.
def info_lines(
    trace: Trace,
    spec: DeviceSpec,
    plain: SimResult,
    plan: Plan | None,
    planned: SimResult | None,
    *,
    budget_bytes: int,
    free_held: bool = False,
    slow_link: SimResult | None = None,
) -> list[str]:
    """The lines, without the logger's prefix."""
    largest = trace.largest_op
    lines = [
        f"[LMS] Analyzing {trace.name}, inputs {list(map(list, trace.input_shapes))}, "
        f"traced on {trace.device}",
        f"[LMS] The step has {len(trace.ops)} operations, {trace.num_edges} edges and "
        f"{trace.num_levels} levels; {sum(e.kind == 'save' for e in trace.events)} saved tensors "
        f"in {len(trace.entries())} storages that may move",
        f"[LMS] The model has {format_bytes(trace.param_bytes)} of learning parameters",
        f"[LMS] The largest operation is {largest.name} at {largest.module} consuming "
        f"{format_bytes(largest.working_set_bytes)}",
        f"[LMS] Peak device memory without LMS: {format_bytes(plain.peak_bytes)} "
        f"({format_bytes(plain.peak_tensor_bytes)} of tensors + "
        f"{format_bytes(spec.workspace_bytes)} workspace margin) on {spec.name} with "
        f"{format_bytes(budget_bytes)} for the step",
    ]
    if trace.slabs:
        lines.append(
            "[LMS] In slabs along the first spatial dimension (Note [Slabs]): "
            + ", ".join(f"{name} in {count}" for name, count in trace.slabs)
            + "; the figures below are of the step so"
        )
    scratch = max(trace.ops, key=lambda op: op.cpu_scratch_bytes, default=None)
    if spec.cpu_scratch and scratch is not None and scratch.cpu_scratch_bytes:
        lines.append(
            f"[LMS] Convolutions take up to {format_bytes(scratch.cpu_scratch_bytes)} of scratch "
            f"memory while they run ({scratch.name} at {scratch.module}); in the channels-last "
            "layout oneDNN copies less"
        )
    if plain.peak_bytes <= budget_bytes:
        lines.append("[LMS] LMS is not needed: the step fits without offloading")
        return lines
    lines.append("[LMS] LMS is needed")
    held = [nbytes for storage, nbytes, _ in trace.entries() if storage in trace.held_by_code]
    holders = "(a variable that keeps the model's output, a tensor a module keeps on itself)"
    if held and free_held:
        lines.append(
            f"[LMS] The step's code holds {len(held)} saved storages ({format_bytes(sum(held))}) "
            f"into backward {holders}; a plan may empty those forward no longer reads (free_held)"
        )
    elif held:
        lines.append(
            f"[LMS] {len(held)} saved storages ({format_bytes(sum(held))}) stay on the device: "
            f"the step's code holds them into backward {holders}, so moving them would free "
            "nothing"
        )
    casts = _weight_casts(trace, trace.held_by_code)
    if casts:
        lines.append(
            f"[LMS] {format_bytes(casts)} of what the code holds are casts of the weights that "
            "autocast keeps until its block ends (its cache), as backward runs inside it: run "
            "only forward and the loss under autocast, as PyTorch advises, for a plan that may "
            "move them"
        )
    if plan is None or planned is None:
        return lines
    fits = "fits" if planned.peak_bytes <= budget_bytes else "does NOT fit"
    lines += [
        f"[LMS] Plan ({plan.source}): offload {planned.offloaded_tensors} of "
        f"{plan.num_entries} saved storages ({format_bytes(planned.offloaded_bytes)} out and "
        f"back), swapin_ahead {plan.swapin_ahead}, sync_mode {plan.sync_mode}",
    ]
    if plan.recompute:
        found = recipes(trace)
        remade = set(plan.recompute)
        made_by = [trace.ops[found[i].ops[0]].name for i in plan.recompute]
        products = sum(name in _MATRIX_PRODUCTS for name in made_by)
        chained = sum(bool(set(found[i].inputs) & remade) for i in plan.recompute)
        kinds = f"{made_by.count('aten.convolution.default')} of them convolutions' outputs"
        if products:
            kinds += f", {products} matrix products'"
        lines.append(
            f"[LMS] Recompute {len(plan.recompute)} saved storages in backward instead "
            f"({format_bytes(planned.recomputed_bytes)}, "
            f"{planned.recompute_s * 1e3:.1f} ms of extra compute); {kinds}, {chained} made "
            "from other recomputed ones"
        )
    if plan.free_held:
        emptied = sum(trace.entries()[i][1] for i in plan.free_held)
        lines.append(
            f"[LMS] Empty {len(plan.free_held)} offloaded storages ({format_bytes(emptied)}) that "
            "the step's code still holds, once forward has read them for the last time; backward"
            " fills them again in place (free_held)"
        )
    if plan.held_gaps:  # Note [Gaps in what the code holds]
        gapped = {ordinal for ordinal, _, _ in plan.held_gaps}
        refilled = sum(trace.entries()[i][1] for i, _, _ in plan.held_gaps)
        lines.append(
            f"[LMS] Empty {len(gapped)} offloaded storages that the step's code holds over "
            f"{len(plan.held_gaps)} gaps between forward's reads of them too, each filled again "
            f"before the next read ({format_bytes(refilled)} read back in forward)"
        )
    if plan.spill:
        lines.append(
            f"[LMS] Host memory ({format_bytes(spec.host_memory_bytes or 0)}) is short: "
            f"{len(plan.spill)} offloaded storages go to spill files instead "
            f"({format_bytes(planned.disk_peak_bytes)} on disk at most), the first saved first"
        )
    if plan.refetch:
        lines.append(
            f"[LMS] Read {len(plan.refetch)} offloaded storages back for each use in backward "
            "rather than holding them between uses"
        )
    if planned.relieved_junctions:
        lines.append(
            f"[LMS] At {planned.relieved_junctions} gradient junctions the partial gradients "
            f"wait in host memory to be summed ({format_bytes(planned.relieved_bytes)} out and"
            " back)"
        )
    lines += [
        f"[LMS] Predicted peak with LMS: {format_bytes(planned.peak_bytes)}, {fits} in "
        f"{format_bytes(budget_bytes)}; host memory for offloaded data: "
        f"{format_bytes(planned.host_peak_bytes)}",
        f"[LMS] Predicted step time {planned.step_s * 1e3:.1f} ms vs "
        f"{planned.base_step_s * 1e3:.1f} ms without offload "
        f"({planned.overhead:+.1%}, {_copy_costs(planned)}) over {spec.link}",
    ]
    if slow_link is not None:
        lines.append(
            f"[LMS] With the link and the disk at {LINK_MARGIN:.0%} of those rates: "
            f"{slow_link.step_s * 1e3:.1f} ms ({slow_link.overhead:+.1%}, "
            f"{_copy_costs(slow_link)})"
        )
    return lines


def _copy_costs(result: SimResult) -> str:
    """What copies cost a simulated step: its waits, and on a CPU the compute time they take
    (Note [Copies on a CPU take its cores])."""
    words = f"{result.wait_s * 1e3:.1f} ms waiting for copies"
    if result.copy_compute_s:
        words += f", {result.copy_compute_s * 1e3:.1f} ms of compute lost to them"
    return words


# Note: [Autocast keeps its casts of the weights]
# Under autocast a weight is cast to the lower precision once, at its first use, and the cast is
# kept in autocast's cache until the outermost autocast block ends; a matrix product saves that
# cast for backward. With backward inside the block the cache still holds each cast when backward
# reads it, so the trace finds the code holding it (`Trace.held_by_code`) and no plan can free it
# by moving it: a copy of every weight that a product saves, in the lower precision. With backward
# after the block, as PyTorch advises, only autograd holds them.
def _weight_casts(trace: Trace, held: Iterable[int]) -> int:
    """Bytes of the storages in ``held`` that casts of the weights made (Note [Autocast keeps
    its casts of the weights])."""
    storages = trace.storages  # by id
    total = 0
    for storage in held:
        record = storages[storage]
        if record.alloc_op < 0:
            continue
        op = trace.ops[record.alloc_op]
        if op.name == "aten._to_copy.default" and any(
            storages[i].kind == "param" for i in op.inputs
        ):
            total += record.nbytes
    return total
