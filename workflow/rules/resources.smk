# Stage 0: external inputs in the resources directory.
#
# A download rule exists only for an input that is not there when the workflow is parsed (a weights
# file of another model, a missing folder): Snakemake then never places one in the DAG of files placed
# by hand or read from a read-only directory such as ../shared/assets, so a dry run lists no download
# rule "with missing metadata" and the report's rule graph draws none. A shell command
# (kpca_repro.inputs.download), not a rule script: Snakemake reruns a script rule whose script is newer
# than its output. Offline, the check before the first job stops the run naming the exact path to
# fill (common.smk); online, the rule fetches it and fails with the same path if it cannot.

import re

# The model wildcard of download_timm_weights: any timm id but those whose weights file is there (the
# lookahead sees the whole file name, so a model whose id starts like a present one's is still matched).
WEIGHTS_HERE = sorted(p.stem for p in Path(RESOURCES, "weights", "timm").glob("*.safetensors"))
WEIGHTS_TO_FETCH = (rf"(?!(?:{'|'.join(map(re.escape, WEIGHTS_HERE))})\.safetensors$)" if WEIGHTS_HERE else "") + r"[A-Za-z0-9_.\-]+"


rule download_timm_weights:
    input:
        in_dag=in_dag("download_timm_weights"),
    output:
        f"{RESOURCES}/weights/timm/{{model}}.safetensors",
    log:
        "logs/download_timm_weights/{model}.log",
    benchmark:
        "benchmarks/download_timm_weights/{model}.tsv"
    wildcard_constraints:
        model=WEIGHTS_TO_FETCH,
    localrule: True
    conda:
        ENV
    params:
        downloads=DOWNLOADS,
    shell:
        "python -m kpca_repro.inputs.download weights {log:q} {params.downloads:q} {wildcards.model:q} {output:q}"


if not os.path.exists(f"{RESOURCES}/images/imagenet-sample"):

    rule download_imagenet_sample:
        input:
            in_dag=in_dag("download_imagenet_sample"),
        output:
            directory(f"{RESOURCES}/images/imagenet-sample"),
        log:
            "logs/download_imagenet_sample/download.log",
        benchmark:
            "benchmarks/download_imagenet_sample/download.tsv"
        localrule: True
        conda:
            ENV
        params:
            downloads=DOWNLOADS,
            url=VISION["imagenet_sample_url"],
        shell:
            "python -m kpca_repro.inputs.download imagenet {log:q} {params.downloads:q} {params.url:q} {output:q}"


if not os.path.exists(f"{RESOURCES}/text/wikitext-103/wiki.test.raw"):

    rule download_wikitext:
        input:
            in_dag=in_dag("download_wikitext"),
        output:
            f"{RESOURCES}/text/wikitext-103/wiki.test.raw",
        log:
            "logs/download_wikitext/download.log",
        benchmark:
            "benchmarks/download_wikitext/download.tsv"
        localrule: True
        conda:
            ENV
        params:
            downloads=DOWNLOADS,
        shell:
            "python -m kpca_repro.inputs.download wikitext {log:q} {params.downloads:q} - {output:q}"
