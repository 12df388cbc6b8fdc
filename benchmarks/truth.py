"""Step records of the cases the simulator must predict, each replayed beside what it measured.

Each case is `lms train --record` in a process of its own (on a card, the images and volumes
capped at 32 GiB as the seed's V100); then every record is replayed (`lms.report.replay`) and
the summary written beside the records: measured against predicted step time and peak, the
plan's own prediction, the no-offload step it was priced against and the floor. On a card the
cases are the seed's (ResNet50 at 4000, 8000 and 12650 px, the 3D U-Net at 256^3 and 368^3, a
GPT-2 medium at 60% of its peak); on a CPU, the same kinds of case at sizes a CPU runs in
seconds, on the disk tier.

    python benchmarks/truth.py --out benchmarks/results/records-cpu
    python benchmarks/truth.py --out DIR --only resnet50_8000   # some cases

Each case may run on into the time the cases before it left of ``--time-limit``, keeping
`RESERVE_S` for each case still to come; one stopped, the rest go on.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# name, model, size, batch, steps, extra arguments (a budget may be a share of the step's simulated
# peak without offload: "60%").
# The image and volume cases run on the card capped at 32 GiB, as the seed's V100; GPT-2 medium's
# budget, 60% of its plain peak (about 64 GB), is its own cap. The 3D U-Net at 368^3 is 3.6 times
# the voxels of the largest that fits 32 GiB without offload (240^3).
GPU_CASES = [
    ("resnet50_4000_none", "resnet50", 4000, 1, 2, ["--no-lms"]),
    ("resnet50_4000_lms", "resnet50", 4000, 1, 2, ["--budget", "32GiB"]),
    ("resnet50_8000_lms", "resnet50", 8000, 1, 2, ["--budget", "32GiB"]),
    ("unet3d_256_lms", "unet3d", 256, 1, 2, ["--budget", "32GiB"]),
    ("gpt2_1024_lms", "gpt2", 1024, 12, 2, ["--budget", "60%"]),
    ("resnet50_12650_lms", "resnet50", 12650, 1, 2, ["--budget", "32GiB", "--free-held"]),
    ("unet3d_368_lms", "unet3d", 368, 1, 2, ["--budget", "32GiB", "--free-held"]),
]
UNCAPPED = ("gpt2",)
RESERVE_S = 25.0
"""Seconds kept for each case still to come: a case may run on into what the others left."""
CPU_CASES = [
    ("resnet50_224_none", "resnet50", 224, 1, 3, ["--no-lms"]),
    ("resnet50_320_lms", "resnet50", 320, 1, 3, ["--budget", "70%"]),
    ("unet3d_64_lms", "unet3d", 64, 1, 3, ["--budget", "60%"]),
    ("tinylm_2048_lms", "tinylm", 2048, 1, 3, ["--budget", "60%"]),
]
CAP = (
    "import sys, torch; from lms.cli import main; "
    "torch.cuda.set_per_process_memory_fraction("
    "32 * 2**30 / torch.cuda.get_device_properties(0).total_memory); "
    "sys.exit(main(sys.argv[1:]))"
)


def _arguments(case: tuple, out: str) -> list[str]:
    name, model, size, batch, steps, extra = case
    size_flag = "--seq-len" if model in ("tinylm", "gpt2", "llama") else "--image-size"
    return [  # not quiet: what a case said before it failed or was stopped is kept
        "train",
        "--model",
        model,
        size_flag,
        str(size),
        "--batch-size",
        str(batch),
        "--steps",
        str(steps),
        "--record",
        os.path.join(out, f"{name}.json.gz"),
        *extra,
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="folder for the records and summary.json")
    parser.add_argument("--only", default="", help="comma-separated case names")
    parser.add_argument("--time-limit", type=float, default=330.0, help="seconds for all cases")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    cuda = torch.cuda.is_available()
    cases = GPU_CASES if cuda else CPU_CASES
    if args.only:
        wanted = set(args.only.split(","))
        cases = [case for case in cases if case[0] in wanted]
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    started = time.perf_counter()
    ran: dict[str, dict] = {}
    for index, case in enumerate(cases):
        left = args.time_limit - (time.perf_counter() - started)
        share = left - RESERVE_S * (len(cases) - index - 1)
        if share < 20:
            ran[case[0]] = {"ok": False, "why": "no time left"}
            continue
        argv = _arguments(case, args.out)
        capped = cuda and case[1] not in UNCAPPED
        command = [sys.executable, *(["-c", CAP] if capped else ["-m", "lms"]), *argv]
        began = time.perf_counter()
        try:
            done = subprocess.run(command, env=env, timeout=share, capture_output=True, text=True)
            ok = done.returncode == 0
            why = "" if ok else done.stderr[-2000:]
        except subprocess.TimeoutExpired as stopped:  # with what it said by then
            said = stopped.stderr or ""
            said = said.decode(errors="replace") if isinstance(said, bytes) else said
            ok, why = False, f"stopped after {share:.0f} s; it said last:\n{said[-2000:]}"
        ran[case[0]] = {"ok": ok, "seconds": time.perf_counter() - began, "why": why}
        print(f"{case[0]}: {'recorded' if ok else 'failed'} in {ran[case[0]]['seconds']:.0f} s")
        if why:
            print(why, flush=True)
    summary = {"device": torch.cuda.get_device_name(0) if cuda else "cpu", "cases": {}}
    from lms.core.steprecord import load_record
    from lms.report.replay import format_replay, replay

    for name, status in ran.items():
        path = os.path.join(args.out, f"{name}.json.gz")
        entry = dict(status)
        if status["ok"] and os.path.exists(path):
            result = replay(load_record(path))
            print(format_replay(result))
            entry.update(result.as_dict())
            entry["record_bytes"] = os.path.getsize(path)
        summary["cases"][name] = entry
    with open(os.path.join(args.out, "summary.json"), "w") as handle:
        json.dump(summary, handle, indent=1)
    return 0 if all(s["ok"] for s in ran.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
