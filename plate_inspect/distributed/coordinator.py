"""The process group as a scan uses it: rank 0's verdicts, gathers, failing fast when a rank fails or falls silent."""

from __future__ import annotations

import _thread
import contextlib
import itertools
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch

from plate_inspect.distributed import timing
from plate_inspect.distributed.job_progress import JobProgress
from plate_inspect.distributed.messages import RESUME, one_line
from plate_inspect.distributed.ranks import RankInfo
from plate_inspect.distributed.store import BoundedStore, lost_store_line
from plate_inspect.distributed.tracking import Fault, JobTrack
from plate_inspect.errors import BundleError, ConfigError, PlateInspectError
from plate_inspect.progress import ProgressCallback

T = TypeVar("T")


class Coordinator:
    """What a scan needs from a process group: the root's verdict for everyone, everyone's results at the root.

    With a ``store`` (the job's key-value store), a rank reaching a collective first waits there, polling, until
    every rank has arrived: a rank that failed (its error is posted by :func:`join`) or stopped giving heartbeats
    is named on every rank at once (:class:`~plate_inspect.errors.BundleError`), instead of the others waiting
    at the collective for as long as its timeout (gloo: hours for a stopped rank; a killed one ends the
    collective with gloo's traceback only). Without a store the collectives wait as gloo does.
    """

    def __init__(
        self,
        info: RankInfo,
        store: Any = None,
        prefix: str = "",
        stop_main: bool = False,
        track: JobTrack | None = None,
    ) -> None:
        self.info = info
        self.track = track if track is not None else JobTrack(RankInfo())  # (without one: posts nothing)
        self._stop_main = stop_main  # a lost store interrupts the main thread (the scan): see _heartbeat
        self._store = BoundedStore(store) if store is not None else None
        self._shared, self._prefix = store, prefix
        self._lost: str | None = None  # set by the heartbeat thread when the store stopped answering
        self._waiting = False  # the main thread waits in the store for the others (and finds a lost store itself)
        self._steps = itertools.count()
        self._failed: str | None = None  # the failure this rank has reported (so join does not report it again)
        self._verdict: BaseException | None = None  # rank 0's error, received by on_root (rank 0 says it)
        self._relay: tuple[BaseException, int] | None = None  # another rank's failure named here, and that rank
        self.agreed = False  # every rank planned the same scan (agree): an error after it is this rank's own
        self._stop = threading.Event()
        self._beats: threading.Thread | None = None
        if store is not None and info.world_size > 1:
            self._beats = threading.Thread(target=self._heartbeat, name="plate-heartbeat", daemon=True)
            self._beats.start()

    @property
    def rank(self) -> int:
        """This process's rank."""
        return self.info.rank

    @property
    def world_size(self) -> int:
        """The number of ranks in the job."""
        return self.info.world_size

    @property
    def is_root(self) -> bool:
        """Whether this is rank 0."""
        return self.info.is_root

    def on_root(self, fn: Callable[[], T]) -> T | None:
        """Run ``fn`` on rank 0 only; every rank returns its result or raises its error (no rank is left waiting)."""
        outcome: tuple[bool, Any] = (True, None)
        if self.is_root:
            try:
                outcome = (True, fn())
            except PlateInspectError as e:
                outcome = (False, e)
        if self.world_size > 1:
            box = [outcome]
            self._collective(lambda: torch.distributed.broadcast_object_list(box, src=0))
            outcome = box[0]
        ok, value = outcome
        if not ok:
            # rank 0's verdict on every rank, rank 0's own included: rank 0 says it as it is (say_once), the others
            # stay quiet (on rank 0 it passed for its own error in its share: "another scan is writing this bundle"
            # got "the part files finished so far are kept: rerun the same command to resume")
            self._verdict = value
            raise value
        return value

    def agree(self, value: dict[str, Any], what: str) -> None:
        """ConfigError on every rank unless every rank holds the same ``value`` (a dict; ``what`` names it).

        Ranks that planned different scans (another --r, --layers or model on one node) would otherwise each scan
        a share of their own plan and leave a bundle with holes, or silently scan with rank 0's settings.
        """
        if self.world_size == 1:
            return
        values = self.gather(value)

        def verdict() -> None:  # (on rank 0, which holds every rank's value)
            rows = values or []
            for rank, other in enumerate(rows):
                if other != rows[0]:
                    raise ConfigError(
                        f"ranks disagree on {what}: {_first_difference(rows[0], other, rank)}; start every rank "
                        "with the same command line and the same model files"
                    )

        self.on_root(verdict)
        self.agreed = True

    def gather(self, obj: T) -> list[T] | None:
        """Every rank's ``obj`` at rank 0 (in rank order); None elsewhere."""
        if self.world_size == 1:
            return [obj]
        out: list[Any] | None = [None] * self.world_size if self.is_root else None
        self._collective(lambda: torch.distributed.gather_object(obj, out, dst=0))
        return out

    @contextlib.contextmanager
    def job_progress(
        self, progress: ProgressCallback | None, total: int, bytes_total: int
    ) -> Iterator[ProgressCallback | None]:
        """The ``progress`` callback for this rank's share of a scan of ``total`` modules (``bytes_total`` bytes):
        on rank 0 its events also carry the whole job's progress (:class:`JobProgress`), which every other rank
        posts. Leave the block once every rank has finished (after the gather): rank 0 then sends the job's last
        event. Without a store, or alone, ``progress`` itself."""
        if self._store is None or self.world_size == 1:
            yield progress
            return
        keys = (self._key("progress", "modules"), self._key("progress", "bytes"))
        share = JobProgress(self._store, self._shared, keys, self.is_root, progress, total, bytes_total)
        try:
            yield share if not self.is_root or progress is not None else None
            share.finish()
        finally:
            share.close()

    # ----------------------------------------------------------------------- failing fast
    def report_failure(self, error: BaseException) -> None:
        """Post this rank's error to the store, for the ranks waiting for it (best effort: never raises)."""
        if self._store is None or self.world_size == 1 or self._failed is not None:
            return
        what = "interrupted" if isinstance(error, KeyboardInterrupt) else one_line(error)
        self._post_failure(self.rank, f"rank {self.rank} failed: {what}; {RESUME}")

    @property
    def store_lost(self) -> str | None:
        """The one-line message for a store that stopped answering while this rank scanned (None: it answers)."""
        return self._lost

    def close(self) -> None:
        """Stop the heartbeat thread (without waiting for a store call that does not return)."""
        self._stop.set()
        if self._beats is not None:
            self._beats.join(timeout=1)
        if self._store is not None:
            self._store.close()

    def _key(self, *parts: object) -> str:
        return self._prefix + "/".join(map(str, parts))

    def _heartbeat(self) -> None:
        """Bump this rank's counter until closed (its own store connection where the store can clone one).

        A store that fails or does not answer within ``timing.STORE_TIMEOUT_SECONDS`` (its host is down or unreachable)
        stops this rank's scan (``stop_main``, as :func:`join` asks): the main thread gets a KeyboardInterrupt,
        which :func:`join` turns into the :attr:`store_lost` message; without it a rank scanned its whole share, then
        waited for the store forever."""
        store = BoundedStore(self._shared, clone=True)
        key = self._key("alive", self.rank)
        try:
            while not self._stop.is_set():
                try:
                    beats = store.add(key, 1)
                    if self._stop_main:  # (join's): rank 0 also beats in the agent store, for say_once
                        self.track.tell("beat", beats)
                except RuntimeError as e:
                    if not self._stop.is_set():
                        self._lost = lost_store_line(e)
                        if self._stop_main and not self._waiting:  # (a waiting main thread raises it itself)
                            _thread.interrupt_main()
                    return
                if self._stop.wait(timing.HEARTBEAT_SECONDS):
                    return
        finally:
            store.close()

    def _post_failure(self, rank: int, message: str) -> None:
        self._failed = message
        if self._store is None:
            return
        with contextlib.suppress(Exception):
            self._store.set(self._key("failed", rank), message)
            self._store.add(self._key("failures"), 1)

    def _collective(self, run: Callable[[], None]) -> None:
        """Wait until every rank has arrived (failing fast, see the class), then run the collective ``run``."""
        self.track.passed()
        self._arrive()
        try:
            run()
        except RuntimeError as e:  # gloo: a peer's connection closed (it died) during the collective
            raise BundleError(f"lost contact with another rank during the scan ({one_line(e)}); {RESUME}") from None

    def _arrive(self) -> None:
        store = self._store
        if store is None:
            return
        arrived = self._key("arrived", next(self._steps))
        watched = range(self.world_size) if self.is_root else [0]  # rank 0 watches everyone, the others rank 0
        seen: dict[int, tuple[int, float]] = {}
        pause = 0.002  # doubling up to timing.POLL_SECONDS: ranks that arrive together pass in milliseconds
        self._waiting = True
        try:
            store.add(arrived, 1)
            while store.add(arrived, 0) < self.world_size:
                if store.add(self._key("failures"), 0) > 0:
                    failed, message = self._first_failure(store)
                    error = BundleError(message)
                    self._relay = (error, failed)
                    raise error
                now = time.monotonic()
                for rank in watched:
                    beats = store.add(self._key("alive", rank), 0)
                    if rank not in seen or seen[rank][0] != beats:
                        seen[rank] = (beats, now)
                    elif now - seen[rank][1] > timing.SILENCE_LIMIT_SECONDS and rank != self.rank:
                        message = (
                            f"rank {rank} has given no sign of life for {timing.SILENCE_LIMIT_SECONDS:.0f} s (killed, "
                            f"stopped, or its node is down): stop the job; {RESUME}"
                        )
                        self._post_failure(rank, message)
                        error = BundleError(message)
                        self._relay = (error, rank)
                        raise error
                time.sleep(pause)
                pause = min(2 * pause, timing.POLL_SECONDS)
        except PlateInspectError:
            self._failed = self._failed or "reported"
            raise
        except RuntimeError as e:  # the store is gone (DistNetworkError, a RuntimeError) or does not answer
            self._failed = "store lost"
            self._lost = self._lost or lost_store_line(e)
            raise BundleError(self._lost) from None
        finally:
            self._waiting = False

    def _first_failure(self, store: BoundedStore) -> tuple[int, str]:
        """The lowest failed rank and its message."""
        for rank in range(self.world_size):
            key = self._key("failed", rank)
            if store.check([key]):
                return rank, store.get(key).decode(errors="replace")
        return -1, f"another rank failed; {RESUME}"

    def fault(self, error: BaseException) -> Fault:
        """What ``error``, raised on this rank while it scanned, is for the job's one line (:func:`say_once`)."""
        stage, scan = self.track.stage, self.track.scan
        if error is self._verdict:
            return Fault("verdict", 0, stage=stage, scan=scan)
        if self._relay is not None and error is self._relay[0]:
            return Fault("relay", self._relay[1], stage=stage, scan=scan)
        if not isinstance(error, Exception):
            return Fault("interrupted", self.rank, stage=stage, scan=scan)
        return Fault("own", self.rank, after_agreement=self.agreed, stage=stage, scan=scan)


def _first_difference(root: dict[str, Any], other: dict[str, Any], rank: int) -> str:
    """The first key whose value differs between rank 0's dict and rank ``rank``'s, both values shown (shortened)."""
    for key in sorted(set(root) | set(other)):
        a, b = root.get(key), other.get(key)
        if a != b:
            if isinstance(a, dict) and isinstance(b, dict):
                sub = [k for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)][0]
                key, a, b = f"{key}.{sub}", a.get(sub), b.get(sub)
            return f"{key} is {_short(a)} on rank 0 but {_short(b)} on rank {rank}"
    return f"rank {rank} differs from rank 0"


def _short(value: Any, limit: int = 120) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
