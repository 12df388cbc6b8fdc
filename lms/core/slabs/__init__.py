"""Run a submodule's forward in slabs along its first spatial dimension, so that none of its
operations holds more than a slab of its largest tensors at once.

Note: [Slabs]
A module's forward is recorded once per input shape as the torch functions it calls (on meta
tensors, with every tracer's modes and module hooks set aside), then replayed with each value in
one of three forms: whole (a tensor), stored (its slabs along dim 2, one tensor each) or lazy (a
pointwise function of other values, evaluated a piece at a time where a consumer reads it).
- A convolution runs a slab of its output at a time on the input rows that slab reads (its
  halo, and its stride; zeros past the edges, as its padding), and its output is stored.
- A normalization (batch, instance, group) takes its statistics from every slab first (each
  slab's variance and mean, combined as Chan et al. combine them), then normalizes lazily.
- Pointwise functions, concatenation along channels and padding across the other dims stay
  lazy; in-place ones run out of place on the fresh piece.
- Any other function gets its inputs whole, and its outputs are whole; a whole value made of
  slabs is written into its whole a slab at a time (Note [A whole value is written a slab at a
  time]). A whole input is read a slab at a time as a split of it.
- A tensor the forward makes on its input's device (``device=x.device``) is made on the device
  the module runs on, not on the meta device it was recorded on.
Autograd sees only slab-sized operations, so what they save is slab-sized and LMS moves or
recomputes each piece as its plan says. The gradients are not bitwise those of the unsplit
module: a convolution's weight gradient is summed slab by slab and the statistics are combined
from slabs. The difference is float rounding, bounded in the tests.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch.utils._pytree import tree_flatten

from lms.core.slabs.program import Program, SplitError, record
from lms.core.slabs.replay import replay
from lms.core.slabs.values import slab_bounds

__all__ = ["SplitError", "slab_bounds", "split_modules"]


@contextlib.contextmanager
def split_modules(model: torch.nn.Module, slabs: Mapping[str, int]) -> Iterator[None]:
    """Inside the block, each submodule named in ``slabs`` (as ``model.get_submodule`` takes
    it) runs its forward in that many slabs (Note [Slabs]); its own forward is back after.

    Raises:
        SplitError: a name is not a submodule of ``model`` or is a container that is never
            called (a ``ModuleList``), or a count is not an int of at least 2, before any
            module changes.
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
        if isinstance(module, (torch.nn.ModuleList, torch.nn.ModuleDict)):
            raise SplitError(
                f"lms: {name!r} is a {type(module).__name__}, whose forward is never called; "
                "name a module it holds"
            )
        modules.append((module, count))
    saved = [module.__dict__.get("forward") for module, _ in modules]
    try:
        for module, count in modules:
            module.forward = functools.partial(_slab_forward, module, count)
        yield
    finally:
        for (module, _), own in zip(modules, saved, strict=True):
            if own is None:
                module.__dict__.pop("forward", None)
            else:
                module.forward = own


_PROGRAMS: weakref.WeakKeyDictionary[torch.nn.Module, dict[Any, Program]] = (
    weakref.WeakKeyDictionary()
)
"""Each module's recorded forwards, by its inputs' shapes, strides and dtypes and its mode."""


def _slab_forward(module: torch.nn.Module, slabs: int, *args: Any, **kwargs: Any) -> Any:
    leaves = tree_flatten((args, kwargs))[0]
    key = (
        tuple((tuple(t.shape), t.stride(), t.dtype) for t in leaves if isinstance(t, torch.Tensor)),
        module.training,
    )
    programs = _PROGRAMS.setdefault(module, {})
    if key not in programs:
        patched = module.__dict__.pop("forward")
        try:
            programs[key] = record(module, args, kwargs)
        finally:
            module.forward = patched
    return replay(programs[key], module, slabs, leaves)
