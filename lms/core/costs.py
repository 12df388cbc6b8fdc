"""The cost model: what each kind of work takes on a `DeviceSpec`, in seconds.

One function per kind of cost. The simulator's clock, the planners and the reports all price work
through these, so a change to how a copy is priced is made here once.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from lms.core.devices import DeviceSpec

__all__ = [
    "checksum_s",
    "compute_s",
    "copy_in_s",
    "copy_out_s",
    "fresh_pages_s",
    "floor_s",
    "fresh_read_s",
    "link_s",
    "replay_s",
    "spill_read_s",
    "spill_write_s",
]

_GB = 1e9


def copy_out_s(spec: DeviceSpec, nbytes: int) -> float:
    """Seconds to copy ``nbytes`` from the device to host memory (on "cpu": to its spill file)."""
    return nbytes / (spec.d2h_gbps * _GB)


def copy_in_s(spec: DeviceSpec, nbytes: int) -> float:
    """Seconds to bring ``nbytes`` back to the device, into memory the allocator may map anew
    for it (`fresh_read_s`)."""
    return nbytes / (spec.h2d_gbps * _GB) + fresh_read_s(spec, nbytes)


def link_s(spec: DeviceSpec, nbytes: int) -> float:
    """Seconds ``nbytes`` take over the link's slower direction, fresh pages not counted: what
    one copy of them takes, out or in, where the direction is not yet known."""
    return nbytes / (min(spec.d2h_gbps, spec.h2d_gbps) * _GB)


def spill_write_s(spec: DeviceSpec, nbytes: int) -> float:
    """Seconds to write ``nbytes`` from host memory to a spill file, its digest taken."""
    return nbytes / (spec.disk_write_gbps * _GB) + checksum_s(spec, nbytes)


def spill_read_s(spec: DeviceSpec, nbytes: int) -> float:
    """Seconds to read ``nbytes`` of a spill file back into host memory and check them."""
    return nbytes / (spec.disk_read_gbps * _GB) + checksum_s(spec, nbytes)


def checksum_s(spec: DeviceSpec, nbytes: int) -> float:
    """Seconds the host takes to digest ``nbytes`` of a spill file (Note [Spill files are
    checked when read back]); 0 where the spec's spill rates include it."""
    return 0.0 if spec.checksum_gbps is None else nbytes / (spec.checksum_gbps * _GB)


# Note: [Fresh pages]
# glibc maps each allocation of `DeviceSpec.page_mapped_bytes` or more anew (`FRESH_PAGES_BYTES`,
# its own largest threshold, or the smaller one a CPU budget fixes: Note [The resident set follows
# the heap under a budget]), and the kernel hands whoever first writes it zeroed pages one fault at
# a time; below that size, memory that earlier frees left in glibc's heaps is reused. So on a CPU
# an op's first write of a large output, and a read back into a large storage, cost their page
# faults on top of their traffic, each at a rate the spec measures (`DeviceSpec.fresh_memory_gbps`,
# `DeviceSpec.fresh_read_gbps`). A GPU's caching allocator hands out memory it already holds: its
# specs leave both rates None. Measurements: benchmarks/results/README.md, "Fresh pages on a CPU".
def fresh_pages_s(spec: DeviceSpec, nbytes: int) -> float:
    """Seconds an op spends first writing a storage of ``nbytes`` mapped anew for it (Note
    [Fresh pages]); 0 below the spec's `page_mapped_bytes` or where it has no such cost."""
    mapped = spec.page_mapped_bytes
    if spec.fresh_memory_gbps is None or mapped is None or nbytes < mapped:
        return 0.0
    return nbytes / (spec.fresh_memory_gbps * _GB)


def fresh_read_s(spec: DeviceSpec, nbytes: int) -> float:
    """Seconds a read back of ``nbytes`` spends faulting in memory mapped anew for it (Note
    [Fresh pages]); 0 below the spec's `page_mapped_bytes` or where it has no such cost."""
    mapped = spec.page_mapped_bytes
    if spec.fresh_read_gbps is None or mapped is None or nbytes < mapped:
        return 0.0
    return nbytes / (spec.fresh_read_gbps * _GB)


def compute_s(
    spec: DeviceSpec, *, flops: float, working_set_bytes: int, half: bool = False
) -> float:
    """Seconds an op takes at the spec's rates: its FLOPs or its memory traffic, whichever takes
    longer (the per-op launch overhead not included)."""
    rate = spec.peak_flops_half if half else spec.peak_flops
    return max(flops / rate, working_set_bytes / (spec.memory_bandwidth_gbps * _GB))


def replay_s(op_seconds: Sequence[float], ops: Iterable[int]) -> float:
    """Seconds a replay takes: the ops it runs again, each at its price in the step."""
    return sum(op_seconds[k] for k in ops)


def floor_s(spec: DeviceSpec, moved_bytes: int, kernels_s: float) -> float:
    """The least a step that moves ``moved_bytes`` out and back can take: the larger of its
    kernels' time and the link's time for those bytes, each direction on its own channel."""
    if not moved_bytes:
        return kernels_s
    return max(kernels_s, copy_out_s(spec, moved_bytes), copy_in_s(spec, moved_bytes))
