"""The fast paths give the numbers of the slow ones: batched = per head, sharded = unsharded.

Speed itself is measured by the benchmarks in perf/ (docs/performance.md), never here.
"""

from __future__ import annotations

import dataclasses
import threading

import numpy as np
import pandas as pd
import pytest
import torch

from kpca_repro.activations import ActivationFile, write_activations
from kpca_repro.method import equations as method
from kpca_repro.method import kpca, numerics
from kpca_repro.method.placement import Placement, plan
from kpca_repro.method.records import KpcaJob, kpca_records, layer_chunks
from kpca_repro.method.variant import PAPER
from kpca_repro.workers import WorkerPool, ordered_map

from conftest import TINY_KWARGS, run_snakemake

#: The GPU's solver call (one batched ``eigh``), run on the CPU.
BATCHED_CPU = Placement(torch.device("cpu"), torch.device("cpu"), eigh_batched=True)


@pytest.fixture
def one_thread():
    """One intra-op thread, as the KPCA rules run (torch's multi-threaded kernels split
    reductions by batch size, so bit-for-bit claims hold for a fixed intra-op thread count)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _heads(n_heads=7, n=40, d=8, seed=0):
    """Keys of growing magnitude (the last ones overflow float32 in the paper variant) and values."""
    gen = torch.Generator().manual_seed(seed)
    scale = torch.linspace(0.3, 9.0, n_heads)[:, None, None]
    k = torch.randn(n_heads, n, d, generator=gen) * scale
    v = torch.randn(n_heads, n, d, generator=gen)
    base = torch.randn(n_heads, n, d, generator=gen, dtype=torch.float64)
    return k, v, base


def _assert_same(a: dict[str, np.ndarray], b: dict[str, np.ndarray]):
    assert a.keys() == b.keys()
    for name in a:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)


@pytest.mark.parametrize("variant", ["paper", "corrected"])
@pytest.mark.parametrize("shape", [(40, 8), (33, 16)])
def test_batched_head_metrics_equal_the_per_head_path_bit_for_bit(variant, shape, one_thread):
    k, v, base = _heads(n=shape[0], d=shape[1])
    kwargs = lambda sl: {"baseline": base[sl]} if variant == "corrected" else {}  # noqa: E731
    batched = kpca.head_metrics(k, v, variant, **kwargs(slice(None)))
    singles = [kpca.head_metrics(k[h : h + 1], v[h : h + 1], variant, **kwargs(slice(h, h + 1))) for h in range(k.shape[0])]
    per_head = {name: np.concatenate([s[name] for s in singles]) for name in batched}
    _assert_same(batched, per_head)
    if variant == "paper":
        assert batched["dropped"].any() and not batched["dropped"].all()  # both kinds of head were exercised


@pytest.mark.parametrize("variant", ["paper", "text paper", "corrected"])
def test_cpu_blocks_change_no_number_and_keep_the_sign_draw_rows(variant, one_thread, monkeypatch):
    """19 heads cross two block boundaries (blocks of kpca.CPU_BLOCK_HEADS = 8): the same
    numbers and rows as one block of all 19, and the rows of each head are its own. "text
    paper": the language-model script's options (nothing dropped, NaN costs set to 0)."""
    assert kpca.CPU_BLOCK_HEADS < 19
    k, v, base = _heads(n_heads=19, n=30, d=8, seed=3)
    kwargs = {"baseline": base} if variant == "corrected" else {}
    variant = PAPER.reading(text=True) if variant == "text paper" else variant
    rows_blocks: dict = {}
    blocks = kpca.head_metrics(k, v, variant, rows=rows_blocks, **kwargs)
    monkeypatch.setattr(kpca, "CPU_BLOCK_HEADS", 64)
    rows_one: dict = {}
    one = kpca.head_metrics(k, v, variant, rows=rows_one, **kwargs)
    _assert_same(blocks, one)
    # kc, a, inv_g: for the rotations of kpca_repro.method.solver_variation (issue 34)
    assert rows_blocks.keys() == rows_one.keys() == {"v", "v_kpca", "kc", "a", "inv_g", "spectrum"}
    shapes = {"v": (19, 30, 8), "v_kpca": (19, 30, 8), "kc": (19, 30, 30), "a": (19, 30, 8), "inv_g": (19, 30), "spectrum": (19, 30)}
    for name in rows_one:
        assert rows_blocks[name].shape == shapes[name]
        torch.testing.assert_close(rows_blocks[name], rows_one[name], rtol=0, atol=0, equal_nan=True)  # overflowing heads: NaN
    last: dict = {}
    kpca.head_metrics(k[18:], v[18:], variant, rows=last, **{**kwargs, **({"baseline": base[18:]} if "baseline" in kwargs else {})})
    torch.testing.assert_close(rows_blocks["v_kpca"][18:], last["v_kpca"], rtol=0, atol=0, equal_nan=True)
    with pytest.raises(ValueError, match="baseline must have"):
        kpca.head_metrics(k, v, "corrected", baseline=base[:-1])


def test_batched_eigenpairs_equal_one_matrix_at_a_time(one_thread):
    k = torch.randn(6, 37, 8, generator=torch.Generator().manual_seed(1))
    kc = method.center_dense(method.gram_paper(k)[0])
    evals, evecs, finite = kpca.eigenpairs(kc, 8, "abs_desc")
    assert finite.all()
    for h in range(kc.shape[0]):
        e1, a1, _ = kpca.eigenpairs(kc[h : h + 1].clone(), 8, "abs_desc")
        assert torch.equal(evals[h : h + 1], e1) and torch.equal(evecs[h : h + 1], a1)
    # the batched solver (the CUDA default) gives the same eigenpairs up to round-off and sign
    kc64 = kc.double()
    kc64 = (kc64 + kc64.transpose(-1, -2)) / 2
    e1, a1, _ = kpca.eigenpairs(kc64, 8, "abs_desc", placement=Placement.local("cpu"))
    e2, a2, _ = kpca.eigenpairs(kc64, 8, "abs_desc", placement=BATCHED_CPU)
    torch.testing.assert_close(e2, e1, rtol=1e-10, atol=0)
    torch.testing.assert_close((a1 * a2).sum(-2).abs(), torch.ones(6, 8, dtype=torch.float64), rtol=0, atol=1e-8)


@pytest.mark.parametrize("variant", ["paper", "corrected"])
def test_gpu_code_path_on_the_cpu(variant):
    """What runs on CUDA (one batched eigh call, tensors moved with .to(device)) gives the
    CPU path's numbers: CKA and flags always, and with fixed signs (corrected) every column."""
    k, v, base = _heads(n_heads=6, n=45, d=8)
    kw = {"baseline": base} if variant == "corrected" else {}
    ref = kpca.head_metrics(k, v, variant, **kw)
    batched = kpca.head_metrics(k, v, variant, placement=dataclasses.replace(BATCHED_CPU, per_head_products=variant == "paper"), **kw)
    for name in ("finite", "dropped", "allclose", "exp_overflow", "outer_overflow"):
        if name in ref:
            np.testing.assert_array_equal(batched[name], ref[name], err_msg=name)
    names = [n for n in ref if ref[n].dtype != bool] if variant == "corrected" else ["linear_cka", "rbf_cka"]
    # the first four heads have a well-separated spectrum (the last ones' large keys make
    # eigenvalues nearly degenerate, where any rotation of the eigenvectors is a valid answer)
    for name in names:
        np.testing.assert_allclose(batched[name][:4], ref[name][:4], rtol=0, atol=1e-5 if variant == "paper" else 1e-9, err_msg=name)


def _symmetric_distances(n_mats=6, n=15, seed=0, ties=False):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n_mats, n, 3, generator=gen)
    if ties:  # integer points: many equal distances; duplicated tokens: zero off-diagonal entries
        x = torch.round(x * 2)
        x[:, 1] = x[:, 0]
        x[:, 5] = x[:, 2]
    g = x @ x.transpose(-1, -2)
    dist = torch.diagonal(g, dim1=-2, dim2=-1)[..., None, :] - g
    return dist + dist.transpose(-1, -2)


@pytest.mark.parametrize("which", ["lower", "mean"])
@pytest.mark.parametrize("ties", [False, True])
@pytest.mark.parametrize("n", [2, 3, 15, 16])
def test_median_from_the_upper_triangle_equals_the_full_search(which, ties, n):
    d = _symmetric_distances(n=n, ties=ties and n > 5)
    assert torch.equal(d, d.transpose(-1, -2)) and (torch.diagonal(d, dim1=-2, dim2=-1) == 0).all()
    full = numerics.median_nonzero(d, which)
    upper = numerics.median_nonzero(d, which, symmetric=True)
    assert torch.equal(full, upper)
    if which == "lower":  # and both are torch.median of the non-zero entries, as the reference takes it
        for i in range(d.shape[0]):
            assert upper[i] == torch.median(d[i][d[i] != 0])


def test_median_of_a_matrix_without_nonzero_distance_is_nan():
    d = torch.zeros(2, 4, 4)
    assert torch.isnan(numerics.median_nonzero(d, "lower", symmetric=True)).all()
    assert torch.isnan(numerics.median_nonzero(torch.zeros(1, 1, 1), "lower", symmetric=True)).all()


def test_ordered_map_keeps_order_bounds_pending_and_raises():
    started = []

    def items():
        for i in range(20):
            started.append(i)
            yield i

    out = []
    for r in ordered_map(lambda i: i * i, items(), workers=3, max_pending=4):
        out.append(r)
        assert len(started) <= len(out) + 4  # never more than max_pending items ahead
    assert out == [i * i for i in range(20)]

    def boom(i):
        if i == 5:
            raise ValueError("chunk 5")
        return i

    with pytest.raises(ValueError, match="chunk 5"):
        list(ordered_map(boom, range(10), workers=2))


@pytest.mark.parametrize("workers", [1, 2])
def test_worker_pool_start_leaves_the_caller_free_and_keeps_order(workers):
    """The KPCA job's pipeline: the caller solves the next batch while the workers analyse this one."""
    caller_ran = threading.Event()

    def item(i):
        if workers > 1:  # on the workers: the caller runs meanwhile (start did not wait for this)
            assert caller_ran.wait(timeout=30)
        if i == 7:
            raise ValueError("item 7")
        return i * i

    with WorkerPool(workers) as pool:
        results = pool.start(item, range(5))
        caller_ran.set()
        assert results() == [i * i for i in range(5)]
        failing = pool.start(item, range(9))
        with pytest.raises(ValueError, match="item 7"):
            failing()


def test_worker_pool_leaves_queued_items_unstarted_when_the_caller_stops():
    """An interrupt while batches are queued on the workers (the KPCA job queues two): the running
    items finish, the queued ones never start, and the pool closes without waiting for them."""
    started, release = [], threading.Event()

    def item(i):
        started.append(i)
        release.wait(timeout=30)
        return i

    with pytest.raises(KeyboardInterrupt):
        with WorkerPool(2) as pool:
            pool.start(item, range(10))
            threading.Timer(0.2, release.set).start()
            raise KeyboardInterrupt
    assert sorted(started) == [0, 1]  # the two running on the workers, none of the eight queued


def test_process_usage_counts_the_cpu_time_of_every_thread():
    """The job's own CPU line (kpca_repro.smk.process_usage): CPU time spent on other threads counts."""
    import re
    import time

    from kpca_repro.smk import process_usage

    def spin(seconds):
        end = time.thread_time() + seconds
        while time.thread_time() < end:
            pass

    before = float(re.search(r"([\d.]+) CPU-s", process_usage()).group(1))
    threads = [threading.Thread(target=spin, args=(0.5,)) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall, cpu, busy = map(float, re.fullmatch(r"job process: ([\d.]+) s wall, ([\d.]+) CPU-s \(([\d.]+) cores busy\)", process_usage()).groups())
    assert cpu - before >= 0.9  # both threads' 0.5 s, to the line's 0.1 s
    assert wall > 0 and busy == pytest.approx(cpu / wall, abs=0.1)  # each number rounded to its last digit


def _activation_file(path, n_images=5, n_heads=3, n_layers=2, n=21, d=8):
    gen = np.random.default_rng(0)
    layers = [{t: gen.standard_normal((n_images, n_heads, n, d)).astype(np.float32) * (1 + layer) for t in "qkvh"} for layer in range(n_layers)]
    write_activations(path, layers, model_id="toy", dataset_index=np.arange(n_images) * 7, attrs={"weights_sha256": "0" * 64}, check_invariant=False)
    return path


def test_streaming_reads_at_most_one_chunk_of_heads(tmp_path):
    path = _activation_file(tmp_path / "a.h5")
    with ActivationFile(path) as af:
        seen = []
        for layer, flat, t in layer_chunks(af, [0, 1], heads_per_chunk=4):
            assert t["k"].shape[0] == len(flat) <= 4
            seen.append((layer, flat))
        full = af.read(1, ("k",))["k"].reshape(-1, 21, 8)
        np.testing.assert_array_equal(t["k"].numpy(), full[flat])
    for layer in (0, 1):
        flats = np.concatenate([f for lay, f in seen if lay == layer])
        np.testing.assert_array_equal(flats, np.arange(15))  # every head once, in order


@pytest.mark.parametrize("eigh_threads", [None, 2])
@pytest.mark.parametrize("variant", ["paper", "corrected"])
def test_records_do_not_depend_on_chunks_or_workers(tmp_path, variant, eigh_threads, one_thread):
    """Also with the paper variant's eigh on 2 threads while the workers run on 1 (kpca.eigh_threads)."""
    path = _activation_file(tmp_path / "a.h5")
    cpu = torch.device("cpu")
    ref, _, _ = kpca_records(path, KpcaJob(variant, placement=plan(variant, device=cpu, eigh_threads=eigh_threads), heads_per_chunk=64))
    for chunk, workers in ((1, 1), (4, 2), (7, 3)):
        got, _, _ = kpca_records(path, KpcaJob(variant, placement=plan(variant, device=cpu, cores=workers, eigh_threads=eigh_threads), heads_per_chunk=chunk))
        pd.testing.assert_frame_equal(got, ref, check_exact=True)
    assert torch.get_num_threads() == 1  # the caller's threads are restored


@pytest.mark.integration
def test_sharded_and_unsharded_runs_give_identical_tables(tiny_resources, tmp_path, monkeypatch):
    """Byte-identical tables, also where float32 products round differently per batch size.

    MKL's AVX2 code path (forced here, so an AVX-512 machine checks it too) gives q, k, v
    that differ by ~6e-7 between a batch of 4 images and batches of 2; extraction therefore
    runs the whole sample's batches in every shard (``images.shard_batches``).
    """
    from test_workflow import _write_config

    monkeypatch.setenv("MKL_ENABLE_INSTRUCTIONS", "AVX2")
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")

    model = "vit_tiny_patch16_224"
    targets = ("results/table1.csv", "results/table1_corrected.csv", "results/table3.csv")
    tables = {}
    for shards, chunk, threads in ((1, 64, 1), (2, 5, 2)):
        work = tmp_path / f"shards{shards}"
        work.mkdir()
        cfg = _write_config(
            work / "c.yaml",
            resources_dir=str(tiny_resources),
            vision={"models": [model], "model_kwargs": {model: TINY_KWARGS[model]}, "shards": shards},
            kpca={"heads_per_chunk": chunk, "threads": threads},
        )
        run_snakemake(work, *targets, "--configfile", str(cfg))
        assert len(list((work / "results" / "activations").rglob("*.h5"))) == 2 * shards  # 4 and 3 images
        tables[shards] = {t: (work / t).read_bytes() for t in targets}
    for t in targets:
        assert tables[1][t] == tables[2][t], t


def test_one_forward_pass_per_image_batch_captures_every_layer(tiny_resources, photos_dir, tmp_path, monkeypatch):
    """The reference runs one full forward per layer; extraction runs one per image batch."""
    from kpca_repro.capture import extraction
    from kpca_repro.inputs import images

    model_id = "vit_tiny_patch16_224"
    weights = tiny_resources / "weights" / "timm" / f"{model_id}.safetensors"
    calls = []
    real_load = extraction.load_timm_model

    def counting_load(*args, **kwargs):
        model = real_load(*args, **kwargs)
        model.register_forward_pre_hook(lambda mod, inp: calls.append(inp[0].shape[0]))
        return model

    monkeypatch.setattr(extraction, "load_timm_model", counting_load)
    samples = images.sample_images(images.list_images(photos_dir, "flat"), 5, seed=0)
    extraction.extract_vision(model_id, weights, "x", samples, tmp_path / "a.h5", batch_size=2, device=torch.device("cpu"), model_kwargs=TINY_KWARGS[model_id], progress=False)
    assert calls == [2, 2, 1]  # ceil(5 / 2) forward passes, for the model's 2 layers together
    with ActivationFile(tmp_path / "a.h5") as af:
        assert af.n_layers == 2 and all(np.abs(af.read(layer, ("k",))["k"]).sum() > 0 for layer in range(2))
