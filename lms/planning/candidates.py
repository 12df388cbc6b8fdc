"""What every planner shares: candidate plans, each built and simulated once."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable
from typing import Any

from lms.analysis.simulate import SimResult, simulate
from lms.core.devices import DeviceSpec
from lms.core.plan import Plan
from lms.core.records import Trace
from lms.planning.spans import emptiable, held_gaps, host_spans, place_spill, replay_inputs

__all__ = ["Candidates"]

log = logging.getLogger("lms.planning")


@dataclasses.dataclass
class Candidates:
    """The candidate plans of one search, for one trace, device and budget: builds each plan
    (`plan`), simulates it once (`run`, Note [Each plan simulated once]), counts the distinct
    plans simulated."""

    trace: Trace
    spec: DeviceSpec
    budget_bytes: int
    half: bool = False
    simulations: int = 0
    refetch: frozenset[int] = frozenset()
    """Entries read back per use in every plan that offloads them (set by `smallest_plan`)."""
    relieved_junctions: frozenset[int] = frozenset()
    """Gradient junctions relieved in every plan (set by `smallest_plan`)."""
    free_held: bool = False
    """Whether plans empty what the step's code holds (Note [Emptying what the code holds])."""
    gaps: bool = False
    """With `free_held`: whether plans also empty what they offload over the gaps between
    forward's reads of it (Note [Gaps in what the code holds])."""
    progress: Any = dataclasses.field(default=None, repr=False, compare=False)
    """A progress bar (tqdm's) advanced by one at each simulation, where a search shows one."""

    def __post_init__(self) -> None:
        self.fingerprint = self.trace.fingerprint()
        self.entry_bytes = tuple(size for _, size, _ in self.trace.entries())
        self.num_entries = len(self.entry_bytes)
        self._host_spans = host_spans(self.trace, self.spec)
        self.emptiable = emptiable(self.trace) if self.free_held else {}
        """Entries a plan may empty while the code holds them, and the event from which."""
        self.held_gaps = held_gaps(self.trace) if self.free_held and self.gaps else {}
        """Their gaps in forward, by ordinal."""
        self._results: dict[Plan | None, SimResult] = {}
        """Each plan simulated so far, and its result (Note [Each plan simulated once])."""
        self.fastest_s = float("inf")
        """The shortest predicted step of a plan simulated so far that fits."""
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
        relieved = sorted(self.relieved_junctions)
        meeting = self.trace.junction_ordinals() if relieved else {}
        refetch = self.refetch & chosen
        emptied = sorted(set(self.emptiable) & chosen - refetch - replay_inputs(self.trace, remade))
        return Plan(
            fingerprint=self.fingerprint,
            entry_bytes=self.entry_bytes,
            offload=tuple(sorted(chosen)),
            spill=self.spill_for(chosen),
            refetch=tuple(sorted(refetch)),
            free_held=tuple(emptied),
            free_held_at=tuple(self.emptiable[ordinal] for ordinal in emptied),
            held_gaps=tuple(
                (ordinal, *gap)
                for ordinal in sorted(chosen - refetch)
                for gap in self.held_gaps.get(ordinal, ())
            ),
            recompute=tuple(sorted(remade)),
            relieved_junctions=tuple(relieved),
            relieved_partials=tuple(meeting[ordinal].partials for ordinal in relieved),
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
            if self.progress is not None:
                self.progress.update(1)
            result = simulate(self.trace, plan, self.spec, half=self.half)
            known = dataclasses.replace(
                result, timeline_s=(), device_bytes=(), host_bytes=(), residency=None
            )
            self._results[plan] = known
            if plan is not None and self.fits(known):
                self.fastest_s = min(self.fastest_s, known.step_s)
        return known

    def fits(self, result: SimResult) -> bool:
        return result.peak_bytes <= self.budget_bytes

    def fewest_gaps(self, plan: Plan) -> tuple[Plan, SimResult]:
        """``plan`` without each of its gaps that it fits without, the last gaps first (the
        largest ones are usually the first: a U-Net's outermost skip). Each gap costs a read back
        in forward."""
        result = self.run(plan)
        for gap in reversed(plan.held_gaps):
            trial = dataclasses.replace(
                plan, held_gaps=tuple(g for g in plan.held_gaps if g != gap)
            )
            trial_result = self.run(trial)
            if self.fits(trial_result):
                plan, result = trial, trial_result
        return plan, result

    def finish(self, plan: Plan, result: SimResult) -> Plan:
        """The plan with its predictions; the simulator checks every plan a planner returns."""
        assert self.fits(result), "a planner returned a plan its simulation rejects"
        return dataclasses.replace(
            plan, predicted_peak_bytes=result.peak_bytes, predicted_overhead=result.overhead
        )
