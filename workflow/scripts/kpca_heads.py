"""Rule kpca_heads: per-head KPCA records (paper or corrected variant) of one activation file (vision or text)."""

import json
import os

import numpy as np
import torch

from kpca_repro.check_cache import WORKFLOW_CACHE_DIR
from kpca_repro.h5io import atomic_output
from kpca_repro.method.records import kpca_records
from kpca_repro.method.uncertainty import MEAN_VECTOR, SIGN_DRAW_NAMES, write_sign_draws
from kpca_repro.method.variant import get as get_variant
from kpca_repro.smk import setup_logging
from kpca_repro.threads import resolve_device, resolve_eigh_threads

smk = snakemake  # noqa: F821 (injected by Snakemake)
log = setup_logging(smk, "kpca_heads")
# One intra-op thread and `threads` worker threads, each on its own chunk of heads: every
# head's numbers are then the same whatever threads, heads_per_chunk or shards say. The
# paper variant's eigh calls alone run with kpca.eigh_threads (the authors' thread count).
torch.set_num_threads(1)
eigh_threads = resolve_eigh_threads(smk.params.eigh_threads, WORKFLOW_CACHE_DIR) if get_variant(smk.wildcards.variant).authors_threads else None
device = resolve_device(smk.params.device)
records, meta = kpca_records(
    smk.input.activations,
    smk.wildcards.variant,
    device=device,
    heads_per_chunk=smk.params.heads_per_chunk,
    workers=smk.threads,
    seed=smk.params.seed,
    # on a GPU, eigh of 197 x 197 matrices is faster on the worker threads' CPU cores
    eigh_device="cpu" if device.type == "cuda" else None,
    eigh_threads=eigh_threads,
    sign_draws=tuple(smk.params.sign_draws) if any(smk.params.sign_draws) else None,
)
# per-head solver draws (signs and rotations), rows as the records CSV (the corrected variant's signs are fixed: none)
draws = meta.pop("sign_draws", None) or {name: np.empty((len(records), 0), np.float32) for name in (*SIGN_DRAW_NAMES, MEAN_VECTOR)}
log.info(
    "%d heads, %d dropped, on %s, eigh on %s threads, OpenMP spin count %s",
    len(records),
    int(records["dropped"].sum()),
    device,
    meta["eigh_threads"],
    os.environ.get("GOMP_SPINCOUNT", "libgomp's default"),
)
with atomic_output(smk.output.heads) as tmp:
    records.to_csv(tmp, index=False)
with atomic_output(smk.output.signs) as tmp:
    write_sign_draws(tmp, draws, {"seed": smk.params.seed, "n_heads": len(records), "variant": smk.wildcards.variant})
with atomic_output(smk.output.meta) as tmp:
    tmp.write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
