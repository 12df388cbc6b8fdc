"""Gradient junctions: where one tensor feeds several operations, its partial gradients meet.

Note: [Why junctions, and how the sum stays bit for bit]
Autograd sums the partial gradients of a tensor in the input buffer of the tensor's producer.
The partial that arrives first waits there, on the device, while the other branches run their
backward: at a residual block that is one more activation-sized buffer at the block's busiest
moment, and no saved-tensor hook sees it, because a gradient is not a saved tensor. Hooks on the
autograd nodes can move it: a post hook on each consumer takes the partials as they arrive (and
hands the engine nothing, or a stand-in, in their place; see `partials_taken`), a pre hook on the
producer brings them back and replaces what the engine has with their sum. The engine would have
computed ``((p1 + p2) + p3) ...`` in the order the partials arrived; floating-point addition is
commutative but not associative, so the join folds them in the same order, the partial the
engine kept last, as it arrived last.

That needs every consumer hooked before the first partial arrives, so a junction names its number
of consumer slots. A walk from the first node of backward that reads a saved tensor counts them
over every node reachable from there.

That walk cannot see a branch that backward runs apart from it: with ``loss = a(t) + b(t)`` a
consumer of ``t`` in ``b`` is not reachable from the first node of ``a``. The trace keeps every
node forward makes (a function mode sees each op's ``grad_fn``) and counts consumers over all of
them, and records a junction only where that many partials arrived; a plan names that count. The
runtime walks down from the node of every tensor the step saved as well (each branch of backward
holds one, below which its consumers lie), and hooks a junction only where it counts as many, so
a partial it cannot see never lands in the middle of the fold. A consumer in a branch where no op
saves a tensor stays out of its sight all the same; the trace also walks as the runtime does and
records no junction where the two counts differ, so the simulation never counts on relieving one
the runtime will leave to autograd.

The trace and the runtime name a junction by the saved entry (ordinal) of its tensor and find its
autograd edge the same way: the tensor's ``grad_fn`` and ``output_nr`` when it is first saved.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping
from typing import Any

import torch

__all__ = ["Edge", "edge_of", "fan_in", "attach", "partials_taken", "in_backward"]

Edge = tuple[Any, int]


def in_backward() -> bool:
    """Whether autograd's engine is running a backward pass on this thread."""
    return bool(torch._C._current_graph_task_id() != -1)


"""An autograd edge: the node that produced a tensor and the tensor's output number there."""


def partials_taken(partials: int) -> int:
    """How many of the partials meeting at a relieved junction go off the device.

    The engine must be handed one partial: a pre hook may not put a gradient where there was
    none. Where two meet, the last stays, which costs nothing: it arrives just before the sum and
    brought back it would take the same room. Where more meet, the sum so far and the next partial
    brought back would sit beside it, so the last goes too and the engine is handed a zero that
    takes no memory (a scalar expanded) in its place.
    """
    return partials - 1 if partials == 2 else partials


def edge_of(tensor: torch.Tensor) -> Edge | None:
    """The edge gradients of ``tensor`` flow into; None for a tensor autograd made no node for."""
    node = tensor.grad_fn
    if node is None:
        return None
    return node, tensor.output_nr


def fan_in(*starts: Any) -> dict[Edge, list[tuple[Any, int]]]:
    """For every edge reachable from ``starts``, the consumer nodes and input slots feeding it."""
    seen: set[Any] = set()
    nodes = []
    todo = list(starts)
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        nodes.append(node)
        todo.extend(following for following, _ in node.next_functions)
    return _consumers(nodes)


def _consumers(nodes: list[Any]) -> dict[Edge, list[tuple[Any, int]]]:
    consumers: dict[Edge, list[tuple[Any, int]]] = {}
    for node in nodes:
        for slot, (following, number) in enumerate(node.next_functions):
            if following is not None:
                consumers.setdefault((following, number), []).append((node, slot))
    return consumers


def attach(
    edges: Mapping[Edge, Hashable],
    root: Any,
    take: Callable[[Hashable, torch.Tensor, bool], torch.Tensor | None],
    join: Callable[[Hashable, torch.Tensor | None], torch.Tensor | None],
    consumers: Mapping[Edge, list[tuple[Any, int]]] | None = None,
    partials: Mapping[Any, int] | None = None,
) -> dict[Hashable, int]:
    """Hook the junctions among ``edges`` (each named by its key); returns the keys hooked, each
    with the number of partial gradients that meet there (its consumer slots).

    Consumers are counted over the nodes reachable from ``root``, or taken from ``consumers``
    (`fan_in` over every node forward made, as the trace counts them). With ``partials``, a key
    is hooked only where the count is the one given for it.

    In each backward, ``take(key, partial, last)`` runs on each partial gradient that reaches a
    junction, in the order they arrive: it returns None to hand the engine nothing for it, or the
    tensor the engine gets in its place; the last partial (``last`` True) must be handed on.
    ``join(key, rest)`` runs before the producer's backward with the engine's sum of what it was
    handed (None if nothing); what it returns replaces that sum, None keeps it.
    """
    if consumers is None:
        consumers = fan_in(root)
    hooked: dict[Hashable, int] = {}
    for edge, key in edges.items():
        feeding = consumers.get(edge, [])
        node, number = edge
        if len(feeding) < 2 or type(node).__name__ == "AccumulateGrad":
            continue
        if partials is not None and partials.get(key) != len(feeding):
            continue
        state = _Arrivals(len(feeding) - 1)
        slots: dict[Any, list[int]] = {}
        for consumer, slot in feeding:
            slots.setdefault(consumer, []).append(slot)
        for consumer, positions in slots.items():
            consumer.register_hook(_taker(key, positions, state, take))
        node.register_prehook(_joiner(key, number, state, join))
        hooked[key] = len(feeding)
    return hooked


class _Arrivals:
    """How many partials a junction has handed to ``take`` in the backward now running."""

    def __init__(self, takes: int) -> None:
        self.takes = takes
        self.count = 0
        self.task = -1

    def next(self) -> int:
        """Count one partial arriving: how many came before it in this backward."""
        task = torch._C._current_graph_task_id()
        if task != self.task:  # a backward that stopped midway leaves no count behind
            self.task, self.count = task, 0
        self.count += 1
        return self.count - 1

    def reset(self) -> None:
        self.task, self.count = -1, 0


def _taker(
    key: Hashable,
    positions: list[int],
    state: _Arrivals,
    take: Callable[[Hashable, torch.Tensor, bool], torch.Tensor | None],
) -> Callable[[tuple[Any, ...], tuple[Any, ...]], tuple[Any, ...] | None]:
    def hook(grad_inputs: tuple[Any, ...], grad_outputs: tuple[Any, ...]) -> tuple[Any, ...] | None:
        replaced: list[Any] | None = None
        for position in positions:  # the engine adds a node's outputs in slot order
            partial = grad_inputs[position]
            if partial is None:
                continue
            handed = take(key, partial, state.next() >= state.takes)
            if handed is not partial:
                replaced = replaced or list(grad_inputs)
                replaced[position] = handed
        return tuple(replaced) if replaced is not None else None

    return hook


def _joiner(
    key: Hashable,
    number: int,
    state: _Arrivals,
    join: Callable[[Hashable, torch.Tensor | None], torch.Tensor | None],
) -> Callable[[tuple[Any, ...]], tuple[Any, ...] | None]:
    def hook(grad_outputs: tuple[Any, ...]) -> tuple[Any, ...] | None:
        state.reset()  # the next backward through a retained graph starts afresh
        merged = join(key, grad_outputs[number])
        if merged is None:
            return None
        replaced = list(grad_outputs)
        replaced[number] = merged
        return tuple(replaced)

    return hook
