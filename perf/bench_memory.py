"""Peak host memory of extraction and KPCA for one model (random weights) and growing numbers of images.

    python perf/bench_memory.py [--model vit_large_patch16_224] [--images 4 16 100] [--kpca-layers 0 1 2 3]
                                [--image-dir DIR] [--batch-size 25] [--chunk 16] [--threads 2] [--tmpdir DIR] [--out memory.json]

For each ``--images`` count, in their own processes: ``extract_vision`` of the first images of
``--image-dir`` (a flat folder of JPEGs) with the model's random weights, on all CPU cores, then
the paper variant's KPCA stage (``kpca_records``) over ``--kpca-layers`` (default: all) of the
file it wrote: seconds and peak RSS of each, and the file's size. Writes
``{"command": "memory", "rows": [...]}`` (perf/_bench.py: the result file).
"""

from __future__ import annotations

import json
import os
import resource
import tempfile
import time
from pathlib import Path

import _bench
import _methods


def _make_weights(spec: dict) -> dict:
    """Random weights of ``spec['model']`` (seed 0) saved as safetensors at ``spec['path']``."""
    import timm
    import torch
    from safetensors.torch import save_file

    torch.manual_seed(0)
    m = timm.create_model(spec["model"], pretrained=False)
    save_file({k: v.contiguous() for k, v in m.state_dict().items()}, spec["path"])
    return {}


def _extract(spec: dict) -> dict:
    import torch

    from kpca_repro.capture.extraction import extract_vision

    torch.set_num_threads(os.cpu_count() or 1)
    samples = _bench.first_images(spec["image_dir"], spec["images"])
    extract_vision(spec["model"], spec["weights"], "0" * 64, samples, spec["out"], batch_size=spec["batch_size"], device=torch.device("cpu"), progress=False)
    return {"peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def _timed(run, *a, **kw) -> tuple[float, float]:
    """(seconds, peak RSS in MB) of a child process."""
    t0 = time.perf_counter()
    res = run(*a, **kw)
    return time.perf_counter() - t0, res["peak_rss_mb"]


def measure(args) -> dict:
    rows = []
    with tempfile.TemporaryDirectory(dir=args.tmpdir) as tmp:
        weights = Path(tmp) / f"{args.model}.safetensors"
        _bench.run_child(__file__, "_weights", {"model": args.model, "path": str(weights)})
        for n_img in args.images:
            h5 = Path(tmp) / f"{args.model}_{n_img}.h5"
            spec = {"model": args.model, "weights": str(weights), "images": n_img, "image_dir": args.image_dir, "out": str(h5), "batch_size": args.batch_size}
            t_ext, rss_ext = _timed(_bench.run_child, __file__, "_extract", spec)
            kspec = {"activations": str(h5), "layers": args.kpca_layers, "chunk": args.chunk, "workers": args.threads}
            t_kpca, rss_kpca = _timed(_methods.records_child, kspec)
            row = {
                "model": args.model,
                "images": n_img,
                "extract_seconds": t_ext,
                "extract_peak_rss_mb": rss_ext,
                "kpca_layers": args.kpca_layers or "all",
                "kpca_seconds": t_kpca,
                "kpca_peak_rss_mb": rss_kpca,
                "h5_mb": h5.stat().st_size / 2**20,
            }
            print(json.dumps(row), flush=True)
            rows.append(row)
            h5.unlink()
    return {"command": "memory", "rows": rows}


def main(argv=None) -> dict:
    p = _bench.parser(__doc__)
    p.add_argument("--model", default="vit_large_patch16_224")
    p.add_argument("--images", type=int, nargs="+", default=[4, 16])
    p.add_argument("--image-dir", default=str(_bench.IMAGE_DIR))
    p.add_argument("--batch-size", type=int, default=25)
    p.add_argument("--kpca-layers", type=int, nargs="*", default=None, help="layers the KPCA run covers (default: all)")
    p.add_argument("--chunk", type=int, default=16)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--tmpdir", default=None)
    return _bench.main(p, measure, argv)


if __name__ == "__main__":
    if not _bench.serve_child({"_weights": _make_weights, "_extract": _extract}):
        main()
