"""Wall and CPU time of the authors' ``value_vectors.py`` structure for one model, as one whole process (the chain's baseline).

    python perf/bench_authors.py [--model deit_tiny_patch16_224] [--weights W.safetensors] [--image-dir DIR]
                                 [--images 100] [--seed 0] [--out authors.json]

Runs :func:`_authors` in a child process and times it from outside: wall seconds (the imports
included, as the chain's include Snakemake's), and inside: CPU seconds, heads, torch's thread
count and the Table 1 row (MDC, MOC, LCKA, KCKA) it gives, which equals the pipeline's for the
same images (tests/test_benchmarks.py). Writes ``{"command": "authors", "spec", "wall_seconds",
"seconds_in_process", "cpu_seconds", "heads", "torch_threads", "table1"}`` (perf/_bench.py: the result file).
"""

from __future__ import annotations

import json
import resource
import time

import _bench


def _authors_head(k, v) -> dict | None:
    """One head the way ``value_vectors.py`` treats it: one ``Vhat``, the oracle's Table 1
    metrics on it, plus the quantities that script also computes per head and never
    aggregates (Frobenius error, token-wise Euclidean, L1 and Pearson, Python lists of the
    per-token values and a Python loop counting negative cosines; docs/method.md 2). Their
    cost belongs to the baseline. None where the script drops the head."""
    import torch

    from kpca_tools.reference import metrics_reference, v_kpca_reference

    vhat = v_kpca_reference(k)
    try:
        out = metrics_reference(v, vhat)
    except ValueError:  # scipy on a NaN cost matrix: the script drops the head
        return None
    vn = v / (v.norm(2, dim=1, keepdim=True) + 1e-8)
    vhn = vhat / (vhat.norm(2, dim=1, keepdim=True) + 1e-8)
    direct = (vn * vhn).sum(dim=1).tolist()
    out["negative_count"] = sum(1 for c in direct if c < 0)
    out["frobenius"] = torch.norm(v - vhat, p="fro").item() / torch.norm(v, p="fro").item()
    out["euclidean"] = torch.norm(v - vhat, dim=1).tolist()
    out["l1"] = torch.sum(torch.abs(v - vhat), dim=1).tolist()
    vc, vhc = v - v.mean(dim=1, keepdim=True), vhat - vhat.mean(dim=1, keepdim=True)
    out["pearson"] = (vc / (vc.norm(dim=1, keepdim=True) + 1e-8) * (vhc / (vhc.norm(dim=1, keepdim=True) + 1e-8))).sum(dim=1).tolist()
    return out


def _authors(spec: dict) -> dict:
    """The structure of the authors' ``value_vectors.py`` for one model (docs/method.md 2 and 12),
    run in its own process: decode the images one by one, then for every layer a hook on
    ``blocks[l].attn.qkv`` and a full forward pass of all images, then a Python loop over
    images and heads. Same weights, images and preprocessing as the pipeline, torch's
    default thread count (the authors never set one)."""
    t0 = time.perf_counter()
    import numpy as np
    import pandas as pd
    import torch

    from kpca_repro.capture.vision import load_timm_model
    from kpca_repro.inputs import images as img

    model = load_timm_model(spec["model"], spec["weights"]).eval()
    records = img.list_images(spec["image_dir"], spec["layout"])
    paths = list(img.sample_images(records, spec["images"], spec["seed"])["path"])
    transform = img.paper_transform(224)
    x = torch.stack([transform(img.load_image(p)) for p in paths])
    rows = []
    for layer, block in enumerate(model.blocks):
        attn, captured = block.attn, {}
        handle = attn.qkv.register_forward_hook(lambda _m, _i, out: captured.__setitem__("qkv", out.detach().clone()))
        with torch.no_grad():
            model(x)
        handle.remove()
        qkv = captured["qkv"]
        b, n = qkv.shape[:2]
        _, k, v = qkv.reshape(b, n, 3, attn.num_heads, attn.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
        for i in range(b):
            for h in range(attn.num_heads):
                out = _authors_head(k[i, h], v[i, h])
                if out is not None:
                    rows.append({"layer": layer, "image": i, "head": h, **{c: out[c] for c in ("direct_cos_mean", "optimal_cos_mean", "linear_cka", "rbf_cka")}})
    df = pd.DataFrame(rows)
    table = {
        "MDC": float(df["direct_cos_mean"].max()),
        "MOC": float(df["optimal_cos_mean"].max()),
        "LCKA": float(np.mean(df["linear_cka"])),
        "KCKA": float(np.mean(df["rbf_cka"])),
    }
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return {"seconds_in_process": time.perf_counter() - t0, "cpu_seconds": usage.ru_utime + usage.ru_stime, "heads": len(df), "torch_threads": torch.get_num_threads(), "table1": table}


def measure(args) -> dict:
    spec = {"model": args.model, "weights": args.weights, "image_dir": args.image_dir, "layout": "flat", "images": args.images, "seed": args.seed}
    t0 = time.perf_counter()
    out = _bench.run_child(__file__, "_authors", spec)
    wall = time.perf_counter() - t0
    print(json.dumps({"wall_seconds": wall, **out["table1"]}), flush=True)
    return {"command": "authors", "spec": spec, "wall_seconds": wall, **out}


def main(argv=None) -> dict:
    p = _bench.parser(__doc__)
    _bench.input_arguments(p)
    p.add_argument("--seed", type=int, default=0, help="the configuration seed of the image draw")
    return _bench.main(p, measure, argv)


if __name__ == "__main__":
    if not _bench.serve_child({"_authors": _authors}):
        main()
