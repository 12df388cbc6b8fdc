"""Which saved tensors stay where they are: parameters and buffers and views of them, tensors
too small to move, layouts the runtime does not move, and all saved inside `no_offload()` or
inside the modules named to `no_offload_in`."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch.nn.parameter import is_lazy
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

__all__ = [
    "Keep",
    "distinct_storages",
    "is_plain",
    "is_weight",
    "no_offload",
    "no_offload_in",
    "offload_blocked",
    "submodules",
    "without_node",
    "wrapped_parts",
]

_local = threading.local()


@contextlib.contextmanager
def no_offload() -> Iterator[None]:
    """Keep every tensor saved inside this block on the device."""
    _local.depth = getattr(_local, "depth", 0) + 1
    try:
        yield
    finally:
        _local.depth -= 1


def offload_blocked() -> bool:
    """Whether tensors saved now stay: inside `no_offload()` or a module given to
    `no_offload_in` (the trace asks too, so that plans count saved tensors as the runtime does)."""
    return getattr(_local, "depth", 0) > 0 or getattr(_local, "modules", 0) > 0


def leave_modules() -> None:
    """A step starts outside every module: forget a count that an interrupted forward (one
    that skipped its modules' forward hooks) left behind."""
    _local.modules = 0


class NoOffloadIn:
    """The hooks `no_offload_in` put on modules; ``remove()`` (or leaving a ``with``) takes
    them off."""

    def __init__(self, modules: tuple[torch.nn.Module, ...]):
        # Hooks on chosen modules run inside a model compiled in place: as they are, never traced.
        enter, leave = torch.compiler.disable(_enter), torch.compiler.disable(_leave)
        self._handles: list[Any] = []
        for module in modules:
            self._handles.append(module.register_forward_pre_hook(enter))
            self._handles.append(module.register_forward_hook(leave, always_call=True))

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def __enter__(self) -> NoOffloadIn:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()


def _enter(module: torch.nn.Module, args: object) -> None:
    _local.modules = getattr(_local, "modules", 0) + 1


def _leave(module: torch.nn.Module, args: object, output: object) -> None:
    _local.modules = max(getattr(_local, "modules", 0) - 1, 0)


def no_offload_in(*modules: torch.nn.Module) -> NoOffloadIn:
    """Keep every tensor saved while one of ``modules`` runs on the device, without editing
    the model: ``lms.no_offload_in(model.layer4, model.fc)``. Tracing and tuning see the same
    choice. The hooks stay until ``remove()`` on what this returns, or the end of its ``with``.

    Raises:
        TypeError: when one of ``modules`` is not a ``torch.nn.Module``.
    """
    for module in modules:
        if not isinstance(module, torch.nn.Module):
            raise TypeError(
                f"lms: no_offload_in takes modules (such as model.layer4), not "
                f"{type(module).__name__}"
            )
    return NoOffloadIn(modules)


def submodules(model: torch.nn.Module, names: Iterable[str]) -> tuple[torch.nn.Module, ...]:
    """``model``'s submodules by their qualified names ("layer4", "encoder.layers.0").

    Raises:
        ValueError: a name that is not one of ``model``'s submodules, with the top-level ones.
    """
    found = []
    for name in names:
        try:
            found.append(model.get_submodule(name))
        except AttributeError:
            children = ", ".join(child for child, _ in model.named_children()) or "none"
            raise ValueError(
                f"lms: {type(model).__name__} has no submodule {name!r}; its top-level ones: "
                f"{children}"
            ) from None
    return tuple(found)


class Keep:
    """Called on a saved tensor: whether it stays (not an activation, or not worth moving)."""

    def __init__(self, min_offload_bytes: int):
        self.min_bytes = max(min_offload_bytes, 1)
        self.fixed_ptrs: set[int] = set()
        """Addresses of the parameters' and buffers' storages."""
        self.models = 0
        """Models noted whole (`note_model`), as `LMS.tune` does."""
        self.host_weights: dict[tuple[torch.device, int], int] = {}
        """Bytes of the host storages of those models' parameters and buffers
        (`distinct_storages`)."""

    def note_model(self, model: torch.nn.Module) -> None:
        """Every parameter and buffer of ``model`` stays: also those a step reads without
        calling their module (a frozen attention's out_proj.weight, read by the functional op)."""
        tensors = [*model.parameters(), *model.buffers()]
        lazy = [tensor for tensor in tensors if is_lazy(tensor)]
        tensors = [tensor for tensor in tensors if not is_lazy(tensor)]
        for tensor in tensors:
            self.fixed_ptrs.update(_storage_ptrs(tensor))
        self.host_weights.update(distinct_storages(tensors, device_type="cpu"))
        # A lazy module's parameters have no storage until its first call makes them: the
        # model is not known whole, and each module call notes its parameters as it runs.
        self.models += not lazy

    def note_module(self, module: torch.nn.Module, args: object) -> None:
        """A forward pre-hook: the parameters and buffers of the module about to run stay."""
        # Runs before every module call: the tables directly, not parameters()'s generators.
        for table in (module._parameters, module._buffers):
            for tensor in table.values():
                if tensor is None or is_lazy(tensor):
                    continue
                if is_plain(tensor):
                    self.fixed_ptrs.add(tensor.untyped_storage().data_ptr())
                else:
                    self.fixed_ptrs.update(_storage_ptrs(tensor))

    def __call__(self, tensor: torch.Tensor) -> bool:
        if offload_blocked():
            return True
        return tensor.is_conj() or tensor.is_neg() or not self.movable(tensor)

    def movable(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor``'s storage is one the runtime may move, wherever it is saved: an
        activation, large enough, in a layout it copies."""
        if type(tensor) is not torch.Tensor:  # parameters, subclasses, fake tensors
            return False
        if is_weight(tensor):
            return False
        if tensor.layout != torch.strided:
            return False
        if tensor.device.type not in ("cpu", "cuda") or tensor.is_quantized:
            return False
        storage = tensor.untyped_storage()
        if storage.nbytes() < self.min_bytes:
            return False
        return storage.data_ptr() not in self.fixed_ptrs


_PLAIN = (torch.Tensor, torch.nn.Parameter)
"""Types whose storage is their own (most parameters and buffers): no subclass to look into."""


def is_plain(tensor: torch.Tensor) -> bool:
    """Whether ``tensor``'s storage is its own: a tensor or a parameter, not a subclass."""
    return type(tensor) in _PLAIN


def wrapped_parts(
    tensor: torch.Tensor,
) -> tuple[dict[str, torch.Tensor], dict[str, Any], Any] | None:
    """What a tensor subclass that wraps others and has no storage of its own (a DTensor, FSDP's
    sharded parameters) is made of: its inner tensors by name, the other objects its
    ``__tensor_unflatten__`` takes back by name (a DTensor's device mesh), and the context it
    takes with them; None for any other tensor."""
    if not is_traceable_wrapper_subclass(tensor):
        return None
    names, context = tensor.__tensor_flatten__()
    parts = {name: getattr(tensor, name) for name in names}
    inner = {name: part for name, part in parts.items() if isinstance(part, torch.Tensor)}
    others = {name: part for name, part in parts.items() if name not in inner}
    return inner, others, context


def is_weight(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a leaf that needs a gradient (a parameter), or a view of one
    (``weight.t()``): saves of those stay."""
    base = tensor if tensor._base is None else tensor._base
    return bool(base.is_leaf and base.requires_grad)


def _storages(tensor: torch.Tensor) -> list[torch.UntypedStorage]:
    """The storages behind ``tensor``: its own, or for a subclass that wraps others, theirs."""
    wrapped = wrapped_parts(tensor)
    if wrapped is None:
        return [tensor.untyped_storage()]
    return [storage for part in wrapped[0].values() for storage in _storages(part)]


def _storage_ptrs(tensor: torch.Tensor) -> list[int]:
    return [storage.data_ptr() for storage in _storages(tensor)]


def distinct_storages(
    values: Iterable[object], *, device_type: str | None = None
) -> dict[tuple[torch.device, int], int]:
    """The bytes of each distinct storage (by device and address) behind the strided tensors
    among ``values``, a subclass that wraps others by theirs; on ``device_type`` only, if given."""
    found: dict[tuple[torch.device, int], int] = {}
    for value in values:
        if not isinstance(value, torch.Tensor) or value.layout != torch.strided or is_lazy(value):
            continue
        if device_type is None or value.device.type == device_type:
            found.update(((s.device, s.data_ptr()), s.nbytes()) for s in _storages(value))
    return found


def without_node(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` as a pack hook may hold it: a detached alias unless it is a parameter (a leaf
    that needs a gradient).

    Note: [A kept save holds no reference cycle]
    An op that saves its own output (softmax, tanh, exp) makes the output's node hold the packed
    object: holding the output itself would close a cycle (output, node, packed, output) through
    autograd's C++ node, which Python's collector cannot see, and an output that backward never
    reaches (a metric computed with gradients on, an unused head) would never be freed. A
    detached alias has the same storage and version counter and no node. A tensor that needs no
    gradient (max pooling's indices, an RNN's workspace) is a leaf with no node, but its alias
    lets the object die with the caller's last reference, as it does when the runtime moves it:
    the trace watches those objects to learn what the step's code holds (Note [Tensors the
    step's code holds]).
    """
    return tensor if tensor.is_leaf and tensor.requires_grad else tensor.detach()
