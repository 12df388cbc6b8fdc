"""Memory in use in this process: the C heap's count and the resident set, read now or sampled
at their peak over a block on a thread.

Note: [The C heap in use, not the resident set, measures a CPU step]
PyTorch's CPU tensors come from the C allocator. glibc keeps freed chunks below its mmap threshold
(which it raises, up to 32 MiB, as large blocks are freed) in its heaps, resident, for later
allocations to reuse: how much the resident set grows over a step then depends on what earlier
steps left behind. The demo's ResNet50 steps grew the resident set by 803, 190 and 209 MiB while
the bytes in use in the heap grew by 311.7, 306.3 and 306.3 MiB (simulated: 293.0). The bytes in
use (glibc's ``mallinfo2``) are what a CUDA card's ``max_memory_allocated`` counts there, and what
the simulator predicts; the resident set is closer to the memory the allocator reserves. Where
``mallinfo2`` is missing (not glibc, or glibc before 2.33) the resident set is all there is.

Note: [The resident set follows the heap under a budget]
What the heap keeps is still the process's memory: the out-of-memory killer and the user see the
resident set. ResNet50's steps on a 1 GiB budget grew the heap by 907 MiB and the resident set by
up to 1.2 GiB, as chunks freed in forward, of other sizes than backward asks for, stayed resident
while the heap grew past them (trimming the heap after each step did not lower that peak). A
runtime with a budget on the CPU therefore fixes glibc's mmap threshold at `MAPPED_ALONE_BYTES`
once (``mallopt``), which also stops glibc raising it: each allocation that large gets pages of
its own, which go back to the system when it is freed, and the resident set grows as the heap in
use does. The price is that such allocations fault their pages in afresh every step: those steps
took 1.5 to 4 times as long on this project's CPU, and the "cpu" spec prices those faults
(`DeviceSpec.page_mapped_bytes`), its ops timed under the same threshold (Note [Ops timed on the
device]). ``LMS(cpu_resident=False)`` keeps glibc's own setting, for speed,
and says that the resident set may then pass the budget. Measurements:
benchmarks/results/README.md, "The resident set under a CPU budget".
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import resource
import threading
import time
from collections.abc import Callable

from lms.core.devices import MAPPED_ALONE_BYTES

__all__ = [
    "PeakMemory",
    "current_rss_bytes",
    "heap_in_use_bytes",
    "peak_rss_bytes",
    "proc_kib_bytes",
    "reset_peak_rss",
    "map_alone_from",
    "release_freed_memory",
    "trim_heap",
]

_PAGE = os.sysconf("SC_PAGE_SIZE")
_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter
_released: bool | None = None


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


def release_freed_memory() -> bool:
    """Make memory the C allocator frees leave the resident set, from now on in this process,
    and give back what it keeps now (Note [The resident set follows the heap under a budget]).
    False where the allocator is not glibc's. Idempotent."""
    global _released
    if _released is None:
        _released = map_alone_from(MAPPED_ALONE_BYTES)
    return _released


def map_alone_from(nbytes: int) -> bool:
    """Fix glibc's mmap threshold at ``nbytes`` in this process: each allocation that large gets
    pages of its own from then on, given back when it is freed; and give back what the heap
    keeps now. False where the allocator is not glibc's."""
    try:
        done = bool(ctypes.CDLL(None).mallopt(_M_MMAP_THRESHOLD, nbytes))
    except AttributeError:  # not glibc
        return False
    trim_heap()
    return done


def trim_heap() -> None:
    """Give back to the system what the heap keeps free now (glibc's ``malloc_trim``); nothing
    where the allocator is not glibc's."""
    with contextlib.suppress(AttributeError):  # not glibc
        ctypes.CDLL(None).malloc_trim(0)


def current_rss_bytes() -> int:
    """This process's resident set now."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * _PAGE
    except OSError:  # not Linux: the lifetime peak is the best there is
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def reset_peak_rss() -> bool:
    """Set this process's peak resident set (``VmHWM``) to its resident set now, so that
    `peak_rss_bytes` reads the peak from here on; False where the system cannot (not Linux, or
    a kernel without it)."""
    try:
        with open("/proc/self/clear_refs", "w") as refs:
            refs.write("5")
    except OSError:
        return False
    return True


def peak_rss_bytes() -> int | None:
    """This process's peak resident set (``VmHWM``) since it started or since `reset_peak_rss`;
    None where the system does not say."""
    return proc_kib_bytes("/proc/self/status", "VmHWM")


def proc_kib_bytes(path: str, field: str) -> int | None:
    """The bytes of ``field`` in the ``/proc`` file ``path``, whose lines read ``field: N kB``;
    None where the system has no such file or field (not Linux)."""
    try:
        with open(path) as lines:
            for line in lines:
                if line.startswith(f"{field}:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


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
    def start_rss_bytes(self) -> int:
        """The resident set at the block's start."""
        return self._start[0]

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
