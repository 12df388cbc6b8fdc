"""Bitwise check on Hugging Face models outside the zoo: BERT, T5, Qwen2, Mistral, GPT-NeoX and
ViT, tiny configs (hidden 256, three layers; sequence 512, or 224 px), random weights, on the
CPU's disk tier. Each is tuned (`LMS.tune`) at a budget 30% of the way from the least any plan
needs to its peak without offload and runs three steps against three plain ones, PyTorch's
deterministic algorithms on; it passes when every loss and gradient holds the same bits. The
language models take a batch as a tokenizer gives it (an attention mask of ones, and labels)
through the default step; each run also counts the steps that left their plan
(``diverged_steps``).

    .venv/bin/python benchmarks/hf_bitwise.py [--json benchmarks/results/hf_bitwise_cpu.json]
"""

from __future__ import annotations

import argparse
import copy
import json
import tempfile
import warnings
from collections.abc import Callable
from typing import Any

import torch
from transformers import (
    BertConfig,
    BertForMaskedLM,
    GPTNeoXConfig,
    GPTNeoXForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    T5Config,
    T5ForConditionalGeneration,
    ViTConfig,
    ViTForImageClassification,
)

import lms
from lms.analysis import simulate, trace_step
from lms.analysis.trace import default_step
from lms.orchestration.local import local_device_spec

SHAPE = {"hidden_size": 256, "intermediate_size": 1024, "num_hidden_layers": 3}
LM = {**SHAPE, "vocab_size": 500, "num_attention_heads": 4}


def _seq2seq(model: Any, batch: list[torch.Tensor]) -> torch.Tensor:
    out = model(input_ids=batch[0], labels=batch[1])
    out.loss.backward()
    return out.loss


def _image(model: Any, batch: list[torch.Tensor]) -> torch.Tensor:
    out = model(pixel_values=batch[0], labels=batch[1])
    out.loss.backward()
    return out.loss


def _cases() -> dict[str, tuple[Callable[[], Any], Any, Callable[..., Any] | None]]:
    ids = torch.randint(0, 500, (4, 512))
    # as a tokenizer gives it, with labels, through the default step (the model's own loss)
    tokens = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
    t5 = T5Config(
        vocab_size=500, d_model=256, d_kv=64, d_ff=1024, num_layers=2, num_heads=4,
        decoder_start_token_id=0,
    )  # fmt: skip
    vit = ViTConfig(**SHAPE, num_attention_heads=4, image_size=224, patch_size=16, num_labels=10)
    return {
        "bert": (lambda: BertForMaskedLM(BertConfig(**LM)), tokens, None),
        "t5": (
            lambda: T5ForConditionalGeneration(t5),
            [ids, torch.randint(0, 500, (4, 256))],
            _seq2seq,
        ),
        "qwen2": (
            lambda: Qwen2ForCausalLM(Qwen2Config(**LM, num_key_value_heads=2)),
            tokens,
            None,
        ),
        "mistral": (
            lambda: MistralForCausalLM(
                MistralConfig(**LM, num_key_value_heads=2, sliding_window=128)
            ),
            tokens,
            None,
        ),
        "gpt_neox": (lambda: GPTNeoXForCausalLM(GPTNeoXConfig(**LM)), tokens, None),
        "vit": (
            lambda: ViTForImageClassification(vit),
            [torch.randn(8, 3, 224, 224), torch.randint(0, 10, (8,))],
            _image,
        ),
    }


def check(name: str, spill_dir: str) -> dict[str, Any]:
    """Tune ``name`` between its floor and its peak; three steps against plain ones."""
    build, batch, given = _cases()[name]
    step = given or default_step
    torch.manual_seed(0)
    model = build()
    plain, moved = copy.deepcopy(model), copy.deepcopy(model)
    trace = trace_step(copy.deepcopy(model), batch, step, device="cpu")
    peak = simulate(trace, None, local_device_spec(torch.device("cpu"))).peak_bytes
    try:
        lms.LMS(budget=1).tune(copy.deepcopy(model), batch, step)
        floor = peak
    except lms.PlanInfeasibleError as error:
        floor = error.min_budget_bytes
    offload = lms.LMS(budget=int(floor + 0.3 * (peak - floor)), tier="disk", spill_dir=spill_dir)
    offload.tune(moved, batch, given)
    bitwise = True
    for seed in range(3):
        plain.zero_grad(set_to_none=True)
        moved.zero_grad(set_to_none=True)
        torch.manual_seed(seed)
        expected = step(plain, batch)
        torch.manual_seed(seed)
        with offload:
            got = step(moved, batch)
        bitwise = bitwise and torch.equal(expected, got)
        for a, b in zip(plain.parameters(), moved.parameters(), strict=True):
            bitwise = bitwise and (a.grad is None) == (b.grad is None)
            bitwise = bitwise and (a.grad is None or torch.equal(a.grad, b.grad))
    stats = offload.stats
    offload.close()
    return {
        "model": name,
        "bitwise": bitwise and stats.replays_differed == 0,
        "offloaded_per_step": stats.offloaded_tensors // 3,
        "recomputed_per_step": stats.recomputed_tensors // 3,
        "diverged_steps": stats.diverged_steps,
        "saved_entries": offload.plan.num_entries if offload.plan else 0,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=",".join(_cases()))
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    torch.use_deterministic_algorithms(True)
    results = []
    for name in args.models.split(","):
        with tempfile.TemporaryDirectory() as spill_dir:
            results.append(check(name, spill_dir))
        print(json.dumps(results[-1]), flush=True)
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"torch": torch.__version__, "runs": results}, out, indent=1)
    if not all(r["bitwise"] for r in results):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
