"""Rule download_fashion_mnist: the four IDX .gz files from downloads.fashion_mnist_url, checked."""

from kpca_repro.inputs.resources import DownloadPolicy, download_fashion_mnist
from kpca_repro.smk import fail_cleanly, setup_logging
from kpca_repro.training.data import FASHION_MNIST_FILES

smk = snakemake  # noqa: F821 (injected by Snakemake)
log = setup_logging(smk, "download_fashion_mnist")
dl = smk.params.downloads
log.info("downloading %s -> %s", dl["fashion_mnist_url"], smk.params.root)
fail_cleanly(log, download_fashion_mnist, dl["fashion_mnist_url"], smk.params.root, FASHION_MNIST_FILES, dl["fashion_mnist_hashes"], policy=DownloadPolicy.from_config(dl), log=log)
log.info("Fashion-MNIST in %s", smk.params.root)
