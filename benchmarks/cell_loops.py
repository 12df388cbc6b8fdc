"""RNN cells looped over time steps under tuned plans, on this CPU's disk tier: `nn.LSTMCell` and
`nn.GRUCell` (64 inputs, hidden 128, batch 256, 6 steps), each tuned at 60%, 75% and 90% of its
simulated peak and run three steps against plain ones. Each cell saves chunks of its gates, one
storage saved through several bases, which a step copies again once the plan has moved it out
(Note [A storage copied again keeps its place in the plan]). Records whether the steps were
bitwise and kept to their plans, the copies out a step against the plan's, and the growth of the
C heap in use over each step against the simulated growth.

    .venv/bin/python benchmarks/cell_loops.py [--json benchmarks/results/cell_loops_cpu.json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import tempfile
from typing import Any

import torch
from torch import nn

import lms
from lms.analysis import simulate, trace_step
from lms.harness.memory import PeakMemory
from lms.orchestration.local import local_device_spec

STEPS = 3


class CellLoop(nn.Module):
    """A cell over the time steps of a sequence, then a linear head on the last state."""

    def __init__(self, kind: str):
        super().__init__()
        self.cell = getattr(nn, kind)(64, 128)
        self.head = nn.Linear(128, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = c = torch.zeros(x.shape[1], 128)
        for t in range(x.shape[0]):
            if isinstance(self.cell, nn.LSTMCell):
                h, c = self.cell(x[t], (h, c))
            else:
                h = self.cell(x[t], h)
        return self.head(h)


def _step(model: nn.Module, batch: list[torch.Tensor]) -> torch.Tensor:
    loss = model(*batch).square().mean()
    loss.backward()
    return loss


def check(kind: str, share: int, spill_dir: str) -> dict[str, Any]:
    """Tune a ``kind`` loop at ``share`` percent; three steps against plain ones."""
    torch.manual_seed(0)
    model, x = CellLoop(kind), torch.randn(6, 256, 64)

    def run(ctx: Any = None) -> list[torch.Tensor]:
        model.zero_grad(set_to_none=True)
        with ctx if ctx is not None else contextlib.nullcontext():
            loss = _step(model, [x])
        return [loss.detach(), *(p.grad.clone() for p in model.parameters())]

    ref = run()
    offload = lms.LMS(budget=f"{share}%", min_offload_bytes=0, tier="disk", spill_dir=spill_dir)
    plan = offload.tune(model, [x], _step)
    bitwise, growth = True, []
    for _ in range(STEPS):
        with PeakMemory() as peak:
            got = run(offload)
        growth.append(peak.growth_bytes)
        bitwise = bitwise and all(torch.equal(a, b) for a, b in zip(ref, got, strict=True))
    trace = trace_step(model, [x], _step, device="cpu", min_offload_bytes=0)
    before = trace.param_bytes + trace.buffer_bytes + trace.input_bytes
    simulated = simulate(trace, plan, local_device_spec(torch.device("cpu")))
    stats = offload.stats
    offload.close()
    return {
        "cell": kind,
        "budget_share": share,
        "budget_bytes": offload.config.budget_bytes,
        "bitwise": bitwise and stats.replays_differed == 0,
        "diverged_steps": stats.diverged_steps,
        "plan_offload": len(plan.offload) if plan else 0,
        "plan_recompute": len(plan.recompute) if plan else 0,
        "copies_out_per_step": stats.offloaded_tensors / STEPS,
        "measured_growth_bytes": growth,
        "simulated_growth_bytes": simulated.peak_tensor_bytes - before,
        "simulated_peak_bytes": simulated.peak_bytes,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    results = []
    for kind in ("LSTMCell", "GRUCell"):
        for share in (60, 75, 90):
            with tempfile.TemporaryDirectory() as spill_dir:
                results.append(check(kind, share, spill_dir))
            print(json.dumps(results[-1]), flush=True)
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"torch": torch.__version__, "runs": results}, out, indent=1)
    if not all(r["bitwise"] and r["diverged_steps"] == 0 for r in results):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
