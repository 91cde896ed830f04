"""A scan's progress over every rank of a job, for rank 0's progress callback."""

from __future__ import annotations

import threading
import time
from dataclasses import replace
from typing import Any

from plate_inspect.distributed import timing
from plate_inspect.distributed.store import BoundedStore
from plate_inspect.progress import ProgressCallback, ProgressEvent


class JobProgress:
    """A scan's progress over every rank of the job, for rank 0's ``progress`` callback (``ProgressEvent.job``).

    Each rank but 0 adds the modules (and bytes) it finished to two counters in the job's store: not waited for
    (:meth:`BoundedStore.post`, on the thread that makes its other store calls, so they arrive before it joins the
    gather), at most once per ``timing.PROGRESS_SECONDS`` and once at the end of its share. Rank 0 reads the counters
    from a thread of its own as often, and adds its own count: each of its events carries the job's tally, and
    when only the others moved the thread repeats rank 0's last event with the new tally (one call at a time).
    A rank that dies leaves the counters where they were (the Coordinator names it); every store call is bounded
    and rank 0's reads stop at the first that fails: a bar is not worth a hang."""

    def __init__(
        self,
        store: BoundedStore,
        shared: Any,
        keys: tuple[str, str],
        is_root: bool,
        progress: ProgressCallback | None,
        total: int,
        bytes_total: int,
    ) -> None:
        """``store``: the Coordinator's bounded store (posts); ``shared``: the job's raw store, which rank 0 clones for
        its reads; ``keys``: the job's counters of modules and bytes."""
        self._store, self._is_root, self._progress = store, is_root, progress
        self._total, self._bytes_total = total, bytes_total
        self._keys = keys
        self._posted, self._posted_at = (0, 0), 0.0  # (ranks > 0) modules and bytes added to the counters, when
        self._last: ProgressEvent | None = None  # (rank 0) its last event, repeated with the others' news
        self._others = (0, 0)  # (rank 0) the counters, as last read
        self._lock = threading.Lock()  # rank 0's callback gets one event at a time, in order
        self._stop = threading.Event()
        self._reads: BoundedStore | None = None
        self._reader: threading.Thread | None = None
        if is_root and progress is not None:
            self._reads = BoundedStore(shared, clone=True, timeout=min(5.0, timing.STORE_TIMEOUT_SECONDS))
            self._reader = threading.Thread(target=self._read_on, name="plate-job-progress", daemon=True)
            self._reader.start()

    def __call__(self, event: ProgressEvent) -> None:
        """One event of this rank's share: posted (ranks > 0), or sent on with the job's tally (rank 0)."""
        if not self._is_root:
            self._post(event)
            if self._progress is not None:
                self._progress(event)
            return
        with self._lock:
            self._last = event
            self._send()

    def finish(self) -> None:
        """Every rank has finished (and posted its count): rank 0 reads the counters once more, so that its last
        event counts the whole job."""
        self._stop.set()
        if self._reader is None:
            return
        self._reader.join(timeout=1)
        counts = self._read()
        with self._lock:
            if counts is not None and counts != self._others:
                self._others = counts
                self._send()
            self._last = None  # nothing is sent after this

    def close(self) -> None:
        """Stop rank 0's reads (without waiting for a store call that does not return)."""
        self._stop.set()
        with self._lock:
            self._last = None
        reads = self._reads
        if reads is not None:
            reads.close()

    def _post(self, event: ProgressEvent) -> None:
        modules, nbytes = event.done, event.bytes_done or 0
        moved = modules - self._posted[0], nbytes - self._posted[1]
        now = time.monotonic()
        if moved == (0, 0) or (now - self._posted_at < timing.PROGRESS_SECONDS and event.done != event.total):
            return
        keys = self._keys
        self._store.post(lambda store: (store.add(keys[0], moved[0]), store.add(keys[1], moved[1])))
        self._posted, self._posted_at = (modules, nbytes), now

    def _read(self) -> tuple[int, int] | None:
        """The other ranks' modules and bytes, or None once a read failed (not tried again)."""
        reads = self._reads
        if reads is None:
            return None
        try:
            return reads.add(self._keys[0], 0), reads.add(self._keys[1], 0)
        except RuntimeError:
            self._reads = None
            reads.close()
            return None

    def _read_on(self) -> None:
        """Rank 0's thread: the others' news, every ``timing.PROGRESS_SECONDS``, until stopped or a read failed (or the
        callback did: the main thread meets its error itself at its next event)."""
        while not self._stop.wait(timing.PROGRESS_SECONDS):
            counts = self._read()
            if counts is None:
                return
            with self._lock:
                if counts != self._others and self._last is not None and not self._stop.is_set():
                    self._others = counts
                    try:
                        self._send()
                    except Exception:
                        return

    def _send(self) -> None:
        """Rank 0's last event with the job's tally (under the lock)."""
        if self._last is None or self._progress is None:
            return
        own = self._last
        job = ProgressEvent(
            own.done + self._others[0],
            self._total,
            own.unit,
            own.label,
            (own.bytes_done or 0) + self._others[1],
            self._bytes_total,
        )
        self._progress(replace(own, job=job))
