"""Scans on many processes: torchrun ranks on many machines, or one spawned worker per device on one machine.

Every rank plans the same scan, takes a deterministic, cost-balanced share of the part files
(:func:`assign_parts`), and writes its own parts into the shared output directory; rank 0 prepares the directory
before anyone writes and writes the manifest after everyone is done. Only small Python objects (a verdict, the
module records, run statistics) cross ranks, over a gloo process group: no tensor is ever communicated, so the
bundle's bytes are those of a single-process scan with the same threads per process.
"""

from __future__ import annotations

import _thread
import contextlib
import datetime
import hashlib
import heapq
import itertools
import math
import multiprocessing
import os
import queue as queue_mod
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from plate_inspect.errors import BundleError, ConfigError, PlateInspectError
from plate_inspect.progress import ProgressCallback, ProgressCounter, ProgressEvent

if TYPE_CHECKING:
    from plate_inspect.bundle import Bundle
    from plate_inspect.scanner import ScanPlan

T = TypeVar("T")
#: How long a rank waits for the others at a collective (a rank may finish its share long before the slowest).
COLLECTIVE_TIMEOUT = datetime.timedelta(hours=24)
#: Relative cost of an eigensolve of the s x s Gram matrix per s^3, against forming it (s^2 * l multiply-adds).
EIGENSOLVE_WEIGHT = 2.0
#: Every rank bumps its counter in the job's store this often, from a thread, while it takes part in a scan.
HEARTBEAT_SECONDS = 2.0
#: A rank whose counter has not moved for this long while others wait for it is taken as dead or stopped.
SILENCE_LIMIT_SECONDS = 30.0
#: A rank still waiting for the others to join the process group after this long says so on stderr (and again).
JOIN_NOTE_SECONDS = 60.0
#: How often a waiting rank looks at the store (arrivals, failures, heartbeats).
POLL_SECONDS = 0.25
#: Target tensors whose stored bytes every rank samples for the plan's identity (more are subsampled evenly).
WEIGHT_SAMPLES = 1024
#: Bytes sampled from the middle of each of them.
SAMPLE_BYTES = 4096
#: Every call to the job's store returns within this many seconds, or the store's host is taken as gone. TCPStore's
#: own timeout does not bound a call whose server stopped answering (a powered-off or unreachable host: the socket
#: stays open, the client waits for a reply forever), so each call runs on a thread of its own that is waited for.
STORE_TIMEOUT_SECONDS = 30.0
#: At most this long a rank other than 0 waits for rank 0's error line, to stay quiet when it is the same
#: (:func:`say_once`); it stops waiting as soon as rank 0 has got past the point where this rank failed.
SAID_WAIT_SECONDS = 10.0
#: How long a rank that stays quiet lets rank 0 exit first.
QUIET_EXIT_SECONDS = 1.0
#: Least time between two posts of a rank's finished modules to the job's store, and between two reads of them on
#: rank 0 (:class:`JobProgress`): a bar needs no more.
PROGRESS_SECONDS = 0.5
_THREAD_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")


@dataclass(frozen=True)
class RankInfo:
    """This process's place in a distributed job, from torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK; its
    node: GROUP_RANK of GROUP_WORLD_SIZE nodes, LOCAL_WORLD_SIZE ranks on it)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    node: int = 0
    nodes: int = 1

    @property
    def is_root(self) -> bool:
        return self.rank == 0


def rank_from_env() -> RankInfo:
    """The job this process belongs to; a single process when WORLD_SIZE is unset or 1."""
    if os.environ.get("RANK", "0").strip() != "0" and "WORLD_SIZE" not in os.environ:
        raise ConfigError(
            f"RANK={os.environ['RANK']} is set but WORLD_SIZE is not (torchrun sets both): unset RANK for a "
            "single-process scan, or launch distributed scans with torchrun"
        )
    try:
        world = int(os.environ.get("WORLD_SIZE", "1"))
        rank = int(os.environ.get("RANK", "0"))
        local = int(os.environ.get("LOCAL_RANK", str(rank)))
    except ValueError:
        raise ConfigError("RANK, WORLD_SIZE and LOCAL_RANK must be integers (as torchrun sets them)") from None
    env = os.environ.get
    try:  # its node (default: one node holding every rank); only for saying where a problem is, so never an error
        place = (
            int(env("LOCAL_WORLD_SIZE", str(world))),
            int(env("GROUP_RANK", "0")),
            int(env("GROUP_WORLD_SIZE", "1")),
        )
    except ValueError:
        place = (world, 0, 1)
    if world < 1 or not 0 <= rank < world:
        raise ConfigError(f"RANK={rank} is not a rank of WORLD_SIZE={world}")
    missing = [var for var in ("MASTER_ADDR", "MASTER_PORT") if world > 1 and var not in os.environ]
    if missing:
        raise ConfigError(
            f"WORLD_SIZE={world} but {' and '.join(missing)} {'is' if len(missing) == 1 else 'are'} unset: launch "
            "distributed scans with torchrun (or unset WORLD_SIZE and RANK for a single-process scan)"
        )
    return RankInfo(rank, world, local, *place)


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
    ):
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
        return self.info.rank

    @property
    def world_size(self) -> int:
        return self.info.world_size

    @property
    def is_root(self) -> bool:
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
            if not self.is_root:
                self._verdict = value  # rank 0 failed with it and says it (say_once): this rank stays quiet
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

        def verdict() -> None:
            for rank, other in enumerate(values or []):
                if other != values[0]:
                    raise ConfigError(
                        f"ranks disagree on {what}: {_first_difference(values[0], other, rank)}; start every rank "
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
        share = JobProgress(self, progress, total, bytes_total)
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
        what = "interrupted" if isinstance(error, KeyboardInterrupt) else _one_line(error)
        self._post_failure(self.rank, f"rank {self.rank} failed: {what}; {_RESUME}")

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

        A store that fails or does not answer within :data:`STORE_TIMEOUT_SECONDS` (its host is down or unreachable)
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
                        self._lost = _store_lost(e)
                        if self._stop_main and not self._waiting:  # (a waiting main thread raises it itself)
                            _thread.interrupt_main()
                    return
                if self._stop.wait(HEARTBEAT_SECONDS):
                    return
        finally:
            store.close()

    def _post_failure(self, rank: int, message: str) -> None:
        self._failed = message
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
            raise BundleError(f"lost contact with another rank during the scan ({_one_line(e)}); {_RESUME}") from None

    def _arrive(self) -> None:
        if self._store is None:
            return
        arrived = self._key("arrived", next(self._steps))
        watched = range(self.world_size) if self.is_root else [0]  # rank 0 watches everyone, the others rank 0
        seen: dict[int, tuple[int, float]] = {}
        pause = 0.002  # doubling up to POLL_SECONDS: ranks that arrive together pass in milliseconds
        self._waiting = True
        try:
            self._store.add(arrived, 1)
            while self._store.add(arrived, 0) < self.world_size:
                if self._store.add(self._key("failures"), 0) > 0:
                    failed, message = self._first_failure()
                    error = BundleError(message)
                    self._relay = (error, failed)
                    raise error
                now = time.monotonic()
                for rank in watched:
                    beats = self._store.add(self._key("alive", rank), 0)
                    if rank not in seen or seen[rank][0] != beats:
                        seen[rank] = (beats, now)
                    elif now - seen[rank][1] > SILENCE_LIMIT_SECONDS and rank != self.rank:
                        message = (
                            f"rank {rank} has given no sign of life for {SILENCE_LIMIT_SECONDS:.0f} s (killed, "
                            f"stopped, or its node is down): stop the job; {_RESUME}"
                        )
                        self._post_failure(rank, message)
                        error = BundleError(message)
                        self._relay = (error, rank)
                        raise error
                time.sleep(pause)
                pause = min(2 * pause, POLL_SECONDS)
        except PlateInspectError:
            self._failed = self._failed or "reported"
            raise
        except RuntimeError as e:  # the store is gone (DistNetworkError, a RuntimeError) or does not answer
            self._failed = "store lost"
            self._lost = self._lost or _store_lost(e)
            raise BundleError(self._lost) from None
        finally:
            self._waiting = False

    def _first_failure(self) -> tuple[int, str]:
        """The lowest failed rank and its message."""
        for rank in range(self.world_size):
            key = self._key("failed", rank)
            if self._store.check([key]):
                return rank, self._store.get(key).decode(errors="replace")
        return -1, f"another rank failed; {_RESUME}"

    def fault(self, error: BaseException) -> Fault:
        """What ``error``, raised on this rank while it scanned, is for the job's one line (:func:`say_once`)."""
        where = {"stage": self.track.stage, "scan": self.track.scan}
        if error is self._verdict:
            return Fault("verdict", 0, **where)
        if self._relay is not None and error is self._relay[0]:
            return Fault("relay", self._relay[1], **where)
        if not isinstance(error, Exception):
            return Fault("interrupted", self.rank, **where)
        return Fault("own", self.rank, after_agreement=self.agreed, **where)


class JobProgress:
    """A scan's progress over every rank of the job, for rank 0's ``progress`` callback (``ProgressEvent.job``).

    Each rank but 0 adds the modules (and bytes) it finished to two counters in the job's store: not waited for
    (:meth:`BoundedStore.post`, on the thread that makes its other store calls, so they arrive before it joins the
    gather), at most once per :data:`PROGRESS_SECONDS` and once at the end of its share. Rank 0 reads the counters
    from a thread of its own as often, and adds its own count: each of its events carries the job's tally, and
    when only the others moved the thread repeats rank 0's last event with the new tally (one call at a time).
    A rank that dies leaves the counters where they were (the Coordinator names it); every store call is bounded
    and rank 0's reads stop at the first that fails: a bar is not worth a hang."""

    def __init__(self, group: Coordinator, progress: ProgressCallback | None, total: int, bytes_total: int):
        self._group, self._progress = group, progress
        self._total, self._bytes_total = total, bytes_total
        self._keys = (group._key("progress", "modules"), group._key("progress", "bytes"))
        self._posted, self._posted_at = (0, 0), 0.0  # (ranks > 0) modules and bytes added to the counters, when
        self._last: ProgressEvent | None = None  # (rank 0) its last event, repeated with the others' news
        self._others = (0, 0)  # (rank 0) the counters, as last read
        self._lock = threading.Lock()  # rank 0's callback gets one event at a time, in order
        self._stop = threading.Event()
        self._reads: BoundedStore | None = None
        self._reader: threading.Thread | None = None
        if group.is_root and progress is not None:
            self._reads = BoundedStore(group._shared, clone=True, timeout=min(5.0, STORE_TIMEOUT_SECONDS))
            self._reader = threading.Thread(target=self._read_on, name="plate-job-progress", daemon=True)
            self._reader.start()

    def __call__(self, event: ProgressEvent) -> None:
        """One event of this rank's share: posted (ranks > 0), or sent on with the job's tally (rank 0)."""
        if not self._group.is_root:
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
        if moved == (0, 0) or (now - self._posted_at < PROGRESS_SECONDS and event.done != event.total):
            return
        keys = self._keys
        self._group._store.post(lambda store: (store.add(keys[0], moved[0]), store.add(keys[1], moved[1])))
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
        """Rank 0's thread: the others' news, every :data:`PROGRESS_SECONDS`, until stopped or a read failed (or the
        callback did: the main thread meets its error itself at its next event)."""
        while not self._stop.wait(PROGRESS_SECONDS):
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


#: What a connection to a store that ended raises (torch's network and store errors, RuntimeErrors).
_STORE_ERRORS = tuple(
    getattr(torch.distributed, name)
    for name in ("DistNetworkError", "DistStoreError")
    if hasattr(torch.distributed, name)
) or (RuntimeError,)

_RESUME = "the part files finished so far are kept: rerun the same command to resume (with any number of ranks)"


class StoreTimeout(RuntimeError):
    """A call to the job's store got no answer within :data:`STORE_TIMEOUT_SECONDS`."""


class BoundedStore:
    """A key-value store (TCPStore) whose every call returns within ``timeout`` seconds (default
    :data:`STORE_TIMEOUT_SECONDS`) or raises :class:`StoreTimeout`; once one has timed out, every later call raises
    at once.

    The calls run in order on a daemon thread of this object's own (with ``clone``, over a connection of its own,
    opened there too); a call that never returns leaves that thread blocked, not the caller. ``store`` may also be
    a function that opens the store (on that thread, so that connecting is bounded as well)."""

    def __init__(self, store: Any, clone: bool = False, timeout: float | None = None):
        self._timeout = timeout  # None: STORE_TIMEOUT_SECONDS (read at each call)
        self._calls: queue_mod.SimpleQueue = queue_mod.SimpleQueue()
        self._timed_out: str | None = None
        self._thread = threading.Thread(target=self._serve, args=(store, clone), name="plate-store", daemon=True)
        self._thread.start()

    def _serve(self, store: Any, clone: bool) -> None:
        opened: tuple[bool, Any] = (True, store)
        try:
            if callable(store) and not hasattr(store, "add"):
                opened = (True, store())
            elif clone:
                with contextlib.suppress(Exception):
                    opened = (True, store.clone())
        except BaseException as e:  # a store that cannot be opened: every call raises its error
            opened = (False, e)
        while True:
            item = self._calls.get()
            if item is None:
                return
            fn, box, done = item
            if not opened[0]:
                box.append(opened)
            else:
                try:
                    box.append((True, fn(opened[1])))
                except BaseException as e:
                    box.append((False, e))
            done.set()

    def call(self, fn: Callable[[Any], T]) -> T:
        """``fn(store)`` on the store's thread, waited for at most :data:`STORE_TIMEOUT_SECONDS`."""
        if self._timed_out is not None:
            raise StoreTimeout(self._timed_out)
        box: list[tuple[bool, Any]] = []
        done = threading.Event()
        self._calls.put((fn, box, done))
        timeout = STORE_TIMEOUT_SECONDS if self._timeout is None else self._timeout
        if not done.wait(timeout):
            self._timed_out = f"no answer for {timeout:.0f} s"
            raise StoreTimeout(self._timed_out)
        ok, value = box[0]
        if not ok:
            raise value
        return value

    def post(self, fn: Callable[[Any], Any]) -> None:
        """``fn(store)`` on the store's thread, not waited for (its result or error is dropped)."""
        if self._timed_out is None:
            self._calls.put((fn, [], threading.Event()))

    def add(self, key: str, amount: int) -> int:
        return self.call(lambda s: s.add(key, amount))

    def set(self, key: str, value: str) -> None:
        self.call(lambda s: s.set(key, value))

    def get(self, key: str) -> bytes:
        return self.call(lambda s: s.get(key))

    def check(self, keys: list[str]) -> bool:
        return self.call(lambda s: s.check(keys))

    def close(self) -> None:
        """End the store's thread once the calls before have returned (at once if none is pending)."""
        self._calls.put(None)


def _store_address() -> str:
    return f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"


#: The addresses (host:port) of job stores this process found gone: :func:`say_once` does not wait on them again.
_LOST_STORES: set[str] = set()


def _store_lost(error: BaseException) -> str:
    """The one line for a job whose store (on the first node) failed or stopped answering (and notes it as gone)."""
    _LOST_STORES.add(_store_address())
    what = (
        f"has not answered for {STORE_TIMEOUT_SECONDS:.0f} s"
        if isinstance(error, StoreTimeout)
        else f"is gone ({_one_line(error)})"
    )
    return (
        f"lost contact with the job's store at {_store_address()}: it {what}; the first node (torchrun's agent or "
        f"rank 0 there) is down, stopped or unreachable: stop the job; {_RESUME}"
    )


@dataclass(frozen=True)
class Fault:
    """What an error raised on a rank during a scan is to the job's one line (:func:`say_once`): rank 0's verdict
    that every rank received (``verdict``: rank 0 says it), another rank's failure named here (``relay``: ``rank``
    is that rank, which says it itself), this rank's own (``own``; ``after_agreement``: raised once every rank had
    planned the same scan, so about this rank's share of it, which no other rank repeats), a Ctrl-C or SIGTERM
    (``interrupted``), or the job's store gone while this rank waited to join (``node``: every rank of its node met
    it, and the first says it for them). ``stage`` and ``scan``: where it happened (:class:`JobTrack`); an error
    without a Fault belongs to the scan that ended with an error just before, or else to the next (stage 0)."""

    kind: str
    rank: int
    after_agreement: bool = False
    stage: int = 0
    scan: int = 0


#: The attribute :func:`join` sets on an error it lets through: what it is to the job's one line (:class:`Fault`).
FAULT_ATTRIBUTE = "plate_fault"


@dataclass
class _RunScans:
    """The scans of several ranks this process joined in one torchrun run: how many (every rank of a job joins the
    same scans in the same order, so each scan's keys in the job's stores are its own), and the last one if it ended
    with an error (an error raised outside it, such as a second Ctrl-C, belongs to it). Only an index: each scan's
    own state is its :class:`JobTrack`."""

    joined: int = 0
    failed: int | None = None


#: Each torchrun run's (TORCHELASTIC_RUN_ID and restart; "" without one) scans in this process.
_RUNS: dict[str, _RunScans] = {}


def _run() -> str:
    """This torchrun run (and restart): the agent store outlives a run's scans, and a restart's workers are new."""
    return f"{os.environ.get('TORCHELASTIC_RUN_ID', '')}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"


def _job_key(what: str, scan: int, *parts: object) -> str:
    """A key of scan ``scan`` of this torchrun run in the agent store."""
    return "/".join(["plate-inspect", what, _run(), str(scan), *map(str, parts)])


@dataclass
class JobTrack:
    """One scan of a torchrun job, as this rank goes through it: which scan of this run's processes it is (its keys
    in torchrun's agent store), how many of the points that every rank passes in the same order it got past
    (entering :func:`join`, each collective: its ``stage``), and its client of the agent store, where it posts
    them (not waited for) so that a rank that failed before one of them learns who got past it (:func:`say_once`).

    Owned by one scan (its :class:`Coordinator`; :func:`join` closes it): two scans in one process (tests, Python
    callers) never see each other's stage."""

    info: RankInfo
    scan: int = 0
    stage: int = 0
    _store: BoundedStore | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.info.world_size > 1:
            self._store = _agent_store(STORE_TIMEOUT_SECONDS)

    def key(self, what: str, *parts: object) -> str:
        return _job_key(what, self.scan, *parts)

    def passed(self) -> None:
        """This rank got past one more point: counted in the job's and its node's tally of ranks that reached it."""
        self.stage += 1
        keys = (self.key("reached", self.stage), self.key("reached", self.stage, "node", self.info.node))
        self._post(lambda store: [store.add(key, 1) for key in keys])

    def tell(self, what: str, value: int) -> None:
        """On rank 0: post ``what`` = ``value`` (its heartbeat, ``beat``), for the ranks that wait for its line."""
        if self.info.is_root:
            key, text = self.key(what, 0), str(value)
            self._post(lambda store: store.set(key, text))

    def close(self) -> None:
        """Close the client once the posts made so far are sent (without waiting for them)."""
        if self._store is not None:
            self._store.close()

    def _post(self, fn: Callable[[Any], Any]) -> None:
        if self._store is not None:
            self._store.post(fn)


def _record_fault(error: BaseException, group: Coordinator) -> None:
    """Note on ``error`` what it is (its :data:`FAULT_ATTRIBUTE`, read by :func:`say_once`); for a rank's own error,
    claim saying it in the agent store, so that a rank that names this failure (``rank N failed: ...``) stays
    quiet."""
    if group.world_size == 1:
        return
    fault = group.fault(error)
    with contextlib.suppress(AttributeError, TypeError):  # (an exception type without attributes: an own error)
        setattr(error, FAULT_ATTRIBUTE, fault)
    if fault.kind == "own":
        _claim(_job_key("claim", fault.scan, fault.rank))


def _claim(key: str, store: BoundedStore | None = None) -> bool:
    """Take the right to say what ``key`` names (True for the first to ask, and when there is no agent store to
    ask)."""
    own = store is None
    store = store or _agent_store(SAID_WAIT_SECONDS)
    if store is None:
        return True
    try:
        return store.add(key, 1) == 1
    except RuntimeError:
        return True
    finally:
        if own:
            store.close()


def _quietly(seconds: float) -> None:
    """Sleep (a Ctrl-C ends the sleep, not with a traceback: the process is exiting anyway)."""
    with contextlib.suppress(KeyboardInterrupt):
        time.sleep(seconds)


def say_once(
    line: str, say: Callable[[str], None], error: BaseException | None = None, info: RankInfo | None = None
) -> None:
    """Print a user error (or, for a KeyboardInterrupt ``error``, the interrupted line) once per job, not once per
    rank: ``say(line)`` for a problem of every rank (and in a single process); a problem of some ranks only is said
    once per node, naming them (``ranks 8-15 on node 1 (host): line``; ``rank 1: line`` in a job on one node).
    ``info``: this rank (default: from the environment).

    Every rank of a torchrun job runs the same command line on its node's files and mostly fails the same way (a
    bad --out, a missing model, a setting out of range, a verdict all ranks share), and a Ctrl-C or a scheduler's
    SIGTERM reaches every rank: N ranks printed N identical lines. Ranks learn about each other from torchrun's
    agent store (it exists from the start, so also for errors before the process group does), never waiting
    longer than :data:`SAID_WAIT_SECONDS`:

    - rank 0's verdict, received by every rank (:meth:`Coordinator.on_root`): only rank 0 says it, at once;
    - a rank's error in its share of the scan: it says it at once, with how to resume (and its rank, but rank 0's);
      a rank that names its failure (``rank N failed: ...``) is quiet (the failing rank claims the line first);
    - an error before the ranks agreed on the plan (a bad option, a model missing on one node): the first rank of
      each node to claim the line waits until every rank had it (then one rank says it as it is) or until a rank got
      past the point where this one failed (:class:`JobTrack`) and the ranks of its node have each failed or got
      past it: then it says the line once for its node, naming the ranks there that had it
      (:func:`_say_for_the_ranks`);
    - interrupted (a Ctrl-C, or torchrun's SIGTERM to every rank when one failed): rank 0 says it; another rank
      only if rank 0 has said nothing within the wait, and then only the first to claim it, so a rank 0 that gets
      to it late (inside a long C++ operation when the signal came) stays quiet; no rank says it once a rank said a
      line of its own (its error says how to resume; torchrun stops the others).

    A rank without an agent store (a job started without torchrun, or its store gone) says its line with its rank.
    A rank that says a line posts it after printing, so that no rank falls quiet (and exits) before it spoke."""
    if info is None:
        try:
            info = rank_from_env()
        except ConfigError:  # the job's variables themselves are wrong: every process says so
            info = RankInfo()
    if info.world_size == 1:
        say(line)
        return
    fault = getattr(error, FAULT_ATTRIBUTE, None)
    if not isinstance(fault, Fault):  # raised outside a scan (_scan_now says which one it belongs to)
        fault = Fault("interrupted" if isinstance(error, KeyboardInterrupt) else "own", info.rank, scan=_scan_now())
    if fault.kind == "node":  # every rank of this node met it (the store is gone): its first rank says it for them
        if info.local_rank == 0:
            first = info.rank - info.local_rank
            say(f"{_where(range(first, first + info.local_world_size), info)}: {line}")
        return
    store = _agent_store(SAID_WAIT_SECONDS)
    if store is None:
        say(line if info.is_root else f"rank {info.rank}: {line}")
        return
    try:
        if isinstance(error, KeyboardInterrupt):
            _say_interrupted(line, say, info, store, fault.scan)
        elif fault.kind == "verdict" or fault.kind == "relay" or fault.after_agreement:
            _say_as_fault(line, say, info, store, fault)
        else:
            _say_for_the_ranks(line, say, info, store, fault)
    finally:
        store.close()


def _scan_now() -> int:
    """The scan of this run that an error raised outside any scan belongs to: the last one this process joined if
    that ended with an error, else the next one."""
    scans = _RUNS.get(_run(), _RunScans())
    return scans.joined if scans.failed is None else scans.failed


def _said(store: BoundedStore, scan: int, line: str | None) -> None:
    """After this rank printed a line of its own (not the interrupted one): no rank adds an interrupted line; with
    ``line`` (the job's line, unprefixed), the ranks waiting for rank 0's line have it."""
    with contextlib.suppress(RuntimeError):
        store.add(_job_key("spoken", scan, 0), 1)
        if line is not None:
            store.set(_job_key("said", scan, 0), line)


def _say_as_fault(line: str, say: Callable[[str], None], info: RankInfo, store: BoundedStore, fault: Fault) -> None:
    """A verdict of rank 0 (rank 0 says it), a relay of another rank's failure (the first to claim it says it), or
    this rank's own error in its share (said at once, with how to resume and its rank but rank 0's)."""
    mine: str | None = line
    if fault.kind == "verdict":
        mine = line if info.is_root else None
    elif fault.kind == "relay":
        mine = line if _claim(_job_key("claim", fault.scan, fault.rank), store) else None
        if mine is None and info.is_root:
            return  # the failed rank said it itself
    else:
        mine = line if _RESUME in line else f"{line}; {_RESUME}"
        mine = mine if info.is_root else f"rank {info.rank}: {mine}"
    if mine is None:
        _quietly(QUIET_EXIT_SECONDS)  # the rank that says it exits first, so that torchrun's report names it
        return
    say(mine)
    _said(store, fault.scan, mine if info.is_root else None)


def _say_for_the_ranks(
    line: str, say: Callable[[str], None], info: RankInfo, store: BoundedStore, fault: Fault
) -> None:
    """An error before the ranks agreed on the plan: one line for the job when every rank had it, else one per node.

    The line's ranks are tallied in the agent store, for the job and for each node, with the point where they failed
    (``fell``), beside :meth:`JobTrack.passed`'s tallies of the ranks that reached each point. The first rank of a
    node to claim the line waits until every rank had it (then the first such rank of the job to claim it says it
    as it is: a bad option, a model missing everywhere), or until a rank got past where this one failed (or every
    rank failed or got past it, not all with this line) and every rank of this node failed or got past it: then it
    says the line naming the ranks of this node that had it, and the node's name when the job has several (a model
    or --out missing on one node: the line says so, also on rank 0's node). At :data:`SAID_WAIT_SECONDS` it says
    what it knows by then; a second signal ends the wait the same way. The other ranks of the node wait until it has
    spoken, then exit after it."""

    def key(what: str, *parts: object) -> str:
        return _job_key(what, fault.scan, *parts)

    digest, stage, node = _digest(line), fault.stage, ("node", info.node)
    said = key("said", digest, *node)
    spoken = False
    try:
        store.set(key("who", digest, *node, store.add(key("same", digest, *node), 1) - 1), str(info.rank))
        store.add(key("same", digest), 1)
        store.add(key("fell", stage), 1)
        store.add(key("fell", stage, *node), 1)
        if not _claim(key("speak", digest, *node), store):  # another rank of this node says it
            _wait_for(store, said, 2 * SAID_WAIT_SECONDS)
            _quietly(QUIET_EXIT_SECONDS)
            return
        everyone = _wait_for_the_ranks(store, key, info, stage, digest)
        if everyone:
            text = line if _claim(key("speak", digest), store) else None
        else:
            count = store.add(key("same", digest, *node), 0)
            ranks = sorted(
                int(store.get(k)) for k in (key("who", digest, *node, i) for i in range(count)) if store.check([k])
            )
            text = f"{_where(ranks or [info.rank], info)}: {line}"
        if text is not None:
            say(text)
            spoken = True
            _said(store, fault.scan, text if everyone else None)
        store.set(said, "1")
        if text is None:
            _quietly(QUIET_EXIT_SECONDS)
    except RuntimeError:  # the store failed or stopped answering: say it with this rank
        if not spoken:
            say(line if info.is_root else f"rank {info.rank}: {line}")


def _wait_for_the_ranks(store: BoundedStore, key: Callable[..., str], info: RankInfo, stage: int, digest: str) -> bool:
    """Whether every rank failed with the line ``digest`` (True), or not: a rank got past ``stage`` or every rank
    failed or got past it, and so did every rank of this node (False; also at :data:`SAID_WAIT_SECONDS`, or when a
    signal ends the wait)."""
    node = ("node", info.node)
    deadline = time.monotonic() + SAID_WAIT_SECONDS
    try:
        while True:
            if store.add(key("same", digest), 0) >= info.world_size:
                return True
            past = store.add(key("reached", stage + 1), 0)
            fell = sum(store.add(key("fell", s), 0) for s in range(stage + 1))
            here = store.add(key("reached", stage + 1, *node), 0)
            here += sum(store.add(key("fell", s, *node), 0) for s in range(stage + 1))
            if (past > 0 or past + fell >= info.world_size) and here >= info.local_world_size:
                return False
            if time.monotonic() > deadline:
                return False
            time.sleep(0.05)
    except KeyboardInterrupt:  # (the terminal's Ctrl-C and torchrun's): say what is known now
        return False


def _wait_for(store: BoundedStore, key: str, seconds: float) -> None:
    """Until ``key`` is in the store, at most ``seconds`` (a signal ends the wait)."""
    deadline = time.monotonic() + seconds
    with contextlib.suppress(KeyboardInterrupt, RuntimeError):
        while time.monotonic() < deadline and not store.check([key]):
            time.sleep(0.05)


def _where(ranks: Sequence[int], info: RankInfo) -> str:
    """``rank 3``, ``ranks 0-7``, ``ranks 0-2, 5``; with the node (its number and host name) in a job of several."""
    spans: list[str] = []
    for _, run in itertools.groupby(enumerate(ranks), key=lambda ir: ir[1] - ir[0]):
        members = [rank for _, rank in run]
        spans.append(str(members[0]) if len(members) == 1 else f"{members[0]}-{members[-1]}")
    text = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(spans)}"
    return f"{text} on node {info.node} ({socket.gethostname()})" if info.nodes > 1 else text


def _say_interrupted(line: str, say: Callable[[str], None], info: RankInfo, store: BoundedStore, scan: int) -> None:
    """Rank 0 says the interrupted line; another rank only when rank 0 said nothing within the wait, and then only
    the first to claim it (rank 0 claims it too, so a rank 0 that gets to it after that, having been inside a long
    C++ operation when the signal came, is quiet). Nobody says it once a rank said a line of its own."""
    if _spoken(store, scan):
        return  # torchrun stops the ranks after one failed, and that rank said why (and how to resume)
    if not info.is_root and _hear_rank_0(store, scan) is not None:
        return
    if not _claim(_job_key("speak", scan, "interrupted"), store):
        return
    say(line if info.is_root else f"rank {info.rank}: {line}")
    if info.is_root:
        with contextlib.suppress(RuntimeError):
            store.set(_job_key("said", scan, 0), line)


def _spoken(store: BoundedStore, scan: int) -> bool:
    """Whether a rank has said a line of its own (not the interrupted one) for this scan."""
    with contextlib.suppress(RuntimeError):
        return store.add(_job_key("spoken", scan, 0), 0) > 0
    return False


def _hear_rank_0(store: BoundedStore, scan: int) -> str | None:
    """Rank 0's line, waited for at most :data:`SAID_WAIT_SECONDS`; None without it, or once rank 0's heartbeat in
    the agent store (posted while it scans) has stopped for 2.5 beats without a line from it."""
    deadline = time.monotonic() + SAID_WAIT_SECONDS
    said, beat = _job_key("said", scan, 0), _job_key("beat", scan, 0)
    last: list[Any] = []  # rank 0's last heartbeat, and when it moved
    with contextlib.suppress(RuntimeError, ValueError):
        while (now := time.monotonic()) < deadline:
            try:
                if store.check([said]):
                    return store.get(said).decode(errors="replace")
                if store.check([beat]):
                    beats = store.get(beat)
                    if not last or last[0] != beats:
                        last[:] = [beats, now]
                    elif now - last[1] > 2.5 * HEARTBEAT_SECONDS:
                        return None  # rank 0 stopped beating without a word: it is gone (killed, its node down)
                time.sleep(0.05)
            except KeyboardInterrupt:  # a second signal (the terminal's and torchrun's): the wait is bounded anyway
                continue
    return None


def _agent_store(timeout: float) -> BoundedStore | None:
    """A client of torchrun's agent store (TORCHELASTIC_USE_AGENT_STORE=True: the agent on the first node holds the
    store at MASTER_ADDR:MASTER_PORT for the whole job); None without one (rank 0 would hold it, in its process
    group only), or when this process found it gone already. Every call is bounded by ``timeout`` seconds,
    connecting included."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or _store_address() in _LOST_STORES:
        return None
    try:
        host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    except (KeyError, ValueError):
        return None
    wait = datetime.timedelta(seconds=timeout)
    return BoundedStore(lambda: torch.distributed.TCPStore(host, port, is_master=False, timeout=wait), timeout=timeout)


def _one_line(error: BaseException) -> str:
    """An exception as one short line: its type (for non-plate-inspect errors) and the first line of its message."""
    lines = str(error).strip().splitlines()
    text = lines[0] if lines else ""
    if not isinstance(error, PlateInspectError):
        text = f"{type(error).__name__}: {text}" if text else type(error).__name__
    return text if len(text) <= 300 else text[:297] + "..."


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


def plan_identity(plan: ScanPlan) -> dict[str, Any]:
    """What every rank of one scan must agree on: the settings, the planned modules (name and shape) and the
    checkpoint's identity (its tensors and file sizes, not its path: nodes may mount it elsewhere); in a job of
    several ranks also a sample of the weights' bytes (:func:`weight_sample`)."""
    identity = {
        "settings": plan.settings.to_json(),
        "modules": f"{len(plan.targets)} modules, " + _digest([(t.name, list(t.shape)) for t in plan.targets]),
        "checkpoint": plan.checkpoint.signature(),
    }
    if rank_from_env().world_size > 1:
        identity["weight bytes"] = weight_sample(plan)
    return identity


def weight_sample(plan: ScanPlan) -> str:
    """A digest of :data:`SAMPLE_BYTES` from the middle of each target tensor's stored bytes (at most
    :data:`WEIGHT_SAMPLES` tensors, evenly spaced by name).

    Other weights with the same names, shapes and file sizes (an older revision in one node's hub cache, a stale
    copy on one node) pass :meth:`Checkpoint.signature`, and a rank scanning them would silently put their
    geometry into the bundle; a retrained or fine-tuned weight differs in almost every byte, so the sample
    catches it. The bytes read are not counted as the scan's (``bytes_read``)."""
    ckpt = plan.checkpoint
    names = sorted({t.tensor.name for t in plan.targets})
    step = max(1, math.ceil(len(names) / WEIGHT_SAMPLES))
    h = hashlib.sha256()
    counted = ckpt.bytes_read
    try:
        for name in names[::step]:
            size = ckpt.tensors[name].nbytes
            length = min(SAMPLE_BYTES, size)
            h.update(ckpt.read_bytes(name, (size - length) // 2, length))
    finally:
        ckpt.bytes_read = counted
    return f"sha256:{h.hexdigest()[:16]} over {len(names[::step])} tensors"


def _digest(obj: Any) -> str:
    import json

    return "sha256:" + hashlib.sha256(json.dumps(obj).encode()).hexdigest()[:16]


@contextlib.contextmanager
def join() -> Iterator[Coordinator]:
    """The process group of this job (created from torchrun's env:// variables if needed, torn down after).

    An error on this rank is posted to the job's store before it propagates, so that ranks waiting for this one
    fail at once with its message (:class:`Coordinator`)."""
    info = rank_from_env()
    scans = _RUNS.setdefault(_run(), _RunScans()) if info.world_size > 1 else _RunScans()
    scan, scans.failed = scans.joined, None
    scans.joined += 1
    track = JobTrack(info, scan)
    track.passed()
    created = False
    if info.world_size > 1 and not torch.distributed.is_initialized():
        try:
            with _waiting_note(info), _stop_signals_end_joining(), _end_joining_once_a_rank_spoke(track):
                torch.distributed.init_process_group("gloo", init_method="env://", timeout=COLLECTIVE_TIMEOUT)
        except _STORE_ERRORS as e:  # the store's node ended while this rank waited (its ranks failed, or it died)
            scans.failed = scan
            track.close()
            lost = BundleError(_store_lost(e))
            setattr(lost, FAULT_ATTRIBUTE, Fault("node", info.rank, stage=track.stage, scan=track.scan))
            raise lost from None
        created = True
    store = _job_store() if info.world_size > 1 else None
    group = Coordinator(info, store, f"plate-inspect/scan-{scan}/", stop_main=True, track=track)
    try:
        with _sigterm_interrupts(info):
            yield group
    except BaseException as e:
        scans.failed = scan
        if group.store_lost is not None:  # the heartbeat thread stopped the scan (KeyboardInterrupt), or the
            raise BundleError(group.store_lost) from None  # main thread found the store gone first: one message
        _record_fault(e, group)
        group.report_failure(e)
        raise
    finally:
        group.close()
        track.close()
        if created and group.store_lost is None:  # (with the store's host gone, tearing down may wait for it)
            torch.distributed.destroy_process_group()


@contextlib.contextmanager
def _sigterm_interrupts(info: RankInfo) -> Iterator[None]:
    """On rank 0 of a torchrun job, SIGTERM raises KeyboardInterrupt while the scan runs, so it ends as after a
    Ctrl-C: the CLI's one line says that finished parts are kept and to rerun the same command.

    torchrun stops every rank with SIGTERM when one fails (a killed rank, another node's error); rank 0 used to
    die silently, leaving only torchrun's report, which names the failed rank but not how to go on. Only in the
    main thread, only over the default handler (never a program's own), restored after; not for ``--devices``
    workers, which their parent stops and reports itself."""
    import signal

    if (
        info.world_size == 1
        or not info.is_root
        or "TORCHELASTIC_RUN_ID" not in os.environ
        or threading.current_thread() is not threading.main_thread()
        or signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL
    ):
        yield
        return

    def interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


@contextlib.contextmanager
def _stop_signals_end_joining() -> Iterator[None]:
    """While this rank waits to join the process group, SIGTERM and SIGINT end it at once (their default action).

    Joining waits inside torch's C++ code, where a Python signal handler never runs: when another rank failed
    before it joined, torchrun's SIGTERM (or a Ctrl-C it passes on) left this rank waiting until torchrun killed it
    30 s later. Nothing of the scan is written before the group exists (the directory lock is an flock, released
    with the process). Only in the main thread; a signal ignored (SIG_IGN) stays ignored."""
    import signal

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    for sig, handler in saved.items():
        if handler is not signal.SIG_IGN:
            signal.signal(sig, signal.SIG_DFL)
    try:
        yield
    finally:
        for sig, handler in saved.items():
            if handler is not None:
                signal.signal(sig, handler)


@contextlib.contextmanager
def _end_joining_once_a_rank_spoke(track: JobTrack) -> Iterator[None]:
    """While this rank waits to join the process group, end it (as torchrun's SIGTERM does) once another rank of
    the job has said a line of its own in the agent store (:func:`say_once`): that rank failed before joining and
    never will, and it said why.

    On one node torchrun stops the waiting ranks when that rank exits; on another node nothing did, and the ranks
    there waited up to :data:`COLLECTIVE_TIMEOUT` (24 h) after the failed node's line, with a note every minute.
    Nothing of the scan is written before the group exists. Only under torchrun (its agent store)."""
    store = _agent_store(STORE_TIMEOUT_SECONDS) if track.info.world_size > 1 else None
    if store is None:
        yield
        return
    done = threading.Event()
    key = track.key("spoken", 0)

    def watch() -> None:
        with contextlib.suppress(RuntimeError):
            while not done.wait(POLL_SECONDS):
                if store.add(key, 0) > 0 and not done.is_set():
                    import signal

                    os.kill(os.getpid(), signal.SIGTERM)  # (at its default action while joining, see the caller)
                    if not done.wait(QUIET_EXIT_SECONDS):  # SIGTERM ignored: end all the same
                        os._exit(128 + signal.SIGTERM)
                    return

    thread = threading.Thread(target=watch, name="plate-join-watch", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        store.close()


@contextlib.contextmanager
def _waiting_note(info: RankInfo) -> Iterator[None]:
    """Say on stderr, every :data:`JOIN_NOTE_SECONDS`, that this rank is still waiting for the others to join.

    Joining waits as long as :data:`COLLECTIVE_TIMEOUT` (a rank may still be planning, or fetching the model into
    its node's cache), silently: a rank that failed before it joined (its model path missing on its node) or was
    never started (WORLD_SIZE left in a shell's environment) would leave the others waiting without a word."""
    done = threading.Event()
    where = f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"

    def note() -> None:
        waited = 0.0
        while not done.wait(JOIN_NOTE_SECONDS):
            waited += JOIN_NOTE_SECONDS
            print(
                f"plate-inspect: rank {info.rank} has waited {waited:.0f} s for the other ranks of WORLD_SIZE="
                f"{info.world_size} to join at {where}; a rank that failed before joining (see its output) or was "
                "never started leaves the others waiting: if so, stop the job",
                file=sys.stderr,
                flush=True,
            )

    thread = threading.Thread(target=note, name="plate-join-note", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()


def _job_store() -> Any:
    """The default process group's key-value store (torchrun's or rank 0's TCPStore), or None if it has none."""
    try:
        from torch.distributed.distributed_c10d import _get_default_store

        return _get_default_store()
    except (ImportError, RuntimeError, ValueError):
        return None


def rank_device(device: torch.device, info: RankInfo) -> torch.device:
    """One GPU per rank: ``cuda`` under torchrun means ``cuda:LOCAL_RANK``; an explicit index is kept."""
    if device.type != "cuda" or device.index is not None or info.world_size == 1:
        return device
    count = torch.cuda.device_count()
    if info.local_rank >= count:
        raise ConfigError(
            f"rank {info.rank} has LOCAL_RANK={info.local_rank} but this machine shows {count} CUDA devices; "
            "run at most one process per GPU (--nproc-per-node)"
        )
    return torch.device("cuda", info.local_rank)


# --------------------------------------------------------------------------- the shared output directory
def require_shared_out(out: str | os.PathLike, files_by_rank: Sequence[Sequence[str]]) -> None:
    """Rank 0, once every rank's parts are written: BundleError unless it sees every part file each rank wrote.

    Ranks given node-local directories under one path (``--out /scratch/b`` on every node), or another ``--out``
    each, write their shares into their own directories; rank 0 would mark a manifest complete whose part files
    sit elsewhere (``info``: "missing: N part files"). Meant for ``scanner._finish`` before the manifest is
    finalised, so that the bundle stays unfinished and the message says what to change."""
    from plate_inspect.formatting import counted

    root = Path(out)
    unseen = {rank: [f for f in files if not (root / f).is_file()] for rank, files in enumerate(files_by_rank)}
    unseen = {rank: files for rank, files in unseen.items() if files}
    if not unseen:
        return
    ranks = sorted(unseen)
    n = sum(len(files) for files in unseen.values())
    raise BundleError(
        f"{root}: rank 0 does not see {counted(n, 'part file')} that rank{'s' if len(ranks) > 1 else ''} "
        f"{', '.join(map(str, ranks))} wrote there (e.g. {unseen[ranks[0]][0]}): --out must be one directory that "
        "every rank shares (a shared filesystem at the same path on every node); give one and rerun the same command"
    )


# --------------------------------------------------------------------------- sharing the work
def module_cost(d_out: int, d_in: int) -> float:
    """Relative compute of one module from its shape: the Gram matrix on the small side plus its eigensolve."""
    small, large = min(d_out, d_in), max(d_out, d_in)
    return float(small) * small * large + EIGENSOLVE_WEIGHT * float(small) ** 3


def assign_parts(costs: Sequence[tuple[str, float]], world_size: int) -> list[list[str]]:
    """Deterministic greedy bin-packing of whole part files onto ranks (largest cost first, to the least loaded).

    Ties break by part order and by the lower rank, so every rank computes the same assignment. Each rank's
    parts come back in the given order. The largest load is at most 4/3 of the optimum (LPT scheduling).
    """
    order = {name: i for i, (name, _) in enumerate(costs)}
    loads = [(0.0, rank) for rank in range(world_size)]
    heapq.heapify(loads)
    shares: list[list[str]] = [[] for _ in range(world_size)]
    for name, cost in sorted(costs, key=lambda nc: (-nc[1], order[nc[0]])):
        load, rank = heapq.heappop(loads)
        shares[rank].append(name)
        heapq.heappush(loads, (load + cost, rank))
    return [sorted(share, key=order.__getitem__) for share in shares]


# --------------------------------------------------------------------------- one worker per device
def parse_devices(spec: str | Sequence[str]) -> list[str]:
    """'cuda:0,cuda:1' or 'all' (every visible GPU) -> device names; repeated 'cpu' entries run CPU workers."""
    if isinstance(spec, str):
        if spec.strip() == "all":
            count = torch.cuda.device_count()
            if count == 0:
                raise ConfigError(
                    'devices="all" (CLI: --devices all): no CUDA device is visible; use '
                    'device="cpu" (CLI: --device cpu)'
                )
            return [f"cuda:{i}" for i in range(count)]
        spec = [d.strip() for d in spec.split(",") if d.strip()]
    devices = list(spec)
    if not devices:
        raise ConfigError("--devices is empty; give e.g. cuda:0,cuda:1 or all")
    cuda = [d for d in devices if d != "cpu"]
    if len(set(cuda)) != len(cuda):
        raise ConfigError(f"--devices names a GPU twice ({', '.join(devices)}); give each GPU once")
    for d in cuda:
        head, _, index = d.partition(":")
        if head != "cuda" or not index.isdigit():
            raise ConfigError(f"--devices: '{d}' is not cpu or cuda:N")
        dev = torch.device(d)
        if dev.index >= torch.cuda.device_count():
            raise ConfigError(f"--devices: {d} is not visible (this machine shows {torch.cuda.device_count()} GPUs)")
    return devices


def scan_on_devices(
    plan: ScanPlan,
    out: str | os.PathLike,
    devices: Sequence[str],
    *,
    overwrite: bool = False,
    progress: ProgressCallback | None = None,
) -> Bundle:
    """Run a scan as one spawned worker process per device (a local torchrun without torchrun), then load it.

    Workers get RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR/MASTER_PORT and, unless already set, an equal share of
    the CPU cores as OMP/OpenBLAS/MKL threads. If a worker fails, the others are stopped and the error is raised
    here; rerunning resumes from the part files already written.
    """
    from plate_inspect.bundle import Bundle

    ctx = multiprocessing.get_context("spawn")
    messages = ctx.Queue()
    n = len(devices)
    port = _free_port()
    threads = str(max(1, (os.cpu_count() or 1) // n))
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(n)}
    env.update({var: threads for var in _THREAD_VARS if var not in os.environ})
    counter = ProgressCounter(progress, len(plan.targets), "modules", bytes_total=sum(t.nbytes for t in plan.targets))
    counter.start()
    procs = []
    try:
        for rank, device in enumerate(devices):
            rank_env = {**env, "RANK": str(rank), "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(n)}
            with _environ(rank_env):  # spawned children copy the environment when they start
                proc = ctx.Process(
                    target=_device_worker,
                    args=(plan, str(out), device, overwrite, messages, os.getpid()),
                    name=f"plate-scan-{rank}",
                )
                proc.start()
            procs.append(proc)
        error = _watch(procs, messages, counter)
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.terminate()
            proc.join()
    if error is not None:
        raise error
    return Bundle.load(out)


def _watch(procs: list, messages: Any, counter: ProgressCounter) -> PlateInspectError | None:
    """Relay progress until every worker exits; the first failure (its own error, or its exit code) is returned."""
    error: PlateInspectError | None = None
    while True:
        try:
            kind, payload = messages.get(timeout=0.2)
        except queue_mod.Empty:
            kind, payload = None, None
        if kind == "module":
            name, nbytes = payload
            counter.step(name, nbytes=nbytes)
        elif kind == "error" and error is None:
            error = payload
        dead = [p for p in procs if p.exitcode not in (None, 0)]
        if dead and error is None and kind is None:
            p = dead[0]
            error = BundleError(
                f"scan worker {p.name} died (exit code {p.exitcode}); finished parts are kept: rerun to resume"
            )
        if error is not None:
            return error
        if kind is None and all(p.exitcode == 0 for p in procs):
            return None


def _die_with_parent(parent_pid: int) -> None:
    """Linux: this worker is killed when the process that started it dies (kill, SIGTERM, OOM), instead of
    scanning on as an orphan that holds its GPU; a later rerun resumes from the parts written. Elsewhere: no-op."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes
    import signal

    pr_set_pdeathsig = 1
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, int(signal.SIGKILL))
    if os.getppid() != parent_pid:  # the parent died before the request above took effect
        os._exit(1)


def _device_worker(
    plan: ScanPlan, out: str, device: str, overwrite: bool, messages: Any, parent_pid: int | None = None
) -> None:
    from plate_inspect.scanner import run_scan

    if parent_pid is not None:
        _die_with_parent(parent_pid)

    done, read = [0], [0]

    def relay(event: ProgressEvent) -> None:
        """This worker's progress, relayed to the parent process (which counts over all workers); an event that
        repeats ``done`` (worker 0's news of the others, :class:`JobProgress`) is not a module."""
        if event.done > done[0]:
            messages.put(("module", (event.label, (event.bytes_done or 0) - read[0])))
        done[0], read[0] = event.done, event.bytes_done or 0

    try:
        run_scan(plan, out, overwrite=overwrite, device=device, progress=relay)
    except PlateInspectError as e:
        messages.put(("error", e))
        raise SystemExit(2) from None


@contextlib.contextmanager
def _environ(values: dict[str, str]) -> Iterator[None]:
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
