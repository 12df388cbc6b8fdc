"""One step's state in the runtime, and the handle autograd holds for each saved tensor."""

from __future__ import annotations

import bisect
import collections
import weakref
from collections.abc import Callable
from typing import Any

import torch

from lms.core import junctions, policy
from lms.core.errors import SavedTensorChangedError
from lms.core.keep import without_node, wrapped_parts
from lms.core.plan import Plan
from lms.runtime.store import Entry

__all__ = ["Handle", "Kept", "Step", "Wrapped", "storage_bytes"]


# Note: [Saved tensors changed in place]
# Autograd refuses, at backward, a saved tensor that an in-place op changed after it was saved
# (its version counter moved), but not one that saved-tensor hooks packed: without a check, a
# step that plain PyTorch refuses would train on whatever the copy caught. The runtime checks the
# same counter. A kept tensor keeps its version beside it. A handle keeps the version and a
# watch: an alias of the saved tensor that shares its counter (as a view's is its base's) but
# has an empty storage of its own, so that checking keeps no memory alive and sees changes made
# before the tensor itself was freed.


class Kept:
    """What autograd holds for a saved tensor the runtime leaves in place."""

    __slots__ = ("tensor", "version")

    def __init__(self, tensor: torch.Tensor):
        self.tensor = without_node(tensor)
        self.version = tensor._version

    def unpack(self) -> torch.Tensor:
        """The tensor (Note [Saved tensors changed in place]).

        Raises:
            SavedTensorChangedError: an in-place op changed it after it was saved.
        """
        tensor = self.tensor
        if tensor._version != self.version:
            raise changed_error(tensor, tensor._version, self.version)
        return tensor


_EMPTY: dict[torch.device, torch.UntypedStorage] = {}


def _empty_storage(device: torch.device) -> torch.UntypedStorage:
    """One storage of no bytes on ``device``, shared by every watch there: nothing writes to it."""
    storage = _EMPTY.get(device)
    if storage is None:
        storage = _EMPTY[device] = torch.UntypedStorage(0, device=device)
    return storage


class Handle:
    """What autograd holds instead of a saved tensor: its storage entry and view geometry."""

    __slots__ = ("release", "entry", "dtype", "size", "stride", "offset", "version", "watch")

    def __init__(self, release: Callable[[Entry], None], entry: Entry, tensor: torch.Tensor):
        self.release = release
        """Called with ``entry`` when autograd lets go of this handle."""
        self.entry = entry
        self.dtype = tensor.dtype
        self.size = tensor.size()
        self.stride = tensor.stride()
        self.offset = tensor.storage_offset()
        self.version = tensor._version
        self.watch = tensor.detach()
        # An empty storage instead of its own; set_ moves the shared counter, put back at once.
        self.watch.set_(_empty_storage(tensor.device), 0, (0,), (1,))
        torch._C._autograd._unsafe_set_version_counter((self.watch,), (self.version,))

    def check(self) -> None:
        """Raise if the saved tensor changed in place (Note [Saved tensors changed in place]).

        Raises:
            SavedTensorChangedError: its version moved since it was saved.
        """
        now = self.watch._version
        if now != self.version:
            raise changed_error(self.watch, now, self.version, self.size)

    def __del__(self) -> None:
        self.release(self.entry)


class Wrapped:
    """What autograd holds for a saved tensor subclass that wraps plain tensors (a DTensor and
    its local shard): what the runtime holds for each inner tensor, and what remakes the
    subclass around them.

    Note: [Subclasses move by their inner tensors]
    Tensor parallelism saves the inputs of its matrix products as DTensors, whose memory is a
    plain local tensor inside. Where a step follows no plan, each inner tensor is kept, moved or
    shared like any saved tensor, and the subclass is made again around what comes back, by its
    own ``__tensor_unflatten__`` with the shape, strides and context it had when saved: the same
    bits as its own. The other objects it is made of (a DTensor's mesh) are held as they are. A
    plan counts such a save as one it keeps (the trace sees no subclass), so a step following
    one keeps the subclass whole, as it keeps one whose inner tensors all stay (a view of a
    sharded weight).

    An in-place op on the subclass moves its own version counter, not its inner tensors' (their
    ops run below autograd), so the check of Note [Saved tensors changed in place] watches the
    subclass itself: a detached alias, which shares its counter, with its inner tensors swapped
    for empty ones so that it holds no memory.
    """

    __slots__ = ("kind", "held", "others", "context", "size", "stride", "version", "watch")

    def __init__(
        self, tensor: torch.Tensor, held: dict[str, Any], others: dict[str, Any], context: Any
    ):
        self.kind = type(tensor)
        self.held = held
        """Inner tensors' names to what the runtime holds for each (`Kept`, `Handle`)."""
        self.others = others
        self.context = context
        self.size = tensor.size()
        self.stride = tensor.stride()
        self.version = tensor._version
        self.watch: torch.Tensor | None = tensor.detach()
        empty = torch.empty(0, dtype=tensor.dtype, device=tensor.device)
        try:
            for name in held:
                setattr(self.watch, name, empty)
        except (AttributeError, TypeError):  # a subclass that refuses: its inner tensors' checks
            self.watch = None

    def remake(self, unpack: Callable[[Any], torch.Tensor]) -> torch.Tensor:
        """The subclass again, each inner tensor brought back by ``unpack``.

        Raises:
            SavedTensorChangedError: an in-place op changed it after it was saved.
        """
        if self.watch is not None and self.watch._version != self.version:
            raise changed_error(self.watch, self.watch._version, self.version, self.size)
        inner = {name: unpack(part) for name, part in self.held.items()}
        return self.kind.__tensor_unflatten__(  # type: ignore[attr-defined,no-any-return]
            {**self.others, **inner}, self.context, self.size, self.stride
        )


def changed_error(
    tensor: torch.Tensor, now: int, saved: int, size: torch.Size | None = None
) -> SavedTensorChangedError:
    shape = list(size if size is not None else tensor.shape)
    return SavedTensorChangedError(
        f"lms: a tensor saved for backward ({str(tensor.dtype).removeprefix('torch.')} {shape})"
        f" was changed by an in-place operation after it was saved: it is at version {now}, "
        f"saved at version {saved}. Autograd refuses the same step without LMS; make that "
        "operation out of place, or clone the tensor before it"
    )


def storage_bytes(tensor: torch.Tensor) -> int:
    """Bytes of a plain strided tensor's storage, or of those of the plain tensors a subclass
    wraps (Note [Subclasses move by their inner tensors]); 0 for other layouts."""
    if type(tensor) is not torch.Tensor:
        wrapped = wrapped_parts(tensor)
        if wrapped is None:
            return 0
        return sum(storage_bytes(t) for t in wrapped[0].values())
    if tensor.layout != torch.strided:
        return 0
    return int(tensor.untyped_storage().nbytes())


class Step:
    """The state of one step: its entries in save order and the runtime's choices."""

    def __init__(
        self, number: int, record: policy.StepRecord | None, plan: Plan | None = None
    ) -> None:
        self.number = number
        self.record = record
        self.plan = plan
        self.diverged = False
        self.level = 0
        self.entries: list[Entry] = []
        self.first_use: dict[int, int] = {}
        self.resident: collections.deque[Entry] = collections.deque()
        self.resident_bytes = 0
        self.policy_peak_bytes = 0
        """The most saved bytes resident after a save while the step followed the budget's own
        policy (without a plan, or once it diverged from one)."""
        self.largest_bytes = max(record.nbytes, default=0) if record else 0
        self.offload_set: set[int] | None = None
        self.refetch_set: set[int] | None = None
        self.recompute_set: set[int] | None = None
        self.spill_set: set[int] | None = None
        self.empty_at: dict[int, int] | None = None
        self.gaps: dict[int, list[tuple[int, int]]] | None = None  # the plan's, by ordinal
        self.use_queue: list[Entry] | None = None
        self.use_pos: dict[int, int] = {}
        self.offloaded_at: list[int] = []  # positions in use_queue of offloaded entries, sorted
        self.save_level: dict[int, int] = {}
        self.baseline_bytes: int | None = None
        self.entered: tuple[int, int, int] | None = None
        """On a card, as the step began: the current device's index, what it had allocated and
        its allocator's retries so far (`lms.runtime._cuda.allocator_now`)."""
        self.first_call: tuple[torch.nn.Module, tuple[Any, ...]] | None = None
        """The first module the step called and its arguments, until the first save: on a CPU,
        their host storages are what the budget starts from (Note [What a budget on the CPU
        starts from]); read then alone, since a step on a card, or one that follows its plan
        light, never asks."""
        self.junction_edges: dict[junctions.Edge, int] = {}
        self.saved_nodes: list[Any] = []  # grad_fn of each saved tensor, while junctions wait
        self.walked = False
        self.light = False  # saves pass through untouched (see LMS._calibrate)
        self.saved_storage_bytes = 0  # bytes of the storages of every save, shared ones again
        self.forward_again = False  # saved after every earlier save was released (by backward)
        self.held: dict[tuple[str, int], weakref.ref[torch.UntypedStorage]] = {}
        """Storages that saves kept in place hold, by (device, address)."""
        self.twins: set[int] = set()
        """Keys of the entries that copy a storage again under its entry's ordinal (Note [A
        storage copied again keeps its place in the plan])."""
        self.to_empty: list[Entry] = []
        """Offloaded entries the plan empties in place, not emptied yet (`Entry.empty_at`)."""

    def owns(self, entry: Entry) -> bool:
        return (
            entry.ordinal < len(self.entries) and self.entries[entry.ordinal] is entry
        ) or entry.key in self.twins

    def note_held_outside(self) -> None:
        """At the end of a step that ran backward, a storage the runtime moved whose device copy
        is still alive is held by something else: the caller's input batch, an output kept for
        a metric, a tensor a module caches. Moving it freed nothing and bringing it back made a
        second copy: the record marks it held, so that later steps without a plan keep it."""
        for entry in self.entries:
            if entry.storage is None and entry.pending_out is None and entry.origin() is not None:
                entry.held = True

    def to_record(self) -> policy.StepRecord:
        return policy.StepRecord(
            save_level=tuple(self.save_level[e.ordinal] for e in self.entries),
            nbytes=tuple(e.nbytes for e in self.entries),
            first_use_level=tuple(self.first_use.get(e.ordinal) for e in self.entries),
            held=frozenset(e.ordinal for e in self.entries if e.held),
        )

    # Note: [The first step prefetches in the traced order]
    # Prefetches follow the order in which backward first reads the saved storages. A step learns
    # that order from the step before it; the first step under a tuned plan has none before it, and
    # reading newest first instead can bring a large storage back long before the simulator, which
    # prefetches in the traced order, has it there, over a plan simulated under its budget. So a
    # step with no record of an earlier one follows the plan's `use_order`, the trace's. The case
    # that showed it: benchmarks/results/README.md, "The first step's prefetch order".
    def backward_queue(self) -> list[Entry]:
        """The entries in the order backward first reads them: as the recorded step read them
        when this step saves the same, else as the plan's trace read them, else newest first.
        Made at backward's first read."""
        if self.use_queue is None:
            record, plan, count = self.record, self.plan, len(self.entries)
            order: list[int] = []
            if record is not None and not self.diverged and len(record.nbytes) == count:
                order = record.use_order
            elif plan is not None and plan.use_order and plan.num_entries == count:
                order = list(plan.use_order)
            seen = set(order)
            order += [i for i in reversed(range(count)) if i not in seen]
            self.use_queue = [self.entries[i] for i in order]
            self.use_pos = {e.ordinal: i for i, e in enumerate(self.use_queue)}
            self.offloaded_at = [i for i, e in enumerate(self.use_queue) if e.offloaded]
        return self.use_queue

    def note_offloaded(self, entry: Entry) -> None:
        """Keep ``offloaded_at`` whole when backward's queue exists before ``entry`` goes out
        (a save during backward, as checkpointed regions make, can evict an older storage)."""
        if self.use_queue is None:
            return
        position = self.use_pos.get(entry.ordinal)
        if position is None:
            return
        index = bisect.bisect_left(self.offloaded_at, position)
        if index == len(self.offloaded_at) or self.offloaded_at[index] != position:
            self.offloaded_at.insert(index, position)
