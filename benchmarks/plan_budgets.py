"""How good a plan each planner finds for language models across budgets, and how long it takes:
GPT-2 medium (batch 12, sequence 1024, fp32) at 12, 24 and 48 layers at 50%, 60% and 70% of its
peak, and the Llama-3-8B shape (sequence 8192, bf16 autocast) at 70% and 80%, against the H100
spec, planned by `plan_auto` and by `plan_milp` on one trace of each model (the models of
`benchmarks/tune_time.py`). Writes each plan's predicted overhead, what it offloads and
recomputes, and the seconds it took, as JSON.

    .venv/bin/python benchmarks/plan_budgets.py [--out benchmarks/results/plan_budgets_cpu.json]
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch
from tune_time import PLANNERS, _half_step, _lm_step, gpt2_medium, llama_shape, write_rows

from lms.analysis import device_spec, simulate, trace_step


def _models() -> list[tuple[str, Any, torch.Tensor, Any, tuple[float, ...], bool]]:
    found = []
    for layers in (12, 24, 48):
        build, ids = gpt2_medium(layers)
        found.append((f"gpt2-medium-{layers}", build, ids, _lm_step, (0.5, 0.6, 0.7), False))
    build, ids = llama_shape()
    found.append(("llama-3-8b-shape", build, ids, _half_step, (0.7, 0.8), True))
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="benchmarks/results/plan_budgets_cpu.json")
    args = parser.parse_args()
    spec = device_spec("h100")
    rows = []
    for name, build, ids, step, fractions, half in _models():
        autocast = torch.bfloat16 if half else None
        trace = trace_step(build, [ids], step, device="cpu", autocast=autocast)
        plain = simulate(trace, None, spec, half=half)
        for fraction in fractions:
            for planner, choose in PLANNERS.items():
                start = time.perf_counter()
                plan = choose(trace, spec, int(plain.peak_bytes * fraction), half=half)
                seconds = time.perf_counter() - start
                rows.append(
                    {
                        "model": name,
                        "fraction": fraction,
                        "planner": planner,
                        "plan_s": seconds,
                        "predicted_overhead": plan.predicted_overhead,
                        "offloaded": len(plan.offload),
                        "recomputed": len(plan.recompute),
                    }
                )
                print(
                    f"{name} at {fraction:.0%}, {planner}: {plan.predicted_overhead:+.1%} "
                    f"({len(plan.offload)} offloaded, {len(plan.recompute)} recomputed) "
                    f"in {seconds:.1f} s",
                    flush=True,
                )
    write_rows(args.out, "h100-80gb", rows)


if __name__ == "__main__":
    main()
