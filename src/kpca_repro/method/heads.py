"""Head sources: the heads one KPCA job analyses, with their masks, in chunks.

A :class:`HeadSource` is where the keys, values (and, for the projection test, queries and
outputs) of the heads come from: an activation file (:class:`FileHeads`) or arrays in memory
(:class:`HeadArrays`). Both yield the same chunks of heads for the same tensors
(:meth:`HeadSource.chunks`), so the ``kpca_heads`` rule, :func:`kpca_repro.method.records.kpca_records`
and the notebook API (:func:`kpca_repro.method.api.analyze_heads`) run one loop over them.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np
import pandas as pd
import torch

from kpca_repro.method.variant import Variant
from kpca_repro.method.variant import get as get_variant

__all__ = [
    "HeadSource",
    "FileHeads",
    "HeadArrays",
    "MIN_TOKENS",
    "too_few_tokens",
    "check_prefix",
    "baseline_noise",
    "layer_chunks",
    "no_records",
    "projection_test_wanted",
]

#: The fewest tokens a head is analysed with (docs/method.md 16.2). With ``N`` tokens the
#: centered Gram matrix has at most ``N - 1`` non-zero eigenvalues: none at ``N = 1``
#: (``V_KPCA = 0``: cosines 0, CKA 0/0) and one at ``N = 2``, where two centered rows are
#: opposite, so linear and RBF CKA are 1 for any ``k`` and ``v``.
MIN_TOKENS = 3
#: Why, in one clause (the errors and the log name it).
FEW_TOKENS_REASON = (
    f"a head needs at least {MIN_TOKENS} tokens: with N tokens the centered Gram matrix has at most "
    "N - 1 non-zero eigenvalues (none at N = 1: V_KPCA = 0, CKA 0/0; one at N = 2: both CKAs are 1 for any k and v)"
)
#: The identifying columns of every record row (int64).
ID_COLUMNS = ("sample_rank", "dataset_index", "layer", "head", "n_tokens", "head_dim")


def too_few_tokens(n_tokens) -> np.ndarray:
    """Which heads (real-token counts ``n_tokens``, any shape) have fewer than :data:`MIN_TOKENS` tokens.

    Returns a bool array of ``n_tokens``' shape. The corrected reading of language models (and
    decoders in both variants) leaves such rows out with a logged count
    (:func:`kpca_repro.method.records.kpca_records`); the notebook API refuses them
    (:func:`kpca_repro.method.api.analyze_heads`).
    """
    return np.asarray(n_tokens) < MIN_TOKENS


def check_prefix(prefix) -> None:
    """Refuse a prefix length ``P`` of the prefix profile (docs/method.md 16.1) below :data:`MIN_TOKENS`.

    ``None`` (the full-prefix view) passes. Whether the heads are causal is the caller's check.

    Raises:
        TypeError: ``prefix`` is not an integer (``bool`` included); one line naming it.
        ValueError: ``prefix < MIN_TOKENS``; one line naming it and the reason.
    """
    if prefix is None:
        return
    if isinstance(prefix, (bool, np.bool_)) or not isinstance(prefix, (int, np.integer)):
        kind = type(prefix).__name__
        what = "the prefix length P is a number of real tokens and must be an integer"
        raise TypeError(f"prefix={prefix!r}: {what}, not {kind}")
    if prefix < MIN_TOKENS:
        raise ValueError(f"prefix={prefix}: P must be at least {MIN_TOKENS}; {FEW_TOKENS_REASON}")


def baseline_noise(seed: int, dataset_index: int, layer: int, shape: tuple[int, ...]) -> torch.Tensor:
    """Standard normal stand-in for V_KPCA of one (image, layer), float64 on the CPU.

    Seeded by ``(seed, dataset_index, layer)`` so it does not depend on sharding or batching.
    """
    ss = np.random.SeedSequence([seed, int(dataset_index), int(layer)])
    gen = torch.Generator().manual_seed(int(ss.generate_state(1, dtype=np.uint64)[0] >> 1))
    return torch.randn(shape, generator=gen, dtype=torch.float64)


def no_records() -> pd.DataFrame:
    """The records of a prefix that no row reaches: no rows, the identifying int64 columns."""
    return pd.DataFrame({name: pd.Series(dtype="int64") for name in ID_COLUMNS})


def projection_test_wanted(variant: Variant, causal: bool) -> bool:
    """Whether the records of a file carry the projection test (docs/method.md 17.3): the
    corrected variant's (``variant.controls``), and a decoder's in both variants."""
    return variant.controls or causal


def _equal_length_groups(
    af,
    t: dict[str, np.ndarray],
    variant: str | Variant,
    layer: int,
    seed: int,
    transposed: bool,
    prefix: int | None = None,
):
    """Heads of one layer in groups with a common token count ``N``.

    ``af``: a :class:`HeadSource` or an :class:`~kpca_repro.activations.ActivationFile` (its
    ``attention_mask``, ``causal``, ``kv_head_of_query``, ``sample_rank``, ``dataset_index``);
    ``t``: the layer's arrays ``name -> (B, heads, N, d)``.
    Yields ``(k, v, sample_rank, dataset_index, head, baseline, q, h)``: ``k, v`` float32 tensors
    ``(heads, N, d)``, per-head index arrays, the random baseline (corrected variant) or
    None (``variant.baselines``), and where ``t`` holds ``q`` and ``h`` the projection test's
    queries and outputs ``(heads, G, M, d)`` (the ``G`` query heads of each KV head; ``M`` = every
    token, or a causal prefix's last one), else None. Three readings:

    * vision, and language models with ``variant.text_padding == "included"`` (paper): every
      (input, head) with all ``N`` stored positions (padding included, docs/method.md 3);
    * ``transposed`` (Longformer, paper variant): the reference's misreading of Longformer's
      ``(sequence, batch, hidden)`` projections (docs/method.md 3): each "head matrix" is the
      ``B`` inputs at one position ``p``, so ``sample_rank`` holds ``p`` and
      ``dataset_index`` is -1;
    * language models, ``text_padding == "excluded"`` (corrected, docs/method.md 15 item 4;
      decoders in every variant, 16.2): each input keeps only its real tokens
      (``attention_mask == 1``, on either side; a causal file without a mask: every token);
      inputs of equal length are grouped; an input with fewer than :data:`MIN_TOKENS` real
      tokens is left out. With ``prefix`` ``P`` (the prefix profile of a causal
      file, docs/method.md 16.1) each input keeps its first ``P`` real tokens, and an input with
      fewer than ``P`` is left out.

    The heads are ``k``'s: a causal file's KV heads (docs/method.md 16.4).
    """
    variant = get_variant(variant)
    k, v = t["k"], t["v"]
    n_in, n_heads = k.shape[:2]
    causal = bool(getattr(af, "causal", False))
    group = _query_groups(t, n_heads, getattr(af, "kv_head_of_query", None))

    def base(index, shape):
        return torch.cat([baseline_noise(seed, di, layer, shape) for di in index]) if variant.baselines else None

    if transposed:
        yield _transposed_group(k, v)
    elif variant.text_padding == "excluded" and (af.attention_mask is not None or causal):
        yield from _real_token_groups(af, t, group, prefix, base)
    else:
        yield (
            torch.from_numpy(k).reshape(-1, *k.shape[2:]),
            torch.from_numpy(v).reshape(-1, *v.shape[2:]),
            np.repeat(af.sample_rank, n_heads),
            np.repeat(af.dataset_index, n_heads),
            np.tile(np.arange(n_heads), n_in),
            base(af.dataset_index, tuple(v.shape[1:])),
            *(None if group is None else torch.from_numpy(t[name][:, group]).flatten(0, 1) for name in ("q", "h")),
        )


def _transposed_group(k: np.ndarray, v: np.ndarray) -> tuple:
    """Longformer as the reference reads it (:func:`_equal_length_groups`): the ``B`` inputs at one
    position per head."""
    n_heads = k.shape[1]
    k, v = k.transpose(2, 1, 0, 3), v.transpose(2, 1, 0, 3)
    n_pos = k.shape[0]
    ranks = np.repeat(np.arange(n_pos), n_heads)
    return (
        torch.from_numpy(np.ascontiguousarray(k)).reshape(-1, *k.shape[2:]),
        torch.from_numpy(np.ascontiguousarray(v)).reshape(-1, *v.shape[2:]),
        ranks,
        np.full(len(ranks), -1),
        np.tile(np.arange(n_heads), n_pos),
        None,
        None,
        None,
    )


def _real_token_groups(
    af,
    t: dict[str, np.ndarray],
    group: np.ndarray | None,
    prefix: int | None,
    base,
) -> Iterator[tuple]:
    """Each input's real tokens (or first ``prefix`` of them), inputs of one length per group
    (:func:`_equal_length_groups`)."""
    k, v = t["k"], t["v"]
    n_in, n_heads = k.shape[:2]
    causal = bool(getattr(af, "causal", False))
    mask = af.attention_mask.astype(bool) if af.attention_mask is not None else np.ones((n_in, k.shape[2]), dtype=bool)
    lengths = mask.sum(axis=1)
    lengths = np.where(too_few_tokens(lengths), -1, lengths)  # -1: left out (counted by kpca_records)
    if prefix is not None:
        mask = mask & (np.cumsum(mask, axis=1) <= prefix)
        lengths = np.where(lengths >= prefix, prefix, -1)  # -1: shorter than P, left out
    for n in sorted(set(lengths.tolist()) - {-1}):
        sel = np.flatnonzero(lengths == n)
        kk = np.stack([k[i][:, mask[i]] for i in sel])
        vv = np.stack([v[i][:, mask[i]] for i in sel])
        # the queries tested (docs/method.md 17.3): every real token of an encoder's row; the
        # last real token of a causal prefix, the one query whose key set is the whole prefix
        queries = [np.flatnonzero(mask[i])[-1:] if causal else np.flatnonzero(mask[i]) for i in sel]
        tested = [None, None]
        if group is not None:
            for j, name in enumerate(("q", "h")):
                rows = [t[name][i][group][..., at, :] for i, at in zip(sel, queries)]
                tested[j] = torch.from_numpy(np.stack(rows)).flatten(0, 1)
        yield (
            torch.from_numpy(kk).reshape(-1, n, kk.shape[-1]),
            torch.from_numpy(vv).reshape(-1, n, vv.shape[-1]),
            np.repeat(af.sample_rank[sel], n_heads),
            np.repeat(af.dataset_index[sel], n_heads),
            np.tile(np.arange(n_heads), len(sel)),
            base(af.dataset_index[sel], (n_heads, n, vv.shape[-1])),
            *tested,
        )


def _query_groups(t: dict[str, np.ndarray], n_kv_heads: int, kv_head_of_query) -> np.ndarray | None:
    """The query heads of each KV head as an index array ``(H_kv, G)`` into ``q``'s heads, or None
    where ``t`` holds no ``q`` and ``h`` (no projection test) or the KV heads' groups differ in size."""
    if "q" not in t or "h" not in t:
        return None
    kv = np.arange(n_kv_heads) if kv_head_of_query is None else np.asarray(kv_head_of_query)
    order = np.argsort(kv, kind="stable")
    counts = np.bincount(kv, minlength=n_kv_heads)
    if len(set(counts.tolist())) != 1:
        return None
    return order.reshape(n_kv_heads, -1)


def _chunked(groups: Iterator[tuple], layer: int, heads_per_chunk: int) -> Iterator[tuple]:
    """:func:`_equal_length_groups`' groups in chunks of at most ``heads_per_chunk`` heads, each
    ``(layer, k, v, sample_rank, dataset_index, head, baseline or None, q, h)``:
    :func:`kpca_repro.method.records.chunk_records`' first arguments."""
    for group in groups:
        for lo in range(0, group[0].shape[0], heads_per_chunk):
            yield (layer, *(None if x is None else x[lo : lo + heads_per_chunk] for x in group))


def layer_chunks(
    af,
    layers: Sequence[int],
    heads_per_chunk: int,
    names: tuple[str, ...] = ("k", "v"),
    interleave: bool = False,
) -> Iterator[tuple[int, np.ndarray, dict[str, torch.Tensor]]]:
    """Stream an activation file (or any :class:`HeadSource`) as chunks of at most ``max(heads_per_chunk, H)`` heads.

    Reads each layer in blocks of ``max(1, heads_per_chunk // H)`` images (``H``: ``af.n_kv_heads``),
    so host memory depends on the chunk size, not on the number of images in the file. Layer by
    layer, or with ``interleave`` each block of images through every layer in turn (every layer
    early: Table 1's floor of the matched-cosine draws,
    :class:`~kpca_repro.method.solver_variation.RunningFloor`, rises with the layers that hold the
    largest values, wherever they are).

    Yields:
        ``(layer, flat, tensors)``: the chunk's flat head indices ``image * H + head`` within
        the layer (``(heads,)`` int64) and ``name -> (heads, N, d)`` float32 CPU tensors.
    """
    n_img, n_heads = len(af.sample_rank), int(af.n_kv_heads)
    per_read = max(1, heads_per_chunk // n_heads)
    blocks = [(layer, i0) for layer in layers for i0 in range(0, n_img, per_read)]
    if interleave:
        blocks.sort(key=lambda b: (b[1], list(layers).index(b[0])))
    for layer, i0 in blocks:
        i1 = min(i0 + per_read, n_img)
        t = af.read(layer, names, images=slice(i0, i1))
        flat_t = {name: torch.from_numpy(a).reshape(-1, *a.shape[2:]) for name, a in t.items()}
        heads = (i1 - i0) * n_heads
        for lo in range(0, heads, heads_per_chunk):
            hi = min(lo + heads_per_chunk, heads)
            yield layer, np.arange(i0 * n_heads + lo, i0 * n_heads + hi), {name: x[lo:hi] for name, x in flat_t.items()}


class HeadSource:
    """The heads of one job with their masks: an activation file (:class:`FileHeads`) or arrays in
    memory (:class:`HeadArrays`).

    Every source sets: ``name`` (str, for messages), ``model_id`` (str), ``attention_mask`` (int
    ``(B, N)``, 1 = real token, or None: every token real), ``causal`` (bool: query ``i`` attends
    to keys ``j <= i``), ``kv_head_of_query`` (int ``(H,)`` or None: the identity),
    ``sample_rank`` and ``dataset_index`` (int64 ``(B,)``), ``n_heads`` (``H``, query heads),
    ``n_kv_heads`` (heads of ``k`` and ``v``), ``n_tokens`` (``N``), ``layers`` (the layers a job
    reads by default) and ``sequence_first`` (Longformer's ``(sequence, batch, hidden)``
    projections); and defines :meth:`read` and :meth:`describe`.
    """

    name: str
    model_id: str
    attention_mask: np.ndarray | None
    causal: bool
    kv_head_of_query: np.ndarray | None
    sample_rank: np.ndarray
    dataset_index: np.ndarray
    n_heads: int
    n_kv_heads: int
    n_tokens: int
    layers: Sequence[int]
    sequence_first: bool = False

    def read(self, layer: int, names: tuple[str, ...], images: slice | None = None) -> dict[str, np.ndarray]:
        """Float32 arrays ``(B, heads, N, d)`` of ``layer`` (``images``: a slice of the inputs), those
        of ``names`` it holds."""
        raise NotImplementedError

    def describe(self) -> dict:
        """The source's part of the records' metadata (``model_id`` and, for a file, its weights and shard)."""
        raise NotImplementedError

    @property
    def text(self) -> bool:
        """Whether the heads are read as text: a padding mask, or causal heads."""
        return self.attention_mask is not None or self.causal

    def real_tokens(self) -> np.ndarray:
        """The real tokens of each input, int ``(B,)`` (``N`` each without a mask)."""
        if self.attention_mask is not None:
            return self.attention_mask.sum(axis=1)
        return np.full(len(self.sample_rank), self.n_tokens)

    def chunks(
        self,
        variant: Variant,
        layers: list[int],
        heads_per_chunk: int,
        seed: int,
        transposed: bool,
        interleave: bool,
        prefix: int | None,
    ) -> Iterator[tuple[tuple, tuple]]:
        """``(position, (layer, k, v, sample_rank, dataset_index, head, baseline or None, q, h))`` per chunk.

        ``position`` orders the records (layer by layer) whatever order the chunks come in.
        Vision heads (no ``attention_mask``, not causal): :func:`layer_chunks` (``interleave``:
        every layer early), the corrected variant's baselines drawn per image
        (:func:`baseline_noise`, ``(heads, N, d)`` float64), position ``(place of the layer in
        layers, first flat head)``. Text and causal heads: each layer read whole and grouped by
        :func:`_equal_length_groups` in ``variant``'s reading (``transposed``: Longformer as the
        reference reads it; ``prefix``: a causal source's first ``P`` real tokens), in chunks of
        ``heads_per_chunk`` (:func:`_chunked`), position a running count.
        """
        with_queries = projection_test_wanted(variant, self.causal) and not transposed
        names = ("k", "v", "q", "h") if with_queries else ("k", "v")
        if not self.text:
            yield from self._vision_chunks(variant, layers, heads_per_chunk, seed, names, interleave)
            return
        position = 0
        for layer in layers:
            groups = _equal_length_groups(self, self.read(layer, names), variant, layer, seed, transposed, prefix)
            for chunk in _chunked(groups, layer, heads_per_chunk):
                position += 1
                yield (position,), chunk

    def _vision_chunks(self, variant: Variant, layers: list[int], heads_per_chunk: int, seed: int, names, interleave):
        """:meth:`chunks` of vision heads, streamed by :func:`layer_chunks`."""
        n_heads = self.n_kv_heads
        for layer, flat, t in layer_chunks(self, layers, heads_per_chunk, names=names, interleave=interleave):
            images = flat // n_heads
            base = None
            if variant.baselines:
                shape = (n_heads, *t["v"].shape[1:])
                noise = {int(i): baseline_noise(seed, self.dataset_index[i], layer, shape) for i in np.unique(images)}
                base = torch.stack([noise[int(f // n_heads)][f % n_heads] for f in flat])
            queries = tuple(t[name][:, None] for name in ("q", "h")) if "q" in t else (None, None)
            ids = (self.sample_rank[images], self.dataset_index[images], flat % n_heads)
            yield (layers.index(layer), int(flat[0])), (layer, t["k"], t["v"], *ids, base, *queries)


class FileHeads(HeadSource):
    """The heads of an open :class:`~kpca_repro.activations.ActivationFile` (docs/activations.md).

    Args:
        af: the open file; it stays the caller's to close.
        name: how messages name it (default: its path).
    """

    def __init__(self, af, name: str | None = None):
        from kpca_repro.activations import SEQUENCE_FIRST

        self.file = af
        self.name = str(af.path) if name is None else name
        self.model_id = str(af.attrs["model_id"])
        self.attention_mask, self.causal = af.attention_mask, bool(af.causal)
        self.kv_head_of_query = af.kv_head_of_query
        self.sample_rank, self.dataset_index = af.sample_rank, af.dataset_index
        self.n_heads, self.n_kv_heads = int(af.attrs["n_heads"]), int(af.n_kv_heads)
        self.n_tokens = int(af.attrs["n_tokens"])
        self.layers = range(af.n_layers)
        self.sequence_first = str(af.attrs.get("hooked_layout", "")) == SEQUENCE_FIRST

    def read(self, layer: int, names: tuple[str, ...], images: slice | None = None) -> dict[str, np.ndarray]:
        return self.file.read(layer, names, images=images)

    def describe(self) -> dict:
        attrs = self.file.attrs
        return {
            "model_id": self.model_id,
            "weights_sha256": str(attrs["weights_sha256"]),
            "shard": int(attrs["shard"]),
            "n_shards": int(attrs["n_shards"]),
        }


class HeadArrays(HeadSource):
    """The heads of one layer held in memory (numpy or torch), the notebook API's source.

    Args:
        q: queries ``(B, H, N, d)``, ``(H, N, d)`` or ``(N, d)``, any float dtype (rounded to
            float32 as the activation files store them); with ``h`` the projection test's and
            the capture invariant's; may be None.
        k, v: keys and values ``(B, H_kv, N, d)`` (or the shorter forms), the same shape.
        h: the attention's per-head output, ``q``'s shape, or None.
        attention_mask: ``(B, N)`` 0/1, 1 = real token (language models); None: all real.
        causal: a decoder's heads (query ``i`` attends to keys ``j <= i``).
        kv_head_of_query: ``(H,)`` the KV head each query head reads (grouped-query attention,
            causal heads); None: ``H_kv = H``.
        sample_rank, dataset_index: ``(B,)`` integers (default ``0 .. B-1``); ``dataset_index``
            seeds the corrected variant's baselines.
        layer: the layer index of the records (and of the baselines' seeds).

    Raises:
        TypeError: a non-float array.
        ValueError: shapes disagree; a mask not ``(B, N)`` or an input without a real token; a
            wrong ``kv_head_of_query`` (or one on non-causal heads); ``sample_rank`` or
            ``dataset_index`` not ``(B,)``; each in one line naming the argument.
    """

    def __init__(
        self,
        q,
        k,
        v,
        h=None,
        *,
        attention_mask=None,
        causal=False,
        kv_head_of_query=None,
        sample_rank=None,
        dataset_index=None,
        layer=0,
    ):
        from kpca_repro.activations import half_precision_problem

        self.k, self.v = _four_d(k, "k"), _four_d(v, "v")
        if self.k.shape != self.v.shape:
            raise ValueError(f"k and v must have one shape (B, H, N, d); got {self.k.shape} and {self.v.shape}")
        n_in, self.n_kv_heads, self.n_tokens, _ = self.k.shape
        self.q = None if q is None else _four_d(q, "q")
        self.h = None if h is None else _four_d(h, "h")
        self.n_heads = self.n_kv_heads if self.q is None else self.q.shape[1]
        self.causal = bool(causal)
        self.kv_head_of_query = _kv_map(kv_head_of_query, None if q is None else self.n_heads, self.n_kv_heads)
        identity = self.kv_head_of_query is None or np.array_equal(self.kv_head_of_query, np.arange(self.n_kv_heads))
        if not identity and not self.causal and attention_mask is None:
            why = "grouped-query attention is read for causal heads or with an attention_mask"
            raise ValueError(f"kv_head_of_query: {why}")
        self.attention_mask = None if attention_mask is None else _padding_mask(attention_mask, n_in, self.n_tokens)
        self.sample_rank, self.dataset_index = _input_numbers(sample_rank, dataset_index, n_in)
        self.layer = int(layer)
        self.layers = [self.layer]
        self.name, self.model_id = "the arrays", ""
        #: why ``h`` cannot be checked at the default tolerance (half precision), or None
        self.half_precision = half_precision_problem({"q": q, "k": k, "v": v, "h": h}, None) if h is not None else None

    def read(self, layer: int, names: tuple[str, ...], images: slice | None = None) -> dict[str, np.ndarray]:
        if layer != self.layer:
            raise ValueError(f"layer {layer}: the arrays hold layer {self.layer}")
        held = {"k": self.k, "v": self.v}
        if self.q is not None and self.h is not None:
            held.update(q=self.q, h=self.h)
        rows = slice(None) if images is None else images
        return {name: held[name][rows] for name in names if name in held}

    def describe(self) -> dict:
        return {"model_id": self.model_id}


def _four_d(x, name: str) -> np.ndarray:
    """``(N, d)`` / ``(H, N, d)`` / ``(B, H, N, d)`` -> float32 ``(B, H, N, d)``.

    Raises:
        TypeError: not floating point. ValueError: another number of dimensions.
    """
    if hasattr(x, "detach"):
        x = x.detach().cpu()
        # numpy has no bfloat16; float32 holds it exactly
        x = (x.float() if str(x.dtype) == "torch.bfloat16" else x).numpy()
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
    if np.size(attention_mask) != n_in * n_tokens:
        raise ValueError(f"attention_mask must be (B, N) = ({n_in}, {n_tokens}), got shape {np.shape(attention_mask)}")
    given = attention_mask.detach().cpu() if hasattr(attention_mask, "detach") else attention_mask
    mask = np.asarray(given).reshape(-1, n_tokens)
    empty = np.flatnonzero(~mask.astype(bool).any(axis=1))
    if empty.size:
        raise ValueError(f"attention_mask: input {int(empty[0])} has no real token (all padding); leave that input out")
    return mask.astype(np.int64)


def _kv_map(kv_head_of_query, n_heads: int | None, n_kv_heads: int) -> np.ndarray | None:
    """``kv_head_of_query`` as int64 ``(H,)``, or None for the identity (``H = H_kv``).

    Raises:
        ValueError: it is not ``(H,)`` with values in ``[0, H_kv)`` (``H`` from ``q``), or ``q``
            has other heads than ``k`` without it.
    """
    if kv_head_of_query is None:
        if n_heads is not None and n_heads != n_kv_heads:
            fix = "give kv_head_of_query (grouped-query attention)"
            raise ValueError(f"q has {n_heads} heads and k {n_kv_heads}: {fix}")
        return None
    kv = np.asarray(kv_head_of_query, dtype=np.int64)
    wrong_shape = kv.ndim != 1 or (n_heads is not None and kv.shape != (n_heads,))
    if wrong_shape or kv.min(initial=0) < 0 or kv.max(initial=0) >= n_kv_heads:
        want = f"({n_heads},) KV-head indices in [0, {n_kv_heads})"
        raise ValueError(f"kv_head_of_query must be {want}, got {kv_head_of_query!r}")
    return kv


def _input_numbers(sample_rank, dataset_index, n_in: int) -> tuple[np.ndarray, np.ndarray]:
    """``(sample_rank, dataset_index)`` of the ``B`` inputs as int64 ``(B,)`` arrays (default ``0 .. B-1`` each).

    Raises:
        ValueError: either is given with a shape other than ``(B,)``.
    """
    ranks = np.arange(n_in) if sample_rank is None else np.asarray(sample_rank, dtype=np.int64)
    index = np.arange(n_in) if dataset_index is None else np.asarray(dataset_index, dtype=np.int64)
    if ranks.shape != (n_in,) or index.shape != (n_in,):
        raise ValueError(f"sample_rank and dataset_index must be ({n_in},)")
    return ranks, index
