"""The resident set against a CPU budget, with `LMSConfig.cpu_resident` on and off.

A torchvision ResNet50 (batch 2, 512 px, SGD with momentum) tuned for a 1 GiB budget on the disk
tier, five steps in a fresh process for each setting (the setting changes the C allocator for the
whole process: Note [The resident set follows the heap under a budget]). For each step: its time,
the peak growth of the heap in use and of the resident set over its start, and the resident set
after it over the first step's start; and the step time the tuned plan was predicted at. Writes
JSON.

    .venv/bin/python benchmarks/cpu_resident.py [--out benchmarks/results/cpu_resident.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
from typing import Any

import torch

STEPS = 5
BUDGET = "1GiB"
SIZE, BATCH = 512, 2

_CHILD = """
import json, sys, time, torch, torchvision, lms
from lms.harness.memory import PeakMemory
from lms.runtime.heap import current_rss_bytes
torch.manual_seed(0)
model = torchvision.models.resnet50()
size, batch, steps = (int(a) for a in sys.argv[3:6])
x, y = torch.randn(batch, 3, size, size), torch.randint(0, 1000, (batch,))
optimizer = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)

def step(m, b):
    loss = torch.nn.functional.cross_entropy(m(b[0]), b[1])
    loss.backward()
    return loss

offload = lms.LMS(budget=sys.argv[2], tier="disk", cpu_resident=sys.argv[1] == "on",
                  spill_dir=sys.argv[6])
plan = offload.tune(model, [x, y], step, cache_dir=None)
trace, spec, half = offload.priced_on
from lms.analysis import simulate
predicted = simulate(trace, plan, spec, half=half).step_s
start = current_rss_bytes()
rows = []
with PeakMemory() as whole:
    for _ in range(steps):
        optimizer.zero_grad(set_to_none=True)
        began = time.perf_counter()
        with PeakMemory() as memory:
            with offload:
                step(model, [x, y])
            optimizer.step()
        rows.append({"seconds": time.perf_counter() - began,
                     "heap_growth_bytes": memory.heap_growth_bytes,
                     "resident_growth_bytes": memory.rss_growth_bytes,
                     "resident_after_bytes": current_rss_bytes() - start})
print(json.dumps({"steps": rows, "peak_resident_growth_bytes": whole.rss_growth_bytes,
                  "offloaded": offload.stats.offloaded_tensors, "predicted_step_s": predicted}))
"""


def write_runs(path: str, model: str, budget: str, runs: dict[str, Any]) -> None:
    """Write a benchmark's runs, each in a process of its own, as JSON with the machine."""
    result = {
        "model": model,
        "budget": budget,
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs",
        "torch": torch.__version__,
        "runs": runs,
    }
    with open(path, "w") as handle:
        json.dump(result, handle, indent=1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results/cpu_resident.json")
    args = parser.parse_args()
    runs = {}
    for setting in ("on", "off"):
        with tempfile.TemporaryDirectory() as spill:
            done = subprocess.run(
                [sys.executable, "-c", _CHILD, setting, BUDGET, str(SIZE), str(BATCH)]
                + [str(STEPS), spill],
                capture_output=True,
                text=True,
                check=True,
            )
        runs[f"cpu_resident_{setting}"] = json.loads(done.stdout.strip().splitlines()[-1])
    write_runs(args.out, f"resnet50 batch {BATCH} {SIZE}px, SGD momentum, disk tier", BUDGET, runs)
    for name, run in runs.items():
        steady = run["steps"][1:]
        print(
            f"{name}: steady step {sum(s['seconds'] for s in steady) / len(steady):.2f} s; "
            f"heap growth {max(s['heap_growth_bytes'] for s in steady) / 2**20:.0f} MiB; "
            f"resident set peak growth {run['peak_resident_growth_bytes'] / 2**20:.0f} MiB; "
            f"predicted step {run['predicted_step_s']:.2f} s"
        )


if __name__ == "__main__":
    main()
