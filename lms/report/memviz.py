"""Export a simulation as a snapshot that pytorch.org/memory_viz opens (and as JSON).

The viewer reads a pickled dict ``{"segments": [...], "device_traces": [[entry, ...]]}`` whose
trace entries are ``{"action", "addr", "size", "stream", "time_us", "frames", "category"}``
with actions ``alloc``, ``free_requested`` and ``free_completed``.
"""

from __future__ import annotations

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


def snapshot_dict(trace: Trace, result: SimResult) -> dict[str, Any]:
    """The snapshot as a plain dict: one synthetic address per resident interval."""
    entries: list[tuple[float, int, dict[str, Any]]] = []
    address = 0x7F0000000000
    for order, span in enumerate(result.intervals):
        size = -(-span.nbytes // 512) * 512
        name = f"storage {span.storage}" if span.storage >= 0 else _UNSTORED[span.kind]
        frames = [{"filename": trace.name, "line": 0, "name": name}]
        common = {
            "addr": address,
            "size": size,
            "stream": 0,
            "frames": frames,
            "category": _CATEGORIES.get(span.kind, "unknown"),
        }
        entries.append((span.start_s, 2 * order + 1, {"action": "alloc", **common}))
        for action in ("free_requested", "free_completed"):
            entries.append((span.end_s, 2 * order, {"action": action, **common}))
        address += size
    entries.sort(key=lambda item: (item[0], item[1]))
    trace_entries = []
    for time_s, _, entry in entries:
        entry["time_us"] = int(time_s * 1e6)
        trace_entries.append(entry)
    # The viewer wants a category named 'unknown' to exist whenever entries carry categories.
    if not any(e["category"] == "unknown" for e in trace_entries) and trace_entries:
        probe = dict(trace_entries[-1], action="alloc", size=0, category="unknown")
        trace_entries.append(probe)
        trace_entries.append(dict(probe, action="free_completed"))
    return {"segments": [], "device_traces": [trace_entries]}


def save_snapshot(path: str | os.PathLike[str], trace: Trace, result: SimResult) -> None:
    """Write the snapshot: pickle (protocol 4) for the viewer, or JSON when ``path`` ends .json."""
    data = snapshot_dict(trace, result)
    if str(path).endswith(".json"):
        with open(path, "w") as handle:
            json.dump(data, handle)
        return
    with open(path, "wb") as handle:
        pickle.dump(data, handle, protocol=4)
