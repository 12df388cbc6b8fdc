"""Run a submodule's forward in slabs along its first spatial dimension, so that none of its
operations holds more than a slab of its largest tensors at once.

Note: [Slabs]
A module's forward is recorded once per input shape as the torch functions it calls (on meta
tensors, with every tracer's modes and module hooks set aside), then replayed with each value in
one of three forms: whole (a tensor), stored (its slabs along dim 2, one tensor each) or lazy (a
pointwise function of other values, evaluated a piece at a time where a consumer reads it).
- A convolution with stride 1 along dim 2 runs a slab at a time on its input's rows plus the
  halo its kernel reads (zeros past the edges, as its padding), and its output is stored.
- A normalization (batch, instance, group) takes its statistics from every slab first (each
  slab's variance and mean, combined as Chan et al. combine them), then normalizes lazily.
- Pointwise functions, concatenation along channels and padding across the other dims stay
  lazy; in-place ones run out of place on the fresh piece.
- Any other function gets its inputs whole, and its outputs are whole.
Autograd sees only slab-sized operations, so what they save is slab-sized and LMS moves or
recomputes each piece as its plan says. The gradients are not bitwise those of the unsplit
module: a convolution's weight gradient is summed slab by slab and the statistics are combined
from slabs. The difference is float rounding, bounded in the tests.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

__all__ = ["SplitError", "slab_bounds", "split_modules"]

_DIM = 2  # the first spatial dimension: depth in NCDHW, height in NCHW

_CONVS = {"conv1d", "conv2d", "conv3d"}
_NORMS = {"batch_norm", "instance_norm", "group_norm"}
_POINTWISE = {
    "relu", "relu_", "leaky_relu", "leaky_relu_", "gelu", "silu", "sigmoid", "tanh", "elu",
    "selu", "celu", "hardtanh", "relu6", "mish", "hardswish", "softplus", "dropout",
    "add", "sub", "mul", "div", "add_", "sub_", "mul_", "div_", "neg", "clamp", "clamp_",
    "__add__", "__radd__", "__sub__", "__rsub__", "__mul__", "__rmul__", "__truediv__",
    "__iadd__", "__isub__", "__imul__", "__itruediv__", "contiguous", "clone",
}  # fmt: skip
_IN_PLACE = {"__iadd__": "__add__", "__isub__": "__sub__", "__imul__": "__mul__"} | {
    "__itruediv__": "__truediv__"
}


class SplitError(ValueError):
    """A module named for slabs cannot run in them, or the number of slabs is not valid."""


def slab_bounds(depth: int, slabs: int) -> list[int]:
    """The boundaries of ``slabs`` near-equal slabs of ``depth`` rows (fewer when the rows
    are fewer): ``[0, ..., depth]``."""
    count = max(1, min(slabs, depth))
    return [depth * i // count for i in range(count + 1)]


@contextlib.contextmanager
def split_modules(model: torch.nn.Module, slabs: Mapping[str, int]) -> Iterator[None]:
    """Inside the block, each submodule named in ``slabs`` (as ``model.get_submodule`` takes
    it) runs its forward in that many slabs (Note [Slabs]); its own forward is back after.

    Raises:
        SplitError: a name is not a submodule of ``model``, or a count is not an int of at
            least 2, before any module changes.
    """
    modules = []
    for name, count in slabs.items():
        if not isinstance(count, int) or isinstance(count, bool) or count < 2:
            raise SplitError(
                f"lms: {count!r} slabs for {name!r}: a module runs in at least 2 slabs; "
                "give an int of 2 or more"
            )
        try:
            module = model.get_submodule(name)
        except AttributeError as error:
            raise SplitError(
                f"lms: {type(model).__name__} has no submodule {name!r} to run in slabs; "
                "name one as model.named_modules() lists it"
            ) from error
        modules.append((module, count))
    saved = [module.__dict__.get("forward") for module, _ in modules]
    try:
        for module, count in modules:
            module.forward = functools.partial(_slab_forward, module, count, module.forward)
        yield
    finally:
        for (module, _), own in zip(modules, saved, strict=True):
            if own is None:
                module.__dict__.pop("forward", None)
            else:
                module.forward = own


# -- recording ------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Ref:
    """A tensor in a recorded program: an input, a parameter or buffer, or a call's output
    (``index``, and ``item`` in a tuple output)."""

    kind: str
    key: int | str
    item: int = -1


@dataclasses.dataclass(frozen=True)
class _Call:
    func: Callable[..., Any]
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    shapes: tuple[tuple[int, ...], ...]
    """The shape of each tensor output, as recorded."""


@dataclasses.dataclass(frozen=True)
class _Program:
    calls: tuple[_Call, ...]
    output: Any
    last_use: dict[int, int]
    """Each call's output: the index of the last call that reads it."""


class _Recorder(TorchFunctionMode):
    def __init__(self, refs: dict[int, _Ref]):
        super().__init__()
        self.refs = refs
        self.calls: list[_Call] = []
        self.alive: list[Any] = []  # outputs kept, so that their ids stay theirs

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        for tensor in tree_flatten((args, kwargs))[0]:
            if isinstance(tensor, torch.Tensor) and id(tensor) not in self.refs:
                raise SplitError(
                    f"lms: {getattr(func, '__name__', func)} reads a tensor that is neither an "
                    "input, a parameter or buffer, nor made in the forward; run this module "
                    "whole"
                )
        out = func(*args, **kwargs)
        outs = [out] if isinstance(out, torch.Tensor) else []
        if isinstance(out, (tuple, list)) and all(isinstance(t, torch.Tensor) for t in out):
            outs = list(out)
        if not outs:
            return out
        index = len(self.calls)
        self.calls.append(
            _Call(
                func,
                tree_map(self._ref, args),
                tree_map(self._ref, kwargs),
                tuple(tuple(t.shape) for t in outs),
            )
        )
        if isinstance(out, torch.Tensor):
            self.refs[id(out)] = _Ref("value", index)
        else:
            for item, tensor in enumerate(outs):
                self.refs[id(tensor)] = _Ref("value", index, item)
        self.alive.append(out)
        return out

    def _ref(self, value: Any) -> Any:
        return self.refs[id(value)] if isinstance(value, torch.Tensor) else value


def _meta(tensor: torch.Tensor) -> torch.Tensor:
    return torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype, device="meta")


@contextlib.contextmanager
def _hooks_aside(root: torch.nn.Module) -> Iterator[None]:
    """Module hooks set aside while a forward is recorded: the global ones (a tracer's, the
    runtime's) and those of ``root`` and its submodules (a user's). The recording is no call of
    the step's, and its tensors are meta tensors no hook expects."""
    module = torch.nn.modules.module
    globals_ = [
        name
        for name in (
            "_global_forward_pre_hooks",
            "_global_forward_hooks",
            "_global_forward_hooks_always_called",
        )
        if hasattr(module, name)
    ]
    held: list[tuple[Any, str, Any]] = [(module, name, getattr(module, name)) for name in globals_]
    for each in root.modules():
        held += [
            (each, name, hooks)
            for name, hooks in vars(each).items()
            if name.startswith("_forward") and "hooks" in name and isinstance(hooks, dict)
        ]
    for owner, name, hooks in held:
        setattr(owner, name, type(hooks)())
    try:
        yield
    finally:
        for owner, name, hooks in held:
            setattr(owner, name, hooks)


def _record(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> _Program:
    leaves, structure = tree_flatten((args, kwargs))
    with _disable_current_modes(), _hooks_aside(module), torch.no_grad():
        metas = [_meta(t) if isinstance(t, torch.Tensor) else t for t in leaves]
        refs = {id(m): _Ref("input", i) for i, m in enumerate(metas) if isinstance(m, torch.Tensor)}
        state = {
            name: _meta(t)
            for name, t in [*module.named_parameters(), *module.named_buffers()]
            if t is not None
        }
        refs |= {id(t): _Ref("param", name) for name, t in state.items()}
        meta_args, meta_kwargs = tree_unflatten(metas, structure)
        recorder = _Recorder(refs)
        try:
            with recorder:
                out = torch.func.functional_call(module, state, meta_args, meta_kwargs)
        except SplitError:
            raise
        except Exception as error:
            raise SplitError(
                f"lms: {type(module).__name__}'s forward could not be recorded to run in "
                f"slabs ({type(error).__name__}: {error}); run this module whole"
            ) from error
        output = tree_map(recorder._ref, out)
    last_use: dict[int, int] = {}
    for index, call in enumerate(recorder.calls):
        for ref in tree_flatten((call.args, call.kwargs))[0]:
            if isinstance(ref, _Ref) and ref.kind == "value":
                last_use[int(ref.key)] = index
    for ref in tree_flatten(output)[0]:
        if isinstance(ref, _Ref) and ref.kind == "value":
            last_use[int(ref.key)] = len(recorder.calls)
    return _Program(tuple(recorder.calls), output, last_use)


# -- values ---------------------------------------------------------------------------------


class _Value:
    depth: int
    slabs: int
    shape: tuple[int, ...]

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def piece(self, start: int, stop: int) -> torch.Tensor:
        raise NotImplementedError

    def whole(self) -> torch.Tensor:
        bounds = slab_bounds(self.depth, self.slabs)
        parts = [self.piece(a, b) for a, b in zip(bounds, bounds[1:], strict=False)]
        return parts[0] if len(parts) == 1 else torch.cat(parts, _DIM)


class _Whole(_Value):
    def __init__(self, tensor: torch.Tensor, slabs: int):
        self.tensor, self.slabs, self.shape = tensor, slabs, tuple(tensor.shape)
        self.depth = tensor.shape[_DIM] if tensor.dim() > _DIM else 0
        self._stored: _Stored | None = None

    def piece(self, start: int, stop: int) -> torch.Tensor:
        # Note: [One split, not a slice per piece]
        # A slice's backward makes a zero tensor of the whole size for its gradient; a whole
        # tensor read a piece at a time would make one per piece. Split once, into the standard
        # slabs, and its backward makes the whole gradient once.
        if self._stored is None:
            bounds = slab_bounds(self.depth, self.slabs)
            sizes = [b - a for a, b in zip(bounds, bounds[1:], strict=False)]
            self._stored = _Stored(list(self.tensor.split(sizes, _DIM)), bounds, self.slabs)
        return self._stored.piece(start, stop)

    def whole(self) -> torch.Tensor:
        return self.tensor


class _Stored(_Value):
    def __init__(self, parts: list[torch.Tensor], bounds: list[int], slabs: int):
        self.parts, self.bounds, self.slabs, self.depth = parts, bounds, slabs, bounds[-1]
        self.shape = (*parts[0].shape[:_DIM], self.depth, *parts[0].shape[_DIM + 1 :])

    def piece(self, start: int, stop: int) -> torch.Tensor:
        pieces = []
        for part, a, b in zip(self.parts, self.bounds, self.bounds[1:], strict=False):
            lo, hi = max(a, start), min(b, stop)
            if lo < hi:
                pieces.append(part if (lo, hi) == (a, b) else part.narrow(_DIM, lo - a, hi - lo))
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces, _DIM)


class _Lazy(_Value):
    """``func`` applied piecewise: every argument with this depth is cut to the piece."""

    def __init__(
        self, func: Callable[..., Any], args: Any, kwargs: Any, shape: tuple[int, ...], slabs: int
    ):
        self.func, self.args, self.kwargs, self.slabs = func, args, kwargs, slabs
        self.shape, self.depth = shape, shape[_DIM]

    def piece(self, start: int, stop: int) -> torch.Tensor:
        bounds = slab_bounds(self.depth, self.slabs)
        cuts = sorted({start, stop, *(b for b in bounds if start < b < stop)})
        parts = [self._piece(a, b) for a, b in zip(cuts, cuts[1:], strict=False)]
        return parts[0] if len(parts) == 1 else torch.cat(parts, _DIM)

    def _piece(self, start: int, stop: int) -> torch.Tensor:
        def cut(value: Any) -> Any:
            if isinstance(value, _Value):
                if value.ndim == self.ndim and value.depth == self.depth:
                    return value.piece(start, stop)
                return value.whole()
            return value

        return self.func(*tree_map(cut, self.args), **tree_map(cut, self.kwargs))


class _Normalize(torch.autograd.Function):
    """``(x - mean) / sqrt(var + eps) * weight + bias`` for statistics of the whole tensor,
    taken as inputs: one batch norm in eval mode forward and its backward, whose sums also
    give the statistics' gradients. It saves only its input piece (a view of a stored slab,
    where it is one)."""

    @staticmethod
    def forward(ctx, x, mean, var, weight, bias, eps):  # type: ignore[no-untyped-def,override]
        flat, w, b, m, v = _flat(x, mean, var, weight, bias)
        out = torch.batch_norm(flat, w, b, m, v, False, 0.0, eps, torch.backends.cudnn.enabled)
        ctx.save_for_backward(x, mean, var, weight)
        ctx.eps, ctx.has_bias = eps, bias is not None
        return out.view(x.shape).to(x.dtype) if out.shape != x.shape else out.to(x.dtype)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[no-untyped-def,override]
        x, mean, var, weight = ctx.saved_tensors
        flat, w, _, m, v = _flat(x, mean, var, weight, None)
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


def _flat(
    x: torch.Tensor,
    mean: torch.Tensor,
    var: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """``x`` and its statistics as one batch norm takes them: statistics per sample and
    channel fold the samples into the channels (1, N*C, ...), and the weight repeats."""
    wide = _wide(x)
    per = mean.numel() // x.shape[1]  # 1 for statistics per channel, N per sample and channel
    flat = wide.reshape(1, -1, *x.shape[2:]) if per > 1 else wide
    w = None if weight is None else weight.reshape(-1).to(wide.dtype).repeat(per)
    b = None if bias is None else bias.reshape(-1).to(wide.dtype).repeat(per)
    return flat, w, b, mean.reshape(-1).to(wide.dtype), var.reshape(-1).to(wide.dtype)


# -- replay ---------------------------------------------------------------------------------


def _slab_forward(
    module: torch.nn.Module, slabs: int, own: Callable[..., Any], *args: Any, **kwargs: Any
) -> Any:
    leaves = tree_flatten((args, kwargs))[0]
    key = (
        tuple((tuple(t.shape), t.stride(), t.dtype) for t in leaves if isinstance(t, torch.Tensor)),
        module.training,
    )
    programs = module.__dict__.setdefault("_lms_slab_programs", {})
    if key not in programs:
        patched = module.__dict__.pop("forward")
        try:
            programs[key] = _record(module, args, kwargs)
        finally:
            module.forward = patched
    return _replay(programs[key], module, slabs, leaves)


def _replay(program: _Program, module: torch.nn.Module, slabs: int, leaves: list[Any]) -> Any:
    state = dict(module.named_parameters()) | dict(module.named_buffers())
    values: dict[int, Any] = {}

    def resolve(ref: Any) -> Any:
        if not isinstance(ref, _Ref):
            return ref
        if ref.kind == "input":
            return _Whole(leaves[int(ref.key)], slabs)
        if ref.kind == "param":
            return _Whole(state[str(ref.key)], slabs)
        value = values[int(ref.key)]
        return value[ref.item] if ref.item >= 0 else value

    for index, call in enumerate(program.calls):
        args, kwargs = tree_map(resolve, call.args), tree_map(resolve, call.kwargs)
        values[index] = _run(call, args, kwargs, slabs)
        for done in [i for i in values if program.last_use.get(i, -1) <= index]:
            del values[done]
    return tree_map(_whole, tree_map(resolve, program.output))


def _whole(value: Any) -> Any:
    return value.whole() if isinstance(value, _Value) else value


def _run(call: _Call, args: Any, kwargs: Any, slabs: int) -> Any:
    name = getattr(call.func, "__name__", "")
    depth = call.shapes[0][_DIM] if len(call.shapes) == 1 and len(call.shapes[0]) > _DIM else 0
    if depth > 1:
        if name in _CONVS:
            stored = _conv(call, args, kwargs, slabs)
            if stored is not None:
                return stored
        elif name in _NORMS:
            lazy = _norm(call, args, kwargs, slabs)
            if lazy is not None:
                return lazy
        elif name in _POINTWISE or name in {"cat", "pad"}:
            piecewise = _pointwise(call, args, kwargs, depth, slabs)
            if piecewise is not None:
                return piecewise
    out = call.func(*tree_map(_whole, args), **tree_map(_whole, kwargs))
    if isinstance(out, torch.Tensor):
        return _Whole(out, slabs)
    return [_Whole(t, slabs) for t in out]


def _bound(func: Callable[..., Any], args: Any, kwargs: Any) -> inspect.BoundArguments | None:
    try:
        bound = inspect.signature(func).bind(*args, **kwargs)
    except (TypeError, ValueError):
        return None
    bound.apply_defaults()
    return bound


def _pointwise(call: _Call, args: Any, kwargs: Any, depth: int, slabs: int) -> _Value | None:
    name = getattr(call.func, "__name__", "")
    func = call.func
    ndim = len(call.shapes[0])
    tensors = [v for v in tree_flatten((args, kwargs))[0] if isinstance(v, _Value)]
    if not any(v.ndim == ndim and v.depth == depth for v in tensors):
        return None
    for value in tensors:  # each spans the depth as the output does, or is constant along it
        aligned = _DIM - (ndim - value.ndim)
        size = value.shape[aligned] if 0 <= aligned < value.ndim else 1
        if size != 1 and (value.ndim != ndim or size != depth):
            return None
    if name == "cat":
        dim = kwargs.get("dim", args[1] if len(args) > 1 else 0)
        if dim % ndim == _DIM:
            return None
        return _Lazy(func, args, kwargs, call.shapes[0], slabs)
    if name == "pad":
        pad = list(kwargs.get("pad", args[1] if len(args) > 1 else ()))
        at = 2 * (ndim - 1 - _DIM)
        if len(pad) > at and any(pad[at : at + 2]):
            return None
        return _Lazy(func, args, kwargs, call.shapes[0], slabs)
    if name in _IN_PLACE or (name.endswith("_") and not name.startswith("__")):
        out_of_place = _IN_PLACE.get(name, name.rstrip("_"))
        found = [getattr(where, out_of_place, None) for where in (torch.Tensor, F, torch)]
        if all(f is None for f in found):
            return None
        func = next(f for f in found if f is not None)
    elif "inplace" in inspect.signature(func).parameters if inspect.isfunction(func) else False:
        bound = _bound(func, args, kwargs)
        if bound is None:
            return None
        if name == "dropout" and bound.arguments["training"] and bound.arguments["p"] > 0:
            return None  # the mask must draw as the whole tensor does
        bound.arguments["inplace"] = False
        args, kwargs = bound.args, bound.kwargs
    elif name == "dropout":
        return None
    return _Lazy(func, args, kwargs, call.shapes[0], slabs)


def _triple(value: Any, count: int) -> tuple[Any, ...]:
    return tuple(value) if isinstance(value, (tuple, list)) else (value,) * count


def _conv(call: _Call, args: Any, kwargs: Any, slabs: int) -> _Stored | None:
    bound = _bound(_conv_signature, args, kwargs)
    if bound is None:
        return None
    x, weight, bias = bound.arguments["input"], bound.arguments["weight"], bound.arguments["bias"]
    if not isinstance(x, _Value) or x.depth <= 1 or not isinstance(weight, _Whole):
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
    if stride[0] != 1:
        return None
    reach = dilation[0] * (kernel[0] - 1)
    out_depth = call.shapes[0][_DIM]
    bounds = slab_bounds(out_depth, slabs)
    parts = []
    bias_tensor = _whole(bias)
    for a, b in zip(bounds, bounds[1:], strict=False):
        lo, hi = a - padding[0], b - padding[0] + reach
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
    return _Stored(parts, bounds, slabs)


def _conv_signature(input, weight, bias=None, stride=1, padding=0, dilation=1, groups=1):  # type: ignore[no-untyped-def]
    """The arguments of ``torch.conv1d``/``conv2d``/``conv3d``, which have no signature."""


def _norm(call: _Call, args: Any, kwargs: Any, slabs: int) -> _Lazy | None:
    name = call.func.__name__
    bound = _bound(getattr(F, name), args, kwargs)
    if bound is None:
        return None
    a = bound.arguments
    x = a["input"]
    if not isinstance(x, _Lazy | _Stored):
        return None
    weight, bias = _whole(a.get("weight")), _whole(a.get("bias"))
    running_mean, running_var = _whole(a.get("running_mean")), _whole(a.get("running_var"))
    channels = call.shapes[0][1]
    ndim = len(call.shapes[0])
    from_input = {
        "batch_norm": a.get("training"),
        "instance_norm": a.get("use_input_stats"),
        "group_norm": True,
    }[name]
    if from_input:
        groups = a["num_groups"] if name == "group_norm" else channels
        mean, var, count = _statistics(x, name, groups, channels, ndim)
        if running_mean is not None and running_var is not None:
            _update_running(running_mean, running_var, mean, var, count, a["momentum"], name)
    else:
        if running_mean is None or running_var is None:
            return None
        shape = (1, channels) + (1,) * (ndim - 2)
        mean, var = running_mean.view(shape), running_var.view(shape)
    eps = a["eps"]

    def normalize(piece: torch.Tensor) -> torch.Tensor:
        return _Normalize.apply(piece, mean, var, weight, bias, eps)

    return _Lazy(normalize, (x,), {}, x.shape, slabs)


def _wide(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` in at least float32, where statistics are taken and normalized."""
    return tensor.to(torch.promote_types(tensor.dtype, torch.float32))


def _statistics(
    x: _Value, name: str, groups: int, channels: int, ndim: int
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The mean and biased variance of ``x`` per normalized group, broadcastable against
    ``x`` (float32), from each slab's own (Chan et al.'s pairwise combination); and how many
    values each group has."""
    bounds = slab_bounds(x.depth, x.slabs)
    counts, means, variances = [], [], []
    for a, b in zip(bounds, bounds[1:], strict=False):
        piece = _wide(x.piece(a, b))
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


def _update_running(
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
