"""Fake bundles for the report tests (reports/test_reports, reports/test_report_browser): valid bundles with random
tensors at any size without a scan, and the module shapes they are built from."""

from __future__ import annotations

from pathlib import Path

import torch

from plate_inspect.bundle import Q_DTYPES, BundleWriter, Manifest, ModuleRecord, ScanSettings
from plate_inspect.geometry import k_for_tau, random_orthonormal, select_redundant_rows

QWEN7B_TYPES = {  # module type -> [d_out, d_in] of Qwen2.5-7B
    "self_attn.q_proj": (3584, 3584),
    "self_attn.k_proj": (512, 3584),
    "self_attn.v_proj": (512, 3584),
    "self_attn.o_proj": (3584, 3584),
    "mlp.gate_proj": (18944, 3584),
    "mlp.up_proj": (18944, 3584),
    "mlp.down_proj": (3584, 18944),
}
SMALL_TYPES = {
    "self_attn.q_proj": (48, 40),
    "self_attn.v_proj": (16, 40),
    "mlp.up_proj": (96, 40),
    "mlp.down_proj": (40, 96),
}

#: an MoE layer's dense modules, and its experts' projections (DeepSeek/Qwen-MoE names)
MOE_DENSE = {"self_attn.q_a_proj": (48, 64), "mlp.shared_experts.up_proj": (40, 64)}
MOE_EXPERTS = {"gate_proj": (40, 64), "down_proj": (64, 40)}


def write_fake_bundle(
    path: Path,
    layers: int,
    types: dict[str, tuple[int, int]],
    *,
    r: int = 8,
    tau: float = 0.9,
    max_rank: int = 32,
    seed: int = 0,
    q_dtype: str = "float32",
    wall_seconds: float | None = 12.5,
    finalize: bool = True,
    extra: dict[str, tuple[int, int]] | None = None,
    experts: dict[str, tuple[int, int]] | None = None,
    n_experts: int = 0,
) -> Path:
    """A valid bundle with fake tensors: random scores with B = their top r, a random decaying spectrum with
    k and k_by_tau derived from it as the scanner derives them, Q a random orthonormal d_in x k basis.

    ``experts`` (projection -> shape) adds ``n_experts`` experts per layer, named as DeepSeek/Qwen-MoE name
    them (``model.layers.N.mlp.experts.E.<proj>``, module type ``mlp.experts.<proj>``)."""
    gen = torch.Generator().manual_seed(seed)
    settings = ScanSettings(r=r, tau=tau, max_rank=max_rank, seed=seed, q_dtype=q_dtype)
    grid = sorted({*settings.tau_grid, tau})
    targets = [(f"model.layers.{i}.{t}", i, t, shp) for i in range(layers) for t, shp in types.items()]
    targets += [
        (f"model.layers.{i}.mlp.experts.{e}.{p}", i, f"mlp.experts.{p}", shp)
        for i in range(layers)
        for e in range(n_experts)
        for p, shp in (experts or {}).items()
    ]
    targets += [(name, None, name, shp) for name, shp in (extra or {}).items()]
    bases: dict[int, torch.Tensor] = {}  # experts share one orthonormal basis per d_in (fast at 46k modules)
    manifest = Manifest(
        source={"kind": "local", "id": f"/models/fake-{seed}", "revision": None, "commit": None},
        settings=settings,
        planned=[t[0] for t in targets],
        source_signature=f"fake-{seed}",
        model_type="qwen2",
        selection_note="fake modules for tests",
    )
    writer = BundleWriter(path, manifest)
    writer.open()
    parts: dict[str, list] = {}
    for t in targets:
        parts.setdefault("other" if t[1] is None else f"layer-{t[1]:05d}", []).append(t)
    for part, members in parts.items():
        records, tensors = [], {}
        for name, layer, mtype, (d_out, d_in) in members:
            scores = torch.rand(d_out, generator=gen) * 0.2 + 0.02
            b = select_redundant_rows(scores, r)
            n = min(d_out - len(b), d_in)
            decay = torch.rand(1, generator=gen).item() * 8 + 2
            spectrum = torch.exp(-decay * torch.linspace(0, 1, n)) * (1 + torch.rand(1, generator=gen).item())
            spectrum = torch.sort(spectrum, descending=True).values.to(torch.float32)
            k = k_for_tau(spectrum, tau, d_in, max_rank)
            full = torch.cat([spectrum.double(), torch.zeros(d_in - n, dtype=torch.float64)])
            captured = float(full[d_in - k :].sum() / full.sum())
            if ".experts." in name:
                if d_in not in bases:
                    bases[d_in] = random_orthonormal(d_in, d_in, seed=d_in)
                q = bases[d_in][:, :k].to(Q_DTYPES[q_dtype]).contiguous()
            else:
                q = random_orthonormal(d_in, k, seed=len(records) + 7 * (layer or 0)).to(Q_DTYPES[q_dtype])
            records.append(
                ModuleRecord(
                    name=name,
                    module_type=mtype,
                    layer=layer,
                    shape=[d_out, d_in],
                    layout="linear",
                    dtype="BF16",
                    r=len(b),
                    k=k,
                    captured_energy=captured,
                    total_energy=float(spectrum.double().sum()),
                    mean_redundancy=float(scores.double().mean()),
                    k_by_tau={f"{t:g}": k_for_tau(spectrum, t, d_in, max_rank) for t in grid},
                    fingerprint="sha256:" + "0" * 64,
                    file=f"{part}.safetensors",
                )
            )
            tensors.update(
                {
                    f"{name}.plate_B_idx": b,
                    f"{name}.plate_Q": q,
                    f"{name}.redundancy": scores.to(torch.float32),
                    f"{name}.spectrum": spectrum,
                }
            )
        writer.write_part(f"{part}.safetensors", records, tensors)
    if finalize:
        writer.finalize({"wall_seconds": wall_seconds, "device": "cpu"} if wall_seconds is not None else None)
    return path
