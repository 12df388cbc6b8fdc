"""Spill files: the one module that writes them.

A `SpillStore` keeps each offloaded storage in a file of its own under the spill directory, and
runs one background I/O thread. Writes and reads run on that thread in submission order, so a
read of a key always follows its write.

Note: [Spill files have no name]
Each file is opened without a name (Linux's ``O_TMPFILE``; elsewhere, made and unlinked at once)
and reached through its descriptor alone. The kernel frees its blocks when the last descriptor
closes: when its data is released, at `close()`, and when the process ends however it ends
(SIGTERM, SIGKILL, the out-of-memory killer). So nothing is left on disk for anyone to clean up,
and a forked child, which inherits the descriptors but no name, cannot delete what its parent
still needs: its exit closes its own copies only.

Note: [Spill files are checked when read back]
A file's bytes can change between forward and backward (a failing disk or filesystem, another
process writing through ``/proc``), and wrong bytes would become wrong gradients with no error.
Each file's xxh3 digest is taken as it is written and checked as it is read back; a mismatch
raises `SpillError` before the bytes reach the step. The digest runs on the I/O thread beside the
copy, and its cost is priced with the file's write and read (`lms.core.costs`); measurements:
benchmarks/results/README.md, "Spill-file checksums". Host-memory copies (pinned buffers on a
GPU) are not checked: they never leave the process's own memory, where nothing but the process
writes.

Note: [Spill folders of processes that were killed]
Releases before unnamed files kept a folder of named files per process, which a killed process
left behind: ``lms-spill-<pid>@<host>.<namespace>-<random>``. A store still removes, under its
spill directory, such folders whose process is gone from this host and namespace
(`remove_stale_folders`); a folder of a live process, of another host or namespace, or of a
process this one may not signal is left alone.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import errno
import logging
import mmap
import os
import re
import shutil
import socket
import tempfile
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

import torch
import xxhash

from lms.core.errors import SpillError
from lms.core.units import format_bytes

__all__ = ["SpillStore", "check_spill_dir", "remove_stale_folders"]

log = logging.getLogger("lms.runtime.disk")
_CHUNK_BYTES = 1024**2
"""The buffer a spill file is written through (Note [A spill file is written from a snapshot]):
an anonymous mapping, so that it stays out of the C heap a budget on the CPU counts."""
RESERVE_FREE_BYTES = 64 * 1024**2
"""Free space a spill folder keeps beyond the files written to it, for the rest of the system."""


def _bytes_view(data: torch.Tensor) -> memoryview:
    """The bytes of ``data`` (a contiguous CPU uint8 tensor) as a writable memoryview.

    Not through ``data.numpy()``: that marks the storage as one that can never be resized again,
    and the runtime empties storages the step's code holds (Note [Emptying what the code
    holds]); the caller keeps ``data`` alive while the view is read or written."""
    return memoryview((ctypes.c_char * data.numel()).from_address(data.data_ptr())).cast("B")


def check_spill_dir(path: str | None) -> str:
    """Return a usable spill directory, or raise `SpillError` saying why it is not usable."""
    folder = os.path.abspath(path if path is not None else tempfile.gettempdir())
    if not os.path.isdir(folder):
        raise SpillError(
            f"lms: spill_dir {folder!r} is not a folder; create it or pass another spill_dir"
        )
    try:
        probe = tempfile.mkdtemp(prefix=".lms-probe-", dir=folder)
    except OSError as exc:
        raise SpillError(
            f"lms: spill_dir {folder!r} is not writable ({exc.strerror}); pass a writable spill_dir"
        ) from exc
    os.rmdir(probe)
    return folder


def _remove_tree(folder: str) -> None:
    shutil.rmtree(folder, ignore_errors=True)


_FOLDER = re.compile(r"lms-spill-(\d+)@(.+)-[^-]+")


def _this_host() -> str:
    """This host's name, and the process-id namespace whose ids name the folders' processes."""
    try:
        space = re.sub(r"\D", "", os.readlink("/proc/self/ns/pid"))
    except OSError:
        space = "0"
    return f"{socket.gethostname()}.{space}"


def _runs(pid: int) -> bool:
    if os.name != "posix":  # there a signal ends the process: never ask
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's process, say
        return True
    return True


def remove_stale_folders(root: str) -> int:
    """Remove the spill folders under ``root`` left by processes of this host that no longer
    run (Note [Spill folders of processes that were killed]); returns how many."""
    host = _this_host()
    try:
        names = os.listdir(root)
    except OSError:
        return 0
    removed = 0
    for name in names:
        match = _FOLDER.fullmatch(name)
        if match is None or match[2] != host or _runs(int(match[1])):
            continue
        path = os.path.join(root, name)
        _remove_tree(path)
        removed += not os.path.exists(path)
    if removed:
        log.info(
            "[LMS] Removed %d spill folders left in %s by processes that were killed", removed, root
        )
    return removed


def _open_unnamed(root: str) -> int:
    """A read-write descriptor of a new file under ``root`` that has no name (Note [Spill files
    have no name])."""
    flags = os.O_RDWR | getattr(os, "O_CLOEXEC", 0)
    unnamed = getattr(os, "O_TMPFILE", 0)
    if unnamed:
        try:
            return os.open(root, flags | unnamed, 0o600)
        except OSError as exc:  # a filesystem without unnamed files: name one and unlink it
            if exc.errno not in (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL):
                raise
    fd, path = tempfile.mkstemp(prefix=".lms-spill-", dir=root)
    os.unlink(path)
    return fd


class _File:
    """One spill file: its descriptor, size and digest (Note [Spill files are checked when
    read back])."""

    __slots__ = ("fd", "nbytes", "digest")

    def __init__(self, fd: int, nbytes: int, digest: int):
        self.fd, self.nbytes, self.digest = fd, nbytes, digest


def _close_all(files: dict[int, _File], owner: int) -> None:
    """Close every descriptor in ``files`` (in the process that opened them only)."""
    if os.getpid() != owner:
        return
    for record in list(files.values()):
        with _suppress_os_error():
            os.close(record.fd)
    files.clear()


class SpillStore:
    """Unnamed files for offloaded storages, written and read by one background thread (Note
    [Spill files have no name]), each checked as it is read back (Note [Spill files are checked
    when read back])."""

    def __init__(self, spill_dir: str | None, *, reserve_bytes: int = RESERVE_FREE_BYTES):
        self.root = check_spill_dir(spill_dir)
        self.reserve_bytes = reserve_bytes
        self._swept = False
        self._lock = threading.Lock()
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="lms-io")
        self._files: dict[int, _File] = {}
        self._bounce: memoryview | None = None  # the I/O thread's (Note [A spill file is ...])
        self._closed = False
        # Runs at close(), at garbage collection or at interpreter exit, whichever is first; a
        # forked child's exit leaves the parent's descriptors to the parent.
        self._finalizer = weakref.finalize(self, _close_all, self._files, os.getpid())
        self.bytes_on_disk = 0
        self.peak_bytes_on_disk = 0
        self.timed: Callable[[str, int, float, float], None] | None = None
        """Told, on the I/O thread, the wall-clock start and end of each write (``out``) and
        read (``in``), by key: a step record's (`lms.runtime.steplog`)."""

    @property
    def folder(self) -> str | None:
        """The folder this store's files are in, once the first file was written."""
        return self.root if self._swept else None

    def write(self, key: int, data: torch.Tensor) -> concurrent.futures.Future[None]:
        """Start writing ``data`` (a contiguous CPU uint8 tensor) to the file of ``key``.

        Raises:
            SpillError: at once when the disk has not room for it, or the store is closed.
        """
        if self._closed:
            raise SpillError("lms: this LMS object was closed; spill files cannot be written")
        nbytes = data.numel()
        if not self._swept:
            self._swept = True
            remove_stale_folders(self.root)
        free = shutil.disk_usage(self.root).free
        if free < nbytes + self.reserve_bytes:
            raise SpillError(
                f"lms: the spill folder {self.root!r} has {format_bytes(free)} free, too little "
                f"for {format_bytes(nbytes)} more of offloaded data beside the "
                f"{format_bytes(self.reserve_bytes)} it keeps free (spill_reserve) "
                f"(already {format_bytes(self.bytes_on_disk)} on disk); "
                "pass a spill_dir with more room, lower spill_reserve, raise the budget or "
                "lower the batch size"
            )
        self.bytes_on_disk += nbytes
        self.peak_bytes_on_disk = max(self.peak_bytes_on_disk, self.bytes_on_disk)
        return self._pool.submit(self._run, "out", key, self._write, [data])

    # Note: [The I/O thread lets go of a storage before it says it is done]
    # A thread pool's worker keeps the call it ran, its arguments and its future with the
    # result, until it takes the next one, after the future says the call is done. The step,
    # woken by that future, drops its own reference and goes on; were a storage among those
    # arguments or the result, it would stay allocated until the worker ran again, which on a
    # loaded machine (the worker preempted while the step waited) came after the step's next
    # activation was allocated: a storage more at the peak than the plan has (a CPU step
    # measured 52 MB, one activation, over its simulated peak, in one step of three). So a
    # call's data travels in a list that the worker empties, a read's result is None (the
    # caller keeps the tensor it reads into), and the storage's last reference on the I/O
    # thread is a local of a frame that returns before the future is told.
    def _run(
        self, direction: str, key: int, work: Callable[[int, torch.Tensor], Any], box: list[Any]
    ) -> Any:
        data = box.pop()
        timed = self.timed
        if timed is None:
            return work(key, data)
        start = time.perf_counter()
        try:
            return work(key, data)
        finally:
            timed(direction, key, start, time.perf_counter())

    def _write(self, key: int, data: torch.Tensor) -> None:
        view = _bytes_view(data)
        fd = -1
        digest = xxhash.xxh3_64()
        try:
            fd = _open_unnamed(self.root)
            # Note: [A spill file is written from a snapshot]
            # The bytes go through a small buffer of this store's, a chunk at a time, and the
            # digest is taken of that buffer: the file and its digest are of the same bytes even
            # where the storage changes while it is written. A saved view may cover part of its
            # storage while the step still writes the rest, bytes backward never reads (a GRU's
            # storages were seen to change so on CPU); a digest taken apart from the write
            # would not match the file there. Each chunk is copied by `ctypes.memmove`, which
            # lets go of the interpreter lock while it copies, as the digest and the write do; a
            # slice assignment holds it, and the step's thread, which takes the lock back after
            # each op it runs, waited for it (benchmarks/results/README.md, "The I/O thread and
            # the interpreter lock").
            if self._bounce is None:  # a mapping of its own, outside the C heap
                self._bounce = memoryview(mmap.mmap(-1, _CHUNK_BYTES))
            bounce = self._bounce
            into = ctypes.addressof(ctypes.c_char.from_buffer(bounce))
            source = data.data_ptr()
            done = 0
            while done < len(view):
                size = min(_CHUNK_BYTES, len(view) - done)
                ctypes.memmove(into, source + done, size)
                digest.update(bounce[:size])
                written = 0
                while written < size:
                    written += os.pwrite(fd, bounce[written:size], done + written)
                done += size
        except OSError as exc:
            if fd >= 0:
                with _suppress_os_error():
                    os.close(fd)
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                raise SpillError(
                    f"lms: the disk of {self.root!r} filled up while writing "
                    f"{format_bytes(len(view))} of offloaded data; pass a spill_dir with more "
                    "room, raise the budget or lower the batch size"
                ) from exc
            raise SpillError(
                f"lms: writing a spill file in {self.root!r} failed ({exc}); check the spill_dir"
            ) from exc
        with self._lock:
            old = self._files.pop(key, None)
            self._files[key] = _File(fd, len(view), digest.intdigest())
        if old is not None:
            with _suppress_os_error():
                os.close(old.fd)

    def read(self, key: int, into: torch.Tensor) -> concurrent.futures.Future[None]:
        """Start reading the file of ``key`` into ``into`` (a CPU uint8 tensor of its size),
        which the caller keeps: the future's result is None (Note [The I/O thread lets go of a
        storage before it says it is done]).

        The future raises `SpillError` where the file is gone (the store was closed) or its
        bytes are not those written (Note [Spill files are checked when read back])."""
        if self._closed:
            raise SpillError(
                "lms: this LMS object was closed and its spill files with it; run backward "
                "before closing it (or leaving its with block)"
            )
        return self._pool.submit(self._run, "in", key, self._read, [into])

    def _read(self, key: int, into: torch.Tensor) -> None:
        with self._lock:
            record = self._files.get(key)
        if record is None:
            raise SpillError(
                f"lms: the spill file of saved tensor {key} in {self.root!r} is gone (the LMS "
                "object was closed, or its data released); run backward before closing it"
            )
        view = _bytes_view(into)
        done = 0
        while done < len(view):
            got = os.preadv(record.fd, [view[done:]], done)
            if not got:
                raise SpillError(
                    f"lms: the spill file of saved tensor {key} in {self.root!r} holds {done} of "
                    f"its {record.nbytes} bytes: something truncated it; keep other processes "
                    "off the spill_dir, or check its disk"
                )
            done += got
        digest = xxhash.xxh3_64_intdigest(view)
        if digest != record.digest:
            raise SpillError(
                f"lms: the spill file of saved tensor {key} ({format_bytes(record.nbytes)}) in "
                f"{self.root!r} changed between forward and backward (checksum {digest:016x}, "
                f"written {record.digest:016x}); its data was not used. Check the disk under "
                "the spill_dir, pass another spill_dir, or use tier='host'"
            )

    def delete(self, key: int, nbytes: int) -> None:
        """Close the file of ``key`` once the thread is done with it; the kernel frees it."""
        self.bytes_on_disk -= nbytes
        try:
            self._pool.submit(self._forget, key)
        except RuntimeError:  # the pool is shut down: close it here
            self._forget(key)

    def _forget(self, key: int) -> None:
        with self._lock:
            record = self._files.pop(key, None)
        if record is not None:
            with _suppress_os_error():
                os.close(record.fd)

    def close(self) -> None:
        """Wait for the I/O thread, then close every file left; nothing stays on disk."""
        self._closed = True
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._finalizer()
        self._bounce = None  # the mapping goes with its last view
        self.bytes_on_disk = 0


class _suppress_os_error:
    def __enter__(self) -> None:
        return None

    def __exit__(self, exc_type: object, exc: object, tb: object) -> bool:
        return isinstance(exc, OSError)
