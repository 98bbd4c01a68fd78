"""What the metrics can mean (docs/method.md 17): the all-components regime and its control, the
unbiased CKA, and the projection test of the claim itself.

Every expectation is a separate float64 computation written here (explicit ``G``, ``H`` and
eigenvectors from numpy, Székely's U-centering for the unbiased HSIC, a loop over queries), or a
closed form (``V = V_KPCA`` gives a perfect projection), never a stored number.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest
import torch
import yaml
from test_activations import heads_records

from kpca_repro.analysis.tables import TABLES, table_corrected
from kpca_repro.method.equations import projection_test, unbiased_cka_from_sides, unbiased_side
from kpca_repro.method.kpca import head_metrics

D = 8


def kpca_float64(k: np.ndarray, n_components: int) -> tuple[np.ndarray, np.ndarray]:
    """``(V_KPCA, 1/g)`` of one head from its keys ``(N, d)``, float64 with numpy (docs/method.md 0.2, exact),
    each eigenvector's entry of largest magnitude positive (the corrected variant's sign rule, 15.2)."""
    n = k.shape[0]
    kraw = np.exp(k @ k.T / math.sqrt(k.shape[1]))
    g = kraw.sum(1)
    h = np.eye(n) - 1.0 / n
    kc = h @ (kraw / np.outer(g, g)) @ h
    w, a = np.linalg.eigh(kc)
    a = a[:, np.argsort(w)[::-1][:n_components]]
    a = a * np.sign(a[np.abs(a).argmax(0), np.arange(a.shape[1])])[None, :]
    return np.diag(1 / g) @ h @ a, 1 / g


def centered(m: np.ndarray) -> np.ndarray:
    n = m.shape[0]
    h = np.eye(n) - 1.0 / n
    return h @ m @ h


def cka(kx: np.ndarray, ky: np.ndarray) -> float:
    """Biased CKA of two kernel matrices, ``tr(HKH HLH) / sqrt(..)``."""
    a, b = centered(kx), centered(ky)
    return float((a * b).sum() / math.sqrt((a * a).sum() * (b * b).sum()))


def rbf(x_gram: np.ndarray) -> np.ndarray:
    """RBF kernel of rows with squared distances from their Gram matrix, bandwidth the median non-zero distance (i < j)."""
    sq = np.diag(x_gram)
    dist = sq[:, None] + sq[None, :] - 2 * x_gram
    iu = np.triu_indices(len(sq), 1)
    sigma2 = np.median(dist[iu][dist[iu] != 0])
    return np.exp(-dist / (2 * sigma2))


def u_centered(k: np.ndarray) -> np.ndarray:
    """Székely & Rizzo's U-centering: HSIC_1(K, L) = <U(K), U(L)> / (n (n - 3)) (a form unlike Song's)."""
    n = k.shape[0]
    k = k - np.diag(np.diag(k))
    u = k - k.sum(0)[None, :] / (n - 2) - k.sum(1)[:, None] / (n - 2) + k.sum() / ((n - 1) * (n - 2))
    np.fill_diagonal(u, 0)
    return u


def cka_unbiased_reference(kx: np.ndarray, ky: np.ndarray) -> float:
    ux, uy = u_centered(kx), u_centered(ky)
    return float((ux * uy).sum() / math.sqrt((ux * ux).sum() * (uy * uy).sum()))


def random_heads(n: int, d: int = D, heads: int = 3, seed: int = 0, scale: float = 1.0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(heads, n, d, generator=gen, dtype=torch.float64) * scale, torch.randn(heads, n, d, generator=gen, dtype=torch.float64)


@pytest.mark.parametrize("n", [2, 3, 5, 8, 9, 10, 16, 40])
def test_cka_equals_the_all_components_control_exactly_where_every_direction_is_kept(n):
    k, v = random_heads(n, seed=n)
    cols = head_metrics(k, v, "corrected", baseline=torch.randn(v.shape, dtype=torch.float64))
    for i in range(k.shape[0]):
        _, inv_g = kpca_float64(k[i].numpy(), min(D, n))
        control = np.diag(inv_g) @ centered(np.eye(n)) @ np.diag(inv_g)  # G H G, the row Gram matrix of G H
        vv = v[i].numpy()
        np.testing.assert_allclose(cols["control_linear_cka"][i], cka(vv @ vv.T, control), rtol=1e-10)
        if n > 2:  # two tokens: one distance, every RBF kernel the same
            np.testing.assert_allclose(cols["control_rbf_cka"][i], cka(rbf(vv @ vv.T), rbf(control)), rtol=1e-9)
    kept = n <= D + 1
    for name in ("linear_cka", "rbf_cka"):
        gap = np.abs(cols[name] - cols[f"control_{name}"])
        if kept:
            np.testing.assert_allclose(cols[name], cols[f"control_{name}"], rtol=1e-9, atol=1e-12, err_msg=name)
        else:
            assert (gap > 1e-4).all(), (name, gap)
    if n == 2:  # two tokens: any k and v give CKA 1
        np.testing.assert_allclose(cols["linear_cka"], 1.0, rtol=1e-12)


def test_records_say_where_every_direction_is_kept():
    rng = np.random.default_rng(1)
    for n, expected in ((9, True), (10, False), (5, True)):
        k, v = (rng.standard_normal((1, 2, n, D)).astype(np.float32) for _ in range(2))
        rec = heads_records(None, k, v, variant="corrected")
        assert (rec["n_centered_directions"] == n - 1).all() and (rec["n_components"] == min(n, D)).all()
        assert (rec["all_directions_kept"] == expected).all()


@pytest.mark.parametrize("n", [8, 32, 197])
def test_unbiased_cka_of_independent_matrices_averages_near_zero_and_equals_u_centering(n):
    gen = torch.Generator().manual_seed(0)
    draws = 4000 if n < 100 else 500  # standard error of the mean about 0.004 at N = 8, 0.0003 at N = 197
    x = torch.randn(draws, n, 64, generator=gen, dtype=torch.float64)
    y = torch.randn(draws, n, 64, generator=gen, dtype=torch.float64)
    kx, ky = x @ x.transpose(-1, -2), y @ y.transpose(-1, -2)
    got = unbiased_cka_from_sides(unbiased_side(kx), unbiased_side(ky)).numpy()
    assert abs(got.mean()) < 0.02, got.mean()
    for i in range(3):
        assert got[i] == pytest.approx(cka_unbiased_reference(kx[i].numpy(), ky[i].numpy()), rel=1e-9, abs=1e-12)
    biased = np.array([cka(kx[i].numpy(), ky[i].numpy()) for i in range(20)])
    if n == 8:  # the biased estimator's bias at few tokens, for contrast
        assert biased.mean() > 0.5
    same = unbiased_cka_from_sides(unbiased_side(kx[:3]), unbiased_side(kx[:3])).numpy()
    np.testing.assert_allclose(same, 1.0, rtol=1e-12)


def test_unbiased_cka_of_the_records_equals_u_centering():
    k, v = random_heads(30, seed=5)
    cols = head_metrics(k, v, "corrected")
    for i in range(k.shape[0]):
        vk, _ = kpca_float64(k[i].numpy(), D)
        vv = v[i].numpy()
        assert cols["linear_cka_unbiased"][i] == pytest.approx(cka_unbiased_reference(vv @ vv.T, vk @ vk.T), rel=1e-7)
        assert cols["rbf_cka_unbiased"][i] == pytest.approx(cka_unbiased_reference(rbf(vv @ vv.T), rbf(vk @ vk.T)), rel=1e-6)


def projection_loop(q: np.ndarray, k: np.ndarray, h: np.ndarray, values: np.ndarray, inv_g: np.ndarray) -> dict[str, float]:
    """The projection test query by query, float64: cos, relative error, norm ratio and the all-components bound."""
    s = 1 / math.sqrt(k.shape[1])
    cos, err, hat, ref, bound = [], 0.0, 0.0, 0.0, 0.0
    n = k.shape[0]
    for qi, hi in zip(q, h):
        logits = s * (k @ qi)
        w = np.exp(logits - logits.max())
        w /= w.sum()
        h_hat = w @ values
        cos.append(h_hat @ hi / (np.linalg.norm(h_hat) * np.linalg.norm(hi)))
        err += ((h_hat - hi) ** 2).sum()
        hat += (h_hat**2).sum()
        ref += (hi**2).sum()
        bound += (((np.eye(n) - 1.0 / n) @ (inv_g * w)) ** 2).sum()
    return {"cos": np.mean(cos), "rel_error": math.sqrt(err / ref), "norm_ratio": math.sqrt(hat / ref), "bound": math.sqrt(bound / ref)}


@pytest.mark.parametrize("variant", ["corrected", "paper"])
def test_projection_test_equals_a_loop_over_queries_encoder_and_causal(variant):
    rng = np.random.default_rng(3)
    n = 12
    q, k, v = (rng.standard_normal((2, 2, n, D)).astype(np.float32) for _ in range(3))
    s = 1 / math.sqrt(D)
    for causal in (False, True) if variant == "corrected" else (True,):  # the paper variant tests decoders only (Tables 1-4 stay the authors')
        if causal:
            logits = np.where(np.tril(np.ones((n, n), bool)), s * q.astype(np.float64) @ k.transpose(0, 1, 3, 2), -np.inf)
        else:
            logits = s * q.astype(np.float64) @ k.transpose(0, 1, 3, 2)
        w = np.exp(logits - logits.max(-1, keepdims=True))
        h = ((w / w.sum(-1, keepdims=True)) @ v).astype(np.float32)
        rec = heads_records(q, k, v, h, variant=variant, causal=causal)
        assert {"projection_cos", "projection_rel_error", "projection_norm_ratio", "control_projection_norm_ratio"} <= set(rec)
        for b in range(2):
            for head in range(2):
                row = rec[(rec["sample_rank"] == b) & (rec["head"] == head)].iloc[0]
                kk = k[b, head].astype(np.float64)
                vk, inv_g = kpca_float64(kk, D)
                queries = slice(n - 1, n) if causal else slice(None)  # a causal head: the last query sees the whole prefix
                ref = projection_loop(q[b, head, queries].astype(np.float64), kk, h[b, head, queries].astype(np.float64), vk, inv_g)
                tol = dict(rel=1e-6, abs=1e-9) if variant == "corrected" else dict(rel=2e-3, abs=1e-6)
                # the norms do not depend on the eigenvectors' signs; the paper variant's signs are the solver's
                assert row["projection_norm_ratio"] == pytest.approx(ref["norm_ratio"], **tol)
                assert row["control_projection_norm_ratio"] == pytest.approx(ref["bound"], **tol)
                assert row["projection_norm_ratio"] <= row["control_projection_norm_ratio"] * (1 + 1e-6)
                if variant == "corrected":
                    assert row["projection_cos"] == pytest.approx(ref["cos"], rel=1e-6, abs=1e-9)
                    assert row["projection_rel_error"] == pytest.approx(ref["rel_error"], rel=1e-6)


def test_projection_is_perfect_for_heads_whose_values_are_v_kpca():
    """Built so that V = V_KPCA (numpy's eigenvectors, the corrected sign rule) and h = softmax(s Q K^T) V:
    cos(ĥ, h) = 1, the error 0, the norm ratio 1, and no principal directions could give more."""
    rng = np.random.default_rng(7)
    n, s = 16, 1 / math.sqrt(D)
    k = rng.standard_normal((1, 3, n, D)) * 0.8
    q = rng.standard_normal((1, 3, n, D))
    v = np.stack([kpca_float64(k[0, head], D)[0] for head in range(3)])[None]
    logits = s * q @ k.transpose(0, 1, 3, 2)
    w = np.exp(logits - logits.max(-1, keepdims=True))
    h = (w / w.sum(-1, keepdims=True)) @ v
    rec = heads_records(q, k, v, h, variant="corrected")
    np.testing.assert_allclose(rec["projection_cos"], 1.0, atol=1e-9)
    np.testing.assert_allclose(rec["projection_rel_error"], 0.0, atol=1e-6)
    np.testing.assert_allclose(rec["projection_norm_ratio"], 1.0, rtol=1e-6)
    assert (rec["control_projection_norm_ratio"] >= 1 - 1e-6).all()
    # the same with the equation alone, in float64
    out = projection_test(torch.from_numpy(q[0][:, None]), torch.from_numpy(k[0]), torch.from_numpy(h[0][:, None]), torch.from_numpy(v[0]))
    np.testing.assert_allclose(out["cos"].numpy(), 1.0, atol=1e-12)
    np.testing.assert_allclose(out["rel_error"].numpy(), 0.0, atol=1e-12)


def test_corrected_table_leaves_the_regime_out_of_its_cka_statistics():
    rows = []
    for n in (6, 9, 10, 30):  # N <= d + 1 = 9 keeps every direction
        k, v = random_heads(n, seed=n)
        cols = head_metrics(k, v, "corrected", baseline=torch.randn(v.shape, dtype=torch.float64))
        frame = pd.DataFrame({"model": "m", "layer": 0, "sample_rank": n, "head": np.arange(3), "n_tokens": n, "head_dim": D, **cols})
        frame["all_directions_kept"] = n <= D + 1
        rows.append(frame)
    records = pd.concat(rows, ignore_index=True)
    table = table_corrected(records, {"m": {"n_sentences": 4, "weights_sha256": "x"}}, TABLES["table4"]).set_index("column")
    outside = records[~records["all_directions_kept"]]
    for col in ("linear_cka", "rbf_cka", "linear_cka_unbiased"):
        assert table.loc[col, "n_all_directions_kept"] == 6
        assert table.loc[col, "mean"] == pytest.approx(outside[col].mean(), rel=1e-12)
        assert table.loc[col, "control_mean"] == pytest.approx(outside[f"control_{col}"].mean(), rel=1e-12)
    assert table.loc["direct_cos_max", "n_all_directions_kept"] == 0
    assert table.loc["direct_cos_max", "mean"] == pytest.approx(records["direct_cos_max"].mean(), rel=1e-12)


def test_no_default_prefix_length_keeps_every_direction():
    """Every default decoder has d = 64 (GPT-2, Pythia-160m, SmolLM2-135M, Qwen2.5-0.5B: hidden size / heads)."""
    with open("config/config.yaml") as f:
        config = yaml.safe_load(f)
    assert config["decoders"]["prefix_lengths"] and min(config["decoders"]["prefix_lengths"]) > 64 + 1
    assert max(config["decoders"]["prefix_lengths"]) <= config["text"]["max_length"]
