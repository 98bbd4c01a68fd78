# Stage 2: per (image, layer, head): Gram matrix, centering, eigenpairs, V_KPCA, metrics.


rule kpca_vision:
    input:
        activations="results/activations/{model}/vision_{n}_{shard}.h5",
        code=LIB_KPCA,
    output:
        heads="results/heads/{variant}/{model}/vision_{n}_{shard}.csv",
        meta="results/heads/{variant}/{model}/vision_{n}_{shard}.json",
    params:
        device=config["device"],
        seed=config["seed"],
        heads_per_chunk=config["kpca"]["heads_per_chunk"],
    threads: config["kpca"]["threads"]
    resources:
        gpu=1 if config["device"] != "cpu" else 0,
        mem_mb=8000,
    log:
        "logs/kpca_vision/{variant}/{model}/vision_{n}_{shard}.log",
    benchmark:
        "benchmarks/kpca_vision/{variant}/{model}/vision_{n}_{shard}.tsv"
    conda:
        ENV
    script:
        "../scripts/kpca_vision.py"
