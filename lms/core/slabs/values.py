"""A value inside a module run in slabs: whole, stored a slab at a time, or lazy (Note
[Slabs])."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils._pytree import tree_map

__all__ = ["DIM", "Lazy", "Stored", "Value", "Whole", "slab_bounds", "whole_of"]

DIM = 2  # the first spatial dimension: depth in NCDHW, height in NCHW


def slab_bounds(depth: int, slabs: int) -> list[int]:
    """The boundaries of ``slabs`` near-equal slabs of ``depth`` rows (fewer when the rows
    are fewer): ``[0, ..., depth]``."""
    count = max(1, min(slabs, depth))
    return [depth * i // count for i in range(count + 1)]


class Value:
    depth: int
    slabs: int
    shape: tuple[int, ...]

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def piece(self, start: int, stop: int) -> torch.Tensor:
        raise NotImplementedError

    def whole(self) -> torch.Tensor:
        # Note: [A whole value is written a slab at a time]
        # Joined with one cat, every piece would be alive beside the whole they make: at a
        # module's output, twice its size. Each piece is made, written into the whole and let
        # go instead; backward hands each piece its rows of the gradient, a view.
        bounds = slab_bounds(self.depth, self.slabs)
        first = self.piece(bounds[0], bounds[1])
        if len(bounds) == 2:
            return first
        out = torch.empty(
            self.shape, dtype=first.dtype, device=first.device, memory_format=_layout(first)
        )
        out = _Write.apply(out, first, 0)
        del first  # each piece goes once written
        for a, b in zip(bounds[1:], bounds[2:], strict=False):
            out = _Write.apply(out, self.piece(a, b), a)
        return out


def _layout(piece: torch.Tensor) -> torch.memory_format:
    """The memory format ``piece`` is laid out in (channels last or not), for its whole."""
    last = {4: torch.channels_last, 5: torch.channels_last_3d}.get(piece.dim())
    if last is not None and not piece.is_contiguous() and piece.is_contiguous(memory_format=last):
        return last
    return torch.contiguous_format


class _Write(torch.autograd.Function):
    """``piece`` written into ``whole`` at row ``start`` of `DIM`, in place."""

    @staticmethod
    def forward(ctx: Any, whole: torch.Tensor, piece: torch.Tensor, start: int) -> torch.Tensor:
        ctx.start, ctx.rows = start, piece.shape[DIM]
        # no view of the whole is made here, where grad mode is off: autograd forbids writing
        # through such a view to a tensor that later writes record
        rows = torch.arange(start, start + ctx.rows, device=whole.device)
        whole.index_copy_(DIM, rows, piece)
        ctx.mark_dirty(whole)
        return whole

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        # the rows written here were empty before: what the whole had before gets the gradient
        # as it is, since no write reads another's rows
        return grad, grad.narrow(DIM, ctx.start, ctx.rows), None


class Whole(Value):
    def __init__(self, tensor: torch.Tensor, slabs: int):
        self.tensor, self.slabs, self.shape = tensor, slabs, tuple(tensor.shape)
        self.depth = tensor.shape[DIM] if tensor.dim() > DIM else 0
        self._stored: Stored | None = None

    def piece(self, start: int, stop: int) -> torch.Tensor:
        # Note: [One split, not a slice per piece]
        # A slice's backward makes a zero tensor of the whole size for its gradient; a whole
        # tensor read a piece at a time would make one per piece. Split once, into the standard
        # slabs, and its backward makes the whole gradient once.
        if self._stored is None:
            bounds = slab_bounds(self.depth, self.slabs)
            sizes = [b - a for a, b in zip(bounds, bounds[1:], strict=False)]
            self._stored = Stored(list(self.tensor.split(sizes, DIM)), bounds, self.slabs)
        return self._stored.piece(start, stop)

    def whole(self) -> torch.Tensor:
        return self.tensor


class Stored(Value):
    def __init__(self, parts: list[torch.Tensor], bounds: list[int], slabs: int):
        self.parts, self.bounds, self.slabs, self.depth = parts, bounds, slabs, bounds[-1]
        self.shape = (*parts[0].shape[:DIM], self.depth, *parts[0].shape[DIM + 1 :])

    def piece(self, start: int, stop: int) -> torch.Tensor:
        pieces = []
        for part, a, b in zip(self.parts, self.bounds, self.bounds[1:], strict=False):
            lo, hi = max(a, start), min(b, stop)
            if lo < hi:
                pieces.append(part if (lo, hi) == (a, b) else part.narrow(DIM, lo - a, hi - lo))
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces, DIM)


class Lazy(Value):
    """``func`` applied piecewise: every argument with this depth is cut to the piece."""

    def __init__(
        self, func: Callable[..., Any], args: Any, kwargs: Any, shape: tuple[int, ...], slabs: int
    ):
        self.func, self.args, self.kwargs, self.slabs = func, args, kwargs, slabs
        self.shape, self.depth = shape, shape[DIM]

    def piece(self, start: int, stop: int) -> torch.Tensor:
        bounds = slab_bounds(self.depth, self.slabs)
        cuts = sorted({start, stop, *(b for b in bounds if start < b < stop)})
        parts = [self._piece(a, b) for a, b in zip(cuts, cuts[1:], strict=False)]
        return parts[0] if len(parts) == 1 else torch.cat(parts, DIM)

    def _piece(self, start: int, stop: int) -> torch.Tensor:
        def cut(value: Any) -> Any:
            if isinstance(value, Value):
                if value.ndim == self.ndim and value.depth == self.depth:
                    return value.piece(start, stop)
                return value.whole()
            return value

        return self.func(*tree_map(cut, self.args), **tree_map(cut, self.kwargs))


def whole_of(value: Any) -> Any:
    """``value`` as a tensor, where it is a value of the replay."""
    return value.whole() if isinstance(value, Value) else value
