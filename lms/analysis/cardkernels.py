"""A step traced on the CPU for a GPU: attention and dropout as a card's fused kernels run them.

Note: [A card's attention and dropout, traced on a CPU]
A step traced on the CPU runs the CPU's kernels, and two of them save other tensors than a
card's. PyTorch's attention (`scaled_dot_product_attention`) takes its math path under fake CPU
tensors: it keeps the attention probabilities for backward, a [batch, heads, length, length]
tensor a layer. On a card it runs a fused kernel (flash attention in half precision without a
mask, memory-efficient attention otherwise) that keeps its output and the log-sum-exp alone.
Dropout on the CPU draws its mask into a tensor of the input's dtype (``empty_like``,
``bernoulli_``, ``div_``); a card's ``native_dropout`` keeps one byte an element. A
transformer traced so was simulated at more than twice the memory its card's own trace gives
(benchmarks/results/README.md, "A card's attention and dropout, traced on a CPU").

So a trace on the CPU for a GPU spec (`lms.analyze` with a GPU's spec, where this machine has no
card) runs those calls as the card's kernels, which fake tensors take through their meta kernels
and autograd's formulas: `scaled_dot_product_attention` as the fused op the card would choose,
where its inputs meet that op's conditions (four dimensions, a head size that is a multiple of
8 up to 256, no grouped-query flag), else as it is; training-mode ``dropout`` as
``native_dropout``. A trace for the CPU itself, or on a card, runs the step's own calls.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

__all__ = ["CardKernels"]

_HALF = (torch.float16, torch.bfloat16)


class CardKernels(TorchFunctionMode):
    """Attention and dropout as a card runs them (Note [A card's attention and dropout, traced
    on a CPU])."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            fused = _fused_attention(*args, **kwargs)
            if fused is not None:
                return fused
        elif func is F.dropout:
            dropped = _native_dropout(*args, **kwargs)
            if dropped is not None:
                return dropped
        return func(*args, **kwargs)


def _fused_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor | None:
    """The output of the fused attention a card would run on these arguments; None where it
    would run another."""
    tensors = (query, key, value)
    if enable_gqa or any(t.dim() != 4 for t in tensors):
        return None
    head = query.shape[-1]
    if head % 8 or head > 256 or value.shape[-1] != head or key.shape[-1] != head:
        return None
    if query.dtype not in (torch.float32, *_HALF) or len({t.dtype for t in tensors}) != 1:
        return None
    if query.dtype in _HALF and attn_mask is None:
        return torch.ops.aten._scaled_dot_product_flash_attention(
            query, key, value, dropout_p, is_causal, False, scale=scale
        )[0]
    if attn_mask is not None and is_causal:
        return None  # a card refuses both
    bias = attn_mask
    if bias is not None and bias.dtype == torch.bool:  # as the card's entry makes it
        bias = torch.zeros_like(bias, dtype=query.dtype).masked_fill(~bias, float("-inf"))
    needs_grad = any(t.requires_grad for t in tensors)
    return torch.ops.aten._scaled_dot_product_efficient_attention(
        query, key, value, bias, needs_grad, dropout_p, is_causal, scale=scale
    )[0]


def _native_dropout(
    input: torch.Tensor, p: float = 0.5, training: bool = True, inplace: bool = False
) -> torch.Tensor | None:
    """Training-mode dropout as a card runs it; None where it does nothing or works in place."""
    if not training or inplace or not 0.0 < p < 1.0 or input.numel() == 0:
        return None
    return torch.native_dropout(input, p, True)[0]
