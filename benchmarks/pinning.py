"""Pinned host buffers on a CUDA machine: PyTorch's pinned allocator against the pool's (Note
[Pinned to the byte]), for the sizes of ResNet50's activations at 12650 px.

For each size, side by side: the seconds to get a page-locked buffer and the bytes locked, from
``torch.empty(pin_memory=True)`` (rounded up to a power of two, and kept pinned in PyTorch's cache
after it is freed), from `lms.runtime._cuda.pin_host` (the exact size, its pages faulted in on
PyTorch's intra-op threads first), and from the same registration without that first touch; then
the copy rate from the device into each. Writes JSON.

    python benchmarks/pinning.py [--sizes-mib 2442,9766] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from lms.runtime import _cuda


def _torch_pinned_bytes() -> int | None:
    """Bytes PyTorch's pinned allocator holds, rounded blocks cached or in use (its statistic's
    name differs between versions); None where this PyTorch reports neither."""
    stats = torch.cuda.host_memory_stats()
    return stats.get("reserved_bytes.current", stats.get("allocated_bytes.current"))


def _timed(make):
    torch.cuda.synchronize()
    start = time.perf_counter()
    buf = make()
    return buf, time.perf_counter() - start


def _register_untouched(nbytes: int) -> torch.Tensor:
    buf = _cuda.page_aligned(nbytes)
    torch.cuda.check_error(torch.cuda.cudart().cudaHostRegister(buf.data_ptr(), nbytes, 0))
    return buf


def _d2h_gbps(dst: torch.Tensor, src: torch.Tensor) -> float:
    dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    start = time.perf_counter()
    dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    return src.numel() / (time.perf_counter() - start) / 1e9


def measure(nbytes: int) -> dict:
    """One size: each way of pinning, timed, its bytes, and the copy rate into it."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    row: dict = {"bytes": nbytes}
    before = _torch_pinned_bytes()
    buf, seconds = _timed(lambda: torch.empty(nbytes, dtype=torch.uint8, pin_memory=True))
    after = _torch_pinned_bytes()
    reserved = None if before is None or after is None else after - before
    row["torch"] = {"s": seconds, "pinned_bytes": reserved, "d2h_gbps": _d2h_gbps(buf, src)}
    del buf
    getattr(torch._C, "_host_emptyCache", lambda: None)()  # PyTorch's cache lets it go
    for name, make in (("lms", _cuda.pin_host), ("register_untouched", _register_untouched)):
        buf, seconds = _timed(lambda make=make: make(nbytes))
        assert buf is not None, "the host refused to pin"
        row[name] = {"s": seconds, "pinned_bytes": nbytes, "d2h_gbps": _d2h_gbps(buf, src)}
        _cuda.unpin_host(buf)
        del buf
    return row


def _gib(nbytes: int | None) -> str:
    return "? GiB" if nbytes is None else f"{nbytes / 1024**3:.2f} GiB"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    # 64 x 6325^2 fp32 (the stem's output) and 64 x 3163^2 fp32 (layer1's narrow activations)
    parser.add_argument("--sizes-mib", default="2442,9766")
    parser.add_argument("--json")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("pinning: needs a CUDA device")
    rows = [measure(int(mib) * 1024**2) for mib in args.sizes_mib.split(",")]
    result = {
        "gpu": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "sizes": rows,
    }
    for row in rows:
        print(
            f"{row['bytes'] / 1024**3:.2f} GiB: "
            + ", ".join(
                f"{name} {row[name]['s']:.2f} s, {_gib(row[name]['pinned_bytes'])} pinned, "
                f"{row[name]['d2h_gbps']:.1f} GB/s in"
                for name in ("torch", "lms", "register_untouched")
            )
        )
    if args.json:
        with open(args.json, "w") as file:
            json.dump(result, file, indent=2)


if __name__ == "__main__":
    main()
