"""A pool of host buffers, pinned when they serve a CUDA device, reused across tensors and steps.

Buffers are sized in buckets (powers of two up to 2 MiB, then multiples of 2 MiB) so that
activations of one shape share buffers step after step; no pinned allocation is made per tensor
once the pool is warm. A buffer handed back with a pending CUDA event is reused only after the
event has completed (Note: [Allocate reloads on the compute stream]).
"""

from __future__ import annotations

import os
from typing import Any

import torch

__all__ = ["HostPool", "available_host_bytes", "bucket_bytes"]

_STEP = 2 * 1024**2


def available_host_bytes() -> int:
    """Host memory the system could hand out now (``MemAvailable``)."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def bucket_bytes(nbytes: int) -> int:
    """The pool bucket a request of ``nbytes`` is served from."""
    if nbytes <= _STEP:
        return 1 << max(nbytes - 1, 0).bit_length()
    return -(-nbytes // _STEP) * _STEP


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

    def acquire(self, nbytes: int) -> torch.Tensor | None:
        """A uint8 buffer of at least ``nbytes``, or None when the limit leaves no room."""
        size = bucket_bytes(nbytes)
        buf = self._take_free(size)
        if buf is None:
            if self.allocated_bytes + size > self.limit_bytes:
                self._trim(self.allocated_bytes + size - self.limit_bytes)
            if self.allocated_bytes + size > self.limit_bytes:
                return None
            buf = torch.empty(size, dtype=torch.uint8, pin_memory=self.pin)
            self.allocated_bytes += size
            self.allocations += 1
        self.in_use_bytes += size
        self.peak_in_use_bytes = max(self.peak_in_use_bytes, self.in_use_bytes)
        return buf

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
                    self.allocated_bytes -= size
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
                self.allocated_bytes -= buf.numel()
        self._free.clear()
