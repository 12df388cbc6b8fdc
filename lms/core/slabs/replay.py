"""A recorded forward replayed a slab at a time (Note [Slabs])."""

from __future__ import annotations

import inspect
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils._pytree import tree_flatten, tree_map

from lms.core.slabs.norms import norm
from lms.core.slabs.program import Call, Program, Ref, bind
from lms.core.slabs.values import DIM, Lazy, Stored, Value, Whole, slab_bounds, whole_of

__all__ = ["replay"]


CONVS = {"conv1d", "conv2d", "conv3d"}
NORMS = {"batch_norm", "instance_norm", "group_norm"}
POINTWISE = {
    "relu", "relu_", "leaky_relu", "leaky_relu_", "gelu", "silu", "sigmoid", "tanh", "elu",
    "selu", "celu", "hardtanh", "relu6", "mish", "hardswish", "softplus", "dropout",
    "add", "sub", "mul", "div", "add_", "sub_", "mul_", "div_", "neg", "clamp", "clamp_",
    "__add__", "__radd__", "__sub__", "__rsub__", "__mul__", "__rmul__", "__truediv__",
    "__iadd__", "__isub__", "__imul__", "__itruediv__", "contiguous", "clone",
}  # fmt: skip
IN_PLACE = {"__iadd__": "__add__", "__isub__": "__sub__", "__imul__": "__mul__"} | {
    "__itruediv__": "__truediv__"
}


def replay(program: Program, module: torch.nn.Module, slabs: int, leaves: list[Any]) -> Any:
    state = dict(module.named_parameters()) | dict(module.named_buffers())
    values: dict[int, Any] = {}
    device = next(t.device for t in [*leaves, *state.values()] if isinstance(t, torch.Tensor))

    def resolve(ref: Any) -> Any:
        if not isinstance(ref, Ref):
            return ref
        if ref.kind == "input":
            return Whole(leaves[int(ref.key)], slabs)
        if ref.kind == "param":
            return Whole(state[str(ref.key)], slabs)
        if ref.kind == "device":
            return device
        value = values[int(ref.key)]
        return value[ref.item] if ref.item >= 0 else value

    for index, call in enumerate(program.calls):
        args, kwargs = tree_map(resolve, call.args), tree_map(resolve, call.kwargs)
        values[index] = _run(call, args, kwargs, slabs)
        for done in [i for i in values if program.last_use.get(i, -1) <= index]:
            del values[done]
    return tree_map(whole_of, tree_map(resolve, program.output))


def _run(call: Call, args: Any, kwargs: Any, slabs: int) -> Any:
    name = getattr(call.func, "__name__", "")
    depth = call.shapes[0][DIM] if len(call.shapes) == 1 and len(call.shapes[0]) > DIM else 0
    if depth > 1:
        if name in CONVS:
            stored = _conv(call, args, kwargs, slabs)
            if stored is not None:
                return stored
        elif name in NORMS:
            lazy = norm(call, args, kwargs, slabs)
            if lazy is not None:
                return lazy
        elif name in POINTWISE or name in {"cat", "pad"}:
            piecewise = _pointwise(call, args, kwargs, depth, slabs)
            if piecewise is not None:
                return piecewise
    out = call.func(*tree_map(whole_of, args), **tree_map(whole_of, kwargs))
    if isinstance(out, torch.Tensor):
        return Whole(out, slabs)
    return [Whole(t, slabs) for t in out]


def _pointwise(call: Call, args: Any, kwargs: Any, depth: int, slabs: int) -> Value | None:
    name = getattr(call.func, "__name__", "")
    func = call.func
    ndim = len(call.shapes[0])
    tensors = [v for v in tree_flatten((args, kwargs))[0] if isinstance(v, Value)]
    if not any(v.ndim == ndim and v.depth == depth for v in tensors):
        return None
    for value in tensors:  # each spans the depth as the output does, or is constant along it
        aligned = DIM - (ndim - value.ndim)
        size = value.shape[aligned] if 0 <= aligned < value.ndim else 1
        if size != 1 and (value.ndim != ndim or size != depth):
            return None
    if name == "cat":
        dim = kwargs.get("dim", args[1] if len(args) > 1 else 0)
        if dim % ndim == DIM:
            return None
        return Lazy(func, args, kwargs, call.shapes[0], slabs)
    if name == "pad":
        pad = list(kwargs.get("pad", args[1] if len(args) > 1 else ()))
        at = 2 * (ndim - 1 - DIM)
        if len(pad) > at and any(pad[at : at + 2]):
            return None
        return Lazy(func, args, kwargs, call.shapes[0], slabs)
    if name in IN_PLACE or (name.endswith("_") and not name.startswith("__")):
        out_of_place = IN_PLACE.get(name, name.rstrip("_"))
        found = [getattr(where, out_of_place, None) for where in (torch.Tensor, F, torch)]
        if all(f is None for f in found):
            return None
        func = next(f for f in found if f is not None)
    elif "inplace" in inspect.signature(func).parameters if inspect.isfunction(func) else False:
        bound = bind(func, args, kwargs)
        if bound is None:
            return None
        if name == "dropout" and bound.arguments["training"] and bound.arguments["p"] > 0:
            return None  # the mask must draw as the whole tensor does
        bound.arguments["inplace"] = False
        args, kwargs = bound.args, bound.kwargs
    elif name == "dropout":
        return None
    return Lazy(func, args, kwargs, call.shapes[0], slabs)


def _triple(value: Any, count: int) -> tuple[Any, ...]:
    return tuple(value) if isinstance(value, (tuple, list)) else (value,) * count


def _conv(call: Call, args: Any, kwargs: Any, slabs: int) -> Stored | None:
    bound = bind(_conv_signature, args, kwargs)
    if bound is None:
        return None
    x, weight, bias = bound.arguments["input"], bound.arguments["weight"], bound.arguments["bias"]
    if not isinstance(x, Value) or x.depth <= 1 or not isinstance(weight, Whole):
        return None
    spatial = weight.tensor.dim() - 2
    stride = _triple(bound.arguments["stride"], spatial)
    dilation = _triple(bound.arguments["dilation"], spatial)
    kernel = tuple(weight.tensor.shape[2:])
    padding = bound.arguments["padding"]
    if padding == "valid":
        padding = 0
    if padding == "same":
        totals = [d * (k - 1) for d, k in zip(dilation, kernel, strict=False)]
        if any(t % 2 for t in totals):
            return None
        padding = tuple(t // 2 for t in totals)
    padding = _triple(padding, spatial)
    reach = dilation[0] * (kernel[0] - 1)
    out_depth = call.shapes[0][DIM]
    bounds = slab_bounds(out_depth, slabs)
    parts = []
    bias_tensor = whole_of(bias)
    for a, b in zip(bounds, bounds[1:], strict=False):
        # output rows a..b-1 read input rows a*stride - padding up to (b-1)*stride - padding +
        # reach, zeros past the edges as the padding is
        lo, hi = a * stride[0] - padding[0], (b - 1) * stride[0] - padding[0] + reach + 1
        start, stop = max(lo, 0), min(hi, x.depth)
        rows = x.piece(start, stop)
        if start > lo or stop < hi:
            rows = F.pad(rows, [0, 0] * (spatial - 1) + [start - lo, hi - stop])
        parts.append(
            call.func(
                rows,
                weight.tensor,
                bias_tensor,
                stride,
                (0, *padding[1:]),
                dilation,
                bound.arguments["groups"],
            )
        )
    return Stored(parts, bounds, slabs)


def _conv_signature(input, weight, bias=None, stride=1, padding=0, dilation=1, groups=1):  # type: ignore[no-untyped-def]
    """The arguments of ``torch.conv1d``/``conv2d``/``conv3d``, which have no signature."""
