"""Fit a LightningModule under a memory budget with one callback: the first training batch is
traced and planned before it trains, so a budget no plan fits fails before any weight changes.

    python examples/lightning_fit.py      # needs large-model-support[lightning]
"""

import lightning.pytorch as pl
import torch
from torch import nn

import lms
from lms.integrations.lightning import LMSCallback


class Net(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        for channels in (3, 32, 32, 32, 32):
            layers += [nn.Conv2d(channels, 32, 3, padding=1), nn.ReLU()]
        self.model = nn.Sequential(
            *layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 10)
        )

    def training_step(self, batch: list[torch.Tensor], index: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self.model(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def main() -> None:
    torch.manual_seed(0)
    x, y = torch.randn(8, 3, 128, 128), torch.randint(0, 10, (8,))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=2)
    net = Net()

    def step(model: nn.Module, batch: list[torch.Tensor]) -> None:
        nn.functional.cross_entropy(model(batch[0]), batch[1]).backward()

    report = lms.analyze(net.model, [x[:2], y[:2]], step, gpu_memory="1GiB", device_spec="cpu")
    callback = LMSCallback(budget=int(0.7 * report.plain.peak_bytes))
    trainer = pl.Trainer(
        max_epochs=1,
        accelerator="cpu",
        callbacks=[callback],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(net, loader)
    assert callback.lms is not None and callback.lms.plan is not None
    stats = callback.lms.stats
    print(f"fit {stats.steps} batches under LMS; offloaded {stats.offloaded_bytes} B")


if __name__ == "__main__":
    main()
