# Stage 3: aggregate per-head records into the paper's tables (CSV + Markdown).
# One rule per table; {suffix} is a variant's output suffix (kpca_repro.method.variant: "" paper, "_corrected" corrected).
# Only the paper variant reads the sign draws and computes intervals (docs/uncertainty.md).


default_target("results/table1{suffix}.csv", "results/table1{suffix}.md", report=True, when=has_vision)


rule table1:
    input:
        unpack(table_inputs(lambda variant, ext: [f for m in VISION["models"] for f in heads_files(variant, m, ext)] + user_heads(variant, ext, "vision"))),
        models=needs_models("vision", "Table 1"),
        code=stage_code("method", "analysis"),
    output:
        csv="results/table1{suffix}.csv",
        md="results/table1{suffix}.md",
    log:
        "logs/table1/table1{suffix}.log",
    benchmark:
        "benchmarks/table1/table1{suffix}.tsv"
    wildcard_constraints:
        suffix=SUFFIXES,
    localrule: True
    conda:
        ENV
    params:
        variant=variant_of,
        uncertainty=paper_uncertainty,
        stand_ins=config["comparison"]["stand_in_models"],
        user_models=list(USER),
    script:
        "../scripts/table1.py"


# Table 4: language models (docs/method.md Section 3; corrected: Section 15).


default_target(
    "results/table4{suffix}.csv", "results/table4{suffix}.md", report=True, when=lambda config: bool(config["text"]["models"] or user_models(config, "text"))
)  # text.models: [] leaves Table 4 out


rule table4:
    input:
        unpack(table_inputs(lambda variant, ext: [f for m in TEXT["models"] for f in text_stage_files(m, ext, variant)] + user_heads(variant, ext, "text"))),
        models=needs_models("text", "Table 4"),
        code=stage_code("method", "analysis"),
    output:
        csv="results/table4{suffix}.csv",
        md="results/table4{suffix}.md",
    log:
        "logs/table4/table4{suffix}.log",
    benchmark:
        "benchmarks/table4/table4{suffix}.tsv"
    wildcard_constraints:
        suffix=SUFFIXES,
    localrule: True
    conda:
        ENV
    params:
        variant=variant_of,
        uncertainty=paper_uncertainty,
        stand_ins=config["comparison"]["stand_in_models"],
        user_models=list(USER),
    script:
        "../scripts/table4.py"
