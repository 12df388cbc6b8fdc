"""Batch, instance and group norms in slabs: statistics from every slab, then each piece
normalized (Note [Slabs])."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from lms.core.slabs.program import Call, bind
from lms.core.slabs.values import Lazy, Value, slab_bounds, whole_of

__all__ = ["Normalize", "norm"]


class Normalize(torch.autograd.Function):
    """``(x - mean) / sqrt(var + eps) * weight + bias`` for statistics of the whole tensor,
    taken as inputs: one batch norm in eval mode forward and its backward, whose sums also
    give the statistics' gradients. It saves only its input piece (a view of a stored slab,
    where it is one)."""

    @staticmethod
    def forward(ctx, x, mean, var, weight, bias, eps):  # type: ignore[no-untyped-def,override]
        flat, w, b, m, v = as_batch_norm(x, mean, var, weight, bias)
        # the statistics as inputs the op does not write (batch_norm's schema marks its running
        # statistics written), so that a replay of it may read them again
        out = torch.ops.aten._native_batch_norm_legit_no_training(flat, w, b, m, v, 0.0, eps)[0]
        ctx.save_for_backward(x, mean, var, weight)
        ctx.eps, ctx.has_bias = eps, bias is not None
        return out.view(x.shape).to(x.dtype) if out.shape != x.shape else out.to(x.dtype)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[no-untyped-def,override]
        x, mean, var, weight = ctx.saved_tensors
        flat, w, _, m, v = as_batch_norm(x, mean, var, weight, None)
        invstd = torch.rsqrt(v + ctx.eps)
        grad_flat = grad.reshape(flat.shape).to(flat.dtype)
        grad_x, grad_w, grad_b = torch.ops.aten.native_batch_norm_backward(
            grad_flat, flat, w, m, v, None, None, False, ctx.eps, [True, True, True]
        )
        scale = invstd if w is None else w * invstd
        grad_mean = (-scale * grad_b).view(mean.shape)
        grad_var = (-0.5 * scale * invstd * grad_w).view(var.shape)
        per = mean.numel() // x.shape[1]  # samples with statistics of their own
        grad_weight = grad_bias = None
        if weight is not None:
            grad_weight = grad_w.view(per, -1).sum(0).view(weight.shape).to(weight.dtype)
        if ctx.has_bias:
            grad_bias = grad_b.view(per, -1).sum(0).view(-1)
            grad_bias = grad_bias.to(weight.dtype) if weight is not None else grad_bias
        return grad_x.view(x.shape).to(x.dtype), grad_mean, grad_var, grad_weight, grad_bias, None


def as_batch_norm(
    x: torch.Tensor,
    mean: torch.Tensor,
    var: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """``x`` and its statistics as one batch norm takes them: statistics per sample and
    channel fold the samples into the channels (1, N*C, ...), and the weight repeats."""
    wide = widened(x)
    per = mean.numel() // x.shape[1]  # 1 for statistics per channel, N per sample and channel
    flat = wide.reshape(1, -1, *x.shape[2:]) if per > 1 else wide
    # one sample: the parameters themselves, which a replay reads as they are
    w = None if weight is None else weight.reshape(-1).to(wide.dtype)
    b = None if bias is None else bias.reshape(-1).to(wide.dtype)
    if per > 1:
        w = None if w is None else w.repeat(per)
        b = None if b is None else b.repeat(per)
    return flat, w, b, mean.reshape(-1).to(wide.dtype), var.reshape(-1).to(wide.dtype)


def norm(call: Call, args: Any, kwargs: Any, slabs: int) -> Lazy | None:
    name = call.func.__name__
    bound = bind(getattr(F, name), args, kwargs)
    if bound is None:
        return None
    a = bound.arguments
    x = a["input"]
    if not isinstance(x, Value):  # a whole input is read a slab at a time too
        return None
    weight, bias = whole_of(a.get("weight")), whole_of(a.get("bias"))
    running_mean, running_var = whole_of(a.get("running_mean")), whole_of(a.get("running_var"))
    channels = call.shapes[0][1]
    ndim = len(call.shapes[0])
    from_input = {
        "batch_norm": a.get("training"),
        "instance_norm": a.get("use_input_stats"),
        "group_norm": True,
    }[name]
    if from_input:
        groups = a["num_groups"] if name == "group_norm" else channels
        mean, var, count = statistics(x, name, groups, channels, ndim)
        if running_mean is not None and running_var is not None:
            update_running(running_mean, running_var, mean, var, count, a["momentum"], name)
    else:
        if running_mean is None or running_var is None:
            return None
        shape = (1, channels) + (1,) * (ndim - 2)
        mean, var = running_mean.view(shape), running_var.view(shape)
    eps = a["eps"]

    def normalize(piece: torch.Tensor) -> torch.Tensor:
        return Normalize.apply(piece, mean, var, weight, bias, eps)

    return Lazy(normalize, (x,), {}, x.shape, slabs)


def widened(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` in at least float32, where statistics are taken and normalized."""
    return tensor.to(torch.promote_types(tensor.dtype, torch.float32))


def statistics(
    x: Value, name: str, groups: int, channels: int, ndim: int
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The mean and biased variance of ``x`` per normalized group, broadcastable against
    ``x`` (float32), from each slab's own (Chan et al.'s pairwise combination); and how many
    values each group has."""
    bounds = slab_bounds(x.depth, x.slabs)
    counts, means, variances = [], [], []
    for a, b in zip(bounds, bounds[1:], strict=False):
        piece = widened(x.piece(a, b))
        if name == "group_norm":
            piece = piece.reshape(piece.shape[0], groups, -1)
            dims: tuple[int, ...] = (2,)
        elif name == "instance_norm":
            dims = tuple(range(2, ndim))
        else:
            dims = (0, *range(2, ndim))
        var, mean = torch.var_mean(piece, dim=dims, correction=0, keepdim=True)
        counts.append(piece.numel() // mean.numel())
        means.append(mean)
        variances.append(var)
    total = sum(counts)
    mean = torch.stack([n * m for n, m in zip(counts, means, strict=True)]).sum(0) / total
    pairs = zip(counts, variances, means, strict=True)
    var = torch.stack([n * (v + (m - mean) ** 2) for n, v, m in pairs]).sum(0) / total
    if name == "group_norm":  # per (sample, group) to per (sample, channel)
        per = channels // groups
        shape = (mean.shape[0], channels) + (1,) * (ndim - 2)
        mean = mean.repeat_interleave(per, dim=1).view(shape)
        var = var.repeat_interleave(per, dim=1).view(shape)
    return mean, var, total


def update_running(
    running_mean: torch.Tensor,
    running_var: torch.Tensor,
    mean: torch.Tensor,
    var: torch.Tensor,
    count: int,
    momentum: float,
    name: str,
) -> None:
    """The running statistics' update that batch and instance norm make in training: the
    unbiased variance; instance norm's averaged over the batch."""
    with torch.no_grad():
        batch_mean = mean.detach().reshape(mean.shape[0], -1)
        batch_var = var.detach().reshape(var.shape[0], -1) * (count / max(count - 1, 1))
        if name == "instance_norm":
            batch_mean, batch_var = batch_mean.mean(0), batch_var.mean(0)
        else:
            batch_mean, batch_var = batch_mean[0], batch_var[0]
        running_mean.mul_(1 - momentum).add_(batch_mean.to(running_mean.dtype), alpha=momentum)
        running_var.mul_(1 - momentum).add_(batch_var.to(running_var.dtype), alpha=momentum)
