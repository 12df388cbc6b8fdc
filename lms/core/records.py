"""The records shared between stages: a traced step, what the simulator makes of it.

Times in a trace are op indices: op ``i`` is the ``i``-th aten operation of the step. A storage
allocated by op ``a`` and freed after op ``f`` occupies memory while ops ``a..f`` run.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
from typing import Any, Literal

__all__ = [
    "OpRecord",
    "OpCall",
    "TensorMeta",
    "StorageRecord",
    "SavedEvent",
    "JunctionRecord",
    "Trace",
]

Phase = Literal["forward", "backward", "optimizer"]
Kind = Literal["param", "buffer", "input", "activation", "gradient", "state"]


@dataclasses.dataclass(frozen=True)
class OpRecord:
    """One aten operation."""

    index: int
    name: str
    """The overload, as in ``aten.convolution.default``."""
    module: str
    """Fully qualified name of the innermost module running it (``Global`` outside any)."""
    phase: Phase
    flops: int
    """Floating-point operations, from PyTorch's FLOP counter (0 for ops it does not count)."""
    read_bytes: int
    """Bytes of the distinct input storages."""
    written_bytes: int
    """Bytes of the distinct output storages."""
    inputs: tuple[int, ...]
    """Storage ids read."""
    outputs: tuple[int, ...]
    """Storage ids written (new allocations and in-place targets)."""
    cpu_scratch_bytes: int = 0
    """Memory the op takes for itself while it runs on a CPU, on top of its tensors: oneDNN's
    copies of a convolution's tensors (Note [Convolution scratch on the CPU])."""
    touched_bytes: int = -1
    """Bytes of the tensors it reads and writes, each its own elements rather than its whole
    storage; 0 for a view, which moves no data. -1 in records made before it was kept: then
    the working set stands for it."""

    @property
    def working_set_bytes(self) -> int:
        """Inputs and outputs that must be resident at once while the op runs."""
        return self.read_bytes + self.written_bytes

    @property
    def moved_bytes(self) -> int:
        """The bytes that price the op where its memory bound it (Note [An op moves its
        tensors, not their storages])."""
        return self.working_set_bytes if self.touched_bytes < 0 else self.touched_bytes


@dataclasses.dataclass(frozen=True)
class TensorMeta:
    """A tensor argument of a recorded call, without its data."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: Any
    """A ``torch.dtype``."""
    device: str


@dataclasses.dataclass(frozen=True)
class OpCall:
    """How one op was called: its overload and arguments, tensors as `TensorMeta`, so that it
    can run again alone on real tensors of those shapes (`lms.orchestration.timing.time_ops`)."""

    op: Any
    """The ``torch._ops.OpOverload``."""
    args: tuple[Any, ...]
    kwargs: dict[str, Any]

    @functools.cached_property
    def key(self) -> str:
        """The same for calls alike: the op, the shapes and the other arguments."""
        return repr((str(self.op), self.args, sorted(self.kwargs.items())))


@dataclasses.dataclass(frozen=True)
class StorageRecord:
    """One storage: its bytes and when it lives."""

    id: int
    nbytes: int
    kind: Kind
    alloc_op: int
    """Op that allocated it; -1 when it existed before the step."""
    free_op: int | None
    """Last op during which it was alive; None when it outlives the step."""
    last_forward_op: int
    """Last forward op that read or wrote it, or after which the last tensor of it that the
    step's code held died, if later (-1 if none): when it dies if autograd lets go (Note [Tensors
    the step's code holds])."""
    last_read_op: int = -1
    """Last forward op that read or wrote it (-1 if none), however long the code holds it."""
    last_held_op: int = -1
    """For one made once forward was over (by a backward, as a double backward saves it): the
    op after which the last tensor of it outside autograd's saves died (-1 for one made in
    forward, or in records made before it was kept). Note [What backward makes and saves]."""

    @property
    def let_go_op(self) -> int | None:
        """The op after which autograd's saves alone hold it, where a copy out frees it:
        `last_forward_op` for what forward made, `last_held_op` for what came later; for those
        without either, its free (None: it outlives the step)."""
        if self.last_forward_op >= 0 or self.alloc_op < 0:
            return self.last_forward_op
        return self.last_held_op if self.last_held_op >= 0 else self.free_op


@dataclasses.dataclass(frozen=True)
class SavedEvent:
    """A saved-tensor event: autograd saving a tensor (pack) or reading it back (unpack)."""

    level: int
    """Position in the step's sequence of saved-tensor events, from 1."""
    op: int
    """Index of the next op to run when the event happened."""
    kind: Literal["save", "use"]
    storage: int
    nbytes: int
    offloadable: bool
    """False for parameters, buffers, leaves that require grad, and tensors below the size floor."""
    held_to: int = -1
    """For a read: the op after which the tensor it gave, and the views made of it, died (the
    node that read it returned); -1 in records made before it was kept."""


@dataclasses.dataclass(frozen=True)
class JunctionRecord:
    """A saved tensor that feeds several operations: where its partial gradients met in backward.

    See `lms.core.junctions`.
    """

    storage: int
    """The saved storage (its entry names the junction in `lms.Plan.relieved_junctions`)."""
    grads: tuple[int, ...]
    """Storages of the partial gradients, in the order they arrived."""
    sizes: tuple[int, ...]
    """Their bytes."""
    arrive_ops: tuple[int, ...]
    """For each, the index of the first op after it was made (the engine's sum, after the first)."""
    join_op: int
    """Index of the first op of the producer's backward, where the partials are summed."""
    merged: int
    """Storage of the sum the producer received (a partial's, when summed in place)."""
    accumulated: tuple[int, ...] = ()
    """Storages the engine's sums of the partials wrote, ``merged`` among them."""
    taken: int = 1
    """How many of the partials, first to arrive first, wait off the device when relieved
    (`lms.core.junctions.partials_taken`)."""

    @property
    def partials(self) -> int:
        """How many partial gradients meet here: the consumer slots of the tensor."""
        return len(self.grads)

    @property
    def nbytes(self) -> int:
        """Bytes that wait off the device when relieved."""
        return sum(self.sizes[: self.taken])

    @property
    def sums(self) -> frozenset[int]:
        """Every storage the plain sum uses: the partials, what the engine adds them into."""
        return frozenset((*self.grads, *self.accumulated, self.merged))


@dataclasses.dataclass(frozen=True)
class Trace:
    """Everything one traced training step did, in order."""

    name: str
    input_shapes: tuple[tuple[int, ...], ...]
    device: str
    ops: tuple[OpRecord, ...]
    storages: tuple[StorageRecord, ...]
    """By id: ``storages[i].id == i``."""
    events: tuple[SavedEvent, ...]
    param_bytes: int
    buffer_bytes: int
    input_bytes: int
    gradient_bytes: int
    state_bytes: int
    """Optimizer state created during the step."""
    backward_start_op: int
    num_levels: int
    """Topological levels of the op graph (longest producer-to-consumer chain)."""
    num_edges: int
    min_offload_bytes: int
    junctions: tuple[JunctionRecord, ...] = ()
    """Gradient junctions of saved tensors, in first-save order of those tensors."""
    compiled: bool = False
    """The model has parts compiled with ``torch.compile``, or the step is compiled as a whole:
    backward recomputes nothing (Note [Compiled models are not replayed])."""
    slabs: tuple[tuple[str, int], ...] = ()
    """The submodules that ran in slabs, by name, with how many (Note [Slabs])."""
    calls: tuple[OpCall | None, ...] = dataclasses.field(default=(), compare=False, repr=False)
    """How each op was called, by op index (None where it cannot run again alone); empty for
    traces made otherwise. Not part of the record's identity."""
    modules: tuple[str, ...] = dataclasses.field(default=(), compare=False, repr=False)
    """The modules forward called, as ops name them, in the order of their first call (a
    ``ModuleList`` holds modules but is never called); empty for traces made otherwise."""

    # -- derived -----------------------------------------------------------------------------
    @property
    def weights_and_grads_bytes(self) -> int:
        """The weights, buffers and gradients the step ends with: what no plan, slab or batch
        size lowers."""
        return self.param_bytes + self.buffer_bytes + self.gradient_bytes

    @property
    def largest_op(self) -> OpRecord:
        """The op with the largest working set (inputs + outputs)."""
        return max(self.ops, key=lambda op: op.working_set_bytes)

    # Note: [A trace derives once]
    # A planner simulates one trace thousands of times; what each simulation derives from the
    # trace alone is derived once, kept on the (frozen) trace, and handed out as a copy.
    @functools.cached_property
    def _entries(self) -> tuple[tuple[int, int, int], ...]:
        seen: dict[int, tuple[int, int, int]] = {}
        for event in self.events:
            if event.kind == "save" and event.offloadable and event.storage not in seen:
                seen[event.storage] = (event.storage, event.nbytes, event.op)
        return tuple(seen.values())

    @functools.cached_property
    def held(self) -> frozenset[int]:
        """Storages that may move but that a save kept in place (inside `lms.no_offload`) holds
        on the device meanwhile: moving or recomputing one frees nothing."""
        movable = {storage for storage, _, _ in self._entries}
        return frozenset(
            event.storage
            for event in self.events
            if event.kind == "save" and not event.offloadable and event.storage in movable
        )

    @functools.cached_property
    def held_by_code(self) -> frozenset[int]:
        """Storages that may move but that the step's code holds into backward (a variable that
        keeps the model's output while backward runs, a tensor a module keeps): moving one frees
        nothing (Note [Tensors the step's code holds])."""
        start, first_use = self.backward_start_op, self.first_use_op()
        held = set()
        for storage, _, _ in self._entries:
            record = self.storages[storage]
            if record.alloc_op < 0:
                continue
            if record.alloc_op < start and record.last_forward_op >= start:
                held.add(storage)
            elif record.alloc_op >= start:
                # made after forward (Note [What backward makes and saves]): held to its first
                # read, moving it frees nothing
                let_go = record.let_go_op
                if let_go is None or let_go >= first_use.get(storage, len(self.ops)):
                    held.add(storage)
        return frozenset(held)

    @functools.cached_property
    def event_ops(self) -> list[int]:
        """The op of each saved-tensor event (`SavedEvent.op`), by level less one; do not mutate
        it."""
        return [event.op for event in self.events]

    @functools.cached_property
    def _uses(self) -> dict[int, tuple[int, ...]]:
        uses: dict[int, list[int]] = {}
        for event in self.events:
            if event.kind == "use":
                ops = uses.setdefault(event.storage, [])
                if not ops or ops[-1] != event.op:
                    ops.append(event.op)
        return {storage: tuple(ops) for storage, ops in uses.items()}

    @functools.cached_property
    def memo(self) -> dict[Any, Any]:
        """Values later stages derive from this trace alone, by key (Note [A trace derives
        once]); not part of the record."""
        return {}

    def entries(self) -> list[tuple[int, int, int]]:
        """Offloadable saved storages in first-save order, as ``(storage, nbytes, save_op)``.

        Their positions are the ordinals the runtime gives the same storages, so a plan can
        name tensors by them.
        """
        return list(self._entries)

    def junction_ordinals(self) -> dict[int, JunctionRecord]:
        """The junctions by the ordinal of their saved entry."""
        ordinal = {storage: i for i, (storage, _, _) in enumerate(self.entries())}
        return {ordinal[j.storage]: j for j in self.junctions if j.storage in ordinal}

    @functools.cached_property
    def first_use_levels(self) -> dict[int, int]:
        """The level of each saved storage's first read in backward, by storage; do not mutate
        it."""
        first: dict[int, int] = {}
        for event in self.events:
            if event.kind == "use":
                first.setdefault(event.storage, event.level)
        return first

    @functools.cached_property
    def use_order(self) -> tuple[int, ...]:
        """Ordinals of `entries` in the order backward first reads them, as its saved-tensor
        events came (several read by one op, in the order that op read them); those backward
        never reads left out. The runtime prefetches in this order (`Plan.use_order`)."""
        first = self.first_use_levels
        ordinals = [i for i, (storage, _, _) in enumerate(self._entries) if storage in first]
        return tuple(sorted(ordinals, key=lambda i: first[self._entries[i][0]]))

    @functools.cached_property
    def read_ends(self) -> dict[tuple[int, int], int]:
        """For each read of a saved storage in backward, by ``(storage, op)`` as `use_ops` names
        it: the op after which what that read gave died (the op itself where the record does
        not say); do not mutate it. A copy read back for that use alone lives until then."""
        ends: dict[tuple[int, int], int] = {}
        for event in self.events:
            if event.kind == "use":
                key = (event.storage, event.op)
                ends[key] = max(ends.get(key, event.op), event.held_to)
        return ends

    def first_use_op(self) -> dict[int, int]:
        """For each saved storage, the op index of its first read in backward."""
        return {storage: ops[0] for storage, ops in self._uses.items()}

    def use_ops(self) -> dict[int, list[int]]:
        """For each saved storage, the distinct op indices at which backward reads it, in order."""
        return {storage: list(ops) for storage, ops in self._uses.items()}

    def fingerprint(self) -> str:
        """A short hash of the step's shape: op names, sizes and saved-tensor events."""
        return self._fingerprint

    @functools.cached_property
    def _fingerprint(self) -> str:  # each simulation compares it (Note [A trace derives once])
        digest = hashlib.sha256()
        header = [self.name, self.input_shapes, self.device, *(["compiled"] * self.compiled)]
        digest.update(json.dumps(header).encode())
        for op in self.ops:
            scratch = f":{op.cpu_scratch_bytes}" if op.cpu_scratch_bytes else ""
            digest.update(f"{op.name}:{op.read_bytes}:{op.written_bytes}{scratch};".encode())
        for event in self.events:
            digest.update(f"{event.kind}{event.nbytes}{int(event.offloadable)};".encode())
        return digest.hexdigest()[:16]

    def summary(self) -> dict[str, Any]:
        """Headline numbers, JSON-ready."""
        largest = self.largest_op
        return {
            "name": self.name,
            "num_ops": len(self.ops),
            "num_edges": self.num_edges,
            "num_levels": self.num_levels,
            "saved_events": len(self.events),
            "param_bytes": self.param_bytes,
            "largest_op": {
                "name": largest.name,
                "module": largest.module,
                "bytes": largest.working_set_bytes,
            },
        }
