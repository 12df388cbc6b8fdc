"""Where offloaded storages live: host buffers from the pool, or spill files, and back.

An `Entry` is one device storage that autograd saved (once, or as several views). The `Offloader`
moves its bytes out and in; it never decides *what* to move (that is the session's policy).
"""

from __future__ import annotations

import concurrent.futures
import time
import weakref
from typing import Any

import torch

from lms.core.errors import HostMemoryError, StepAbortedError
from lms.core.units import format_bytes
from lms.runtime.disk import RESERVE_FREE_BYTES, SpillStore
from lms.runtime.pool import HostPool
from lms.runtime.steplog import StepLog

__all__ = ["Entry", "Offloader"]


def _as_bytes(storage: torch.UntypedStorage, device: torch.device) -> torch.Tensor:
    """A flat uint8 tensor over the whole of ``storage``."""
    flat = torch.empty(0, dtype=torch.uint8, device=device)
    return flat.set_(storage, 0, (storage.nbytes(),), (1,))


class Entry:
    """One saved storage and where its bytes are."""

    __slots__ = (
        "key",
        "ordinal",
        "device",
        "nbytes",
        "storage",
        "handles",
        "saves",
        "replays",
        "offloaded",
        "host_buf",
        "on_disk",
        "pending_out",
        "loading",
        "loaded",
        "last",
        "aborted",
        "released",
        "in_event",
        "uses",
        "base",
        "copied_version",
        "back",
        "recipe",
        "held",
        "origin",
        "empty_at",
        "gaps",
        "emptied",
        "into",
        "reading",
    )

    def __init__(self, key: int, ordinal: int, storage: torch.UntypedStorage, device: torch.device):
        self.key = key
        self.ordinal = ordinal
        self.device = device
        self.nbytes = storage.nbytes()
        self.storage: torch.UntypedStorage | None = storage
        self.handles = 0  # saves alive, and replays that read it not yet let go of
        self.saves = 0  # tensors saved on it this step
        self.replays = 0  # recomputed entries whose recipe reads it, not yet let go of
        self.offloaded = False
        self.host_buf: torch.Tensor | None = None
        self.on_disk = False
        self.pending_out: Any = None  # a CUDA event or a write future
        self.loading: Any = None  # a read future, or (device tensor, CUDA event)
        self.loaded: torch.UntypedStorage | None = None
        self.last: weakref.ref[torch.UntypedStorage] | None = None
        self.aborted = False
        self.released = False
        self.in_event: Any = None  # the CUDA event of the last copy in from the host buffer
        self.uses = 0
        self.base: weakref.ref[torch.Tensor] | None = None  # the tensor its views come from
        self.copied_version: int | None = None  # the base's version when the copy was taken
        self.back = False  # brought back to the device since it was offloaded
        self.recipe: Any = None  # set when backward recomputes it instead
        self.held = False  # a save kept in place holds its storage: moving it frees nothing
        self.origin = weakref.ref(storage)  # the device storage, alive while anything holds it
        self.empty_at: int | None = None  # the event from which the plan empties it (free_held)
        self.gaps: list[tuple[int, int]] = []  # (empty_at, fill_at) still to come, in forward
        self.emptied = False  # its device storage, which the code holds, is empty for now
        self.into: torch.Tensor | None = None  # that device storage, while its file is read
        self.reading: torch.Tensor | None = None  # the host tensor its file is read into

    def note_copied(self) -> None:
        """Remember its base's version as its bytes leave the device (copied out, or dropped to be
        remade): see Note [Join a copied storage only through the same base at the same version]."""
        base = self.base() if self.base is not None else None
        self.copied_version = base._version if base is not None else None


def _finished(pending: Any, *, wait: bool = False) -> bool:
    """Whether a copy out (a CUDA event, or a spill file's write) has finished; ``wait``: once
    it has."""
    if isinstance(pending, concurrent.futures.Future):
        if wait:
            concurrent.futures.wait([pending])
        return pending.done()
    if wait:
        pending.synchronize()
    return bool(pending.query())


class Offloader:
    """Moves entries' bytes to host buffers or spill files and back, for one device type."""

    def __init__(
        self,
        *,
        tier: str,
        host_limit_bytes: int,
        spill_dir: str | None,
        sync_out: bool,
        spill_reserve_bytes: int = RESERVE_FREE_BYTES,
    ):
        self.tier = tier
        self.host_limit_bytes = host_limit_bytes
        self.spill_dir = spill_dir
        self.spill_reserve_bytes = spill_reserve_bytes
        self.sync_out = sync_out
        self._pool: HostPool | None = None
        self._disk: SpillStore | None = None
        self._engines: dict[torch.device, Any] = {}  # a copy engine for each CUDA device
        self._pending: list[Entry] = []
        self._error: BaseException | None = None
        self.disk_bytes = 0
        self.host_bytes = 0
        self.peak_host_bytes = 0
        self.peak_disk_bytes = 0
        self.loaded_bytes = 0
        self.emptied_bytes = 0
        self._emptied: dict[int, Entry] = {}  # by key: emptied storages, filled before closing
        self.log: StepLog | None = None

    def record_to(self, log: StepLog | None) -> None:
        """Report copies and waits to ``log`` from now on (None: stop)."""
        self.log = log
        if self._disk is not None:
            self._disk.timed = None if log is None else log.spill_done
        for engine in self._engines.values():
            engine.timed = log is not None

    # -- set-up -----------------------------------------------------------------------------
    def _pool_for(self, device: torch.device) -> HostPool:
        if self._pool is None:
            self._pool = HostPool(self.host_limit_bytes, pin=device.type == "cuda")
        return self._pool

    def _disk_store(self) -> SpillStore:
        if self._disk is None:
            self._disk = SpillStore(self.spill_dir, reserve_bytes=self.spill_reserve_bytes)
            self._disk.timed = None if self.log is None else self.log.spill_done
        return self._disk

    def _engine_for(self, device: torch.device) -> Any:
        """The streams of ``device``: a model split over several devices in one process has
        its tensors copied on their own device's streams, and brought back there."""
        engine = self._engines.get(device)
        if engine is None:
            from lms.runtime._cuda import CopyEngine

            engine = self._engines[device] = CopyEngine(device)
            engine.timed = self.log is not None
        return engine

    def _uses_disk(self, device: torch.device) -> bool:
        return self.tier == "disk" or (self.tier == "auto" and device.type == "cpu")

    def check_ready(self, device: torch.device) -> None:
        """Open what the tier needs for ``device`` now, so bad settings fail before training."""
        if self._uses_disk(device) or self.tier == "auto":
            self._disk_store()

    # -- out ---------------------------------------------------------------------------------
    def offload(self, entry: Entry, *, to_disk: bool = False) -> None:
        """Start moving ``entry`` out of device memory (``to_disk``: to a spill file even when
        host memory has room)."""
        assert entry.storage is not None and not entry.offloaded
        device = entry.device
        src = _as_bytes(entry.storage, device)
        if not self._uses_disk(device) and not to_disk:
            buf = self._pool_for(device).acquire(entry.nbytes)
            if buf is not None:
                dst = buf[: entry.nbytes]
                log = self.log
                queued = None if log is None else log.mark()
                if device.type == "cuda":
                    engine = self._engine_for(device)
                    entry.pending_out = engine.copy_out(src, dst)
                    if log is not None:
                        log.copy(
                            "out",
                            entry.ordinal,
                            entry.nbytes,
                            queued,
                            engine.last_start,
                            entry.pending_out,
                        )
                else:
                    dst.copy_(src)
                    if log is not None:
                        log.copy("out", entry.ordinal, entry.nbytes, queued, queued, log.mark())
                entry.host_buf = buf
                self.host_bytes += buf.numel()
                self.peak_host_bytes = max(self.peak_host_bytes, self.host_bytes)
                self._finish_out(entry)
                return
            if self.tier == "host":
                raise HostMemoryError(
                    f"lms: host memory for offloaded data is full: {format_bytes(self.host_bytes)}"
                    f" held, {format_bytes(entry.nbytes)} more needed, host_budget "
                    f"{format_bytes(self.host_limit_bytes)}; raise host_budget, use tier='auto' "
                    "to overflow to disk, or lower the batch size"
                )
        if device.type != "cpu":
            src = src.to("cpu")  # a host copy that the write holds until it is on disk
        if self.log is not None:
            self.log.spill_asked("out", entry.key, entry.ordinal, entry.nbytes)
        entry.pending_out = self._disk_store().write(entry.key, src)
        entry.on_disk = True
        self.disk_bytes += entry.nbytes
        self.peak_disk_bytes = max(self.peak_disk_bytes, self.disk_bytes)
        self._finish_out(entry)

    def _finish_out(self, entry: Entry) -> None:
        entry.offloaded = True
        if entry.pending_out is None:
            entry.storage = None
        elif self.sync_out:
            self._complete(entry, wait=True)
        else:
            self._pending.append(entry)

    def _complete(self, entry: Entry, *, wait: bool) -> bool:
        """Drop the device storage once its copy out has finished; True when done. A wait for
        one still running is a wait of the step's (the record's, Note [One clock for a step
        record])."""
        pending = entry.pending_out
        if pending is None:
            return True
        if not _finished(pending):
            if not wait:
                return False
            mark = None if self.log is None else self.log.mark()
            _finished(pending, wait=True)
            if self.log is not None:
                self.log.wait(entry.ordinal, mark, self.log.mark())
        error = pending.exception() if isinstance(pending, concurrent.futures.Future) else None
        if error is not None:
            # The data is still on the device: keep it there, nothing is lost.
            entry.pending_out = None
            entry.on_disk = False
            entry.offloaded = False
            self.disk_bytes -= entry.nbytes
            self._error = self._error or error
            return True
        # Note: [Free after the copy event]
        entry.pending_out = None
        entry.storage = None
        return True

    @property
    def pending_bytes(self) -> int:
        """Bytes of device storages whose copy out has not finished (still occupying memory)."""
        return sum(entry.nbytes for entry in self._pending)

    def wait_oldest(self) -> None:
        """Wait for the oldest copy out still in flight."""
        if self._pending:
            self._complete(self._pending.pop(0), wait=True)
            self.raise_error()

    def poll(self) -> None:
        """Finish copies out that are done; raise the first error a background copy hit."""
        self._pending = [e for e in self._pending if not self._complete(e, wait=False)]
        self.raise_error()

    def raise_error(self) -> None:
        """Raise (once) the error a background copy hit."""
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    # -- emptied in place ----------------------------------------------------------------------
    # Note: [Emptying what the code holds]
    # A saved storage frees its device memory when the runtime's copy out ends only if nothing
    # else holds it. The step's code often does: the caller's input batch, a block's input kept
    # in a local (`identity = x`), ResNet's `x` while layer1 runs, the model's output kept into
    # backward. With `free_held`, a plan names those it offloads and, for each, the first
    # saved-tensor event after forward's last read of it (from the trace); from that event on,
    # once the copy out has finished, the runtime resizes the storage to nothing (every tensor of
    # it stays what it was, with no bytes behind it, as FSDP does to its sharded parameters) and
    # later fills the same storage again in place: when backward reads it (its copy in writes
    # into it), or when autograd lets go of it unread, or when the step fails, so no tensor the
    # code holds is lost. No version counter moves. A storage that cannot be resized (shared
    # memory, numpy's) is kept. Should the plan come too late (the copy out not done before
    # backward reads it), backward reads the storage where it stayed, with no second copy.
    def empty(self, entry: Entry) -> None:
        """Free the device memory of ``entry``'s storage, which something still holds."""
        origin = entry.origin()
        if origin is None or entry.emptied or origin.nbytes() != entry.nbytes:
            return
        if entry.loading is not None or entry.loaded is not None:
            return  # on its way back already
        if entry.last is not None and entry.last() is not None:
            return  # backward reads it in place
        try:
            origin.resize_(0)
        except RuntimeError:  # not resizable: it stays
            return
        entry.emptied = True
        self.emptied_bytes += entry.nbytes
        self._emptied[entry.key] = entry

    def empty_now(self, entry: Entry) -> None:
        """Wait for ``entry``'s copy out, then `empty` it: where a plan's gap in forward begins
        (Note [Gaps in what the code holds])."""
        self._complete(entry, wait=True)
        if entry.offloaded:
            self.empty(entry)

    def _fill_target(self, entry: Entry) -> torch.Tensor | None:
        """The bytes of ``entry``'s emptied storage, given back its size for a load to fill."""
        if not entry.emptied:
            return None
        entry.emptied = False
        self._emptied.pop(entry.key, None)
        origin = entry.origin()
        if origin is None:
            return None
        origin.resize_(entry.nbytes)
        return _as_bytes(origin, entry.device)

    def _in_place(self, entry: Entry) -> bool:
        """Whether backward reads ``entry`` where the code still holds it, full (see Note
        [Emptying what the code holds]): no load."""
        if entry.empty_at is None or entry.emptied:
            return False
        origin = entry.origin()
        if origin is None or origin.nbytes() != entry.nbytes:
            return False
        entry.last = weakref.ref(origin)
        return True

    def fill(self, entry: Entry) -> None:
        """Fill ``entry``'s emptied storage from its copy now, before the copy goes."""
        if not entry.emptied:
            return
        if entry.pending_out is not None:
            self._complete(entry, wait=True)
        into = self._fill_target(entry)
        if into is None:
            return
        log = self.log
        queued = None if log is None else log.mark()
        if entry.host_buf is not None:
            into.copy_(entry.host_buf[: entry.nbytes])
        elif entry.on_disk:
            on_host = into if into.device.type == "cpu" else torch.empty_like(into, device="cpu")
            self._disk_store().read(entry.key, on_host).result()
            if on_host is not into:
                into.copy_(on_host)
        if log is not None:
            tier = "host" if entry.host_buf is not None else "disk"
            log.copy("in", entry.ordinal, entry.nbytes, queued, queued, log.mark(), tier=tier)

    # -- in ----------------------------------------------------------------------------------
    def prefetch(self, entry: Entry) -> bool:
        """Start bringing ``entry`` back; False when it needs no load."""
        if not entry.offloaded or entry.loading is not None or entry.loaded is not None:
            return False
        if entry.last is not None and entry.last() is not None:
            return False
        if entry.aborted or self._in_place(entry):
            return False
        device = entry.device
        if entry.on_disk:
            if entry.pending_out is not None:
                self._complete(entry, wait=True)
                if not entry.offloaded:  # the write failed; the data stayed resident
                    return False
            into = self._fill_target(entry)
            if device.type != "cpu":  # read on the host, copied in by `fetch`
                entry.into, into = into, None
            if into is None:
                into = torch.empty(entry.nbytes, dtype=torch.uint8)
            if self.log is not None:
                self.log.spill_asked("in", entry.key, entry.ordinal, entry.nbytes)
            entry.reading = into
            entry.loading = self._disk_store().read(entry.key, into)
        else:
            assert entry.host_buf is not None
            src = entry.host_buf[: entry.nbytes]
            into = self._fill_target(entry)
            log = self.log
            queued = None if log is None else log.mark()
            if device.type == "cuda":
                if entry.pending_out is not None:
                    self._complete(entry, wait=False)
                # Note [A copy in follows the copy out of its data]
                engine = self._engine_for(device)
                entry.loading = engine.copy_in(src, into, after=entry.pending_out)
                if log is not None:
                    log.copy(
                        "in",
                        entry.ordinal,
                        entry.nbytes,
                        queued,
                        engine.last_start,
                        entry.loading[1],
                    )
            else:
                entry.loading = src.clone() if into is None else into.copy_(src)
                if log is not None:
                    log.copy("in", entry.ordinal, entry.nbytes, queued, queued, log.mark())
        self.loaded_bytes += entry.nbytes
        return True

    def fetch(self, entry: Entry, *, hold: bool = False) -> tuple[torch.UntypedStorage, float]:
        """The device storage of ``entry``, loading it if needed; also the seconds waited.

        With ``hold``, the loaded storage stays referenced for the entry's other views.
        """
        if entry.storage is not None:
            return entry.storage, 0.0
        if entry.aborted:
            raise StepAbortedError(
                "lms: backward needs a tensor whose offloaded copy was discarded when its step "
                "failed; run forward again"
            )
        if entry.loaded is not None:
            storage = entry.loaded
            entry.loaded = storage if hold else None
            entry.last = weakref.ref(storage)
            return storage, 0.0
        if entry.last is not None:
            alive = entry.last()
            if alive is not None:
                return alive, 0.0
        if entry.loading is None:
            self.prefetch(entry)
            if entry.storage is not None:
                return entry.storage, 0.0
            if entry.loading is None and entry.last is not None:
                alive = entry.last()  # read in place (Note [Emptying what the code holds])
                if alive is not None:
                    return alive, 0.0
        start = time.perf_counter()
        mark = None if self.log is None else self.log.mark()
        loading, entry.loading = entry.loading, None
        if isinstance(loading, concurrent.futures.Future):
            loading.result()
            data, entry.reading = entry.reading, None
            assert data is not None
            if entry.device.type != "cpu":
                into, entry.into = entry.into, None
                data = data.to(entry.device) if into is None else into.copy_(data)
        elif isinstance(loading, tuple):
            data, event = loading
            self._engine_for(entry.device).wait(event)
            assert entry.host_buf is not None
            # Keep the copy's event with the host buffer so it is not reused before it is read.
            entry.in_event = event
        else:
            data = loading
        waited = time.perf_counter() - start
        if self.log is not None:
            self.log.wait(entry.ordinal, mark, self.log.mark())
        storage = data.untyped_storage()
        entry.last = weakref.ref(storage)
        entry.loaded = storage if hold else None
        return storage, waited

    # -- end of life -------------------------------------------------------------------------
    def release(self, entry: Entry) -> None:
        """Free the host buffer or spill file of ``entry`` (its handles are all gone)."""
        if entry.released:
            return
        entry.released = True
        if entry.pending_out is not None and entry.on_disk:
            self._complete(entry, wait=True)
        if entry.emptied:
            self._fill_quietly(entry)
        if entry.host_buf is not None:
            event = entry.in_event if entry.pending_out is None else entry.pending_out
            if isinstance(entry.loading, tuple):  # a copy in, queued and never waited for
                event = entry.loading[1]
            self.host_bytes -= entry.host_buf.numel()
            if self._pool is not None:
                self._pool.release(entry.host_buf, event)
            entry.host_buf = None
        if entry.on_disk and self._disk is not None:
            self._disk.delete(entry.key, entry.nbytes)
            self.disk_bytes -= entry.nbytes
            entry.on_disk = False
        entry.storage = None
        entry.loaded = None
        entry.loading = None
        entry.pending_out = None
        entry.into = None
        entry.reading = None

    def _fill_quietly(self, entry: Entry) -> None:
        """`fill`, where a failed read must not stop the rest of a release: the error is kept
        for `raise_error`."""
        try:
            self.fill(entry)
        except Exception as error:  # noqa: BLE001 - raised later, once
            self._error = self._error or error

    def abort(self, entries: list[Entry]) -> None:
        """Discard every offloaded copy of ``entries``; resident data stays usable."""
        for entry in entries:
            if entry.pending_out is not None:
                self._complete(entry, wait=True)
            if entry.storage is None:
                entry.aborted = True
            self.release(entry)
        self._pending = []
        self._error = None
        self.close()

    def tidy(self) -> None:
        """Remove the spill folder once nothing is in it."""
        if self._disk is not None and self.disk_bytes == 0:
            self._disk.close()
            self._disk = None

    def close(self) -> None:
        """Fill what is still emptied, remove spill files and drop the idle buffers of the pool."""
        for entry in self._pending:
            self._complete(entry, wait=True)
        self._pending = []
        for entry in list(self._emptied.values()):
            self._fill_quietly(entry)
        if self._disk is not None:
            self._disk.close()
            self._disk = None
            self.disk_bytes = 0
        if self._pool is not None:
            self._pool.clear()

    @property
    def pool(self) -> HostPool | None:
        """The host buffer pool, once one was made."""
        return self._pool

    @property
    def disk(self) -> SpillStore | None:
        """The spill store, once one was made."""
        return self._disk
