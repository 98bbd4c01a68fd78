"""Several paper-variant KPCA processes at once on the same cores, with libgomp's default spin and with ``GOMP_SPINCOUNT`` values.

    python perf/bench_concurrent.py ACTIVATIONS.h5 [--layers 0 1] [--spincounts 3000 default] [--chunk 16] [--out concurrent.json]

For each ``--spincounts`` value (``default``: the variable unset, libgomp's own), starts one
process per ``--layers`` entry at once, each running the KPCA stage (``kpca_records``, paper
variant, one worker, the ``kpca_heads`` rule's ``eigh`` threads) on that layer of the file, and
reports the wall time until all are done and each process's seconds, heads and peak RSS.
Writes ``{"command": "concurrent", "activations": ..., "rows": [...]}`` (perf/_bench.py: the result file).
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import _bench
import _methods


def measure(args) -> dict:
    rows = []
    base_env = _bench.child_env(base={k: v for k, v in os.environ.items() if k != "GOMP_SPINCOUNT"})
    for spin in args.spincounts:
        env = dict(base_env) if spin == "default" else dict(base_env, GOMP_SPINCOUNT=spin)
        t0 = time.perf_counter()
        specs = [{"activations": str(args.activations), "layers": [layer], "chunk": args.chunk, "workers": 1, "eigh_threads": "auto"} for layer in args.layers]
        procs = [subprocess.Popen(_methods.records_command(spec), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env) for spec in specs]
        outs = []
        for proc in procs:
            out, err = proc.communicate()
            if proc.returncode != 0:
                raise RuntimeError(err[-3000:])
            outs.append(_bench.last_json(out))
        row = {"gomp_spincount": spin, "processes": len(procs), "wall_seconds": time.perf_counter() - t0, "per_process": outs}
        print(json.dumps(row), flush=True)
        rows.append(row)
    return {"command": "concurrent", "activations": str(args.activations), "rows": rows}


def main(argv=None) -> dict:
    p = _bench.parser(__doc__)
    p.add_argument("activations", type=Path)
    p.add_argument("--layers", type=int, nargs="+", default=[0, 1], help="one process per layer")
    p.add_argument("--chunk", type=int, default=16)
    p.add_argument("--spincounts", nargs="+", default=["3000", "default"], help="GOMP_SPINCOUNT values; 'default': libgomp's own")
    return _bench.main(p, measure, argv)


if __name__ == "__main__":
    main()
