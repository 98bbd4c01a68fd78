"""Rule extract_text: one language model, one shard of a text sample -> HDF5 of per-head q, k, v, h and the mask."""

from pathlib import Path

import torch

from kpca_repro.capture.extraction import extract_text, forward_batch_size
from kpca_repro.capture.hf_capture import check_text_model
from kpca_repro.inputs.text import read_samples
from kpca_repro.resume import file_identity
from kpca_repro.smk import check_writable, fail_cleanly, setup_logging
from kpca_repro.threads import resolve_device, resolve_threads

smk = snakemake  # noqa: F821 (injected by Snakemake)
log = setup_logging(smk, "extract_text")
# an attention the capture does not reproduce ends the job in one line naming the model (a hub model not yet
# downloaded is checked by the extraction after its download, before any forward pass)
fail_cleanly(log, check_text_model, smk.params.model_id, smk.params.source, decoder=smk.params.decoder, revision=smk.params.revision)
torch.set_num_threads(resolve_threads(smk.params.intra_op_threads, "kpca.intra_op_threads"))
log.info("torch intra-op threads: %d", torch.get_num_threads())
shard, n_shards = (int(x) for x in smk.wildcards.shard.split("of"))
samples = read_samples(smk.input.samples)
device = resolve_device(smk.params.device)
batch_size = forward_batch_size(smk.params.batch_size, device, len(samples))
# finished forward batches kept beside the output until it is written (kpca_repro.resume); the extraction adds
# the weights' SHA-256 and the inputs to this key
parts = Path(smk.output[0]).with_suffix(".parts")
check_writable([parts / "key.json"])
key = {"samples": file_identity(smk.input.samples), "params": dict(smk.params.items()), "device": str(device), "batch_size": batch_size, "threads": torch.get_num_threads()}
log.info("%s from %s: %d rows (shard %d of %d) on %s", smk.params.model_id, smk.params.source, len(samples), shard, n_shards, device)
extract_text(
    smk.params.model_id,
    smk.params.source,
    samples,
    smk.output[0],
    shard=(shard, n_shards),
    batch_size=batch_size,
    max_length=smk.params.max_length,
    device=device,
    offline=smk.params.offline,
    checksum=smk.params.checksum,
    revision=smk.params.revision,
    decoder=smk.params.decoder,
    resume=(parts, key),
)
