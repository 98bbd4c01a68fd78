"""What every ``perf/bench_*.py`` benchmark shares: the machine, child processes, the JSON result.

Not a benchmark itself. Each benchmark script imports it as ``_bench`` (Python puts ``perf/``
first on the path when it runs a script there), which also puts ``tools/`` on the path for the
per-head baseline :mod:`kpca_tools.reference` (a test tool, never installed: tools/README.md).

A benchmark's result file (``--out``) is one JSON object: ``environment`` (:func:`environment`,
with ``loadavg_1min_at_end`` added when the measurement ends), ``argv`` (the benchmark's own
arguments) and what its measurement returns, starting with ``command`` (the benchmark's name,
which ``perf/report.py`` dispatches on).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# the per-head baseline (kpca_tools.reference) is a test tool, never installed (tools/README.md)
sys.path.insert(0, str(REPO / "tools"))
#: The offline inputs beside the checkout (README.md: ``../shared/assets``).
ASSETS = REPO / ".." / "shared" / "assets"
#: The real DeiT-Tiny weights and the 1000-image sample, the defaults of the benchmarks that read them.
DEIT_TINY_WEIGHTS = ASSETS / "weights" / "timm" / "deit_tiny_patch16_224.safetensors"
IMAGE_DIR = ASSETS / "images" / "imagenet-sample"


def timed(fn: Callable, record: Callable[[float], None]) -> Callable:
    """``fn`` wrapped so that the wall seconds of every call go to ``record`` (also when it raises).

    The breakdowns of ``perf/`` (``_methods``, ``bench_ab``, ``kpca_stage``) wrap the engine's
    functions with it; ``record`` decides where the seconds go (a lock for worker threads, a tree).
    """

    def wrapper(*a, **kw):
        t0 = time.perf_counter()
        try:
            return fn(*a, **kw)
        finally:
            record(time.perf_counter() - t0)

    return wrapper


def environment() -> dict:
    """The machine a measurement ran on: Python and torch versions, CPUs, 1-minute load average, GPU name."""
    import torch

    out = {"python": platform.python_version(), "torch": torch.__version__, "cpus": os.cpu_count(), "loadavg_1min_at_start": os.getloadavg()[0]}
    if torch.cuda.is_available():
        out["gpu"] = torch.cuda.get_device_name()
    return out


def child_env(tree: Path = REPO, base: dict | None = None) -> dict:
    """``base`` (default: this process's environment) with ``tree``'s ``src/`` first on ``PYTHONPATH``."""
    return dict(os.environ if base is None else base, PYTHONPATH=f"{tree / 'src'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")


def last_json(stdout: str) -> dict:
    """The last line a child printed, parsed as JSON (a child's result; its progress lines come before)."""
    return json.loads(stdout.strip().splitlines()[-1])


def run_child(script: Path | str, helper: str, spec: dict, env: dict | None = None) -> dict:
    """Run ``python SCRIPT HELPER JSON(spec)`` (:func:`serve_child` on the other side) and return its result.

    Each measurement runs in its own interpreter, so its peak RSS and its imports are its own.
    Raises ``RuntimeError`` with the end of the child's stderr if the child fails.
    """
    proc = subprocess.run([sys.executable, str(script), helper, json.dumps(spec)], capture_output=True, text=True, env=child_env() if env is None else env)
    if proc.returncode != 0:
        raise RuntimeError(f"{Path(script).name} {helper} {spec} failed:\n{proc.stderr[-3000:]}")
    return last_json(proc.stdout)


def serve_child(helpers: dict[str, Callable[[dict], dict]]) -> bool:
    """If this process was started as ``SCRIPT HELPER JSON`` (:func:`run_child`) with ``HELPER`` in
    ``helpers``: run it on the decoded spec, print its result as one JSON line and return True."""
    if len(sys.argv) > 2 and sys.argv[1] in helpers:
        print(json.dumps(helpers[sys.argv[1]](json.loads(sys.argv[2]))))
        return True
    return False


def first_images(image_dir: str, n: int):
    """The sample table of the first ``n`` JPEGs of a flat folder, in name order."""
    import pandas as pd

    files = sorted(Path(image_dir).glob("*.JPEG"))[:n]
    return pd.DataFrame({"sample_rank": range(len(files)), "dataset_index": range(len(files)), "path": [str(f) for f in files]})


def parser(doc: str) -> argparse.ArgumentParser:
    """An argument parser with the benchmark's module docstring as its help."""
    return argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)


def input_arguments(p: argparse.ArgumentParser, images: int = 100) -> None:
    """The options of the benchmarks that read real inputs: ``--model``, ``--weights``,
    ``--image-dir`` (defaults: the offline DeiT-Tiny and ImageNet sample) and ``--images``."""
    p.add_argument("--model", default="deit_tiny_patch16_224")
    p.add_argument("--weights", default=str(DEIT_TINY_WEIGHTS))
    p.add_argument("--image-dir", default=str(IMAGE_DIR))
    p.add_argument("--images", type=int, default=images)


def main(p: argparse.ArgumentParser, measure: Callable[[argparse.Namespace], dict], argv: list[str] | None = None) -> dict:
    """Parse ``argv`` (with ``--out``), run ``measure(args)`` and write the result file (module docstring)."""
    p.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    args = p.parse_args(argv)
    result = {"environment": environment(), "argv": sys.argv[1:] if argv is None else list(argv), **measure(args)}
    result["environment"]["loadavg_1min_at_end"] = os.getloadavg()[0]
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return result
