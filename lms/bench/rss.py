"""Peak resident-set growth of this process over a block, sampled from /proc on a thread."""

from __future__ import annotations

import os
import resource
import threading
import time

__all__ = ["PeakRSS", "current_rss_bytes"]

_PAGE = os.sysconf("SC_PAGE_SIZE")


def current_rss_bytes() -> int:
    """This process's resident set now."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * _PAGE
    except OSError:  # not Linux: the lifetime peak is the best there is
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class PeakRSS:
    """``with PeakRSS() as peak: ...`` then ``peak.growth_bytes``: peak RSS minus RSS at entry."""

    def __init__(self, interval_s: float = 0.002):
        self.interval_s = interval_s
        self.start_bytes = 0
        self.peak_bytes = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak_bytes = max(self.peak_bytes, current_rss_bytes())
            time.sleep(self.interval_s)

    def __enter__(self) -> PeakRSS:
        self.start_bytes = self.peak_bytes = current_rss_bytes()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        assert self._thread is not None
        self._thread.join()
        self.peak_bytes = max(self.peak_bytes, current_rss_bytes())

    @property
    def growth_bytes(self) -> int:
        """Peak RSS over the block minus RSS at its start."""
        return self.peak_bytes - self.start_bytes
