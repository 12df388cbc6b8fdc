"""Peak memory growth of this process over a block, sampled on a thread.

Note: [The C heap in use, not the resident set, measures a CPU step]
PyTorch's CPU tensors come from the C allocator. glibc keeps freed chunks below its mmap threshold
(which it raises, up to 32 MiB, as large blocks are freed) in its heaps, resident, for later
allocations to reuse: how much the resident set grows over a step then depends on what earlier
steps left behind. The demo's ResNet50 steps grew the resident set by 803, 190 and 209 MiB while
the bytes in use in the heap grew by 311.7, 306.3 and 306.3 MiB (simulated: 293.0). The bytes in
use (glibc's ``mallinfo2``) are what a CUDA card's ``max_memory_allocated`` counts there, and what
the simulator predicts; the resident set is closer to the memory the allocator reserves. Where
``mallinfo2`` is missing (not glibc, or glibc before 2.33) the resident set is all there is.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import resource
import threading
import time
from collections.abc import Callable, Iterable

import torch

from lms.core.keep import distinct_storages

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

_PAGE = os.sysconf("SC_PAGE_SIZE")


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


def _mallinfo2() -> Callable[[], _MallInfo2] | None:
    try:
        function = ctypes.CDLL(None).mallinfo2
    except (AttributeError, OSError):
        return None
    function.restype = _MallInfo2
    function.argtypes = []
    return function  # type: ignore[no-any-return]


_MALLINFO2 = _mallinfo2()


def heap_in_use_bytes() -> int | None:
    """Bytes the C allocator has handed out and not taken back, over all its arenas (chunks in
    use plus chunks mapped on their own); None where glibc's ``mallinfo2`` is missing."""
    if _MALLINFO2 is None:
        return None
    info = _MALLINFO2()
    return int(info.uordblks + info.hblkhd)


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


def current_rss_bytes() -> int:
    """This process's resident set now."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * _PAGE
    except OSError:  # not Linux: the lifetime peak is the best there is
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class PeakMemory:
    """``with PeakMemory() as peak: ...`` then ``peak.growth_bytes``: how much the block added at
    most to the heap in use (to the resident set where that is not counted)."""

    def __init__(self, interval_s: float = 0.002):
        self.interval_s = interval_s
        self._start = (0, 0)
        self._peak = [0, 0]  # resident set, heap in use
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _read(self) -> tuple[int, int]:
        return current_rss_bytes(), heap_in_use_bytes() or 0

    def _note(self) -> None:
        rss, heap = self._read()
        self._peak[0] = max(self._peak[0], rss)
        self._peak[1] = max(self._peak[1], heap)

    def _sample(self) -> None:
        while not self._stop.is_set():
            self._note()
            time.sleep(self.interval_s)

    def __enter__(self) -> PeakMemory:
        self._start = self._read()
        self._peak = list(self._start)
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        assert self._thread is not None
        self._thread.join()
        self._note()

    @property
    def rss_growth_bytes(self) -> int:
        """Peak resident set over the block minus the resident set at its start."""
        return self._peak[0] - self._start[0]

    @property
    def heap_growth_bytes(self) -> int | None:
        """Peak heap in use over the block minus the heap in use at its start (None where the
        heap is not counted): Note [The C heap in use, not the resident set, measures a CPU
        step]."""
        return self._peak[1] - self._start[1] if _MALLINFO2 is not None else None

    @property
    def growth_bytes(self) -> int:
        """The heap's growth where it is counted, else the resident set's."""
        heap = self.heap_growth_bytes
        return self.rss_growth_bytes if heap is None else heap


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
