"""What recording a step costs: ResNet50 steps with and without `--record`, no offload and LMS,
in turns within one process so that both see the same machine.

    python benchmarks/record_overhead.py --json benchmarks/results/record_overhead_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile

import torch

from lms.harness.train import train


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", required=True)
    parser.add_argument("--size", type=int, default=320)
    parser.add_argument("--budget", default="250MiB")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    times: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory() as folder:
        record = os.path.join(folder, "steps.json.gz")
        for _ in range(args.rounds):
            for method, budget in (("none", None), ("lms", args.budget)):
                for recorded in (False, True):
                    result = train(
                        "resnet50",
                        size=args.size,
                        steps=4,
                        method=method,
                        budget=budget,
                        progress=False,
                        record=record if recorded else None,
                    )
                    key = f"{method}_{'recorded' if recorded else 'plain'}"
                    times.setdefault(key, []).append(result.step_s)
    medians = {key: statistics.median(values) for key, values in times.items()}
    summary = {
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
        "threads": torch.get_num_threads(),
        "model": f"resnet50 {args.size} px, batch 1",
        "step_s": times,
        "median_step_s": medians,
        "recording_slowdown": {
            method: medians[f"{method}_recorded"] / medians[f"{method}_plain"] - 1
            for method in ("none", "lms")
        },
    }
    print(json.dumps(summary["recording_slowdown"]))
    with open(args.json, "w") as handle:
        json.dump(summary, handle, indent=1)


if __name__ == "__main__":
    main()
