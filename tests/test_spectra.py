"""Tables 2 and 3: eigenvalues of the centered Gram matrix and their statistics."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from kpca_repro import projection
from kpca_repro.analysis.statistics import spectrum_statistics
from kpca_repro.method import equations as method
from kpca_repro.method import kpca


def test_standardized_keys_have_norm_d_minus_one():
    k = projection.standardize_tokens(torch.randn(3, 20, 64, dtype=torch.float64) * 5 + 2)
    torch.testing.assert_close((k**2).sum(-1), torch.full((3, 20), 63.0, dtype=torch.float64), rtol=1e-6, atol=0)


@pytest.mark.parametrize("standardize", [True, False])
def test_top_eigenvalues_match_numpy_eigvalsh_in_float64(standardize):
    gen = torch.Generator().manual_seed(1)
    k = torch.randn(4, 60, 16, generator=gen, dtype=torch.float64)
    evals, finite = kpca.top_eigenvalues(k, 16, "corrected", standardize)
    assert finite.all()
    for h in range(4):
        kk = k[h].numpy()
        if standardize:
            kk = (kk - kk.mean(1, keepdims=True)) / (kk.std(1, ddof=1, keepdims=True) + 1e-8)
        kraw = np.exp(kk @ kk.T / math.sqrt(16))
        g = kraw.sum(1)
        n = len(g)
        hm = np.eye(n) - np.ones((n, n)) / n
        expected = np.sort(np.linalg.eigvalsh(hm @ (kraw / np.outer(g, g)) @ hm))[::-1][:16]
        np.testing.assert_allclose(evals[h].numpy(), np.abs(expected), rtol=1e-9, atol=1e-15)
    paper, _ = kpca.top_eigenvalues(k.float(), 16, "paper", standardize)
    np.testing.assert_allclose(paper.numpy(), evals.numpy(), rtol=1e-3, atol=1e-9)


def test_corrected_spectrum_is_finite_where_the_paper_variant_overflows():
    k = torch.randn(2, 50, 64) * 4  # s k.k ~ 128 > 88.7
    paper, finite = kpca.top_eigenvalues(k, 8, "paper", standardize=False)
    assert not finite.any() and torch.isnan(paper).all()
    corrected, finite = kpca.top_eigenvalues(k, 8, "corrected", standardize=False)
    assert finite.all() and torch.isfinite(corrected).all()
    standardized, finite = kpca.top_eigenvalues(k, 8, "paper", standardize=True)  # standardizing removes overflow
    assert finite.all() and torch.isfinite(standardized).all()


def test_spectrum_statistics_on_a_hand_made_case():
    # 2 images, 2 heads, 4 ranks; rank-wise mean over heads, then max/min/mean/lower median
    ev = (
        np.array(
            [
                [[4.0, 3.0, 2.0, 1.0], [6.0, 5.0, 2.0, 1.0]],  # mean over heads: 5, 4, 2, 1
                [[8.0, 4.0, 4.0, 2.0], [8.0, 6.0, 2.0, 0.0]],  # mean over heads: 8, 5, 3, 1
            ]
        )
        * 1e-6
    )
    s = spectrum_statistics(ev)
    assert s["max_mean"] == pytest.approx(6.5) and s["max_std"] == pytest.approx(np.std([5, 8], ddof=1))
    assert s["min_mean"] == pytest.approx(1.0) and s["min_std"] == pytest.approx(0.0)
    assert s["mean_mean"] == pytest.approx((3.0 + 4.25) / 2)
    assert s["median_mean"] == pytest.approx((2.0 + 3.0) / 2)  # lower median: 2nd of 4 sorted
    assert s["n_nonfinite_heads"] == 0 and s["n_heads"] == 4
    ev[0, 1, 2] = np.nan
    s = spectrum_statistics(ev)
    assert s["n_nonfinite_heads"] == 1 and np.isnan(s["max_mean"])  # NaN is reported, never dropped


def test_pairwise_spread_matches_a_loop_over_pairs():
    gamma = torch.randn(2, 7, 3, dtype=torch.float64)
    out = method.pairwise_spread(gamma)
    for h in range(2):
        for d in range(3):
            g = gamma[h, :, d].tolist()
            pairs = [(g[i], g[j]) for i in range(7) for j in range(i + 1, 7)]
            diffs = np.array([abs(a - b) for a, b in pairs])
            rel = np.array([abs(a - b) / (max(abs(a), abs(b)) + 1e-10) for a, b in pairs])
            assert out["abs_mean"][h, d].item() == pytest.approx(diffs.mean())
            assert out["abs_std"][h, d].item() == pytest.approx(diffs.std(ddof=1))
            assert out["rel_mean"][h, d].item() == pytest.approx(rel.mean())
            assert out["rel_std"][h, d].item() == pytest.approx(rel.std(ddof=1))


def test_gamma_equals_eigenvalue_over_n_for_exact_eigenvectors():
    k = torch.randn(2, 40, 8, dtype=torch.float64)
    kc = method.center(torch.exp(method.log_gram(k)[0]))
    evals, a, _ = kpca.eigenpairs(kc, 8, "desc")
    torch.testing.assert_close(method.gamma_matrix(kc, a), (evals / 40)[..., None, :].expand(2, 40, 8), rtol=1e-6, atol=0)


@pytest.mark.parametrize("variant", ["paper", "corrected"])
def test_gamma_spread_is_round_off_for_true_and_large_for_perturbed_eigenvectors(variant):
    k = torch.randn(3, 60, 16) * 2
    out = kpca.gamma_test(k, 16, variant, standardize=True, noise=0.1, generator=torch.Generator().manual_seed(0))
    true_rel, pert_rel = out["true"]["rel_mean"], out["perturbed"]["rel_mean"]
    tol = 1e-2 if variant == "paper" else 1e-8  # float32 vs float64 round-off
    assert (true_rel < tol).all()
    assert (pert_rel > 0.05).all()
    assert (out["perturbed"]["abs_mean"] > 100 * out["true"]["abs_mean"]).all()
