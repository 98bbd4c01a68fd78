"""The notebook API: per-head KPCA metrics of any q, k, v (and h), without Snakemake.

``kpca_repro.analyze_heads`` analyses heads held in memory (:class:`~kpca_repro.method.heads.HeadArrays`),
``kpca_repro.analyze_file`` an activation file (docs/activations.md); both run the pipeline's own
loop (:func:`kpca_repro.method.records.kpca_records`) as one :class:`~kpca_repro.method.job.KpcaJob`
says, so a head's numbers and draws are the same from either (tests/test_one_way_in.py).
"""

from __future__ import annotations

import math
import os

import numpy as np
import pandas as pd

from kpca_repro.method.heads import FEW_TOKENS_REASON, HeadArrays, too_few_tokens
from kpca_repro.method.job import KpcaJob

__all__ = ["analyze_heads", "analyze_file", "HeadArrays", "KpcaJob"]


def _check_capture(heads: HeadArrays, tolerance: float | None) -> None:
    """The capture invariant (docs/method.md 0.1) on in-memory heads: ``h`` must equal ``softmax(s q k^T + mask) v``.

    ``heads.k``, ``heads.v``: float32 ``(B, H_kv, N, d)``; ``heads.q``, ``heads.h`` float32
    ``(B, H, N, d)``; the mask int64 ``(B, N)`` or None; causal: keys ``j <= i`` only;
    ``kv_head_of_query``: ``(H,)`` the KV head of each query head (None: ``H_kv = H``);
    ``s = 1/sqrt(d)``; relative error ``max |h - h_hat| / max |v|`` at most ``tolerance`` (default
    :data:`kpca_repro.activations.INVARIANT_RTOL`), recomputed in float64.

    Raises:
        ValueError: ``q`` is None, or the shapes of q, k, v, h disagree.
        kpca_repro.activations.CaptureMismatchError: the invariant fails.
    """
    from kpca_repro.activations import INVARIANT_RTOL, attention_mask_matrix, check_attention_invariant

    q4, k4, v4, h4, kv, mask = heads.q, heads.k, heads.v, heads.h, heads.kv_head_of_query, heads.attention_mask
    if q4 is None:
        raise ValueError("h is given but q is None: the invariant needs q")
    n_kv = q4.shape[1] if kv is None else k4.shape[1]
    if k4.shape != (q4.shape[0], n_kv, *q4.shape[2:]) or h4.shape != q4.shape:
        shapes = f"{q4.shape}, {k4.shape}, {v4.shape}, {h4.shape}"
        raise ValueError(f"q, k, v, h must have one shape (k and v with the KV heads); got {shapes}")
    n_tokens, d = k4.shape[2:]
    check_attention_invariant(
        "analyze_heads",
        heads.layer,
        q4,
        k4,
        v4,
        h4,
        scale=1.0 / math.sqrt(d),
        allowed=attention_mask_matrix(n_tokens, key_mask=mask, causal=heads.causal),
        query_mask=mask,
        kv_head_of_query=kv,
        tolerance=INVARIANT_RTOL if tolerance is None else tolerance,
    )


def _check_token_counts(heads: HeadArrays, excluded: bool) -> None:
    """Refuse heads with fewer than :data:`kpca_repro.method.heads.MIN_TOKENS` analysed tokens (the
    full-prefix reading).

    ``excluded``: each input's real tokens are analysed (the mask's counts); else all ``N``.

    Raises:
        ValueError: one line naming ``attention_mask`` (an input's real tokens) or ``k`` (``N``) and the reason.
    """
    mask, n_tokens = heads.attention_mask, heads.n_tokens
    if excluded and mask is not None:
        lengths = mask.astype(bool).sum(axis=1)
        short = np.flatnonzero(too_few_tokens(lengths))
        if short.size:
            i, n = int(short[0]), int(lengths[short[0]])
            such = f"{short.size} such input{'s' * (short.size > 1)}"
            has = f"input {i} has {n} real token{'s' * (n != 1)} ({such})"
            raise ValueError(f"attention_mask: {has}; leave it out: {FEW_TOKENS_REASON}")
    elif too_few_tokens(n_tokens):
        raise ValueError(f"k: N = {n_tokens} token{'s' * (n_tokens != 1)} per head; {FEW_TOKENS_REASON}")


def analyze_heads(
    heads: HeadArrays,
    job: KpcaJob | str | None = None,
    tolerance: float | None = None,
) -> tuple[pd.DataFrame, dict[str, np.ndarray]]:
    """Per-head KPCA metrics of one or many attention heads held in memory, in either variant (docs/method.md).

    The heads' arrays (:class:`~kpca_repro.method.heads.HeadArrays`: ``q, k, v, h``, the mask,
    causal, the KV groups, the inputs' numbers, the layer) are checked, then go through the
    pipeline's own loop (:func:`kpca_repro.method.records.kpca_records`) as ``job`` says
    (:class:`~kpca_repro.method.job.KpcaJob`; a variant name: that variant's default job; None:
    the paper variant's). For each head (keys ``K`` and values ``V``, ``N`` tokens x ``d``),
    with ``s = 1/sqrt(d)``:

    * Gram matrix and centering (docs/method.md 0.2): ``K_phi = exp(s K K^T) / (g g^T + eps)``,
      ``g_i = sum_j exp(s k_i.k_j)``, ``K~ = K_phi - 1_N K_phi - K_phi 1_N + 1_N K_phi 1_N``
      (``1_N`` the matrix of ``1/N``); ``paper``: float32, ``eps = 1e-6``; ``corrected``:
      float64, computed in the log domain, ``eps = 0``;
    * eigenpairs ``K~ a_r = lambda_r a_r``, the top ``d`` (paper: by ``|lambda|``; corrected:
      descending, sign of each eigenvector's largest entry positive) form ``A`` (N x d);
    * ``V_KPCA = G A - G 1_N A`` (Eq. 5, ``G = diag(1/g)``), compared with ``V``: ``allclose``,
      the direct and optimal (Hungarian-matched) token-row cosines ``cos(v_i, v^KPCA_j)`` (mean,
      max, min), linear CKA and RBF CKA; corrected: column-wise ``|cos|`` and the same statistics
      against a standard normal ``V_KPCA`` seeded by ``(seed, dataset_index, layer)`` (``baseline_*``).

    Language-model inputs (``attention_mask`` given) follow Table 4: ``paper`` analyses all
    ``N`` positions with the NLP script's options (ascending top-``d``, ``g + 1e-6``, NaN costs
    -> 0, ``sqrt(HSIC_xx HSIC_yy) + 1e-10``); ``corrected`` keeps each input's real tokens only.
    Every input needs a real token, and where the reading keeps each input's real tokens
    (``corrected``, or causal) at least :data:`~kpca_repro.method.heads.MIN_TOKENS` (3) of them:
    with ``N`` tokens the centered Gram matrix has at most ``N - 1`` non-zero eigenvalues, none
    at ``N = 1`` (V_KPCA = 0) and one at ``N = 2`` (both CKAs 1 for any k and v); docs/method.md 16.2.

    Decoders' heads (``causal=True``, docs/method.md 16): each input's real tokens in both
    variants (padding on either side left out); ``job.prefix=None`` the full-prefix view (the
    encoder analysis of those tokens), ``prefix=P`` the prefix profile at ``P`` (first ``P`` real
    tokens; inputs with fewer left out). With grouped-query attention ``k`` and ``v`` hold the
    ``H_kv`` KV heads and the rows are per KV head; ``q`` and ``h`` keep the ``H`` query heads.

    With ``h``, the capture invariant ``max |h - softmax(s q k^T + mask) v| / max |v| <= tolerance``
    is checked first (recomputed in float64 from the float32 tensors; default tolerance 1e-4,
    :data:`kpca_repro.activations.INVARIANT_RTOL`, for float32 or float64 tensors). Half
    precision (float16, bfloat16) needs an explicit ``tolerance``: its rounding alone (2^-11,
    2^-8 relative) exceeds the default one. For bit-identical numbers with the pipeline's paper
    variant, give the job the rule's placement (``plan("paper", device="cpu", eigh_threads=T)``
    with ``T`` the ``eigh_threads`` of the records JSON) and call ``torch.set_num_threads(1)``
    as the rule does.

    Returns:
        ``(records, draws)``. ``records``: one row per (input, head): ``variant, sample_rank,
        dataset_index, layer, head, n_tokens, head_dim`` and the metric columns of the pipeline's
        per-head records (docs/internals.md "Per-head records"): flags ``finite, dropped,
        exp_overflow, outer_overflow, allclose`` (bool), ``direct_cos_mean|max|min``,
        ``direct_cos_frac_negative``, ``optimal_cos_mean|max|min``, ``linear_cka``, ``rbf_cka``
        (float64, dimensionless; NaN for a dropped head), and with ``job.sign_draws`` the
        columns ``eigengap_min``, ``solver_groups``, ``solver_group_max``,
        ``solver_boundary_group``. Rows in the pipeline's order: input-major for vision, grouped
        by real-token count where padding is left out. ``draws``: the solver draws, name ->
        float32 ``(heads, R)`` in the rows' order (``R = 0`` without ``job.sign_draws``).

    Raises:
        ValueError: heads of fewer than 3 analysed tokens (``N``, or an input's real tokens),
            ``job.prefix`` for heads that are not causal, ``h`` without ``q``, q, k, v, h of
            disagreeing shapes, half-precision tensors with ``h`` and no ``tolerance``; each in
            one line naming the argument and the reason (the arrays' own checks:
            :class:`~kpca_repro.method.heads.HeadArrays`).
        kpca_repro.activations.CaptureMismatchError: ``h`` is given and q, k, v do not reproduce it
            (the message gives the measured error, input and head).
    """
    from kpca_repro.method.records import kpca_records

    job = KpcaJob.of(job)
    if job.prefix is not None and not heads.causal:
        fix = "pass causal=True (a decoder's heads)"
        raise ValueError(f"prefix={job.prefix}: the prefix profile is of causal heads; {fix}")
    if job.prefix is None:  # a prefix profile leaves out the inputs shorter than P
        reading = job.variant.reading(text=heads.text, causal=heads.causal)
        _check_token_counts(heads, excluded=reading.text_padding == "excluded")
    if heads.h is not None:
        if heads.half_precision is not None and tolerance is None:
            raise ValueError(heads.half_precision)
        _check_capture(heads, tolerance)
    records, _, draws = kpca_records(heads, job)
    return records.drop(columns="model"), draws


def analyze_file(path: str | os.PathLike, job: KpcaJob | str | None = None) -> pd.DataFrame:
    """The per-head records of one activation file (docs/activations.md), as the pipeline writes them.

    Calls :func:`kpca_repro.method.records.kpca_records` (the ``kpca_heads`` rule's function)
    with ``job`` (:class:`~kpca_repro.method.job.KpcaJob`, or a variant name; ``prefix`` for a
    decoder's file: docs/method.md 16) and returns its records. Validate a file of your own
    first (``python -m kpca_repro.activations validate FILE``).

    Raises:
        kpca_repro.activations.CorruptActivationFileError: the file is unreadable.
    """
    from kpca_repro.method.records import kpca_records

    records, _, _ = kpca_records(path, job)
    return records
