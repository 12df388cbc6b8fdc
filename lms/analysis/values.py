"""The real values behind a traced step's fake tensors, where a step reads them and they come
cheap (Note [A value the step reads is computed for real]).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

import torch
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensor,
)
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils._pytree import tree_map
from torch.utils.weak import WeakIdKeyDictionary

from lms.core.recipes import written_arguments

__all__ = ["Values", "REAL_ELEMENTS"]

log = logging.getLogger("lms.analysis")

# Note: [A value the step reads is computed for real]
# Fake tensors have shapes, not values, and some steps read values: a loss that keeps the labels
# it scores (``(labels >= 0).nonzero()``, DeBERTa's), one that checks them (``labels.max() >=
# vocab_size``) and takes the lengths of masks (``mask.sum(-1)``, a CTC loss's), a padding check
# over the tokens. Such values come, nearly always, from the batch through a few small ops. So
# while the step is traced, `Values` keeps a graph of the ops it sees, each op's tensors referred
# to by the op that made them; the real tensors behind the batch's fake ones, and behind a real
# model's fake parameters, are its leaves. Where an op raises for want of a value, the ops that
# lead to its arguments run for real on the CPU, unless they would make more than
# `REAL_ELEMENTS` elements in all (a value read off the activations, which would run the model
# itself): the op then raises as it did. The real op gives its result's shape (a fake tensor of
# it) or its value (``.item()``), as the real step will. A tensor an op wrote in place is known
# by that op from there on; one whose storage was written through another view is not known any
# more. A random op draws from the CPU's generator under a fork of it, which is put back: a step
# that draws otherwise (a layer dropped at random) diverges from its plan, as any other would.
# An op made of a tensor not known, or larger than that limit, is not known itself. An op whose
# result's shape is set by its integer or boolean arguments alone takes zeros (one, expanded) for
# its floating-point ones (activations, their gradients) to give that shape: a CTC loss's target
# lengths, and a boolean index or mask from the batch (wav2vec2's masked time steps, whose
# gradient backward gathers with the same mask). A packed sequence's batch sizes stay real
# (Note [A packed sequence's batch sizes are real]).

# Note: [A packed sequence's batch sizes are real]
# A recurrent layer given a packed sequence (`torch.nn.utils.rnn.pack_padded_sequence`, how
# batches of sequences of different lengths go into an LSTM) runs its time steps in PyTorch's C++,
# which reads the sequence's batch sizes, an integer tensor on the CPU, to slice each step's rows
# of the data; so do packing's backward and `pad_packed_sequence`. Under fake tensors those sizes
# had no data, and the layer raised. They are set by the lengths the batch gives alone: packing
# runs for real, with zeros for the activations it packs, and its batch sizes are handed on as
# the real tensor they are in the real step, which its readers take as it does. The time steps
# then run on fake tensors, op by op, as the real step runs them. `pad_packed_sequence` writes
# each sequence's length into an integer tensor it allocates on the host: while it runs under
# the trace (`lms.analysis.trace._Padded`), that tensor is allocated for real. Lengths the trace
# cannot have (computed from the activations) fail the trace as before.

REAL_ELEMENTS = 1 << 24
"""The most elements the ops that lead to a value the step reads may make, for it to be had."""

_READS = (DataDependentOutputException, DynamicOutputShapeException)
_SHAPED_BY_INDICES = {
    torch.ops.aten._ctc_loss.Tensor,
    torch.ops.aten.index.Tensor,
    torch.ops.aten.masked_select.default,
    torch.ops.aten._pack_padded_sequence.default,
}
"""Ops whose result's shape depends on the values of their integer or boolean arguments alone
(the target lengths of a CTC loss, a boolean index or mask, a packed sequence's lengths), not of
their floating-point ones."""
_REAL_RESULTS = {torch.ops.aten._pack_padded_sequence.default: 1}
"""Ops whose result at this index stays real where the trace has it (Note [A packed sequence's
batch sizes are real])."""


class _Node:
    """One op's call, each tensor among its arguments given as the `_Ref` that made it; or a
    leaf, a real tensor."""

    __slots__ = ("func", "args", "kwargs", "written", "elements", "done")

    def __init__(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self.func, self.args, self.kwargs = func, args, kwargs
        self.written: tuple[tuple[int | str, int | None], ...] = ()  # where its written tensors are
        self.elements = 0  # of its outputs
        self.done: tuple[Any, Any] | None = None  # real ((args, kwargs), what it returned)


class _Ref:
    """A tensor: its node's output ``at`` (an index among the flattened outputs), or its argument
    written in place (``at``: the argument, and the index within it where it is a list)."""

    __slots__ = ("node", "at")

    def __init__(self, node: _Node, at: int | tuple[int | str, int | None]) -> None:
        self.node, self.at = node, at


def _leaf(value: torch.Tensor) -> _Ref:
    """A real tensor (its values on the CPU when first used)."""
    node = _Node(None, (), {})
    node.done = (((), {}), value)
    return _Ref(node, 0)


_UNKNOWN = object()
"""A tensor among an op's arguments whose value cannot be had."""


class Values:
    """Follows what each fake tensor of a traced step was made from, and answers an op that
    needs a value with the real one where it can be had (Note [A value the step reads is
    computed for real]). The recorder runs each op through `call`."""

    def __init__(self) -> None:
        self.bound: WeakIdKeyDictionary = WeakIdKeyDictionary()  # tensor -> (_Ref, generation)
        self.generation: dict[int, int] = {}  # storage -> how often it has been written

    def know(self, fake: torch.Tensor, real: torch.Tensor) -> None:
        """``fake`` stands for ``real`` (a tensor of the batch, a parameter), where ``real`` has
        values (not fake itself, nor on the meta device)."""
        if not isinstance(real, FakeTensor) and not real.is_meta:
            self.bound[fake] = (_leaf(real), self._generation(fake))

    def _generation(self, tensor: torch.Tensor) -> int:
        if tensor.layout != torch.strided:  # a sparse tensor: known by what made it alone
            return 0
        return self.generation.get(tensor.untyped_storage()._cdata, 0)

    def _ref(self, tensor: torch.Tensor) -> Any:
        if not isinstance(tensor, FakeTensor):
            return _leaf(tensor)  # a real tensor the step takes from outside
        bound = self.bound.get(tensor)
        if bound is None or bound[1] != self._generation(tensor):
            return _UNKNOWN
        return bound[0]

    def _refs(self, value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return self._ref(value)
        if isinstance(value, (list, tuple)) and any(isinstance(v, torch.Tensor) for v in value):
            return type(value)(self._ref(v) if isinstance(v, torch.Tensor) else v for v in value)
        return value

    def call(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """``func(*args, **kwargs)``, under fake tensors, or from the real values it needs."""
        node = _Node(
            func, tuple(self._refs(a) for a in args), {k: self._refs(v) for k, v in kwargs.items()}
        )
        written = list(_written(func, args, kwargs))
        node.written = tuple(where for where, _ in written)  # copied where run for real
        try:
            out = func(*args, **kwargs)
        except _READS:
            real = _real(node, args)
            if real is None:
                raise
            device = _device(args, kwargs)
            out = tree_map(lambda v: _fake_of(v, device), real)
            if func in _REAL_RESULTS:  # Note [A packed sequence's batch sizes are real]
                at = _REAL_RESULTS[func]
                out = (*out[:at], real[at], *out[at + 1 :])
        outs = out if isinstance(out, (list, tuple)) else (out,)
        node.elements = sum(v.numel() for v in outs if isinstance(v, torch.Tensor))
        # what is made of an unknown tensor, or is too large to be made for real, is not known
        known = node.elements <= REAL_ELEMENTS and all(r is not _UNKNOWN for r in _inputs(node))
        for where, tensor in written:
            key = tensor.untyped_storage()._cdata
            self.generation[key] = self.generation.get(key, 0) + 1
            if known:
                self.bound[tensor] = (_Ref(node, where), self.generation[key])
        if known:
            for index, value in enumerate(outs):
                if isinstance(value, torch.Tensor) and all(value is not v for v in args):
                    self.bound[value] = (_Ref(node, index), self._generation(value))
        return out


def _written(
    func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Iterator[tuple[tuple[int | str, int | None], torch.Tensor]]:
    """Each tensor ``func`` writes (in place, ``out=``, a batch norm's running statistics), with
    where it is among the arguments: the argument, and its index within it where it is a list."""
    for index, name in written_arguments(func):
        at, value = (index, args[index]) if index < len(args) else (name, kwargs.get(name))
        if isinstance(value, torch.Tensor):
            yield (at, None), value
        elif isinstance(value, (list, tuple)):
            for j, tensor in enumerate(value):
                if isinstance(tensor, torch.Tensor):
                    yield (at, j), tensor


def _device(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.device | None:
    for value in (*args, *kwargs.values()):
        for item in value if isinstance(value, (list, tuple)) else (value,):
            if isinstance(item, FakeTensor):
                return item.device
    return None


def _real(node: _Node, given: tuple[Any, ...]) -> Any:
    """``node``'s op run for real on its arguments' real values (``given``, fake); None where
    they cannot be had."""
    if not _affordable(node):
        if node.func not in _SHAPED_BY_INDICES:
            return None
        # its floating-point arguments do not shape its result: zeros in their place
        with _real_ops():
            args = tuple(
                _leaf(torch.zeros((), dtype=fake.dtype).expand(fake.shape))
                if isinstance(fake, torch.Tensor) and fake.is_floating_point()
                else ref
                for fake, ref in zip(given, node.args, strict=True)
            )
        node = _Node(node.func, args, node.kwargs)
        if not _affordable(node):
            return None
    try:
        with _real_ops():
            _run(node)
    except Exception as error:  # an op that runs on the device only, say: as if not known
        log.debug("[LMS] the trace could not run %s for real: %s", node.func, error)
        return None
    assert node.done is not None
    return node.done[1]


def _inputs(node: _Node) -> Iterator[Any]:
    """The refs among ``node``'s arguments (`_UNKNOWN` for a tensor not known)."""
    for value in (*node.args, *node.kwargs.values()):
        if isinstance(value, (list, tuple)):
            yield from (v for v in value if isinstance(v, _Ref) or v is _UNKNOWN)
        elif isinstance(value, _Ref) or value is _UNKNOWN:
            yield value


def _affordable(root: _Node) -> bool:
    """Whether every tensor ``root`` needs is known, and the ops still to run make at most
    `REAL_ELEMENTS` elements."""
    seen: set[int] = set()
    stack = [root]
    total = 0
    while stack:
        node = stack.pop()
        if id(node) in seen or node.done is not None:
            continue
        seen.add(id(node))
        total += node.elements
        if total > REAL_ELEMENTS:
            return False
        for ref in _inputs(node):
            if ref is _UNKNOWN:
                return False
            stack.append(ref.node)
    return True


def _run(root: _Node) -> None:
    """Run ``root``, and first the ops that lead to it, for real."""
    stack: list[tuple[_Node, bool]] = [(root, False)]
    while stack:
        node, ready = stack.pop()
        if node.done is not None:
            continue
        if not ready:
            stack.append((node, True))
            stack.extend((r.node, False) for r in _inputs(node))
            continue
        written = {where[0] for where in node.written}
        args = tuple(_real_value(v, i in written) for i, v in enumerate(node.args))
        kwargs = {k: _real_value(v, k in written) for k, v in node.kwargs.items()}
        node.done = ((args, kwargs), node.func(*args, **kwargs))


def _real_value(value: Any, copy: bool) -> Any:
    """An argument with each tensor's real value (those of the ops it takes them from done): a
    copy where the op writes it; a device, the CPU."""
    if isinstance(value, _Ref):
        real = _of(value)
        return real.clone() if copy else real
    if isinstance(value, (list, tuple)):
        return type(value)(_real_value(v, copy) for v in value)
    if isinstance(value, torch.device):
        return torch.device("cpu")
    return value


def _of(ref: _Ref) -> Any:
    assert ref.node.done is not None
    (args, kwargs), out = ref.node.done
    if ref.node.func is None and out.device.type != "cpu":  # a leaf on a device
        out = out.cpu()
        ref.node.done = ((args, kwargs), out)
    if isinstance(ref.at, int):
        return out[ref.at] if isinstance(out, (list, tuple)) else out
    at, j = ref.at
    value = args[at] if isinstance(at, int) else kwargs[at]
    return value if j is None else value[j]


@contextlib.contextmanager
def _real_ops() -> Iterator[None]:
    """Ops run for real, on the CPU, outside the trace's modes, autograd and autocast, their
    random draws put back."""
    with (
        _disable_current_modes(),
        torch.no_grad(),
        torch.autocast("cpu", enabled=False),
        torch.random.fork_rng(devices=[]),
        torch.device("cpu"),
    ):
        yield


def _fake_of(value: Any, device: torch.device | None) -> Any:
    """A fake tensor of ``value``'s shape on the device of the op's tensors; a number as it is."""
    if not isinstance(value, torch.Tensor):
        return value
    return torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device=device)
