"""The KPCA mathematics against closed forms, brute force and the per-head reference transcription."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch

from kpca_repro import projection
from kpca_repro.method import equations as method
from kpca_repro.method import kpca, numerics
from kpca_repro.method.placement import Placement
from kpca_tools.reference import head_metrics_reference


def _keys(heads=4, n=23, d=8, scale=1.0, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(heads, n, d, generator=gen, dtype=torch.float64) * scale


def test_gram_paper_matches_definition():
    k = _keys().float()
    kphi, g = method.gram_paper(k)
    kraw = torch.exp(torch.einsum("hid,hjd->hij", k.double(), k.double()) / math.sqrt(k.shape[-1]))
    g64 = kraw.sum(-1)
    expected = kraw / (g64[..., :, None] * g64[..., None, :] + 1e-6)
    torch.testing.assert_close(g.double(), g64, rtol=1e-5, atol=0)
    torch.testing.assert_close(kphi.double(), expected, rtol=1e-4, atol=1e-12)


def test_log_gram_equals_exp_domain_where_finite():
    k = _keys()
    log_kphi, log_g = method.log_gram(k)
    kraw = torch.exp(k @ k.transpose(-1, -2) / math.sqrt(k.shape[-1]))
    g = kraw.sum(-1)
    torch.testing.assert_close(torch.exp(log_g), g)
    torch.testing.assert_close(torch.exp(log_kphi), kraw / (g[..., :, None] * g[..., None, :]))


def test_corrected_centered_gram_in_place_is_log_gram_exp_center_bit_for_bit():
    k = _keys().double()
    kc, log_g = kpca._corrected_centered_gram(k)
    log_kphi, log_g_ref = method.log_gram(k)
    torch.testing.assert_close(log_g, log_g_ref, rtol=0, atol=0)
    torch.testing.assert_close(kc, method.center(torch.exp(log_kphi)), rtol=0, atol=0)


def test_exact_row_normalisation_leaves_zero_rows_zero():
    x = torch.randn(2, 5, 3, dtype=torch.float64)
    x[0, 2] = 0.0
    x[1, :, 1] = 0.0
    rows, columns = method.row_normalize(x, None), method.row_normalize(x, None, dim=-2)
    assert torch.equal(rows[0, 2], torch.zeros(3, dtype=torch.float64))
    assert torch.equal(columns[1, :, 1], torch.zeros(5, dtype=torch.float64))
    norms = torch.linalg.vector_norm(rows, dim=-1)
    torch.testing.assert_close(norms[norms != 0], torch.ones(9, dtype=torch.float64))
    torch.testing.assert_close(rows[1], x[1] / torch.linalg.vector_norm(x[1], dim=-1, keepdim=True), rtol=0, atol=0)


@pytest.mark.parametrize("centering", [method.center, method.center_dense])
def test_centering_is_h_m_h(centering):
    m = torch.randn(3, 11, 11, dtype=torch.float64)
    h = torch.eye(11, dtype=torch.float64) - torch.full((11, 11), 1 / 11, dtype=torch.float64)
    torch.testing.assert_close(centering(m), h @ m @ h)
    assert torch.allclose(centering(m).sum(-1), torch.zeros(3, 11, dtype=torch.float64), atol=1e-12)


@pytest.mark.parametrize("per_matrix", [True, False])
@pytest.mark.parametrize("order", ["abs_desc", "desc", "asc_top"])
def test_eigenpairs_satisfy_eigen_equation(order, per_matrix):
    k = _keys(n=31, d=6)
    log_kphi, _ = method.log_gram(k)
    kc = method.center(torch.exp(log_kphi))
    placement = Placement(torch.device("cpu"), torch.device("cpu"), eigh_batched=not per_matrix)
    evals, a, finite = kpca.eigenpairs(kc, 6, order, fix_signs=True, placement=placement)
    assert finite.all()
    torch.testing.assert_close(kc @ a, a * evals[..., None, :], rtol=0, atol=1e-12)  # K~ A = A Lambda
    torch.testing.assert_close(a.transpose(-1, -2) @ a, torch.eye(6, dtype=torch.float64).expand(4, 6, 6), rtol=0, atol=1e-10)
    full = torch.linalg.eigvalsh(kc)
    if order == "desc":
        torch.testing.assert_close(evals, full.flip(-1)[..., :6])
    elif order == "asc_top":
        torch.testing.assert_close(evals, full[..., -6:])
    else:
        expected = torch.gather(full, -1, torch.argsort(full.abs(), dim=-1, descending=True)[..., :6])
        torch.testing.assert_close(evals, expected)
    # sign fix: the entry of largest magnitude of every eigenvector is positive
    pivot = torch.gather(a, -2, a.abs().argmax(-2, keepdim=True))
    assert (pivot > 0).all()


def test_eigenpairs_sign_fix_is_invariant_to_input_sign_flips():
    k = _keys(n=17, d=4)
    kc = method.center(torch.exp(method.log_gram(k)[0]))
    _, a1, _ = kpca.eigenpairs(kc, 4, "desc", fix_signs=True)
    evals, evecs = torch.linalg.eigh(kc)
    flipped = evecs * torch.tensor([-1.0, 1.0] * (evecs.shape[-1] // 2) + [1.0] * (evecs.shape[-1] % 2), dtype=evecs.dtype)
    rebuilt = flipped @ torch.diag_embed(evals) @ flipped.transpose(-1, -2)
    _, a2, _ = kpca.eigenpairs(rebuilt, 4, "desc", fix_signs=True)
    torch.testing.assert_close(a1, a2, atol=1e-8, rtol=0)


def test_v_kpca_matches_equation_5_naively():
    k = _keys(heads=1, n=13, d=5)[0]
    kraw = torch.exp(k @ k.T / math.sqrt(5))
    g = kraw.sum(1)
    kc = method.center(kraw / torch.outer(g, g))
    _, a, _ = kpca.eigenpairs(kc[None], 5, "desc")
    a = a[0]
    big_g = torch.diag(1 / g)
    one_n = torch.full((13, 13), 1 / 13, dtype=torch.float64)
    naive = big_g @ a - big_g @ one_n @ a  # Eq. 5: G A - G 1_N A
    torch.testing.assert_close(method.v_kpca(a[None], 1 / g[None])[0], naive)
    # the retained eigenvectors of a centered matrix are orthogonal to 1, so 1_N A ~ 0
    torch.testing.assert_close(naive, big_g @ a, atol=1e-12, rtol=0)


def test_cka_of_a_matrix_with_itself_is_one():
    x = torch.randn(5, 40, 7, dtype=torch.float64)
    for paper in (True, False):
        torch.testing.assert_close(method.linear_cka(x, x, paper), torch.ones(5, dtype=torch.float64))
        torch.testing.assert_close(method.rbf_cka(x, x, paper), torch.ones(5, dtype=torch.float64))


def test_cka_invariant_to_orthogonal_transform_and_isotropic_scaling():
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(3, 50, 6, generator=gen, dtype=torch.float64)
    y = x @ torch.randn(3, 6, 6, generator=gen, dtype=torch.float64) + 0.5 * torch.randn(3, 50, 6, generator=gen, dtype=torch.float64)
    q, _ = torch.linalg.qr(torch.randn(6, 6, generator=gen, dtype=torch.float64))
    for fn in (method.linear_cka, method.rbf_cka):
        base = fn(x, y, False)
        assert (base > 0.05).all() and (base < 0.999).all()
        torch.testing.assert_close(fn(x @ q, y, False), base)
        torch.testing.assert_close(fn(x, 7.5 * y, False), base)
        torch.testing.assert_close(fn(0.01 * x @ q, 3.0 * y, False), base)


def test_linear_cka_matches_kornblith_feature_space_formula():
    x = torch.randn(2, 30, 5, dtype=torch.float64)
    y = torch.randn(2, 30, 4, dtype=torch.float64)
    xc, yc = x - x.mean(-2, keepdim=True), y - y.mean(-2, keepdim=True)
    fro = lambda m: (m**2).sum((-1, -2))  # noqa: E731
    expected = fro(yc.transpose(-1, -2) @ xc) / torch.sqrt(fro(xc.transpose(-1, -2) @ xc) * fro(yc.transpose(-1, -2) @ yc))
    torch.testing.assert_close(method.linear_cka(x, y, paper=False), expected)


@pytest.mark.parametrize("n", [2, 3, 5, 6])
def test_assignment_agrees_with_brute_force(n):
    gen = torch.Generator().manual_seed(n)
    sims = torch.randn(4, n, n, generator=gen, dtype=torch.float64)
    matched = numerics.assignment_similarities(sims)
    for b in range(4):
        best = max(sum(sims[b, i, p[i]].item() for i in range(n)) for p in itertools.permutations(range(n)))
        assert matched[b].sum().item() == pytest.approx(best, abs=1e-12)


def test_paper_variant_reproduces_float32_overflow_and_corrected_has_none():
    k = _keys(heads=3, n=80, d=64, scale=1.0).float()
    k[0] *= 4.0  # s k.k ~ 64*16/8 = 128 > 88.7: exp overflows in float32
    v = torch.randn(3, 80, 64)
    paper = kpca.head_metrics(k, v, "paper")
    assert paper["exp_overflow"][0] and paper["dropped"][0] and not paper["finite"][0]
    assert np.isnan(paper["linear_cka"][0]) and np.isnan(paper["optimal_cos_mean"][0])
    assert not paper["dropped"][1:].any() and np.isfinite(paper["linear_cka"][1:]).all()
    corrected = kpca.head_metrics(k, v, "corrected", baseline=torch.randn(3, 80, 64, dtype=torch.float64))
    assert not corrected["dropped"].any()
    for name, col in corrected.items():
        if col.dtype != bool:
            assert np.isfinite(col).all(), name


def test_outer_product_overflow_is_silent_in_the_paper_variant():
    # g ~ N e^{s k.k} above ~1.8e19 overflows g_i g_j to inf without exp overflowing: Kphi
    # entries become 0 and the head is kept, as in the reference (docs/method.md 0.2).
    k = torch.zeros(1, 30, 64)
    k[0, :, 0] = 17.0  # s k.k = 289/8 = 36.1; g = 30 e^36.1 ~ 1.4e17 ... scale a few rows up
    k[0, :3, 0] = 19.0  # s k.k up to 45.1: g ~ 3e19 -> g^2 overflows
    v = torch.randn(1, 30, 64)
    out = kpca.head_metrics(k, v, "paper")
    assert out["outer_overflow"][0] and not out["exp_overflow"][0] and not out["dropped"][0]


@pytest.mark.parametrize("scale", [0.3, 1.0, 2.0, "growing"])
def test_batched_paper_variant_equals_per_head_reference(scale):
    """The batched implementation gives the numbers of the per-head transcription of
    value_vectors.py (tools/kpca_tools/reference.py, the baseline of perf/), head by head: every
    metric within 2e-5, the allclose flag exactly, and the heads the reference drops (scipy on a
    NaN cost matrix) are exactly the dropped ones. Keys of one scale (d = 16), and of growing
    magnitude (0.3 to 9, d = 8), whose last heads overflow float32."""
    if scale == "growing":
        gen = torch.Generator().manual_seed(0)
        k = torch.randn(5, 50, 8, generator=gen) * torch.linspace(0.3, 9.0, 5)[:, None, None]
        v = torch.randn(5, 50, 8, generator=gen)
    else:
        gen = torch.Generator().manual_seed(11)
        k = (torch.randn(6, 50, 16, generator=gen) * scale).float()
        v = torch.randn(6, 50, 16, generator=gen).float()
    ours = kpca.head_metrics(k, v, "paper")
    dropped = []
    for h in range(k.shape[0]):
        ref = head_metrics_reference(k[h], v[h])
        if ref is None:
            dropped.append(h)
            continue
        for name, value in ref.items():
            if name == "allclose":
                assert bool(ours[name][h]) == value
            else:
                assert ours[name][h] == pytest.approx(value, abs=2e-5), name
    assert list(np.flatnonzero(ours["dropped"])) == dropped
    assert bool(dropped) == (scale == "growing") and len(dropped) < k.shape[0]  # both kinds of head where the keys grow


def test_head_metrics_rejects_bad_input():
    with pytest.raises(ValueError, match="variant"):
        kpca.head_metrics(torch.randn(1, 5, 2), torch.randn(1, 5, 2), "nope")
    with pytest.raises(ValueError, match="heads, N, d"):
        kpca.head_metrics(torch.randn(1, 5, 2), torch.randn(2, 5, 2), "paper")
    with pytest.raises(ValueError, match="n_components"):
        kpca.eigenpairs(torch.eye(3)[None], 4)


def test_fewer_tokens_than_head_dimensions():
    k, v = torch.randn(2, 5, 8), torch.randn(2, 5, 8)
    for variant in kpca.VARIANTS:
        out = kpca.head_metrics(k, v, variant, baseline=torch.randn(2, 5, 8, dtype=torch.float64) if variant == "corrected" else None)
        assert not out["dropped"].any() and np.isfinite(out["linear_cka"]).all()


# --------------------------------------------------------------------------------------
# Squared norms and J_proj
# --------------------------------------------------------------------------------------


def test_feature_norm_log_domain_equals_direct_formula():
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(2, 3, 17, 8, generator=gen, dtype=torch.float64)
    k = torch.randn(2, 3, 17, 8, generator=gen, dtype=torch.float64)
    s = 1 / math.sqrt(8)
    direct = torch.exp(s * (q * q).sum(-1)) / torch.exp(s * q @ k.transpose(-1, -2)).sum(-1) ** 2
    torch.testing.assert_close(projection.feature_norm_sq(q, k), direct)
    torch.testing.assert_close(projection.feature_norm_sq(q, k, log_domain=False), direct)
    # kernel trick: ||phi(q)||^2 = k(q, q) / g(q)^2 with an explicit loop over one head
    i = 5
    g = sum(math.exp(s * float(q[0, 0, i] @ k[0, 0, j])) for j in range(17))
    assert float(projection.feature_norm_sq(q, k)[0, 0, i]) == pytest.approx(math.exp(s * float(q[0, 0, i] @ q[0, 0, i])) / g**2, rel=1e-12)


def test_feature_norm_log_domain_survives_overflow_and_masks_keys():
    q = torch.full((1, 4, 16), 30.0)
    k = torch.full((1, 4, 16), 30.0)
    assert not torch.isfinite(projection.feature_norm_sq(q, k, log_domain=False)).all()
    log_phi = projection.log_feature_norm_sq(q, k)
    assert torch.isfinite(log_phi).all()
    # masking a key equals removing it
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(5, 8, generator=gen, dtype=torch.float64), torch.randn(7, 8, generator=gen, dtype=torch.float64)
    mask = torch.tensor([True, True, False, True, False, True, True])
    torch.testing.assert_close(projection.feature_norm_sq(q, k, key_mask=mask), projection.feature_norm_sq(q, k[mask]))
    torch.testing.assert_close(projection.feature_norm_sq(q, k, key_mask=mask, log_domain=False), projection.feature_norm_sq(q, k[mask]))


def test_attention_output_is_naive_softmax_attention():
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(3, 6, 4, generator=gen, dtype=torch.float64) for _ in range(3))
    h = projection.attention_output(q, k, v)
    w = torch.exp(q @ k.transpose(-1, -2) / 2)
    torch.testing.assert_close(h, (w / w.sum(-1, keepdim=True)) @ v)
    mask = torch.tensor([True, False, True, True, False, True])
    torch.testing.assert_close(projection.attention_output(q, k, v, key_mask=mask), projection.attention_output(q, k[:, mask], v[:, mask]))
    torch.testing.assert_close(projection.output_norm_sq(h), torch.linalg.vector_norm(h, dim=-1) ** 2)


def test_projection_errors_against_a_loop():
    phi = torch.tensor([[0.5, 2.0], [1e-3, 4.0]], dtype=torch.float64)
    h = torch.tensor([[1.0, 1.0], [3.0, 4.0]], dtype=torch.float64)
    out = projection.projection_errors(phi, h)
    pairs = list(zip(phi.flatten().tolist(), h.flatten().tolist()))
    assert float(out["error"]) == pytest.approx(sum(abs(p - x) for p, x in pairs) / 4)
    assert float(out["rel_error_wrt_h"]) == pytest.approx(sum(abs(p - x) / (x + 1e-8) for p, x in pairs) / 4)
    assert float(out["rel_error_wrt_phiq"]) == pytest.approx(sum(abs(p - x) / (p + 1e-8) for p, x in pairs) / 4)
    assert float(out["h_ave"]) == pytest.approx(2.25) and float(out["phi_ave"]) == pytest.approx(sum(p for p, _ in pairs) / 4)
    masked = projection.projection_errors(phi, h, mask=torch.tensor([[True, False], [True, True]]))
    assert float(masked["h_ave"]) == pytest.approx((1 + 3 + 4) / 3)


def test_median_of_nonzero_entries_matches_a_full_sort_with_zeros_negatives_and_ties():
    """The lower median (torch.median's, the reference's bandwidth) and the usual median of the
    non-zero entries: on a hand-made case, then the CPU search (numpy introselect, ranks shifted
    past zeros) against sorting the selection ``d[d != 0]``, with negative entries (float32
    distances can be), runs of zeros and ties; both medians, float32 and float64. (The
    upper-triangle search of symmetric matrices against this one: tests/test_batching_and_sharding.py.)"""
    d = torch.tensor([[[0.0, 3.0], [1.0, 0.0]], [[0.0, 5.0], [5.0, 2.0]], [[0.0, 0.0], [0.0, 0.0]]])
    lower = numerics.median_nonzero(d, "lower")
    usual = numerics.median_nonzero(d, "mean")
    assert lower[0] == 1.0 and usual[0] == 2.0  # {1, 3}
    assert lower[1] == 5.0 and usual[1] == 5.0  # {2, 5, 5}
    assert torch.isnan(lower[2]) and torch.isnan(usual[2])
    gen = torch.Generator().manual_seed(11)
    for dtype in (torch.float32, torch.float64):
        for trial in range(200):
            n = int(torch.randint(1, 10, (1,), generator=gen))
            d = torch.randint(-3, 5, (5, n, n), generator=gen).to(dtype)
            if trial % 2:
                d = d + torch.rand(5, n, n, generator=gen, dtype=dtype)
            d[torch.rand(5, n, n, generator=gen) < 0.35] = 0
            for which in ("lower", "mean"):
                got = numerics.median_nonzero(d, which)
                for i in range(5):
                    sel = d[i][d[i] != 0].sort().values
                    m = sel.numel()
                    if m == 0:
                        assert torch.isnan(got[i])
                        continue
                    want = sel[(m - 1) // 2] if which == "lower" or m % 2 else (sel[m // 2 - 1] + sel[m // 2]) / 2
                    assert got[i] == want, (dtype, trial, which, i)
                    if which == "lower":
                        assert got[i] == torch.median(d[i][d[i] != 0])


def test_cka_centering_by_means_equals_the_explicit_h_products():
    """Linear CKA from token-centered features and RBF CKA from mean-centered kernels equal
    the CKA helper's explicit ``(H K) H`` form (tools/kpca_tools/reference.py) in float64, and
    stay within float32 round-off of it in float32."""
    from kpca_tools.reference import CudaCKA

    cka = CudaCKA()
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(4, 60, 8, generator=gen, dtype=torch.float64) + 3.0  # a common offset: centering matters
    y = x[..., :6] @ torch.randn(4, 6, 5, generator=gen, dtype=torch.float64) + torch.randn(4, 60, 5, generator=gen, dtype=torch.float64)
    for dtype, tol in ((torch.float64, 1e-12), (torch.float32, 2e-6)):
        xs, ys = x.to(dtype), y.to(dtype)
        lin, rbf = method.linear_cka(xs, ys), method.rbf_cka(xs, ys)
        for i in range(4):
            assert abs(lin[i].item() - cka.linear_cka(xs[i], ys[i]).item()) < tol
            assert abs(rbf[i].item() - cka.kernel_cka(xs[i], ys[i]).item()) < 10 * tol
        assert (lin > 0.05).all() and (lin < 0.99).all()


def test_reduced_costs_give_the_plain_assignment():
    """Scipy's solver on the row- and column-reduced cost of the transpose returns exactly the
    matched values of ``linear_sum_assignment(-S)`` on the same matrices (square: a constant per
    row or column does not change the optimum, and the transpose's optimal matching is the
    inverse), and a NaN in a matrix that counts still raises."""
    from scipy.optimize import linear_sum_assignment

    gen = torch.Generator().manual_seed(2)
    sim = torch.randn(30, 25, 8, generator=gen, dtype=torch.float64) @ torch.randn(30, 8, 25, generator=gen, dtype=torch.float64)
    got = numerics.assignment_similarities(sim)
    for i in range(30):
        rows, cols = linear_sum_assignment(-sim[i].numpy())
        assert np.array_equal(got[i].numpy(), sim[i].numpy()[rows, cols])
    bad = sim[:2].clone()
    bad[1, 3, 4] = float("nan")
    with pytest.raises(ValueError):
        numerics.assignment_similarities(bad)
    assert torch.isnan(numerics.assignment_similarities(bad, valid=torch.tensor([True, False]))[1]).all()


def test_corrected_rbf_cka_by_sums_equals_the_centered_kernels():
    """The corrected variant's RBF CKA (uncentered kernels with their row sums, distances
    ``(G_ii + G_jj) - 2 G_ij``, usual median over the pairs ``i < j``) equals the explicit
    ``sum((H K H) * (H L H))`` form with a bandwidth found by sorting, in float64."""
    gen = torch.Generator().manual_seed(8)
    x = torch.randn(3, 40, 6, generator=gen, dtype=torch.float64) + 2.0
    y = x[..., :4] @ torch.randn(3, 4, 5, generator=gen, dtype=torch.float64) + torch.randn(3, 40, 5, generator=gen, dtype=torch.float64)
    n = x.shape[1]
    h = torch.eye(n, dtype=torch.float64) - 1.0 / n

    def kernel(m):
        d = torch.cdist(m, m) ** 2
        iu = torch.triu_indices(n, n, offset=1)
        pairs = d[iu[0], iu[1]]
        s = pairs[pairs != 0].sort().values
        sigma2 = (s[(s.numel() - 1) // 2] + s[s.numel() // 2]) / 2  # the usual median
        return torch.exp(-d / (2 * sigma2))

    for i in range(3):
        kx, ky = h @ kernel(x[i]) @ h, h @ kernel(y[i]) @ h
        want = (kx * ky).sum() / torch.sqrt((kx * kx).sum() * (ky * ky).sum())
        assert abs(method.rbf_cka(x[i : i + 1], y[i : i + 1], paper=False)[0].item() - want.item()) < 1e-10
    k = method.rbf_kernel(x, paper=False)
    sums, centered = method.cka_side("kernel_sums", k), method.cka_side("kernel", k.clone())
    torch.testing.assert_close(sums[2], centered[2], rtol=1e-12, atol=0)


def test_finite_flags_survive_an_overflowing_sum_and_catch_nan_and_inf():
    """Every matrix of finite entries is solved, also when the sum of all entries overflows to
    inf (the fast check then falls back to the entry test); a matrix with a NaN or an inf entry
    is flagged, gets NaN eigenpairs, and leaves the others' eigenpairs as they were."""
    gen = torch.Generator().manual_seed(4)
    m = torch.randn(4, 9, 9, generator=gen)
    m = m + m.transpose(-1, -2)
    want, want_a, _ = kpca.eigenpairs(m, 3, "desc", fix_signs=True)
    big = m.clone()
    big[0] = big[0] * 3e37  # finite entries whose total overflows float32
    assert not torch.isfinite(big.sum())
    _, _, finite = kpca.eigenpairs(big, 3, "desc")
    assert finite.all()
    for bad in (float("nan"), float("inf")):
        x = m.clone()
        x[2, 4, 1] = x[2, 1, 4] = bad
        evals, a, finite = kpca.eigenpairs(x, 3, "desc", fix_signs=True)
        assert finite.tolist() == [True, True, False, True]
        assert torch.isnan(evals[2]).all() and torch.isnan(a[2]).all()
        keep = [0, 1, 3]
        assert torch.equal(evals[keep], want[keep]) and torch.equal(a[keep], want_a[keep])
