"""`Plan`: what to offload and how, for one traced step; saved to and loaded from JSON."""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

from lms.core.sync import SyncMode

__all__ = ["Plan"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Plan:
    """A per-tensor offload plan. Tensors are named by ordinal: the position of their storage
    among the step's offloadable saved storages, in the order they were first saved."""

    fingerprint: str
    """`Trace.fingerprint()` of the step the plan was made for."""
    offload: tuple[int, ...]
    """Ordinals to move out of device memory."""
    num_entries: int
    """How many offloadable storages the step saves."""
    refetch: tuple[int, ...] = ()
    """Offloaded ordinals read back for each use in backward: the device copy is dropped between
    uses instead of held (TFLMS's swap-in per consumer)."""
    recompute: tuple[int, ...] = ()
    """Ordinals that backward recomputes from their forward ops instead of storing."""
    spill: tuple[int, ...] = ()
    """Offloaded ordinals that go to spill files rather than host memory (host memory short)."""
    relieved_junctions: tuple[int, ...] = ()
    """Ordinals whose gradient junction is relieved: where the tensor feeds several operations,
    each partial gradient that backward computes but the last waits off the device until they
    are summed (see `lms.core.junctions`)."""
    relieved_partials: tuple[int, ...] = ()
    """For each ordinal of `relieved_junctions`, how many partial gradients meet at its
    junction (two each
    when empty); the runtime relieves a junction only where it counts as many."""
    free_held: tuple[int, ...] = ()
    """Offloaded ordinals whose device storage is emptied once forward has read it for the last
    time, though the step's code still holds it (the input batch, a block's input in a local),
    and filled again in place when backward reads it (Note [Emptying what the code holds])."""
    free_held_at: tuple[int, ...] = ()
    """For each ordinal of `free_held`, the saved-tensor event (counting saves and reads from 1)
    from which the runtime empties it, once its copy out has finished."""
    held_gaps: tuple[tuple[int, int, int], ...] = ()
    """``(ordinal, empty_at, fill_at)`` for each stretch of forward over which the step's code
    holds an offloaded ordinal without reading it: from saved-tensor event ``empty_at`` on,
    once its copy out has finished, its storage is emptied, and at event ``fill_at`` filled
    again from the copy, before forward's next read of it (Note [Gaps in what the code
    holds])."""
    swapin_ahead: int = 2
    """Offloaded tensors brought back ahead of backward's use."""
    sync_mode: int = SyncMode.ASYNC
    """How the step waits for its copies: a `SyncMode` (TFLMS's 0 to 3)."""
    budget_bytes: int | None = None
    """The device budget the plan was made for."""
    predicted_peak_bytes: int = 0
    """The simulator's device peak with the plan."""
    predicted_overhead: float = 0.0
    """The simulator's step-time overhead over no offload."""
    source: str = "runtime-policy"
    """What made it: "runtime-policy", "tflms", "planner"."""
    slabs: tuple[tuple[str, int], ...] = ()
    """Submodules that run in slabs, by name, with how many: the step the plan was made for
    ran them so (Note [Slabs]); the runtime runs them so too."""
    entry_bytes: tuple[int, ...] = ()
    """The bytes of each saved storage, by ordinal, in the step the plan was made for (from
    `Trace.entries`); a step whose storage the plan recomputes has other bytes there diverges
    (Note [A step is checked where its plan recomputes]). Empty: not checked."""
    use_order: tuple[int, ...] = ()
    """Ordinals in the order backward first read them in the traced step (`Trace.use_order`):
    the order the runtime prefetches in before a step of its own has shown it; empty for the
    order of an earlier step, else newest first (Note [The first step prefetches in the traced
    order])."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "sync_mode", SyncMode(self.sync_mode))
        if self.entry_bytes and len(self.entry_bytes) != self.num_entries:
            raise ValueError(
                f"lms: Plan.entry_bytes gives {len(self.entry_bytes)} sizes for "
                f"{self.num_entries} entries"
            )
        bad = [i for i in self.offload if not 0 <= i < self.num_entries]
        if bad:
            raise ValueError(
                f"lms: Plan.offload names ordinals {bad[:5]} outside 0..{self.num_entries - 1}"
            )
        both = sorted(set(self.recompute) & set(self.offload))
        if both or any(not 0 <= i < self.num_entries for i in self.recompute):
            raise ValueError(
                f"lms: Plan.recompute {list(self.recompute)[:5]} must name ordinals in "
                f"0..{self.num_entries - 1} that Plan.offload does not (both: {both[:5]})"
            )
        loose = sorted(set(self.spill) - set(self.offload))
        if loose:
            raise ValueError(
                f"lms: Plan.spill names ordinals {loose[:5]} that Plan.offload does not; "
                "only offloaded tensors can go to disk"
            )
        outside = [i for i in self.relieved_junctions if not 0 <= i < self.num_entries]
        if outside:
            raise ValueError(
                f"lms: Plan.relieved_junctions names ordinals {outside[:5]} outside "
                f"0..{self.num_entries - 1}"
            )
        if self.relieved_partials and (
            len(self.relieved_partials) != len(self.relieved_junctions)
            or min(self.relieved_partials) < 2
        ):
            raise ValueError(
                f"lms: Plan.relieved_partials {list(self.relieved_partials)[:5]} must give a "
                f"count of two or more for each of the {len(self.relieved_junctions)} ordinals of "
                "Plan.relieved_junctions"
            )
        stray = sorted(set(self.refetch) - set(self.offload))
        if stray:
            raise ValueError(
                f"lms: Plan.refetch names ordinals {stray[:5]} that Plan.offload does not; "
                "only offloaded tensors can be read back per use"
            )

        if len(set(self.use_order)) != len(self.use_order) or any(
            not 0 <= i < self.num_entries for i in self.use_order
        ):
            raise ValueError(
                f"lms: Plan.use_order must name distinct ordinals in 0..{self.num_entries - 1}"
            )

        loose_held = sorted(
            set(self.free_held) - set(self.offload) | set(self.free_held) & set(self.refetch)
        )
        if loose_held or len(self.free_held_at) != len(self.free_held):
            raise ValueError(
                f"lms: Plan.free_held names ordinals {loose_held[:5]} that Plan.offload does not, "
                "or that Plan.refetch reads back per use, or Plan.free_held_at does not give an "
                f"event for each of its {len(self.free_held)} ordinals"
            )
        if self.held_gaps:
            self._check_gaps()

    def gaps_of(self) -> dict[int, list[tuple[int, int]]]:
        """The `held_gaps` of each ordinal, ``(empty_at, fill_at)`` in order, by ordinal."""
        found: dict[int, list[tuple[int, int]]] = {}
        for ordinal, empty_at, fill_at in sorted(self.held_gaps):
            found.setdefault(ordinal, []).append((empty_at, fill_at))
        return found

    def _check_gaps(self) -> None:
        last = self.free_held_events()
        moved = set(self.offload) - set(self.refetch)
        ends: dict[int, int] = {}
        for ordinal, empty_at, fill_at in sorted(self.held_gaps):
            before = last.get(ordinal, fill_at + 1)
            if ordinal not in moved or not ends.get(ordinal, 0) < empty_at < fill_at < before:
                raise ValueError(
                    f"lms: Plan.held_gaps has ({ordinal}, {empty_at}, {fill_at}): each gap must "
                    "name an ordinal of Plan.offload not read back per use, and events empty_at "
                    "< fill_at after the ordinal's previous gap (and before its Plan.free_held_at "
                    "event)"
                )
            ends[ordinal] = fill_at

    def free_held_events(self) -> dict[int, int]:
        """The event from which each ordinal of `free_held` is emptied, by ordinal."""
        return dict(zip(self.free_held, self.free_held_at, strict=True))

    def junction_partials(self) -> dict[int, int]:
        """How many partial gradients meet at each relieved junction, by ordinal."""
        return dict(
            zip(
                self.relieved_junctions,
                self.relieved_partials or (2,) * len(self.relieved_junctions),
                strict=True,
            )
        )

    def to_json(self) -> str:
        """The plan as JSON text."""
        return json.dumps(dataclasses.asdict(self), indent=1)

    @classmethod
    def from_json(cls, text: str) -> Plan:
        """A plan from `to_json` text."""
        data: dict[str, Any] = json.loads(text)
        data["offload"] = tuple(data["offload"])
        data["refetch"] = tuple(data.get("refetch", ()))
        data["recompute"] = tuple(data.get("recompute", ()))
        data["spill"] = tuple(data.get("spill", ()))
        # Plans saved before the fields were named for what they hold.
        data.setdefault("relieved_junctions", data.pop("stash", ()))
        data.setdefault("relieved_partials", data.pop("stash_partials", ()))
        data["relieved_junctions"] = tuple(data["relieved_junctions"])
        data["relieved_partials"] = tuple(data.get("relieved_partials", ()))
        data["free_held"] = tuple(data.get("free_held", ()))
        data["free_held_at"] = tuple(data.get("free_held_at", ()))
        data["held_gaps"] = tuple(tuple(gap) for gap in data.get("held_gaps", ()))
        data["use_order"] = tuple(data.get("use_order", ()))
        data["entry_bytes"] = tuple(data.get("entry_bytes", ()))
        data["slabs"] = tuple((str(name), int(count)) for name, count in data.get("slabs", ()))
        return cls(**data)

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the plan to ``path``."""
        with open(path, "w") as handle:
            handle.write(self.to_json())

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Plan:
        """Read a plan written by `save`."""
        with open(path) as handle:
            return cls.from_json(handle.read())
