"""Spill files: the one module that writes them.

A `SpillStore` owns a private folder under the spill directory and one background I/O thread.
Writes and reads run on that thread in submission order, so a read of a key always follows its
write. Files hold raw bytes and are deleted when their data is released; `close()` removes the
folder and whatever is still in it, also after an exception.

Note: [Spill folders of processes that were killed]
A process killed outright (SIGKILL, the kernel's out-of-memory killer, a timeout's kill) runs no
clean-up, and its spill folder would stay, gigabytes of it. Each folder's name says which
process made it, on which host and in which process-id namespace (a container has its own):
``lms-spill-<pid>@<host>.<namespace>-<random>``. Before a store makes its folder it removes the
folders under its spill directory whose process is gone from this host and namespace
(`remove_stale_folders`). A folder of a live process, of another host or namespace, or of a
process this one may not signal is left alone.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import errno
import logging
import os
import re
import shutil
import socket
import tempfile
import threading
import weakref

import torch

from lms.core.errors import SpillError
from lms.core.units import format_bytes

__all__ = ["SpillStore", "check_spill_dir", "remove_stale_folders"]

log = logging.getLogger("lms.runtime.disk")
_RESERVE_FREE_BYTES = 64 * 1024**2


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


def _folder_prefix() -> str:
    return f"lms-spill-{os.getpid()}@{_this_host()}-"


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


class SpillStore:
    """Raw-byte files for offloaded storages, written and read by one background thread."""

    def __init__(self, spill_dir: str | None):
        self.root = check_spill_dir(spill_dir)
        self._folder: str | None = None
        self._lock = threading.Lock()
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="lms-io")
        self._finalizer: weakref.finalize | None = None
        self.bytes_on_disk = 0
        self.peak_bytes_on_disk = 0

    def _path(self, key: int) -> str:
        with self._lock:
            if self._folder is None:
                remove_stale_folders(self.root)
                self._folder = tempfile.mkdtemp(prefix=_folder_prefix(), dir=self.root)
                # Runs at close(), at garbage collection or at interpreter exit, whichever is first.
                self._finalizer = weakref.finalize(self, _remove_tree, self._folder)
            return os.path.join(self._folder, f"{key}.bin")

    @property
    def folder(self) -> str | None:
        """The private folder holding this store's files, once the first file was written."""
        return self._folder

    def write(self, key: int, data: torch.Tensor) -> concurrent.futures.Future[None]:
        """Start writing ``data`` (a contiguous CPU uint8 tensor) to the file of ``key``.

        Raises:
            SpillError: at once when the disk has not room for it.
        """
        nbytes = data.numel()
        path = self._path(key)
        free = shutil.disk_usage(os.path.dirname(path)).free
        if free < nbytes + _RESERVE_FREE_BYTES:
            raise SpillError(
                f"lms: the spill folder {self.root!r} has {format_bytes(free)} free, too little "
                f"for {format_bytes(nbytes)} more of offloaded data "
                f"(already {format_bytes(self.bytes_on_disk)} on disk); "
                "pass a spill_dir with more room, raise the budget or lower the batch size"
            )
        self.bytes_on_disk += nbytes
        self.peak_bytes_on_disk = max(self.peak_bytes_on_disk, self.bytes_on_disk)
        return self._pool.submit(self._write, path, data)

    def _write(self, path: str, data: torch.Tensor) -> None:
        view = _bytes_view(data)
        try:
            with open(path, "wb", buffering=0) as handle:
                written = 0
                while written < len(view):
                    written += handle.write(view[written:])
        except OSError as exc:
            with _suppress_os_error():
                os.unlink(path)
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                raise SpillError(
                    f"lms: the disk of {self.root!r} filled up while writing "
                    f"{format_bytes(len(view))} of offloaded data; pass a spill_dir with more "
                    "room, raise the budget or lower the batch size"
                ) from exc
            raise SpillError(
                f"lms: writing a spill file in {self.root!r} failed ({exc}); check the spill_dir"
            ) from exc

    def read(self, key: int, into: torch.Tensor) -> concurrent.futures.Future[torch.Tensor]:
        """Start reading the file of ``key`` into ``into`` (a CPU uint8 tensor of its size)."""
        return self._pool.submit(self._read, self._path(key), into)

    @staticmethod
    def _read(path: str, into: torch.Tensor) -> torch.Tensor:
        view = _bytes_view(into)
        with open(path, "rb", buffering=0) as handle:
            done = 0
            while done < len(view):
                got = handle.readinto(view[done:])
                if not got:
                    raise SpillError(f"lms: spill file {path!r} is shorter than expected")
                done += got
        return into

    def delete(self, key: int, nbytes: int) -> None:
        """Delete the file of ``key`` once the thread is done with it."""
        self.bytes_on_disk -= nbytes
        path = self._path(key)
        try:
            self._pool.submit(_unlink_quietly, path)
        except RuntimeError:  # the pool is shut down: delete here
            _unlink_quietly(path)

    def close(self) -> None:
        """Wait for the I/O thread, then remove the folder and every file left in it."""
        self._pool.shutdown(wait=True, cancel_futures=True)
        if self._finalizer is not None:
            self._finalizer()
        self.bytes_on_disk = 0


def _unlink_quietly(path: str) -> None:
    with _suppress_os_error():
        os.unlink(path)


class _suppress_os_error:
    def __enter__(self) -> None:
        return None

    def __exit__(self, exc_type: object, exc: object, tb: object) -> bool:
        return isinstance(exc, OSError)
