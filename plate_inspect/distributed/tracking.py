"""Where each rank of a torchrun job is in a scan: the scans of this run, each scan's stages, and what an error
is to the job's one line (:class:`Fault`)."""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from plate_inspect.distributed import timing
from plate_inspect.distributed.ranks import RankInfo
from plate_inspect.distributed.store import BoundedStore, agent_store


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
class RunScans:
    """The scans of several ranks this process joined in one torchrun run: how many (every rank of a job joins the
    same scans in the same order, so each scan's keys in the job's stores are its own), and the last one if it ended
    with an error (an error raised outside it, such as a second Ctrl-C, belongs to it). Only an index: each scan's
    own state is its :class:`JobTrack`."""

    joined: int = 0
    failed: int | None = None


#: Each torchrun run's (TORCHELASTIC_RUN_ID and restart; "" without one) scans in this process.
_RUNS: dict[str, RunScans] = {}


def _run() -> str:
    """This torchrun run (and restart): the agent store outlives a run's scans, and a restart's workers are new."""
    return f"{os.environ.get('TORCHELASTIC_RUN_ID', '')}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"


def job_key(what: str, scan: int, *parts: object) -> str:
    """A key of scan ``scan`` of this torchrun run in the agent store."""
    return "/".join(["plate-inspect", what, _run(), str(scan), *map(str, parts)])


def this_run(info: RankInfo) -> RunScans:
    """The scans this process joined in this torchrun run (a single process: a fresh record, kept nowhere)."""
    return _RUNS.setdefault(_run(), RunScans()) if info.world_size > 1 else RunScans()


def scan_now() -> int:
    """The scan of this run that an error raised outside any scan belongs to: the last one this process joined if
    that ended with an error, else the next one."""
    scans = _RUNS.get(_run(), RunScans())
    return scans.joined if scans.failed is None else scans.failed


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
            self._store = agent_store(timing.STORE_TIMEOUT_SECONDS)

    def announce(self) -> None:
        """Post this rank's process (host, PID namespace and pid) for this scan: an interrupted rank 0 tells from it a
        rank that died without a word (SIGKILL, the OOM killer) from an interrupted one (:func:`say_once`)."""
        key, text = self.key("process", self.info.rank), f"{process_place()}:{os.getpid()}"
        self._post(lambda store: store.set(key, text))

    def key(self, what: str, *parts: object) -> str:
        """This scan's key ``what/parts`` in the agent store (:func:`job_key`)."""
        return job_key(what, self.scan, *parts)

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


def process_place() -> str:
    """Where this process's id means something: its host and PID namespace (two containers of one host may share a
    host name, never a PID namespace)."""
    try:
        namespace = os.readlink("/proc/self/ns/pid")
    except OSError:  # not Linux: the host alone
        namespace = ""
    return f"{socket.gethostname()}/{namespace}"


def mark_exit(info: RankInfo, scan: int) -> None:
    """Post rank ``info.rank``'s exit mark for ``scan`` in the agent store (read by an interrupted rank 0, which names
    the ranks of its node that are gone without one: killed), waiting at most ``timing.EXIT_MARK_WAIT_SECONDS``."""
    if info.world_size == 1:
        return
    store = agent_store(timing.EXIT_MARK_WAIT_SECONDS)
    if store is None:
        return
    try:
        store.set(job_key("left", scan, info.rank), "interrupted")
    except RuntimeError:  # (StoreTimeout is one): a mark that cannot be posted names nobody wrongly, only no one
        pass
    finally:
        store.close()
