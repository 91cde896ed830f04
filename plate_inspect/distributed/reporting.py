"""A user error said once per job (or once per node, naming its ranks), not once per rank: :func:`say_once`."""

from __future__ import annotations

import contextlib
import itertools
import os
import socket
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from plate_inspect.distributed import identity, timing
from plate_inspect.distributed.messages import RESUME
from plate_inspect.distributed.ranks import RankInfo, rank_from_env
from plate_inspect.distributed.signals import sigterm_ignored_while_saying
from plate_inspect.distributed.store import BoundedStore, agent_store
from plate_inspect.distributed.tracking import FAULT_ATTRIBUTE, Fault, job_key, mark_exit, process_place, scan_now
from plate_inspect.errors import ConfigError

if TYPE_CHECKING:
    from plate_inspect.distributed.coordinator import Coordinator


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
    longer than ``timing.SAID_WAIT_SECONDS``:

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
    A rank that says a line posts it after printing, so that no rank falls quiet (and exits) before it spoke. A
    SIGTERM that comes while it says its line (torchrun's, after scancel's own) is ignored
    (:func:`~plate_inspect.distributed.signals.sigterm_ignored_while_saying`)."""
    if info is None:
        try:
            info = rank_from_env()
        except ConfigError:  # the job's variables themselves are wrong: every process says so
            info = RankInfo()
    if info.world_size == 1:
        say(line)
        return
    with sigterm_ignored_while_saying():  # torchrun's SIGTERM, late on a busy node, no longer ends the rank here
        _say_in_job(line, say, error, info)


def _say_in_job(line: str, say: Callable[[str], None], error: BaseException | None, info: RankInfo) -> None:
    """:func:`say_once` in a job of several ranks."""
    fault = getattr(error, FAULT_ATTRIBUTE, None)
    if not isinstance(fault, Fault):  # raised outside a scan (scan_now says which one it belongs to)
        fault = Fault("interrupted" if isinstance(error, KeyboardInterrupt) else "own", info.rank, scan=scan_now())
    if fault.kind == "node":  # every rank of this node met it (the store is gone): its first rank says it for them
        if info.local_rank == 0:
            first = info.rank - info.local_rank
            say(f"{_where(range(first, first + info.local_world_size), info)}: {line}")
        return
    store = agent_store(timing.SAID_WAIT_SECONDS)
    if store is None:
        say(line if info.is_root else f"rank {info.rank}: {line}")
        return
    try:
        if isinstance(error, KeyboardInterrupt):
            mark_exit(info, fault.scan)  # interrupted, not killed (rank 0 names a rank gone without it)
            _say_interrupted(line, say, info, store, fault.scan)
        elif fault.kind == "verdict" or fault.kind == "relay" or fault.after_agreement:
            _say_as_fault(line, say, info, store, fault)
        else:
            _say_for_the_ranks(line, say, info, store, fault)
    finally:
        store.close()


def record_fault(error: BaseException, group: Coordinator) -> None:
    """Note on ``error`` what it is (its :data:`FAULT_ATTRIBUTE`, read by :func:`say_once`); for a rank's own error,
    claim saying it in the agent store, so that a rank that names this failure (``rank N failed: ...``) stays
    quiet."""
    if group.world_size == 1:
        return
    fault = group.fault(error)
    with contextlib.suppress(AttributeError, TypeError):  # (an exception type without attributes: an own error)
        setattr(error, FAULT_ATTRIBUTE, fault)
    if fault.kind == "own":
        _claim(job_key("claim", fault.scan, fault.rank))


def _claim(key: str, store: BoundedStore | None = None) -> bool:
    """Take the right to say what ``key`` names (True for the first to ask, and when there is no agent store to
    ask)."""
    own = store is None
    store = store or agent_store(timing.SAID_WAIT_SECONDS)
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


def _said(store: BoundedStore, scan: int, line: str | None) -> None:
    """After this rank printed a line of its own (not the interrupted one): no rank adds an interrupted line; with
    ``line`` (the job's line, unprefixed), the ranks waiting for rank 0's line have it."""
    with contextlib.suppress(RuntimeError):
        store.add(job_key("spoken", scan, 0), 1)
        if line is not None:
            store.set(job_key("said", scan, 0), line)


def _say_as_fault(line: str, say: Callable[[str], None], info: RankInfo, store: BoundedStore, fault: Fault) -> None:
    """A verdict of rank 0 (rank 0 says it), a relay of another rank's failure (the first to claim it says it), or
    this rank's own error in its share (said at once, with how to resume and its rank but rank 0's)."""
    mine: str | None = line
    if fault.kind == "verdict":
        mine = line if info.is_root else None
    elif fault.kind == "relay":
        mine = line if _claim(job_key("claim", fault.scan, fault.rank), store) else None
        if mine is None and info.is_root:
            return  # the failed rank said it itself
    else:
        mine = line if RESUME in line else f"{line}; {RESUME}"
        mine = mine if info.is_root else f"rank {info.rank}: {mine}"
    if mine is None:
        _quietly(timing.QUIET_EXIT_SECONDS)  # the rank that says it exits first, so that torchrun's report names it
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
    or --out missing on one node: the line says so, also on rank 0's node). At ``timing.SAID_WAIT_SECONDS`` it says
    what it knows by then; a second signal ends the wait the same way. The other ranks of the node wait until it has
    spoken, then exit after it; no rank exits before every rank of its node that failed at this point is done
    (:func:`_wait_for_the_node`)."""

    def key(what: str, *parts: object) -> str:
        return job_key(what, fault.scan, *parts)

    digest, stage, node = identity.digest(line), fault.stage, ("node", info.node)
    said = key("said", digest, *node)
    spoken = False
    try:
        store.set(key("who", digest, *node, store.add(key("same", digest, *node), 1) - 1), str(info.rank))
        store.add(key("same", digest), 1)
        store.add(key("fell", stage), 1)
        store.add(key("fell", stage, *node), 1)
        if not _claim(key("speak", digest, *node), store):  # another rank of this node says it
            _wait_for(store, said, 2 * timing.SAID_WAIT_SECONDS)
            _wait_for_the_node(store, key, stage, info)
            _quietly(timing.QUIET_EXIT_SECONDS)
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
        _wait_for_the_node(store, key, stage, info)
        if text is None:
            _quietly(timing.QUIET_EXIT_SECONDS)
    except RuntimeError:  # the store failed or stopped answering: say it with this rank
        if not spoken:
            say(line if info.is_root else f"rank {info.rank}: {line}")


def _wait_for_the_ranks(store: BoundedStore, key: Callable[..., str], info: RankInfo, stage: int, digest: str) -> bool:
    """Whether every rank failed with the line ``digest`` (True), or not: a rank got past ``stage`` or every rank
    failed or got past it, and so did every rank of this node (False; also at ``timing.SAID_WAIT_SECONDS``, or when a
    signal ends the wait)."""
    node = ("node", info.node)
    deadline = time.monotonic() + timing.SAID_WAIT_SECONDS
    try:
        while True:
            # The tallies first, the line's count after them: a rank counts its line before its fall, so a fall read
            # here is in the line's count read next (read the other way round, the last rank's line and fall could
            # land in between, and every rank having the line passed for a node's problem).
            past = store.add(key("reached", stage + 1), 0)
            fell = sum(store.add(key("fell", s), 0) for s in range(stage + 1))
            here = store.add(key("reached", stage + 1, *node), 0)
            here += sum(store.add(key("fell", s, *node), 0) for s in range(stage + 1))
            if store.add(key("same", digest), 0) >= info.world_size:
                return True
            if (past > 0 or past + fell >= info.world_size) and here >= info.local_world_size:
                return False
            if time.monotonic() > deadline:
                return False
            time.sleep(0.05)
    except KeyboardInterrupt:  # (the terminal's Ctrl-C and torchrun's): say what is known now
        return False


def _wait_for_the_node(store: BoundedStore, key: Callable[..., str], stage: int, info: RankInfo) -> None:
    """Count this rank done with its line (said, or left to another rank), then wait until every rank of its node
    that failed at ``stage`` is done too (at most ``timing.SAID_WAIT_SECONDS``; a signal ends the wait).

    Under torchrun the first rank of a node to exit gets the node's other ranks stopped: a rank that said its line
    and exited at once cut off another rank of its node that was still saying a different line."""
    node = ("node", info.node)
    done, fell = key("done", stage, *node), key("fell", stage, *node)
    deadline = time.monotonic() + timing.SAID_WAIT_SECONDS
    with contextlib.suppress(KeyboardInterrupt, RuntimeError):
        store.add(done, 1)
        while time.monotonic() < deadline and store.add(done, 0) < store.add(fell, 0):
            time.sleep(0.05)


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
    if not _claim(job_key("speak", scan, "interrupted"), store):
        return
    if info.is_root:
        silent = _silent_ranks(store, scan, info.world_size)
        if silent:  # torchrun stopped the job because these ranks died: say so, the report above is long
            who = _where(silent, info)
            line += f" ({who} had stopped without a word: killed, e.g. by the out-of-memory killer?)"
    say(line if info.is_root else f"rank {info.rank}: {line}")
    if info.is_root:
        with contextlib.suppress(RuntimeError):
            store.set(job_key("said", scan, 0), line)


def _silent_ranks(store: BoundedStore, scan: int, world_size: int) -> list[int]:
    """On an interrupted rank 0: the other ranks of this node whose process is gone without an exit mark (a SIGKILL,
    the out-of-memory killer), waited for at most ``timing.EXIT_MARK_WAIT_SECONDS``.

    torchrun SIGTERMs every rank when one dies, so rank 0 ends as after a Ctrl-C. An interrupted rank posts its exit
    mark before its line and then waits for rank 0's (:func:`say_once`): it is alive or marked, and a rank that is
    gone without a mark died. Each rank posted its process (place and pid, :meth:`JobTrack.announce`); ranks on other
    nodes, or still running without a mark at the bound (inside a long C++ operation), are not named."""
    deadline = time.monotonic() + timing.EXIT_MARK_WAIT_SECONDS
    here = process_place()
    pending = set(range(1, world_size))
    silent: list[int] = []
    with contextlib.suppress(RuntimeError, ValueError):
        while pending:
            try:
                for rank in sorted(pending):
                    process = job_key("process", scan, rank)
                    if store.check([job_key("left", scan, rank)]) or not store.check([process]):
                        pending.discard(rank)  # interrupted (marked), or never announced: nothing to say
                        continue
                    where, _, pid = store.get(process).decode(errors="replace").rpartition(":")
                    if where != here:  # another node's (or container's) process id: not checkable here
                        pending.discard(rank)
                    elif not _process_alive(int(pid)):
                        silent.append(rank)
                        pending.discard(rank)
                if not pending or time.monotonic() >= deadline:
                    break
                time.sleep(0.05)
            except KeyboardInterrupt:  # a second signal: the wait is bounded anyway
                continue
    return sorted(silent)


def _process_alive(pid: int) -> bool:
    """Whether process ``pid`` still runs (a zombie, dead but not yet reaped by torchrun, does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's: it exists
        return True
    with contextlib.suppress(OSError, IndexError):
        stat = Path(f"/proc/{pid}/stat").read_text()
        return stat[stat.rindex(")") + 2] not in "ZX"
    return True


def _spoken(store: BoundedStore, scan: int) -> bool:
    """Whether a rank has said a line of its own (not the interrupted one) for this scan."""
    with contextlib.suppress(RuntimeError):
        return store.add(job_key("spoken", scan, 0), 0) > 0
    return False


def _hear_rank_0(store: BoundedStore, scan: int) -> str | None:
    """Rank 0's line, waited for at most ``timing.SAID_WAIT_SECONDS``; None without it, or once rank 0's heartbeat in
    the agent store (posted while it scans) has stopped for 2.5 beats without a line from it."""
    deadline = time.monotonic() + timing.SAID_WAIT_SECONDS
    said, beat = job_key("said", scan, 0), job_key("beat", scan, 0)
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
                    elif now - last[1] > 2.5 * timing.HEARTBEAT_SECONDS:
                        return None  # rank 0 stopped beating without a word: it is gone (killed, its node down)
                time.sleep(0.05)
            except KeyboardInterrupt:  # a second signal (the terminal's and torchrun's): the wait is bounded anyway
                continue
    return None
