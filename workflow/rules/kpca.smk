# Stage 2: per (input, layer, head): Gram matrix, centering, eigenpairs, V_KPCA, metrics.
# One rule for vision (vision_<n>_<shard>) and language-model (text_<sample>_<shard>) files;
# the records module reads the kind of file from its layout (attention_mask for text).
# user_<i>of<S>: a user's activation file (activations.smk, docs/activations.md).


rule kpca_heads:
    input:
        activations="results/activations/{model}/{stem}.h5",
    output:
        heads="results/heads/{variant}/{model}/{stem}.csv",
        meta="results/heads/{variant}/{model}/{stem}.json",
        signs="results/heads/{variant}/{model}/{stem}_signs.h5",
    log:
        "logs/kpca_heads/{variant}/{model}/{stem}.log",
    benchmark:
        "benchmarks/kpca_heads/{variant}/{model}/{stem}.tsv"
    wildcard_constraints:
        stem=r"(vision_\d+|text_(\d+|sentences)|user)_\d+of\d+",
    conda:
        ENV
    threads: job_threads
    resources:
        gpu=GPU,
        mem_mb=8000,
    params:
        code=code_of("kpca_heads.py"),
        device=config["device"],
        seed=config["seed"],
        heads_per_chunk=config["kpca"]["heads_per_chunk"],
        eigh_threads=config["kpca"]["eigh_threads"],
        gpu_eigensolver=config["kpca"]["gpu_eigensolver"],
        sign_draws=sign_draws_of,
        # all of each row's tokens; rule kpca_prefix (decoders.smk): its first P real tokens
        prefix=None,
    script:
        "../scripts/kpca_heads.py"
