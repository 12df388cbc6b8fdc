"""A module's forward recorded as the torch functions it calls, on meta tensors (Note
[Slabs])."""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

__all__ = ["Call", "Program", "Ref", "SplitError", "bind", "record"]


class SplitError(ValueError):
    """A module named for slabs cannot run in them, or the number of slabs is not valid."""


@dataclasses.dataclass(frozen=True)
class Ref:
    """A tensor in a recorded program: an input, a parameter or buffer, or a call's output
    (``index``, and ``item`` in a tuple output); or, of kind ``"device"``, the device the
    module runs on, where the forward asked for the meta device it was recorded on (a tensor
    made with ``device=x.device``)."""

    kind: str
    key: int | str
    item: int = -1


@dataclasses.dataclass(frozen=True)
class Call:
    func: Callable[..., Any]
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    shapes: tuple[tuple[int, ...], ...]
    """The shape of each tensor output, as recorded."""


@dataclasses.dataclass(frozen=True)
class Program:
    calls: tuple[Call, ...]
    output: Any
    last_use: dict[int, int]
    """Each call's output: the index of the last call that reads it."""


class Recorder(TorchFunctionMode):
    def __init__(self, refs: dict[int, Ref]):
        super().__init__()
        self.refs = refs
        self.calls: list[Call] = []
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
            Call(
                func,
                tree_map(self._ref, args),
                tree_map(self._ref, kwargs),
                tuple(tuple(t.shape) for t in outs),
            )
        )
        if isinstance(out, torch.Tensor):
            self.refs[id(out)] = Ref("value", index)
        else:
            for item, tensor in enumerate(outs):
                self.refs[id(tensor)] = Ref("value", index, item)
        self.alive.append(out)
        return out

    def _ref(self, value: Any) -> Any:
        if isinstance(value, torch.device) and value.type == "meta":
            return Ref("device", 0)
        return self.refs[id(value)] if isinstance(value, torch.Tensor) else value


def _meta(tensor: torch.Tensor, fake: torch.device | None = None) -> torch.Tensor:
    """An empty stand-in for ``tensor``: on the meta device, or on ``fake`` (under a fake tensor
    mode: Note [Slabs recorded under autocast])."""
    device = fake if fake is not None else "meta"
    return torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype, device=device)


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


def record(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Program:
    leaves, structure = tree_flatten((args, kwargs))
    device = next((t.device for t in leaves if isinstance(t, torch.Tensor)), None)
    # Note: [Slabs recorded under autocast]
    # Autocast casts a call's tensors by their device, and has no rules for the meta device: a
    # forward recorded on meta tensors under autocast would meet a weight in single precision
    # with an input autocast made half (a convolution refuses that). There, the forward is
    # recorded on fake tensors of its own device, which autocast casts as it will in each slab;
    # the recorded calls are the same torch functions, replayed under the same autocast.
    cast = device is not None and device.type in ("cpu", "cuda")
    cast = cast and torch.is_autocast_enabled(device.type)  # type: ignore[union-attr]
    faked = FakeTensorMode() if cast else contextlib.nullcontext()
    with _disable_current_modes(), _hooks_aside(module), torch.no_grad(), faked:
        return _record(module, leaves, structure, device if cast else None)


def _record(
    module: torch.nn.Module, leaves: list[Any], structure: Any, fake: torch.device | None
) -> Program:
    """`record`, on meta tensors, or on fake tensors of the device ``fake`` where given."""
    metas = [_meta(t, fake) if isinstance(t, torch.Tensor) else t for t in leaves]
    refs = {id(m): Ref("input", i) for i, m in enumerate(metas) if isinstance(m, torch.Tensor)}
    state = {
        name: _meta(t, fake)
        for name, t in [*module.named_parameters(), *module.named_buffers()]
        if t is not None
    }
    refs |= {id(t): Ref("param", name) for name, t in state.items()}
    meta_args, meta_kwargs = tree_unflatten(metas, structure)
    recorder = Recorder(refs)
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
            if isinstance(ref, Ref) and ref.kind == "value":
                last_use[int(ref.key)] = index
    for ref in tree_flatten(output)[0]:
        if isinstance(ref, Ref) and ref.kind == "value":
            last_use[int(ref.key)] = len(recorder.calls)
    return Program(tuple(recorder.calls), output, last_use)


def bind(func: Callable[..., Any], args: Any, kwargs: Any) -> inspect.BoundArguments | None:
    """``func``'s arguments bound to their names, defaults filled; None where they do not bind."""
    try:
        bound = inspect.signature(func).bind(*args, **kwargs)
    except (TypeError, ValueError):
        return None
    bound.apply_defaults()
    return bound
