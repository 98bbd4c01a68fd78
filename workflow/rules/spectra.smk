# Tables 2 and 3: eigenvalues of the centered Gram matrix of the keys (docs/method.md 4-5), the records
# rule table aggregates (tables.smk); Figure 3: the gamma-test of the eigenvectors.


rule eigenvalues_vision:
    input:
        activations="results/activations/{model}/vision_{n}_{shard}.h5",
    output:
        "results/spectra/{variant}/{model}/vision_{n}_{shard}_{keyset}.csv",
    log:
        "logs/eigenvalues_vision/{variant}/{model}/vision_{n}_{shard}_{keyset}.log",
    benchmark:
        "benchmarks/eigenvalues_vision/{variant}/{model}/vision_{n}_{shard}_{keyset}.tsv"
    conda:
        ENV
    threads: job_threads
    resources:
        gpu=GPU,
        mem_mb=8000,
    params:
        code=code_of("eigenvalues_vision.py"),
        device=config["device"],
        n_components=config["spectra"]["n_components"],
        heads_per_chunk=config["kpca"]["heads_per_chunk"],
        gpu_eigensolver=config["kpca"]["gpu_eigensolver"],
    script:
        "../scripts/eigenvalues_vision.py"


rule gamma_vision:
    input:
        activations=expand(
            "results/activations/{model}/vision_{n}_0of1.h5",
            model=config["figure3"]["model"],
            n=config["figure3"]["n_images"],
        ),
    output:
        "results/figure3/gamma_{variant}.csv",
    log:
        "logs/gamma_vision/{variant}.log",
    benchmark:
        "benchmarks/gamma_vision/{variant}.tsv"
    conda:
        ENV
    threads: job_threads
    resources:
        gpu=GPU,
    params:
        code=code_of("gamma_vision.py"),
        intra_op_threads=config["kpca"]["intra_op_threads"],
        device=config["device"],
        block=config["figure3"]["block"],
        standardize=config["figure3"]["standardize"],
        noise=config["figure3"]["noise"],
        n_components=config["figure3"]["n_components"],
        seed=config["seed"],
        gpu_eigensolver=config["kpca"]["gpu_eigensolver"],
    script:
        "../scripts/gamma_vision.py"


default_target("results/figure3{suffix}.pdf", when=has_vision)


rule figure3:
    input:
        gamma=lambda wc: f"results/figure3/gamma_{variant_of(wc)}.csv",
        columns=lambda wc: f"results/figure3/gamma_{variant_of(wc)}.csv-metadata.json",
    output:
        pdf="results/figure3{suffix}.pdf",
        png=report(
            "results/figure3{suffix}.png",
            caption="../report/figure3.rst",
            category="Figures",
            labels=lambda wc: report_labels("Figure 3", variant_of(wc), [config["figure3"]["model"]]),
        ),
        csv="results/figure3{suffix}.csv",
        meta="results/figure3{suffix}.csv-metadata.json",
    log:
        "logs/figure3/figure3{suffix}.log",
    benchmark:
        "benchmarks/figure3/figure3{suffix}.tsv"
    wildcard_constraints:
        suffix=SUFFIXES,
    localrule: True
    conda:
        ENV
    params:
        code=code_of("figure3.py"),
        title=lambda wc: (f"{config['figure3']['model']}, block {config['figure3']['block']}, " f"{variant_of(wc)} variant; perturbed = QR(A + {config['figure3']['noise']} N(0, 1))"),
    script:
        "../scripts/figure3.py"
