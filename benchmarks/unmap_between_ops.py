"""Where a CPU step's frees of large storages fall: inside an op timed alone, between ops in a step.

glibc gives each allocation past its mmap threshold pages of its own and unmaps them when the
storage is freed. An op timed alone (`lms.orchestration.timing`) frees its output inside the timed
call; in a step the output lives on and is freed later, between ops, where a step record counts
it as the host's time between ops (Note [A step's time in parts]). Two measurements:
- a ReLU over a 64 MiB input, timed as the timing process times it (its output freed inside the
  timed call) and with its output kept until after the clock is read;
- a chain of eight Linear + ReLU pairs over 8192 rows, 1024 and 2048 wide (activations of 32 and
  64 MiB), recorded under a plan that moves nothing and replayed: the step's parts.

    python benchmarks/unmap_between_ops.py [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from typing import Any

import torch
import torch.nn as nn

import lms
from lms.core.steprecord import load_record
from lms.report.replay import replay


def _relu_timed() -> dict[str, float]:
    x = torch.randn(8192, 2048)
    op = torch.ops.aten.relu.default

    def freed_inside() -> float:
        start = time.perf_counter()
        op(x)  # freed before the clock is read, as `_one_run` times a call
        return time.perf_counter() - start

    def kept() -> float:
        start = time.perf_counter()
        out = op(x)
        took = time.perf_counter() - start
        del out
        return took

    result = {}
    for run in (freed_inside, kept):
        run()
        result[f"{run.__name__}_ms"] = min(run() for _ in range(10)) * 1e3
    return result


def _step(model: nn.Module, batch: list[torch.Tensor]) -> None:
    model(*batch).square().mean().backward()


def _chain_parts(width: int, folder: str) -> dict[str, Any]:
    torch.manual_seed(0)
    model = nn.Sequential(*[m for _ in range(8) for m in (nn.Linear(width, width), nn.ReLU())])
    batch = [torch.randn(8192, width)]
    offload = lms.LMS(budget="20GiB", cpu_resident=False, spill_dir=folder)
    offload.tune(model, batch, _step, cache_dir=folder)
    offload.record_steps("cpu")
    for _ in range(3):
        model.zero_grad(set_to_none=True)
        with offload:
            _step(model, batch)
    path = f"{folder}/chain_{width}.json.gz"
    offload.save_record(path)
    offload.close()
    result = replay(load_record(path))
    return {
        "activation_mib": 8192 * width * 4 / 2**20,
        "ops": result.trace_ops,
        "step_s": result.measured_step_s,
        "planned_step_s": result.planned_step_s,
        "parts": {
            p.part: {"measured_s": p.measured_s, "planned_s": p.planned_s} for p in result.parts
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    result: dict[str, Any] = {"torch": torch.__version__, "relu_64mib": _relu_timed()}
    print("ReLU over 64 MiB:", {k: round(v, 3) for k, v in result["relu_64mib"].items()})
    with tempfile.TemporaryDirectory(prefix="lms-unmap-") as folder:
        result["chains"] = [_chain_parts(width, folder) for width in (1024, 2048)]
    for chain in result["chains"]:
        between = chain["parts"]["between ops"]
        kernels = chain["parts"]["kernels"]
        print(
            f"chain of {chain['activation_mib']:.0f} MiB activations, {chain['ops']} ops: "
            f"between ops {between['measured_s']:.4f} s (priced {between['planned_s']:.4f}), "
            f"kernels {kernels['measured_s']:.4f} s (priced {kernels['planned_s']:.4f})"
        )
    if args.json:
        with open(args.json, "w") as out:
            json.dump(result, out, indent=2)


if __name__ == "__main__":
    main()
