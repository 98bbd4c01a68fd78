"""Rule extract_vision: one model, one image shard -> HDF5 of per-head q, k, v, h."""

from pathlib import Path

import pandas as pd
import torch

from kpca_repro.capture.extraction import extract_vision, forward_batch_size
from kpca_repro.capture.vision import check_vision_model
from kpca_repro.inputs.resources import check_checksum
from kpca_repro.resume import file_identity
from kpca_repro.smk import check_writable, fail_cleanly, setup_logging
from kpca_repro.threads import resolve_device, resolve_threads

smk = snakemake  # noqa: F821 (injected by Snakemake)
log = setup_logging(smk, "extract_vision")
# a model timm does not know, or whose attention the capture does not reproduce, ends the job in one line naming it
fail_cleanly(log, check_vision_model, smk.wildcards.model, dict(smk.params.model_kwargs))
torch.set_num_threads(resolve_threads(smk.params.intra_op_threads, "kpca.intra_op_threads"))
log.info("torch intra-op threads: %d", torch.get_num_threads())
sha = check_checksum(smk.input.weights, smk.params.checksum)
shard, n_shards = (int(x) for x in smk.wildcards.shard.split("of"))
samples = pd.read_csv(smk.input.samples, sep="\t")
device = resolve_device(smk.params.device)
batch_size = forward_batch_size(smk.params.batch_size, device, len(samples))
# finished forward batches kept beside the output until it is written (kpca_repro.resume); the extraction adds
# the weights' SHA-256 and the inputs to this key
parts = Path(smk.output[0]).with_suffix(".parts")
check_writable([parts / "key.json"])
key = {"samples": file_identity(smk.input.samples), "params": dict(smk.params.items()), "device": str(device), "batch_size": batch_size, "threads": torch.get_num_threads()}
log.info("%s: shard %d of %d of %d images on %s, weights sha256 %s", smk.wildcards.model, shard, n_shards, len(samples), device, sha)
extract_vision(
    smk.wildcards.model,
    smk.input.weights,
    sha,
    samples,
    smk.output[0],
    batch_size=batch_size,
    device=device,
    model_kwargs=dict(smk.params.model_kwargs),
    shard=(shard, n_shards),
    resume=(parts, key),
)
