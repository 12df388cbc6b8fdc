"""How long planning a language model takes on this machine, against an H100 spec: trace with fake
tensors, simulate without offload, then `plan_auto` for a fraction of the plain peak.

Hugging Face GPT-2 medium (hidden 1024, 16 heads, batch 12, sequence 1024, fp32,
``labels=input_ids``) at 12, 24 and 48 layers, at 60% of its peak; and a Llama-3-8B-shaped model
(32 layers, hidden 4096, 32 heads with 8 KV heads, intermediate 14336, sequence 8192, batch 1,
bfloat16 autocast) at 70%. Random weights, built under fake tensors: nothing is downloaded and
no real memory is taken. Attention and dropout are traced as the card's kernels run them, as
`lms analyze` does for a GPU's spec (Note [A card's attention and dropout, traced on a CPU]).
Each case runs three times; writes the medians and each run's total as JSON. ``--planner milp``
plans with the mixed-integer program (`lms.planning.milp`) in place of `plan_auto`, on the same
traces.

    .venv/bin/python benchmarks/tune_time.py [--out benchmarks/results/tune_time_cpu.json]
    .venv/bin/python benchmarks/tune_time.py --planner milp \
        --out benchmarks/results/tune_time_milp_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from typing import Any

import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

from lms.analysis import device_spec, simulate, trace_step
from lms.planning import plan_auto
from lms.planning.blocks import repeats
from lms.planning.milp import plan_milp

REPEATS = 3
"""Each model is traced and planned this many times; the medians are reported, with every
run's total (the first in a process pays one-time imports and caches)."""


def _lm_step(model: torch.nn.Module, batch: Any) -> torch.Tensor:
    out = model(input_ids=batch[0], labels=batch[0])
    out.loss.backward()
    return out.loss


def _half_step(model: torch.nn.Module, batch: Any) -> torch.Tensor:
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(input_ids=batch[0], labels=batch[0])
    out.loss.backward()
    return out.loss


def gpt2_medium(layers: int) -> tuple[Any, torch.Tensor]:
    """A builder of GPT-2 medium with ``layers`` layers (random weights), and a batch of 12
    sequences of 1024 tokens."""
    config = GPT2Config(n_layer=layers, n_embd=1024, n_head=16, n_positions=1024)
    return lambda: GPT2LMHeadModel(config), torch.randint(0, config.vocab_size, (12, 1024))


def llama_shape() -> tuple[Any, torch.Tensor]:
    """A builder of the Llama-3-8B shape (random weights), and one sequence of 8192 tokens."""
    config = LlamaConfig(
        num_hidden_layers=32,
        hidden_size=4096,
        num_attention_heads=32,
        num_key_value_heads=8,
        intermediate_size=14336,
        max_position_embeddings=8192,
        vocab_size=128256,
    )
    return lambda: LlamaForCausalLM(config), torch.randint(0, config.vocab_size, (1, 8192))


PLANNERS = {"auto": plan_auto, "milp": plan_milp}


def _case(
    name: str,
    build: Any,
    ids: torch.Tensor,
    step: Any,
    fraction: float,
    half: bool,
    planner: str = "auto",
    runs: int = REPEATS,
):
    spec = device_spec("h100")
    traced, planned = [], []
    autocast = torch.bfloat16 if half else None
    for _ in range(runs):
        start = time.perf_counter()
        trace = trace_step(build, [ids], step, device="cpu", autocast=autocast, card_kernels=True)
        traced.append(time.perf_counter() - start)
        plain = simulate(trace, None, spec, half=half)
        budget = int(plain.peak_bytes * fraction)
        start = time.perf_counter()
        plan = PLANNERS[planner](trace, spec, budget, half=half)
        planned.append(time.perf_counter() - start)
    tuned = sorted(t + p for t, p in zip(traced, planned, strict=True))
    row = {
        "model": name,
        "ops": len(trace.ops),
        "saved_storages": len(trace.entries()),
        "entries_per_role": repeats(trace),
        "plain_peak_bytes": plain.peak_bytes,
        "budget_bytes": budget,
        "fraction": fraction,
        "trace_s": statistics.median(traced),
        "plan_s": statistics.median(planned),
        "tune_s": statistics.median(tuned),
        "tune_s_runs": tuned,
        "planner": plan.source,
        "predicted_overhead": plan.predicted_overhead,
        "offloaded": len(plan.offload),
        "recomputed": len(plan.recompute),
    }
    print(
        f"{name}: {row['ops']} ops, {row['saved_storages']} saved; trace {row['trace_s']:.1f} s, "
        f"plan {row['plan_s']:.2f} s (tune {tuned[0]:.1f} to {tuned[-1]:.1f} s) at "
        f"{fraction:.0%} of {plain.peak_bytes / 2**30:.1f} GiB: "
        f"{plan.predicted_overhead:+.1%} predicted",
        flush=True,
    )
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="benchmarks/results/tune_time_cpu.json")
    parser.add_argument("--planner", choices=sorted(PLANNERS), default="auto")
    parser.add_argument("--repeats", type=int, default=REPEATS, help="runs of each case")
    parser.add_argument("--models", default="gpt2-medium-12,gpt2-medium-24,gpt2-medium-48,llama")
    args = parser.parse_args()
    wanted = set(args.models.split(","))
    rows = []
    for layers in (12, 24, 48):
        if f"gpt2-medium-{layers}" in wanted:
            build, ids = gpt2_medium(layers)
            case = (f"gpt2-medium-{layers}", build, ids, _lm_step, 0.6, False)
            rows.append(_case(*case, args.planner, args.repeats))
    if "llama" in wanted:
        build, ids = llama_shape()
        case = ("llama-3-8b-shape", build, ids, _half_step, 0.7, True)
        rows.append(_case(*case, args.planner, args.repeats))
    write_rows(args.out, "h100-80gb", rows, planner=args.planner)


def write_rows(path: str, spec: str, rows: list[dict[str, Any]], **extra: Any) -> None:
    """Write a planning benchmark's rows as JSON, with the machine and the spec."""
    result = {
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}",
        "spec": spec,
        **extra,
        "rows": rows,
    }
    with open(path, "w") as handle:
        json.dump(result, handle, indent=1)


if __name__ == "__main__":
    main()
