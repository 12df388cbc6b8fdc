"""What every planner shares: candidate plans, checking them, and the infeasible-budget error."""

from __future__ import annotations

import bisect
import dataclasses
import logging
from collections.abc import Iterable

from lms._units import format_bytes
from lms.analysis.devices import DeviceSpec
from lms.analysis.recompute import recipes
from lms.analysis.records import Trace
from lms.analysis.simulate import SimResult, simulate
from lms.errors import PlanInfeasibleError
from lms.plan import Plan

__all__ = ["Checker", "emptiable", "entry_distances", "host_spans", "place_spill"]

log = logging.getLogger("lms.planning")


def host_spans(trace: Trace, spec: DeviceSpec) -> list[tuple[int, int, int]]:
    """For each entry, the ops over which an offloaded copy of it is held: from its save to the
    op after which its storage is freed (the end of the step if never), and the host memory
    the copy takes on ``spec`` (`DeviceSpec.host_copy_bytes`)."""
    free_op = {record.id: record.free_op for record in trace.storages}
    end = len(trace.ops)
    spans = []
    for storage, nbytes, save_op in trace.entries():
        last = free_op.get(storage)
        held = spec.host_copy_bytes(nbytes)
        spans.append((save_op, end if last is None else min(last, end), held))
    return spans


def place_spill(
    spans: list[tuple[int, int, int]], offload: Iterable[int], limit_bytes: int, num_ops: int
) -> tuple[int, ...]:
    """Offloaded entries to send to disk so that the copies held in host memory never exceed
    ``limit_bytes``.

    Note: [Spill what backward needs last]
    Wherever host memory would overflow, the entry held there that was saved first goes to disk:
    backward reads it last, so its slower read has the most time to hide behind compute, and
    the entries saved last (read first, with the least time to come back) stay in host memory.
    """
    held = [0] * (num_ops + 1)
    chosen = sorted(set(offload))
    for ordinal in chosen:
        begin, end, nbytes = spans[ordinal]
        for op in range(begin, end + 1):
            held[op] += nbytes
    spilled: list[int] = []
    remaining = list(chosen)  # in save order: the first saved first
    while remaining:
        peak = max(range(len(held)), key=held.__getitem__)
        if held[peak] <= limit_bytes:
            break
        victim = next(i for i in remaining if spans[i][0] <= peak <= spans[i][1])
        remaining.remove(victim)
        spilled.append(victim)
        begin, end, nbytes = spans[victim]
        for op in range(begin, end + 1):
            held[op] -= nbytes
    return tuple(sorted(spilled))


def entry_distances(trace: Trace) -> list[float]:
    """For each entry, levels from its first save to its first use (infinite if never used)."""
    save_level: dict[int, int] = {}
    use_level: dict[int, int] = {}
    for event in trace.events:
        if not event.offloadable:
            continue
        if event.kind == "save":
            save_level.setdefault(event.storage, event.level)
        else:
            use_level.setdefault(event.storage, event.level)
    return [
        use_level[s] - save_level[s] if s in use_level else float("inf")
        for s, _, _ in trace.entries()
    ]


def emptiable(trace: Trace) -> dict[int, int]:
    """The entries that the step's code holds past forward's last read of them (an input, a
    block's input in a local, an output kept into backward), and for each the first saved-tensor
    event after that read: from there a plan may empty it (Note [Emptying what the code holds]).
    Not those a kept save holds: autograd reads them in place."""
    storages, event_ops = trace.storages, trace.event_ops
    found = {}
    for ordinal, (storage, _, _) in enumerate(trace.entries()):
        record = storages[storage]
        code_holds = (
            record.alloc_op < 0
            or storage in trace.held_by_code
            or record.last_forward_op > record.last_read_op
        )
        if not code_holds or storage in trace.held:
            continue
        after = bisect.bisect_right(event_ops, record.last_read_op)
        if after < len(event_ops):
            found[ordinal] = trace.events[after].level
    return found


def _replay_inputs(trace: Trace, remade: set[int]) -> set[int]:
    """The entries that replays of ``remade`` read: those stay filled for the replay."""
    if not remade:
        return set()
    found = recipes(trace)
    return {i for ordinal in remade if ordinal in found for i in found[ordinal].inputs}


@dataclasses.dataclass
class Checker:
    """Simulates candidate plans for one trace, device and budget, and counts the work: the
    distinct plans simulated (Note [Each plan simulated once])."""

    trace: Trace
    spec: DeviceSpec
    budget_bytes: int
    half: bool = False
    simulations: int = 0
    refetch: frozenset[int] = frozenset()
    """Entries read back per use in every plan that offloads them (set by `require_feasible`)."""
    stash: frozenset[int] = frozenset()
    """Gradient junctions relieved in every plan (set by `require_feasible`)."""
    free_held: bool = False
    """Whether plans empty what the step's code holds (Note [Emptying what the code holds])."""

    def __post_init__(self) -> None:
        self.fingerprint = self.trace.fingerprint()
        self.num_entries = len(self.trace.entries())
        self._host_spans = host_spans(self.trace, self.spec)
        self.emptiable = emptiable(self.trace) if self.free_held else {}
        """Entries a plan may empty while the code holds them, and the event from which."""
        self._results: dict[Plan | None, SimResult] = {}
        """Each plan simulated so far, and its result (Note [Each plan simulated once])."""
        # Note: [Inputs in plans]
        # An input, held by the caller since before the step, frees nothing when moved, and what
        # comes back is a second copy (which the simulator counts, for plans made otherwise, such
        # as the runtime's budget policy): plans keep inputs, and likewise what the step's code
        # holds into backward (the model's output kept in a variable while backward runs: Note
        # [Tensors the step's code holds]).
        storages = self.trace.storages
        self.pinned = frozenset(
            ordinal
            for ordinal, (storage, _, _) in enumerate(self.trace.entries())
            if ordinal not in self.emptiable
            and (
                storages[storage].alloc_op < 0
                or storage in self.trace.held
                or storage in self.trace.held_by_code
            )
        )
        """Entries every plan keeps: inputs (held since before the step), storages a kept save
        holds, and those the step's code holds into backward; moving or recomputing one frees
        nothing."""

    def spill_for(self, offload: Iterable[int]) -> tuple[int, ...]:
        """Which of ``offload`` go to disk so that host memory holds the rest: `place_spill`."""
        limit = self.spec.host_memory_bytes
        if not self.spec.spills or limit is None:
            return ()
        return place_spill(self._host_spans, offload, limit, len(self.trace.ops) + 1)

    def plan(
        self,
        offload: Iterable[int],
        *,
        ahead: int = 2,
        sync_mode: int = 0,
        source: str,
        recompute: Iterable[int] = (),
    ) -> Plan:
        remade = set(recompute) - self.pinned
        chosen = set(offload) - remade - self.pinned
        stash = sorted(self.stash)
        meeting = self.trace.junction_ordinals() if stash else {}
        refetch = self.refetch & chosen
        emptied = sorted(
            set(self.emptiable) & chosen - refetch - _replay_inputs(self.trace, remade)
        )
        return Plan(
            fingerprint=self.fingerprint,
            offload=tuple(sorted(chosen)),
            spill=self.spill_for(chosen),
            refetch=tuple(sorted(refetch)),
            free_held=tuple(emptied),
            free_held_at=tuple(self.emptiable[ordinal] for ordinal in emptied),
            recompute=tuple(sorted(remade)),
            stash=tuple(stash),
            stash_partials=tuple(meeting[ordinal].partials for ordinal in stash),
            num_entries=self.num_entries,
            swapin_ahead=ahead,
            sync_mode=sync_mode,
            budget_bytes=self.budget_bytes,
            source=source,
        )

    def run(self, plan: Plan | None) -> SimResult:
        """The simulation of ``plan``: its peaks and times, without the memory timeline.

        Note: [Each plan simulated once]
        The planner's searches reach the same plan by different paths (two refinements that
        converge, a polish that ends where it began, a restart's searches repeating the first
        one's): 15% to 23% of the candidates at the sweeps' hardest points (ResNet50 at 7500 px
        on the V100 spec: 26011 asked, 20000 distinct). A plan simulated before is answered
        from memory and not counted, so the search's count of simulations, its only limit, buys
        that many more distinct candidates, and the same step still gets the same plan on any
        machine. The timeline is dropped (planners read peaks and times only), which keeps
        20000 answers within about 23 MB (ResNet50 at 7500 px).
        """
        known = self._results.get(plan)
        if known is None:
            self.simulations += 1
            result = simulate(self.trace, plan, self.spec, half=self.half)
            known = dataclasses.replace(
                result, timeline_s=(), device_bytes=(), host_bytes=(), residency=None
            )
            self._results[plan] = known
        return known

    def fits(self, result: SimResult) -> bool:
        return result.peak_bytes <= self.budget_bytes

    def finish(self, plan: Plan, result: SimResult) -> Plan:
        """The plan with its predictions; the simulator checks every plan a planner returns."""
        assert self.fits(result), "a planner returned a plan its simulation rejects"
        return dataclasses.replace(
            plan, predicted_peak_bytes=result.peak_bytes, predicted_overhead=result.overhead
        )

    def require_feasible(self, first: str = "stash") -> tuple[Plan, SimResult]:
        """The smallest-memory plan (everything out, copies waited for); raises if it fails.

        When even that does not fit, two remedies are tried, ``first`` ("stash" or "refetch")
        first and the other only if it alone does not fit: the partial gradients that wait at
        gradient junctions go off the device too (stash), or tensors that backward reads at
        several places are read back for each use rather than held between uses (refetch). Of
        each, the fewest that fit are kept (in `stash` and `refetch`) for the plans that follow.
        """
        if first not in ("stash", "refetch"):
            raise ValueError(f"lms: first must be 'stash' or 'refetch', not {first!r}")
        found, best = self._everything_out()
        if found is None and first == "refetch":
            found = self._fewest_refetches()
            self.refetch = self.refetch if found else frozenset()
        if found is None and self.trace.junctions:
            self.stash = frozenset(self.trace.junction_ordinals())
            found, relieved = self._everything_out()
            best = min(best, relieved, key=lambda pair: pair[1].peak_bytes)
        found = found or self._fewest_refetches()
        if found is not None:
            return self._fewest_stashes(found) if self.stash else found
        result = best[1]
        if self.refetch:  # nothing fits: the lowest peak is that of all of these together
            everything = self.plan(range(self.num_entries), ahead=1, sync_mode=3, source="minimum")
            result = min(result, self.run(everything), key=lambda sim: sim.peak_bytes)
        how = "even with every saved tensor offloaded"
        plain = self.run(None)
        if plain.peak_bytes < result.peak_bytes:
            # Tensors saved in backward (a checkpoint's recomputation, a double backward) are
            # read soon after: moving them costs a copy back on top of the peak.
            result = plain
            how = "as it is (moving its saved tensors off the device raises its peak)"
        op = self.trace.ops[result.peak_op] if self.trace.ops else None
        largest = self.trace.largest_op
        where = f"{op.name} at {op.module}" if op else "the step"
        raise PlanInfeasibleError(
            f"lms: budget {format_bytes(self.budget_bytes)} is below the "
            f"{format_bytes(result.peak_bytes)} that the step needs {how}: "
            f"{where} runs at that peak (the largest operation, "
            f"{largest.name} at {largest.module}, needs {format_bytes(largest.working_set_bytes)}"
            " at once); raise the budget or lower the batch size or resolution"
            + self._free_held_hint(result.peak_bytes),
            op_name=op.name if op else "",
            op_bytes=largest.working_set_bytes,
            min_budget_bytes=result.peak_bytes,
        )

    def _free_held_hint(self, needed: int) -> str:
        """What ``free_held`` would change, when it is off and the step's code holds saved
        tensors past forward's last read of them (the end of `require_feasible`'s message)."""
        if self.free_held or not emptiable(self.trace):
            return ""
        freeing = Checker(self.trace, self.spec, self.budget_bytes, self.half, free_held=True)
        try:
            freeing.require_feasible()
            outcome = "with it the step fits this budget"
        except PlanInfeasibleError as error:
            if error.min_budget_bytes >= needed:
                return ""
            outcome = f"with it the step needs {format_bytes(error.min_budget_bytes)}"
        finally:
            self.simulations += freeing.simulations
        return (
            ", or set free_held (--free-held), which empties what the step's code holds but "
            f"forward no longer reads: {outcome}"
        )

    def _everything_out(self) -> tuple[tuple[Plan, SimResult] | None, tuple[Plan, SimResult]]:
        """Everything offloaded, under each way of waiting for copies: the first that fits (or
        None) and the one with the lowest peak."""
        best: tuple[Plan, SimResult] | None = None
        for ahead, sync_mode in ((1, 0), (1, 1), (1, 3)):
            plan = self.plan(
                range(self.num_entries), ahead=ahead, sync_mode=sync_mode, source="minimum"
            )
            result = self.run(plan)
            if best is None or result.peak_bytes < best[1].peak_bytes:
                best = (plan, result)
            if self.fits(result):
                return (plan, result), best
        assert best is not None
        return None, best

    def _fewest_stashes(self, found: tuple[Plan, SimResult]) -> tuple[Plan, SimResult]:
        """Back to leaving junctions to autograd, largest first, wherever the step still fits."""
        plan = found[0]
        junctions = self.trace.junction_ordinals()
        for ordinal in sorted(self.stash, key=lambda i: -junctions[i].nbytes):
            self.stash = self.stash - {ordinal}
            trial = self.plan(
                plan.offload,
                ahead=plan.swapin_ahead,
                sync_mode=plan.sync_mode,
                source=plan.source,
            )
            result = self.run(trial)
            if self.fits(result):
                found = (trial, result)
            else:
                self.stash = self.stash | {ordinal}
        log.info(
            "[LMS] [Planner] %d of %d gradient junctions send their partial gradients off the"
            " device until they are summed",
            len(self.stash),
            len(junctions),
        )
        return found

    def _fewest_refetches(self) -> tuple[Plan, SimResult] | None:
        """Everything out and read back per use, then back to holding between uses, smallest gap
        first, wherever the step still fits; None when even reading all back per use does not."""
        use_ops = self.trace.use_ops()
        entries = self.trace.entries()
        many = [i for i, (storage, _, _) in enumerate(entries) if len(use_ops.get(storage, ())) > 1]
        if not many:
            return None
        self.refetch = frozenset(many)
        everything = range(self.num_entries)

        def attempt() -> tuple[Plan, SimResult] | None:
            plan = self.plan(everything, ahead=1, sync_mode=3, source="minimum")
            result = self.run(plan)
            return (plan, result) if self.fits(result) else None

        found = attempt()
        if found is None:
            return None

        def gap(ordinal: int) -> int:
            ops = use_ops[entries[ordinal][0]]
            return ops[-1] - ops[0]

        for ordinal in sorted(many, key=gap):  # small gaps save least: try dropping them first
            self.refetch = self.refetch - {ordinal}
            trial = attempt()
            if trial is None:
                self.refetch = self.refetch | {ordinal}
            else:
                found = trial
        log.info(
            "[LMS] [Planner] %d of %d tensors read at several places in backward are read back"
            " for each use",
            len(self.refetch),
            len(many),
        )
        return found
