"""Decoders' causal heads (docs/method.md 16): the full-prefix view, the prefix profile, the causal norms, grouped-query heads.

Small random heads with a causal ``h`` computed here in float64; every expectation is a
brute-force equivalent (the encoder analysis of the same real tokens, one head at a time, an
explicit sum over ``j <= i``), never a stored number.
"""

from __future__ import annotations

import math

import h5py
import numpy as np
import pandas as pd
import pytest
import torch
from test_activations import heads_records

from kpca_repro.activations import ActivationFile, write_activations
from kpca_repro.analysis.norms import CORRECTED_NORMS_BAND, PAPER_NORMS_BAND, PAPER_NORMS_TRIM, layer_norm_statistics, norm_statistics, squared_norms
from kpca_repro.method.kpca import head_metrics
from kpca_repro.method.records import KpcaJob, baseline_noise, kpca_records
from kpca_repro.method.variant import get as get_variant

D = 8
IDS = ["sample_rank", "dataset_index", "layer", "head", "n_tokens", "head_dim"]


def causal_attention(q, k, v, mask, kv):
    """``h_i = sum_{j <= i, j real} softmax_j(s q_i . k_j) v_j`` per query head, float64 (padded queries: 0)."""
    q, k, v = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
    k, v = k[:, kv], v[:, kv]
    n = q.shape[2]
    allowed = np.tril(np.ones((n, n), bool))[None] & mask.astype(bool)[:, None, :]
    logits = np.where(allowed[:, None], q @ k.transpose(0, 1, 3, 2) / math.sqrt(q.shape[-1]), -np.inf)
    top = np.max(logits, axis=-1, keepdims=True)
    w = np.exp(logits - np.where(np.isfinite(top), top, 0.0))
    total = w.sum(-1, keepdims=True)
    h = (w / np.where(total > 0, total, 1.0)) @ v  # a padded query that sees no key: 0
    return h * mask[:, None, :, None]


def place(real: list[np.ndarray], n: int, side: str) -> tuple[np.ndarray, np.ndarray]:
    """Rows of real tokens ``(H, L_b, d)`` padded to ``n`` on ``side``: ``(B, H, n, d)`` float32 (padding random) and the mask."""
    rng = np.random.default_rng(99)
    out = rng.standard_normal((len(real), real[0].shape[0], n, real[0].shape[-1])).astype(np.float32) * 5
    mask = np.zeros((len(real), n), np.int64)
    for b, x in enumerate(real):
        pos = slice(0, x.shape[1]) if side == "right" else slice(n - x.shape[1], n)
        out[b, :, pos], mask[b, pos] = x, 1
    return out, mask


def heads(lengths=(20, 13, 7), n_heads=2, n_kv=2, seed=0):
    """Real tokens of each row: q ``(H, L, d)``, k and v ``(H_kv, L, d)``, float32."""
    rng = np.random.default_rng(seed)
    return [{name: (rng.standard_normal((n_heads if name == "q" else n_kv, L, D)) * 1.5).astype(np.float32) for name in "qkv"} for L in lengths]


def padded(rows, n, side, kv):
    """The rows padded to ``n`` on ``side`` with their causal ``h``: ``(q, k, v, h, mask)``."""
    (q, mask), (k, _), (v, _) = (place([r[name] for r in rows], n, side) for name in "qkv")
    return q, k, v, causal_attention(q, k, v, mask, kv).astype(np.float32), mask


#: The regime's columns (docs/method.md 17.1) and the projection test's (17.3, which needs q and h): not head_metrics' of k and v alone.
REGIME = ["n_centered_directions", "n_components", "all_directions_kept"]
PROJECTION = ("projection_", "baseline_projection_", "control_projection_")


def metric_columns(frame: pd.DataFrame) -> list[str]:
    return [c for c in frame.columns if c not in IDS + REGIME and c != "variant" and not c.startswith(PROJECTION)]


def by_head(frame: pd.DataFrame) -> pd.DataFrame:
    return frame.sort_values(["sample_rank", "head"]).reset_index(drop=True)


# --------------------------------------------------------------------------------------
# (a) the full-prefix view is the encoder analysis of the real tokens, on either padding side
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", ["paper", "corrected"])
def test_full_prefix_view_is_the_encoder_analysis_of_the_real_tokens(variant):
    rows, kv = heads(), np.arange(2)
    right = heads_records(*padded(rows, 24, "right", kv)[:4], attention_mask=padded(rows, 24, "right", kv)[4], variant=variant, causal=True)
    q, k, v, h, mask = padded(rows, 26, "left", kv)
    left = heads_records(q, k, v, h, attention_mask=mask, variant=variant, causal=True)
    # the encoder analysis: each row alone, no padding at all (so the paper variant keeps every position)
    encoder = pd.concat(
        [heads_records(None, r["k"], r["v"], variant=variant, sample_rank=[b], dataset_index=[b], attention_mask=np.ones((1, r["k"].shape[1]))) for b, r in enumerate(rows)],
        ignore_index=True,
    )
    right, left, encoder = by_head(right), by_head(left), by_head(encoder)
    assert list(right["n_tokens"]) == [20, 20, 13, 13, 7, 7]
    pd.testing.assert_frame_equal(right, left)
    # the projection test is the causal one (the last real query) here, over every query in the encoder's (docs/method.md 17.3)
    pd.testing.assert_frame_equal(right[[c for c in right if not c.startswith(PROJECTION)]], encoder)
    assert np.isfinite(right["linear_cka"]).all()


def test_padding_is_left_out_in_the_paper_variant_too():
    """An encoder's paper reading keeps padded positions (Table 4); a decoder's never does."""
    rows, kv = heads(), np.arange(2)
    q, k, v, h, mask = padded(rows, 24, "right", kv)
    causal = heads_records(q, k, v, h, attention_mask=mask, variant="paper", causal=True)
    encoder = heads_records(q, k, v, attention_mask=mask, variant="paper")
    assert set(causal["n_tokens"]) == {20, 13, 7} and set(encoder["n_tokens"]) == {24}


# --------------------------------------------------------------------------------------
# (b) the prefix profile against one head at a time on its first P real tokens
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", ["paper", "corrected"])
def test_prefix_profile_equals_per_prefix_brute_force(variant):
    rows, kv = heads(lengths=(20, 13, 9), n_heads=4, n_kv=2), np.array([0, 0, 1, 1])
    q, k, v, h, mask = padded(rows, 22, "left", kv)
    reading = get_variant(variant).reading(text=True, causal=True)
    seed, layer = 3, 5
    for p in (4, 9, 16):
        got = by_head(heads_records(q, k, v, h, attention_mask=mask, variant=variant, causal=True, kv_head_of_query=kv, prefix=p, seed=seed, layer=layer))
        expected = []
        for b, r in enumerate(rows):
            if r["k"].shape[1] < p:
                continue
            noise = baseline_noise(seed, b, layer, (2, p, D))
            for head in range(2):
                cols = head_metrics(
                    torch.from_numpy(r["k"][head : head + 1, :p].copy()),
                    torch.from_numpy(r["v"][head : head + 1, :p].copy()),
                    reading,
                    baseline=noise[head : head + 1] if reading.baselines else None,
                )
                expected.append({"sample_rank": b, "head": head, **{c: x[0] for c, x in cols.items()}})
        expected = pd.DataFrame(expected)
        assert list(zip(got["sample_rank"], got["head"])) == list(zip(expected["sample_rank"], expected["head"]))
        assert (got["n_tokens"] == p).all()
        for c in metric_columns(got):
            np.testing.assert_allclose(got[c].to_numpy(dtype=float), expected[c].to_numpy(dtype=float), rtol=1e-6, atol=1e-7, err_msg=f"P={p} {c}")


def test_prefix_profile_leaves_out_rows_shorter_than_p():
    rows, kv = heads(lengths=(20, 12, 40)), np.arange(2)
    q, k, v, h, mask = padded(rows, 40, "right", kv)
    at = {p: heads_records(q, k, v, h, attention_mask=mask, variant="corrected", causal=True, prefix=p) for p in (12, 16, 41)}
    assert sorted(set(at[12]["sample_rank"])) == [0, 1, 2]
    assert sorted(set(at[16]["sample_rank"])) == [0, 2] and len(at[16]) == 4
    assert at[41].empty and list(at[41].columns) == ["variant", *IDS]


def test_prefix_needs_causal_heads():
    rows = heads()
    with pytest.raises(ValueError, match="causal"):
        heads_records(None, rows[0]["k"], rows[0]["v"], prefix=4)


# --------------------------------------------------------------------------------------
# (c) the causal norms against an explicit sum over j <= i
# --------------------------------------------------------------------------------------


def brute_force_phi(q, k, mask, kv):
    """``||phi(q_i)||^2 = exp(s ||q_i||^2) / (sum_{j <= i, j real} exp(s q_i . k_j))^2``, one query at a time, float64."""
    q, k = np.asarray(q, np.float64), np.asarray(k, np.float64)
    s = 1.0 / math.sqrt(q.shape[-1])
    out = np.full(q.shape[:3], np.nan)
    for b in range(q.shape[0]):
        for head in range(q.shape[1]):
            for i in np.flatnonzero(mask[b]):
                g = sum(math.exp(s * q[b, head, i] @ k[b, kv[head], j]) for j in range(i + 1) if mask[b, j])
                out[b, head, i] = math.exp(s * q[b, head, i] @ q[b, head, i]) / g**2
    return out


@pytest.mark.parametrize("variant", ["paper", "corrected"])
@pytest.mark.parametrize("side", ["right", "left"])
def test_causal_norms_equal_an_explicit_sum_over_the_prefix(variant, side):
    rows, kv = heads(lengths=(11, 6, 9), n_heads=4, n_kv=2), np.array([0, 0, 1, 1])
    q, k, v, h, mask = padded(rows, 12, side, kv)
    tm = torch.from_numpy(mask.astype(bool))[:, None, :].expand(3, 4, 12)
    kk, vv = torch.from_numpy(k)[:, kv], torch.from_numpy(v)[:, kv]
    phi, h_sq, valid = squared_norms(torch.from_numpy(q), kk, vv, torch.from_numpy(h), variant, language=True, token_mask=tm, causal=True)
    assert phi.dtype == torch.float64 and torch.equal(valid, tm)
    expected = brute_force_phi(q, k, mask, kv)
    np.testing.assert_allclose(phi[valid].numpy(), expected[mask.astype(bool)[:, None, :].repeat(4, 1)], rtol=1e-12)
    np.testing.assert_allclose(h_sq[valid].numpy(), (h.astype(np.float64) ** 2).sum(-1)[valid.numpy()], rtol=1e-12)
    # the first real query sees only its own key: ||phi||^2 = exp(s |q|^2 - 2 s q.k)
    b, i = 0, int(np.flatnonzero(mask[0])[0])
    s = 1 / math.sqrt(D)
    first = math.exp(s * q[b, 0, i].astype(np.float64) @ q[b, 0, i] - 2 * s * q[b, 0, i].astype(np.float64) @ k[b, 0, i])
    assert phi[b, 0, i].item() == pytest.approx(first, rel=1e-12)


def test_causal_norms_differ_from_the_full_normaliser():
    """Negative control: without the causal mask (every real key in g) the values change."""
    rows, kv = heads(lengths=(11,), n_heads=2, n_kv=2), np.arange(2)
    q, k, v, h, mask = padded(rows, 11, "right", kv)
    args = (torch.from_numpy(q), torch.from_numpy(k), torch.from_numpy(v), torch.from_numpy(h), "corrected")
    causal, _, _ = squared_norms(*args, language=True, causal=True)
    full, _, _ = squared_norms(*args, language=True)
    assert torch.equal(causal[..., -1], full[..., -1].double())  # the last query sees every key
    assert not torch.allclose(causal[..., :-1], full[..., :-1].double(), rtol=1e-3)


# --------------------------------------------------------------------------------------
# (d) grouped-query attention: records per KV head, norms per query head with its KV head
# --------------------------------------------------------------------------------------


def test_grouped_query_records_are_per_kv_head_and_the_invariant_uses_the_map():
    from kpca_repro.activations import CaptureMismatchError

    rows, kv = heads(lengths=(10, 8), n_heads=4, n_kv=2), np.array([0, 0, 1, 1])
    q, k, v, h, mask = padded(rows, 10, "right", kv)
    out = heads_records(q, k, v, h, attention_mask=mask, variant="corrected", causal=True, kv_head_of_query=kv)
    assert len(out) == 2 * 2 and sorted(set(out["head"])) == [0, 1]
    with pytest.raises(CaptureMismatchError):  # a wrong map does not reproduce h
        heads_records(q, k, v, h, attention_mask=mask, variant="corrected", causal=True, kv_head_of_query=[1, 1, 0, 0])
    with pytest.raises(ValueError, match="kv_head_of_query"):
        heads_records(q, k, v, h, attention_mask=mask, causal=True)
    with pytest.raises(ValueError, match="kv_head_of_query"):
        heads_records(q, k, v, h, attention_mask=mask, causal=True, kv_head_of_query=[0, 0, 1, 2])


def test_grouped_query_norms_need_the_right_kv_head():
    rows, kv = heads(lengths=(9, 7), n_heads=4, n_kv=2), np.array([0, 0, 1, 1])
    q, k, v, h, mask = padded(rows, 9, "left", kv)
    tm = torch.from_numpy(mask.astype(bool))[:, None, :].expand(2, 4, 9)
    expected = brute_force_phi(q, k, mask, kv)[tm.numpy()]

    def phi(kv_map):
        return squared_norms(torch.from_numpy(q), torch.from_numpy(k)[:, kv_map], torch.from_numpy(v)[:, kv_map], torch.from_numpy(h), "paper", token_mask=tm, causal=True)[0][tm].numpy()

    np.testing.assert_allclose(phi(kv), expected, rtol=1e-12)
    assert not np.allclose(phi(np.array([1, 1, 0, 0])), expected, rtol=1e-3)


# --------------------------------------------------------------------------------------
# Activation files (format version 2): the records and norms stages read causal files so
# --------------------------------------------------------------------------------------


def encoder_attention(q, k, v, mask):
    """``softmax(s q k^T + padding mask) v`` in float64, every real key (an encoder's ``h``)."""
    q, k, v = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
    logits = np.where(mask.astype(bool)[:, None, None, :], q @ k.transpose(0, 1, 3, 2) / math.sqrt(q.shape[-1]), -np.inf)
    w = np.exp(logits - logits.max(-1, keepdims=True))
    return (w / w.sum(-1, keepdims=True)) @ v


def write_causal(path, rows, n, side, kv, n_layers=2):
    """A causal file of ``rows`` (one layer per seed offset) padded on ``side``."""
    layers = []
    for layer in range(n_layers):
        shifted = [{name: x + np.float32(0.25 * layer) for name, x in r.items()} for r in rows]
        q, k, v, h, mask = padded(shifted, n, side, kv)
        layers.append({"q": q, "k": k, "v": v, "h": h})
    write_activations(path, layers, model_id="tiny-decoder", attention_mask=mask, causal=True, kv_head_of_query=kv)
    return path


@pytest.mark.parametrize("variant", ["paper", "corrected"])
def test_full_prefix_records_of_a_causal_file_equal_the_encoder_files(tmp_path, variant):
    # the paper variant reads an encoder's padding, so its encoder file has none: equal lengths
    lengths = (12, 12) if variant == "paper" else (12, 9, 5)
    rows, kv = heads(lengths=lengths, n_heads=2, n_kv=2), np.arange(2)
    right, _, _ = kpca_records(write_causal(tmp_path / "right.h5", rows, 14, "right", kv), variant)
    left, meta, _ = kpca_records(write_causal(tmp_path / "left.h5", rows, 15, "left", kv), variant)
    layers = []
    for layer in range(2):
        shifted = [{name: x + np.float32(0.25 * layer) for name, x in r.items()} for r in rows]
        (q, mask), (k, _), (v, _) = (place([r[name] for r in shifted], 12, "right") for name in "qkv")
        layers.append({"q": q, "k": k, "v": v, "h": encoder_attention(q, k, v, mask).astype(np.float32)})
    write_activations(tmp_path / "encoder.h5", layers, model_id="tiny-decoder", attention_mask=mask)
    encoder, encoder_meta, _ = kpca_records(tmp_path / "encoder.h5", variant)
    pd.testing.assert_frame_equal(right, left)
    # the causal projection test is the last real query's, the encoder's every query's (docs/method.md 17.3)
    same = [c for c in encoder if not c.startswith(PROJECTION)]
    pd.testing.assert_frame_equal(right[same], encoder[same])
    assert meta["causal"] is True and meta["prefix"] is None and meta["n_kv_heads"] == 2 and meta["padding"] == "excluded"
    assert not {"causal", "prefix", "n_kv_heads"} & set(encoder_meta)


def test_prefix_records_of_a_gqa_file_equal_analyze_heads(tmp_path):
    rows, kv = heads(lengths=(14, 10, 6), n_heads=4, n_kv=2), np.array([0, 0, 1, 1])
    path = write_causal(tmp_path / "gqa.h5", rows, 16, "left", kv)
    with ActivationFile(path) as af:
        t, mask = af.read(1), af.attention_mask
    for p in (8, 12):
        records, meta, _ = kpca_records(path, KpcaJob("corrected", heads_per_chunk=3, layers=[1], prefix=p))
        direct = heads_records(t["q"], t["k"], t["v"], t["h"], attention_mask=mask, variant="corrected", causal=True, kv_head_of_query=kv, prefix=p, layer=1)
        assert meta["prefix"] == p and meta["n_kv_heads"] == 2
        assert sorted(set(records["head"])) == [0, 1] and (records["n_tokens"] == p).all()
        assert sorted(set(records["sample_rank"])) == ([0, 1] if p == 8 else [0])
        pd.testing.assert_frame_equal(records.drop(columns=["model", "variant"]), direct.drop(columns="variant"), check_like=True)
    empty, _, _ = kpca_records(path, KpcaJob("paper", prefix=15))
    assert empty.empty


def test_prefix_of_an_encoder_file_is_refused(tmp_path):
    rows = heads(lengths=(6,))
    q, k, v = (r[None] for r in (rows[0]["q"], rows[0]["k"], rows[0]["v"]))
    write_activations(tmp_path / "enc.h5", [{"q": q, "k": k, "v": v, "h": encoder_attention(q, k, v, np.ones((1, 6))).astype(np.float32)}], model_id="enc")
    with pytest.raises(ValueError, match="causal"):
        kpca_records(tmp_path / "enc.h5", KpcaJob("corrected", prefix=4))


@pytest.mark.parametrize("variant", ["paper", "corrected"])
def test_norm_statistics_of_a_gqa_file_pool_the_brute_force_values(tmp_path, variant):
    rows, kv = heads(lengths=(9, 6), n_heads=4, n_kv=2), np.array([0, 0, 1, 1])
    path = write_causal(tmp_path / "gqa.h5", rows, 10, "right", kv, n_layers=1)
    got = norm_statistics([path], variant, language=True, progress=False).set_index("quantity")
    with ActivationFile(path) as af:
        t, mask = af.read(0), af.attention_mask
    real = mask.astype(bool)[:, None, :].repeat(4, 1)
    expected = {"phi": brute_force_phi(t["q"], t["k"], mask, kv)[real], "h": (t["h"].astype(np.float64) ** 2).sum(-1)[real]}
    paper = variant == "paper"
    for name, values in expected.items():
        want = layer_norm_statistics(values, trim=PAPER_NORMS_TRIM if paper else None, band=PAPER_NORMS_BAND if paper else CORRECTED_NORMS_BAND)
        assert got.loc[name, "n_values"] == real.sum() == 4 * (9 + 6)
        for stat in ("median", "band_lower", "band_upper", "mean_all", "max"):
            assert got.loc[name, stat] == pytest.approx(want[stat], rel=1e-10), (name, stat)
    assert got.loc["phi", "scale"] == 1 / math.sqrt(D)
    # negative control: the same tensors under a wrong KV-head map give other ||phi||^2
    wrong = tmp_path / "wrong.h5"
    with h5py.File(path) as src, h5py.File(wrong, "w") as dst:
        for name in src:
            src.copy(name, dst)
        dst.attrs.update(dict(src.attrs))
        dst.attrs["kv_head_of_query"] = np.array([1, 1, 0, 0])
    other = norm_statistics([wrong], variant, language=True, progress=False).set_index("quantity")
    assert other.loc["phi", "median"] != pytest.approx(got.loc["phi", "median"], rel=1e-3)
    assert other.loc["h", "median"] == got.loc["h", "median"]


@pytest.mark.parametrize("variant", ["paper", "corrected"])
def test_encoder_records_of_a_version_1_file_equal_version_2(tmp_path, variant):
    """Format version 2 with ``causal`` False reads as version 1 did: the same records and metadata."""
    rows = heads(lengths=(8, 8, 5))
    (q, mask), (k, _), (v, _) = (place([r[name] for r in rows], 8, "right") for name in "qkv")
    layer = {"q": q, "k": k, "v": v, "h": encoder_attention(q, k, v, mask).astype(np.float32)}
    write_activations(tmp_path / "v2.h5", [layer], model_id="enc", attention_mask=mask)
    v1 = tmp_path / "v1.h5"
    with h5py.File(tmp_path / "v2.h5") as src, h5py.File(v1, "w") as dst:
        for name in src:
            src.copy(name, dst)
        dst.attrs.update({key: val for key, val in src.attrs.items() if key not in ("causal", "n_kv_heads", "kv_head_of_query", "format_version")})
    new, new_meta, _ = kpca_records(tmp_path / "v2.h5", variant)
    old, old_meta, _ = kpca_records(v1, variant)
    pd.testing.assert_frame_equal(new, old)
    assert new_meta == old_meta and "causal" not in new_meta
