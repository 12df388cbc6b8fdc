"""On a GPU: which allocator blocks are live at the peak of a step that follows a plan, beside
the simulator's tensor peak for the same plan.

The step is `tests/gpu/test_cuda.py`'s 5% check: eight ``Linear(1024, 1024)`` and GELU layers
at batch 8192 under a 1 GiB budget, whose plan offloads and recomputes. The second step runs
with the CUDA allocator's history recorded (Python stacks), and the blocks live when the
allocations of the step peaked are grouped by size and by the first frames outside PyTorch
that made them: what the measured peak holds that the simulation does not.

    python benchmarks/peak_blocks.py [--json PATH]
"""

from __future__ import annotations

import argparse
import collections
import json
from typing import Any

import torch
import torch.nn as nn

import lms
from lms.analysis import simulate, trace_step
from lms.orchestration.local import local_device_spec


def _step(model: nn.Module, batch: list[torch.Tensor]) -> torch.Tensor:
    loss = model(*batch).square().mean()
    loss.backward()
    return loss


def _made_by(event: dict[str, Any]) -> str:
    """The first frames of an allocation outside PyTorch's own Python (autograd's kept)."""
    frames = [
        f
        for f in event.get("frames", [])
        if "/torch/" not in f["filename"] or "autograd" in f["filename"]
    ]
    return " <- ".join(f"{f['filename'].rsplit('/', 1)[-1]}:{f['line']}" for f in frames[:4])


def live_at_peak(trace: list[dict[str, Any]]) -> tuple[int, list[dict[str, Any]]]:
    """The most bytes the allocations of ``trace`` (a device's history) held at once, counted
    from its start, and the allocations live then."""
    live: dict[int, dict[str, Any]] = {}
    held = most = 0
    at_most: list[dict[str, Any]] = []
    for event in trace:
        if event["action"] == "alloc":
            live[event["addr"]] = event
            held += event["size"]
            if held > most:
                most, at_most = held, list(live.values())
        elif event["action"] == "free_requested":
            gone = live.pop(event["addr"], None)
            if gone is not None:
                held -= gone["size"]
    return most, at_most


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args()
    torch.manual_seed(0)
    layers = [m for _ in range(8) for m in (nn.Linear(1024, 1024), nn.GELU())]
    model = nn.Sequential(*layers).cuda()
    x = torch.randn(8192, 1024, device="cuda")
    offload = lms.LMS(budget="1GiB")
    plan = offload.tune(model, [x], _step)
    trace = trace_step(model, [x], _step, device="cuda")
    sim = simulate(trace, plan, local_device_spec(torch.device("cuda")))
    steps = []
    for recorded in (False, True):
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        if recorded:
            torch.cuda.memory._record_memory_history(stacks="python", max_entries=100_000)
        with offload:
            _step(model, [x])
        torch.cuda.synchronize()
        steps.append({"start_bytes": before, "peak_bytes": torch.cuda.max_memory_allocated()})
    snapshot = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    most, live = live_at_peak(snapshot["device_traces"][0])
    groups: collections.Counter[tuple[int, str]] = collections.Counter(
        (event["size"], _made_by(event)) for event in live
    )
    result = {
        "gpu": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "plan": {
            "offload": list(plan.offload),
            "recompute": list(plan.recompute),
            "sync_mode": plan.sync_mode,
        },
        "simulated_peak_tensor_bytes": sim.peak_tensor_bytes,
        "steps": steps,
        "recorded_peak_growth_bytes": most,
        "live_at_peak": [
            {"count": n, "bytes": size, "made_by": where}
            for (size, where), n in sorted(groups.items(), key=lambda kv: -kv[0][0] * kv[1])
        ],
    }
    print(json.dumps(result, indent=2))
    if args.json:
        with open(args.json, "w") as out:
            json.dump(result, out, indent=2)


if __name__ == "__main__":
    main()
