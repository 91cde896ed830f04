"""Audit any fine-tune from the weights alone: how much of each update lands where the frozen rows live.

For a module with base weight W (d_out x d_in), update dW (tuned minus base), B the redundant output rows (the
bundle's, or chosen exactly as the scan chooses them) and W_f the rows outside B:

- ``protected_input_share`` = ||dW P||_F^2 / ||dW||_F^2, P the projector onto the top-m(tau) eigenvectors of
  W_f^T W_f: the input directions holding a tau fraction of the frozen rows' energy;
- ``frozen_row_share`` = the share of ||dW||_F^2 on rows outside B;
- ``delta_norm`` = ||dW||_F and ``relative_delta`` = ||dW||_F / ||W||_F.

A fine-tuned checkpoint stored coarser than BASE (bf16 of an fp32 base; FP8 with block scales or MXFP4 of a bf16/fp32
base) gives dW = TUNED - BASE rounded to TUNED's storage (:func:`rounding_reference`; FP8 and MXFP4 at TUNED's own
scales): the
rounding or quantization of the save is not an update. Records say so (``base_rounded_to``, ``rounding_floor``).

A PLATE update (rows in B, inputs in the bottom eigenspace Q) scores 0 on both; a dense isotropic random update
scores m(tau)/d_in on the first and (d_out - r)/d_out on the second. Per-module ``risk`` = ||dW P||_F / ||W||_F
(the update's size inside the protected directions, relative to the weight) ranks modules.

TUNED is a fine-tuned checkpoint (dir, ``.safetensors`` file or hub id), a PEFT LoRA adapter dir
(dW = (alpha/r) B A, rsLoRA alpha/sqrt(r), ``rank_pattern``/``alpha_pattern`` honoured), or a PLATE adapter
(a ``save_adapter`` file, a dir holding one, or a PEFT ``plate`` adapter dir: dW = rho B A Q^T on B's rows).
Streaming: one module's weights are in memory at a time; low-rank updates are never formed densely.

One module per job:

- :mod:`.updates`: an update dW (dense or low rank) and the storage rounding model (pure functions);
- :mod:`.measures`: the protected input directions, one module's record, a model's summary, table and notes;
- :mod:`.sources`: where dW comes from: a fine-tuned checkpoint, a LoRA adapter, a PLATE adapter;
- :mod:`.driver`: the streaming audit (:func:`audit`).
"""

from plate_inspect.auditing.driver import (
    audit,
    bundle_origin,
    check_bundle_fits_base,
    select_by_filters,
    targets_by_name,
)
from plate_inspect.auditing.measures import (
    AUDIT_KEYS,
    ROUNDING_KEYS,
    SWAPPED_KEYS,
    TABLE_COLUMNS,
    AuditRecord,
    AuditSummary,
    ProtectedSubspace,
    audit_notes,
    audit_update,
    protected_energy,
    protected_subspace,
    rank_by_risk,
    rounding_kind,
    rounding_note,
    summarize,
    swapped_note,
    table_cells,
)
from plate_inspect.auditing.sources import (
    CheckpointUpdate,
    LoraUpdate,
    PlateUpdate,
    UpdateSource,
    open_update,
    resolve_names,
)
from plate_inspect.auditing.updates import (
    MXFP4,
    Delta,
    LowRankDelta,
    Storage,
    delta_row_energy,
    delta_shape_ok,
    delta_times,
    fp8_storage,
    grid_step,
    mxfp4_storage,
    quantized_storage,
    round_e2m1,
    rounded_like,
    rounding_reference,
    storage_label,
)

__all__ = [
    "AUDIT_KEYS",
    "AuditRecord",
    "AuditSummary",
    "CheckpointUpdate",
    "Delta",
    "LoraUpdate",
    "LowRankDelta",
    "MXFP4",
    "PlateUpdate",
    "ProtectedSubspace",
    "ROUNDING_KEYS",
    "SWAPPED_KEYS",
    "Storage",
    "TABLE_COLUMNS",
    "UpdateSource",
    "audit",
    "audit_notes",
    "audit_update",
    "bundle_origin",
    "check_bundle_fits_base",
    "delta_row_energy",
    "delta_shape_ok",
    "delta_times",
    "fp8_storage",
    "grid_step",
    "mxfp4_storage",
    "open_update",
    "protected_energy",
    "protected_subspace",
    "quantized_storage",
    "rank_by_risk",
    "resolve_names",
    "round_e2m1",
    "rounded_like",
    "rounding_kind",
    "rounding_note",
    "rounding_reference",
    "select_by_filters",
    "storage_label",
    "summarize",
    "swapped_note",
    "table_cells",
    "targets_by_name",
]
