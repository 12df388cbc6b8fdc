"""`LMS.tune`: trace the user's step, plan it for the local device, cache plans by fingerprint."""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch

import lms
from lms._units import format_bytes
from lms.analysis.devices import DEVICES, FRESH_PAGES_BYTES, DeviceSpec, OpTimings
from lms.analysis.records import Trace
from lms.analysis.simulate import simulate
from lms.analysis.trace import StepFn, trace_step
from lms.cache import cache_folder, cache_path, load_cached, planner_code, save_plan
from lms.errors import HostMemoryError, SpillError
from lms.plan import Plan
from lms.runtime._cuda import pin_host, unpin_host
from lms.timing import backend_settings, time_ops

__all__ = [
    "ComputeRates",
    "check_offload_room",
    "local_device_spec",
    "measure_compute",
    "measure_fresh_memory_gbps",
    "measure_link_gbps",
    "measure_spill_gbps",
    "tune_plan",
    "with_local_timings",
]

log = logging.getLogger("lms.tuning")


def measure_link_gbps(device: torch.device, nbytes: int = 256 * 1024**2) -> tuple[float, float]:
    """Device-to-host and host-to-device copy rates (GB/s) between pinned memory and ``device``.

    The host buffer is pinned as the runtime pins its own (Note [Pinned to the byte]) and
    unpinned after: PyTorch's pinned allocator would keep it pinned for the life of the process.

    Raises:
        HostMemoryError: the host refuses to pin ``nbytes``.
    """
    host = pin_host(nbytes)
    if host is None:
        raise HostMemoryError(
            f"lms: the host refused to pin {format_bytes(nbytes)} to measure the link to "
            f"{device}; free host memory and tune again"
        )
    try:
        dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
        rates = []
        for dst, src in ((host, dev), (dev, host)):
            dst.copy_(src, non_blocking=True)  # warm-up
            torch.cuda.synchronize(device)
            start = time.perf_counter()
            for _ in range(3):
                dst.copy_(src, non_blocking=True)
            torch.cuda.synchronize(device)
            rates.append(3 * nbytes / (time.perf_counter() - start) / 1e9)
    finally:
        torch.cuda.synchronize(device)
        unpin_host(host)
    return rates[0], rates[1]


@dataclasses.dataclass(frozen=True)
class ComputeRates:
    """What a device reaches, as opposed to its datasheet peak."""

    flops: float
    """FLOP/s of a 3x3 convolution in fp32 (TF32 where PyTorch lets cuDNN use it): its forward
    on a GPU, forward and both gradients on a CPU (Note [A CPU's rates are measured])."""
    flops_half: float
    """FLOP/s of the same convolution in bf16."""
    bandwidth_gbps: float
    """GB/s of memory traffic of an elementwise add (two reads and a write)."""


def _seconds_per_call(fn: Callable[[], Any], device: torch.device, at_least_s: float) -> float:
    """Seconds one ``fn()`` takes, from as many calls as fill ``at_least_s`` (3 or more)."""

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    fn()  # warm-up: kernel choice, allocation
    sync()
    calls, start = 0, time.perf_counter()
    while True:
        fn()
        calls += 1
        if calls >= 3:
            sync()
            elapsed = time.perf_counter() - start
            if elapsed >= at_least_s:
                return elapsed / calls


def measure_compute(device: torch.device, at_least_s: float = 0.05) -> ComputeRates:
    """Time a convolution (fp32 and bf16) and an elementwise add on ``device``.

    Note: [Why measure compute]
    The simulator prices an op at the larger of its FLOPs over the compute rate and its bytes
    over the memory bandwidth. At datasheet peaks, compute looks several times faster than the
    kernels run, so copies look harder to hide than they are: on one H100 a ResNet50 step at
    8000 px was predicted to wait for copies for 5.7 times its compute and measured 1.7 ms of
    waiting in three steps. A 3x3 convolution of 64 channels at 128x128 is the shape that
    dominates the zoo's convolutional nets; the add is the memory-bound op (batch norm,
    activations) at its best.
    """
    with torch.no_grad(), torch.autocast(device.type, enabled=False):
        return _measure_compute(device, at_least_s)


def _measure_compute(device: torch.device, at_least_s: float) -> ComputeRates:
    half = torch.bfloat16
    cuda = device.type == "cuda"
    batch = 8 if cuda else 1
    inputs = {
        dtype: (
            torch.randn(batch, 64, 128, 128, device=device, dtype=dtype),
            torch.randn(64, 64, 3, 3, device=device, dtype=dtype),
        )
        for dtype in (torch.float32, half)
    }
    flops = 2 * batch * 64 * 128 * 128 * 64 * 9
    conv = {}
    for dtype, (x, w) in inputs.items():
        call = functools.partial(torch.nn.functional.conv2d, x, w, padding=1)
        if cuda:
            conv[dtype] = flops / _seconds_per_call(call, device, at_least_s)
        else:  # Note [A CPU's rates are measured]: forward and both gradients
            both = _with_gradients(call, x, w)
            conv[dtype] = 3 * flops / _seconds_per_call(both, device, at_least_s)
    del inputs
    numel = (16 if cuda else 4) * 1024**2
    a, b = (torch.randn(numel, device=device) for _ in range(2))
    out = torch.empty_like(a)
    seconds = _seconds_per_call(lambda: torch.add(a, b, out=out), device, at_least_s)
    return ComputeRates(conv[torch.float32], conv[half], 3 * 4 * numel / seconds / 1e9)


def _with_gradients(
    conv: Callable[[], torch.Tensor], x: torch.Tensor, w: torch.Tensor
) -> Callable[[], Any]:
    """``conv``, then its input's and weight's gradients from an output gradient of ones."""
    x.requires_grad_(True)
    w.requires_grad_(True)

    def both() -> Any:
        with torch.enable_grad():
            out = conv()
            return torch.autograd.grad(out, (x, w), torch.ones_like(out))

    return both


_MEASURED: dict[tuple[int, bool], tuple[float, float, ComputeRates]] = {}
"""Link and compute rates measured in this process, by GPU index and whether TF32 is allowed."""

_MEASURED_CPU: dict[int, tuple[ComputeRates, float, float, float | None, float | None]] = {}
"""Compute rates of this CPU, its spill files' write and read rates, and its fresh pages' rates
as ops write them and as reads fill them (GB/s), measured in this process, by PyTorch's
intra-op thread count: rates, laid over the table's "cpu" entry at each call, so that the
entry's other figures stay the table's."""


def measure_spill_gbps(
    spill_dir: str | None = None, files: int = 4, nbytes: int = 16 * 1024**2
) -> tuple[float, float, float | None]:
    """Rates (GB/s) of spill files in ``spill_dir`` (None: the system's temporary folder), as
    the runtime moves them, each the median of three rounds: ``files`` files of ``nbytes``
    written, then read back into memory written before, by the spill store's thread; and the
    rate at which a read back first writes memory mapped anew for it, on top of that read
    (Note [Reads back into fresh pages]: a file of `FRESH_PAGES_BYTES` read into fresh memory
    against into memory written before; None where that costs nothing more).

    Raises:
        SpillError: the folder is not usable or has not room for them.
    """
    from lms.runtime.disk import SpillStore

    data = [torch.full((nbytes,), k, dtype=torch.uint8) for k in range(files)]
    targets = [torch.zeros_like(chunk) for chunk in data]
    large = torch.ones(FRESH_PAGES_BYTES, dtype=torch.uint8)
    warm = torch.zeros_like(large)
    store = SpillStore(spill_dir)
    rounds = []
    try:
        store.write(files, large).result()
        for _ in range(3):
            start = time.perf_counter()
            for write in [store.write(k, chunk) for k, chunk in enumerate(data)]:
                write.result()
            written = time.perf_counter()
            for read in [store.read(k, into) for k, into in enumerate(targets)]:
                read.result()
            done = time.perf_counter()
            for k in range(files):
                store.delete(k, nbytes)
            store.read(files, warm).result()
            fresh = time.perf_counter()
            store.read(files, torch.empty_like(large)).result()
            faults = (time.perf_counter() - fresh) - (fresh - done)
            rounds.append((written - start, done - written, faults))
    finally:
        store.close()
    moved = files * nbytes / 1e9
    faults = statistics.median(f for _, _, f in rounds)
    return (
        moved / statistics.median(w for w, _, _ in rounds),
        moved / statistics.median(r for _, r, _ in rounds),
        FRESH_PAGES_BYTES / faults / 1e9 if faults > 0 else None,
    )


def measure_fresh_memory_gbps(pairs: int = 9) -> float | None:
    """GB/s at which this CPU first writes memory the allocator maps anew, on top of writing
    memory written before (Note [Fresh pages on a CPU]): an add into a fresh output of
    `FRESH_PAGES_BYTES` against one into the same output again, timed in ``pairs`` pairs (the
    median of their differences: a shared machine's noise is of the size of the difference);
    None where the fresh one costs nothing more."""
    numel = FRESH_PAGES_BYTES // 4
    a, b = torch.randn(numel), torch.randn(numel)
    out = torch.add(a, b)
    extra = []
    with torch.no_grad():
        for _ in range(pairs + 1):  # the first pair warms up
            start = time.perf_counter()
            torch.add(a, b)
            fresh = time.perf_counter()
            torch.add(a, b, out=out)
            extra.append(2 * fresh - start - time.perf_counter())
    seconds = statistics.median(extra[1:])
    return FRESH_PAGES_BYTES / seconds / 1e9 if seconds > 0 else None


# Note: [A CPU's rates are measured]
# The table's "cpu" entry is a guess for any CPU (60 GFLOP/s fp32, 30 bf16, 15 GB/s), and this
# project's 2-core AVX-512 machine beats it by 3x in single precision and 10x in bfloat16: a
# convolution's forward and both gradients (64 channels, 3x3, 128x128) reach 150 to 180 GFLOP/s
# fp32 and 270 to 300 bf16, its add 40 to 90 GB/s. Priced at the entry, steps of the seed's four
# models without offload were predicted 2 to 10 times as long as they ran (the demo's ResNet50
# at 512 px, batch 2: 4.6 s against 1.8); at these rates and with fresh pages priced (below),
# within -31% to +16% of their runs in two rounds (ResNet50 at 512 px +1% and +8%, at 256 px
# batch 4 -16% and -10%, at 384 px under bfloat16 +9% and +16%; GoogLeNet -29% and -31%, its
# many small ops; DeepLabV3 -8% and +4%; the 3D U-Net -20% and -10%, under bfloat16 +1% and
# +10%). The forward alone runs faster than a step's mix (120 to 200 GFLOP/s fp32),
# hence both gradients here; a GPU's rates stay its forward's (Note [Why measure compute]). The
# link is the spill store's own write and read rates, into the page cache and back into memory
# written before (5 and 12 GB/s here, where the entry has 1.5 and 3; the entry's where the
# temporary folder refuses them), with the faults of reads into fresh memory on top (2.7 GB/s:
# Note [Reads back into fresh pages]), and copies take compute's cores while its threads fill
# them (Note [Copies on a CPU take its cores]); the rate of first writes to fresh pages is
# measured too (Note [Fresh pages on a CPU]). Each rate is the median of three rounds: rounds
# on a shared machine vary by a third, and so do its steps. A plan tuned for this CPU then prices
# its step's ops at their own times where it can (Note [Ops timed on the device]).
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
    budget and kernel settings (`lms.timing.backend_settings`), so that tuning the same step
    twice prices it alike, as the rates are (the last 16 kept)."""
    settings = tuple(sorted(backend_settings().items()))
    key = (trace.fingerprint(), str(device), budget, settings)
    if key not in _TIMED:
        while len(_TIMED) >= 16:
            del _TIMED[next(iter(_TIMED))]
        _TIMED[key] = time_ops(trace, device, max_bytes=budget)
    return spec.with_op_timings(_TIMED[key])


def _cores() -> int:
    """The CPUs this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


# Note: [The allocator's slack]
# A budget caps what the CUDA caching allocator reserves (`set_per_process_memory_fraction`
# counts reserved memory), and the allocator reserves more than the tensors it holds: parts of its
# blocks that no tensor fits at the moment. With expandable segments it held 100 to 149 MiB so at
# four failures of ResNet50 on an H100 capped at 32 GiB; at 8000 px a plan simulated at 31.955
# GiB had 30.05 GiB allocated and 0.145 GiB idle when it asked for 1.91 more, 0.1 GiB over the
# cap. A plan tuned for a CUDA device leaves that room too: the margin for library workspaces
# grows by `ALLOCATOR_SLACK_BYTES`. The named specs (the sweeps' V100 and H100) keep the
# workspace margin alone, as the seed's figures had an allocator of their own.
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


def tune_plan(
    model: torch.nn.Module,
    batch: Any,
    step_fn: StepFn | None,
    *,
    budget_bytes: int | None,
    min_offload_bytes: int,
    autocast: torch.dtype | None = None,
    cache_dir: str | None = None,
    planner: Callable[..., Plan] | None = None,
    tier: str = "auto",
    host_budget_bytes: int | None = None,
    spill_dir: str | None = None,
    free_held: bool = False,
) -> Plan:
    """Trace ``step_fn(model, batch)`` under fake tensors and plan it for the model's device.

    A plan for the same step, budget and device found in ``cache_dir`` (else ``$LMS_CACHE_DIR``,
    else ``~/.cache/lms/plans``) is used instead of tuned, if it still fits (`lms.cache`).
    On a GPU, offloaded data beyond ``host_budget_bytes`` is planned into spill files (tier
    "auto"), or refused (tier "host"). ``free_held``: the plan may empty what the step's code
    holds (`lms.LMSConfig.free_held`).

    Raises:
        PlanInfeasibleError: when no plan fits the device budget.
        HostMemoryError: tier "host", when the offloaded data cannot fit in the host budget.
        SpillError: when the spill files the plan needs do not fit on the spill disk.
    """
    from lms.planning import plan_auto

    param = next(model.parameters(), None)
    device = param.device if param is not None else torch.device("cpu")
    spec = local_device_spec(device)
    if device.type == "cuda" and tier == "auto":
        spec = spec.with_host_memory(host_budget_bytes)
    budget = spec.memory_bytes if budget_bytes is None else budget_bytes
    started = time.perf_counter()
    trace = trace_step(
        model,
        batch,
        step_fn,
        device=device,
        autocast=autocast,
        min_offload_bytes=min_offload_bytes,
        name=type(model).__name__,
    )
    half = autocast is not None
    choose: Any = planner or plan_auto
    if device.type == "cuda":  # the card, not its measured rates, which vary run to run
        card = torch.cuda.get_device_properties(device)
        where = f"{card.name}:{card.total_memory}:{spec.host_memory_bytes}"
    else:
        where = spec.name
    chooser = getattr(choose, "__qualname__", type(choose).__qualname__)
    setting = (where, lms.__version__, planner_code(), half, chooser, *(["free_held"] * free_held))
    path = cache_path(cache_folder(cache_dir), trace, budget, setting)
    loaded = load_cached(path, trace, spec, budget, half=half)
    if loaded is not None:
        plan = loaded
    else:
        spec = with_local_timings(spec, trace, device, budget)
        if trace.compiled:
            log.info(
                "[LMS] The model or the step is compiled: its plan recomputes nothing, since "
                "a replay would run it uncompiled (Note [Compiled models are not replayed])"
            )
        options = {"free_held": True} if free_held else {}
        plan = choose(trace, spec, budget, half=half, **options)
        # Note [The first step prefetches in the traced order]
        plan = dataclasses.replace(plan, use_order=trace.use_order)
    # A cached plan too: the host budget and the spill disk's free space may differ now.
    check_offload_room(
        trace,
        plan,
        spec,
        half=half,
        host_budget_bytes=host_budget_bytes if device.type == "cuda" and tier == "host" else None,
        spill_dir=spill_dir,
        spills=tier != "host",
    )
    if loaded is not None:
        log.info("[LMS] Loaded the plan for this step from %s", path)
        return plan
    save_plan(plan, path)
    log.info(
        "[LMS] Tuned in %.2f s: offload %d of %d saved storages, predicted peak %.2f GiB, "
        "overhead %+.1f%%; saved to %s",
        time.perf_counter() - started,
        len(plan.offload),
        plan.num_entries,
        plan.predicted_peak_bytes / 1024**3,
        100 * plan.predicted_overhead,
        path,
    )
    return plan


def check_offload_room(
    trace: Trace,
    plan: Plan,
    spec: DeviceSpec,
    *,
    half: bool = False,
    host_budget_bytes: int | None = None,
    spill_dir: str | None = None,
    spills: bool = True,
) -> None:
    """Refuse, before training, a plan whose offloaded data has nowhere to go.

    Args:
        host_budget_bytes: host memory the offloaded copies must fit in (tier "host"); None
            when they may overflow to disk.
        spill_dir: where spill files go (None: the system's temporary folder).
        spills: whether offloaded data may go to spill files at all (not with tier "host").

    Raises:
        HostMemoryError: the copies held in host memory exceed ``host_budget_bytes``.
        SpillError: the spill files exceed the free space of the spill disk.
    """
    result = simulate(trace, plan, spec, half=half)
    if host_budget_bytes is not None and result.host_peak_bytes > host_budget_bytes:
        raise HostMemoryError(
            f"lms: the plan holds up to {format_bytes(result.host_peak_bytes)} of offloaded data "
            f"in host memory, over the host budget of {format_bytes(host_budget_bytes)}; raise "
            "host_budget, use tier='auto' to spill the rest to disk, or raise the device budget"
        )
    on_disk = result.disk_peak_bytes if spec.name != "cpu" else result.host_peak_bytes
    if on_disk and spills:
        folder = spill_dir or tempfile.gettempdir()
        free = shutil.disk_usage(folder).free
        if on_disk > free:
            raise SpillError(
                f"lms: the plan writes up to {format_bytes(on_disk)} of spill files but {folder} "
                f"has {format_bytes(free)} free; point spill_dir at a larger disk, raise the "
                "host budget, or raise the device budget"
            )
    if result.disk_peak_bytes:
        log.info(
            "[LMS] Host memory holds up to %s of offloaded data; %d tensors (%s at most at "
            "once) go to spill files",
            format_bytes(result.host_peak_bytes),
            len(plan.spill),
            format_bytes(result.disk_peak_bytes),
        )
