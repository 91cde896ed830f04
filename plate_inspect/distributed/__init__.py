"""Scans on many processes: torchrun ranks on many machines, or one spawned worker per device on one machine.

Every rank plans the same scan, takes a deterministic, cost-balanced share of the part files
(:func:`assign_parts`), and writes its own parts into the shared output directory; rank 0 prepares the directory
before anyone writes and writes the manifest after everyone is done. Only small Python objects (a verdict, the
module records, run statistics) cross ranks, over a gloo process group: no tensor is ever communicated, so the
bundle's bytes are those of a single-process scan with the same threads per process.

One module per job:

- :mod:`.ranks`: this process's rank and node (torchrun's environment) and its GPU;
- :mod:`.sharding`: which rank writes which part files, and rank 0 seeing them all;
- :mod:`.identity`: what every rank of a scan must agree on (settings, modules, a sample of the weights);
- :mod:`.group`: joining the process group for one scan (:func:`join`);
- :mod:`.coordinator`: the group as a scan uses it, failing fast when a rank fails or falls silent;
- :mod:`.job_progress`: the whole job's progress on rank 0's callback;
- :mod:`.store`: the job's key-value stores, every call bounded in time;
- :mod:`.tracking`: where each rank is in a scan, and what an error is to the job's one line;
- :mod:`.reporting`: a user error said once per job or node (:func:`say_once`), not once per rank;
- :mod:`.signals`: SIGTERM, Ctrl-C and the other ranks' news while joining and scanning;
- :mod:`.network`: the interface gloo listens on across hosts, and whether the job's store can be reached;
- :mod:`.devices`: one spawned worker per device on one machine (``--devices``);
- :mod:`.timing`: every waiting bound, read at each use.
"""

from plate_inspect.distributed.coordinator import Coordinator
from plate_inspect.distributed.devices import parse_devices, scan_on_devices
from plate_inspect.distributed.group import join
from plate_inspect.distributed.identity import plan_identity, weight_sample
from plate_inspect.distributed.job_progress import JobProgress
from plate_inspect.distributed.ranks import RankInfo, rank_device, rank_from_env
from plate_inspect.distributed.reporting import say_once
from plate_inspect.distributed.sharding import assign_parts, module_cost, require_shared_out
from plate_inspect.distributed.store import BoundedStore, StoreTimeout
from plate_inspect.distributed.tracking import FAULT_ATTRIBUTE, Fault, JobTrack

__all__ = [
    "FAULT_ATTRIBUTE",
    "BoundedStore",
    "Coordinator",
    "Fault",
    "JobProgress",
    "JobTrack",
    "RankInfo",
    "StoreTimeout",
    "assign_parts",
    "join",
    "module_cost",
    "parse_devices",
    "plan_identity",
    "rank_device",
    "rank_from_env",
    "require_shared_out",
    "say_once",
    "scan_on_devices",
    "weight_sample",
]
