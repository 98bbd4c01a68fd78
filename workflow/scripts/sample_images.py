"""Rule sample_images: the paper's seeded draw of n images (docs/method.md Section 1)."""

from kpca_repro.h5io import atomic_output
from kpca_repro.inputs import images
from kpca_repro.smk import setup_logging

smk = snakemake  # noqa: F821 (injected by Snakemake)
log = setup_logging(smk, "sample_images")
records = images.list_images(smk.input.images, smk.params.layout)
table = images.sample_images(records, int(smk.wildcards.n), smk.params.seed)
images.check_images(table["path"])  # an unreadable image stops here, naming its path
log.info("sampled %d of %d images from %s (seed %d)", len(table), len(records), smk.input.images, smk.params.seed)
with atomic_output(smk.output[0]) as tmp:
    table.to_csv(tmp, sep="\t", index=False)
