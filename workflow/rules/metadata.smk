# The column metadata of the method's records (kpca_repro.analysis.columns): the per-head records
# (rules kpca_heads, kpca_prefix), the eigenvalue records (eigenvalues_vision, eigenvalues_user) and
# the gamma records (gamma_vision) get `<name>.csv-metadata.json` beside them from this local rule,
# not from the jobs that write them: those import nothing of kpca_repro.analysis, so that editing a
# column's description reruns this rule and never hours of KPCA work (tests/test_code_deps.py).
# The rules that read the records (table: kpca_repro.workflow.paths.table_inputs; decoders_prefix;
# figure3) take the metadata as inputs too, so that building a table or figure builds it.

#: The schema (kpca_repro.analysis.columns.SCHEMAS) of the records under each folder of results/.
RECORDS_SCHEMAS = {"heads": "heads", "spectra": "spectra", "figure3": "gamma"}


rule records_metadata:
    input:
        "results/{records}.csv",
    output:
        "results/{records}.csv-metadata.json",
    log:
        "logs/records_metadata/{records}.log",
    benchmark:
        "benchmarks/records_metadata/{records}.tsv"
    wildcard_constraints:
        records=r"(heads|spectra)/[^/]+/[^/]+/[^/]+|figure3/gamma_[^/]+",
    localrule: True
    conda:
        ENV
    params:
        code=code_of("records_metadata.py"),
        schema=lambda wc: RECORDS_SCHEMAS[wc.records.split("/")[0]],
    script:
        "../scripts/records_metadata.py"
