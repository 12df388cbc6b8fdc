"""A pool of host buffers, pinned when they serve a CUDA device, reused across tensors and steps.

Buffers are sized in buckets (powers of two up to 2 MiB, then multiples of 2 MiB) so that
activations of one shape share buffers step after step; no pinned allocation is made per tensor
once the pool is warm. A buffer handed back with a pending CUDA event is reused only after the
event has completed (Note: [Allocate reloads on the compute stream]). Pinned buffers pin exactly
their bucket, and dropping one unpins it (Note: [Pinned to the byte]).
"""

from __future__ import annotations

import logging
import os
import weakref
from typing import Any

import torch

from lms.core.units import BUCKET_STEP, bucket_bytes, format_bytes
from lms.runtime._cuda import pin_host, unpin_host
from lms.runtime.heap import proc_kib_bytes

__all__ = ["HostPool", "available_host_bytes", "bucket_bytes"]

_HOST_RESERVE = 2 * 1024**3  # left available beside a new pinned buffer (Note [Pinning can...])
log = logging.getLogger("lms.runtime")


def available_host_bytes() -> int:
    """Host memory the system could hand out now (``MemAvailable``)."""
    available = proc_kib_bytes("/proc/meminfo", "MemAvailable")
    if available is not None:
        return available
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def _empty(nbytes: int, pin: bool) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)


def _unpin_all(registered: dict[int, torch.Tensor]) -> None:
    """Unpin what a pool registered and still holds, when the pool goes (in use or idle)."""
    if registered and torch.cuda.is_initialized():
        # No copy on any device may still be reading or writing them: the buffers are portable
        # (Note [Pinned to the byte]), and a model split over devices copies on each.
        for device in range(torch.cuda.device_count()):
            torch.cuda.synchronize(device)
    for buf in registered.values():
        unpin_host(buf)
    registered.clear()


class HostPool:
    """Host buffers up to ``limit_bytes`` in all; pinned when ``pin`` is true."""

    def __init__(self, limit_bytes: int, *, pin: bool):
        self.limit_bytes = limit_bytes
        self.pin = pin
        self._free: dict[int, list[tuple[torch.Tensor, Any]]] = {}
        self.allocated_bytes = 0
        self.in_use_bytes = 0
        self.peak_in_use_bytes = 0
        self.allocations = 0
        # Buffers pinned by registration, by address: held until unpinned (Note [Pinned to
        # the byte]), and unpinned when the pool goes, should any be left.
        self._registered: dict[int, torch.Tensor] = {}
        weakref.finalize(self, _unpin_all, self._registered)
        self._registers = pin  # until this host refuses registration itself

    def acquire(self, nbytes: int) -> torch.Tensor | None:
        """A uint8 buffer of at least ``nbytes``, or None when the limit leaves no room."""
        size = bucket_bytes(nbytes)
        buf = self._take_free(size)
        if buf is None:
            if self.allocated_bytes + size > self.limit_bytes:
                self._trim(self.allocated_bytes + size - self.limit_bytes)
            if self.allocated_bytes + size > self.limit_bytes:
                return None
            buf = self._allocate(size)
            if buf is None:
                return None
            self.allocated_bytes += size
            self.allocations += 1
        self.in_use_bytes += size
        self.peak_in_use_bytes = max(self.peak_in_use_bytes, self.in_use_bytes)
        return buf

    # Note: [Pinning can fail below the budget]
    # Page-locked memory is not all the host's memory: a machine (a virtual one especially) may
    # refuse to pin more well before the host budget, with a CUDA error rather than PyTorch's
    # out-of-memory. Nor is the budget a promise that the host has the memory now: a buffer is
    # pinned only while the host would still have 2 GiB available beside it, since faulting its
    # pages in past that wakes the kernel's out-of-memory killer, which ends the process with
    # no error to catch. Either way the pool holds at what it has: the limit drops to what is
    # pinned, so the store sends what does not fit to disk (tier "auto") or raises
    # `HostMemoryError` (tier "host"), as for a full budget, rather than failing the step.
    def _allocate(self, size: int) -> torch.Tensor | None:
        """A new buffer of ``size`` bytes; None where pinning it failed (Note [Pinning can fail
        below the budget])."""
        buf = self._make(size)
        if buf is not None:
            return buf
        log.warning(
            "[LMS] pinning %s more host memory failed with %s pinned (host budget %s); "
            "offloaded data beyond that goes to disk, or raises HostMemoryError with "
            "tier='host'",
            format_bytes(size),
            format_bytes(self.allocated_bytes),
            format_bytes(self.limit_bytes),
        )
        self.limit_bytes = self.allocated_bytes
        return None

    def _make(self, size: int) -> torch.Tensor | None:
        """A new buffer of ``size`` bytes, pinned to the byte above 2 MiB (Note [Pinned to the
        byte]: up to 2 MiB, PyTorch's power of two is the bucket itself); None where refused."""
        if self._registers and size > BUCKET_STEP:
            if size + _HOST_RESERVE > available_host_bytes():
                return None
            try:
                buf = pin_host(size)
            except torch.cuda.CudaError as error:  # not for this host: PyTorch's way it is
                log.warning(
                    "[LMS] page-locking host memory in place failed (%s); pinning through "
                    "PyTorch's allocator instead, which rounds each buffer up to a power of two",
                    error,
                )
                self._registers = False
                return self._make(size)
            if buf is not None:
                self._registered[buf.data_ptr()] = buf
            return buf
        try:
            return _empty(size, self.pin)
        except RuntimeError as error:
            if not self.pin or "out of memory" not in str(error).lower():
                raise
        return None

    def release(self, buf: torch.Tensor, event: Any = None) -> None:
        """Give ``buf`` back; with ``event``, it is reused only after the event completed."""
        self.in_use_bytes -= buf.numel()
        self._free.setdefault(buf.numel(), []).append((buf, event))

    def _take_free(self, size: int) -> torch.Tensor | None:
        bucket = self._free.get(size)
        if not bucket:
            return None
        for index, (buf, event) in enumerate(bucket):
            if event is None or event.query():
                del bucket[index]
                return buf
        return None

    def _trim(self, need: int) -> None:
        """Free idle buffers of other sizes until ``need`` bytes are released or none are left."""
        for size in sorted(self._free, reverse=True):
            bucket = self._free[size]
            keep = []
            for buf, event in bucket:
                if need > 0 and (event is None or event.query()):
                    self._drop(buf)
                    need -= size
                else:
                    keep.append((buf, event))
            self._free[size] = keep
            if need <= 0:
                return

    def clear(self) -> None:
        """Drop every idle buffer (waiting for pending events first)."""
        for bucket in self._free.values():
            for buf, event in bucket:
                if event is not None:
                    event.synchronize()
                self._drop(buf)
        self._free.clear()

    def _drop(self, buf: torch.Tensor) -> None:
        """Let go of an idle buffer whose copies have all completed, unpinning it."""
        self.allocated_bytes -= buf.numel()
        if self._registered.pop(buf.data_ptr(), None) is not None:
            unpin_host(buf)

    @property
    def registered_bytes(self) -> int:
        """Bytes this pool has page-locked by registration and not yet unlocked."""
        return sum(buf.numel() for buf in self._registered.values())
