"""`LMSStats`: what the runtime moved and what it cost, for the last step and in total."""

from __future__ import annotations

import dataclasses

__all__ = ["LMSStats"]


@dataclasses.dataclass
class LMSStats:
    """Counters of one `lms.LMS`, summed over its steps unless the name says otherwise."""

    steps: int = 0
    """Steps (``with`` blocks) run."""
    saved_tensors: int = 0
    """Tensors autograd saved under the runtime."""
    saved_bytes: int = 0
    """Bytes of distinct storages among them, in steps run in full (not the light ones)."""
    kept_tensors: int = 0
    """Saved tensors left on the device: parameters, buffers, small ones, `no_offload` regions,
    and every save of a light step (one that follows a plan that moves nothing)."""
    offloaded_tensors: int = 0
    """Storages moved out of device memory."""
    offloaded_bytes: int = 0
    """Bytes moved out of device memory."""
    spilled_bytes: int = 0
    """Of those, bytes written to spill files."""
    emptied_bytes: int = 0
    """Of those, bytes of storages the step's code held, emptied in place while it did (a plan
    made with ``free_held``), each time they were emptied."""
    gap_fills: int = 0
    """Emptied storages filled again in forward, before the code read them again (the plan's
    `lms.Plan.held_gaps`)."""
    gap_filled_bytes: int = 0
    """Their bytes, each time."""
    recomputed_tensors: int = 0
    """Storages dropped in forward and recomputed in backward, as the plan said."""
    recomputed_bytes: int = 0
    """Their bytes (counted once per storage, not per recompute)."""
    diverged_steps: int = 0
    """Steps that saved other tensors than their plan was made for, and followed the runtime's
    own policy from there (an `[LMS]` warning says where, for the first)."""
    replays_differed: int = 0
    """Replays checked against forward's bits (a plan's first step) that differed; each such
    storage is offloaded instead from the next step on."""
    relieved_partials: int = 0
    """Partial gradients that waited off the device at a gradient junction, as the plan said."""
    relieved_bytes: int = 0
    """Their bytes."""
    prefetched_bytes: int = 0
    """Bytes brought back ahead of their use."""
    reloaded_bytes: int = 0
    """Bytes brought back (ahead of use or on demand), counting each reload."""
    wait_s: float = 0.0
    """Seconds backward waited for data to come back."""
    peak_resident_saved_bytes: int = 0
    """Largest bytes of saved storages held on the device at once."""
    peak_host_bytes: int = 0
    """Largest host memory held by offloaded data."""
    peak_disk_bytes: int = 0
    """Largest disk space held by spill files."""
    allocator_retries: int = 0
    """Times the CUDA caching allocator, finding no room under its cap, freed its cached blocks
    and tried again during the steps: each synchronizes the card and maps memory anew (Note [The
    allocator gives memory back]). 0 on a CPU."""

    def as_dict(self) -> dict[str, float]:
        """The counters as a plain dict."""
        return dataclasses.asdict(self)
