"""A step traced on the CPU for a GPU runs attention and dropout as a card's fused kernels do
(Note [A card's attention and dropout, traced on a CPU])."""

import pathlib

import pytest
import torch
import torch.nn.functional as F

import lms
from lms.analysis import device_spec, simulate, trace_step
from lms.core.steprecord import load_record
from lms.harness.zoo import zoo_model

_CARD_RECORD = (
    pathlib.Path(__file__).resolve().parents[2]
    / "benchmarks/results/gpu-NVIDIA-H200/truth/gpt2_1024_lms.json.gz"
)


class _Block(torch.nn.Module):
    def __init__(self, mask=False):
        super().__init__()
        self.qkv = torch.nn.Linear(64, 192)
        self.drop = torch.nn.Dropout(0.1)
        self.mask = mask

    def forward(self, x):
        q, k, v = self.qkv(x).view(2, 32, 3, 4, 16).permute(2, 0, 3, 1, 4)
        mask = torch.ones(32, 32, dtype=torch.bool).tril() if self.mask else None
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=not self.mask)
        return self.drop(y.transpose(1, 2).reshape(2, 32, 64))


def _ops(card, mask=False, autocast=None):
    trace = trace_step(
        lambda: _Block(mask),
        lambda: [torch.randn(2, 32, 64)],
        device="cpu",
        card_kernels=card,
        autocast=autocast,
    )
    return {op.name for op in trace.ops}


@pytest.mark.parametrize(
    ("mask", "autocast", "fused"),
    [
        (False, None, "aten._scaled_dot_product_efficient_attention.default"),
        (True, None, "aten._scaled_dot_product_efficient_attention.default"),
        (False, torch.bfloat16, "aten._scaled_dot_product_flash_attention.default"),
    ],
    ids=["fp32", "fp32-mask", "bf16"],
)
def test_attention_and_dropout_are_traced_as_a_cards_kernels(mask, autocast, fused):
    card = _ops(True, mask, autocast)
    assert fused in card and "aten.native_dropout.default" in card
    assert not {"aten._safe_softmax.default", "aten.bernoulli_.float"} & card
    own = _ops(False, mask, autocast)  # the CPU's own kernels, for a step the CPU runs
    assert fused not in own and "aten.native_dropout.default" not in own


def test_gpt2_traced_on_the_cpu_for_a_card_saves_what_the_card_saved():
    """The trace an H200 took of `lms train --model gpt2` (GPT-2 medium, batch 12, sequence
    1024, fp32), simulated without offload for the H100 spec: 43.19 GiB (the card measured
    44.10). The same step traced here for a card saves the same storages to the byte; traced
    with the CPU's own kernels it was simulated at 96.6 GiB."""
    pytest.importorskip("transformers")
    card = load_record(_CARD_RECORD).trace
    entry = zoo_model("gpt2")
    here = trace_step(
        entry.build, entry.make_batch(1024, 12), entry.step_fn, device="cpu", card_kernels=True
    )
    spec = device_spec("h100")
    assert sorted(size for _, size, _ in here.entries()) == sorted(
        size for _, size, _ in card.entries()
    )
    peak, card_peak = simulate(here, None, spec).peak_bytes, simulate(card, None, spec).peak_bytes
    assert abs(peak / card_peak - 1) < 0.01, (peak / 2**30, card_peak / 2**30)


def test_analyze_traces_for_a_gpu_spec_with_a_cards_kernels():
    block = lms.analyze(lambda: _Block(), lambda: [torch.randn(2, 32, 64)], device_spec="h100")
    names = {op.name for op in block.trace.ops}
    assert "aten._scaled_dot_product_efficient_attention.default" in names
    local = lms.analyze(lambda: _Block(), lambda: [torch.randn(2, 32, 64)], device_spec="cpu")
    assert "aten._scaled_dot_product_efficient_attention.default" not in {
        op.name for op in local.trace.ops
    }
