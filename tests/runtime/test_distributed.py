"""Data parallel: each process runs its own LMS around a DistributedDataParallel step (gloo)."""

import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn

import lms
from tests.conftest import same_bits

WORLD = 2


class Residual(nn.Module):
    def __init__(self, channels=8):
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, padding=1)
        self.norm = nn.BatchNorm2d(channels)

    def forward(self, x):
        return x + torch.relu(self.norm(self.conv(x)))


def _model():
    torch.manual_seed(0)
    return nn.Sequential(*[Residual() for _ in range(4)], nn.Flatten(), nn.Linear(8 * 32 * 32, 10))


def _step(model, batch):
    images, labels = batch
    loss = nn.functional.cross_entropy(model(images), labels)
    loss.backward()
    return loss


def _worker(rank, folder, offloaded):
    dist.init_process_group(
        "gloo", init_method=f"file://{folder}/rendezvous", rank=rank, world_size=WORLD
    )
    try:
        model = _model()
        parallel = nn.parallel.DistributedDataParallel(model)
        generator = torch.Generator().manual_seed(rank)  # each rank its own shard
        batch = [torch.randn(4, 8, 32, 32, generator=generator), torch.randint(0, 10, (4,))]
        optimizer = torch.optim.SGD(parallel.parameters(), lr=0.1)
        offload = None
        if offloaded:
            spill = os.path.join(folder, f"spill{rank}")
            os.mkdir(spill)
            offload = lms.LMS(budget="2MiB", min_offload_bytes=0, spill_dir=spill)
            offload.tune(model, batch, _step, cache_dir=os.path.join(folder, f"plans{rank}"))
        for _ in range(2):
            optimizer.zero_grad()
            with (
                offload
                if offload is not None
                else torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)
            ):
                _step(parallel, batch)
            optimizer.step()
        report = {"params": [p.detach() for p in model.parameters()]}
        if offload is not None:
            report["plan"] = offload.plan
            report["stats"] = offload.stats
            offload.close()
            report["spill_files"] = os.listdir(os.path.join(folder, f"spill{rank}"))
        torch.save(report, os.path.join(folder, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def _fit(folder, offloaded):
    os.makedirs(folder)
    mp.spawn(_worker, args=(folder, offloaded), nprocs=WORLD)
    return [torch.load(os.path.join(folder, f"rank{r}.pt"), weights_only=False) for r in range(2)]


def test_data_parallel_steps_are_bitwise_and_follow_each_plan(tmp_path):
    plain = _fit(str(tmp_path / "plain"), offloaded=False)
    ranks = _fit(str(tmp_path / "lms"), offloaded=True)
    for rank, report in enumerate(ranks):
        plan, stats = report["plan"], report["stats"]
        assert plan.offload, "the budget is meant to make the plan move tensors"
        assert stats.offloaded_tensors == 2 * len(plan.offload), rank  # followed, not diverged
        assert report["spill_files"] == []
        for a, b in zip(plain[rank]["params"], report["params"], strict=True):
            assert same_bits(a, b)
