"""Record the steps LMS runs, then replay the record: the plan simulated again at the step's own
op times, beside what the step measured.

    python examples/record_and_replay.py [steps.json.gz]
"""

import sys
import tempfile

import torch

import lms
from lms.core.steprecord import load_record
from lms.report.replay import format_replay, replay

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from train_under_a_budget import model_and_batch, step  # noqa: E402


def main() -> None:
    path = sys.argv[1] if len(sys.argv) > 1 else tempfile.mktemp(suffix=".json.gz")
    model, x, y = model_and_batch()
    report = lms.analyze(model, [x, y], step, gpu_memory="1GiB", device_spec="cpu")
    offload = lms.LMS(budget=int(0.6 * report.plain.peak_bytes))
    offload.tune(model, [x, y], step)
    offload.record_steps()  # every step from here on, op by op
    for _ in range(2):
        model.zero_grad(set_to_none=True)
        with offload:
            step(model, [x, y])
    offload.save_record(path)  # what `lms train --record` writes; `lms replay PATH` reads it
    print(format_replay(replay(load_record(path))))
    offload.close()


if __name__ == "__main__":
    torch.set_num_threads(max(1, torch.get_num_threads()))
    main()
