"""Train a small CNN under a memory budget it does not fit without LMS, on this machine's device.

    python examples/train_under_a_budget.py

On a CPU the budget counts the weights, the batch and the C heap a step takes (spill files hold
what moves); on a GPU, the device's allocation.
"""

import torch
from torch import nn

import lms


def model_and_batch() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for channels in (3, 32, 32, 32, 32, 32):
        layers += [nn.Conv2d(channels, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU()]
    model = nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 10))
    return model, torch.randn(2, 3, 256, 256), torch.randint(0, 10, (2,))


def step(model: nn.Module, batch: list[torch.Tensor]) -> torch.Tensor:
    x, y = batch
    loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()
    return loss


def main() -> None:
    model, x, y = model_and_batch()
    report = lms.analyze(model, [x, y], step, gpu_memory="1GiB", device_spec="cpu")
    budget = int(0.6 * report.plain.peak_bytes)  # 60% of what the step needs without LMS
    offload = lms.LMS(budget=budget)
    offload.tune(model, [x, y], step)  # traced with fake tensors, planned, checked
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(3):
        optimizer.zero_grad(set_to_none=True)
        with offload:
            loss = step(model, [x, y])
        optimizer.step()
    print(
        f"loss {loss.item():.4f}; plan moves {len(offload.plan.offload)} storages and "
        f"recomputes {len(offload.plan.recompute)}; offloaded {offload.stats.offloaded_bytes} B"
    )
    offload.close()


if __name__ == "__main__":
    main()
