"""How long the per-tensor planner takes on convolutional networks, and what it finds: the zoo's
ResNet50, GoogLeNet and 3D U-Net (the cases of `benchmarks/planners.py`), seven torchvision
networks at batches that need offload and MONAI's SegResNet (group norms, trilinear upsampling),
each traced once (fake tensors) and planned by `plan_auto` at fractions of its peak without
offload (EfficientNet-B7 and DenseNet-201 at a fixed 24 and 12 GiB) against the V100 or H100
spec. Writes each plan's predicted overhead, what it moves, the simulations it took and the
seconds, as JSON.

    .venv/bin/python benchmarks/planner_cnns.py [--out benchmarks/results/planner_cnns_cpu.json]
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from tune_time import write_rows  # beside this file

from lms.analysis import device_spec, simulate, trace_step
from lms.harness.zoo import zoo_model
from lms.planning import plan_auto
from lms.planning.candidates import Candidates

CASES = (
    ("efficientnet_b7", 600, 16, "h100", (24 * 2**30,)),
    ("resnet50", 2000, 1, "v100", (0.7, 0.5, 0.35)),
    ("googlenet", 2000, 1, "v100", (0.7, 0.5, 0.35)),
    ("unet3d", 128, 1, "v100", (0.7, 0.5)),
    ("densenet121", 512, 32, "v100", (0.6, 0.4)),
    ("convnext_tiny", 512, 16, "v100", (0.6, 0.4)),
    ("mobilenet_v3_large", 1024, 16, "v100", (0.5,)),
    ("swin_t", 448, 16, "v100", (0.5,)),
    ("regnet_y_1_6gf", 768, 16, "v100", (0.5,)),
    ("densenet201", 512, 32, "h100", (12 * 2**30,)),
    ("monai.networks.nets:SegResNet", 256, 1, "h100", (0.5, 0.35)),
)
"""(model, size, batch, spec, budgets): a budget below 1 is a fraction of the plain peak."""


def _counting() -> list[int]:
    """A counter of the simulations every `Candidates` runs from now on."""
    count = [0]
    run = Candidates.run

    def counted(self: Candidates, plan):  # type: ignore[no-untyped-def]
        before = self.simulations
        result = run(self, plan)
        count[0] += self.simulations - before
        return result

    Candidates.run = counted  # type: ignore[method-assign]
    return count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="benchmarks/results/planner_cnns_cpu.json")
    args = parser.parse_args()
    count = _counting()
    rows = []
    for name, size, batch, spec_name, budgets in CASES:
        entry = zoo_model(name)
        torch.manual_seed(0)
        trace = trace_step(entry.build, entry.make_batch(size, batch), entry.step_fn, device="cpu")
        spec = device_spec(spec_name)
        plain = simulate(trace, None, spec)
        for share in budgets:
            budget = int(share * plain.peak_bytes) if share < 1 else int(share)
            count[0] = 0
            start = time.perf_counter()
            plan = plan_auto(trace, spec, budget)
            row = {
                "model": name,
                "size": size,
                "batch": batch,
                "spec": spec.name,
                "ops": len(trace.ops),
                "saved_storages": len(trace.entries()),
                "budget": share,
                "budget_bytes": budget,
                "plan_s": time.perf_counter() - start,
                "simulations": count[0],
                "predicted_overhead": plan.predicted_overhead,
                "offloaded": len(plan.offload),
                "recomputed": len(plan.recompute),
            }
            rows.append(row)
            print(json.dumps(row), flush=True)
    write_rows(args.out, "per case", rows)


if __name__ == "__main__":
    main()
