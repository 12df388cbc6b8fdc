"""Plan a step for a GPU this machine does not have: trace with fake tensors, simulate a V100
limited to 4 GiB, and print the plan and its predicted cost (nothing is allocated at full size).

    python examples/plan_for_another_gpu.py
"""

import torch
from torch import nn

import lms


def main() -> None:
    blocks = [nn.TransformerEncoderLayer(1024, 16, 4096, batch_first=True) for _ in range(4)]
    model = nn.Sequential(*blocks)
    report = lms.analyze(
        model,
        lambda: [torch.randn(4, 1024, 1024)],
        gpu_memory="4GiB",
        device_spec="v100-32gb",
    )
    for line in report.lines():
        print(line)


if __name__ == "__main__":
    main()
