"""What the runtime's hooks cost per saved tensor, where compute is small enough to show it.

A 100-block MLP (``Linear(64, 64)``, ReLU) at batch 64 saves 300 tensors a step and computes for
about 25 ms on a 2-core CPU. Each configuration runs ``--steps`` steps in a round, the rounds
alternate the configurations, and the median step time of each is compared with the plain step:
- plain: no hooks;
- identity hooks: ``saved_tensors_hooks`` that return what they get (the floor of any hook);
- lms, light: a tuned plan that moves nothing, so steps after the first run light;
- lms, full: a plan that offloads one small storage, so every step keeps its books in full.

    python benchmarks/hook_overhead.py [--rounds 7] [--steps 10] [--json PATH]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import tempfile
import time
from collections.abc import Callable

import torch
import torch.nn as nn

import lms
from lms.core.plan import Plan


def _step(model: nn.Module, batch: list[torch.Tensor]) -> torch.Tensor:
    loss = model(*batch).square().mean()
    loss.backward()
    return loss


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="lms-hooks-") as spill:  # the plan cache, too
        result = _measure(spill, rounds=args.rounds, steps=args.steps)
    if args.json:
        with open(args.json, "w") as out:
            json.dump(result, out, indent=2)


def _measure(spill: str, *, rounds: int, steps: int) -> dict[str, object]:
    torch.manual_seed(0)
    model = nn.Sequential(*[m for _ in range(100) for m in (nn.Linear(64, 64), nn.ReLU())])
    batch = [torch.randn(64, 64)]
    light = lms.LMS(budget="1GiB", min_offload_bytes=0, spill_dir=spill)
    plan = light.tune(model, batch, _step, cache_dir=spill)
    assert not plan.offload, "a roomy budget should move nothing"
    one = Plan(fingerprint="one", offload=(0,), num_entries=plan.num_entries)
    full = lms.LMS(plan=one, min_offload_bytes=0, spill_dir=spill)

    def under(ctx: Callable[[], contextlib.AbstractContextManager[object]]) -> Callable[[], None]:
        def run() -> None:
            model.zero_grad(set_to_none=True)
            with ctx():
                _step(model, batch)

        return run

    configs = {
        "plain": under(contextlib.nullcontext),
        "identity hooks": under(
            lambda: torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)
        ),
        "lms, light": under(lambda: light),
        "lms, full": under(lambda: full),
    }
    for run in configs.values():  # warm-up; the LMS objects' first steps
        run()
    times: dict[str, list[float]] = {name: [] for name in configs}
    for _ in range(rounds):
        for name, run in configs.items():
            started = time.perf_counter()
            for _ in range(steps):
                run()
            times[name].append((time.perf_counter() - started) / steps)
    plain = statistics.median(times["plain"])
    saved = light.stats.saved_tensors // light.stats.steps
    result: dict[str, object] = {"saved_tensors_a_step": saved, "plain_ms": plain * 1e3}
    for name, values in times.items():
        step = statistics.median(values)
        extra = step - plain
        result[name] = {"step_ms": step * 1e3, "extra_us_a_saved_tensor": extra / saved * 1e6}
        print(
            f"{name:15s} {step * 1e3:7.2f} ms a step, {extra / saved * 1e6:6.1f} us a saved tensor"
        )
    assert full.stats.offloaded_tensors > 0, "the full configuration moves a storage each step"
    light.close()
    full.close()
    return result


if __name__ == "__main__":
    main()
