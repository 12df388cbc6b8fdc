"""`lms demo`: analyze a real model's step, then train it past a budget with LMS.

On a CPU machine the budget caps the step's growth of the C heap in use (Note [The C heap in use,
not the resident set, measures a CPU step]) and offloaded tensors go to spill files; on a CUDA
machine it caps device memory and they go to pinned host memory.
"""

from __future__ import annotations

import functools
import logging
import os
import time

import torch
from tqdm import tqdm

from lms.analysis import simulate, trace_step
from lms.core.units import check_counts, format_bytes
from lms.harness.memory import SampledSteps, tensors_bytes
from lms.harness.zoo import zoo_model
from lms.orchestration.analyze import report_for
from lms.orchestration.local import local_device_spec, with_local_timings
from lms.orchestration.session import LMS
from lms.planning import plan_auto

__all__ = ["run_demo"]

log = logging.getLogger("lms.harness.demo")

# The embedded default: ResNet50 at a resolution whose step needs well over the budget.
MODEL = "resnet50"
CPU_SIZE, CPU_BATCH = 512, 2
GPU_SIZE, GPU_BATCH = 4096, 2
BUDGET_FRACTION = 0.4
DEMO_SIMULATIONS = 3000
"""The demo plans within this many simulations, not the planner's default 20000: its plan comes
out 0.3 points of overhead slower in a sixth of the time (benchmarks/results/README.md, "The
demo's planning")."""


# Long by design: the demo's script, step by step as its output reads: trace, plan, train with
# and without LMS, compare, write the files.
def run_demo(
    *, out_dir: str = "out/demo", steps: int = 3, progress: bool = True
) -> dict[str, float]:
    """Run the demo; returns the measured and predicted figures.

    Raises:
        ValueError: fewer than one step.
    """
    check_counts(steps=steps)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    size, batch = (GPU_SIZE, GPU_BATCH) if cuda else (CPU_SIZE, CPU_BATCH)
    entry = zoo_model(MODEL)
    spec = local_device_spec(device)

    # 1. Trace with fake tensors, in the layout it trains in (a CPU's convolutions take scratch
    # memory in the contiguous one): the plain peak sets the budget; then plan for it.
    fmt = torch.channels_last
    torch.manual_seed(0)
    model = entry.build().to(device).to(memory_format=fmt)

    def make_batch() -> list[torch.Tensor]:
        images, labels = entry.make_batch(size, batch)
        return [images.contiguous(memory_format=fmt), labels]

    trace = trace_step(
        model,
        make_batch,
        entry.step_fn,
        device=device,
        name=f"{MODEL} {size}px batch {batch}",
    )
    spec = with_local_timings(spec, trace, device)
    plain_peak = simulate(trace, None, spec).peak_tensor_bytes
    budget = int(plain_peak * BUDGET_FRACTION)
    log.info(
        "[LMS] Demo budget: %s (%.0f%% of the step's %s of tensors)",
        format_bytes(budget),
        100 * BUDGET_FRACTION,
        format_bytes(plain_peak),
    )
    planner = functools.partial(plan_auto, max_simulations=DEMO_SIMULATIONS)
    report = report_for(
        trace, spec.with_memory(budget + spec.workspace_bytes), budget, planner=planner
    )
    os.makedirs(out_dir, exist_ok=True)
    plot_path = os.path.join(out_dir, "memory.png")
    snapshot_path = os.path.join(out_dir, "memory_snapshot.pickle")
    report.plot(plot_path)
    report.save_snapshot(snapshot_path)

    # 2. Train for real with LMS on.
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    images, labels = (t.to(device) for t in make_batch())
    assert entry.step_fn is not None
    plan = report.plan if report.plan is not None and report.plan.source != "infeasible" else None
    offload = LMS(budget=budget, plan=plan)
    # What each step starts with (weights, buffers, the batch), which the budget and the
    # simulator count: the measured peak is that plus the step's growth (on a GPU, over what
    # the card holds at its start, which also has the optimizer's momentum).
    held = tensors_bytes([*model.parameters(), *model.buffers(), images, labels])
    times, peaks = [], []  # CUDA's peaks, a step each
    run = SampledSteps(steps, cuda)  # Note [Steps timed without the sampler]
    for index in tqdm(range(steps), desc="training with LMS", unit="step", disable=not progress):
        optimizer.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated() if cuda else 0
        with run.sampling(index):
            start = time.perf_counter()
            with offload:
                loss = entry.step_fn(model, [images, labels])
            optimizer.step()
            if cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        if cuda:
            peaks.append(held + torch.cuda.max_memory_allocated() - base)
    offload.close()
    memory = run.steady  # on a CPU, the sampled step after the first (else the first)
    if memory is not None:
        peaks.append(held + memory.growth_bytes)
    heap_counted = memory is None or memory.heap_growth_bytes is not None

    steady = run.steady_times(times)
    step_s = sum(steady) / len(steady)
    unsampled = len(steady) < len(times) - 1
    timed = (
        f"over {len(steady)} timed after the one whose memory was sampled"
        if unsampled
        else "after the first"
    )
    pixels = batch * entry.elements(size)
    measured = max(peaks[1:] or peaks)
    simulated = report.planned or report.plain
    # what the allocator counts: rounded blocks, and on a CPU the autograd graph's heap (Note
    # [The autograd graph on a CPU's heap]); not the margin kept for libraries' workspaces
    predicted = simulated.peak_bytes - spec.workspace_bytes
    stats = offload.stats
    what = "device memory" if cuda else "heap in use" if heap_counted else "resident set"
    lines = [
        f"[LMS] Trained {steps} steps of {MODEL} {size}x{size} batch {batch} on {device.type}; "
        f"last loss {loss.item():.4f}",
        f"[LMS] Throughput: {batch / step_s:.2f} images/s, {pixels / step_s / 1e6:.2f} "
        f"megapixels/s ({step_s:.2f} s per step {timed}; predicted {simulated.step_s:.2f} s)",
        f"[LMS] Measured peak: {format_bytes(measured)} ({format_bytes(held)} of weights and "
        f"batch, then the {what} grew by {format_bytes(measured - held)}) against a budget of "
        f"{format_bytes(budget)}; simulated "
        f"{format_bytes(predicted)} ({measured / predicted - 1:+.1%}); without LMS "
        f"{format_bytes(plain_peak)}",
        *(
            []
            if memory is None or not heap_counted
            else [
                "[LMS] The resident set grew by up to "
                f"{format_bytes(memory.rss_growth_bytes)} a step (freed memory goes back to the "
                "system: LMSConfig.cpu_resident)"
            ]
        ),
        f"[LMS] Offloaded {format_bytes(stats.offloaded_bytes / max(stats.steps, 1))} per step "
        f"({stats.offloaded_tensors // max(stats.steps, 1)} storages) to "
        f"{'host memory' if cuda else 'spill files'}; waited "
        f"{stats.wait_s / max(stats.steps, 1):.3f} s per step for data to come back",
        f"[LMS] Wrote {plot_path} and {snapshot_path} (open the latter at pytorch.org/memory_viz)",
    ]
    for line in lines:
        log.info("%s", line)
    return {
        "budget_bytes": budget,
        "measured_peak_bytes": measured,
        "predicted_peak_bytes": predicted,
        "plain_peak_bytes": plain_peak,
        "step_s": step_s,
        "predicted_step_s": simulated.step_s,
    }
