"""What the spill store's I/O thread costs the step's thread through the interpreter lock.

A thread copies, digests or writes 64 MiB again and again while the main thread runs a pure
Python loop; the loop's time beside each, against its time alone, says whether that work holds
the lock (the loop then slows) or lets go of it (the loop keeps its pace). The copies are the
two ways a spill file's chunk can be copied into the store's buffer: a memoryview slice
assignment and `ctypes.memmove`. Then the store itself writes 64 files of 2 MiB beside the loop.

    .venv/bin/python benchmarks/io_lock.py [--out benchmarks/results/io_lock_cpu.json]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import platform
import statistics
import tempfile
import threading
import time
from collections.abc import Callable

import torch
import xxhash

from lms.runtime.disk import SpillStore

NBYTES = 64 * 1024**2
ROUNDS = 5
LOOP = 6_000_000


def _loop() -> float:
    started = time.perf_counter()
    total = 0
    for i in range(LOOP):
        total += i
    return time.perf_counter() - started


def _beside(work: Callable[[], None]) -> tuple[float, int]:
    """The loop's seconds while ``work`` runs over and over on a thread, and how often it ran."""
    stop = threading.Event()
    runs = [0]

    def again() -> None:
        while not stop.is_set():
            work()
            runs[0] += 1

    thread = threading.Thread(target=again)
    thread.start()
    try:
        return _loop(), runs[0]
    finally:
        stop.set()
        thread.join()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="benchmarks/results/io_lock_cpu.json")
    args = parser.parse_args()
    source = bytearray(os.urandom(1024) * (NBYTES // 1024))
    target = mmap.mmap(-1, NBYTES)
    view = memoryview(target)
    into = ctypes.addressof(ctypes.c_char.from_buffer(target))
    start = ctypes.addressof((ctypes.c_char * NBYTES).from_buffer(source))

    def slice_copy() -> None:
        view[:] = source

    def memmove() -> None:
        ctypes.memmove(into, start, NBYTES)

    def digest() -> None:
        xxhash.xxh3_64_intdigest(view)

    chunks = [torch.randint(0, 256, (2 * 1024**2,), dtype=torch.uint8) for _ in range(64)]
    with tempfile.TemporaryDirectory() as folder:
        store = SpillStore(folder)
        written = [0]

        def spill() -> None:
            base = written[0]
            for future in [store.write(base + k, chunk) for k, chunk in enumerate(chunks)]:
                future.result()
            for k, chunk in enumerate(chunks):
                store.delete(base + k, chunk.numel())
            written[0] += len(chunks)

        kinds = {"slice_copy": slice_copy, "memmove": memmove, "xxh3": digest, "store": spill}
        alone, beside = [], {kind: [] for kind in kinds}
        for _ in range(ROUNDS):
            alone.append(_loop())
            for kind, work in kinds.items():
                beside[kind].append(_beside(work)[0])
        store.close()
    result = {
        "machine": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "loop_alone_s": statistics.median(alone),
        "loop_beside_s": {kind: statistics.median(times) for kind, times in beside.items()},
    }
    for kind, seconds in result["loop_beside_s"].items():
        print(f"{kind:10s} loop {seconds:.3f} s beside it, {result['loop_alone_s']:.3f} s alone")
    with open(args.out, "w") as out:
        json.dump(result, out, indent=1)
        out.write("\n")


if __name__ == "__main__":
    main()
