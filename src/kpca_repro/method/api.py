"""The notebook API: per-head KPCA metrics of any q, k, v (and h), without Snakemake.

``kpca_repro.analyze_heads`` is the function; ``kpca_repro.analyze_file`` runs the pipeline's
own stage (:func:`kpca_repro.method.records.kpca_records`) on an activation file
(docs/activations.md). Both reach the same engine, :func:`kpca_repro.method.kpca.head_metrics`, with
the same per-head grouping (:func:`kpca_repro.method.records._equal_length_groups`), the same options and the
same random baselines, so a head's numbers are the same from either (tests/test_activations.py
checks equality on real DeiT-Tiny and MiniLM activations).
"""

from __future__ import annotations

import math
import os
from types import SimpleNamespace

import numpy as np
import pandas as pd

__all__ = ["analyze_heads", "analyze_file"]


def _four_d(x, name: str) -> np.ndarray:
    """``(N, d)`` / ``(H, N, d)`` / ``(B, H, N, d)`` -> float32 ``(B, H, N, d)``."""
    if hasattr(x, "detach"):
        x = x.detach().cpu()
        x = (x.float() if str(x.dtype) == "torch.bfloat16" else x).numpy()  # numpy has no bfloat16; float32 holds it exactly
    a = np.asarray(x)
    if a.dtype.kind != "f":
        raise TypeError(f"{name} must be a floating-point array, got dtype {a.dtype}")
    if a.ndim not in (2, 3, 4):
        raise ValueError(f"{name} must be (N, d), (H, N, d) or (B, H, N, d); got shape {a.shape}")
    return np.ascontiguousarray(a.reshape((1,) * (4 - a.ndim) + a.shape).astype(np.float32, copy=False))


def _padding_mask(attention_mask, n_in: int, n_tokens: int) -> np.ndarray:
    """A language model's ``attention_mask`` (numpy or torch, ``B * N`` entries, 1 = real token) as int64 ``(B, N)``.

    Raises:
        ValueError: it does not hold ``B * N`` entries, or an input has no real token.
    """
    mask = np.asarray(attention_mask.detach().cpu() if hasattr(attention_mask, "detach") else attention_mask).reshape(-1, n_tokens) if np.size(attention_mask) == n_in * n_tokens else None
    if mask is None:
        raise ValueError(f"attention_mask must be (B, N) = ({n_in}, {n_tokens}), got shape {np.shape(attention_mask)}")
    empty = np.flatnonzero(~mask.astype(bool).any(axis=1))
    if empty.size:
        raise ValueError(f"attention_mask: input {int(empty[0])} has no real token (all padding); leave that input out")
    return mask.astype(np.int64)


def _check_token_counts(mask: np.ndarray | None, n_tokens: int, excluded: bool) -> None:
    """Refuse heads with fewer than :data:`kpca_repro.method.records.MIN_TOKENS` analysed tokens (the full-prefix reading).

    ``excluded``: each input's real tokens are analysed (the mask's counts); else all ``N``.

    Raises:
        ValueError: one line naming ``attention_mask`` (an input's real tokens) or ``k`` (``N``) and the reason.
    """
    from kpca_repro.method.records import FEW_TOKENS_REASON, too_few_tokens

    if excluded and mask is not None:
        lengths = mask.astype(bool).sum(axis=1)
        short = np.flatnonzero(too_few_tokens(lengths))
        if short.size:
            i, n = int(short[0]), int(lengths[short[0]])
            raise ValueError(f"attention_mask: input {i} has {n} real token{'s' * (n != 1)} ({short.size} such input{'s' * (short.size > 1)}); leave it out: {FEW_TOKENS_REASON}")
    elif too_few_tokens(n_tokens):
        raise ValueError(f"k: N = {n_tokens} token{'s' * (n_tokens != 1)} per head; {FEW_TOKENS_REASON}")


def _check_capture(q, k4: np.ndarray, v4: np.ndarray, h, mask: np.ndarray | None, layer: int, tolerance: float | None, causal: bool = False, kv: np.ndarray | None = None) -> None:
    """The capture invariant (docs/method.md 0.1) on in-memory tensors: ``h`` must equal ``softmax(s q k^T + mask) v``.

    ``k4``, ``v4``: float32 ``(B, H_kv, N, d)``; ``q``, ``h`` (``(B, H, N, d)``) in any form
    :func:`_four_d` reads; ``mask``: int64 ``(B, N)`` or None; ``causal``: keys ``j <= i`` only;
    ``kv``: ``(H,)`` the KV head of each query head (None: ``H_kv = H``, the identity);
    ``s = 1/sqrt(d)``; relative error ``max |h - h_hat| / max |v|`` at most ``tolerance`` (default
    :data:`kpca_repro.activations.INVARIANT_RTOL`), recomputed in float64.

    Raises:
        ValueError: ``q`` is None, or the shapes of q, k, v, h disagree.
        kpca_repro.activations.CaptureMismatchError: the invariant fails.
    """
    from kpca_repro.activations import INVARIANT_RTOL, attention_mask_matrix, check_attention_invariant

    if q is None:
        raise ValueError("h is given but q is None: the invariant needs q")
    q4, h4 = _four_d(q, "q"), _four_d(h, "h")
    n_kv = q4.shape[1] if kv is None else k4.shape[1]
    if k4.shape != (q4.shape[0], n_kv, *q4.shape[2:]) or h4.shape != q4.shape:
        raise ValueError(f"q, k, v, h must have one shape (k and v with the KV heads); got {q4.shape}, {k4.shape}, {v4.shape}, {h4.shape}")
    n_tokens, d = k4.shape[2:]
    allowed = attention_mask_matrix(n_tokens, key_mask=mask, causal=causal)
    check_attention_invariant(
        "analyze_heads", layer, q4, k4, v4, h4, scale=1.0 / math.sqrt(d), allowed=allowed, query_mask=mask, kv_head_of_query=kv, tolerance=INVARIANT_RTOL if tolerance is None else tolerance
    )


def _kv_map(kv_head_of_query, n_heads: int | None, n_kv_heads: int) -> np.ndarray | None:
    """``kv_head_of_query`` as int64 ``(H,)``, or None for the identity (``H = H_kv``).

    Raises:
        ValueError: it is not ``(H,)`` with values in ``[0, H_kv)`` (``H`` from ``q``), or ``q``
            has other heads than ``k`` without it.
    """
    if kv_head_of_query is None:
        if n_heads is not None and n_heads != n_kv_heads:
            raise ValueError(f"q has {n_heads} heads and k {n_kv_heads}: give kv_head_of_query (grouped-query attention)")
        return None
    kv = np.asarray(kv_head_of_query, dtype=np.int64)
    if kv.ndim != 1 or (n_heads is not None and kv.shape != (n_heads,)) or kv.min(initial=0) < 0 or kv.max(initial=0) >= n_kv_heads:
        raise ValueError(f"kv_head_of_query must be ({n_heads},) KV-head indices in [0, {n_kv_heads}), got {kv_head_of_query!r}")
    return kv


def _input_numbers(sample_rank, dataset_index, n_in: int) -> tuple[np.ndarray, np.ndarray]:
    """``(sample_rank, dataset_index)`` of the ``B`` inputs as ``(B,)`` arrays (default ``0 .. B-1`` each).

    Raises:
        ValueError: either is given with a shape other than ``(B,)``.
    """
    ranks = np.arange(n_in) if sample_rank is None else np.asarray(sample_rank, dtype=np.int64)
    index = np.arange(n_in) if dataset_index is None else np.asarray(dataset_index, dtype=np.int64)
    if ranks.shape != (n_in,) or index.shape != (n_in,):
        raise ValueError(f"sample_rank and dataset_index must be ({n_in},)")
    return ranks, index


def analyze_heads(
    q,
    k,
    v,
    h=None,
    *,
    variant: str = "paper",
    attention_mask=None,
    layer: int = 0,
    sample_rank=None,
    dataset_index=None,
    seed: int = 0,
    device: str = "cpu",
    eigh_threads: int | None = None,
    heads_per_chunk: int = 64,
    sign_draws: tuple[int, int] | None = None,
    tolerance: float | None = None,
    causal: bool = False,
    kv_head_of_query=None,
    prefix: int | None = None,
) -> pd.DataFrame:
    """Per-head KPCA metrics of one or many attention heads, in either variant (docs/method.md).

    For each head (keys ``K`` and values ``V``, ``N`` tokens x ``d``), with ``s = 1/sqrt(d)``:

    * Gram matrix and centering (docs/method.md 0.2): ``K_phi = exp(s K K^T) / (g g^T + eps)``,
      ``g_i = sum_j exp(s k_i.k_j)``, ``K~ = K_phi - 1_N K_phi - K_phi 1_N + 1_N K_phi 1_N``
      (``1_N`` the matrix of ``1/N``); ``paper``: float32, ``eps = 1e-6``; ``corrected``:
      float64, computed in the log domain, ``eps = 0``;
    * eigenpairs ``K~ a_r = lambda_r a_r``, the top ``d`` (paper: by ``|lambda|``; corrected:
      descending, sign of each eigenvector's largest entry positive) form ``A`` (N x d);
    * ``V_KPCA = G A - G 1_N A`` (Eq. 5, ``G = diag(1/g)``), compared with ``V``: ``allclose``, the direct and optimal
      (Hungarian-matched) token-row cosines ``cos(v_i, v^KPCA_j)`` (mean, max, min), linear CKA
      and RBF CKA; corrected: column-wise ``|cos|`` and the same statistics against a standard
      normal ``V_KPCA`` seeded by ``(seed, dataset_index, layer)`` (``baseline_*``).

    Language-model inputs (``attention_mask`` given) follow Table 4: ``paper`` analyses all
    ``N`` positions with the NLP script's options (ascending top-``d``, ``g + 1e-6``, NaN costs
    -> 0, ``sqrt(HSIC_xx HSIC_yy) + 1e-10``); ``corrected`` keeps each input's real tokens only.

    Decoders' heads (``causal=True``, docs/method.md 16): each input's real tokens in both
    variants (padding on either side left out); ``prefix=None`` the full-prefix view (the
    encoder analysis of those tokens), ``prefix=P`` the prefix profile at ``P`` (first ``P`` real
    tokens; inputs with fewer left out). With grouped-query attention ``k`` and ``v`` hold the
    ``H_kv`` KV heads and the rows are per KV head; ``q`` and ``h`` keep the ``H`` query heads.

    Args:
        q: queries ``(B, H, N, d)``, ``(H, N, d)`` or ``(N, d)`` (numpy or torch, any float
            dtype; rounded to float32 as the activation files store them). Only used, with
            ``h``, for the capture invariant; may be None when ``h`` is None. Half precision
            (float16, bfloat16) with ``h`` needs an explicit ``tolerance``: its rounding alone
            (2^-11, 2^-8 relative) exceeds the default one.
        k, v: keys and values, the same shape as ``q`` (``v``'s last dimension must equal ``d``;
            with ``kv_head_of_query``, ``H_kv`` heads).
        h: the attention's per-head output, same shape; when given, the invariant
            ``max |h - softmax(s q k^T + mask) v| / max |v| <= tolerance`` is checked first
            (recomputed in float64 from the float32 tensors).
        variant: ``"paper"`` or ``"corrected"`` (:mod:`kpca_repro.method.variant`).
        attention_mask: ``(B, N)`` 0/1, 1 = real token (language models); None = all real
            (vision). Every input needs a real token, and where the reading keeps each input's
            real tokens (``corrected``, or ``causal``) at least
            :data:`kpca_repro.method.records.MIN_TOKENS` (3) of them: with ``N`` tokens the
            centered Gram matrix has at most ``N - 1`` non-zero eigenvalues, none at ``N = 1``
            (V_KPCA = 0) and one at ``N = 2`` (both CKAs 1 for any k and v); docs/method.md 16.2.
        layer: the layer index written to the records and used to seed the baselines.
        sample_rank, dataset_index: ``(B,)`` integers (default ``0 .. B-1``); ``dataset_index``
            seeds the corrected variant's baselines as in the pipeline.
        seed: the pipeline's ``seed`` (baselines, sign draws).
        device: where the Gram matrices are computed (``"cpu"``, ``"cuda"``).
        eigh_threads: paper variant: torch intra-op threads of each CPU ``eigh`` (the
            pipeline uses torch's default count and records it as ``eigh_threads`` in each
            records JSON); None: the caller's. Pass that value, with
            ``torch.set_num_threads(1)`` as the rule sets it, for bit-identical numbers.
        heads_per_chunk: heads per engine call (no number depends on it on the CPU).
        sign_draws: ``(n_direct, n_optimal)`` solver draws per head: eigenvector signs, and
            rotations inside near-degenerate eigenspaces
            (:func:`kpca_repro.method.solver_variation.head_solver_draws`, as the ``kpca_heads``
            rule with ``uncertainty.sign_draws`` / ``sign_draws_optimal``); adds the columns
            ``eigengap_min``, ``solver_groups``, ``solver_group_max``,
            ``solver_boundary_group``, and returns the draws, name -> ``(heads, R)`` in the
            rows' order, in ``df.attrs["sign_draws"]``.
        tolerance: the invariant's tolerance (default 1e-4, :mod:`kpca_repro.activations`,
            for float32 or float64 tensors; give one for half precision).
        causal: a decoder's heads: query ``i`` attends to the keys ``j <= i`` (the invariant, the reading above).
        kv_head_of_query: ``(H,)`` the KV head each query head reads (grouped-query attention:
            ``k``, ``v`` are ``(B, H_kv, N, d)``); None: ``H_kv = H``.
        prefix: an integer ``P >= 3`` (:data:`~kpca_repro.method.records.MIN_TOKENS`), the
            prefix profile of causal heads; None: the full-prefix view.

    Returns:
        One row per (input, head): ``variant, layer, sample_rank, dataset_index, head, n_tokens,
        head_dim`` and the metric columns of the pipeline's per-head records
        (docs/internals.md "Per-head records"): flags ``finite, dropped, exp_overflow,
        outer_overflow, allclose`` (bool), ``direct_cos_mean|max|min``, ``direct_cos_frac_negative``,
        ``optimal_cos_mean|max|min``, ``linear_cka``, ``rbf_cka`` (float64, dimensionless;
        NaN for a dropped head). Rows in the pipeline's order: input-major for vision, grouped
        by real-token count for the corrected variant of language models.

    Raises:
        ValueError: shapes disagree, an unknown variant, a mask of the wrong shape, an input
            without a real token, heads of fewer than 3 analysed tokens (``N``, or an input's
            real tokens), a wrong ``kv_head_of_query``, ``prefix`` without ``causal`` or below
            3, half-precision tensors with ``h`` and no ``tolerance``; each in one line naming
            the argument and the reason.
        TypeError: a non-float array, a non-integer ``prefix``.
        kpca_repro.activations.CaptureMismatchError: ``h`` is given and q, k, v do not reproduce it
            (the message gives the measured error, input and head).
    """

    from kpca_repro.activations import half_precision_problem
    from kpca_repro.method.placement import plan
    from kpca_repro.method.records import _chunked, _equal_length_groups, check_prefix, chunk_records, no_records, projection_test_wanted
    from kpca_repro.method.uncertainty import BOUND_NAMES, MEAN_VECTOR, RANGE_NAMES, SIGN_DRAW_NAMES
    from kpca_repro.method.variant import get as get_variant

    var = get_variant(variant)
    k4, v4 = _four_d(k, "k"), _four_d(v, "v")
    if k4.shape != v4.shape:
        raise ValueError(f"k and v must have one shape (B, H, N, d); got {k4.shape} and {v4.shape}")
    n_in, n_kv, n_tokens, _ = k4.shape
    check_prefix(prefix)
    if prefix is not None and not causal:
        raise ValueError(f"prefix={prefix}: the prefix profile is of causal heads; pass causal=True (a decoder's heads)")
    kv = _kv_map(kv_head_of_query, None if q is None else _four_d(q, "q").shape[1], n_kv)
    mask = None if attention_mask is None else _padding_mask(attention_mask, n_in, n_tokens)
    var = var.reading(text=mask is not None or causal, causal=causal)
    if prefix is None:  # a prefix profile leaves out the inputs shorter than P
        _check_token_counts(mask, n_tokens, excluded=var.text_padding == "excluded")
    if h is not None:
        half = half_precision_problem({"q": q, "k": k, "v": v, "h": h}, tolerance)
        if half is not None:
            raise ValueError(half)
        _check_capture(q, k4, v4, h, mask, layer, tolerance, causal=causal, kv=kv)
    ranks, index = _input_numbers(sample_rank, dataset_index, n_in)
    placement = plan(var, device=device, cores=1, eigh_threads=eigh_threads)
    # the records stage's own grouping of heads (padding kept or dropped, baselines per input)
    source = SimpleNamespace(attention_mask=mask, sample_rank=ranks, dataset_index=index, causal=causal, kv_head_of_query=kv)
    tensors = {"k": k4, "v": v4}
    if q is not None and h is not None and projection_test_wanted(var, causal):  # the projection test (docs/method.md 17.3)
        tensors.update(q=_four_d(q, "q"), h=_four_d(h, "h"))
    frames, draw_parts = [], []
    for chunk in _chunked(_equal_length_groups(source, tensors, var, layer, seed, transposed=False, prefix=prefix), layer, heads_per_chunk):
        draws, frame = chunk_records(*chunk, variant=var, placement=placement, sign_draws=sign_draws, seed=seed)
        draw_parts.append(draws)
        frame.insert(0, "variant", var.name)
        frames.append(frame)
    if not frames:  # a prefix no input reaches
        return no_records()
    out = pd.concat(frames, ignore_index=True)
    if sign_draws:
        out.attrs["sign_draws"] = {name: np.concatenate([p[name] for p in draw_parts]) for name in (*SIGN_DRAW_NAMES, MEAN_VECTOR, *BOUND_NAMES, *RANGE_NAMES)}
    return out


def analyze_file(path: str | os.PathLike, variant: str = "paper", *, device: str = "cpu", seed: int = 0, **kwargs) -> pd.DataFrame:
    """The per-head records of one activation file (docs/activations.md), as the pipeline writes them.

    Calls :func:`kpca_repro.method.records.kpca_records` (the ``kpca_heads`` rule's function) and
    returns its records; ``kwargs`` go to it (``heads_per_chunk``, ``workers``, ``layers``,
    ``eigh_threads``, ``sign_draws``, ``prefix`` for a decoder's file: docs/method.md 16). Validate a file of your own first
    (``python -m kpca_repro.activations validate FILE``).

    Raises:
        kpca_repro.activations.CorruptActivationFileError: the file is unreadable.
    """

    from kpca_repro.method.records import kpca_records

    records, _ = kpca_records(path, variant, device=device, seed=seed, progress=False, **kwargs)
    return records
