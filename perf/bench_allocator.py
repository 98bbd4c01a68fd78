"""Peak RSS and time of the KPCA stage (paper variant) over more and more layers, per glibc allocator setting.

    python perf/bench_allocator.py ACTIVATIONS.h5 [--layers 1 12] [--threads 2] [--chunk 64] [--out allocator.json]

For each setting of :data:`ALLOCATOR_MODES` and each ``--layers`` count n, one process runs the
KPCA stage (``kpca_records``, paper variant, ``--threads`` workers) on the file's first n layers
and reports its seconds, heads and peak RSS. Tells whether the RSS growth with depth is memory
the stage holds or freed heap memory that glibc keeps (``malloc_trim`` hands it back; a fixed
mmap threshold never keeps it). Writes ``{"command": "allocator", "activations", "threads",
"chunk", "rows": [...]}`` (perf/_bench.py: the result file).
"""

from __future__ import annotations

import json
from pathlib import Path

import _bench
import _methods

#: glibc settings compared: name -> (extra environment, malloc_trim after each chunk)
ALLOCATOR_MODES = {
    "default": ({}, False),
    "malloc_trim after each chunk": ({}, True),
    "MALLOC_MMAP_THRESHOLD_=131072": ({"MALLOC_MMAP_THRESHOLD_": "131072"}, False),
}


def measure(args) -> dict:
    rows = []
    env0 = _bench.child_env()
    for mode, (extra, trim) in ALLOCATOR_MODES.items():
        for n_layers in args.layers:
            spec = {"activations": str(args.activations), "layers": list(range(n_layers)), "chunk": args.chunk, "workers": args.threads, "trim": trim}
            row = {"mode": mode, "layers": n_layers, **_methods.records_child(spec, env={**env0, **extra})}
            print(json.dumps(row), flush=True)
            rows.append(row)
    return {"command": "allocator", "activations": str(args.activations), "threads": args.threads, "chunk": args.chunk, "rows": rows}


def main(argv=None) -> dict:
    p = _bench.parser(__doc__)
    p.add_argument("activations", type=Path)
    p.add_argument("--layers", type=int, nargs="+", default=[1, 12], help="first n layers the KPCA run covers")
    p.add_argument("--chunk", type=int, default=64, help="heads per chunk (the rule's default kpca.heads_per_chunk)")
    p.add_argument("--threads", type=int, default=2)
    return _bench.main(p, measure, argv)


if __name__ == "__main__":
    main()
