"""What checking spill files costs: the xxh3 digest's rate beside the spill store's own read rate.

Writes 32 MiB files through `lms.runtime.disk.SpillStore` (each digested as it is written and
checked as it is read back) and reads them back, then times the digest alone over the same
bytes. Prints the rates and the share of a read the check takes; writes JSON.

    .venv/bin/python benchmarks/checksum.py [--out benchmarks/results/checksum_cpu.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time

import torch
import xxhash

from lms.runtime.disk import SpillStore

NBYTES = 32 * 1024**2
FILES = 8
ROUNDS = 5


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="benchmarks/results/checksum_cpu.json")
    args = parser.parse_args()
    data = [torch.randint(0, 256, (NBYTES,), dtype=torch.uint8) for _ in range(FILES)]
    back = [torch.empty(NBYTES, dtype=torch.uint8) for _ in range(FILES)]
    reads, digests = [], []
    with tempfile.TemporaryDirectory() as folder:
        store = SpillStore(folder)
        for key, tensor in enumerate(data):
            store.write(key, tensor).result()
        for _ in range(ROUNDS):
            start = time.perf_counter()
            for future in [store.read(key, back[key]) for key in range(FILES)]:
                future.result()
            reads.append(FILES * NBYTES / (time.perf_counter() - start) / 1e9)
            start = time.perf_counter()
            for tensor in back:
                xxhash.xxh3_64_intdigest(tensor.numpy())
            digests.append(FILES * NBYTES / (time.perf_counter() - start) / 1e9)
        store.close()
    read = statistics.median(reads)
    digest = statistics.median(digests)
    # A checked read: the read with the digest in it; the digest alone over the same bytes.
    share = read / digest
    result = {
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.python_version()}",
        "file_bytes": NBYTES,
        "files": FILES,
        "rounds": ROUNDS,
        "checked_read_gbps": read,
        "digest_gbps": digest,
        "digest_share_of_checked_read": share,
        "checked_read_gbps_rounds": reads,
        "digest_gbps_rounds": digests,
    }
    print(
        f"checked spill read {read:.2f} GB/s (page cache), xxh3 alone {digest:.2f} GB/s: "
        f"the check is {share:.0%} of a checked read's time"
    )
    with open(args.out, "w") as handle:
        json.dump(result, handle, indent=1)


if __name__ == "__main__":
    main()
