"""What every planner shares: candidate plans, checking them, and the infeasible-budget error."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable

from lms._units import format_bytes
from lms.analysis.devices import DeviceSpec
from lms.analysis.records import Trace
from lms.analysis.simulate import SimResult, simulate
from lms.errors import PlanInfeasibleError
from lms.plan import Plan

__all__ = ["Checker", "entry_distances"]

log = logging.getLogger("lms.planning")


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


@dataclasses.dataclass
class Checker:
    """Simulates candidate plans for one trace, device and budget, and counts the work."""

    trace: Trace
    spec: DeviceSpec
    budget_bytes: int
    half: bool = False
    simulations: int = 0
    refetch: frozenset[int] = frozenset()
    """Entries read back per use in every plan that offloads them (set by `require_feasible`)."""

    def __post_init__(self) -> None:
        self.fingerprint = self.trace.fingerprint()
        self.num_entries = len(self.trace.entries())

    def plan(
        self,
        offload: Iterable[int],
        *,
        ahead: int = 2,
        sync_mode: int = 0,
        source: str,
        recompute: Iterable[int] = (),
    ) -> Plan:
        remade = set(recompute)
        chosen = set(offload) - remade
        return Plan(
            fingerprint=self.fingerprint,
            offload=tuple(sorted(chosen)),
            refetch=tuple(sorted(self.refetch & chosen)),
            recompute=tuple(sorted(remade)),
            num_entries=self.num_entries,
            swapin_ahead=ahead,
            sync_mode=sync_mode,
            budget_bytes=self.budget_bytes,
            source=source,
        )

    def run(self, plan: Plan | None) -> SimResult:
        self.simulations += 1
        return simulate(self.trace, plan, self.spec, half=self.half)

    def fits(self, result: SimResult) -> bool:
        return result.peak_bytes <= self.budget_bytes

    def finish(self, plan: Plan, result: SimResult) -> Plan:
        """The plan with its predictions; the simulator checks every plan a planner returns."""
        assert self.fits(result), "a planner returned a plan its simulation rejects"
        return dataclasses.replace(
            plan, predicted_peak_bytes=result.peak_bytes, predicted_overhead=result.overhead
        )

    def require_feasible(self) -> tuple[Plan, SimResult]:
        """The smallest-memory plan (everything out, copies waited for); raises if it fails.

        When even that does not fit, tensors that backward reads at several places are read back
        for each use rather than held between uses; the fewest such that fit are kept in
        `refetch` for the plans that follow.
        """
        everything = range(self.num_entries)
        best: tuple[Plan, SimResult] | None = None
        for ahead, sync_mode in ((1, 0), (1, 1), (1, 3)):
            plan = self.plan(everything, ahead=ahead, sync_mode=sync_mode, source="minimum")
            result = self.run(plan)
            if best is None or result.peak_bytes < best[1].peak_bytes:
                best = (plan, result)
            if self.fits(result):
                return plan, result
        found = self._fewest_refetches()
        if found is not None:
            return found
        assert best is not None
        plan, result = best
        if self.refetch:
            plan = self.plan(everything, ahead=1, sync_mode=3, source="minimum")
            result = self.run(plan)
        op = self.trace.ops[result.peak_op] if self.trace.ops else None
        largest = self.trace.largest_op
        where = f"{op.name} at {op.module}" if op else "the step"
        raise PlanInfeasibleError(
            f"lms: budget {format_bytes(self.budget_bytes)} is below the "
            f"{format_bytes(result.peak_bytes)} that the step needs even with every saved "
            f"tensor offloaded: {where} runs at that peak (the largest operation, "
            f"{largest.name} at {largest.module}, needs {format_bytes(largest.working_set_bytes)}"
            " at once); raise the budget or lower the batch size or resolution",
            op_name=op.name if op else "",
            op_bytes=largest.working_set_bytes,
            min_budget_bytes=result.peak_bytes,
        )

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
