"""Images per second of ``extract_vision`` on the real DeiT-Tiny weights, this tree and optionally another one.

    python perf/bench_extract.py [--tree OTHER_CHECKOUT] [--repeats 2] [--images 100] [--batch-size 25] [--threads 2]
                                 [--model deit_tiny_patch16_224] [--weights W.safetensors] [--image-dir DIR] [--tmpdir DIR] [--out extract.json]

Each repeat runs ``extract_vision`` once per tree (this checkout's ``src/``, then ``--tree``'s),
alternating, each in its own process on the first ``--images`` JPEGs of ``--image-dir``, with
``--threads`` torch threads; the imports are not timed. Reports seconds, CPU seconds, images/s
and peak RSS. Writes ``{"command": "extract", "rows": [...]}`` (perf/_bench.py: the result file).
"""

from __future__ import annotations

import json
import resource
import tempfile
import time
from pathlib import Path

import _bench


def _extract_timed(spec: dict) -> dict:
    """Images per second of ``extract_vision`` alone (imports and timm's own import not timed)."""
    import timm  # noqa: F401  (imported by the model loader; its ~2 s are start-up, not extraction)
    import torch

    from kpca_repro.capture.extraction import extract_vision

    torch.set_num_threads(spec["threads"])
    samples = _bench.first_images(spec["image_dir"], spec["images"])
    t0, c0 = time.perf_counter(), time.process_time()
    extract_vision(spec["model"], spec["weights"], "0" * 64, samples, spec["out"], batch_size=spec["batch_size"], device=torch.device("cpu"), progress=False)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    return {"images": len(samples), "seconds": wall, "cpu_seconds": cpu, "images_per_second": len(samples) / wall, "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def measure(args) -> dict:
    rows = []
    trees = [("this", _bench.REPO)] + ([("other", Path(args.tree).resolve())] if args.tree else [])
    with tempfile.TemporaryDirectory(dir=args.tmpdir) as tmp:
        for rep in range(args.repeats):
            for name, tree in trees:
                spec = {"model": args.model, "weights": args.weights, "image_dir": args.image_dir, "images": args.images, "batch_size": args.batch_size}
                spec.update(threads=args.threads, out=str(Path(tmp) / f"{name}.h5"))
                row = {"tree": str(tree), "repeat": rep, **_bench.run_child(__file__, "_extract_timed", spec, env=_bench.child_env(tree))}
                print(json.dumps(row), flush=True)
                rows.append(row)
    return {"command": "extract", "rows": rows}


def main(argv=None) -> dict:
    p = _bench.parser(__doc__)
    _bench.input_arguments(p)
    p.add_argument("--batch-size", type=int, default=25)
    p.add_argument("--threads", type=int, default=2, help="torch intra-op threads of the forward pass")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--tree", default=None, help="another checkout to compare with (its src/)")
    p.add_argument("--tmpdir", default=None)
    return _bench.main(p, measure, argv)


if __name__ == "__main__":
    if not _bench.serve_child({"_extract_timed": _extract_timed}):
        main()
