# Bring your own activations (docs/activations.md): each file of `activations: {name: {files, kind}}`
# is validated (format version, shapes, capture invariant) and installed as
# results/activations/<slug>/user_<i>of<S>.h5, from where kpca_heads, the spectra and the norms
# read it like a pipeline model's file. Tables 1-4 and the figures list the user models beside
# the configured ones (kpca_repro.workflow.paths.table_inputs, norms.smk); functions in user_helpers.smk.


rule user_activations:
    input:
        source=user_source,
    output:
        "results/activations/{model}/user_{shard}.h5",
    log:
        "logs/user_activations/{model}/user_{shard}.log",
    benchmark:
        "benchmarks/user_activations/{model}/user_{shard}.tsv"
    wildcard_constraints:
        model="|".join(re.escape(s) for s in USER_BY_SLUG) or "(?!)",
    localrule: True
    conda:
        ENV
    params:
        code=code_of("user_activations.py"),
        name=lambda wc: USER_BY_SLUG[wc.model],
        kind=lambda wc: USER[USER_BY_SLUG[wc.model]]["kind"],
        shard=lambda wc: int(wc.shard.split("of")[0]),
        n_shards=lambda wc: int(wc.shard.split("of")[1]),
    script:
        "../scripts/user_activations.py"


# Tables 2 and 3 of a user's vision model: the eigenvalue rule of the pipeline's files, on the installed ones.
rule eigenvalues_user:
    input:
        activations="results/activations/{model}/user_{shard}.h5",
    output:
        "results/spectra/{variant}/{model}/user_{shard}_{keyset}.csv",
    log:
        "logs/eigenvalues_vision/{variant}/{model}/user_{shard}_{keyset}.log",
    benchmark:
        "benchmarks/eigenvalues_vision/{variant}/{model}/user_{shard}_{keyset}.tsv"
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
