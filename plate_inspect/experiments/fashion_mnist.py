"""Fashion-MNIST from Debian's ``dataset-fashion-mnist`` package (IDX files, gzip), for the continual benchmark.

The package installs ``train-images-idx3-ubyte.gz``, ``train-labels-idx1-ubyte.gz``, ``t10k-images-idx3-ubyte.gz``
and ``t10k-labels-idx1-ubyte.gz`` under ``/usr/share/datasets/fashion-mnist``. Elsewhere, put the same four files
(from github.com/zalandoresearch/fashion-mnist) in a directory and pass it as ``root`` or set
``PLATE_INSPECT_FASHION_MNIST``. Images are 28x28 = 784 inputs scaled to [0, 1]; the official 60,000/10,000
train/test split is kept (task 1 = classes 0-4: 30,000 train / 5,000 test images; task 2 = classes 5-9 likewise).
Real MNIST has no Debian package and cannot be downloaded offline, so the paper's MNIST run is replaced by this one.
"""

from __future__ import annotations

import gzip
import os
import struct
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from plate_inspect.errors import ConfigError

if TYPE_CHECKING:
    from plate_inspect.experiments.digits import Task

DEFAULT_ROOT = Path("/usr/share/datasets/fashion-mnist")
FILES = {
    "train": ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz"),
    "test": ("t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz"),
}
HOW_TO_GET = (
    "install Debian's package (sudo apt-get install dataset-fashion-mnist), or put the four IDX .gz files from "
    "https://github.com/zalandoresearch/fashion-mnist (data/fashion) in a directory and pass that directory as "
    "data_root (CLI: --data-root) or set PLATE_INSPECT_FASHION_MNIST=/that/dir"
)


def fashion_root(root: str | os.PathLike | None = None) -> Path:
    """The directory holding the four IDX files: ``root``, else $PLATE_INSPECT_FASHION_MNIST, else Debian's path."""
    path = Path(root or os.environ.get("PLATE_INSPECT_FASHION_MNIST") or DEFAULT_ROOT)
    missing = [f for pair in FILES.values() for f in pair if not (path / f).is_file()]
    if missing:
        raise ConfigError(f"Fashion-MNIST: {path} lacks {', '.join(missing)}; {HOW_TO_GET}")
    return path


def read_idx(path: str | os.PathLike) -> np.ndarray:
    """An IDX array (gzip or plain): magic 0x0000 + type byte 0x08 (uint8) + ndim byte, big-endian int32 dims."""
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rb") as f:
        raw = f.read()
    if len(raw) < 4 or raw[0:2] != b"\x00\x00" or raw[2] != 0x08:
        raise ConfigError(f"{path}: not an unsigned-byte IDX file (magic {raw[:4].hex()}); {HOW_TO_GET}")
    ndim = raw[3]
    dims = struct.unpack(f">{ndim}i", raw[4 : 4 + 4 * ndim])
    data = np.frombuffer(raw, dtype=np.uint8, offset=4 + 4 * ndim)
    if data.size != int(np.prod(dims)):
        raise ConfigError(f"{path}: header says {dims} ({int(np.prod(dims))} bytes), file holds {data.size}")
    return data.reshape(dims)


def load_fashion_arrays(root: str | os.PathLike | None = None) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """{"train": (x [60000, 784] float32 in [0, 1], y int64), "test": (x [10000, 784], y)}."""
    base = fashion_root(root)
    out = {}
    for split, (images, labels) in FILES.items():
        x = read_idx(base / images)
        y = read_idx(base / labels)
        if x.ndim != 3 or y.ndim != 1 or x.shape[0] != y.shape[0]:
            raise ConfigError(f"{base}: {split} images {x.shape} and labels {y.shape} do not match")
        xt = torch.from_numpy(x.reshape(x.shape[0], -1).astype(np.float32) / 255.0)
        out[split] = (xt, torch.from_numpy(y.astype(np.int64)))
    return out


def _range_task(arrays: dict[str, tuple[torch.Tensor, torch.Tensor]], lo: int, hi: int) -> Task:
    from plate_inspect.experiments.digits import Task

    parts = []
    for split in ("train", "test"):
        x, y = arrays[split]
        mask = (y >= lo) & (y < hi)
        parts += [x[mask].contiguous(), (y[mask] - lo).contiguous()]
    return Task(*parts)


def load_fashion_tasks(root: str | os.PathLike | None = None) -> tuple[Task, Task]:
    """(task 1: classes 0-4, task 2: classes 5-9) on the official train/test split."""
    arrays = load_fashion_arrays(root)
    return _range_task(arrays, 0, 5), _range_task(arrays, 5, 10)


def load_fashion_pair_tasks(root: str | os.PathLike | None = None) -> list[Task]:
    """The four binary tasks 2v3, 4v5, 6v7, 8v9 (the paper's sequential appendix protocol)."""
    arrays = load_fashion_arrays(root)
    return [_range_task(arrays, lo, lo + 2) for lo in (2, 4, 6, 8)]
