"""FSDP2 (`fully_shard`) in a trace: its hooks lifted while the step is recorded, and its
parameters counted as each process holds them (Note [FSDP2's layers traced whole])."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Callable, Iterator
from typing import Any

import torch

from lms.core.errors import UnplannableStepError
from lms.core.records import OpRecord, StorageRecord

__all__ = ["Unit", "account", "hooks_lifted", "resolve", "units"]

log = logging.getLogger("lms.analysis")


# Note: [FSDP2's layers traced whole]
# Under `fully_shard` each layer's parameters are DTensors holding this process's shard; FSDP's
# hooks gather a layer's parameters before it runs and free them after, with collectives that
# fake tensors cannot run. The trace lifts those hooks for the step it records and stands a whole
# fake parameter, of the DTensor's global shape, in for each shard: the ops and saved tensors it
# sees are those each process runs between its gathers, so a plan's entries are each process's.
# Then `account` counts the parameters as FSDP holds them: each shard for the whole step, and a
# layer's gathered rest (the whole less the shard) from its first forward op to its last, and
# again from its first backward op to its last, with its unsharded gradients, which FSDP
# reduce-scatters into shards when the layer's backward ends. The root's parameters stay gathered
# from forward into backward, as FSDP keeps them. Not counted: FSDP prefetching the next layer's
# gather while one runs (on a GPU, one layer more at once), and its communication buffers.
# Refused before any work: a `MixedPrecisionPolicy` that gathers the parameters in another dtype
# (the step it runs computes in that dtype, not the stored one the trace would see), and tensor
# parallelism, whose DTensors flow through forward itself.


@dataclasses.dataclass
class Unit:
    """One module `fully_shard` was called on, and the parameters it gathers."""

    name: str
    """Its qualified name in the model ('' for the model itself)."""
    params: list[tuple[torch.nn.Module, str, int, int]]
    """Each parameter: the module holding it, its name there, its shard's bytes, its bytes."""
    storages: list[tuple[int, int | None]] = dataclasses.field(default_factory=list)
    """Each parameter's storage in the trace, and its gradient's (None without one)."""


def _fsdp_module() -> type | None:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        return None
    return FSDPModule


def _groups(module: Any) -> list[Any]:
    state = module._get_fsdp_state()
    groups = getattr(state, "_fsdp_param_groups", None)  # older releases keep one group
    if groups is None:
        group = getattr(state, "_fsdp_param_group", None)
        groups = [group] if group is not None else []
    return list(groups)


def units(model: torch.nn.Module) -> list[Unit]:
    """The modules of ``model`` that FSDP2 shards, outermost first; none where it shards none
    or where this PyTorch's FSDP keeps its state where this cannot read it (the trace then
    refuses its DTensors as any other's).

    Raises:
        UnplannableStepError: FSDP gathers the parameters in another dtype (a
            `MixedPrecisionPolicy` with ``param_dtype``): the step it runs is not the traced one.
    """
    fsdp = _fsdp_module()
    if fsdp is None:
        return []
    found = []
    try:
        for name, module in model.named_modules():
            if not isinstance(module, fsdp):
                continue
            params = []
            for group in _groups(module):
                cast = getattr(getattr(group, "mp_policy", None), "param_dtype", None)
                for fsdp_param in group.fsdp_params:
                    stored = fsdp_param.sharded_param.dtype
                    if cast is not None and cast != stored and stored.is_floating_point:
                        raise UnplannableStepError(
                            f"lms: {name or 'the model'} is sharded by FSDP2 with a "
                            f"MixedPrecisionPolicy that gathers its {stored} parameters as "
                            f"{cast}, which a trace of the stored parameters would not see; "
                            "tune the model without that policy's param_dtype (its "
                            "activations under torch.autocast are traced alike), or run "
                            "lms.LMS(budget=...) without tune"
                        )
                    info = fsdp_param._module_info
                    shard = fsdp_param.sharded_param
                    local = shard.to_local() if hasattr(shard, "to_local") else shard
                    whole = shard.numel() * shard.element_size()
                    params.append(
                        (info.module, info.param_name, local.numel() * local.element_size(), whole)
                    )
            found.append(Unit(name, params))
    except AttributeError as error:
        log.info("[LMS] FSDP2's state could not be read (no %s): tune refuses its model", error)
        return []
    return found


def resolve(found: list[Unit], storage_id: Callable[[torch.Tensor], tuple[int, bool]]) -> None:
    """Each unit's parameters' storages, and their gradients', in the trace (called after the
    traced backward, with the fake parameters still in place)."""
    for unit in found:
        unit.storages = []
        for module, name, _, _ in unit.params:
            param = getattr(module, name)
            grad = param.grad
            gradient = None if grad is None else storage_id(grad)[0]
            unit.storages.append((storage_id(param)[0], gradient))


def account(
    storages: list[StorageRecord], ops: tuple[OpRecord, ...], found: list[Unit], root: str
) -> list[StorageRecord]:
    """``storages`` with FSDP2's parameters and gradients at their shards' bytes, and the rest of
    each unit's gathered where FSDP gathers it (Note [FSDP2's layers traced whole]); ``root`` is
    the name the trace gives the model's own module."""
    if not found:
        return storages
    counted = list(storages)
    last = len(ops) - 1
    for unit in found:  # FSDP2 manages each parameter in one unit alone
        rest = grads = 0
        for (_, _, shard, whole), (param, grad) in zip(unit.params, unit.storages, strict=True):
            counted[param] = dataclasses.replace(counted[param], nbytes=shard)
            rest += whole - shard
            if grad is not None:
                counted[grad] = dataclasses.replace(counted[grad], nbytes=shard)
                grads += whole - shard
        prefix = f"{root}.{unit.name}" if unit.name else root
        forward = _span(ops, prefix, "forward")
        backward = _span(ops, prefix, "backward")
        if not unit.name and forward is not None:  # the root stays gathered into backward
            end = backward[1] if backward is not None else last
            spans = [(forward[0], end, rest)]
            if backward is not None:
                spans.append((*backward, grads))
        else:
            spans = [] if forward is None else [(*forward, rest)]
            if backward is not None:
                spans.append((*backward, rest + grads))
        for begin, end, nbytes in spans:
            if nbytes > 0:
                counted.append(
                    StorageRecord(
                        id=len(counted),
                        nbytes=nbytes,
                        kind="param",
                        alloc_op=begin,
                        free_op=end,
                        last_forward_op=-1,
                    )
                )
    return counted


def _span(ops: tuple[OpRecord, ...], prefix: str, phase: str) -> tuple[int, int] | None:
    """The first and last op of ``phase`` run by the module named ``prefix`` or one inside it."""
    inside = [
        op.index
        for op in ops
        if op.phase == phase and (op.module == prefix or op.module.startswith(prefix + "."))
    ]
    return (inside[0], inside[-1]) if inside else None


@contextlib.contextmanager
def hooks_lifted(model: torch.nn.Module) -> Iterator[None]:
    """FSDP2's forward hooks off ``model``'s modules while the block runs; back, in place, after."""
    fsdp = _fsdp_module()
    if fsdp is None:
        yield
        return
    lifted: list[tuple[torch.nn.Module, str, dict[int, Any]]] = []
    try:
        for module in model.modules():
            if isinstance(module, fsdp):
                for table in ("_forward_pre_hooks", "_forward_hooks"):
                    hooks = getattr(module, table)
                    lifted.append((module, table, dict(hooks)))
                    for key in [k for k, hook in hooks.items() if _is_fsdp_hook(hook)]:
                        del hooks[key]
        yield
    finally:
        for module, table, hooks in lifted:
            current = getattr(module, table)
            current.clear()
            current.update(hooks)


def _is_fsdp_hook(hook: Any) -> bool:
    """Whether ``hook`` is one FSDP2 registered (its state's method, or the wrapper it makes for
    modules grouped under one state)."""
    owner = getattr(hook, "__self__", None)
    where = getattr(type(owner), "__module__", "") if owner is not None else ""
    where = where or getattr(hook, "__module__", "") or ""
    return where.startswith("torch.distributed.fsdp._fully_shard")
