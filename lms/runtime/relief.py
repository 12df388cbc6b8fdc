"""Relieved gradient junctions at run time: partial gradients moved off the device as they
arrive and brought back one at a time, summed in the order they arrived.

`lms.core.junctions` finds the junctions in autograd's graph and hooks them (Note [Why
junctions, and how the sum stays bit for bit]); `Relief` is what the hooks call.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch

from lms.core import junctions
from lms.core.errors import HostMemoryError
from lms.core.plan import Plan
from lms.runtime.stats import LMSStats
from lms.runtime.step import Step
from lms.runtime.store import Entry, Offloader

__all__ = ["Relief"]

log = logging.getLogger("lms.runtime")

_Geometry = tuple[torch.dtype, int, torch.Size, tuple[int, ...]]


class Relief:
    """The partial gradients taken at each junction of one backward, and how many meet there."""

    def __init__(
        self,
        offloader: Offloader,
        stats: LMSStats,
        lock: threading.RLock,
        keeps: Callable[[torch.Tensor], bool],
        keys: Iterator[int],
    ):
        self._offloader = offloader
        self._stats = stats
        self._lock = lock
        self._keeps = keeps
        self._keys = keys
        self._held: dict[Any, list[tuple[Entry, _Geometry]]] = {}  # copies, geometry
        self._summing: set[Any] = set()  # junctions whose partials go to autograd this backward
        self._meeting: dict[Any, int] = {}  # junction: partials that meet there

    def note(self, step: Step, plan: Plan | None, entry: Entry, tensor: torch.Tensor) -> None:
        """Remember the autograd edge of ``entry`` when ``plan`` relieves its junction."""
        if plan is None or not plan.relieved_junctions or step.diverged:
            return
        if entry.ordinal in plan.relieved_junctions:
            edge = junctions.edge_of(tensor)
            if edge is not None:
                step.junction_edges.setdefault(edge, entry.ordinal)

    def hook(self, step: Step, plan: Plan | None) -> None:
        """At the first read in backward: hook ``plan``'s junctions in the graph it runs."""
        if not junctions.in_backward() or plan is None:
            return
        step.walked = True
        root = torch._C._current_autograd_node()
        edges, step.junction_edges = step.junction_edges, {}
        # Each branch of backward holds a node whose output some op saved: walking down from
        # those finds the consumers that a walk from the first node misses.
        starts, step.saved_nodes = step.saved_nodes, []
        hooked = self.attach(edges, root, starts, plan.junction_partials())
        if hooked != len(edges):
            log.info(
                "[LMS] %d of the plan's %d gradient junctions are not junctions of as many "
                "partial gradients at run time; autograd sums those as usual",
                len(edges) - hooked,
                len(edges),
            )

    def attach(
        self,
        edges: dict[junctions.Edge, int],
        root: Any,
        starts: list[Any],
        partials: dict[int, int],
    ) -> int:
        """Hook the junctions at ``edges`` in the graph below ``root`` and ``starts`` (see
        `junctions.attach`); returns how many were hooked."""
        self._meeting = junctions.attach(
            edges,
            root,
            self.take,
            self.join,
            consumers=junctions.fan_in(root, *starts),
            partials=partials,
        )
        return len(self._meeting)

    def take(self, key: Any, partial: torch.Tensor, last: bool) -> torch.Tensor | None:
        """Move a partial gradient at junction ``key`` out: None, or for the last one a stand-in
        for autograd to hold (see `junctions.partials_taken`). Or, where it cannot go, hand
        autograd what it would have summed so far (the partials taken, then this one), and take
        no more there in this backward."""
        meeting = self._meeting.get(key, 2)
        if key in self._summing or (last and junctions.partials_taken(meeting) < meeting):
            return partial
        if not torch.is_grad_enabled() and not self._keeps(partial):  # grad on: recorded
            with self._lock:
                entry = Entry(next(self._keys), -1, partial.untyped_storage(), partial.device)
                with contextlib.suppress(HostMemoryError):  # then autograd sums here
                    self._offloader.offload(entry)
                if entry.offloaded:
                    geometry = (
                        partial.dtype,
                        int(partial.storage_offset()),
                        partial.size(),
                        partial.stride(),
                    )
                    self._held.setdefault(key, []).append((entry, geometry))
                    self._stats.relieved_partials += 1
                    self._stats.relieved_bytes += entry.nbytes
                    if not last:
                        return None
                    stand_in = torch.zeros((), dtype=partial.dtype, device=partial.device)
                    return stand_in.expand(partial.shape)
                self._offloader.release(entry)
        self._summing.add(key)  # the rest go to autograd, in the order they arrive
        held = self._sum(key)
        return partial if held is None else _accumulate(held, partial)

    def join(self, key: Any, rest: torch.Tensor | None) -> torch.Tensor | None:
        """Bring the partials taken at ``key`` back, summed in the order they arrived, and add
        the engine's sum of the rest to them."""
        self._summing.discard(key)
        if len(self._held.get(key, ())) == self._meeting.get(key):
            rest = None  # every partial was taken: autograd holds the stand-in for the last
        held = self._sum(key)
        if held is None or rest is None:
            return held
        return _accumulate(held, rest)

    def drop(self) -> None:
        """Free the copies of partial gradients that no backward came back for."""
        held, self._held = self._held, {}
        self._summing.clear()
        for copies in held.values():
            for entry, _ in copies:
                self._offloader.release(entry)

    def _sum(self, key: Any) -> torch.Tensor | None:
        """The partials taken at ``key`` brought back one at a time and summed; None if none."""
        total: torch.Tensor | None = None
        for entry, (dtype, offset, size, stride) in self._held.pop(key, []):
            with self._lock:
                try:
                    storage, waited = self._offloader.fetch(entry)
                finally:
                    self._offloader.release(entry)
                self._stats.wait_s += waited
                self._stats.reloaded_bytes = self._offloader.loaded_bytes
            back = torch.empty(0, dtype=dtype, device=entry.device)
            back.set_(storage, offset, size, stride)
            total = back if total is None else _accumulate(total, back)
        return total


def _accumulate(total: torch.Tensor, partial: torch.Tensor) -> torch.Tensor:
    """``total + partial`` as autograd sums partial gradients; in place in ``total`` (a copy
    brought back, no one else's) where that is safe."""
    if partial.shape == total.shape and partial.dtype == total.dtype and _dense(total):
        return total.add_(partial)
    return total + partial


def _dense(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` covers its elements once each, so adding into it in place is safe."""
    formats = {4: torch.channels_last, 5: torch.channels_last_3d}
    if tensor.is_contiguous():
        return True
    layout = formats.get(tensor.dim())
    return layout is not None and tensor.is_contiguous(memory_format=layout)
