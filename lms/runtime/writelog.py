"""Forward's history of writes, from which the runtime makes recipes for saved storages.

While a plan recomputes anything, `WriteLog` (a dispatch mode) watches forward: for each storage
that a recomputable op (`lms.core.recipes.RECOMPUTABLE_OPS`) allocates, it keeps the calls
that wrote it. When autograd saves such a storage, the session turns that history into a `Recipe`
whose tensor arguments are the storage itself, parameters and buffers, other saved entries, or
storages autograd did not save, made again by recipes of their own (Note [Remake what was never
saved], `lms.core.recipes`). `lms.runtime.recompute` replays it in backward.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from lms.core.junctions import in_backward
from lms.core.keep import is_weight
from lms.core.recipes import RECOMPUTABLE_OPS, written_arguments

__all__ = ["WriteLog", "Call", "Recipe", "Slot"]


@dataclasses.dataclass
class _Arg:
    """A tensor argument as forward passed it."""

    storage: weakref.ref[torch.UntypedStorage]
    size: torch.Size
    stride: tuple[int, ...]
    offset: int
    dtype: torch.dtype
    fixed: torch.Tensor | None
    """The tensor itself when it is a parameter or buffer (held: it outlives the step), or a
    tensor too small to offload (autocast's copy of a weight): held by the recipe."""
    version: int
    written: bool
    entry: Any
    """The saved entry holding its storage when the call ran, if autograd had saved it by then."""
    ptr: int
    """Its storage's address when the call ran."""
    made: _Made | None = None
    """How forward had made its storage by then, where recomputable ops alone wrote it (Note
    [Remake what was never saved])."""


@dataclasses.dataclass(frozen=True)
class _Made:
    """The history of a storage as a later call found it."""

    ptr: int
    nbytes: int
    calls: tuple[_Written, ...]


@dataclasses.dataclass
class _Written:
    """One forward call that wrote a storage."""

    func: Any
    leaves: list[Any]
    spec: Any


@dataclasses.dataclass
class Slot:
    """A tensor argument of a recipe call: a view of the target, of an entry, or a fixed tensor."""

    kind: str  # "self", "entry", "fixed" or "made"
    size: torch.Size
    stride: tuple[int, ...]
    offset: int
    dtype: torch.dtype
    entry: Any = None
    fixed: torch.Tensor | None = None
    version: int = 0
    written: bool = False
    made: Recipe | None = None
    """For "made": the recipe of a storage autograd did not save, replayed first."""


@dataclasses.dataclass
class Call:
    func: Any
    leaves: list[Any]
    """Arguments flattened; tensors replaced by `Slot`s."""
    spec: Any


@dataclasses.dataclass
class Recipe:
    """How to make one saved storage again."""

    calls: list[Call]
    inputs: list[Any]
    """The entries it reads (the session holds a handle on each while the recipe lives)."""
    nbytes: int
    checksum: torch.Tensor | None = None
    """Of the bytes forward made, where the first replay is to be checked against them."""


# Note: [The write log's own cost]
# The log sees every op of the step, so what it spends a call the step spends too. A call's shape
# (which arguments are lists, and how long) gives the same leaves in a loop and the same spec from a
# cache, and an op's facts (its name, its schema's writes) are looked up once a process. What stays
# is a Python dispatch mode's own toll, paid by one that only passes each call on as much. The "cpu"
# spec charges each op for it under a plan that recomputes (`DeviceSpec.write_log_op_s`), so
# planners recompute on a CPU only where that pays for the log; a GPU's host runs that Python while
# the card works through the queue. The costs measured: benchmarks/results/README.md, "The write
# log's own cost".
_FACTS: dict[tuple[Any, int], tuple[bool, frozenset[int]]] = {}
_SPECS: dict[Any, Any] = {}
_CONTAINERS = (list, tuple, dict)


def _facts(func: Any, num_args: int) -> tuple[bool, frozenset[int]]:
    """Whether ``func`` is recomputable, and which of its first ``num_args`` arguments it
    writes."""
    key = (func, num_args)
    known = _FACTS.get(key)
    if known is None:
        recomputable = str(func) in RECOMPUTABLE_OPS
        written = frozenset(i for i, _ in written_arguments(func) if i < num_args)
        known = _FACTS[key] = recomputable, written
    return known


def _flatten(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[list[Any], Any]:
    """``tree_flatten((args, kwargs))``, for an op's call (Note [The write log's own cost])."""
    leaves: list[Any] = []
    shape: list[Any] = []
    for arg in args:
        kind = type(arg)
        if kind is list or kind is tuple:
            if any(isinstance(item, _CONTAINERS) for item in arg):
                return tree_flatten((args, kwargs))  # type: ignore[no-any-return]
            leaves.extend(arg)
            shape.append((kind, len(arg)))
        elif isinstance(arg, _CONTAINERS):  # torch.Size, a named tuple: pytree's own nodes
            return tree_flatten((args, kwargs))  # type: ignore[no-any-return]
        else:
            leaves.append(arg)
            shape.append(None)
    for value in kwargs.values():
        if isinstance(value, _CONTAINERS):
            return tree_flatten((args, kwargs))  # type: ignore[no-any-return]
        leaves.append(value)
    key = (tuple(shape), tuple(kwargs))
    spec = _SPECS.get(key)
    if spec is None:
        spec = _SPECS[key] = tree_flatten((args, kwargs))[1]
    return leaves, spec


def _outputs(out: Any) -> list[Any]:
    """The leaves of an op's output."""
    if isinstance(out, torch.Tensor):
        return [out]
    if type(out) in (tuple, list) and not any(isinstance(item, _CONTAINERS) for item in out):
        return list(out)
    return tree_flatten(out)[0]  # type: ignore[no-any-return]


class WriteLog(TorchDispatchMode):
    """Forward's history of writes into storages that recomputable ops allocated."""

    def __init__(
        self,
        fixed_ptrs: set[int],
        entry_of: Callable[[torch.UntypedStorage], Any],
        small_bytes: int = 0,
    ):
        super().__init__()
        self.fixed_ptrs = fixed_ptrs
        self.entry_of = entry_of
        self.small_bytes = small_bytes
        """Arguments whose storage is smaller than this (never offloaded) are held as they are."""
        self.histories: dict[int, tuple[weakref.ref[torch.UntypedStorage], list[_Written]]] = {}
        self.unsaved: dict[int, list[_Arg]] = {}
        """Arguments read before autograd saved their storage, by its address (`saved`)."""
        self._freed: list[tuple[int, weakref.ref[torch.UntypedStorage]]] = []
        """Histories whose storage has died since the last call, dropped at the next
        (Note [The log lets go of what the step freed])."""

    # Note: [The log lets go of what the step freed]
    # A history holds the arguments of the calls that wrote its storage, and with them every
    # tensor too small to offload that they read (held so that a replay finds it). Kept to the
    # step's end, those outlive the step's own use of them, and a plan that recomputed anything
    # took more memory than its simulation: on a CPU, where the budget counts the heap, enough
    # to pass it. A history is needed only while its storage lives and forward may still
    # save it: a storage that dies takes its history along (the death is noted by a weakref's
    # callback, on whichever thread let the storage go, and acted on by the next call, so that
    # only the watched thread changes the histories, as releases are queued in Note [A handle
    # may be released on any thread]), and the first call of backward drops them all, with the
    # arguments still waiting for their save, every save of forward having taken its recipe by
    # then. A forward run again in
    # the same step (gradient accumulation) starts histories afresh. Measured:
    # benchmarks/results/README.md, "The log lets go of what the step freed".
    def _watch(self, ptr: int, storage: torch.UntypedStorage) -> weakref.ref[torch.UntypedStorage]:
        """A weak reference to ``storage`` that marks its history ``ptr`` to drop once it dies."""
        freed = self._freed
        return weakref.ref(storage, lambda ref: freed.append((ptr, ref)))

    def _drop_freed(self) -> None:
        while self._freed:
            ptr, ref = self._freed.pop()
            # No local name holds the history: what it held goes now, and a storage that dies
            # with it is dropped in this same loop.
            if self.histories.get(ptr, (None,))[0] is ref:
                del self.histories[ptr]

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if in_backward():  # backward: nothing to learn, and forward's histories are done with
            if self.histories or self.unsaved:
                self.histories.clear()
                self.unsaved.clear()
            return out
        if self._freed:
            self._drop_freed()
        leaves, spec = _flatten(args, kwargs)
        read = {
            leaf.untyped_storage().data_ptr()
            for leaf in leaves
            if isinstance(leaf, torch.Tensor) and leaf.device.type != "meta"
        }
        recomputable, written = _facts(func, len(args))
        first = out if isinstance(out, torch.Tensor) else None
        if first is None and isinstance(out, (tuple, list)) and out:
            first = out[0] if isinstance(out[0], torch.Tensor) else None
        if recomputable and first is not None:
            storage = first.untyped_storage()
            ptr = storage.data_ptr()
            call = _Written(
                func, [self._arg(leaf, i in written) for i, leaf in enumerate(leaves)], spec
            )
            if ptr in read:  # in place: extends the history of what it writes
                known = self.histories.get(ptr)
                if known is not None and known[0]() is storage:
                    known[1].append(call)
                return out
            self.histories[ptr] = (self._watch(ptr, storage), [call])
            return out
        # Anything else that writes a storage ends its history.
        for position in written:
            if position < len(leaves) and isinstance(leaves[position], torch.Tensor):
                self.histories.pop(leaves[position].untyped_storage().data_ptr(), None)
        for value in _outputs(out):
            if isinstance(value, torch.Tensor) and value.device.type != "meta":
                ptr = value.untyped_storage().data_ptr()
                if ptr not in read:
                    self.histories.pop(ptr, None)
        return out

    def _arg(self, leaf: Any, written: bool) -> Any:
        if not isinstance(leaf, torch.Tensor):
            return leaf
        storage = leaf.untyped_storage()
        ptr = storage.data_ptr()
        # A parameter the step reads without calling its module (a functional attention's
        # projection weights) is one, whether or not a module hook noted it.
        fixed = (
            ptr in self.fixed_ptrs
            or is_weight(leaf)
            or (storage.nbytes() < self.small_bytes and not written)
        )
        made = None
        known = self.histories.get(ptr) if not (fixed or written) else None
        if known is not None and known[0]() is storage:
            made = _Made(ptr, storage.nbytes(), tuple(known[1]))
        arg = _Arg(
            storage=weakref.ref(storage),
            size=leaf.size(),
            stride=leaf.stride(),
            offset=int(leaf.storage_offset()),
            dtype=leaf.dtype,
            fixed=leaf if fixed else None,
            version=leaf._version,
            written=written,
            # Note: [Name a recipe's inputs by entry]
            # An offloaded input's device storage may be freed before the tensor that reads it
            # is saved, so its entry is looked up now, while the storage is certainly alive,
            # or, where autograd saves it only after this call (BatchNorm saves its input once
            # its kernel has run), given to it when it is saved (`saved`).
            entry=None if fixed else self.entry_of(storage),
            ptr=ptr,
            made=made,
        )
        if not fixed and arg.entry is None and ptr != 0:
            self.unsaved.setdefault(ptr, []).append(arg)
        return arg

    def saved(self, storage: torch.UntypedStorage, entry: Any) -> None:
        """Autograd saved ``storage`` as ``entry``: name it in the arguments that read it
        (Note [Name a recipe's inputs by entry])."""
        for arg in self.unsaved.pop(storage.data_ptr(), ()):
            if arg.storage() is storage:
                arg.entry = entry

    def _entry(self, leaf: _Arg, storage: torch.UntypedStorage | None) -> Any:
        if leaf.entry is not None and not leaf.entry.released:
            return leaf.entry
        return self.entry_of(storage) if storage is not None else None

    def recipe(self, storage: torch.UntypedStorage, entry: Any = None) -> Recipe | None:
        """The recipe for ``storage`` (saved as ``entry``), or None when some argument cannot be
        had in backward."""
        ptr = storage.data_ptr()
        known = self.histories.get(ptr)
        if known is None or known[0]() is not storage:
            return None
        inputs: list[Any] = []
        calls = self._calls(_Made(ptr, storage.nbytes(), tuple(known[1])), inputs, {}, entry)
        return None if calls is None else Recipe(calls, inputs, storage.nbytes())

    def _calls(
        self,
        made: _Made,
        inputs: list[Any],
        remade: dict[tuple[int, int], Recipe],
        target: Any,
    ) -> list[Call] | None:
        """The calls that make ``made``'s storage again, its entries added to ``inputs``;
        ``remade``: recipes of storages autograd did not save, built once per recipe;
        ``target``: the entry the whole recipe makes, which none of them may read (an
        address cannot tell: a storage freed early may have had the target's address)."""
        calls: list[Call] = []
        for written in made.calls:
            leaves: list[Any] = []
            for leaf in written.leaves:
                if not isinstance(leaf, _Arg):
                    leaves.append(leaf)
                    continue
                geometry = (leaf.size, leaf.stride, leaf.offset, leaf.dtype)
                if leaf.ptr == made.ptr and made.ptr != 0:
                    # Only it had that address while its history ran.
                    leaves.append(Slot("self", *geometry))
                elif leaf.fixed is not None:
                    if leaf.fixed._version != leaf.version and not leaf.written:
                        return None  # changed in place since the call read it
                    leaves.append(
                        Slot(
                            "fixed",
                            *geometry,
                            fixed=leaf.fixed,
                            version=leaf.fixed._version,
                            written=leaf.written,
                        )
                    )
                elif (entry := self._entry(leaf, leaf.storage())) is not None:
                    if entry is target:
                        return None  # a replay that would need itself
                    leaves.append(Slot("entry", *geometry, entry=entry))
                    if all(entry is not other for other in inputs):
                        inputs.append(entry)
                elif leaf.made is not None:
                    key = (id(leaf.made.calls[0]), len(leaf.made.calls))
                    if key not in remade:
                        sub = self._calls(leaf.made, inputs, remade, target)
                        if sub is None:
                            return None
                        remade[key] = Recipe(sub, [], leaf.made.nbytes)
                    leaves.append(Slot("made", *geometry, made=remade[key]))
                else:
                    return None
            calls.append(Call(written.func, leaves, written.spec))
        return calls
