"""Weight geometry vs. activation geometry (paper appendix "Weight geometry vs. activation geometry").

For every target linear layer with weight W (d_out x d_in) and input activations X (N x d_in), compare three
k-dimensional input subspaces by the fraction of activation variance they capture,
``VE_k(S) = tr(S^T Sigma S) / tr(Sigma)`` with ``Sigma = X^T X / N`` (uncentred, as in the paper):

- the weight basis V_k: top-k right singular vectors of W (what PLATE's Q is the complement of);
- the activation oracle U_k: top-k eigenvectors of Sigma (the best any k-frame can do);
- a Haar-random k-frame (mean over several seeded draws; its expectation is k / d_in).

and the alignment ``AL_k = ||U_k^T V_k||_F^2 / k`` (1 when the subspaces coincide; chance level k / d_in).

Activations are never stored: forward pre-hooks accumulate X^T X (float64) per layer, batch by batch.

One module per job, all re-exported here (this module is the public import path): the records and the pure math,
:func:`alignment_from_moments` (:mod:`~plate_inspect.analysis.alignment_math`); the hooks on any torch model,
:func:`weight_activation_alignment` (:mod:`~plate_inspect.analysis.activations`); a local Hugging Face model with
its tokenizer run on text, :func:`hf_text_alignment` (:mod:`~plate_inspect.analysis.hf_text`; ``transformers`` is
an optional extra, imported only there, when a model is loaded).
"""

from __future__ import annotations

from plate_inspect.analysis.activations import (
    check_ks,
    collect_input_moments,
    default_module_names,
    linear_weight,
    records_from_moments,
    select_linear_modules,
    weight_activation_alignment,
)
from plate_inspect.analysis.alignment_math import (
    ActivationMoments,
    AlignmentRecord,
    alignment_from_moments,
    top_right_singular_vectors,
    variance_explained,
)
from plate_inspect.analysis.hf_text import (
    SKLEARN_TEXT_SOURCE,
    TOKENIZER_FILES,
    SeqLenCappedWarning,
    capped_seq_len,
    hf_text_alignment,
    hf_text_inputs,
    load_hf_model,
    read_text,
    sklearn_descr_text,
    special_token_frame,
    token_windows,
)
from plate_inspect.errors import AlignmentError

__all__ = [
    "SKLEARN_TEXT_SOURCE",
    "TOKENIZER_FILES",
    "ActivationMoments",
    "AlignmentError",
    "AlignmentRecord",
    "SeqLenCappedWarning",
    "alignment_from_moments",
    "capped_seq_len",
    "check_ks",
    "collect_input_moments",
    "default_module_names",
    "hf_text_alignment",
    "hf_text_inputs",
    "linear_weight",
    "load_hf_model",
    "read_text",
    "records_from_moments",
    "select_linear_modules",
    "sklearn_descr_text",
    "special_token_frame",
    "token_windows",
    "top_right_singular_vectors",
    "variance_explained",
    "weight_activation_alignment",
]
