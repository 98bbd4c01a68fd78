"""Rule decoders_prefix: the decoders' prefix profile (docs/method.md 16), as CSV with its column metadata and as a figure."""

import os

import pandas as pd

from kpca_repro.analysis.columns import metadata_json
from kpca_repro.analysis.tables import decoders_prefix_table
from kpca_repro.figures.plots import plot_prefix_profile
from kpca_repro.h5io import atomic_output
from kpca_repro.smk import setup_logging

smk = snakemake  # noqa: F821 (injected by Snakemake)
log = setup_logging(smk, "decoders_prefix")
files, records = iter(smk.input.heads), {}
for model, prefix, n_files in smk.params.groups:  # the input's files, in groups of each (decoder, prefix)'s shards
    records[(model, prefix)] = pd.concat([pd.read_csv(next(files)) for _ in range(n_files)], ignore_index=True)
profile = decoders_prefix_table(records, smk.params.variant)
for row in profile[profile["cka_all_directions_kept"]].itertuples():
    log.info(
        "%s at P = %s: every head has P <= d + 1 tokens, so its kept eigenvectors span the whole centered space "
        "and LCKA/KCKA test only g (docs/method.md 17.1): marked, and left out of the figure's CKA lines",
        row.hf_id,
        row.prefix,
    )
meta = metadata_json(profile, "decoders_prefix", os.path.basename(smk.output.csv), smk.params.title)
with atomic_output(smk.output.pdf) as pdf, atomic_output(smk.output.png) as png:
    plot_prefix_profile(profile, pdf, png, smk.params.title)
with atomic_output(smk.output.csv) as tmp:
    profile.to_csv(tmp, index=False)
with atomic_output(smk.output.meta) as tmp:
    tmp.write_text(meta)
log.info("wrote %s (%d rows)", smk.output.csv, len(profile))
