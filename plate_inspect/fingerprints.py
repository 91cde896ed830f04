"""Weight fingerprints: the sha256 identity of a weight's stored bytes, from a file or from an in-memory tensor.

A bundle records each module's fingerprint; verify and the trainer-side checks recompute it to prove that the
weights they see are the ones the bundle was scanned from.
"""

from __future__ import annotations

import hashlib
import struct

import torch

__all__ = ["fingerprint_bytes", "fingerprint_parts", "fingerprint_tensor"]


def fingerprint_bytes(data: bytes | bytearray | memoryview) -> str:
    """Identity of a weight: sha256 of its stored bytes (dtype and layout as in the checkpoint)."""
    return "sha256:" + hashlib.sha256(data).hexdigest()


def fingerprint_parts(parts: list[bytes | bytearray]) -> str:
    """Identity of a weight stored in several tensors (FP8 + scales, MXFP4 blocks + scales): length-prefixed sha256.

    A single part gives the same value as :func:`fingerprint_bytes`, so dense weights keep their fingerprint.
    """
    if len(parts) == 1:
        return fingerprint_bytes(parts[0])
    h = hashlib.sha256()
    for data in parts:
        h.update(struct.pack("<Q", len(data)))
        h.update(data)
    return "sha256:" + h.hexdigest()


def fingerprint_tensor(tensor: torch.Tensor, block_bytes: int = 64 << 20) -> str:
    """The same fingerprint, computed from an in-memory tensor (e.g. a loaded model's parameter).

    Hashed in blocks copied to the CPU: numpy never sees the tensor's own storage (that would make it non-resizable,
    and FSDP2 frees an unsharded parameter by resizing its storage), and no copy of the whole weight is made.
    """
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"fingerprint_tensor takes a torch.Tensor, got {type(tensor).__name__}")
    flat = tensor.detach().contiguous().reshape(-1)
    h = hashlib.sha256()
    step = max(1, block_bytes // max(flat.element_size(), 1))
    for i in range(0, flat.numel(), step):
        h.update(flat[i : i + step].to("cpu", copy=True).view(torch.uint8).numpy().data)  # memoryview: no copy
    return "sha256:" + h.hexdigest()
