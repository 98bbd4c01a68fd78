"""Throughput and agreement of the eigensolvers the KPCA engine can use, on centered Gram matrices of Table 1's shape.

For ``--heads`` matrices ``N x N`` (``--tokens``, default 197; keys ``N(0, 0.5^2)`` of head
dimension 64, centered as the paper variant centers them, float32; or the real keys of an
activation file with ``--activations``), times every solver that runs here:

* ``torch-cpu-per-matrix``: LAPACK one matrix per call (the CPU path), ``--cpu-threads`` threads;
* ``torch-cuda-per-matrix``: ``torch.linalg.eigh`` on one CUDA matrix per call (the authors'
  call); ``torch-cuda-batched``: one call for the block (the paper variant's GPU path);
* ``jax-batched`` (JAX's device: the GPU where there is one), ``cupy-batched``;

and reports heads/s, the largest eigenvalue error against float64 (relative to ``||K||``),
whether each solver's eigenvectors are bit-identical to the per-matrix CUDA call (for
``torch-cuda-batched``: the claim that batching keeps the authors' numbers), and the share of
top-64 eigenvector columns with the per-matrix CUDA call's sign. A solver that cannot run
here is listed with its error. Writes JSON (``--out``) and prints a table.

    python perf/eigensolvers.py --heads 1024 --out eigensolvers.json
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch

from kpca_repro.method import equations as method


def gram_matrices(heads: int, tokens: int, seed: int, activations: str | None) -> torch.Tensor:
    """``(heads, N, N)`` float32 centered Gram matrices (paper variant)."""
    if activations:
        from kpca_repro.activations import ActivationFile

        with ActivationFile(activations) as af:
            ks = []
            for layer in range(af.n_layers):
                k = af.read(layer, ("k",))["k"]
                ks.append(torch.from_numpy(k.reshape(-1, *k.shape[2:])))
                if sum(len(x) for x in ks) >= heads:
                    break
        k = torch.cat(ks)[:heads]
    else:
        k = torch.randn(heads, tokens, 64, generator=torch.Generator().manual_seed(seed)) * 0.5
    return method.center_dense(method.gram_paper(k)[0])


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _time(fn, repeats: int = 1) -> tuple[float, object]:
    out = fn()  # warm-up (and the result)
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - t0) / repeats, out


def solvers(kc: torch.Tensor, cpu_threads: int) -> dict:
    """name -> callable returning ``(eigenvalues, eigenvectors)`` as float64 CPU tensors."""
    out = {}

    def torch_cpu():
        before = torch.get_num_threads()
        torch.set_num_threads(cpu_threads)
        try:
            pairs = [torch.linalg.eigh(kc[i]) for i in range(kc.shape[0])]
        finally:
            torch.set_num_threads(before)
        return torch.stack([p[0] for p in pairs]), torch.stack([p[1] for p in pairs])

    out["torch-cpu-per-matrix"] = (torch_cpu, "cpu")
    if torch.cuda.is_available():
        g = kc.cuda()

        def per_matrix():
            pairs = [torch.linalg.eigh(g[i]) for i in range(g.shape[0])]
            torch.cuda.synchronize()
            return torch.stack([p[0] for p in pairs]).cpu(), torch.stack([p[1] for p in pairs]).cpu()

        def batched():
            w, v = torch.linalg.eigh(g)
            torch.cuda.synchronize()
            return w.cpu(), v.cpu()

        out["torch-cuda-per-matrix"] = (per_matrix, "cuda")
        out["torch-cuda-batched"] = (batched, "cuda")
    try:
        import jax
        import jax.numpy as jnp

        x = jax.device_put(np.asarray(kc.numpy()))

        def jax_batched():
            w, v = jnp.linalg.eigh(x)
            w.block_until_ready()
            return torch.from_numpy(np.asarray(w)), torch.from_numpy(np.asarray(v))

        out[f"jax-batched ({jax.devices()[0].platform})"] = (jax_batched, "jax")
    except Exception as exc:  # noqa: BLE001 - any import or device error: reported, not fatal
        out["jax-batched"] = (exc, None)
    try:
        import cupy

        c = cupy.asarray(kc.numpy())

        def cupy_batched():
            w, v = cupy.linalg.eigh(c)
            cupy.cuda.Device().synchronize()
            return torch.from_numpy(cupy.asnumpy(w)), torch.from_numpy(cupy.asnumpy(v))

        out["cupy-batched"] = (cupy_batched, "cupy")
    except Exception as exc:  # noqa: BLE001
        out["cupy-batched"] = (exc, None)
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--heads", type=int, default=1024)
    ap.add_argument("--tokens", type=int, default=197)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--activations", help="take the keys of this activation file instead of random ones")
    ap.add_argument("--cpu-threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    kc = gram_matrices(args.heads, args.tokens, args.seed, args.activations)
    exact = torch.linalg.eigvalsh(kc.double())
    scale = exact.abs().amax(-1, keepdim=True)
    reference = None
    rows = []
    for name, (fn, kind) in solvers(kc, args.cpu_threads).items():
        if kind is None:
            rows.append({"solver": name, "error": f"{type(fn).__name__}: {fn}"[:200]})
            continue
        try:
            seconds, (w, v) = _time(fn, args.repeats)
        except Exception as exc:  # noqa: BLE001
            rows.append({"solver": name, "error": f"{type(exc).__name__}: {exc}"[:200]})
            continue
        w, v = w.double(), v.double()
        row = {"solver": name, "heads": kc.shape[0], "seconds": seconds, "heads_per_s": kc.shape[0] / seconds, "eigenvalue_error": float(((w - exact) / scale).abs().max())}
        if name == "torch-cuda-per-matrix":
            reference = v
        rows.append((row, v))
    out_rows = []
    for item in rows:
        if isinstance(item, dict):
            out_rows.append(item)
            continue
        row, v = item
        if reference is not None:
            top_ref, top = reference[..., -64:], v[..., -64:]
            row["bit_identical_to_cuda_per_matrix"] = bool(torch.equal(top, top_ref))
            row["same_sign_share"] = float(((top * top_ref).sum(-2) > 0).double().mean())
        out_rows.append(row)
    info = {"torch": torch.__version__, "cuda": torch.version.cuda, "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None, "tokens": args.tokens, "rows": out_rows}
    print(f"{'solver':32s} {'heads/s':>10s} {'eig. error':>10s} {'bitwise':>8s} {'same sign':>9s}")
    for r in out_rows:
        if "error" in r:
            print(f"{r['solver']:32s} not run: {r['error']}")
            continue
        print(f"{r['solver']:32s} {r['heads_per_s']:10.0f} {r['eigenvalue_error']:10.1e} {str(r.get('bit_identical_to_cuda_per_matrix', '-')):>8s} {r.get('same_sign_share', float('nan')):9.2f}")
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(info, fh, indent=1)


if __name__ == "__main__":
    main()
