"""The spec of the device a step runs on: a table entry with its rates measured here, and the
times of a trace's ops timed here."""

from __future__ import annotations

import dataclasses
import logging
import os
import statistics
from typing import Any

import torch

from lms.core.devices import DEVICES, DeviceSpec, OpTimings
from lms.core.errors import SpillError
from lms.core.records import Trace
from lms.orchestration.rates import (
    ComputeRates,
    measure_compute,
    measure_fresh_memory_gbps,
    measure_link_gbps,
    measure_spill_gbps,
)
from lms.orchestration.timing import backend_settings, time_ops

__all__ = ["ALLOCATOR_SLACK_BYTES", "local_device_spec", "with_local_timings"]

log = logging.getLogger("lms.orchestration")

_MEASURED: dict[tuple[int, bool], tuple[float, float, ComputeRates]] = {}
"""Link and compute rates measured in this process, by GPU index and whether TF32 is allowed."""

_MEASURED_CPU: dict[int, tuple[ComputeRates, float, float, float | None, float | None]] = {}
"""Compute rates of this CPU, its spill files' write and read rates, and its fresh pages' rates
as ops write them and as reads fill them (GB/s), measured in this process, by PyTorch's
intra-op thread count: rates, laid over the table's "cpu" entry at each call, so that the
entry's other figures stay the table's."""


# Note: [A CPU's rates are measured]
# The table's "cpu" entry is a guess for any CPU, and real CPUs differ from it by several times,
# most in half precision, so a plan priced at the entry mistakes how long a step takes. The local
# spec measures a convolution's forward and both gradients (the forward alone runs faster than a
# step's mix; a GPU's rates stay its forward's, Note [Why measure compute]), an add's memory
# traffic, the spill store's own write and read rates (the entry's where the temporary folder
# refuses spill files), the faults of first writes and of reads into fresh pages (Note [Fresh
# pages]), and whether copies take compute's cores (Note [Copies on a CPU take its cores]). Each
# rate is the median of three rounds, since rounds on a shared machine vary. A plan tuned for this
# CPU then prices its step's ops at their own times where it can (Note [Ops timed on the device]).
# Rates and predictions measured: benchmarks/results/README.md, "A CPU's rates".
def _fresh_rate(gbps: float | None) -> str:
    return "at no extra cost" if gbps is None else f"{gbps:.1f} GB/s"


def _local_cpu_spec() -> DeviceSpec:
    threads = torch.get_num_threads()
    if threads not in _MEASURED_CPU:
        rounds = [measure_compute(torch.device("cpu"), at_least_s=0.02) for _ in range(3)]
        rates = ComputeRates(
            statistics.median(r.flops for r in rounds),
            statistics.median(r.flops_half for r in rounds),
            statistics.median(r.bandwidth_gbps for r in rounds),
        )
        table = DEVICES["cpu"]
        try:
            write, read, fresh_read = measure_spill_gbps()
        except (SpillError, OSError) as error:
            write, read, fresh_read = table.d2h_gbps, table.h2d_gbps, table.fresh_read_gbps
            log.warning(
                "[LMS] Spill files could not be measured in the temporary folder (%s); plans "
                "price them at %.1f GB/s written and %.1f read",
                error,
                write,
                read,
            )
        fresh = measure_fresh_memory_gbps()
        _MEASURED_CPU[threads] = (rates, write, read, fresh, fresh_read)
        log.info(
            "[LMS] CPU, %d threads on %d cores: measured convolution %.0f GFLOP/s fp32, %.0f "
            "GFLOP/s bf16; memory %.0f GB/s, fresh pages %s; spill files %.1f GB/s written, "
            "%.1f GB/s read, fresh pages %s as they are read into",
            threads,
            _cores(),
            rates.flops / 1e9,
            rates.flops_half / 1e9,
            rates.bandwidth_gbps,
            _fresh_rate(fresh),
            write,
            read,
            _fresh_rate(fresh_read),
        )
    rates, write, read, fresh, fresh_read = _MEASURED_CPU[threads]
    return dataclasses.replace(
        DEVICES["cpu"],
        peak_flops=rates.flops,
        peak_flops_half=rates.flops_half,
        memory_bandwidth_gbps=rates.bandwidth_gbps,
        d2h_gbps=write,
        h2d_gbps=read,
        fresh_memory_gbps=fresh,
        fresh_read_gbps=fresh_read,
        copies_take_compute=threads >= _cores(),
    )


_TIMED: dict[tuple[Any, ...], OpTimings] = {}
"""Times of traces' ops measured in this process, by fingerprint, device, budget and kernel
settings."""


def with_local_timings(
    spec: DeviceSpec, trace: Trace, device: torch.device, budget: int | None = None
) -> DeviceSpec:
    """``spec`` with the times of ``trace``'s ops on ``device`` (Note [Ops timed on the
    device]; ops over ``budget`` keep the rates), timed once a process for each step, device,
    budget, kernel settings (`lms.orchestration.timing.backend_settings`) and, on a CPU, the
    size from which allocations get pages of their own (``spec.page_mapped_bytes``), so that
    tuning the same step twice prices it alike, as the rates are (the last 16 kept)."""
    settings = tuple(sorted(backend_settings().items()))
    mapped = spec.page_mapped_bytes if device.type == "cpu" else None
    key = (trace.fingerprint(), str(device), budget, settings, mapped)
    if key not in _TIMED:
        while len(_TIMED) >= 16:
            del _TIMED[next(iter(_TIMED))]
        _TIMED[key] = time_ops(trace, device, max_bytes=budget, mapped_bytes=mapped)
    return spec.with_op_timings(_TIMED[key])


def _cores() -> int:
    """The CPUs this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


# Note: [The allocator's slack]
# A budget caps what the CUDA caching allocator reserves (`set_per_process_memory_fraction` counts
# reserved memory), and the allocator reserves more than the tensors it holds: parts of its blocks
# that no tensor fits at the moment. A plan tuned for a CUDA device leaves that room too: the margin
# for library workspaces grows by `ALLOCATOR_SLACK_BYTES`. The named specs (the sweeps' V100 and
# H100) keep the workspace margin alone, as the seed's figures had an allocator of their own. The
# idle bytes seen at failures: benchmarks/results/README.md, "The allocator's slack".
ALLOCATOR_SLACK_BYTES = 256 * 1024**2
"""Device memory a plan tuned on a CUDA device leaves for the caching allocator's idle parts of
blocks (Note [The allocator's slack])."""


def local_device_spec(device: torch.device) -> DeviceSpec:
    """The spec of ``device``: on a GPU, the closest table entry with its memory, link and
    compute rates measured (each at most the table's peak; measured once a process for each GPU
    and TF32 setting, so that tuning twice prices the same trace alike) and room for the caching
    allocator's slack in its margin (Note [The allocator's slack]); on a CPU, the table's
    entry with its compute and spill-file rates measured (Note [A CPU's rates are measured]),
    once a process for each thread count."""
    if device.type != "cuda":
        return _local_cpu_spec()
    name = torch.cuda.get_device_name(device).lower()
    total = torch.cuda.get_device_properties(device).total_memory
    key = next((k for k in ("gh200", "h200", "h100", "a100", "v100") if k in name), "h100")
    candidates = [s for s in DEVICES.values() if s.name.startswith(key)]
    base = min(candidates, key=lambda s: abs(s.memory_bytes - total))
    index = device.index if device.index is not None else torch.cuda.current_device()
    measured = (index, bool(torch.backends.cudnn.allow_tf32))
    if measured not in _MEASURED:
        _MEASURED[measured] = (*measure_link_gbps(device), measure_compute(device))
    d2h, h2d, rates = _MEASURED[measured]
    log.info(
        "[LMS] %s: measured %.1f GB/s device to host, %.1f GB/s host to device; convolution "
        "%.1f TFLOP/s fp32, %.1f TFLOP/s bf16; memory %.0f GB/s",
        torch.cuda.get_device_name(device),
        d2h,
        h2d,
        rates.flops / 1e12,
        rates.flops_half / 1e12,
        rates.bandwidth_gbps,
    )
    return dataclasses.replace(
        base,
        memory_bytes=total,
        d2h_gbps=d2h,
        h2d_gbps=h2d,
        peak_flops=min(base.peak_flops, rates.flops),
        peak_flops_half=min(base.peak_flops_half, rates.flops_half),
        memory_bandwidth_gbps=min(base.memory_bandwidth_gbps, rates.bandwidth_gbps),
        workspace_bytes=base.workspace_bytes + ALLOCATOR_SLACK_BYTES,
    )
