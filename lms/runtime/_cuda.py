"""Streams and events: the one module that creates them.

Note: [Free after the copy event]
    A device storage being copied out is referenced by its entry until the copy's event has
    completed; only then may the caching allocator hand its memory to another tensor. Dropping
    it when the copy is merely *queued* is the stream/free race that gave other offloaders NaN
    gradients.

Note: [Allocate reloads on the compute stream]
    A reloaded storage is allocated on the compute stream, the copy-in stream first waits for the
    compute stream (so the block is no longer in use there), and the compute stream waits for the
    copy's event before any kernel reads it. The pinned source buffer goes back to the pool only
    with that event, and is reused only once the event has completed.

Note: [A copy in follows the copy out of its data]
    The two directions run on two streams, which a GPU's copy engines run at once. Backward
    may ask for a storage whose copy out is still queued (in async mode, the last ones forward
    saved are the first backward reads): the copy in then waits for the copy out's event on
    the device, or it could read the pinned buffer before the copy out has filled it. Until
    the runtime sees that event complete it reads the device storage itself; once it has, it
    reads the copy in, which must hold the same bits.

Note: [Pinned to the byte]
    PyTorch's pinned allocator rounds each request up to a power of two and keeps what is freed
    pinned in its cache for the life of the process: a 9.5 GiB activation pins 16 GiB, and a
    buffer the pool lets go of stays pinned beside the one that replaces it, so the memory
    pinned can pass the host budget, and the host, long before the pool's count does. Buffers
    above 2 MiB are therefore plain host memory of exactly their size, page-locked with
    ``cudaHostRegister`` when made (portable: pinned for every device of the process, as a model
    split over several has its copies on each) and unlocked with ``cudaHostUnregister`` when
    the pool drops them, after their last copy has completed. Smaller ones come from PyTorch's
    allocator, whose power of two is their size already. Registering a buffer first faults its
    pages in, one thread for all of them; PyTorch's intra-op threads fault them in first
    (zeroing them), so that registering only locks them.

Note: [Host registration through cuda.bindings]
    PyTorch binds ``cudaHostRegister`` and ``cudaHostUnregister`` but not ``cudaGetLastError``,
    and a failed registration leaves its error in the runtime, where PyTorch's next kernel
    launch would raise it as its own. NVIDIA's ``cuda.bindings`` (the ``cuda-bindings``
    package, a dependency of PyTorch's CUDA wheels) binds all three: where it is installed and
    its runtime reaches a device, the buffers are registered through it, and its own last error
    is reset after a failure. Registration is the driver's, for the process: PyTorch's copies
    see the buffers as pinned whichever runtime locked them. Elsewhere PyTorch's binding
    registers them, and the reset is found among the process's loaded ``libcudart``.
"""

from __future__ import annotations

import ctypes
import mmap
from typing import Any

import torch

__all__ = ["CopyEngine", "pin_host", "timing_event", "unpin_host"]

_OUT_OF_MEMORY = 2  # cudaErrorMemoryAllocation
_PORTABLE = 1  # cudaHostRegisterPortable


def pin_host(nbytes: int) -> torch.Tensor | None:
    """A page-locked uint8 host buffer of ``nbytes`` (Note [Pinned to the byte]); None where
    the host refuses to lock more memory."""
    buf = page_aligned(nbytes)
    buf.zero_()  # its pages faulted in on every intra-op thread
    code = _Runtime.get().register(buf.data_ptr(), nbytes)
    if code == 0:
        return buf
    if code == _OUT_OF_MEMORY:
        return None
    raise torch.cuda.CudaError(code)


def page_aligned(nbytes: int) -> torch.Tensor:
    """A plain uint8 host buffer of ``nbytes`` (a multiple of 4096) in pages of its own: an
    anonymous mapping, so that its storage starts where its registration does and
    ``is_pinned()`` tells the truth (PyTorch asks the driver about the storage's first byte).
    The tensor holds the mapping; the pages go back to the system with the last reference."""
    return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=torch.uint8)


def unpin_host(buf: torch.Tensor) -> None:
    """Unlock a buffer from `pin_host`; its memory is freed once nothing references it."""
    code = _Runtime.get().unregister(buf.data_ptr())
    if code != 0:
        raise torch.cuda.CudaError(code)


class _Runtime:
    """``cudaHostRegister`` and ``cudaHostUnregister``, each leaving no error behind (Note [Host
    registration through cuda.bindings])."""

    _chosen: _Runtime | None = None

    def __init__(self, bindings: Any = None):
        self.bindings = bindings
        """``cuda.bindings.runtime``, or None: PyTorch's own binding of the runtime."""

    @classmethod
    def get(cls) -> _Runtime:
        """cuda.bindings' runtime where it is installed and reaches a device, else PyTorch's;
        chosen once a process."""
        if cls._chosen is None:
            try:
                from cuda.bindings import runtime
            except ImportError:
                runtime = None
            reaches = runtime is not None and int(runtime.cudaGetDeviceCount()[0]) == 0
            cls._chosen = cls(runtime if reaches else None)
        return cls._chosen

    def register(self, ptr: int, nbytes: int) -> int:
        """Lock ``nbytes`` at ``ptr`` for every device of the process; the runtime's error
        code (0: done)."""
        if self.bindings is not None:
            flags = self.bindings.cudaHostRegisterPortable
            code = int(self.bindings.cudaHostRegister(ptr, nbytes, flags)[0])
        else:
            code = int(torch.cuda.cudart().cudaHostRegister(ptr, nbytes, _PORTABLE))
        if code != 0:
            self._forget_error()
        return code

    def unregister(self, ptr: int) -> int:
        """Unlock what `register` locked at ``ptr``; the runtime's error code (0: done)."""
        if self.bindings is not None:
            code = int(self.bindings.cudaHostUnregister(ptr)[0])
        else:
            code = int(torch.cuda.cudart().cudaHostUnregister(ptr))
        if code != 0:
            self._forget_error()
        return code

    def _forget_error(self) -> None:
        """Reset the runtime's last error, which PyTorch's next kernel launch would raise as its
        own where the runtime is PyTorch's (it resets it when its own calls fail; these calls
        are not its own)."""
        if self.bindings is not None:
            self.bindings.cudaGetLastError()
            return
        for library in (None, *_loaded("libcudart")):
            reset = getattr(ctypes.CDLL(library), "cudaGetLastError", None)
            if reset is not None:
                reset()
                return


def _loaded(name: str) -> list[str]:
    """Paths of the shared libraries named ``name`` that this process has loaded."""
    try:
        with open("/proc/self/maps") as maps:
            return sorted({line.split()[-1] for line in maps if f"/{name}" in line})
    except OSError:
        return []


class CopyEngine:
    """One device-to-host and one host-to-device stream for a CUDA device."""

    def __init__(self, device: torch.device):
        self.device = device
        self.d2h = torch.cuda.Stream(device)
        self.h2d = torch.cuda.Stream(device)
        self.timed = False
        """Record each copy's start too, and make its events timing ones (a step record)."""
        self.last_start: torch.cuda.Event | None = None
        """With ``timed``: the start event of the last copy queued."""

    def _start(self, stream: torch.cuda.Stream) -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=self.timed)
        if self.timed:
            self.last_start = timing_event(stream)
        return event

    def copy_out(self, src: torch.Tensor, dst: torch.Tensor) -> torch.cuda.Event:
        """Queue ``dst.copy_(src)`` (device to pinned host) after the work that produced ``src``."""
        compute = torch.cuda.current_stream(self.device)
        self.d2h.wait_stream(compute)
        with torch.cuda.stream(self.d2h):
            event = self._start(self.d2h)
            dst.copy_(src, non_blocking=True)
            event.record(self.d2h)
        return event

    def copy_in(
        self,
        src: torch.Tensor,
        into: torch.Tensor | None = None,
        *,
        after: torch.cuda.Event | None = None,
    ) -> tuple[torch.Tensor, torch.cuda.Event]:
        """Allocate on the compute stream (or take ``into``, allocated there) and queue a copy of
        pinned ``src`` into it, after the copy out ``after`` that fills ``src`` (Note [A copy in
        follows the copy out of its data])."""
        compute = torch.cuda.current_stream(self.device)
        dst = torch.empty(src.shape, dtype=src.dtype, device=self.device) if into is None else into
        self.h2d.wait_stream(compute)
        if after is not None:
            self.h2d.wait_event(after)
        with torch.cuda.stream(self.h2d):
            event = self._start(self.h2d)
            dst.copy_(src, non_blocking=True)
            event.record(self.h2d)
        return dst, event

    def wait(self, event: torch.cuda.Event) -> None:
        """Make the compute stream wait for ``event``."""
        torch.cuda.current_stream(self.device).wait_event(event)


def allocator_bytes(device: torch.device) -> tuple[int, int]:
    """The bytes the caching allocator holds in tensors and has reserved on ``device`` now, from
    one read of its statistics: `torch.cuda.memory_allocated` and `torch.cuda.memory_reserved`
    each read the whole table and flatten and sort it, host time that a step record, which asks
    at every op, must not add to the step (Note [One clock for a step record])."""
    stats = torch.cuda.memory_stats_as_nested_dict(device)
    if not stats:  # the allocator not initialized yet
        return 0, 0
    return int(stats["allocated_bytes"]["all"]["current"]), int(
        stats["reserved_bytes"]["all"]["current"]
    )


def allocator_now() -> tuple[int, int, int] | None:
    """The current CUDA device's index, the bytes its caching allocator holds in tensors, and how
    often it has freed its cached blocks to fit a request and tried again (Note [The allocator
    gives memory back]), from one read of its statistics; None where CUDA is not in use."""
    if not torch.cuda.is_initialized():
        return None
    index = torch.cuda.current_device()
    stats = torch.cuda.memory_stats(index)
    return (
        index,
        int(stats.get("allocated_bytes.all.current", 0)),
        int(stats.get("num_alloc_retries", 0)),
    )


HOLD_CYCLES = 1_000_000
"""Clock cycles `hold_card` keeps the card busy: about half a millisecond, longer than the host
takes to queue one op (tens of microseconds)."""


def hold_card() -> None:
    """Keep the current stream busy for `HOLD_CYCLES` while the host queues what follows, so that
    events around it time the kernels alone, not the host's queuing nor a card idling down
    between them (a no-op where PyTorch lacks ``torch.cuda._sleep``)."""
    sleep = getattr(torch.cuda, "_sleep", None)
    if sleep is not None:
        sleep(HOLD_CYCLES)


def timing_event(stream: torch.cuda.Stream | None = None) -> torch.cuda.Event:
    """A timing event recorded now on ``stream`` (the current one by default): a mark on the
    card's own clock for a step record (`lms.runtime.steplog`)."""
    event = torch.cuda.Event(enable_timing=True)
    event.record(stream if stream is not None else torch.cuda.current_stream())
    return event
