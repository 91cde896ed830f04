"""Joining the job's process group for one scan (:func:`join`): the life of a :class:`Coordinator`."""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Iterator
from typing import Any

import torch

from plate_inspect.distributed import timing, tracking
from plate_inspect.distributed.coordinator import Coordinator
from plate_inspect.distributed.network import gloo_interface, gloo_line
from plate_inspect.distributed.ranks import rank_from_env
from plate_inspect.distributed.reporting import record_fault
from plate_inspect.distributed.signals import (
    end_joining_once_a_rank_spoke,
    sigterm_interrupts,
    stop_signals_end_joining,
    waiting_note,
)
from plate_inspect.distributed.store import STORE_ERRORS, lost_store_line
from plate_inspect.distributed.tracking import FAULT_ATTRIBUTE, Fault, JobTrack
from plate_inspect.errors import BundleError


@contextlib.contextmanager
def join() -> Iterator[Coordinator]:
    """The process group of this job (created from torchrun's env:// variables if needed, torn down after).

    An error on this rank is posted to the job's store before it propagates, so that ranks waiting for this one
    fail at once with its message (:class:`Coordinator`)."""
    info = rank_from_env()
    scans = tracking.this_run(info)
    scan, scans.failed = scans.joined, None
    scans.joined += 1
    track = JobTrack(info, scan)
    track.announce()
    track.passed()
    created = False
    if info.world_size > 1 and not torch.distributed.is_initialized():
        try:
            with waiting_note(info), stop_signals_end_joining(), end_joining_once_a_rank_spoke(track):
                _create_group(info.nodes)
        except STORE_ERRORS as e:  # the store's node ended while this rank waited (its ranks failed, or it died)
            scans.failed = scan
            track.close()
            lost = BundleError(lost_store_line(e))
            setattr(lost, FAULT_ATTRIBUTE, Fault("node", info.rank, stage=track.stage, scan=track.scan))
            raise lost from None
        except RuntimeError as e:  # gloo's mesh: a rank could not connect to another (C++ traceback, peers waited)
            if not str(e).startswith("Gloo"):
                raise
            scans.failed = scan
            track.close()
            cut = BundleError(gloo_line(e))  # (said for its node, and the ranks still joining end: the store is up)
            setattr(cut, FAULT_ATTRIBUTE, Fault("own", info.rank, stage=track.stage, scan=track.scan))
            raise cut from None
        created = True
    store = _job_store() if info.world_size > 1 else None
    group = Coordinator(info, store, f"plate-inspect/scan-{scan}/", stop_main=True, track=track)
    try:
        with sigterm_interrupts(info):
            yield group
    except BaseException as e:
        scans.failed = scan
        if group.store_lost is not None:  # the heartbeat thread stopped the scan (KeyboardInterrupt), or the
            raise BundleError(group.store_lost) from None  # main thread found the store gone first: one message
        record_fault(e, group)
        group.report_failure(e)
        raise
    finally:
        group.close()
        track.close()
        if created and group.store_lost is None:  # (with the store's host gone, tearing down may wait for it)
            torch.distributed.destroy_process_group()


def _create_group(nodes: int) -> None:
    """The job's gloo process group, from torchrun's env:// variables. On a host whose name resolves to loopback
    gloo would listen there, unreachable from other nodes: GLOO_SOCKET_IFNAME names the interface that reaches the
    job's store while the group is created (:func:`network.gloo_interface`)."""
    interface = gloo_interface(os.environ, socket.gethostname(), nodes)
    if interface is not None:
        os.environ["GLOO_SOCKET_IFNAME"] = interface
    try:
        torch.distributed.init_process_group("gloo", init_method="env://", timeout=timing.COLLECTIVE_TIMEOUT)
    finally:
        if interface is not None:
            os.environ.pop("GLOO_SOCKET_IFNAME", None)


def _job_store() -> Any:
    """The default process group's key-value store (torchrun's or rank 0's TCPStore), or None if it has none."""
    try:
        from torch.distributed.distributed_c10d import _get_default_store

        return _get_default_store()
    except (ImportError, RuntimeError, ValueError):
        return None
