"""The default planner (`plan_auto`) beside the mixed-integer one (`plan_milp`) on the seed's
convolutional cases, against the V100 spec: predicted overhead and planning time at a few
fractions of each step's peak without offload. Traces are taken once (fake tensors); each
planner then plans the same trace. Writes JSON.

    .venv/bin/python benchmarks/planners.py [--out benchmarks/results/planners_cpu.json]
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from tune_time import write_rows  # beside this file

from lms.analysis import device_spec, simulate, trace_step
from lms.harness.zoo import zoo_model
from lms.planning import plan_auto, plan_milp

CASES = (("resnet50", 2000), ("googlenet", 2000), ("unet3d", 128))
FRACTIONS = (0.7, 0.5, 0.35)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="benchmarks/results/planners_cpu.json")
    args = parser.parse_args()
    spec = device_spec("v100")
    rows = []
    for name, size in CASES:
        entry = zoo_model(name)
        torch.manual_seed(0)
        trace = trace_step(entry.build, entry.make_batch(size, 1), entry.step_fn, device="cpu")
        plain = simulate(trace, None, spec)
        for fraction in FRACTIONS:
            budget = int(plain.peak_bytes * fraction)
            row: dict = {"model": name, "size": size, "fraction": fraction, "budget_bytes": budget}
            for label, planner in (("auto", plan_auto), ("milp", plan_milp)):
                start = time.perf_counter()
                try:
                    plan = planner(trace, spec, budget)
                except Exception as error:  # the floor: no plan fits
                    row[label] = {"error": f"{type(error).__name__}"}
                    continue
                row[label] = {
                    "plan_s": time.perf_counter() - start,
                    "predicted_overhead": plan.predicted_overhead,
                    "offloaded": len(plan.offload),
                    "recomputed": len(plan.recompute),
                }
            rows.append(row)
            print(json.dumps(row), flush=True)
    write_rows(args.out, spec.name, rows)


if __name__ == "__main__":
    main()
