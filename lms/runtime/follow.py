"""What a step does with each storage it saves: its plan's choice, or the budget's own policy.

A step follows its plan (from `LMS.tune`, or given) by the order of its saves. A step that saves
other tensors than the plan was made for diverges, and from there on follows the policy the
runtime uses without a plan: after a recorded first step, the oldest saves go out while the
saved bytes would take the step over its budget (`lms.core.policy`).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

from lms.core import policy
from lms.core.config import LMSConfig
from lms.core.plan import Plan
from lms.core.sync import SyncMode
from lms.runtime.step import Step
from lms.runtime.store import Entry

__all__ = ["Follow"]


log = logging.getLogger("lms.runtime")


class Follow:
    """The choices of one runtime's steps; ``plan`` is the plan they follow, if any."""

    def __init__(self, config: LMSConfig, plan: Plan | None):
        self.config = config
        self.plan = plan
        self.calibrated: tuple[Plan, int] | None = None  # the plan, the most a full step saved
        self._warned = False

    def following(self, step: Step) -> bool:
        """Whether ``step`` follows a plan (it has one and has not diverged from it)."""
        return self.plan is not None and not step.diverged

    def diverge(self, step: Step, ordinal: int, what: str) -> None:
        """``step`` saves other tensors than ``what`` (at save ``ordinal``): warn, once a run."""
        step.diverged = True
        if self._warned:
            return
        self._warned = True
        if step.forward_again:
            log.warning(
                "[LMS] step %d runs forward again after its backward (diverging at save %d), where"
                " the %s one forward and backward; falling back to the runtime's own policy for"
                " the rest of this step. Enter the LMS block once per forward and backward (each"
                " micro-batch of gradient accumulation) to follow the plan in each",
                step.number,
                ordinal,
                what,
            )
            return
        # a copy of the model tuned runs its submodules whole where the plan has them in slabs
        # (with a plan, a step diverges from it: a recorded step is followed only without one)
        slabs = self.plan.slabs if self.plan is not None else ()
        log.warning(
            "[LMS] step %d saves tensors other than the %s (at save %d); falling back to "
            "the runtime's own policy for this step%s",
            step.number,
            what,
            ordinal,
            f". The plan runs {', '.join(name for name, _ in slabs)} in slabs in the model it "
            "was tuned with (or given as LMS(model=...)): step that model, not a copy"
            if slabs
            else "",
        )

    def allowance(self, step: Step, *, backward: bool = False) -> int | None:
        """Saved bytes (resident, plus brought back in ``backward``) the budget leaves room for."""
        budget = self.config.budget_bytes
        if budget is None:
            return None
        reserve = policy.reserve_bytes(step.largest_bytes, backward=backward)
        return budget - (step.baseline_bytes or 0) - reserve

    # -- at save -------------------------------------------------------------------------------
    def past_calibration(self, step: Step) -> bool:
        """Whether ``step`` has saved more than the most a full step of its plan saved (see
        Note [A step that saves more than its plan's steps diverges])."""
        calibrated = self.calibrated
        return (
            calibrated is not None
            and calibrated[0] is self.plan
            and not step.diverged
            and step.saved_storage_bytes > calibrated[1]
        )

    # Note: [A step is checked where its plan recomputes]
    # A step follows its plan by the order of its saves, and learns it left it when it saves more
    # storages than the plan has. A step can part from it sooner and still save as many: an RNN
    # cell's gates, copied again where the cell changed them in place (Note [Join a copied
    # storage only through the same base at the same version]), shifted every later ordinal by
    # one. An offload or a keep of the wrong storage costs memory alone; a replay of the wrong
    # recipe gives other bits, which the runtime sees only after backward took them, and a GRU's
    # gradients differed. So where the plan recomputes an ordinal, the step's storage there must
    # have the bytes the traced one had (`Plan.entry_bytes`), or the step diverges.
    def recomputes(self, step: Step, entry: Entry) -> bool:
        """Whether the plan recomputes ``entry`` rather than storing it (Note [A step is checked
        where its plan recomputes])."""
        if not self.following(step):
            return False
        plan = self.plan
        assert plan is not None
        if step.recompute_set is None:
            step.recompute_set = set(plan.recompute)
        if entry.ordinal not in step.recompute_set:
            return False
        if plan.entry_bytes and plan.entry_bytes[entry.ordinal] != entry.nbytes:
            self.diverge(step, entry.ordinal, "plan was made for")
            return False
        return True

    def offload_instead(self, step: Step, entry: Entry) -> None:
        """Offload ``entry``, which the plan recomputes, because it has no recipe at run time."""
        assert self.plan is not None
        step.offload_set = (step.offload_set or set(self.plan.offload)) | {entry.ordinal}

    def offloads(self, step: Step, entry: Entry) -> bool:
        """With a plan or a record of an earlier step, decide at save time; False: keep for now."""
        if self.plan is not None and not step.diverged:
            if entry.ordinal >= self.plan.num_entries:
                self.diverge(step, entry.ordinal, "plan was made for")
                return False
            if step.offload_set is None:
                step.offload_set = set(self.plan.offload)
            return entry.ordinal in step.offload_set
        record = step.record
        if record is None or step.diverged or entry.held:
            return False
        ordinal = entry.ordinal
        if ordinal >= len(record.nbytes) or record.nbytes[ordinal] != entry.nbytes:
            self.diverge(step, ordinal, "recorded step did")
            return False
        if step.offload_set is None:
            chosen: set[int] = set()
            if self.config.swapout_threshold != -1:
                chosen |= policy.threshold_offloads(record, self.config.swapout_threshold)
            allowance = self.allowance(step)
            if allowance is not None:
                chosen |= policy.budget_offloads(record.nbytes, allowance, record.held)
            step.offload_set = chosen
        return ordinal in step.offload_set

    def empty_at(self, step: Step, entry: Entry) -> int | None:
        """The event from which the plan empties ``entry`` while the code holds it, if it does
        (Note [Emptying what the code holds])."""
        if self.plan is None or not self.plan.free_held or step.diverged:
            return None
        if step.empty_at is None:
            step.empty_at = self.plan.free_held_events()
        return step.empty_at.get(entry.ordinal)

    def gaps(self, step: Step, entry: Entry) -> list[tuple[int, int]]:
        """The stretches of forward over which the plan empties ``entry`` and fills it again, as
        ``(empty_at, fill_at)`` events in order (Note [Gaps in what the code holds])."""
        if self.plan is None or not self.plan.held_gaps or step.diverged:
            return []
        if step.gaps is None:
            step.gaps = self.plan.gaps_of()
        return list(step.gaps.get(entry.ordinal, ()))

    def spills(self, step: Step | None, entry: Entry) -> bool:
        """Whether the plan sends ``entry`` to a spill file rather than host memory."""
        if self.plan is None or not self.plan.spill or step is None or step.diverged:
            return False
        if step.spill_set is None:
            step.spill_set = set(self.plan.spill)
        return entry.ordinal in step.spill_set

    def evictions(self, step: Step) -> Iterator[Entry]:
        """The oldest resident entries, taken off ``step.resident``, while the threshold or the
        budget demands that they move out (none where the step follows a choice made at save)."""
        planned = step.offload_set is not None and not step.diverged
        threshold = self.config.swapout_threshold
        lag = policy.threshold_lag(threshold) if threshold != -1 and not planned else None
        allowance = None if planned else self.allowance(step)
        newest = len(step.entries) - 1
        while step.resident:
            oldest = step.resident[0]
            by_threshold = lag is not None and newest - oldest.ordinal >= lag
            by_budget = allowance is not None and step.resident_bytes > allowance
            if not (by_threshold or by_budget):
                break
            step.resident.popleft()
            step.resident_bytes -= oldest.nbytes
            yield oldest

    # -- in backward ---------------------------------------------------------------------------
    def refetches(self, step: Step | None, entry: Entry) -> bool:
        """Whether the plan drops ``entry``'s device copy between uses and reads it again."""
        if self.plan is None or not self.plan.refetch or step is None or step.diverged:
            return False
        if not step.owns(entry):
            return False
        if step.refetch_set is None:
            step.refetch_set = set(self.plan.refetch)
        return entry.ordinal in step.refetch_set

    def prefetch(self, step: Step) -> tuple[int, int | None] | None:
        """How many offloaded entries to have on their way ahead of each read, and the bytes
        they may take with the rest (None: no limit); None: load each only when read."""
        following = self.following(step)
        if self.config.sync_in or (
            following and self.plan and SyncMode(self.plan.sync_mode).on_demand
        ):
            return None
        if following and self.plan is not None:
            # A plan's prefetches were checked by the simulator: follow them as they are.
            return self.plan.swapin_ahead, None
        return self.config.ahead, self.allowance(step, backward=True)

    # -- after a step ----------------------------------------------------------------------------
    def calibrate(self, step: Step | None) -> None:
        """After a step that followed its plan in full, remember the most bytes it saved.

        Note: [A step that saves more than its plan's steps diverges]
        A plan is made for one step's tensors, by their order. Once a step has followed it in
        full (every save counted, none diverging), a later step that saves more bytes (a larger
        batch of the same model, a longer sequence) is not the step the plan was made for: from
        the save that goes past the most a full step saved, it follows the budget's own policy,
        the earlier saves counted as memory already taken.

        Note: [A plan that moves nothing runs light]
        Where the plan moves nothing, the steps after the first full one run light: their saves
        pass through untouched (no entries, no handles, no module hook) and only add up their
        bytes, until a save goes past that most.
        """
        if step is None or step.diverged or step.light or self.plan is None:
            return
        most = step.saved_storage_bytes
        if self.calibrated is not None and self.calibrated[0] is self.plan:
            most = max(most, self.calibrated[1])
        self.calibrated = (self.plan, most)

    def runs_light(self) -> bool:
        """Whether the next step may run light (see Note [A plan that moves nothing runs light])."""
        plan = self.plan
        if plan is None or self.calibrated is None or self.calibrated[0] is not plan:
            return False
        moves = (
            plan.offload or plan.recompute or plan.spill or plan.refetch or plan.relieved_junctions
        )
        return not moves and not plan.relieved_partials and self.config.swapout_threshold == -1
