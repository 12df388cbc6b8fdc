"""`time_ops`: run each distinct call of a traced step alone on the device, on real tensors of
its shapes, and time it (Note [Ops timed on the device]), in a process of its own (Note [Ops
are timed in a process of their own])."""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import dataclasses
import gc
import logging
import os
import pickle
import queue
import select
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils._pytree import tree_map
from tqdm import tqdm

from lms.analysis.recorder import tensors_in
from lms.core.devices import FRESH_PAGES_BYTES, MAPPED_ALONE_BYTES, OpTimings
from lms.core.records import TensorMeta, Trace
from lms.core.units import format_bytes
from lms.runtime.heap import (
    PeakMemory,
    heap_in_use_bytes,
    map_alone_from,
    peak_rss_bytes,
    reset_peak_rss,
    trim_heap,
)

__all__ = ["apply_backend_settings", "backend_settings", "started_early", "time_ops"]

log = logging.getLogger("lms.orchestration.timing")

_AT_LEAST_S = 2e-3
"""A call runs again (three times at least) until its timed runs fill this..."""
_ENOUGH_S = 30e-3
"""...or until they fill this: one run of a large op is enough."""
_MOST_CALLS = 50
_START_S = 60.0
"""Time the timing process may take beyond its limit to start (importing PyTorch) and end."""
_CHILD = (sys.executable, "-c", "from lms.orchestration.timing import _main; _main()")

Job = tuple[str, tuple[Any, ...], dict[str, Any]]
"""A call to time: the overload's name (``aten.add.Tensor``), its arguments, tensors as
`TensorMeta`."""
_Taken = tuple[float, int | None, int | None]
"""What a call took: its seconds, its scratch bytes (Note [An op's scratch, measured where it is
timed]) and the bytes its first run left to its library (Note [Buffers a library keeps]), None
where they could not be read."""


# Note: [Ops are timed in a process of their own]
# Timing a step's calls allocates and frees its tensors in another order than the step does, and
# glibc's heap keeps the shape that leaves: the process that timed them would then run its steps
# slower, with more page faults. So the calls go, pickled, to a fresh Python process (`_main`),
# which times them and sends each time back as it has it. The step's process keeps its heap, its
# random streams and its threads' state, and an op that crashes on made-up data ends that process
# alone: the calls it had not timed then keep the rates. Steps measured in timed and untimed
# processes: benchmarks/results/README.md, "Ops timed in a process of their own".


def time_ops(
    trace: Trace,
    device: torch.device,
    *,
    max_bytes: int | None = None,
    limit_s: float = 120.0,
    mapped_bytes: int | None = None,
) -> OpTimings:
    """Seconds each op of ``trace`` takes on ``device``, run alone.

    Each distinct call (`lms.core.records.OpCall.key`: the op, its tensors' shapes, strides
    and dtypes, its other arguments) runs on real tensors of those shapes, in a process of its
    own (Note [Ops are timed in a process of their own]): once to warm up (a library's choice of
    kernel, its caches), then timed, the fastest of its runs kept. Views move no data and take
    no time here. Ops the trace could not record, calls that raise on made-up data, calls whose
    inputs and outputs take more than ``max_bytes``, and calls past ``limit_s`` of timing keep
    no time, so the simulator prices them by the spec's rates.

    Args:
        trace: from `lms.analysis.trace.trace_step`, traced for ``device``.
        device: the device to run on (its type must be the trace's).
        max_bytes: the most an op may take at once to run here (the plan's budget).
        limit_s: stop timing after this long.
        mapped_bytes: on a CPU, the size from which the step's allocations get pages of their
            own (`lms.core.devices.DeviceSpec.page_mapped_bytes`); the ops are timed so too,
            their faults included (Note [Fresh pages]). None: glibc's own threshold.

    Raises:
        ValueError: the trace was made for another kind of device.
    """
    if torch.device(trace.device).type != device.type:
        raise ValueError(f"lms: a trace for {trace.device} cannot be timed on {device}")
    seconds: list[float | None] = [None] * len(trace.ops)
    groups: dict[str, list[int]] = {}
    for index, call in enumerate(trace.calls):
        if call is None:
            continue
        if call.op.is_view:
            seconds[index] = 0.0
            continue
        groups.setdefault(call.key, []).append(index)
    jobs: list[Job] = []
    owners: list[list[int]] = []
    too_large = 0
    for indices in groups.values():
        op, call = trace.ops[indices[0]], trace.calls[indices[0]]
        assert call is not None
        if max_bytes is not None and op.working_set_bytes + op.cpu_scratch_bytes > max_bytes:
            too_large += 1
            continue
        jobs.append((str(call.op), call.args, call.kwargs))
        owners.append(indices)
    started = time.perf_counter()
    results = _time_in_child(jobs, device, limit_s, mapped_bytes) if jobs else {}
    scratch: list[int | None] = [None] * len(trace.ops)
    kept: list[int | None] = [None] * len(trace.ops)
    for job, indices in enumerate(owners):
        taken = results.get(job)
        for index in indices:
            seconds[index], scratch[index], kept[index] = (
                taken if taken is not None else (None, None, None)
            )
            if index != indices[0] and kept[index] is not None:
                kept[index] = 0  # kept once, by the call's first run
    timings = OpTimings(
        fingerprint=trace.fingerprint(),
        seconds=tuple(seconds),
        scratch=tuple(scratch),
        kept=tuple(kept),
    )
    log.info(
        "[LMS] Timed %d of %d distinct calls of %d ops on %s in %.1f s (%d ops left to the "
        "rates: calls %d over the memory allowed, %d over the time, %d refused made-up data)",
        sum(taken is not None for taken in results.values()),
        len(groups),
        len(trace.ops),
        device,
        time.perf_counter() - started,
        len(trace.ops) - timings.timed,
        too_large,
        len(jobs) - len(results),
        sum(taken is None for taken in results.values()),
    )
    if device.type == "cpu":  # a card's is kept, not counted
        _tell_scratch(trace, scratch)
    return timings


def _tell_scratch(trace: Trace, scratch: list[int | None]) -> None:
    """Name the op whose measured scratch passes its estimate most, where that is a MiB or more
    (Note [An op's scratch, measured where it is timed])."""
    over = [
        (nbytes - op.cpu_scratch_bytes, op, nbytes)
        for op, nbytes in zip(trace.ops, scratch, strict=True)
        if nbytes is not None
    ]
    most = max(over, key=lambda row: row[0], default=None)
    if most is None or most[0] < MAPPED_ALONE_BYTES:
        return
    _, op, nbytes = most
    alike = sum(1 for more, _, _ in over if more >= MAPPED_ALONE_BYTES)
    log.info(
        "[LMS] %s at %s takes %s of scratch while it runs, measured (estimated: %s); ops a "
        "MiB or more over their estimates: %d, priced at what they took",
        op.name,
        op.module,
        format_bytes(nbytes),
        format_bytes(op.cpu_scratch_bytes),
        alike,
    )


@dataclasses.dataclass(frozen=True)
class _MemoryFormat:
    """A `torch.memory_format` as the timing process receives it, by name.

    Note: [Memory formats go by name]
    A memory format pickles as a global named ``torch.contiguous_format``, which pickle finds by
    searching the loaded modules for one that holds ``torch``, and the timing process must find
    it again by that module. Once, tuning in a process `torch.multiprocessing.spawn` started, the
    timing process could not (``Can't get attribute 'torch.contiguous_format' on <module
    '__main__'>``), and each call that names a format (a ``clone`` with ``memory_format=``) ended
    it; that run did not repeat. By name, nothing is searched.
    """

    name: str


def _sendable(value: Any) -> Any:
    """``value`` as a job sends it: a memory format by its name (Note [Memory formats go by
    name]), anything else as it is."""
    if isinstance(value, torch.memory_format):
        return _MemoryFormat(str(value).removeprefix("torch."))
    return value


_ON_THE_HOST = frozenset({"philox_seed", "philox_offset"})
"""Arguments that may hold the random state of attention's dropout. Where they are 64-bit
integer scalars, the memory-efficient attention forward (and flash attention's on AMD) returns
them on the CPU outside a CUDA graph's capture, and its backward reads them on the host; their
meta kernels put them on the step's device, and so does the trace. Made up on the card, the
backward read a device pointer on the host and the timing process died. Flash attention's state
on NVIDIA cards, two unsigned words, lives on the card, and is made up there."""


def _received(value: Any, device: torch.device, host: bool = False) -> Any:
    """A job's argument as the timing process runs it: a tensor made up on ``device`` (on the
    CPU where ``host`` and it is a 64-bit integer scalar), a memory format from its name,
    anything else as it is."""
    if isinstance(value, TensorMeta):
        if host and value.shape == () and value.dtype == torch.int64:
            value = dataclasses.replace(value, device="cpu")
        return _made_up(value, device)
    if isinstance(value, _MemoryFormat):
        return getattr(torch, value.name)
    return value


_POOLING = ("self", "kernel_size", "stride", "padding", "dilation", "ceil_mode")
"""A max pooling's arguments, as its backward names them too."""


def _pooled(forward: str) -> Any:
    """The indices a max pooling's ``forward`` picks, given its backward's arguments."""
    return lambda named: getattr(torch.ops.aten, forward)(*[named[key] for key in _POOLING])[1]


def _adaptive(forward: str) -> Any:
    """The indices an adaptive max pooling's ``forward`` picks for its gradient's size."""
    return lambda named: getattr(torch.ops.aten, forward)(
        named["self"], list(named["grad_output"].shape[2:])
    )[1]


_INDICES_FROM_FORWARD = {
    "max_pool2d_with_indices_backward": _pooled("max_pool2d_with_indices"),
    "max_pool3d_with_indices_backward": _pooled("max_pool3d_with_indices"),
    "adaptive_max_pool2d_backward": _adaptive("adaptive_max_pool2d"),
    "adaptive_max_pool3d_backward": _adaptive("adaptive_max_pool3d"),
}
"""Backwards that scatter their gradient to the places their forward's indices name: made-up
indices are those that forward picks from the made-up input. Zeros would send every gradient to
one place, and a card adds them there one at a time: a 3D U-Net's first pooling backward was
timed on an H200 at 110.6 ms where its step ran it in 1.8 ms."""


def _lstm_workspace(named: dict[str, Any]) -> torch.Tensor:
    """The workspace oneDNN's LSTM layer makes for the backward call ``named`` (with gradients
    on: without, it makes none)."""
    with torch.enable_grad():
        return _lstm_layer(named)


def _lstm_layer(named: dict[str, Any]) -> torch.Tensor:
    return torch.ops.aten.mkldnn_rnn_layer(
        named["input"],
        *[named[f"weight{i}"] for i in range(1, 5)],
        named["hx_"],
        named["cx_tmp"],
        named["reverse"],
        named["batch_sizes"],
        named["mode"],
        named["hidden_size"],
        named["num_layers"],
        named["has_biases"],
        named["bidirectional"],
        named["batch_first"],
        True,
    )[3]


_WORKSPACE_FROM_FORWARD = {"mkldnn_rnn_layer_backward": _lstm_workspace}
"""Backwards that read a workspace in their library's own layout, which the trace records with
no bytes (Note [Workspaces fake tensors cannot size] in `lms.analysis.recorder`): made up empty,
oneDNN's LSTM backward read past it and ended the timing process. Its forward makes one."""


def _made_up_call(
    op: Any, args: tuple[Any, ...], kwargs: dict[str, Any], device: torch.device
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """A job's arguments made up for ``op`` on ``device``: those of `_ON_THE_HOST` that are
    integer scalars on the CPU, the indices of `_INDICES_FROM_FORWARD` and the workspaces of
    `_WORKSPACE_FROM_FORWARD` from its forward."""
    names = [argument.name for argument in op._schema.arguments]

    def made(name: str, value: Any) -> Any:
        host = name in _ON_THE_HOST
        return tree_map(lambda leaf: _received(leaf, device, host), value)

    named = {name: made(name, value) for name, value in zip(names, args, strict=False)}
    named.update((name, made(name, value)) for name, value in kwargs.items())
    indices = _INDICES_FROM_FORWARD.get(op._schema.name.removeprefix("aten::"))
    if indices is not None and isinstance(named.get("indices"), torch.Tensor):
        picked = indices(named)
        if picked.shape == named["indices"].shape:
            named["indices"].copy_(picked)  # in place: its strides are the call's
    workspace = _WORKSPACE_FROM_FORWARD.get(op._schema.name.removeprefix("aten::"))
    if workspace is not None:
        named["workspace"] = workspace(named)
    return (
        tuple(named[name] for name in names[: len(args)]),
        {name: named[name] for name in kwargs},
    )


def _time_in_child(
    jobs: list[Job], device: torch.device, limit_s: float, mapped_bytes: int | None = None
) -> dict[int, _Taken | None]:
    """Each job's seconds and scratch (None: it raised, or the process died running it), by
    position, timed by a process of its own; jobs it did not reach in ``limit_s`` are left out.

    Note: [A timing process that dies]
    An op run on made-up data can end the process that runs it (a kernel's segmentation fault,
    the out-of-memory killer). The process says which job it starts before running it, so that
    the parent can name the op it died on, leave that op to the rates, and start another
    process for the jobs after it, within what is left of ``limit_s`` and `_RESTARTS` times
    at most.
    """
    sendable: list[bytes | None] = []
    for job in jobs:
        try:
            sendable.append(pickle.dumps(tree_map(_sendable, job)))
        except Exception:  # an argument that cannot be sent (an object of the user's)
            sendable.append(None)
    results: dict[int, _Taken | None] = {}
    started = time.perf_counter()
    first = 0
    for _ in range(_RESTARTS + 1):
        left_s = limit_s - (time.perf_counter() - started)
        if first >= len(jobs) or left_s <= 0:
            break
        done, running, code = _run_child(sendable[first:], device, left_s, mapped_bytes)
        results.update({first + position: taken for position, taken in done.items()})
        if code == 0 or running is None:
            if code != 0:
                log.warning(
                    "[LMS] The process timing ops ended with code %s after %d of %d calls; the "
                    "rest are priced by the device's rates",
                    code,
                    len(results),
                    len(jobs),
                )
            break
        died_on = first + running
        results[died_on] = None
        log.warning(
            "[LMS] The process timing ops ended with code %s running %s (call %d of %d); that "
            "op is priced by the device's rates, and a new process times the calls after it",
            code,
            jobs[died_on][0],
            died_on + 1,
            len(jobs),
        )
        first = died_on + 1
    return results


_RESTARTS = 3
"""New timing processes started after one dies (Note [A timing process that dies])."""
_STARTING = "starting"
"""What the timing process sends before it runs a job."""


def _run_child(
    sendable: list[bytes | None],
    device: torch.device,
    limit_s: float,
    mapped_bytes: int | None = None,
) -> tuple[dict[int, _Taken | None], int | None, int | None]:
    """One timing process over ``sendable``: the times it sent, by position; the job it was
    running when it ended, if it ended in one; and its exit code (0 where it finished them and
    waits for more; None: it could not start)."""
    payload = pickle.dumps(
        (str(device), torch.get_num_threads(), limit_s, backend_settings(), mapped_bytes, sendable)
    )
    worker = _take(_threshold(mapped_bytes))
    if worker is None:
        try:
            worker = _Worker.start()
        except OSError as error:  # no Python to start (an embedded interpreter)
            log.warning("[LMS] No process could time ops (%s); they are priced by the rates", error)
            return {}, None, None
    threading.Thread(target=worker.send, args=(payload,), daemon=True).start()
    deadline = time.perf_counter() + limit_s + _START_S
    results: dict[int, _Taken | None] = {}
    running: int | None = None
    finished = ended = False
    try:
        while not finished:
            try:
                message = worker.said.get(timeout=max(deadline - time.perf_counter(), 0.0))
            except queue.Empty:  # past its time: ended below
                break
            if message is None:  # it ended
                ended = True
                break
            position, taken = message
            if taken == _STARTING:
                running = position
            elif taken == _FINISHED:
                finished = True
            else:
                results[position] = taken
                running = None
    finally:  # an interrupt (Ctrl-C) included: a process not done is ended
        if finished and device.type == "cpu":
            worker.threshold = _threshold(mapped_bytes)
            worker.since = time.monotonic()
            _WAITING.append(worker)
        else:
            worker.end(dying=ended)
    return results, running, 0 if finished else worker.process.returncode


_FINISHED = "finished"
"""What the timing process sends once it has sent every job's time."""
_WAIT_S = 120.0
"""How long a timing process waits for the next tune's jobs before it ends."""
_TAKEN_WITHIN_S = _WAIT_S - 20.0
"""How long after it last timed (or started) a waiting timing process is taken: well before it
ends, so that jobs sent never meet one ending."""
_DYING_S = 5.0
"""How long a timing process that closed its output is given to exit before it is killed."""
_UNSET = object()
"""The allocator threshold of a timing process that has timed nothing yet: any will do."""


def _threshold(mapped_bytes: int | None) -> int | None:
    """The mmap threshold a timing process fixes for ``mapped_bytes`` (None: glibc's own,
    raised as a step's first allocations raise it)."""
    return mapped_bytes if mapped_bytes is not None and mapped_bytes < FRESH_PAGES_BYTES else None


class _Worker:
    """A timing process of this one, what it said (a queue of ``(position, taken)``, None once
    it ended), and the allocator threshold it has fixed (Note [A timing process waits for the
    next tune])."""

    def __init__(self, process: subprocess.Popen[bytes]) -> None:
        self.process = process
        self.command = _CHILD
        self.owner = os.getpid()
        self.threshold: Any = _UNSET
        self.since = time.monotonic()  # started, or last done timing
        self.said: queue.Queue[tuple[int, Any] | None] = queue.Queue()
        threading.Thread(target=self._listen, daemon=True).start()

    @classmethod
    def start(cls) -> _Worker:
        return cls(_spawn())

    def _listen(self) -> None:
        stream = self.process.stdout
        assert stream is not None
        while True:
            try:
                self.said.put(pickle.load(stream))
            except Exception:  # the end, or a message cut short by the process's death
                self.said.put(None)
                return

    def send(self, payload: bytes) -> None:
        stream = self.process.stdin
        assert stream is not None
        try:
            stream.write(payload)
            stream.flush()
        except (OSError, ValueError):  # it died, or was ended: what it said tells
            pass

    def alive(self) -> bool:
        """Whether it runs the current command, for this process, and will still take jobs."""
        return (
            self.owner == os.getpid()
            and self.command == _CHILD
            and self.process.poll() is None
            and time.monotonic() - self.since < _TAKEN_WITHIN_S
        )

    def end(self, dying: bool = False) -> None:
        """End it, if this process started it, and reap it; ``dying``: it closed its output,
        and is given a moment to exit with its own code."""
        if self.owner != os.getpid():  # the process that forked this one owns it
            return
        if dying:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(timeout=_DYING_S)
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()
        for stream in (self.process.stdin, self.process.stdout):
            if stream is not None:
                with contextlib.suppress(OSError):
                    stream.close()


def _spawn() -> subprocess.Popen[bytes]:
    """A timing process, started: it imports PyTorch, then waits for its jobs on stdin."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    # stderr stays the step's: the child's progress bar, and what it says if it dies
    return subprocess.Popen(_CHILD, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)


_WAITING: list[_Worker] = []
"""Timing processes of this process that wait for jobs: one started early, or one that timed a
tune's ops and waits for the next tune's (Note [A timing process waits for the next tune])."""


# Note: [A timing process waits for the next tune]
# A timing process spends about 3 s importing PyTorch before it times anything, longer than a
# small model's whole tune takes besides; a process that tunes again (each new shape of batch,
# each model of a notebook) paid it each time. So a timing process that has timed a CPU step's
# ops stays, waiting for the next tune's jobs on stdin, with the heap it used given back to the
# system, for `_WAIT_S` at most (it holds some 300 MB of its own, PyTorch's state included,
# which a process that trains afterwards should have back); a card's is ended, since it holds a CUDA
# context (memory the step needs). One is taken only well within that wait. It has fixed
# its allocator threshold for the step it timed (Note [Fresh pages]), which it cannot undo: a
# tune under another threshold starts a process of its own. A process that died meanwhile, or
# that another process started (one this one was forked from), is not taken. It ends when this
# process does (it reads the end of stdin), and `atexit` ends it first.
def _take(threshold: int | None) -> _Worker | None:
    """A waiting timing process that can time under ``threshold``, taken; those that cannot
    time at all any more are ended."""
    for worker in list(_WAITING):
        if not worker.alive():
            _WAITING.remove(worker)
            worker.end()
        elif worker.threshold in (_UNSET, threshold):
            _WAITING.remove(worker)
            return worker
    return None


# Note: [The timing process starts early]
# A timing process spends seconds importing PyTorch before it times anything, and `tune` used to
# start it only once the step was traced and its plan about to be made, so every tune paid that
# wait (benchmarks/results/README.md, "The timing process starts early"). `started_early`
# starts it at the start of a tune, once the CPU's rates are measured (it would slow that
# measurement), where it imports on another core while the step is traced (tracing is Python on
# one core); the tune's first timing takes it. Where one waits already (Note [A timing process
# waits for the next tune]), none is started. A tune that times nothing (a plan loaded from the
# cache, timings known already) ends the one it started: still importing PyTorch, it took a
# core from the steps that followed, and a small language model's steps (`lms bench` of a
# two-layer GPT-J at 128 tokens, its plan cached) ran 0.022 to 0.040 s where they ran 0.008 s
# once it was done. A process that died meanwhile is not taken: the timing starts another, as it
# would have.
@contextlib.contextmanager
def started_early() -> Iterator[None]:
    """Start a timing process now, unless one waits already, for the first `time_ops` in the
    block to take; end it after the block if nothing took it (Note [The timing process starts
    early])."""
    started = None
    if not any(worker.alive() for worker in _WAITING):
        with contextlib.suppress(OSError):  # the timing says so, when it comes
            started = _Worker.start()
            _WAITING.append(started)
    try:
        yield
    finally:
        if started is not None and started in _WAITING and started.threshold is _UNSET:
            _WAITING.remove(started)  # it timed nothing: not left to take a core
            started.end()


def _end_waiting() -> None:
    while _WAITING:
        _WAITING.pop().end()


atexit.register(_end_waiting)


def backend_settings() -> dict[str, Any]:
    """The settings of this process that choose which kernel an op runs: TF32 for matrix
    products and convolutions, cuDNN's benchmarking of algorithms, deterministic algorithms."""
    return {
        "matmul_precision": torch.get_float32_matmul_precision(),
        "cudnn_tf32": torch.backends.cudnn.allow_tf32,
        "cudnn_benchmark": torch.backends.cudnn.benchmark,
        "cudnn_deterministic": torch.backends.cudnn.deterministic,
        "deterministic": torch.are_deterministic_algorithms_enabled(),
        "deterministic_warn_only": torch.is_deterministic_algorithms_warn_only_enabled(),
    }


def apply_backend_settings(settings: dict[str, Any]) -> None:
    """Make this process choose kernels as the one whose `backend_settings` these are."""
    torch.set_float32_matmul_precision(settings["matmul_precision"])
    torch.backends.cudnn.allow_tf32 = settings["cudnn_tf32"]
    torch.backends.cudnn.benchmark = settings["cudnn_benchmark"]
    torch.backends.cudnn.deterministic = settings["cudnn_deterministic"]
    torch.use_deterministic_algorithms(
        settings["deterministic"], warn_only=settings["deterministic_warn_only"]
    )


def _main() -> None:
    """The timing process: jobs in on stdin, ``(position, seconds)`` pickles out as each is
    timed."""
    try:  # short of memory, the kernel ends this process rather than the step's
        with open("/proc/self/oom_score_adj", "w") as score:
            score.write("1000")
    except OSError:  # not Linux
        pass
    out = os.fdopen(os.dup(sys.stdout.fileno()), "wb")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # whatever else prints, not in the pickles
    fixed: Any = _UNSET
    while True:  # each tune's jobs (Note [A timing process waits for the next tune])
        if not select.select([sys.stdin], [], [], _WAIT_S)[0]:
            return  # none came: its memory goes back to the system
        try:
            device_name, threads, limit_s, settings, mapped_bytes, jobs = pickle.load(
                sys.stdin.buffer
            )
        except EOFError:  # the process that started this one is done with it
            return
        torch.set_num_threads(threads)
        apply_backend_settings(settings)
        device = torch.device(device_name)
        if device.type == "cuda" and device.index is not None:  # "cuda" alone: the current one
            torch.cuda.set_device(device)
        if device.type == "cpu" and fixed is _UNSET:
            # Note [Fresh pages]: glibc maps an allocation anew until it has freed a mapped
            # one that large; a step's first allocations move its threshold to 32 MiB, and below
            # it a step's tensors take memory its heap held before. Timed before, a 32 MiB add
            # ran 4 times as long as in a step. Under a CPU budget the step's threshold is fixed
            # lower, and from there on its ops fault in their outputs and their scratch each
            # time: they are timed so.
            fixed = _threshold(mapped_bytes)
            if fixed is not None:
                map_alone_from(fixed)
            else:
                torch.empty(FRESH_PAGES_BYTES - 4096, dtype=torch.uint8).fill_(0)
        _free_library_buffers(device)  # Note [Buffers a library keeps]
        _time_jobs(jobs, device, limit_s, out)
        # Note: [A timing process tidies before it says it is done]
        # Once its jobs are timed it collects their garbage and gives their heap back to the
        # system, which takes a core for a while. Done after it said it had finished, that ran
        # beside the steps that followed a tune, on a 2-core CPU the first of them: a small
        # language model's third step ran 0.123 s after a fresh tune and 0.037 s on its plan
        # taken from the cache (benchmarks/results/README.md, "A timing process tidies first").
        # So it tidies first, and the tune waits for it.
        gc.collect()
        trim_heap()  # what the jobs' tensors took, given back while it waits
        pickle.dump((len(jobs), _FINISHED), out)
        out.flush()


def _time_jobs(jobs: list[bytes | None], device: torch.device, limit_s: float, out: Any) -> None:
    """Time each job, within ``limit_s``, and send ``(position, seconds)`` for each."""
    started = time.perf_counter()
    bar = tqdm(jobs, desc="timing ops", unit="op", leave=False, disable=None)
    with torch.no_grad(), torch.autocast(device.type, enabled=False):
        for position, job in enumerate(bar):
            if time.perf_counter() - started > limit_s:
                break
            taken = None
            if job is not None:
                pickle.dump((position, _STARTING), out)  # Note [A timing process that dies]
                out.flush()
                name, args, kwargs = pickle.loads(job)
                taken = _time_call(name, args, kwargs, device)
            pickle.dump((position, taken), out)
            out.flush()


def _time_call(
    name: str, args: tuple[Any, ...], kwargs: dict[str, Any], device: torch.device
) -> _Taken | None:
    """Seconds one run of the overload ``name`` takes on ``device`` (the fastest of a few), and
    the scratch it takes (Note [An op's scratch, measured where it is timed]); None where it
    raises."""

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    try:
        namespace, packet, overload = name.split(".")
        op = getattr(getattr(getattr(torch.ops, namespace), packet), overload)
        args, kwargs = _made_up_call(op, args, kwargs, device)
        sync()
        before = _in_use(device)
        op(*args, **kwargs)  # warm-up, its outputs freed at once
        sync()
        after = _in_use(device)
        kept = None if before is None or after is None else max(after - before, 0)
        runs: list[float] = []
        while len(runs) < _MOST_CALLS:
            runs.append(_one_run(op, args, kwargs, device))
            total = sum(runs)
            if total >= _ENOUGH_S or len(runs) >= 3 and total >= _AT_LEAST_S:
                break
    except Exception:  # an op that needs real data (a valid index, a positive value)
        return None
    scratch = None
    with contextlib.suppress(Exception):  # its time stands without it
        scratch = _scratch_taken(op, args, kwargs, device)
    return min(runs), scratch, kept


# Note: [Buffers a library keeps]
# Some libraries keep memory from an op's first run for the runs after it: MKL keeps the buffers
# its matrix products pack their operands into (a pool it reuses, `mkl_free_buffers` empties it),
# cuBLAS a workspace for each stream. A step's first run allocates them while it runs, and from
# then on the process holds them beside the step's tensors. A gradient penalty's MLP (4096 rows,
# 1024 wide) kept 16.7 MB of MKL's buffers after its first step, which grew the heap by 191.0 MB
# where the later steps grew it by 174.4: its plan, simulated at 174.3 MB under a budget of 186.6,
# took the budget's last 4.4 MB and passed it in the first step, and each step after held the
# budget and more. So the timing process empties the libraries' buffers before each tune's calls
# and, as each call first runs there, reads how far memory in use rose once its outputs were
# freed (the heap in use on a CPU, the caching allocator's count on a card): the bytes that call
# left to its library (`lms.core.devices.OpTimings.kept`). The calls run in the step's order, so
# a pool the step would reuse is reused there too. A plan on a CPU leaves their sum in the budget
# beside the step's own peak (`lms.analysis.simulate.library_kept_bytes`,
# `lms.orchestration.tuning.within_room`); where no plan fits what that leaves, the plan holds
# the step's own peak to the budget and says by how much the first step passes it (a small model
# on a CPU: MKL's smallest pool is 4 MiB, more than some steps take). A card's are read and
# recorded, but not counted, as the spec's workspace margin stands for cuBLAS's workspace there.


def _in_use(device: torch.device) -> int | None:
    """Memory in use on ``device`` now: the caching allocator's on a card, the heap's elsewhere
    (None where that is not counted)."""
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device)
    return heap_in_use_bytes()


def _free_library_buffers(device: torch.device) -> None:
    """Empty what libraries keep from earlier calls (Note [Buffers a library keeps]): MKL's
    buffers where PyTorch's MKL says how, cuBLAS's workspaces on a card."""
    if device.type == "cuda":
        with contextlib.suppress(AttributeError, RuntimeError):
            torch._C._cuda_clearCublasWorkspaces()
        return
    for library in (os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so"), None):
        try:
            ctypes.CDLL(library).mkl_serv_free_buffers()
        except (AttributeError, OSError):  # another build (OpenBLAS) or another system
            continue
        return


# Note: [An op's scratch, measured where it is timed]
# Some ops take memory of their own while they run, beyond their inputs and outputs: a library's
# copies of its operands in its own layout, unfolded columns, per-thread buffers. The trace
# estimates a CPU convolution's and an LSTM backward's from their shapes (Note [Convolution
# scratch on the CPU] in `lms.analysis.recorder`), and those estimates follow a formula; a
# dilated convolution whose kernel spans more than its input (DeepLabV3's atrous pooling at
# 256 px) took 102 MiB where 19.75 were estimated, and its step passed its CPU budget. So on a
# CPU the timing process, once an op is timed, runs it once more and reads how far the heap in
# use rose (the measure of a CPU step: Note [The C heap in use, not the resident set, measures a
# CPU step] in `lms.runtime.heap`), sampled on a thread while the op runs, and how far the
# resident set's peak rose, which is exact but counts only the pages written; the larger, less
# the outputs the op made, is its scratch there. The simulator takes the larger of that and the
# estimate (`lms.core.devices.OpTimings.scratch`): a reading can fall short (a peak between
# samples, pages the heap kept from the runs before where the step's threshold leaves small
# allocations in the heap: Note [Fresh pages]), while an estimate was checked against the step.
# On a card the caching allocator's own peak (`torch.cuda.max_memory_allocated`) is exact, and
# the bytes go into the op timings and a step's record, but the simulator does not count them:
# cuDNN picks its algorithm, and so its workspace, by the memory free when it runs, which in a
# timing process is most of the card, and in a step under a budget is not; the spec's workspace
# margin stands for it there.
_SAMPLE_S = 1e-4
"""How often the heap in use is read while an op's scratch is measured."""


def _scratch_taken(op: Any, args: Any, kwargs: Any, device: torch.device) -> int | None:
    """Bytes one run of ``op`` took on ``device`` beyond the outputs it made (Note [An op's
    scratch, measured where it is timed]); None where neither the heap in use nor the peak
    resident set can be read on a CPU."""
    given = {t.untyped_storage().data_ptr() for t in tensors_in((args, kwargs))}
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        out = op(*args, **kwargs)
        torch.cuda.synchronize(device)
        growths: list[int | None] = [torch.cuda.max_memory_allocated(device) - before]
    else:
        exact = reset_peak_rss()
        with PeakMemory(interval_s=_SAMPLE_S) as sampled:
            out = op(*args, **kwargs)
        peak = peak_rss_bytes() if exact else None
        growths = [
            sampled.heap_growth_bytes,
            None if peak is None else peak - sampled.start_rss_bytes,
        ]
    if all(g is None for g in growths):
        return None
    made = {
        t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
        for t in tensors_in(out)
        if t.untyped_storage().data_ptr() not in given
    }
    return max(max(g for g in growths if g is not None) - sum(made.values()), 0)


def _one_run(op: Any, args: Any, kwargs: Any, device: torch.device) -> float:
    """Seconds of one call: on a card, between CUDA events around it (the kernels' own time on
    the card's clock, without the host's wait for the card); elsewhere, the wall clock.

    On a card the events follow a hold of the card (`lms.runtime._cuda.hold_card`): in a step
    the host queues each op while the card runs the ones before, and so must it here, or the
    op's time would count the host queuing its kernels (tens of microseconds) with the card
    idle."""
    if device.type != "cuda":
        start = time.perf_counter()
        op(*args, **kwargs)
        return time.perf_counter() - start
    from lms.runtime._cuda import hold_card, timing_event

    hold_card()
    before = timing_event()
    op(*args, **kwargs)
    after = timing_event()
    after.synchronize()
    return float(before.elapsed_time(after)) / 1000.0


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
