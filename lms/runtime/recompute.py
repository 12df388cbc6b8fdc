"""Recompute saved tensors in backward from the forward calls that wrote them.

`Replays` takes a `Recipe` (`lms.runtime.writelog`) for each storage the plan recomputes as
forward saves it, drops the storage, and in backward replays the same aten calls on the same
bits, so the result is identical.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils._pytree import tree_unflatten

from lms.core.errors import LMSError, StepAbortedError
from lms.runtime.stats import LMSStats
from lms.runtime.writelog import Recipe, Slot, WriteLog

if TYPE_CHECKING:
    from lms.runtime.store import Entry

log = logging.getLogger("lms.runtime")

__all__ = ["Replays", "checksum", "replay"]


def checksum(storage: torch.UntypedStorage, device: torch.device) -> torch.Tensor:
    """A sum over ``storage``'s bytes read as 64-bit integers, wrapping (on its device, not
    synchronised): two copies whose bits differ almost surely differ in it.

    The words are summed as they lie: a sum that widened smaller integers would first make a
    widened copy, twice the storage, when memory is tightest (19 GiB for ResNet50's stem output
    at 12650 px). Integer addition wraps alike in any order, so the sum does not depend on the
    order the kernel adds in."""
    with torch.no_grad(), _disable_current_modes():
        data = torch.empty(0, dtype=torch.uint8, device=device).set_(storage)
        words = data.numel() // 8
        total = data[: words * 8].view(torch.int64).sum()
        if words * 8 < data.numel():  # the last few bytes, widened: at most seven of them
            total += data[words * 8 :].sum(dtype=torch.int64)
        return total


def _view(storage: torch.UntypedStorage, slot: Slot, device: torch.device) -> torch.Tensor:
    out = torch.empty(0, dtype=slot.dtype, device=device)
    return out.set_(storage, slot.offset, slot.size, slot.stride)


def replay(
    recipe: Recipe,
    device: torch.device,
    fetch: Callable[[Any], torch.UntypedStorage],
) -> torch.UntypedStorage:
    """Run ``recipe``'s calls again; ``fetch`` gives the device storage of an input entry."""
    return _replay(recipe, device, fetch, {})


def _replay(
    recipe: Recipe,
    device: torch.device,
    fetch: Callable[[Any], torch.UntypedStorage],
    remade: dict[int, torch.UntypedStorage],
) -> torch.UntypedStorage:
    """`replay`, with ``remade``: the storages autograd did not save, made once in a replay
    and freed with it."""
    target: torch.UntypedStorage | None = None
    with torch.no_grad(), torch.autocast(device.type, enabled=False):
        for call in recipe.calls:
            leaves: list[Any] = []
            for leaf in call.leaves:
                if not isinstance(leaf, Slot):
                    leaves.append(leaf)
                elif leaf.kind == "self":
                    assert target is not None, "a recipe starts with the call that allocates"
                    leaves.append(_view(target, leaf, device))
                elif leaf.kind == "entry":
                    leaves.append(_view(fetch(leaf.entry), leaf, device))
                elif leaf.kind == "made":
                    assert leaf.made is not None
                    if id(leaf.made) not in remade:
                        remade[id(leaf.made)] = _replay(leaf.made, device, fetch, remade)
                    leaves.append(_view(remade[id(leaf.made)], leaf, device))
                else:
                    assert leaf.fixed is not None
                    if leaf.fixed._version != leaf.version and not leaf.written:
                        raise LMSError(
                            "lms: a parameter (or a small tensor held as one) that a "
                            "recomputed tensor depends on changed between forward and "
                            "backward; step the optimizer after backward"
                        )
                    leaves.append(leaf.fixed.clone() if leaf.written else leaf.fixed)
            args, kwargs = tree_unflatten(leaves, call.spec)
            out = call.func(*args, **kwargs)
            if target is None:
                first = out if isinstance(out, torch.Tensor) else out[0]
                target = first.untyped_storage()
    assert target is not None
    if target.nbytes() != recipe.nbytes:
        raise LMSError(
            f"lms: recomputing a saved tensor made {target.nbytes()} bytes where forward made "
            f"{recipe.nbytes}; pass a plan without recompute"
        )
    return target


class Replays:
    """The runtime's recompute: recipes taken as forward saves, replayed when backward reads."""

    def __init__(
        self,
        stats: LMSStats,
        fetch: Callable[[Entry], tuple[torch.UntypedStorage, float]],
    ):
        self._stats = stats
        self._fetch = fetch
        """Brings an offloaded input back and holds it (its storage, the seconds waited)."""
        self._writes: WriteLog | None = None
        self.checked: Any = None
        """The plan whose first replays were checked (Note [Check the first replays])."""
        self.unreplayable: set[int] = set()
        """Ordinals whose replay gave other bits than forward: offloaded from then on."""

    @property
    def watching(self) -> bool:
        return self._writes is not None

    def watch(
        self,
        fixed_ptrs: set[int],
        entry_of: Callable[[torch.UntypedStorage], Any],
        small_bytes: int,
    ) -> None:
        """Start watching forward's writes (a `WriteLog`) for the step about to run."""
        self._writes = WriteLog(fixed_ptrs, entry_of, small_bytes)
        self._writes.__enter__()

    def saved(self, storage: torch.UntypedStorage, entry: Entry) -> None:
        """See `WriteLog.saved`."""
        if self._writes is not None:
            self._writes.saved(storage, entry)

    def stop(self) -> None:
        if self._writes is not None:
            writes, self._writes = self._writes, None
            writes.__exit__(None, None, None)

    def take(self, entry: Entry, storage: torch.UntypedStorage, *, check: bool) -> bool:
        """Drop ``entry``'s storage now, to be remade from its recipe in backward; False (and
        nothing done) where it has no recipe. ``check``: note a checksum of forward's bytes for
        the first replay to be compared with."""
        if self._writes is None or entry.ordinal in self.unreplayable:
            return False
        recipe = self._writes.recipe(storage, entry)
        if recipe is None:
            return False
        if check:
            # Note: [Check the first replays]
            # A replay gives forward's bits only where the kernels do (cuDNN, say, picks its
            # algorithm for the memory it finds free). The first step of a plan checks each
            # replay against a checksum of what forward made; one that differs is warned about,
            # and that storage is offloaded from the next step on.
            recipe.checksum = checksum(storage, entry.device)
        for source in recipe.inputs:  # kept until this entry is released
            source.handles += 1
            source.replays += 1
        entry.note_copied()
        entry.recipe = recipe
        entry.storage = None
        self._stats.recomputed_tensors += 1
        self._stats.recomputed_bytes += entry.nbytes
        return True

    def remake(self, entry: Entry, *, hold: bool) -> tuple[torch.UntypedStorage, float]:
        """``entry``'s storage, recomputed unless a recomputed copy is still alive, and the
        seconds waited for offloaded inputs; ``hold``: keep it for the entry's next read."""
        if entry.aborted:
            raise StepAbortedError(
                "lms: backward needs a tensor whose recipe was discarded when its step failed; "
                "run forward again"
            )
        alive = entry.loaded
        if alive is None and entry.last is not None:
            alive = entry.last()
        waited = 0.0
        if alive is None:

            def fetch(source: Entry) -> torch.UntypedStorage:
                # A recomputed input is made first and held for its own use (a chain).
                nonlocal waited
                if source.recipe is not None:
                    storage, seconds = self.remake(source, hold=True)
                else:
                    storage, seconds = self._fetch(source)
                waited += seconds
                return storage

            alive = replay(entry.recipe, entry.device, fetch)
            entry.last = weakref.ref(alive)
            self._check(entry, alive)
        entry.loaded = alive if hold else None
        return alive, waited

    def _check(self, entry: Entry, alive: torch.UntypedStorage) -> None:
        """See Note [Check the first replays]."""
        expected, entry.recipe.checksum = entry.recipe.checksum, None
        if expected is None or torch.equal(checksum(alive, entry.device), expected):
            return
        self.unreplayable.add(entry.ordinal)
        self._stats.replays_differed += 1
        log.warning(
            "[LMS] recomputing saved storage %d (%s) gave other bits than forward made, so "
            "this step's gradients may differ from a plain step's in their last bits; it is "
            "offloaded instead from the next step on",
            entry.ordinal,
            entry.recipe.calls[0].func,
        )
