"""The decoders' prefix profile: seconds per 1,000 heads at each prefix length P, both variants.

Random causal heads (``--rows`` rows of ``--heads`` heads, head dimension ``--dim``, padded to
``--length`` tokens; a fifth of the rows 22 % shorter) are written as a format-2 activation file with
their causal ``h`` and analysed by :func:`kpca_repro.method.records.kpca_records` on one thread, as a
``kpca_prefix`` job analyses a decoder's file (docs/method.md 16-17); ``N`` is the full-prefix view.

    python perf/prefix_cost.py --prefixes 16 32 64 80 96 128
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from kpca_repro.activations import write_activations
from kpca_repro.method.records import KpcaJob, kpca_records


def causal_file(path: Path, rows: int, heads: int, length: int, dim: int, seed: int = 0) -> None:
    """A decoder's activation file of random q, k, v with their causal ``h`` (float64, then float32)."""
    rng = np.random.default_rng(seed)
    lengths = np.where(np.arange(rows) % 5 == 4, int(length * 0.78), length)
    mask = (np.arange(length)[None] < lengths[:, None]).astype(np.int64)
    q, k, v = (rng.standard_normal((rows, heads, length, dim)).astype(np.float32) for _ in range(3))
    allowed = np.tril(np.ones((length, length), bool))[None, None] & mask.astype(bool)[:, None, None, :]
    logits = np.where(allowed, q.astype(np.float64) @ k.transpose(0, 1, 3, 2) / np.sqrt(dim), -np.inf)
    w = np.exp(logits - logits.max(-1, keepdims=True))
    h = ((w / w.sum(-1, keepdims=True)) @ v).astype(np.float32) * mask[:, None, :, None]
    write_activations(path, [{"q": q, "k": k, "v": v, "h": h}], model_id="random-decoder", attention_mask=mask, causal=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prefixes", type=int, nargs="+", default=[80, 96, 128], help="prefix lengths P (N, the full prefix, is always added)")
    parser.add_argument("--rows", type=int, default=20)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--length", type=int, default=128)
    parser.add_argument("--dim", type=int, default=64)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "decoder.h5"
        causal_file(path, args.rows, args.heads, args.length, args.dim)
        print("| variant | P | heads | seconds | seconds per 1,000 heads |\n|---|---|---|---|---|")
        for variant in ("paper", "corrected"):
            for p in [*args.prefixes, None]:
                start = time.perf_counter()
                records, _, _ = kpca_records(path, KpcaJob(variant, prefix=p))
                seconds = time.perf_counter() - start
                per = f"{1000 * seconds / len(records):.2f}" if len(records) else "–"
                print(f"| {variant} | {p or 'N'} | {len(records)} | {seconds:.2f} | {per} |", flush=True)


if __name__ == "__main__":
    main()
