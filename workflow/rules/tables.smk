# Stage 3: the paper's tables (CSV, its column metadata kpca_repro.analysis.columns, Markdown), one rule for all: {table} is a name of the table
# registry (kpca_repro.analysis.tables.TABLES), {suffix} a variant's output suffix
# (kpca_repro.method.variant: "" paper, "_corrected" corrected). Tables 1 and 4 aggregate the
# per-head records, Tables 2 and 3 the eigenvalue records (spectra.smk); only a variant with
# sign draws (paper) reads them and gets the solver intervals (docs/uncertainty.md). Rule all
# builds every table whose models are configured (kpca_repro.workflow.paths.all_targets).
#
# The report: `snakemake --report report.html <targets>` holds the report()-flagged outputs of the
# jobs that make <targets>, so each table or figure is flagged in the rule that writes it, beside
# its CSV (here the HTML page of the table, which the report shows inline; a CSV is only a download there):
#     report(<path>, caption=<its .rst file in workflow/report>, category=<"Tables", "Figures" or "Summary">, labels=report_labels(...))
# with a caption file per rule (Jinja over snakemake.wildcards and snakemake.config, no params: the
# report prints every param under "JOB PARAMETERS") and the labels of helpers.smk, which the
# landing page (workflow/report/workflow.rst) lists as what the run built.


rule table:
    input:
        unpack(table_files),
        models=table_needs_models,
    output:
        csv="results/{table}{suffix}.csv",
        md="results/{table}{suffix}.md",
        meta="results/{table}{suffix}.csv-metadata.json",
        html=report(
            "results/html/{table}{suffix}.html",
            caption="../report/tables.rst",
            category="Tables",
            labels=table_labels,
        ),
    log:
        "logs/table/{table}{suffix}.log",
    benchmark:
        "benchmarks/table/{table}{suffix}.tsv"
    wildcard_constraints:
        table="|".join(TABLES),
        suffix=SUFFIXES,
    localrule: True
    conda:
        ENV
    params:
        code=code_of("table.py"),
        variant=variant_of,
        uncertainty={"seed": config["seed"], **config["uncertainty"]},
        # labelled rows: random weights of the exact architecture (docs/hub_fixture.md), a user's activations (docs/activations.md)
        stand_ins=config["comparison"]["stand_in_models"],
        user_models=list(USER),
    script:
        "../scripts/table.py"
