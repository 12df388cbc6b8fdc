"""Gradient junctions: where one tensor feeds two operations, its two partial gradients meet.

Note: [Why junctions, and why only two partials]
Autograd sums the partial gradients of a tensor in the input buffer of the tensor's producer.
The partial that arrives first waits there, on the device, while the other branch runs its whole
backward: at a residual block that is one more activation-sized buffer at the block's busiest
moment, and no saved-tensor hook sees it, because a gradient is not a saved tensor. Hooks on the
autograd nodes can move it: a post hook on each consumer takes the first partial that arrives
(and hands the engine nothing in its place), a pre hook on the producer adds it back to what the
engine summed. The producer then sees ``first + rest``, where the engine would have computed
``(first + second) + third ...``; the two agree bit for bit only when ``rest`` is one partial, as
floating-point addition is commutative but not associative. So only edges with exactly two
consumer slots are junctions, counted over every node reachable from the first node of backward
that reads a saved tensor.

That walk cannot see a branch that backward runs apart from it: with ``loss = a(t) + b(t)`` a third
consumer of ``t`` in ``b`` is not reachable from the first node of ``a``. The trace keeps every
node forward makes (a function mode sees each op's ``grad_fn``) and counts consumers over all of
them; a plan relieves only junctions the trace found, so an edge with a consumer the runtime's walk
misses is never relieved. (A node forward made that backward never runs only makes the trace
count one consumer too many, and leave that junction alone.)

The trace and the runtime name a junction by the saved entry (ordinal) of its tensor and find its
autograd edge the same way: the tensor's ``grad_fn`` and ``output_nr`` when it is first saved.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping
from typing import Any

import torch

__all__ = ["Edge", "edge_of", "fan_in", "attach"]

Edge = tuple[Any, int]
"""An autograd edge: the node that produced a tensor and the tensor's output number there."""


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
    take: Callable[[Hashable, torch.Tensor], bool],
    join: Callable[[Hashable, torch.Tensor | None], torch.Tensor | None],
    consumers: Mapping[Edge, list[tuple[Any, int]]] | None = None,
) -> list[Hashable]:
    """Hook the junctions among ``edges`` (each named by its key); returns the keys hooked.

    Consumers are counted over the nodes reachable from ``root``, or taken from ``consumers``
    (`fan_in` over every node forward made, as the trace counts them).

    ``take(key, partial)`` runs on the first partial gradient that reaches a junction in each
    backward; when it returns True the engine is handed nothing for it. ``join(key, rest)`` runs
    before the producer's backward with the engine's sum of the other partial (None if none);
    what it returns replaces that sum, None keeps it.
    """
    if consumers is None:
        consumers = fan_in(root)
    hooked: list[Hashable] = []
    for edge, key in edges.items():
        feeding = consumers.get(edge, [])
        node, number = edge
        if len(feeding) != 2 or type(node).__name__ == "AccumulateGrad":
            continue
        arrived: dict[str, bool] = {"first": False}
        slots: dict[Any, list[int]] = {}
        for consumer, slot in feeding:
            slots.setdefault(consumer, []).append(slot)
        for consumer, positions in slots.items():
            consumer.register_hook(_taker(key, positions, arrived, take))
        node.register_prehook(_joiner(key, number, arrived, join))
        hooked.append(key)
    return hooked


def _taker(
    key: Hashable,
    positions: list[int],
    arrived: dict[str, bool],
    take: Callable[[Hashable, torch.Tensor], bool],
) -> Callable[[tuple[Any, ...], tuple[Any, ...]], tuple[Any, ...] | None]:
    def hook(grad_inputs: tuple[Any, ...], grad_outputs: tuple[Any, ...]) -> tuple[Any, ...] | None:
        for position in positions:
            partial = grad_inputs[position]
            if partial is None or arrived["first"]:
                continue
            arrived["first"] = True
            if take(key, partial):
                replaced = list(grad_inputs)
                replaced[position] = None
                return tuple(replaced)
        return None

    return hook


def _joiner(
    key: Hashable,
    number: int,
    arrived: dict[str, bool],
    join: Callable[[Hashable, torch.Tensor | None], torch.Tensor | None],
) -> Callable[[tuple[Any, ...]], tuple[Any, ...] | None]:
    def hook(grad_outputs: tuple[Any, ...]) -> tuple[Any, ...] | None:
        arrived["first"] = False  # the next backward through a retained graph starts afresh
        merged = join(key, grad_outputs[number])
        if merged is None:
            return None
        replaced = list(grad_outputs)
        replaced[number] = merged
        return tuple(replaced)

    return hook
