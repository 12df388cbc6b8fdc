"""Measured rates of the local hardware: the link to host memory, compute, spill files and the
first writes to fresh pages."""

from __future__ import annotations

import dataclasses
import functools
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from lms.core.devices import FRESH_PAGES_BYTES
from lms.core.errors import HostMemoryError
from lms.core.units import format_bytes
from lms.runtime._cuda import pin_host, unpin_host

__all__ = [
    "ComputeRates",
    "measure_compute",
    "measure_fresh_memory_gbps",
    "measure_link_gbps",
    "measure_spill_gbps",
]


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


def _made_up(
    *shape: int, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Values to time ops on, drawn from a generator of their own: measuring a device draws
    nothing from the random streams the user seeded, which the step's dropout then draws from
    as it would have."""
    generator = torch.Generator(device).manual_seed(0)
    return torch.randn(*shape, device=device, dtype=dtype, generator=generator)


def _measure_compute(device: torch.device, at_least_s: float) -> ComputeRates:
    half = torch.bfloat16
    cuda = device.type == "cuda"
    batch = 8 if cuda else 1
    inputs = {
        dtype: (
            _made_up(batch, 64, 128, 128, device=device, dtype=dtype),
            _made_up(64, 64, 3, 3, device=device, dtype=dtype),
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
    a, b = (_made_up(numel, device=device) for _ in range(2))
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


def measure_spill_gbps(
    spill_dir: str | None = None, files: int = 4, nbytes: int = 16 * 1024**2
) -> tuple[float, float, float | None]:
    """Rates (GB/s) of spill files in ``spill_dir`` (None: the system's temporary folder), as
    the runtime moves them, each the median of three rounds: ``files`` files of ``nbytes``
    written, then read back into memory written before, by the spill store's thread; and the
    rate at which a read back first writes memory mapped anew for it, on top of that read
    (Note [Fresh pages]: a file of `FRESH_PAGES_BYTES` read into fresh memory
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
    memory written before (Note [Fresh pages]): an add into a fresh output of
    `FRESH_PAGES_BYTES` against one into the same output again, timed in ``pairs`` pairs (the
    median of their differences: a shared machine's noise is of the size of the difference);
    None where the fresh one costs nothing more."""
    numel = FRESH_PAGES_BYTES // 4
    a, b = _made_up(numel), _made_up(numel)
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
