"""`time_ops`: run each distinct call of a traced step alone on the device, on real tensors of
its shapes, and time it (Note [Ops timed on the device])."""

from __future__ import annotations

import logging
import time

import torch
from torch.utils._pytree import tree_map
from tqdm import tqdm

from lms.analysis.devices import FRESH_PAGES_BYTES, OpTimings
from lms.analysis.records import OpCall, TensorMeta, Trace

__all__ = ["time_ops"]

log = logging.getLogger("lms.timing")

_AT_LEAST_S = 2e-3
"""A call runs again (three times at least) until its timed runs fill this..."""
_ENOUGH_S = 30e-3
"""...or until they fill this: one run of a large op is enough."""
_MOST_CALLS = 50


def time_ops(
    trace: Trace,
    device: torch.device,
    *,
    max_bytes: int | None = None,
    limit_s: float = 120.0,
) -> OpTimings:
    """Seconds each op of ``trace`` takes on ``device``, run alone.

    Each distinct call (`lms.analysis.records.OpCall.key`: the op, its tensors' shapes, strides
    and dtypes, its other arguments) runs on real tensors of those shapes: once to warm up (a
    library's choice of kernel, its caches), then timed. Views move no data and take no time
    here. Ops the trace could not record, calls that raise on made-up data, calls whose inputs
    and outputs take more than ``max_bytes``, and calls past ``limit_s`` of timing keep no
    time, so the simulator prices them by the spec's rates. The random number generators'
    states are restored: the timing draws nothing from the step's streams.

    Args:
        trace: from `lms.analysis.trace.trace_step`, traced for ``device``.
        device: the device to run on (its type must be the trace's).
        max_bytes: the most an op may take at once to run here (the plan's budget).
        limit_s: stop timing after this long.
    """
    seconds: list[float | None] = [None] * len(trace.ops)
    groups: dict[str, list[int]] = {}
    for index, call in enumerate(trace.calls):
        if call is None:
            continue
        if call.op.is_view:
            seconds[index] = 0.0
            continue
        groups.setdefault(call.key, []).append(index)
    if torch.device(trace.device).type != device.type:
        raise ValueError(f"lms: a trace for {trace.device} cannot be timed on {device}")
    if device.type == "cpu":
        # Note [Fresh pages on a CPU]: glibc maps an allocation anew until it has freed a mapped
        # one that large; a step's first allocations move its threshold to 32 MiB, and below it
        # a step's tensors take memory its heap held before. Timed before, a 32 MiB add ran 4
        # times as long as in a step.
        torch.empty(FRESH_PAGES_BYTES - 4096, dtype=torch.uint8).fill_(0)
    started = time.perf_counter()
    skipped = failed = 0
    cuda = [device] if device.type == "cuda" else []
    with (
        torch.random.fork_rng(devices=cuda),
        torch.no_grad(),
        torch.autocast(device.type, enabled=False),
    ):
        bar = tqdm(groups.values(), desc="timing ops", unit="op", leave=False, disable=None)
        for indices in bar:
            op = trace.ops[indices[0]]
            if time.perf_counter() - started > limit_s:
                skipped += 1
                continue
            if max_bytes is not None and op.working_set_bytes + op.cpu_scratch_bytes > max_bytes:
                skipped += 1
                continue
            call = trace.calls[indices[0]]
            assert call is not None
            taken = _time_call(call, device)
            failed += taken is None
            for index in indices:
                seconds[index] = taken
    timings = OpTimings(fingerprint=trace.fingerprint(), seconds=tuple(seconds))
    log.info(
        "[LMS] Timed %d distinct calls of %d ops on %s in %.1f s (%d left to the rates: %d "
        "over the time or memory allowed, %d refused made-up data)",
        len(groups),
        len(trace.ops),
        device,
        time.perf_counter() - started,
        len(trace.ops) - timings.timed,
        skipped,
        failed,
    )
    return timings


def _time_call(call: OpCall, device: torch.device) -> float | None:
    """Seconds one run of ``call`` takes on ``device``; None where it raises."""

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    try:
        args, kwargs = tree_map(
            lambda value: _made_up(value, device) if isinstance(value, TensorMeta) else value,
            (call.args, call.kwargs),
        )
        call.op(*args, **kwargs)  # warm-up
        sync()
        runs: list[float] = []
        while len(runs) < _MOST_CALLS:
            start = time.perf_counter()
            call.op(*args, **kwargs)
            sync()
            runs.append(time.perf_counter() - start)
            total = sum(runs)
            if total >= _ENOUGH_S or len(runs) >= 3 and total >= _AT_LEAST_S:
                break
        return min(runs)
    except Exception as error:  # an op that needs real data (a valid index, a positive value)
        log.debug("lms: %s could not run on made-up data: %s", call.op, error)
        return None


def _made_up(meta: TensorMeta, device: torch.device) -> torch.Tensor:
    """A tensor of ``meta``'s shape, strides and dtype on ``device``: uniform in [0, 1) where
    floating point, zeros (valid indices, False) otherwise."""
    where = torch.device(meta.device)
    where = device if where.type == device.type else where  # a CPU scalar beside a GPU's tensors
    extent = 1 + sum((n - 1) * s for n, s in zip(meta.shape, meta.stride, strict=True))
    extent = extent if all(meta.shape) else 0
    base = torch.empty(extent, dtype=meta.dtype, device=where)
    if base.is_floating_point() or base.is_complex():
        try:
            base.uniform_()
        except RuntimeError:  # a dtype without it (float8)
            base.zero_()
    else:
        base.zero_()
    return base.as_strided(meta.shape, meta.stride)
