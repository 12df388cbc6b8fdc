"""What recording a step costs: ResNet50 steps with and without `--record`, no offload and LMS,
in turns within one process so that both see the same machine; and of a recorded step, the
recorder's own host time as the record keeps it (`StepTimes.recorder_s`), and of that its reads
of the memory in use. Then the recorder in parts, plain steps in turns: under a dispatch mode
that does nothing, beside the heap's peak sampler alone, and under the whole recorder.

    python benchmarks/record_overhead.py --json benchmarks/results/record_overhead_cpu.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import tempfile
import time

import torch
import torchvision
from torch.utils._python_dispatch import TorchDispatchMode

from lms.core.steprecord import StepTimes, load_record
from lms.harness.train import train
from lms.runtime.heap import PeakMemory, heap_in_use_bytes
from lms.runtime.steplog import _ALLOCATE_ONLY, StepLog


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", required=True)
    parser.add_argument("--size", type=int, default=320)
    parser.add_argument("--budget", default="250MiB")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--heap-reads",
        action="store_true",
        help="on a CPU, read glibc's heap (mallinfo2) at each op, as the recorder did before "
        "it counted the storages its ops make",
    )
    args = parser.parse_args()
    if args.heap_reads:
        StepLog._made_bytes = lambda self: (heap_in_use_bytes() or 0, 0)  # type: ignore[method-assign]
    times: dict[str, list[float]] = {}
    own: dict[str, list[float]] = {}
    reads: dict[str, list[float]] = {}
    per_read: dict[str, list[float]] = {}
    counted: dict[str, list[list[int]]] = {}  # the most in use over the ops, the step's peak
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
                    if recorded:
                        steps = load_record(record).steps[1:]  # past the first
                        own.setdefault(method, []).append(
                            statistics.median(step.recorder_s for step in steps)
                        )
                        reads.setdefault(method, []).append(
                            statistics.median(step.recorder_reads_s for step in steps)
                        )
                        counted.setdefault(method, []).append(
                            [max(op.allocated_bytes for op in steps[-1].ops), steps[-1].peak_bytes]
                        )
                        per_read.setdefault(method, []).append(
                            statistics.median(
                                step.recorder_reads_s / _reads(step) * 1e6 for step in steps
                            )
                        )
    medians = {key: statistics.median(values) for key, values in times.items()}
    start = time.perf_counter()
    for _ in range(1000):
        heap_in_use_bytes()
    idle_read_us = (time.perf_counter() - start) * 1e3  # per call: 1000 calls, in us
    summary = {
        "heap_reads": args.heap_reads,
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
        "threads": torch.get_num_threads(),
        "model": f"resnet50 {args.size} px, batch 1",
        "step_s": times,
        "median_step_s": medians,
        "recording_slowdown": {
            method: medians[f"{method}_recorded"] / medians[f"{method}_plain"] - 1
            for method in ("none", "lms")
        },
        "recorder_own_s": own,
        "recorder_reads_s": reads,
        "us_a_read_in_the_step": per_read,
        "us_a_read_after_the_runs": idle_read_us,
        "most_in_use_at_an_op_and_peak_bytes": counted,
        "parts_median_step_s": _parts(args.size, args.rounds * 2),
        "recorder_share": {
            method: statistics.median(own[method]) / medians[f"{method}_recorded"]
            for method in ("none", "lms")
        },
    }
    shown = ("recording_slowdown", "recorder_share", "parts_median_step_s")
    print(json.dumps({key: summary[key] for key in shown}))
    with open(args.json, "w") as handle:
        json.dump(summary, handle, indent=1)


class _Idle(TorchDispatchMode):
    """A dispatch mode that runs each op and does nothing else."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        return func(*args, **(kwargs or {}))


class _Sampled:
    """The recorder's sampler of the heap's peak alone (every 10 ms, as it samples)."""

    def __enter__(self) -> None:
        self.peak = PeakMemory(interval_s=0.01).__enter__()

    def __exit__(self, *exc: object) -> None:
        self.peak.__exit__()


class _Logged:
    """Steps recorded by the whole recorder."""

    def __init__(self) -> None:
        self.log = StepLog(torch.device("cpu"))

    def __enter__(self) -> None:
        self.log.begin(len(self.log.steps) + 1, {})

    def __exit__(self, *exc: object) -> None:
        self.log.end({})


def _parts(size: int, rounds: int) -> dict[str, float]:
    """Median plain ResNet50 steps (batch 1, ``size`` px) under each part, in turns."""
    torch.manual_seed(0)
    model = torchvision.models.resnet50()
    batch = torch.randn(1, 3, size, size)
    ways: dict[str, contextlib.AbstractContextManager[None]] = {
        "plain": contextlib.nullcontext(),
        "idle dispatch mode": _Idle(),
        "heap sampler": _Sampled(),
        "recorder": _Logged(),
    }
    times: dict[str, list[float]] = {way: [] for way in ways}
    for round_ in range(rounds + 2):  # two to warm up
        for way, context in ways.items():
            model.zero_grad(set_to_none=True)
            start = time.perf_counter()
            with context:
                model(batch).square().mean().backward()
            if round_ >= 2:
                times[way].append(time.perf_counter() - start)
    return {way: statistics.median(values) for way, values in times.items()}


def _reads(step: StepTimes) -> int:
    """How many times the recorder read the memory in use in ``step``: after each op that ran a
    kernel and each that allocates without one (Note [One clock for a step record])."""
    reads = [op.end_s > op.start_s or op.name.split(".")[1] in _ALLOCATE_ONLY for op in step.ops]
    return sum(reads) or 1


if __name__ == "__main__":
    main()
