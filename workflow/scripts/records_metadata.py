"""Rule records_metadata: the CSVW column metadata of one of the method's records CSVs (per-head,
eigenvalue or gamma records), from the CSV as written; the CSV itself is left as it is."""

import os

import pandas as pd

from kpca_repro.analysis.columns import SCHEMAS, metadata_json
from kpca_repro.h5io import atomic_output
from kpca_repro.smk import setup_logging

smk = snakemake  # noqa: F821 (injected by Snakemake)
log = setup_logging(smk, "records_metadata")
# the dtypes a reader of the CSV gets (a boolean column read back as bool: the format True|False)
records = pd.read_csv(smk.input[0])
title = f"{SCHEMAS[smk.params.schema].title}: results/{smk.wildcards.records}.csv"
columns = metadata_json(records, smk.params.schema, os.path.basename(smk.input[0]), title)  # every column described, or the job stops here
with atomic_output(smk.output[0]) as tmp:
    tmp.write_text(columns)
log.info("wrote %s (%d columns, %d rows)", smk.output[0], len(records.columns), len(records))
