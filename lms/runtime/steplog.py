"""`StepLog`: the runtime's record of the steps it runs, op by op (`lms.core.steprecord`).

Note: [One clock for a step record]
Every time in a record is seconds from the step's start on one clock. On a card that clock is the
card's: each mark is a CUDA event recorded on a stream (ops and waits on the compute stream,
copies on their copy streams), read once the step has ended and the card synchronized, so an op's
start and end are when the card ran it, not when Python queued it. A wait is the span between two
marks on the compute stream around the runtime's wait for a copy: what the card stood still for.
On a CPU, and for spill files' reads and writes on their I/O thread, the clock is the host's wall
clock, taken at the step's start after the card synchronized, so both clocks start together. Ops
are seen by a dispatch mode on the step's thread (and on autograd's, which inherits it); the
runtime's own ops inside its hooks are marked ``runtime``, recomputations ``replay``.

What the recorder does at each op is host time the step did not have unrecorded, and where the
card runs ops faster than the host queues them it shows as the card idle between ops
(`lms.report.replay.Replay.measured_idle_s`). So an op costs two events and one read of the
allocator's statistics, and nothing else until the step ends; an op that runs no kernel (a view,
a `set_`, an `empty`) costs no events, its start and end being the last op's end, and one that
allocates nothing (all but `empty`) takes the last op's reading of the allocator. Such ops are
half or more of a step's: a detach for each tensor autograd saves, and the runtime's own detach
and `set_` in its hooks. On a CPU the reading is a count the recorder keeps (Note [Memory in use
at each op on a CPU]). The recorder clocks its own work inside each op's dispatch (its marks,
its reads of memory in use, its bookkeeping) on the host's wall clock and keeps the sum with the
step (`lms.core.steprecord.StepTimes.recorder_s`, its reads apart), so that a replay can say how
much of the time between ops was its own; the dispatch into its mode, before and after that, is
not in it.

Note: [Memory in use at each op on a CPU]
On a card the allocator's statistics are one read. On a CPU the C heap's count (glibc's
``mallinfo2``) walks every free chunk of every arena: mid-step a read took hundreds of microseconds,
more the longer the process had run, and nearly all of the recorder's cost
(benchmarks/results/README.md, "What recording a step costs"). So on a CPU the heap is read once,
when the step begins, and from there the recorder counts the storages the step's ops make: each
output that its op's schema does not alias to an input is a new storage, counted with its bytes and
watched through a weak reference, which PyTorch keeps alive exactly as long as the storage (its
Python object is preserved with it), so that its free is taken off when it happens, between ops or
inside one. The memory in use at an op's end is the heap at the step's start plus what is alive of
those. What a kernel allocates and frees inside itself (a convolution's scratch), and frees of
storages made before the step, are not in it. The step's peak is the larger of the heap's, sampled
on a thread every 10 ms (which sees the scratch of long ops), and the most of those counts (which
sees a peak between two samples).
"""

from __future__ import annotations

import contextlib
import functools
import time
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from lms.core.junctions import in_backward
from lms.core.steprecord import CopyTime, OpTime, StepTimes, WaitTime
from lms.core.version import __version__
from lms.runtime.heap import PeakMemory, heap_in_use_bytes

__all__ = ["StepLog"]

_COUNTERS_AT_PEAK = ("peak_resident_saved_bytes", "peak_host_bytes", "peak_disk_bytes")


class StepLog:
    """The steps an `lms.LMS` runs from `lms.LMS.record_steps` on, timed (Note [One clock for a
    step record])."""

    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"
        self.steps: list[StepTimes] = []
        self._section = "step"
        self._ops: list[tuple[str, str, bool, Any, Any, int, int]] = []
        self._copies: list[tuple[str, int, int, str, Any, Any, Any]] = []
        self._io: dict[tuple[str, int], tuple[int, int, Any]] = {}  # spill I/O asked for
        self._io_times: list[tuple[str, int, float, float]] = []  # from the I/O thread
        self._waits: list[tuple[int, Any, Any]] = []
        self._mode: _OpTimer | None = None
        self._peak: PeakMemory | None = None
        self._start: Any = None
        self._wall0 = 0.0
        self._number = 0
        self._start_bytes = 0
        self._counters: dict[str, float] = {}
        self._made: _MadeStorages | None = None  # on a CPU, in a step
        self._memory: Callable[[], tuple[int, int]] = self._made_bytes
        self._last: tuple[Any, int, int] = (0.0, 0, 0)  # the last op's end and allocator reading
        self.own_s = 0.0
        """The recorder's own host time in the step so far (Note [One clock for a step record])."""
        self.reads_s = 0.0
        """Of that, its reads of the memory in use."""
        self.mark: Callable[[], Any] = time.perf_counter
        """Now, on the step's clock: a CUDA event on the current stream, or the wall clock."""
        if self.cuda:
            from lms.runtime._cuda import allocator_bytes, timing_event

            self._memory = functools.partial(allocator_bytes, device)
            self.mark = timing_event

    def _made_bytes(self) -> tuple[int, int]:
        """On a CPU, the memory in use now (Note [Memory in use at each op on a CPU])."""
        return (0, 0) if self._made is None else self._made.read()

    # -- marks ---------------------------------------------------------------------------------
    def _seconds(self, mark: Any) -> float:
        if isinstance(mark, float):
            return mark - self._wall0
        return float(self._start.elapsed_time(mark)) / 1000.0

    # -- a step --------------------------------------------------------------------------------
    def begin(self, number: int, counters: dict[str, float]) -> None:
        """Start recording step ``number``; ``counters``: the runtime's counters now."""
        self._number = number
        self._counters = dict(counters)
        self._ops, self._copies, self._waits, self._io, self._io_times = [], [], [], {}, []
        self.own_s = self.reads_s = 0.0
        if self.cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._start_bytes = torch.cuda.memory_allocated(self.device)
            self._start = self.mark()
        else:
            # Long ops (a convolution's scratch) hold their peaks for milliseconds: a sample
            # every 10 ms catches them at a fifth of the default sampler's wakes.
            self._peak = PeakMemory(interval_s=0.01).__enter__()
            self._start_bytes = heap_in_use_bytes() or 0
            self._made = _MadeStorages(self._start_bytes)
        self._wall0 = time.perf_counter()
        self._last = (self._start if self.cuda else self._wall0, *self._memory())
        self._mode = _OpTimer(self)
        self._mode.__enter__()

    def end(self, counters: dict[str, float]) -> None:
        """Finish the step: stop seeing ops, read the marks, keep the step's times."""
        if self._mode is None:
            return
        mode, self._mode = self._mode, None
        mode.__exit__(None, None, None)
        stop = self.mark()
        made, self._made = self._made, None
        if self.cuda:
            torch.cuda.synchronize(self.device)
            peak = torch.cuda.max_memory_allocated(self.device)
        else:
            assert self._peak is not None
            self._peak.__exit__(None, None, None)
            peak = self._start_bytes + max(self._peak.heap_growth_bytes or 0, 0)
            if made is not None:  # Note [Memory in use at each op on a CPU]
                peak = max(peak, made.base_bytes + made.most_bytes)
                made.forget()
        seconds = self._seconds
        ops = tuple(
            OpTime(name, section, backward, seconds(a), seconds(b), allocated, reserved)
            for name, section, backward, a, b, allocated, reserved in self._ops
        )
        copies = [
            CopyTime(direction, ordinal, nbytes, tier, seconds(q), seconds(a), seconds(b))
            for direction, ordinal, nbytes, tier, q, a, b in self._copies
        ]
        for direction, key, start, finish in self._io_times:
            asked = self._io.get((direction, key))
            if asked is not None:
                ordinal, nbytes, queued = asked
                copies.append(
                    CopyTime(
                        direction,
                        ordinal,
                        nbytes,
                        "disk",
                        seconds(queued),
                        start - self._wall0,
                        finish - self._wall0,
                    )
                )
        step = {
            name: value - self._counters.get(name, 0)
            for name, value in counters.items()
            if name not in _COUNTERS_AT_PEAK
        }
        step.update({name: counters[name] for name in _COUNTERS_AT_PEAK if name in counters})
        self.steps.append(
            StepTimes(
                number=self._number,
                clock="cuda-events" if self.cuda else "wall",
                step_s=seconds(stop),
                start_bytes=self._start_bytes,
                peak_bytes=peak,
                ops=ops,
                copies=tuple(sorted(copies, key=lambda c: c.start_s)),
                waits=tuple(WaitTime(o, seconds(a), seconds(b)) for o, a, b in self._waits),
                stats=step,
                recorder_s=self.own_s,
                recorder_reads_s=self.reads_s,
            )
        )

    def meta(self) -> dict[str, str]:
        """What a record keeps of where it ran: the versions and the device."""
        info = {"torch": torch.__version__, "lms": __version__, "device": str(self.device)}
        if self.cuda:
            info["device_name"] = torch.cuda.get_device_name(self.device)
        return info

    @property
    def recording(self) -> bool:
        """Whether a step is being recorded now."""
        return self._mode is not None

    # -- what the runtime reports --------------------------------------------------------------
    @contextlib.contextmanager
    def section(self, name: str) -> Iterator[None]:
        """Ops run inside are marked ``name`` (``runtime``, ``replay``)."""
        outer, self._section = self._section, name
        try:
            yield
        finally:
            self._section = outer

    def wrap(self, hook: Callable[..., Any], name: str) -> Callable[..., Any]:
        """``hook`` with the ops it runs marked ``name``."""

        @functools.wraps(hook)
        def marked(*args: Any) -> Any:
            with self.section(name):
                return hook(*args)

        return marked

    def copy(
        self,
        direction: str,
        ordinal: int,
        nbytes: int,
        queued: Any,
        start: Any,
        end: Any,
        tier: str = "host",
    ) -> None:
        """A copy to or from host memory (or, ``tier`` "disk", a spill file read while the step
        waits), with its marks (``start`` None: taken as queued)."""
        if self.recording:
            began = queued if start is None else start
            self._copies.append((direction, ordinal, nbytes, tier, queued, began, end))

    def spill_asked(self, direction: str, key: int, ordinal: int, nbytes: int) -> None:
        """A spill file's write (``out``) or read (``in``) of entry ``key`` was queued now."""
        if self.recording:
            self._io[(direction, key)] = (ordinal, nbytes, self.mark())

    def spill_done(self, direction: str, key: int, start: float, end: float) -> None:
        """The I/O thread's wall-clock times of that write or read (any thread)."""
        if self.recording:
            self._io_times.append((direction, key, start, end))

    def wait(self, ordinal: int, start: Any, end: Any) -> None:
        """The step waited for entry ``ordinal`` between the marks ``start`` and ``end``."""
        if self.recording:
            self._waits.append((ordinal, start, end))

    def _note_op(self, name: str, start: Any, end: Any, out: Any, fresh: tuple[bool, ...]) -> None:
        before = _clock()
        if self._made is not None:
            self._made.count(out, fresh)
        allocated, reserved = self._memory()
        self.reads_s += _clock() - before
        self._last = (end, allocated, reserved)
        self._ops.append((name, self._section, in_backward(), start, end, allocated, reserved))

    def _note_still(self, name: str, allocates: bool, out: Any, fresh: tuple[bool, ...]) -> None:
        """An op that ran no kernel, at the last op's end (Note [One clock for a step record])."""
        end, allocated, reserved = self._last
        if allocates:
            self._note_op(name, end, end, out, fresh)
        else:
            self._ops.append((name, self._section, in_backward(), end, end, allocated, reserved))


class _MadeStorages:
    """The storages a step's ops made that are still alive, and their bytes (Note [Memory in use
    at each op on a CPU])."""

    def __init__(self, base_bytes: int):
        self.base_bytes = base_bytes
        self.alive_bytes = 0
        self.most_bytes = 0
        """The most ``alive_bytes`` has been."""
        self._alive: dict[int, tuple[int, weakref.ref[torch.UntypedStorage]]] = {}

    def count(self, out: Any, fresh: tuple[bool, ...]) -> None:
        """Count the storages of the outputs ``out`` that ``fresh`` (a flag for each of the op's
        returns) says are new; a sparse or opaque (oneDNN) tensor's, which PyTorch does not
        show, and a wrapper subclass's (its parts are counted where they are made) are not."""
        returns = out if isinstance(out, tuple) else (out,)
        for value, new in zip(returns, fresh, strict=False):
            if not new:
                continue
            for tensor in value if isinstance(value, list) else (value,):
                if isinstance(tensor, torch.Tensor) and tensor.layout is torch.strided:
                    self._add(tensor)

    def _add(self, tensor: torch.Tensor) -> None:
        try:
            storage = tensor.untyped_storage()
            nbytes, address = storage.nbytes(), storage.data_ptr()
        except (NotImplementedError, RuntimeError):  # a wrapper subclass: its parts count
            return
        if not nbytes or not address or address in self._alive:
            return
        self._alive[address] = (
            nbytes,
            weakref.ref(storage, functools.partial(self._gone, address)),
        )
        self.alive_bytes += nbytes
        self.most_bytes = max(self.most_bytes, self.alive_bytes)

    def _gone(self, address: int, ref: weakref.ref[torch.UntypedStorage]) -> None:
        known = self._alive.get(address)
        if known is not None and known[1] is ref:
            del self._alive[address]
            self.alive_bytes -= known[0]

    def forget(self) -> None:
        """Stop watching: the weak references go, and their callbacks with them."""
        self._alive.clear()

    def read(self) -> tuple[int, int]:
        """The heap at the step's start plus the bytes alive, and no reserve."""
        return self.base_bytes + self.alive_bytes, 0


class _OpTimer(TorchDispatchMode):
    """Marks each op's start and end (Note [One clock for a step record])."""

    def __init__(self, log: StepLog):
        super().__init__()
        self.log = log

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        entered = _clock()
        log = self.log
        name, kernel, allocates, fresh = _about(func)
        if not kernel:
            ran = _clock()
            out = func(*args, **(kwargs or {}))
            returned = _clock()
            log._note_still(name, allocates, out, fresh)
            log.own_s += ran - entered + _clock() - returned
            return out
        start = log.mark()
        ran = _clock()
        out = func(*args, **(kwargs or {}))
        returned = _clock()
        log._note_op(name, start, log.mark(), out, fresh)
        log.own_s += ran - entered + _clock() - returned
        return out


_clock = time.perf_counter


_ALLOCATE_ONLY = frozenset({"empty", "empty_strided", "new_empty", "new_empty_strided"})
"""Ops that allocate and run no kernel."""


@functools.cache
def _about(func: Any) -> tuple[str, bool, bool, tuple[bool, ...]]:
    """An op's name, whether it runs a kernel, whether it allocates without one, and for each of
    its returns whether it is new (its schema aliases it to no input)."""
    packet = getattr(getattr(func, "overloadpacket", None), "__name__", "")
    allocates = packet in _ALLOCATE_ONLY
    still = getattr(func, "is_view", False) or packet == "set_" or allocates
    schema = getattr(func, "_schema", None)
    returns = () if schema is None else schema.returns
    fresh = tuple(value.alias_info is None for value in returns)
    return str(func), not still, allocates, fresh
