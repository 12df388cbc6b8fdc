"""Export a simulation as a snapshot that pytorch.org/memory_viz opens (and as JSON).

The viewer reads a pickled dict ``{"segments": [...], "device_traces": [[entry, ...]]}`` whose
trace entries are ``{"action", "addr", "size", "stream", "time_us", "frames", "category"}``
with actions ``alloc``, ``free_requested`` and ``free_completed``.
"""

from __future__ import annotations

import bisect
import json
import os
import pickle
from typing import Any

from lms.analysis.simulate import SimResult
from lms.core.records import Trace

__all__ = ["snapshot_dict", "save_snapshot"]

_CATEGORIES = {
    "param": "parameter",
    "buffer": "parameter",
    "input": "input",
    "activation": "activation",
    "reloaded": "activation",
    "recomputed": "activation",
    "gradient": "gradient",
    "state": "optimizer_state",
    "scratch": "temporary",
    "graph": "autograd_detail",
}


_UNSTORED = {"scratch": "an op's scratch", "graph": "the autograd graph"}


# Note: [A snapshot the viewer can replay]
# pytorch.org/memory_viz draws its timelines from the trace's events and its allocator views from
# the segments, the allocator's state when the snapshot was taken, replaying the events backward
# from there. So the export places each resident interval at an address, first fit into the holes
# earlier frees left (a caching allocator that never returns memory), and gives one segment, as
# large as the highest address used, whose blocks are what is still allocated at the end of the
# step; the rest of it is free. Each allocation's frame names the op that made the storage, its
# index in the step and the module running it, where the viewer shows a Python stack.


def _frames(trace: Trace, storage: int, kind: str) -> list[dict[str, Any]]:
    """The allocation's frame: the op that made the storage and its module."""
    if storage < 0:
        return [{"filename": trace.name, "line": 0, "name": _UNSTORED[kind]}]
    record = trace.storages[storage]
    what = f"storage {storage} ({record.kind}{'' if kind in ('', record.kind) else ', ' + kind})"
    if record.alloc_op < 0:
        return [{"filename": trace.name, "line": 0, "name": f"{what}, before the step"}]
    op = trace.ops[record.alloc_op]
    return [{"filename": op.module, "line": op.index, "name": f"{op.name}: {what}"}]


class _FirstFit:
    """Addresses for allocations: the lowest hole that fits, else the top."""

    def __init__(self, base: int):
        self.base = base
        self.top = base
        self.holes: list[list[int]] = []  # [address, size], by address

    def take(self, size: int) -> int:
        for hole in self.holes:
            if hole[1] >= size:
                address = hole[0]
                hole[0] += size
                hole[1] -= size
                if not hole[1]:
                    self.holes.remove(hole)
                return address
        address, self.top = self.top, self.top + size
        return address

    def give(self, address: int, size: int) -> None:
        bisect.insort(self.holes, [address, size])
        merged: list[list[int]] = []
        for hole in self.holes:
            if merged and merged[-1][0] + merged[-1][1] == hole[0]:
                merged[-1][1] += hole[1]
            else:
                merged.append(hole)
        self.holes = merged


def snapshot_dict(trace: Trace, result: SimResult) -> dict[str, Any]:
    """The snapshot as a plain dict (Note [A snapshot the viewer can replay])."""
    spans = [(span, -(-span.nbytes // 512) * 512) for span in result.intervals if span.nbytes > 0]
    # Events in time order; at one time frees before allocations, so that memory is reused.
    order = sorted(
        [(span.start_s, 1, i) for i, (span, _) in enumerate(spans)]
        + [(span.end_s, 0, i) for i, (span, _) in enumerate(spans)]
    )
    memory = _FirstFit(0x7F0000000000)
    address: dict[int, int] = {}
    events: list[dict[str, Any]] = []
    alive: set[int] = set()
    end_s = max((span.end_s for span, _ in spans), default=0.0)
    for time_s, allocating, i in order:
        span, size = spans[i]
        common = {
            "size": size,
            "stream": 0,
            "frames": _frames(trace, span.storage, span.kind),
            "category": _CATEGORIES.get(span.kind, "unknown"),
            "time_us": int(time_s * 1e6),
        }
        if allocating:
            address[i] = memory.take(size)
            alive.add(i)
            events.append({"action": "alloc", "addr": address[i], **common})
        elif span.end_s < end_s or span.storage < 0:  # what outlives the step stays allocated
            if i not in address:
                continue
            alive.discard(i)
            for action in ("free_requested", "free_completed"):
                events.append({"action": action, "addr": address[i], **common})
            memory.give(address[i], size)
    # The viewer wants a category named 'unknown' to exist whenever entries carry categories.
    if events and not any(e["category"] == "unknown" for e in events):
        probe = dict(events[-1], action="alloc", addr=memory.top, size=0, category="unknown")
        events += [probe, dict(probe, action="free_completed")]
    return {"segments": _segments(memory, spans, address, alive), "device_traces": [events]}


def _segments(
    memory: _FirstFit, spans: list[Any], address: dict[int, int], alive: set[int]
) -> list[dict[str, Any]]:
    """One segment over every address used, its blocks what is allocated at the end."""
    total = memory.top - memory.base
    if not total:
        return []
    blocks: list[dict[str, Any]] = []
    at = memory.base
    for i in sorted(alive, key=address.__getitem__):
        span, size = spans[i]
        if address[i] > at:
            blocks.append(
                {
                    "address": at,
                    "size": address[i] - at,
                    "requested_size": 0,
                    "state": "inactive",
                    "frames": [],
                }
            )
        blocks.append(
            {
                "address": address[i],
                "size": size,
                "requested_size": size,
                "state": "active_allocated",
                "frames": [],
            }
        )
        at = address[i] + size
    if at < memory.top:
        blocks.append(
            {
                "address": at,
                "size": memory.top - at,
                "requested_size": 0,
                "state": "inactive",
                "frames": [],
            }
        )
    allocated = sum(b["size"] for b in blocks if b["state"] == "active_allocated")
    return [
        {
            "device": 0,
            "address": memory.base,
            "total_size": total,
            "allocated_size": allocated,
            "active_size": allocated,
            "requested_size": allocated,
            "stream": 0,
            "segment_type": "large",
            "is_expandable": False,
            "frames": [],
            "blocks": blocks,
        }
    ]


def save_snapshot(path: str | os.PathLike[str], trace: Trace, result: SimResult) -> None:
    """Write the snapshot: pickle (protocol 4) for the viewer, or JSON when ``path`` ends .json."""
    data = snapshot_dict(trace, result)
    if str(path).endswith(".json"):
        with open(path, "w") as handle:
            json.dump(data, handle)
        return
    with open(path, "wb") as handle:
        pickle.dump(data, handle, protocol=4)
