"""Which rank writes which part files: a deterministic, cost-balanced share each, in one shared directory."""

from __future__ import annotations

import heapq
import os
from collections.abc import Sequence
from pathlib import Path

from plate_inspect.errors import BundleError

#: Relative cost of an eigensolve of the s x s Gram matrix per s^3, against forming it (s^2 * l multiply-adds).
EIGENSOLVE_WEIGHT = 2.0


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
