"""Solver variation beyond signs: rotations inside near-degenerate eigenspaces (kpca_repro.method.solver_variation, issue 34 items 2-4)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pandas as pd
import pytest
import scipy.linalg
import torch

from kpca_repro.analysis import comparison as cmp
from kpca_repro.analysis import tables
from kpca_repro.analysis.intervals import combine_for_maximum
from kpca_repro.method import solver_variation as sv
from kpca_repro.method import uncertainty as unc
from kpca_repro.method.equations import linear_cka, rbf_cka, row_normalize, select_eigenpairs, v_kpca
from kpca_repro.projection import ROW_NORM_EPS


def _matrix(evals: np.ndarray, seed: int) -> np.ndarray:
    """A float32 symmetric matrix with the given spectrum (random orthogonal eigenvectors)."""
    q = np.linalg.qr(np.random.default_rng(seed).standard_normal((len(evals), len(evals))))[0]
    m = (q * evals) @ q.T
    return ((m + m.T) / 2).astype(np.float32)


def _rows(kc: np.ndarray, v: np.ndarray, d: int, order: str = "abs_desc", eigh=None, seed: int = 0) -> dict:
    """``head_metrics``' rows of one head from a centered Gram matrix, values and an eigensolver."""
    k = torch.from_numpy(kc)
    w, vec = (eigh or torch.linalg.eigh)(k)
    _, a = select_eigenpairs(torch.as_tensor(w), torch.as_tensor(vec), d, order)
    inv_g = torch.from_numpy(np.random.default_rng(seed + 1).uniform(0.5, 1.5, kc.shape[0]).astype(np.float32))
    vk = v_kpca(a, inv_g)
    vt = torch.from_numpy(v)
    return {"v": row_normalize(vt)[None], "v_kpca": row_normalize(vk)[None], "kc": k[None], "a": a[None], "inv_g": inv_g[None]}


IDS = {"layer": 0, "sample_rank": 0, "dataset_index": 0, "head": 0}


def test_tolerance_is_c_n_u_norm_and_groups_chain_gaps_below_it():
    ev = np.array([-1.0, 0.1, 0.5, 0.5 + 1e-7, 0.5 + 2e-7, 0.9, 0.9 + 5e-7, 2.0])
    tol = sv.resolution_tolerance(ev, 8, torch.float32)
    assert tol == pytest.approx(sv.RESOLUTION_FACTOR * 8 * 2.0**-24 * 2.0)
    assert sv.unit_roundoff(torch.float64) == 2.0**-53
    sel = sv.selected_indices(ev, 3, "abs_desc")  # |lambda| descending: 2.0, -1.0, 0.9 + 5e-7
    assert list(sel) == [7, 0, 6]
    groups = sv.eigen_groups(ev, sel, tol)
    assert [list(g) for g in groups] == [[5, 6]]  # 0.5-triple has no selected member; 0.9 pair straddles the boundary
    assert sv.relative_eigengap(ev, sel) == pytest.approx(5e-7 / 2.0)
    assert list(sv.selected_indices(ev, 3, "asc_top")) == [5, 6, 7]
    assert list(sv.selected_indices(ev, 2, "desc")) == [7, 6]


@pytest.mark.parametrize("m,k", [(2, 2), (5, 5), (7, 3)])
def test_haar_draws_are_orthogonal_and_cover_both_determinants(m, k):
    q = sv.haar_orthogonal(np.random.default_rng(0), m, 200, k=k)
    assert q.shape == (200, m, k)
    eye = np.einsum("rmi,rmj->rij", q, q)
    assert np.abs(eye - np.eye(k)).max() < 1e-12
    if k == m:
        dets = np.sign(np.linalg.det(q))
        assert (dets > 0).any() and (dets < 0).any()  # reflections are in O(m) too
    # Haar: invariant mean zero entries, E[q_ij^2] = 1/m
    assert np.abs((q**2).mean(0) - 1.0 / m).max() < 0.1


@pytest.mark.parametrize("paper", [True, False])
def test_ckas_are_invariant_under_rotations_inside_groups(paper):
    gen = np.random.default_rng(1)
    v = torch.from_numpy(gen.standard_normal((40, 6)))
    vk = torch.from_numpy(gen.standard_normal((40, 6)))
    q = np.eye(6)
    q[1:4, 1:4] = sv.haar_orthogonal(gen, 3)[0]
    q[4:6, 4:6] = sv.haar_orthogonal(gen, 2)[0]
    q[0, 0] = -1.0
    rotated = vk @ torch.from_numpy(q)
    for cka in (linear_cka, rbf_cka):
        a, b = float(cka(v, vk, paper)), float(cka(v, rotated, paper))
        assert a == pytest.approx(b, abs=1e-10)


def test_pair_rotation_bound_equals_a_dense_angle_search():
    gen = np.random.default_rng(2)
    theta = np.linspace(-np.pi, np.pi, 200001)
    for _ in range(20):
        m = gen.standard_normal((2, 2))
        # the closed form is tr(M Q(theta)) for rotations and reflections
        for reflect in (False, True):
            t = 0.37
            q = np.array([[np.cos(t), np.sin(t)], [np.sin(t), -np.cos(t)]]) if reflect else np.array([[np.cos(t), -np.sin(t)], [np.sin(t), np.cos(t)]])
            assert sv.pair_direct_mean(m, np.array(t), reflect) == pytest.approx(np.trace(m @ q))
        brute = np.concatenate([sv.pair_direct_mean(m, theta, False), sv.pair_direct_mean(m, theta, True)])
        bound = float(sv.group_trace_bound(m))
        assert brute.max() == pytest.approx(bound, abs=1e-9) and brute.min() == pytest.approx(-bound, abs=1e-9)


def test_without_near_degenerate_groups_the_draws_are_the_sign_draws():
    ev = np.concatenate([np.linspace(1.0, 0.2, 12), np.zeros(18) + np.linspace(-1e-3, -0.1, 18)])
    kc = _matrix(ev, 3)
    v = np.random.default_rng(4).standard_normal((30, 8)).astype(np.float32)
    rows = _rows(kc, v, 8)
    draws, cols = sv.head_solver_draws(rows, IDS, seed=7, n_direct=64, n_optimal=3, token_max=True, order="abs_desc")
    old = unc.head_sign_draws(rows["v"], rows["v_kpca"], IDS, seed=7, n_direct=64, n_optimal=3, token_max=True)
    assert cols["solver_groups"][0] == 0 and not cols["solver_boundary_group"][0]
    for name in (*unc.SIGN_DRAW_NAMES, unc.MEAN_VECTOR):
        assert np.array_equal(draws[name], old[name]), name
    assert np.array_equal(draws["direct_cos_mean_lower"], draws["direct_cos_mean"])
    assert np.array_equal(draws["direct_cos_mean_upper"], draws["direct_cos_mean"])


def _token_mean(v: np.ndarray, a: np.ndarray, inv_g: np.ndarray) -> float:
    vk = v_kpca(torch.from_numpy(a), torch.from_numpy(inv_g), paper=False)
    return float((row_normalize(torch.from_numpy(v), ROW_NORM_EPS) * row_normalize(vk, ROW_NORM_EPS)).sum(-1).mean())


def test_bounds_equal_a_brute_force_search_over_the_degenerate_pair():
    """An exactly degenerate pair inside the selection: the own-sign bounds are the extreme
    token means over every rotation and reflection of the pair (dense search)."""
    ev = np.array([3.0, 2.0, 2.0, 1.0, 0.5, 0.25] + [0.01 * i for i in range(14)])
    kc = _matrix(ev, 5)
    v = np.random.default_rng(6).standard_normal((20, 5))
    rows = _rows(kc, v.astype(np.float32), 5)
    draws, cols = sv.head_solver_draws(rows, IDS, seed=0, n_direct=8, n_optimal=0, token_max=False, order="abs_desc")
    assert cols["solver_groups"][0] == 1 and cols["solver_group_max"][0] == 2
    a, inv_g = rows["a"][0].double().numpy(), rows["inv_g"][0].double().numpy()
    values = []
    for t in np.linspace(-np.pi, np.pi, 4001):
        for reflect in (False, True):
            q = np.array([[np.cos(t), np.sin(t)], [np.sin(t), -np.cos(t)]]) if reflect else np.array([[np.cos(t), -np.sin(t)], [np.sin(t), np.cos(t)]])
            b = a.copy()
            b[:, 1:3] = a[:, 1:3] @ q
            values.append(_token_mean(v, b, inv_g))
    assert max(values) == pytest.approx(float(draws["direct_cos_mean_own_upper"][0, 0]), abs=2e-6)
    assert min(values) == pytest.approx(float(draws["direct_cos_mean_own_lower"][0, 0]), abs=2e-6)
    # every draw's value lies inside its bounds
    assert (draws["direct_cos_mean_lower"] <= draws["direct_cos_mean"] + 1e-6).all()
    assert (draws["direct_cos_mean"] <= draws["direct_cos_mean_upper"] + 1e-6).all()


def _scipy(driver):
    def eigh(k):
        w, vec = scipy.linalg.eigh(k.numpy(), driver=driver)
        return torch.from_numpy(w), torch.from_numpy(vec)

    return eigh


def test_degenerate_head_under_different_drivers_lands_inside_its_interval():
    """The whole selection is one degenerate pair (d = 2): every driver's answer differs in
    its rotation, and every one lies inside the own-sign range of the pipeline's solver."""
    ev = np.array([2.0, 2.0 * (1 + 1e-8), 0.7, 0.3, 0.1] + [0.001 * i for i in range(11)])
    kc = _matrix(ev, 8)
    v = np.random.default_rng(9).standard_normal((16, 2)).astype(np.float32)
    rows = _rows(kc, v, 2)
    draws, cols = sv.head_solver_draws(rows, IDS, seed=0, n_direct=16, n_optimal=0, token_max=False, order="abs_desc")
    lo, hi = float(draws["direct_cos_mean_own_lower"][0, 0]), float(draws["direct_cos_mean_own_upper"][0, 0])
    assert cols["solver_group_max"][0] == 2 and hi - lo > 0.1
    inv_g = rows["inv_g"][0].double().numpy()
    seen = set()
    for solver in (torch.linalg.eigh, _scipy("evd"), _scipy("evr"), _scipy("evx"), lambda k: tuple(map(torch.from_numpy, np.linalg.eigh(k.numpy().astype(np.float64))))):
        a = _rows(kc, v, 2, eigh=solver)["a"][0].double().numpy()
        value = _token_mean(v.astype(np.float64), a, inv_g)
        seen.add(round(value, 6))
        assert lo - 1e-6 <= value <= hi + 1e-6
    assert len(seen) > 1  # the drivers really differ


def _table_heads(n_img: int = 4, n_heads: int = 3) -> pd.DataFrame:
    gen = np.random.default_rng(3)
    rows = [
        {"model": "m", "variant": "paper", "sample_rank": i, "dataset_index": i, "layer": 0, "head": h, "dropped": False, "exp_overflow": False, "outer_overflow": False, "allclose": False}
        for i in range(n_img)
        for h in range(n_heads)
    ]
    df = pd.DataFrame(rows)
    for col in ("direct_cos_mean", "optimal_cos_mean", "linear_cka", "rbf_cka", "direct_cos_max", "optimal_cos_max"):
        df[col] = gen.uniform(0, 0.3, len(df))
    df["eigengap_min"] = gen.uniform(1e-7, 1e-3, len(df))
    return df


def test_table1_solver_interval_holds_the_point_estimate_and_names_the_deciding_head():
    df = _table_heads()
    h = len(df)
    x = df["direct_cos_mean"].to_numpy()
    gen = np.random.default_rng(0)
    spread = gen.uniform(-0.2, 0.2, (h, 16))
    draws = {
        "direct_cos_mean": spread.astype(np.float32),
        "direct_cos_max": np.zeros((h, 0), np.float32),
        "optimal_cos_mean": (df["optimal_cos_mean"].to_numpy()[:, None] - 0.01).astype(np.float32),
        "optimal_cos_max": np.zeros((h, 1), np.float32),
        unc.MEAN_VECTOR: np.zeros((h, 2), np.float32),
        "direct_cos_mean_lower": (spread - 0.05).astype(np.float32),
        "direct_cos_mean_upper": (spread + 0.05).astype(np.float32),
        "direct_cos_mean_own_lower": (x[:, None] - 0.02).astype(np.float32),
        "direct_cos_mean_own_upper": (x[:, None] + 0.03).astype(np.float32),
    }
    t = tables.paper_table(tables.TABLES["table1"], df, {"m": {"n_images": 4, "weights_sha256": "s"}}, draws, {"bootstrap": 200})
    row = t.iloc[0]
    assert row["MDC_solver_lower"] <= row["MDC"] <= row["MDC_solver_upper"]
    # the own-sign range is exact: the max over heads of the own upper bounds
    assert row["MDC_solver_upper"] >= x.max() + 0.03 - 1e-6
    top = df.iloc[int(np.argmax(x))]
    assert (row["MDC_layer"], row["MDC_head"], row["MDC_sample_rank"]) == (top["layer"], top["head"], top["sample_rank"])
    assert row["MDC_eigengap"] == top["eigengap_min"]
    assert "MDC_sign_lower" not in t.columns and "MOC_solver_lower" in t.columns
    assert bool(row["solver_rotations"])
    # MOC: every head takes its (single) draw, joined with the reproduced value
    moc = df["optimal_cos_mean"].to_numpy()
    assert row["MOC_solver_lower"] == pytest.approx(moc.max() - 0.01, abs=1e-6) and row["MOC_solver_upper"] == pytest.approx(moc.max())
    assert row["MOC_lower"] <= row["MOC"] <= row["MOC_upper"] and row["interval_note"] == ""


def test_statuses_claim_only_what_the_interval_varies():
    assert cmp.status("0.15", 0.124, 0.11, 0.16, solver=False) == cmp.CONSISTENT_SAMPLING
    assert cmp.status("0.15", 0.124, 0.11, 0.14, solver=False) == cmp.DIFFERS_SAMPLING
    assert cmp.status("0.15", 0.124, 0.11, 0.16) == cmp.CONSISTENT
    assert "solver" not in cmp.CONSISTENT_SAMPLING and "solver" not in cmp.DIFFERS_SAMPLING


def test_per_head_range_is_the_exact_extreme_over_every_sign_pattern():
    """Without groups the range is +-sum |m_c|: the extremes of m . sigma over all 2^d patterns."""
    ev = np.concatenate([np.linspace(1.0, 0.2, 12), np.linspace(-1e-3, -0.1, 18)])
    kc = _matrix(ev, 3)
    v = np.random.default_rng(4).standard_normal((30, 6)).astype(np.float32)
    rows = _rows(kc, v, 6)
    draws, _ = sv.head_solver_draws(rows, IDS, seed=0, n_direct=4, n_optimal=0, token_max=False, order="abs_desc")
    m = draws[unc.MEAN_VECTOR][0].astype(np.float64)
    every = np.array(np.meshgrid(*[[-1.0, 1.0]] * 6)).reshape(6, -1).T @ m
    assert float(draws["direct_cos_mean_range_upper"][0, 0]) == pytest.approx(every.max(), abs=1e-6)
    assert float(draws["direct_cos_mean_range_lower"][0, 0]) == pytest.approx(every.min(), abs=1e-6)
    # with a degenerate pair: the range holds every sign pattern of the other columns times every pair rotation
    ev2 = np.array([3.0, 2.0, 2.0, 1.0, 0.5, 0.25] + [0.01 * i for i in range(14)])
    kc2 = _matrix(ev2, 5)
    v2 = np.random.default_rng(6).standard_normal((20, 5))
    rows2 = _rows(kc2, v2.astype(np.float32), 5)
    d2, _ = sv.head_solver_draws(rows2, IDS, seed=0, n_direct=4, n_optimal=0, token_max=False, order="abs_desc")
    a, inv_g = rows2["a"][0].double().numpy(), rows2["inv_g"][0].double().numpy()
    lo, hi = float(d2["direct_cos_mean_range_lower"][0, 0]), float(d2["direct_cos_mean_range_upper"][0, 0])
    values = []
    for signs in np.array(np.meshgrid(*[[-1.0, 1.0]] * 3)).reshape(3, -1).T:
        for t in np.linspace(-np.pi, np.pi, 181):
            b = a.copy()
            b[:, [0, 3, 4]] *= signs
            b[:, 1:3] = a[:, 1:3] @ np.array([[np.cos(t), -np.sin(t)], [np.sin(t), np.cos(t)]])
            values.append(_token_mean(v2, b, inv_g))
    assert lo - 1e-6 <= min(values) and max(values) <= hi + 1e-6
    assert max(values) == pytest.approx(hi, abs=1e-3) and min(values) == pytest.approx(lo, abs=1e-3)  # attained (grid of 2 degrees)


def test_assignment_upper_bound_bounds_the_optimum_and_is_tight_on_a_permutation():
    """LP duality: the row-and-column reduction bound is never below the assignment's optimum
    (scipy), and equals it where each row's best column is its own (a permuted diagonal)."""
    from scipy.optimize import linear_sum_assignment

    rng = np.random.default_rng(0)
    sim = torch.from_numpy(rng.uniform(-1, 1, size=(50, 23, 23)))
    bound = sv.assignment_upper_bound(sim).numpy()
    for s, b in zip(sim.numpy(), bound):
        r, c = linear_sum_assignment(-s)
        assert b >= s[r, c].mean() - 1e-12
    perm = rng.permutation(23)
    s = np.full((23, 23), -0.5)
    s[np.arange(23), perm] = rng.uniform(0.5, 1.0, 23)
    assert sv.assignment_upper_bound(torch.from_numpy(s)[None]).item() == pytest.approx(s[np.arange(23), perm].mean(), abs=1e-12)


def test_collision_bound_lies_between_the_optimum_and_the_reduction_bound():
    """The reduced costs' collision bound is a valid upper bound of the assignment's optimum
    (scipy), never above the row-and-column reduction bound, and strictly tighter where many
    rows prefer the same columns (low-rank similarities, as V Vkpca^T of a head); NaN in, NaN out."""
    from scipy.optimize import linear_sum_assignment

    rng = np.random.default_rng(3)
    uniform = rng.uniform(-1, 1, size=(40, 23, 23))
    x, y = rng.standard_normal((2, 40, 31, 4))
    low_rank = x @ np.swapaxes(y, -1, -2) / 4 + 0.05 * rng.standard_normal((40, 31, 31))
    for sims in (uniform, low_rank):
        sim = torch.from_numpy(sims)
        tight, cheap = sv.assignment_collision_bound(sim).numpy(), sv.assignment_upper_bound(sim).numpy()
        optimum = np.array([s[linear_sum_assignment(-s)].mean() for s in sims])
        assert (tight >= optimum - 1e-12).all() and (tight <= cheap + 1e-12).all()
    assert (tight < cheap - 1e-3).mean() > 0.5  # the collisions bite on low-rank similarities
    sims[0, 3, 5] = np.nan
    assert np.isnan(sv.assignment_collision_bound(torch.from_numpy(sims)).numpy()[0])


def _collision_lower_bound_by_definition(cost: np.ndarray, axis: int) -> np.ndarray:
    """The collision bound of each matrix, line by line in plain Python: every line pays its
    smallest entry, every line but the one with the largest penalty in each group of lines
    whose (first) argmin is the same place also pays its penalty (second smallest - smallest)."""
    out = []
    for c in cost:
        lines = c if axis == -1 else c.T
        total, groups = 0.0, {}
        for line in lines:
            order = np.argsort(line, kind="stable")
            m1, m2 = line[order[0]], line[order[1]]
            total += m1 + (m2 - m1)
            groups.setdefault(int(order[0]), []).append(m2 - m1)
        out.append(total - sum(max(g) for g in groups.values()))
    return np.array(out)


def test_collision_lower_bound_is_its_definition_whatever_the_ties():
    """The lower bound of the reduced costs' assignment equals its definition computed line by
    line, on costs with many exact ties (small integers), along rows and along columns: a tied
    line's penalty is 0, so which of its minima is taken does not matter."""
    rng = np.random.default_rng(11)
    for shape, high in (((30, 9, 9), 4), ((10, 25, 25), 50)):
        cost = rng.integers(0, high, size=shape).astype(np.float32)
        for axis in (-1, -2):
            got = sv._collision_lower_bound(torch.from_numpy(cost), axis).double().numpy()
            np.testing.assert_allclose(got, _collision_lower_bound_by_definition(cost.astype(np.float64), axis), rtol=0, atol=1e-4)


def test_running_floor_only_rises():
    f = sv.RunningFloor()
    assert f.value == -np.inf
    for x in (0.2, float("nan"), 0.1, 0.3):
        f.offer(x)
    assert f.value == 0.3


def _toy_file(path, n_images=8, n_heads=3, n_layers=2, n=24, d=8, seed=0):
    """An activation file whose heads differ in scale, so that some heads' matched cosines lie far below others."""
    from kpca_repro.activations import write_activations

    gen = np.random.default_rng(seed)
    layers = []
    for _ in range(n_layers):
        t = {x: gen.standard_normal((n_images, n_heads, n, d)).astype(np.float32) for x in "qkvh"}
        t["v"][:, 0] = t["k"][:, 0]  # head 0: values that follow the keys (high matched cosines)
        layers.append(t)
    write_activations(path, layers, model_id="toy", dataset_index=np.arange(n_images) * 3, attrs={"weights_sha256": "0" * 64}, check_invariant=False)
    return path


def test_pruned_matched_draws_give_the_intervals_of_every_draw(tmp_path):
    """Table 1's MOC is a maximum over heads: the draws the kpca_heads job leaves NaN (their
    bound lies below a value every replicate maximum reaches) change no interval, bit for bit,
    and every draw it keeps is the draw computed without pruning."""
    from kpca_repro.method.placement import plan
    from kpca_repro.method.records import KpcaJob, kpca_records

    path = _toy_file(tmp_path / "a.h5")
    job = KpcaJob("paper", plan("paper", device="cpu", cores=2, eigh_threads=1), heads_per_chunk=5, sign_draws=(16, 6))
    full, meta_full, d_full = kpca_records(path, dataclasses.replace(job, prune_matched_draws=False))
    pruned, meta, d = kpca_records(path, job)
    pd.testing.assert_frame_equal(pruned, full)
    kept = np.isfinite(d["optimal_cos_mean"])
    assert 0 < kept.sum() < kept.size, "the toy heads should leave some draws below the floor"
    np.testing.assert_array_equal(d["optimal_cos_mean"][kept], d_full["optimal_cos_mean"][kept])
    np.testing.assert_array_equal(~kept, d[unc.MATCHED_BOUND] < meta["matched_draws_floor"])
    own = full["optimal_cos_mean"].to_numpy()
    floor = np.max(np.minimum(own, np.nanmin(d_full["optimal_cos_mean"], axis=1)))
    assert meta["matched_draws_floor"] == pytest.approx(floor, abs=1e-7)  # max over heads of min(own, draws)
    assert (d_full["optimal_cos_mean"][~kept] < floor + 1e-7).all()
    meta_full = {**meta_full, "model_id": "toy"}
    t_full = tables.paper_table(tables.TABLES["table1"], full.assign(model="toy"), {"toy": {"weights_sha256": "0", "n_images": 8}}, d_full, {"seed": 0, "bootstrap": 200})
    t_pruned = tables.paper_table(tables.TABLES["table1"], pruned.assign(model="toy"), {"toy": {"weights_sha256": "0", "n_images": 8}}, d, {"seed": 0, "bootstrap": 200})
    pd.testing.assert_frame_equal(t_pruned, t_full, check_exact=True)


def test_pruned_draws_and_their_bounds_do_not_depend_on_workers_or_chunks(tmp_path):
    """The floor rises in whatever order the workers finish, and the collision bound is computed
    only where the first bound reaches the floor as it stood: the stored draws and bounds are
    still the same, bit for bit, for one worker or two and any chunk size (prune_below_floor)."""
    from kpca_repro.method.placement import plan
    from kpca_repro.method.records import KpcaJob, kpca_records

    path = _toy_file(tmp_path / "a.h5", n_images=10)
    jobs = [KpcaJob("paper", plan("paper", device="cpu", cores=w, eigh_threads=1), heads_per_chunk=c, sign_draws=(16, 6)) for w, c in ((1, 30), (2, 4), (2, 7))]
    runs = [kpca_records(path, job)[1:] for job in jobs]
    ref = runs[0][1]
    assert unc.COLLISION_BOUND not in ref and 0 < np.isfinite(ref["optimal_cos_mean"]).sum() < ref["optimal_cos_mean"].size
    for meta, draws in runs[1:]:
        assert meta["matched_draws_floor"] == runs[0][0]["matched_draws_floor"]
        assert draws.keys() == ref.keys()
        for name, x in ref.items():
            np.testing.assert_array_equal(draws[name], x, err_msg=name)


def test_prune_below_floor_takes_the_collision_bound_where_the_first_reaches_the_floor():
    """A draw's stored bound is its collision bound where its first bound reaches the final
    floor (always computed there), its first bound elsewhere; a draw computed while the floor
    was lower is set to NaN when that bound lies below the final floor."""
    draws = {
        unc.MATCHED_BOUND: np.array([[0.5, 0.5, 0.2, np.nan]], np.float32),
        unc.COLLISION_BOUND: np.array([[0.45, 0.3, 0.25, np.nan]], np.float32),  # the third: computed when the floor was lower
        "optimal_cos_mean": np.array([[0.44, 0.29, 0.19, np.nan]], np.float32),
        "optimal_cos_max": np.array([[0.9, 0.8, 0.7, np.nan]], np.float32),
    }
    out = sv.prune_below_floor(draws, 0.4)
    assert unc.COLLISION_BOUND not in out
    np.testing.assert_array_equal(out[unc.MATCHED_BOUND], np.array([[0.45, 0.3, 0.2, np.nan]], np.float32))
    np.testing.assert_array_equal(out["optimal_cos_mean"], np.array([[0.44, np.nan, np.nan, np.nan]], np.float32))
    np.testing.assert_array_equal(out["optimal_cos_max"], np.array([[0.9, np.nan, np.nan, np.nan]], np.float32))


def test_the_float32_screen_finds_every_group_the_float64_spectrum_finds():
    """The float64 spectrum is computed only where the solver's own gaps come within
    SCREEN_FACTOR tolerances: heads with and without near-degenerate pairs get the groups of
    the full float64 computation."""
    rng = np.random.default_rng(3)
    n = 40
    for close in (1e-7, 3e-6, 1e-3):  # below, just above and far above the float32 tolerance of 2.4e-6 here
        ev = np.sort(np.concatenate([rng.uniform(-0.1, 0.1, n - 6), [1.0, 0.9, 0.8, 0.7, 0.6, 0.6 + close]]))
        kc = torch.from_numpy(_matrix(ev, seed=4))
        w = torch.linalg.eigvalsh(kc)
        screened = sv._degenerate_groups(kc, w, 5, "abs_desc", torch.float32, sv.RESOLUTION_FACTOR)
        full = sv._degenerate_groups(kc, None, 5, "abs_desc", torch.float32, sv.RESOLUTION_FACTOR)
        assert [list(g) for g in screened[0]] == [list(g) for g in full[0]]
        assert bool(full[0]) == (close == 1e-7)
        assert (screened[1] is None) == (close == 1e-3)  # the float64 spectrum only where a gap is close


def test_combined_interval_of_a_maximum_holds_the_solver_and_the_bootstrap_interval():
    """docs/uncertainty.md section 3: sampling and solver deviations added; the old percentile
    bootstrap with draws ran low for a maximum (issue 45: 0.038-0.106 against a solver
    interval of 0.043-0.133 with 4 images)."""
    lo, hi = combine_for_maximum(0.1, (0.043, 0.133), (0.06, 0.1))
    assert (lo, hi) == pytest.approx((0.003, 0.133))
    lo, hi = combine_for_maximum(0.1, (0.09, 0.12), (0.08, 0.11))
    assert (lo, hi) == pytest.approx((0.07, 0.13))
    rng = np.random.default_rng(0)
    for _ in range(200):
        v = rng.uniform(0, 1)
        s = sorted([v - rng.uniform(0, 0.2), v + rng.uniform(0, 0.2)])
        b = sorted([v - rng.uniform(0, 0.2), v + rng.uniform(-0.1, 0.2)])
        lo, hi = combine_for_maximum(v, tuple(s), tuple(b))
        assert lo <= min(s[0], b[0]) and hi >= max(s[1], b[1])
