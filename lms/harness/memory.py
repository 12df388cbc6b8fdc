"""Which steps of a run sample their memory and which time it; the bytes a step starts with.
(What is in use is read by `lms.runtime.heap`: Note [The C heap in use, not the resident set,
measures a CPU step].)
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterable

import torch

from lms.core.keep import distinct_storages
from lms.runtime.heap import PeakMemory, current_rss_bytes, heap_in_use_bytes

__all__ = [
    "PeakMemory",
    "SampledSteps",
    "current_rss_bytes",
    "heap_in_use_bytes",
    "measure_steps",
    "sampled_steps",
    "steady_times",
    "tensors_bytes",
]

# Note: [Steps timed without the sampler]
# `PeakMemory`'s thread wakes every 2 ms to read the resident set and ``mallinfo2``, which walks the
# allocator's arenas under their locks. Where PyTorch's threads fill the cores, the wakes slow the
# step, and an LMS step's spill thread contends with them too. So a run of three steps or more
# samples its second step's memory alone and times the steps after it unsampled; a CUDA run samples
# none, its allocator counting its peak. The slowdown measured: benchmarks/results/README.md, "Steps
# timed without the sampler".


def sampled_steps(steps: int, cuda: bool) -> frozenset[int]:
    """The steps of a run of ``steps`` whose memory `PeakMemory` samples (Note [Steps timed
    without the sampler]): none on CUDA; the second alone of three or more; else all."""
    if cuda:
        return frozenset()
    return frozenset({1}) if steps >= 3 else frozenset(range(steps))


def steady_times(times: list[float], sampled: frozenset[int]) -> list[float]:
    """The times that measure a run's speed: after the first step, those not sampled (Note
    [Steps timed without the sampler]), else all after the first, else the first."""
    return [t for i, t in enumerate(times) if i and i not in sampled] or times[1:] or times


def measure_steps(step: Callable[[], object], steps: int) -> tuple[list[float], PeakMemory]:
    """Run ``step`` once with its memory sampled, then ``steps`` times timed without the sampler
    (Note [Steps timed without the sampler]): the times, and the sampled step's `PeakMemory`."""
    with PeakMemory() as peak:
        step()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return times, peak


def tensors_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors``: what a step starts with (weights,
    buffers, the batch), which a budget counts but the heap's growth over the step leaves out."""
    return sum(distinct_storages(tensors).values())


class SampledSteps:
    """A run of ``steps`` steps: `PeakMemory` around those `sampled_steps` picks, and which
    steps' times measure the run's speed (Note [Steps timed without the sampler])."""

    def __init__(self, steps: int, cuda: bool):
        self.indices = sampled_steps(steps, cuda)
        self._samples: list[PeakMemory] = []

    def sampling(self, index: int) -> contextlib.AbstractContextManager[object]:
        """Around step ``index``: a `PeakMemory` where its memory is sampled, else nothing."""
        if index not in self.indices:
            return contextlib.nullcontext()
        self._samples.append(PeakMemory())
        return self._samples[-1]

    @property
    def steady(self) -> PeakMemory | None:
        """The last step sampled: the one after the first where there is one, else the first
        (a run of one step); None where none was (CUDA)."""
        return self._samples[-1] if self._samples else None

    def steady_times(self, times: list[float]) -> list[float]:
        """`steady_times` of this run's steps."""
        return steady_times(times, self.indices)

    def timing_caveat(self, steps: int) -> str:
        """What the run's timed steps carry beside the step itself, said beside a prediction
        they are set against: the first step's warm-up where it is the one timed, the
        sampler's cost where it ran in the timed steps (Note [Steps timed without the
        sampler]); empty where neither."""
        timed = {int(i) for i in steady_times([float(i) for i in range(steps)], self.indices)}
        if 0 in timed:
            return (
                "measured on the first step, which warms up too "
                "(--steps 3 or more times later ones)"
            )
        if timed & self.indices:
            return (
                "measured with the memory sampler running, which slows a CPU step "
                "(--steps 3 or more times steps without it)"
            )
        return ""
