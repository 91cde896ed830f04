"""What every rank of one scan must agree on (:func:`plan_identity`), as short digests."""

from __future__ import annotations

import hashlib
import json
import math
from typing import TYPE_CHECKING, Any

from plate_inspect.distributed.ranks import rank_from_env

if TYPE_CHECKING:
    from plate_inspect.scanner import ScanPlan


#: Target tensors whose stored bytes every rank samples for the plan's identity (more are subsampled evenly).
WEIGHT_SAMPLES = 1024
#: Bytes sampled from the middle of each of them.
SAMPLE_BYTES = 4096


def plan_identity(plan: ScanPlan) -> dict[str, Any]:
    """What every rank of one scan must agree on: the settings, the planned modules (name and shape) and the
    checkpoint's identity (its tensors and file sizes, not its path: nodes may mount it elsewhere); in a job of
    several ranks also a sample of the weights' bytes (:func:`weight_sample`)."""
    identity = {
        "settings": plan.settings.to_json(),
        "modules": f"{len(plan.targets)} modules, " + digest([(t.name, list(t.shape)) for t in plan.targets]),
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


def digest(obj: Any) -> str:
    """A short stable digest of a JSON-able value ('sha256:' + 16 hex digits), for comparing it across ranks."""

    return "sha256:" + hashlib.sha256(json.dumps(obj).encode()).hexdigest()[:16]
