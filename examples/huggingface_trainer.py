"""Train a small Hugging Face GPT-2 with its own `Trainer`, each micro-batch under LMS: one call
wraps the trainer's step; the first micro-batch is traced and planned before it trains.

    python examples/huggingface_trainer.py      # needs large-model-support[transformers]
"""

import tempfile

import torch
import transformers

import lms
from lms.integrations.transformers import offload_trainer


def model() -> torch.nn.Module:
    config = transformers.AutoConfig.for_model(
        "gpt2", vocab_size=500, n_embd=64, n_layer=2, n_head=4, bos_token_id=0, eos_token_id=0
    )
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config)


def data() -> list[dict[str, torch.Tensor]]:
    ids = torch.randint(0, 500, (6, 128), generator=torch.Generator().manual_seed(1))
    return [{"input_ids": row, "labels": row} for row in ids]


def main() -> None:
    def step(m: torch.nn.Module, batch: dict[str, torch.Tensor]) -> None:
        m(**batch).loss.backward()

    batch = transformers.default_data_collator(data()[:2])
    report = lms.analyze(model, batch, step, gpu_memory="1GiB", device_spec="cpu")
    with tempfile.TemporaryDirectory() as folder:
        args = transformers.TrainingArguments(
            output_dir=folder,
            use_cpu=True,
            max_steps=3,
            per_device_train_batch_size=2,
            report_to="none",
            save_strategy="no",
            disable_tqdm=True,
        )
        trainer = transformers.Trainer(model=model(), args=args, train_dataset=data())
        # 70% of what a micro-batch needs without offload
        offload = offload_trainer(trainer, budget=int(0.7 * report.plain.peak_bytes))
        trainer.train()
    plan = offload.plan
    assert plan is not None
    print(
        f"trained {offload.stats.steps} micro-batches; the plan moves {len(plan.offload)} "
        f"and recomputes {len(plan.recompute)} of {plan.num_entries} saved storages"
    )
    offload.close()


if __name__ == "__main__":
    main()
