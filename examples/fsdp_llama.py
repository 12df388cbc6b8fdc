"""Train a small Llama sharded by FSDP2 over two processes, each under its own LMS budget.

    python examples/fsdp_llama.py

Each process shards every decoder layer and the model with `fully_shard`, tunes its own `LMS`
(FSDP's hooks are lifted while the step is traced; the plan counts each shard and each layer's
gathered weights where FSDP holds them) and trains three steps. Over gloo, on the CPU; on GPUs,
use "nccl" and one device a process.
"""

import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from transformers import LlamaConfig, LlamaForCausalLM

import lms

WORLD = 2


def step(model: torch.nn.Module, batch: list[torch.Tensor]) -> torch.Tensor:
    loss = model(input_ids=batch[0], labels=batch[0]).loss
    loss.backward()
    return loss


def train(rank: int, rendezvous: str) -> None:
    dist.init_process_group("gloo", init_method=rendezvous, rank=rank, world_size=WORLD)
    try:
        torch.manual_seed(0)  # the same weights in every process before sharding
        config = LlamaConfig(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=256,
            max_position_embeddings=256,
        )
        model = LlamaForCausalLM(config)
        mesh = init_device_mesh("cpu", (WORLD,))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        ids = torch.randint(0, 256, (4, 256), generator=torch.Generator().manual_seed(rank))
        # 80% of what this process's step takes at once without LMS, as simulated
        report = lms.analyze(model, [ids], step, gpu_memory="1GiB", device_spec="cpu")
        offload = lms.LMS(budget=int(0.8 * report.plain.peak_bytes))
        offload.tune(model, [ids], step)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        for _ in range(3):
            optimizer.zero_grad(set_to_none=True)
            with offload:
                loss = step(model, [ids])
            optimizer.step()
        print(
            f"rank {rank}: loss {loss.item():.4f}; the plan moves {len(offload.plan.offload)} "
            f"and recomputes {len(offload.plan.recompute)} of its saved storages; "
            f"{offload.stats.offloaded_tensors} offloaded over 3 steps",
            flush=True,
        )
        offload.close()
        dist.barrier()
    finally:
        dist.destroy_process_group()


def main() -> None:
    with tempfile.TemporaryDirectory() as folder:
        rendezvous = "file://" + os.path.join(folder, "rendezvous")
        mp.spawn(train, args=(rendezvous,), nprocs=WORLD)


if __name__ == "__main__":
    main()
