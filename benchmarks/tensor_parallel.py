"""CPU benchmark of tensor parallelism: the DTensors a step saves move by their local shards.

Two processes (gloo, one intra-op thread each) split a stack of transformer feed-forward blocks
(LayerNorm, 512 -> 2048 `ColwiseParallel`, GELU, 2048 -> 512 `RowwiseParallel`, residual) over
the same 2048 tokens. Each configuration runs in two fresh processes (a warm-up step, one step
whose growth of the C heap in use each rank samples, then ``--steps`` timed, their median kept:
Note [Steps timed without the sampler]), and the configurations alternate over ``--repeats``
rounds:
- plain: no offload;
- lms: ``LMS(budget=--budget, tier="disk")`` on each rank;
- save_on_cpu: ``torch.autograd.graph.save_on_cpu(pin_memory=True)``, the peer; its pack hook
  copies each saved tensor into a plain tensor of the same (global) shape, which a DTensor
  refuses, so the error is what it records.

It also counts what one step saves on a rank, by storage: how many bytes are plain tensors and how
many are DTensors' local shards (which the runtime kept whole before it moved subclasses by their
inner tensors). Goals: each rank's heap growth under LMS stays under the budget, less the weights
and the batch the budget also counts.

    python benchmarks/tensor_parallel.py [--repeats 3] [--steps 3] [--blocks 8] [--json PATH]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import tempfile
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import lms
from lms.core.units import format_bytes, parse_bytes
from lms.harness.memory import measure_steps, tensors_bytes

WORLD = 2
WIDTH = 512


class Feedforward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.up = nn.Linear(WIDTH, 4 * WIDTH)
        self.down = nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(nn.functional.gelu(self.up(self.norm(x))))


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _saved_by_kind(model: nn.Module, x: torch.Tensor) -> dict[str, int]:
    """Bytes of the distinct storages one step saves for backward, plain and inside DTensors
    (parameters and their views left out)."""
    fixed = {_local(p).untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, str] = {}  # storage address: plain or dtensor
    sizes: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        kind, local = "plain", tensor
        if isinstance(tensor, DTensor):
            kind, local = "dtensor", tensor.to_local()
        storage = local.untyped_storage()
        if type(tensor) is not nn.Parameter and storage.data_ptr() not in fixed:
            seen.setdefault(storage.data_ptr(), kind)
            sizes[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        model(x).square().mean().backward()
    model.zero_grad(set_to_none=True)
    return {
        kind: sum(sizes[ptr] for ptr, k in seen.items() if k == kind)
        for kind in ("plain", "dtensor")
    }


def _rank(rank: int, config: str, args: argparse.Namespace, folder: str) -> None:
    torch.set_num_threads(1)  # two processes on the machine's cores
    dist.init_process_group(
        "gloo", init_method=f"file://{folder}/rendezvous", rank=rank, world_size=WORLD
    )
    try:
        mesh = init_device_mesh("cpu", (WORLD,))
        torch.manual_seed(0)
        model = nn.Sequential(*(Feedforward() for _ in range(args.blocks)))
        for block in model:
            parallelize_module(block, mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
        x = torch.randn(args.tokens, WIDTH, generator=torch.Generator().manual_seed(1))
        start_bytes = tensors_bytes([*model.parameters(), x])  # DTensors by their shards
        saved = _saved_by_kind(model, x)
        offload = None
        if config == "lms":
            spill = os.path.join(folder, f"spill{rank}")
            os.mkdir(spill)
            offload = lms.LMS(budget=args.budget, tier="disk", spill_dir=spill, model=model)

        def step() -> None:
            model.zero_grad(set_to_none=True)
            if config == "save_on_cpu":
                context: Any = torch.autograd.graph.save_on_cpu(pin_memory=True)
            else:
                context = offload if offload is not None else contextlib.nullcontext()
            with context:
                model(x).square().mean().backward()

        result: dict[str, Any] = {"rank": rank}
        try:
            step()  # warm-up; under LMS, the recorded step
        except RuntimeError as error:  # the same op fails on every rank, so none waits
            result["error"] = f"{type(error).__name__}: {error}"
            with open(os.path.join(folder, f"rank{rank}.json"), "w") as out:
                json.dump(result, out)
            return
        # one step's memory sampled, the others timed (Note [Steps timed without the sampler])
        times, peak = measure_steps(step, args.steps)
        result |= {
            "step_s": statistics.median(times),
            "growth_bytes": peak.growth_bytes,
            "start_bytes": start_bytes,
            "saved_bytes": saved,
        }
        if offload is not None:
            result["stats"] = offload.stats.as_dict()
            offload.close()
        with open(os.path.join(folder, f"rank{rank}.json"), "w") as out:
            json.dump(result, out)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _run(config: str, args: argparse.Namespace) -> list[dict]:
    with tempfile.TemporaryDirectory() as folder:
        mp.spawn(_rank, args=(config, args, folder), nprocs=WORLD)
        results = []
        for rank in range(WORLD):
            with open(os.path.join(folder, f"rank{rank}.json")) as each:
                results.append(json.load(each))
        return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3, help="measured steps per run")
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--budget", default="128MiB", help="each rank's")
    parser.add_argument("--json", default="benchmarks/results/tensor_parallel_cpu.json")
    args = parser.parse_args()

    runs: dict[str, list[list[dict]]] = {"plain": [], "lms": []}
    peer = _run("save_on_cpu", args)
    print(f"save_on_cpu(pin_memory=True): {peer[0].get('error', 'ran')}", flush=True)
    for repeat in range(args.repeats):
        order = list(runs) if repeat % 2 == 0 else list(runs)[::-1]
        for config in order:
            ranks = _run(config, args)
            runs[config].append(ranks)
            print(
                f"[{repeat + 1}/{args.repeats}] {config:5s} "
                + "  ".join(
                    f"rank {r['rank']}: {r['step_s']:.3f} s, heap growth "
                    f"{format_bytes(r['growth_bytes'])}"
                    for r in ranks
                ),
                flush=True,
            )

    def median(config: str, key: str) -> float:
        return statistics.median(r[key] for ranks in runs[config] for r in ranks)

    first = runs["lms"][0][0]
    budget = parse_bytes(args.budget)
    summary = {
        "machine": f"{os.cpu_count()} CPU cores",
        "torch": torch.__version__,
        "blocks": args.blocks,
        "tokens": args.tokens,
        "budget_bytes": budget,
        "start_bytes": first["start_bytes"],
        "saved_bytes_per_rank": first["saved_bytes"],
        "plain_step_s": median("plain", "step_s"),
        "lms_step_s": median("lms", "step_s"),
        "slowdown": median("lms", "step_s") / median("plain", "step_s") - 1,
        "plain_growth_bytes": max(r["growth_bytes"] for ranks in runs["plain"] for r in ranks),
        "lms_growth_bytes": max(r["growth_bytes"] for ranks in runs["lms"] for r in ranks),
        "lms_offloaded_bytes_per_step": first["stats"]["offloaded_bytes"] / first["stats"]["steps"],
        "save_on_cpu": peer,
        "runs": runs,
    }
    room = budget - first["start_bytes"]
    print(
        f"saved per rank and step: {format_bytes(first['saved_bytes']['plain'])} plain, "
        f"{format_bytes(first['saved_bytes']['dtensor'])} in DTensors\n"
        f"heap growth, largest over ranks and runs: plain "
        f"{format_bytes(summary['plain_growth_bytes'])}, LMS "
        f"{format_bytes(summary['lms_growth_bytes'])} (budget {format_bytes(budget)} less "
        f"{format_bytes(first['start_bytes'])} of weights and batch: {format_bytes(room)})\n"
        f"step: plain {summary['plain_step_s']:.3f} s, LMS {summary['lms_step_s']:.3f} s "
        f"({summary['slowdown']:+.1%})"
    )
    os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
    with open(args.json, "w") as out:
        json.dump(summary, out, indent=2)


if __name__ == "__main__":
    main()
