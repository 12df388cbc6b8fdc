"""How close the simulator's step time comes to a measured step, on this machine's device.

For each of the seed's models (a few sizes that fit without offload), one step is traced, priced
two ways and run for real:
- rates: each op at the larger of its FLOPs over the measured convolution rate and its bytes
  over the measured add's (`lms.orchestration.local.local_device_spec`);
- timed: each distinct call run alone on real tensors of its shapes (`time_ops`,
  Note [Ops timed on the device]).
The measured step is the median of ``--steps`` steps after a warm-up. Rates and timings are
measured in this process, once for the rates and once for each trace.

    python benchmarks/step_time.py [--steps 3] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from lms.analysis import simulate, trace_step
from lms.core.devices import DeviceSpec
from lms.harness.zoo import zoo_model
from lms.orchestration.local import local_device_spec
from lms.orchestration.timing import time_ops

CASES = (  # model, size, batch, bf16 autocast, channels last
    ("resnet50", 512, 2, False, True),
    ("resnet50", 256, 4, False, False),
    ("resnet50", 384, 2, True, True),
    ("googlenet", 384, 2, False, False),
    ("deeplabv3", 256, 2, False, False),
    ("unet3d", 64, 1, False, False),
    ("unet3d", 64, 1, True, False),
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    spec = local_device_spec(device)
    rows = []
    for name, size, batch, amp, last in CASES:
        rows.append(_case(device, spec, name, size, batch, amp, last, steps=args.steps))
        row = rows[-1]
        print(
            f"{name} {size} batch {batch}{' bf16' if amp else ''}: measured "
            f"{row['measured_s']:.3f} s; rates {row['rates_s']:.3f} s "
            f"({row['rates_s'] / row['measured_s'] - 1:+.0%}); timed {row['timed_s']:.3f} s "
            f"({row['timed_s'] / row['measured_s'] - 1:+.0%}), timing took "
            f"{row['timing_s']:.1f} s",
            flush=True,
        )
    if args.json:
        info = {"device": str(device), "torch": torch.__version__, "cases": rows}
        with open(args.json, "w") as out:
            json.dump(info, out, indent=2)


def _case(
    device: torch.device,
    spec: DeviceSpec,
    name: str,
    size: int,
    batch: int,
    amp: bool,
    last: bool,
    *,
    steps: int,
) -> dict[str, object]:
    torch.manual_seed(0)
    entry = zoo_model(name)
    fmt = torch.channels_last if last else torch.contiguous_format
    model = entry.build().to(device)
    model = model.to(memory_format=fmt) if last else model

    def make_batch() -> list[torch.Tensor]:
        images, labels = entry.make_batch(size, batch)
        return [images.contiguous(memory_format=fmt) if last else images, labels]

    autocast = torch.bfloat16 if amp else None
    trace = trace_step(model, make_batch, entry.step_fn, device=device, autocast=autocast)
    started = time.perf_counter()
    timings = time_ops(trace, device)
    timing_s = time.perf_counter() - started
    rates = simulate(trace, None, spec, half=amp).base_step_s
    timed = simulate(trace, None, spec.with_op_timings(timings), half=amp).base_step_s
    inputs = [t.to(device) for t in make_batch()]
    seconds = []
    for _ in range(steps + 1):  # the first warms up
        start = time.perf_counter()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=amp):
            entry.step_fn(model, inputs)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        seconds.append(time.perf_counter() - start)
        model.zero_grad(set_to_none=True)
    return {
        "model": name,
        "size": size,
        "batch": batch,
        "bf16": amp,
        "channels_last": last,
        "ops": len(trace.ops),
        "timed_ops": timings.timed,
        "measured_s": statistics.median(seconds[1:]),
        "steps_s": seconds[1:],
        "rates_s": rates,
        "timed_s": timed,
        "timing_s": timing_s,
    }


if __name__ == "__main__":
    main()
