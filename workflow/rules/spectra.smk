# Tables 2 and 3: eigenvalues of the centered Gram matrix of the keys (method.md 4-5).


rule eigenvalues_vision:
    input:
        activations="results/activations/{model}/vision_{n}_{shard}.h5",
        code=LIB_SPECTRA,
    output:
        "results/spectra/{variant}/{model}/vision_{n}_{shard}_{keyset}.csv",
    params:
        device=config["device"],
        n_components=config["spectra"]["n_components"],
        heads_per_chunk=config["kpca"]["heads_per_chunk"],
    threads: config["kpca"]["threads"]
    resources:
        gpu=1 if config["device"] != "cpu" else 0,
        mem_mb=8000,
    log:
        "logs/eigenvalues_vision/{variant}/{model}/vision_{n}_{shard}_{keyset}.log",
    benchmark:
        "benchmarks/eigenvalues_vision/{variant}/{model}/vision_{n}_{shard}_{keyset}.tsv"
    conda:
        ENV
    script:
        "../scripts/eigenvalues_vision.py"


rule table_spectra:
    input:
        records=lambda wc: [
            f
            for m in VISION["models"]
            for keys in (["standardized"] if wc.table == "2" else ["standardized", "raw"])
            for f in spectra_files("corrected" if wc.suffix else "paper", m, keys)
        ],
        code=LIB_TABLES,
    output:
        csv="results/table{table}{suffix}.csv",
        md="results/table{table}{suffix}.md",
    wildcard_constraints:
        table="2|3",
        suffix="|_corrected",
    params:
        variant=lambda wc: "corrected" if wc.suffix else "paper",
    log:
        "logs/table_spectra/table{table}{suffix}.log",
    benchmark:
        "benchmarks/table_spectra/table{table}{suffix}.tsv"
    conda:
        ENV
    script:
        "../scripts/table_spectra.py"
