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
"""

from __future__ import annotations

import torch

__all__ = ["CopyEngine"]


class CopyEngine:
    """One device-to-host and one host-to-device stream for a CUDA device."""

    def __init__(self, device: torch.device):
        self.device = device
        self.d2h = torch.cuda.Stream(device)
        self.h2d = torch.cuda.Stream(device)

    def copy_out(self, src: torch.Tensor, dst: torch.Tensor) -> torch.cuda.Event:
        """Queue ``dst.copy_(src)`` (device to pinned host) after the work that produced ``src``."""
        compute = torch.cuda.current_stream(self.device)
        self.d2h.wait_stream(compute)
        with torch.cuda.stream(self.d2h):
            dst.copy_(src, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.d2h)
        return event

    def copy_in(
        self, src: torch.Tensor, into: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.cuda.Event]:
        """Allocate on the compute stream (or take ``into``, allocated there) and queue a copy of
        pinned ``src`` into it."""
        compute = torch.cuda.current_stream(self.device)
        dst = torch.empty(src.shape, dtype=src.dtype, device=self.device) if into is None else into
        self.h2d.wait_stream(compute)
        with torch.cuda.stream(self.h2d):
            dst.copy_(src, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.h2d)
        return dst, event

    def wait(self, event: torch.cuda.Event) -> None:
        """Make the compute stream wait for ``event``."""
        torch.cuda.current_stream(self.device).wait_event(event)
