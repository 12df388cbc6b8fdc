"""A soak on the CPU's disk tier: many steps under one `LMS`, everything offloaded to spill files,
and what the process holds sampled as it goes: resident set, open descriptors, threads and spill
files. Each should stay flat after the first steps; the run fails (exit 1) where one grows.

    .venv/bin/python benchmarks/soak.py [--steps 1000] [--out benchmarks/results/soak_cpu.json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import tempfile
import threading
import time

import torch

import lms

EVERY = 100


def _rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _open_spill_files(folder: str) -> int:
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # the listing's own descriptor, closed by now
            count += os.readlink(f"/proc/self/fd/{fd}").startswith(folder)
    return count


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--out", default="benchmarks/results/soak_cpu.json")
    args = parser.parse_args()
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(8)])
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    batch = torch.randn(256, 512)
    with tempfile.TemporaryDirectory() as spill:
        spill = os.path.realpath(spill)
        offload = lms.LMS(tier="disk", spill_dir=spill, swapout_threshold=1)
        samples = []
        start = time.perf_counter()
        for step in range(1, args.steps + 1):
            optimizer.zero_grad(set_to_none=True)
            with offload:
                model(batch).square().mean().backward()
            optimizer.step()
            if step % EVERY == 0 or step == 1:
                samples.append(
                    {
                        "step": step,
                        "rss_bytes": _rss_bytes(),
                        "open_fds": len(os.listdir("/proc/self/fd")),
                        "threads": threading.active_count(),
                        "open_spill_files": _open_spill_files(spill),
                        "named_spill_files": sum(len(f) for _, _, f in os.walk(spill)),
                    }
                )
        seconds = time.perf_counter() - start
        offloaded = offload.stats.offloaded_bytes
        offload.close()
        after_close = _open_spill_files(spill) + sum(len(f) for _, _, f in os.walk(spill))
    steady = samples[1:]  # from step EVERY on
    growth = {
        key: max(s[key] for s in steady) - min(s[key] for s in steady)
        for key in ("rss_bytes", "open_fds", "threads", "open_spill_files", "named_spill_files")
    }
    result = {
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}",
        "steps": args.steps,
        "seconds": seconds,
        "offloaded_bytes": offloaded,
        "samples": samples,
        "range_after_first_samples": growth,
        "spill_files_after_close": after_close,
    }
    with open(args.out, "w") as handle:
        json.dump(result, handle, indent=1)
    print(
        f"{args.steps} steps in {seconds:.1f} s, {offloaded / 1e9:.1f} GB offloaded; from step "
        f"{EVERY} on the resident set ranged {growth['rss_bytes'] / 2**20:.1f} MiB, descriptors "
        f"{growth['open_fds']}, threads {growth['threads']}, open spill files "
        f"{growth['open_spill_files']}; {after_close} spill files after close"
    )
    flat = growth["open_fds"] == 0 and growth["threads"] == 0 and after_close == 0
    return 0 if flat and growth["rss_bytes"] < 32 * 2**20 else 1


if __name__ == "__main__":
    raise SystemExit(main())
