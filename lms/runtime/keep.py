"""Which saved tensors stay where they are: parameters and buffers and views of them, tensors
too small to move, layouts the runtime does not move, and all saved inside `no_offload()`."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch

__all__ = ["Keep", "no_offload"]

_local = threading.local()


@contextlib.contextmanager
def no_offload() -> Iterator[None]:
    """Keep every tensor saved inside this block on the device."""
    _local.depth = getattr(_local, "depth", 0) + 1
    try:
        yield
    finally:
        _local.depth -= 1


class Keep:
    """Called on a saved tensor: whether it stays (not an activation, or not worth moving)."""

    def __init__(self, min_offload_bytes: int):
        self.min_bytes = max(min_offload_bytes, 1)
        self.fixed_ptrs: set[int] = set()
        """Addresses of the parameters' and buffers' storages."""
        self.models = 0
        """Models noted whole (`note_model`), as `LMS.tune` does."""

    def note_model(self, model: torch.nn.Module) -> None:
        """Every parameter and buffer of ``model`` stays: also those a step reads without
        calling their module (a frozen attention's out_proj.weight, read by the functional op)."""
        for tensor in [*model.parameters(), *model.buffers()]:
            self.fixed_ptrs.add(tensor.untyped_storage().data_ptr())
        self.models += 1

    def note_module(self, module: torch.nn.Module, args: object) -> None:
        """A forward pre-hook: the parameters and buffers of the module about to run stay."""
        # Runs before every module call: the tables directly, not parameters()'s generators.
        for table in (module._parameters, module._buffers):
            for tensor in table.values():
                if tensor is not None:
                    self.fixed_ptrs.add(tensor.untyped_storage().data_ptr())

    def __call__(self, tensor: torch.Tensor) -> bool:
        if getattr(_local, "depth", 0) > 0:
            return True
        if type(tensor) is not torch.Tensor:  # parameters, subclasses, fake tensors
            return True
        base = tensor if tensor._base is None else tensor._base
        if base.is_leaf and base.requires_grad:  # a parameter, or a view of one (weight.t())
            return True
        if tensor.layout != torch.strided or tensor.is_conj() or tensor.is_neg():
            return True
        if tensor.device.type not in ("cpu", "cuda") or tensor.is_quantized:
            return True
        storage = tensor.untyped_storage()
        if storage.nbytes() < self.min_bytes:
            return True
        return storage.data_ptr() in self.fixed_ptrs
