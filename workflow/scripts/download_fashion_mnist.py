"""Rule download_fashion_mnist: fetch the four IDX .gz files with torchvision's mirrors."""

from kpca_repro.smk import fail_cleanly, setup_logging
from kpca_repro.training import FashionMNISTGz

smk = snakemake  # noqa: F821 (injected by Snakemake)
log = setup_logging(smk, "download_fashion_mnist")
fail_cleanly(log, FashionMNISTGz, smk.params.root, train=True, download=True)
log.info("Fashion-MNIST in %s", smk.params.root)
