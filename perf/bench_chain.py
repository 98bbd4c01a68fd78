"""Wall time of the Table 1 chain, ``snakemake results/table1.csv``, from scratch in a fresh directory, and per job.

    python perf/bench_chain.py [--configfile config/offline_deit_tiny.yaml] [--cores 2] [--targets results/table1.csv ...]
                               [--tree OTHER_CHECKOUT] [--tmpdir DIR] [--out chain.json]

Runs ``snakemake --cores N TARGETS`` of this checkout's (or ``--tree``'s) Snakefile and ``src/``
in an empty temporary directory, with the configuration file's ``../shared`` pointed at this
checkout's. Reports the wall time (Snakemake's start-up included), each job's seconds and peak
RSS from Snakemake's benchmark files, and the CSV targets' text. Writes
``{"command": "chain", "tree", "targets", "cores", "wall_seconds", "rules", "tables"}``
(perf/_bench.py: the result file).
"""

from __future__ import annotations

import csv
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import _bench


def _jobs(benchmarks: Path) -> dict:
    """Each job's ``seconds`` and ``max_rss_mb`` from Snakemake's benchmark TSVs, by path under ``benchmarks``."""
    jobs = {}
    for tsv in sorted(benchmarks.rglob("*.tsv")):
        with open(tsv) as fh:
            rec = next(csv.DictReader(fh, delimiter="\t"))
        jobs[str(tsv.relative_to(benchmarks))] = {"seconds": float(rec["s"]), "max_rss_mb": float(rec["max_rss"])}
    return jobs


def measure(args) -> dict:
    with tempfile.TemporaryDirectory(dir=args.tmpdir) as tmp:
        cfg = Path(args.configfile).resolve()
        text = cfg.read_text().replace("../shared", str((_bench.REPO / ".." / "shared").resolve()))
        (Path(tmp) / "bench.yaml").write_text(text)
        tree = Path(args.tree).resolve() if args.tree else _bench.REPO  # another checkout: compare versions
        cmd = [sys.executable, "-m", "snakemake", "-s", str(tree / "Snakefile"), "-d", tmp, "--cores", str(args.cores), *args.targets, "--configfile", str(Path(tmp) / "bench.yaml")]
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True, env=_bench.child_env(tree), cwd=tmp)
        wall = time.perf_counter() - t0
        if proc.returncode != 0:
            raise RuntimeError(proc.stderr[-4000:])
        rules = _jobs(Path(tmp, "benchmarks"))
        tables = {t: Path(tmp, t).read_text() for t in args.targets if t.endswith(".csv")}
    out = {"command": "chain", "tree": str(args.tree or _bench.REPO), "targets": args.targets, "cores": args.cores, "wall_seconds": wall, "rules": rules, "tables": tables}
    print(json.dumps({"wall_seconds": wall}), flush=True)
    return out


def main(argv=None) -> dict:
    p = _bench.parser(__doc__)
    p.add_argument("--configfile", default=str(_bench.REPO / "config" / "offline_deit_tiny.yaml"))
    p.add_argument("--cores", type=int, default=2)
    p.add_argument("--targets", nargs="+", default=["results/table1.csv"])
    p.add_argument("--tree", default=None, help="run another checkout's Snakefile and src/ (default: this one)")
    p.add_argument("--tmpdir", default=None)
    return _bench.main(p, measure, argv)


if __name__ == "__main__":
    main()
