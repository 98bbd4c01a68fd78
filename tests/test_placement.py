"""Where the KPCA engine runs each kind of work (kpca_repro.method.placement), and the thread arithmetic of a job.

These run on the CPU. The CUDA placement is tested as a decision (no CUDA call is made to
decide it), and the GPU's batched solver call as what it is on the CPU: one ``eigh`` call
for a whole block of heads (torch's, and JAX's where JAX is installed), against float64
and against the per-matrix path, every column.
"""

from __future__ import annotations

import dataclasses
import os
import threading

import numpy as np
import pytest
import torch

from kpca_repro.method import equations as method
from kpca_repro.method import kpca
from kpca_repro.method.placement import EIGENSOLVERS, Placement, batched_eigensolver, plan
from kpca_repro.method.variant import get as get_variant
from kpca_repro.threads import gpu_resource, intra_op_threads
from kpca_repro.workers import ordered_map

CPU = torch.device("cpu")


def test_plan_decides_where_each_kind_of_work_runs():
    """The table of kpca_repro.method.placement, row by row, for a 2-core CPU job and a 16-core GPU job."""
    cpu = plan("paper", device="cpu", cores=2, eigh_threads=2)
    assert (cpu.device.type, cpu.eigh_device.type, cpu.eigh_batched, cpu.eigh_threads) == ("cpu", "cpu", False, 2)
    assert cpu.per_head_products and cpu.solve_on_main and not cpu.streams
    assert (cpu.workers, cpu.blas_threads) == (2, 1)
    corrected = plan("corrected", device="cpu", cores=2, eigh_threads=2)
    assert corrected.eigh_threads is None and not corrected.per_head_products and not corrected.solve_on_main and not corrected.eigh_batched
    spectra = plan("paper", device="cpu", cores=2, eigh_threads=2, sign_invariant=True)
    assert spectra.eigh_threads is None and not spectra.solve_on_main
    # a GPU job: the paper variant's eigh where the authors' script calls it (torch on the CUDA
    # tensor, batched), per-head products on the GPU, workers with their own streams
    gpu = plan("paper", device="cuda", cores=16, eigh_threads="auto")
    assert (gpu.device.type, gpu.eigh_device.type, gpu.eigh_batched, gpu.eigensolver) == ("cuda", "cuda", True, "torch")
    assert gpu.eigh_threads is None and gpu.per_head_products and gpu.streams and not gpu.solve_on_main
    assert (gpu.workers, gpu.blas_threads) == (16, 1)
    # sign-invariant work takes the batched solver of kpca.gpu_eigensolver
    for variant, invariant in (("corrected", False), ("paper", True)):
        place = plan(variant, device="cuda", cores=16, gpu_eigensolver="torch", sign_invariant=invariant)
        assert place.eigh_batched and place.eigensolver == "torch"
    assert plan("corrected", device="cuda", gpu_eigensolver="jax").eigensolver == "jax"
    assert "solved on the main thread" in cpu.describe() and "a CUDA stream per worker" in gpu.describe()
    with pytest.raises(ValueError, match="kpca.gpu_eigensolver"):
        batched_eigensolver("cusolver")
    with pytest.raises(ValueError, match="at least 1 core"):
        plan("paper", device="cpu", cores=0)


def test_auto_solver_is_torch_from_2_12_and_jax_before():
    major, minor = (int(x) for x in torch.__version__.split(".")[:2])
    expected = "torch" if (major, minor) >= (2, 12) else "jax"
    assert batched_eigensolver("auto") == expected
    assert set(EIGENSOLVERS) == {"torch", "jax"}


def test_gpu_resource_follows_the_device(monkeypatch):
    """device: auto declares a GPU only where an NVIDIA GPU is visible (judged without torch), cpu never,
    cuda always; a GPU torch can use is visible, and CUDA_VISIBLE_DEVICES="" or -1 hides every one."""
    from kpca_repro.threads import nvidia_gpu_visible

    assert gpu_resource("cpu") == 0
    assert gpu_resource("cuda") == gpu_resource("cuda:1") == 1
    assert gpu_resource("auto") == int(nvidia_gpu_visible())
    if torch.cuda.is_available():
        assert nvidia_gpu_visible()
    for hidden in ("", "-1"):
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", hidden)
        assert gpu_resource("auto") == 0 and not nvidia_gpu_visible()


def test_workers_run_numpy_blas_on_one_thread_each():
    """A job's map caps numpy's BLAS at one thread per worker (OpenBLAS reads OMP_NUM_THREADS, which
    Snakemake sets to the job's cores), and the count comes back after it."""
    from threadpoolctl import threadpool_info, threadpool_limits

    def blas_threads():
        return {lib["filepath"]: lib["num_threads"] for lib in threadpool_info() if lib["user_api"] == "blas"}

    np.ones((2, 2)) @ np.ones((2, 2))  # numpy's BLAS loaded
    with threadpool_limits(limits=2, user_api="blas"):
        before = blas_threads()
        assert before and set(before.values()) == {2}
        for workers in (1, 2):
            inside = list(ordered_map(lambda _: blas_threads(), range(3), workers=workers, blas_threads=1))
            assert all(seen == dict.fromkeys(before, 1) for seen in inside)
            assert blas_threads() == before
        assert list(ordered_map(lambda _: blas_threads(), range(2), workers=2)) == [before, before]  # no cap: untouched


def test_a_two_core_job_solves_on_two_threads_and_compares_on_one(monkeypatch, tmp_path):
    """The thread arithmetic of the paper variant's kpca_heads job on 2 cores: eigh (and the
    per-head products) on the main thread with the authors' 2 threads while the workers
    compare the previous batch, the comparisons on 2 workers with 1 thread each at the lowest
    priority (nice 19); the records do not depend on it."""
    from test_batching_and_sharding import _activation_file

    from kpca_repro.method import records as records_module
    from kpca_repro.method.records import KpcaJob, kpca_records

    path = _activation_file(tmp_path / "a.h5", n_images=4, n_heads=3, n_layers=2)
    place = plan("paper", device="cpu", cores=2, eigh_threads=2)
    seen, compared, active, lock, overlap = [], [], [0], threading.Lock(), threading.Event()
    real_eigh, real_chunk_records = torch.linalg.eigh, records_module.chunk_records

    def eigh(m, *a, **k):
        seen.append((threading.current_thread() is threading.main_thread(), torch.get_num_threads(), active[0]))
        if active[0]:
            overlap.set()
        return real_eigh(m, *a, **k)

    def chunk_records(*a, **k):
        with lock:
            active[0] += 1
        try:
            compared.append((threading.current_thread() is threading.main_thread(), torch.get_num_threads(), os.getpriority(os.PRIO_PROCESS, threading.get_native_id())))
            overlap.wait(timeout=0.5)  # still at work while the main thread solves the next batch
            return real_chunk_records(*a, **k)
        finally:
            with lock:
                active[0] -= 1

    monkeypatch.setattr(torch.linalg, "eigh", eigh)
    monkeypatch.setattr(records_module, "chunk_records", chunk_records)
    with intra_op_threads(1):
        records, meta, _ = kpca_records(path, KpcaJob("paper", heads_per_chunk=4, placement=place))
    monkeypatch.undo()
    assert seen and all(main and threads == 2 for main, threads, _ in seen)
    assert any(workers_at_work for _, _, workers_at_work in seen)  # solved while the workers compared
    assert compared and all(not main and threads == 1 and nice == 19 for main, threads, nice in compared)
    assert meta["eigh_threads"] == 2
    with intra_op_threads(1):
        alone, _, _ = kpca_records(path, KpcaJob("paper", heads_per_chunk=24, placement=plan("paper", device="cpu", cores=1, eigh_threads=2)))
    np.testing.assert_array_equal(records.select_dtypes("number").to_numpy(), alone.select_dtypes("number").to_numpy())


def _separated_heads(n_heads=6, n=40, d=8, seed=0):
    """Keys and values whose centered Gram spectra are well separated (no eigenvalue within 1e-3 of another among the top d + 1)."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(n_heads, n, d, generator=g, dtype=torch.float64) * 0.5
    v = torch.randn(n_heads, n, d, generator=g, dtype=torch.float64)
    ev = torch.linalg.eigvalsh(kpca.centered_gram(k, "corrected"))
    top = ev.abs().sort(-1, descending=True).values[:, : d + 1]
    gaps = (top[:, :-1] - top[:, 1:]) / top[:, :1]
    assert float(gaps.min()) > 1e-3, "test data without separated eigenvalues"
    return k, v


@pytest.mark.parametrize("solver", ["torch", "jax"])
def test_batched_solver_against_float64(solver):
    """The GPU's call (one batched eigh of a block) on the CPU: eigenvalues within 1e-5 of
    float64 (relative to ||K||), eigenvectors spanning the same lines; non-finite matrices kept
    from the solver."""
    if solver == "jax":
        pytest.importorskip("jax", reason="the gpu and test extras install JAX")
    k, _ = _separated_heads()
    kc64 = kpca.centered_gram(k, "corrected")
    kc = torch.cat([kc64.float(), torch.full((1, *kc64.shape[1:]), float("nan"))])
    batched = Placement(CPU, CPU, eigh_batched=True, eigensolver=solver)
    evals, a, finite = kpca.eigenpairs(kc, 8, "abs_desc", placement=batched)
    want, want_a, _ = kpca.eigenpairs(kc64, 8, "abs_desc")
    assert finite.tolist() == [True] * 6 + [False] and torch.isnan(evals[-1]).all() and torch.isnan(a[-1]).all()
    scale = want.abs().amax(-1, keepdim=True)
    assert float(((evals[:-1].double() - want) / scale).abs().max()) < 1e-5
    cos = (a[:-1].double() * want_a).sum(-2).abs()
    assert float((1 - cos).abs().max()) < 1e-4


@pytest.mark.parametrize("solver", ["torch", "jax"])
@pytest.mark.parametrize("variant", ["paper", "corrected"])
def test_batched_path_gives_every_column_of_the_per_matrix_path(variant, solver):
    """head_metrics through the batched solver against the per-matrix path, every column:
    the corrected variant (signs fixed) within 1e-9; the paper variant with the batched
    eigenvectors' signs aligned to the per-matrix ones (a solver may return either sign,
    docs/uncertainty.md) within 1e-6 for torch's batched LAPACK call, RBF CKA within 5e-6, and
    within 1e-5 for JAX's float32 solver (another algorithm: eigenvectors that round
    differently, 1.0e-6 apart in a token's cosine here); the flags equal."""
    if solver == "jax":
        pytest.importorskip("jax", reason="the gpu and test extras install JAX")
    var = get_variant(variant)
    k, v = _separated_heads()
    if variant == "paper":
        k, v = k.float(), v.float()
    base = torch.randn(v.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64) if var.baselines else None
    per_matrix = Placement.local("cpu", per_head_products=var.authors_threads)
    batched = Placement(CPU, CPU, eigh_batched=True, eigensolver=solver, per_head_products=var.authors_threads)
    ref = kpca.head_metrics(k, v, variant, placement=per_matrix, baseline=base)
    solved = kpca.solve_heads(k, v.shape[-1], var, batched)
    if variant == "paper":
        ref_solved = kpca.solve_heads(k, v.shape[-1], var, per_matrix)
        flip = torch.sign((solved["a"] * ref_solved["a"]).sum(-2, keepdim=True))
        a = solved["a"] * flip
        vk = method.v_kpca(a, solved["inv_g"])
        solved = {**solved, "a": a, "vk": vk, "vk_true": vk}
    got = kpca.head_metrics(k, v, variant, placement=batched, baseline=base, solved=solved)
    assert got.keys() == ref.keys()
    for name in ref:
        if ref[name].dtype == bool:
            np.testing.assert_array_equal(got[name], ref[name], err_msg=name)
            continue
        tol = 1e-9 if variant == "corrected" else 1e-5 if solver == "jax" else 5e-6 if name == "rbf_cka" else 1e-6
        np.testing.assert_allclose(got[name], ref[name], rtol=0, atol=tol, err_msg=name)


def test_a_sign_flip_is_caught_by_every_column_comparison():
    """The comparison above has teeth: negating the eigenvectors moves the direct cosines
    (the columns a CKA-only comparison let pass)."""
    var = get_variant("paper")
    k, v = (x.float() for x in _separated_heads())
    place = Placement.local("cpu", per_head_products=True)
    ref = kpca.head_metrics(k, v, "paper", placement=place)
    solved = kpca.solve_heads(k, v.shape[-1], var, place)
    vk = method.v_kpca(-solved["a"], solved["inv_g"])
    flipped = kpca.head_metrics(k, v, "paper", placement=place, solved={**solved, "a": -solved["a"], "vk": vk, "vk_true": vk})
    np.testing.assert_allclose(flipped["linear_cka"], ref["linear_cka"], rtol=0, atol=1e-6)
    assert np.abs(flipped["direct_cos_mean"] - ref["direct_cos_mean"]).max() > 1e-3


def test_solved_heads_equal_the_ones_head_metrics_solves():
    """head_metrics(solved=solve_heads(...)) is head_metrics itself (what the job does: solve on the main thread, compare on the workers)."""
    var = get_variant("paper")
    k, v = (x.float() for x in _separated_heads(n_heads=11))
    place = dataclasses.replace(Placement.local("cpu", per_head_products=True))
    ref = kpca.head_metrics(k, v, "paper", placement=place)
    got = kpca.head_metrics(k, v, "paper", placement=place, solved=kpca.solve_heads(k, v.shape[-1], var, place))
    for name in ref:
        np.testing.assert_array_equal(got[name], ref[name], err_msg=name)
