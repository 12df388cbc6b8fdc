"""A compiled model under a budget: compiled whole, compiled block by block, and eager.

A torchvision ResNet18 (10 classes, batch 32, 160 px) tuned by `LMS.tune` for 70% of its
simulated peak without offload, on the CPU's disk tier, three steps in a fresh process for each
way of running it (inductor's compiled code, and glibc's allocator setting, are the process's).
For each step: its time and the peak growth of the C heap in use over its start; with the bytes
the step starts from (weights, buffers, batch), the budget, the plan's predicted peak, and the
steps that left their plan (Note [A compiled graph saves when it ends] in
`lms/orchestration/tuning.py`). Writes JSON.

    .venv/bin/python benchmarks/compiled_budget.py [--out PATH]  # compiled_budget_cpu.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile

from cpu_resident import write_runs  # beside this file

STEPS = 3
SIZE, BATCH, SHARE = 160, 32, "70%"
MODES = ("eager", "blocks", "whole")

_CHILD = """
import json, sys, time, torch, torchvision, lms
from lms.harness.memory import PeakMemory, tensors_bytes
mode, size, batch, share, steps, spill = sys.argv[1], *map(int, sys.argv[2:4]), *sys.argv[4:]
steps = int(steps)
torch.manual_seed(0)
model = torchvision.models.resnet18(num_classes=10)
x, y = torch.randn(batch, 3, size, size), torch.randint(0, 10, (batch,))
if mode == "blocks":
    for layer in (model.layer1, model.layer2, model.layer3, model.layer4):
        for block in layer:
            block.compile()
elif mode == "whole":
    model = torch.compile(model)

def step(m, b):
    loss = torch.nn.functional.cross_entropy(m(b[0]), b[1])
    loss.backward()
    return loss

offload = lms.LMS(budget=share, tier="disk", spill_dir=spill)
plan = offload.tune(model, [x, y], step, cache_dir=None)
start = tensors_bytes([*model.parameters(), *model.buffers(), x, y])
rows = []
for _ in range(steps):
    began = time.perf_counter()
    with PeakMemory() as memory:
        with offload:
            step(model, [x, y])
    rows.append({"seconds": time.perf_counter() - began,
                 "heap_growth_bytes": memory.heap_growth_bytes})
    for p in model.parameters():
        p.grad = None
print(json.dumps({"steps": rows, "start_bytes": start, "budget_bytes": offload.config.budget_bytes,
                  "predicted_peak_bytes": plan.predicted_peak_bytes,
                  "diverged_steps": offload.stats.diverged_steps}))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results/compiled_budget_cpu.json")
    args = parser.parse_args()
    runs = {}
    for mode in MODES:
        with tempfile.TemporaryDirectory() as spill:
            done = subprocess.run(
                [sys.executable, "-c", _CHILD, mode, str(SIZE), str(BATCH), SHARE, str(STEPS)]
                + [spill],
                capture_output=True,
                text=True,
                check=True,
            )
        runs[mode] = json.loads(done.stdout.strip().splitlines()[-1])
    model = f"resnet18 10 classes, batch {BATCH}, {SIZE}px, disk tier"
    write_runs(args.out, model, f"{SHARE} of the simulated peak without offload", runs)
    for mode, run in runs.items():
        peak = run["start_bytes"] + max(s["heap_growth_bytes"] for s in run["steps"][1:])
        budget, predicted = run["budget_bytes"] / 2**20, run["predicted_peak_bytes"] / 2**20
        print(
            f"{mode}: peak {peak / 2**20:.1f} MiB against a budget of {budget:.1f} MiB "
            f"(predicted {predicted:.1f}); "
            f"{run['diverged_steps']} of {STEPS} steps left their plan; steady step "
            f"{sum(s['seconds'] for s in run['steps'][1:]) / (STEPS - 1):.2f} s"
        )


if __name__ == "__main__":
    main()
