"""The activation file: one HDF5 file per model and shard with every layer's per-head ``q, k, v, h``.

Format version 2 (docs/activations.md Section 1; version-1 files still read and validate). One
module per step of the file's life, every public name re-exported here:

* :mod:`.format`: the layout (names, constants, ``kv_head_of_query``), the errors, :class:`Summary`;
* :mod:`.invariant`: the capture invariant (docs/method.md 0.1) the writer and the validator share;
* :mod:`.writer`: :class:`ActivationWriter`, the one writer (the pipeline's extraction and a user's
  module through :func:`kpca_repro.capture.module_capture.record_activations`), and
  :func:`write_activations` from arrays;
* :mod:`.reader`: :class:`ActivationFile`, read by the KPCA stage, the spectra and the norms;
* :mod:`.validation`: :func:`validate`, the first violation and its fix;
* :mod:`.user_files`: a user's files (config key ``activations:``): :func:`check_user_config` at
  parse time, :func:`install_user_file` in the rule ``user_activations``;
* :mod:`.cli`: ``python -m kpca_repro.activations validate FILE [--kind vision|text] [--no-invariant]``
  prints ``ok`` and a summary (exit 0) or the first violation and its fix (exit 1).

torch is imported only where the invariant is computed, so the configuration checks that import
this package at parse time stay free of it.
"""

from kpca_repro.activations.cli import main
from kpca_repro.activations.format import (
    BATCH_FIRST,
    FORMAT_VERSION,
    HALF_ROUNDING,
    INVARIANT_RTOL,
    KINDS,
    READ_VERSIONS,
    REQUIRED_ATTRS,
    SEQUENCE_FIRST,
    TENSORS,
    ActivationFileMismatchError,
    ActivationFormatError,
    CaptureMismatchError,
    CorruptActivationFileError,
    Summary,
    layer_key,
    repeat_kv_map,
)
from kpca_repro.activations.invariant import (
    InvariantResult,
    attention_invariant,
    attention_mask_matrix,
    check_attention_invariant,
    half_precision_problem,
)
from kpca_repro.activations.reader import ActivationFile
from kpca_repro.activations.user_files import check_user_config, install_user_file
from kpca_repro.activations.validation import validate
from kpca_repro.activations.writer import ActivationWriter, write_activations

__all__ = [
    "FORMAT_VERSION",
    "READ_VERSIONS",
    "TENSORS",
    "REQUIRED_ATTRS",
    "KINDS",
    "BATCH_FIRST",
    "SEQUENCE_FIRST",
    "INVARIANT_RTOL",
    "HALF_ROUNDING",
    "half_precision_problem",
    "layer_key",
    "repeat_kv_map",
    "ActivationFormatError",
    "CorruptActivationFileError",
    "CaptureMismatchError",
    "ActivationFileMismatchError",
    "InvariantResult",
    "attention_mask_matrix",
    "attention_invariant",
    "check_attention_invariant",
    "ActivationFile",
    "ActivationWriter",
    "Summary",
    "validate",
    "write_activations",
    "install_user_file",
    "check_user_config",
    "main",
]
