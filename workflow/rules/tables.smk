# Stage 3: aggregate per-head records into the paper's tables (CSV + Markdown).


rule table1:
    localrule: True
    input:
        heads=lambda wc: [f for m in VISION["models"] for f in heads_files("paper", m)],
        meta=lambda wc: [f for m in VISION["models"] for f in heads_files("paper", m, "json")],
        signs=lambda wc: [f.replace(".csv", "_signs.h5") for m in VISION["models"] for f in heads_files("paper", m)],
        code=code_inputs("table1.py"),
    output:
        csv="results/table1.csv",
        md="results/table1.md",
    params:
        variant="paper",
        uncertainty={"seed": config["seed"], **config["uncertainty"]},
    log:
        "logs/table1/paper.log",
    benchmark:
        "benchmarks/table1/paper.tsv"
    conda:
        ENV
    script:
        "../scripts/table1.py"


rule table1_corrected:
    localrule: True
    input:
        heads=lambda wc: [f for m in VISION["models"] for f in heads_files("corrected", m)],
        meta=lambda wc: [f for m in VISION["models"] for f in heads_files("corrected", m, "json")],
        code=code_inputs("table1.py"),
    output:
        csv="results/table1_corrected.csv",
        md="results/table1_corrected.md",
    params:
        variant="corrected",
    log:
        "logs/table1/corrected.log",
    benchmark:
        "benchmarks/table1/corrected.tsv"
    conda:
        ENV
    script:
        "../scripts/table1.py"


# Table 4: language models (docs/method.md Section 3; corrected: Section 15).


rule table4:
    localrule: True
    input:
        heads=lambda wc: [f for m in TEXT["models"] for f in text_stage_files(m, "csv", "paper")],
        meta=lambda wc: [f for m in TEXT["models"] for f in text_stage_files(m, "json", "paper")],
        signs=lambda wc: [f.replace(".csv", "_signs.h5") for m in TEXT["models"] for f in text_stage_files(m, "csv", "paper")],
        code=code_inputs("table4.py"),
    output:
        csv="results/table4.csv",
        md="results/table4.md",
    params:
        variant="paper",
        uncertainty={"seed": config["seed"], **config["uncertainty"]},
    log:
        "logs/table4/paper.log",
    benchmark:
        "benchmarks/table4/paper.tsv"
    conda:
        ENV
    script:
        "../scripts/table4.py"


rule table4_corrected:
    localrule: True
    input:
        heads=lambda wc: [f for m in TEXT["models"] for f in text_stage_files(m, "csv", "corrected")],
        meta=lambda wc: [f for m in TEXT["models"] for f in text_stage_files(m, "json", "corrected")],
        code=code_inputs("table4.py"),
    output:
        csv="results/table4_corrected.csv",
        md="results/table4_corrected.md",
    params:
        variant="corrected",
    log:
        "logs/table4/corrected.log",
    benchmark:
        "benchmarks/table4/corrected.tsv"
    conda:
        ENV
    script:
        "../scripts/table4.py"
