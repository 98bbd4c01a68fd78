# Stage 0: external inputs in the resources directory.
#
# A download rule exists only for inputs that are missing when the workflow is parsed, so
# files placed by hand (or a read-only directory such as ../shared/assets) are never
# "regenerated". Offline (offline: true), a missing input stops DAG construction with the
# exact path to fill; online, the rule fetches it and fails with the same path if it cannot.
import re

MISSING_WEIGHTS = [m for m in VISION["models"] if not os.path.exists(weights_path(m))]
IMAGES_MISSING = VISION["imagenet_val_dir"] is None and not os.path.isdir(image_source()[0])


if MISSING_WEIGHTS:

    rule download_timm_weights:
        input:
            offline_guard(
                f"{RESOURCES}/weights/timm/{{model}}.safetensors",
                "pretrained weights",
                "Place the timm state_dict of the model there as safetensors "
                "(timm.create_model(id, pretrained=True).state_dict() saved with "
                "safetensors.torch.save_file), or set offline: false to let timm download it.",
            ),
        output:
            f"{RESOURCES}/weights/timm/{{model}}.safetensors",
        log:
            "logs/download_timm_weights/{model}.log",
        benchmark:
            "benchmarks/download_timm_weights/{model}.tsv"
        wildcard_constraints:
            model="|".join(re.escape(m) for m in MISSING_WEIGHTS),
        localrule: True
        conda:
            ENV
        params:
            downloads=config["downloads"],
        script:
            "../scripts/download_timm_weights.py"


if IMAGES_MISSING:

    rule download_imagenet_sample:
        input:
            offline_guard(
                f"{RESOURCES}/images/imagenet-sample",
                "ImageNet sample images",
                "Put the 1000 files <wnid>_<label>.JPEG of the ImageNet sample there, " "or set vision.imagenet_val_dir to an ImageNet validation root.",
            ),
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
            downloads=config["downloads"],
            url=VISION["imagenet_sample_url"],
        script:
            "../scripts/download_imagenet_sample.py"


WIKITEXT_MISSING = not os.path.exists(f"{RESOURCES}/text/wikitext-103/wiki.test.raw")


if WIKITEXT_MISSING:

    rule download_wikitext:
        input:
            offline_guard(
                f"{RESOURCES}/text/wikitext-103/wiki.test.raw",
                "WikiText-103 raw test split",
                "Put the file wiki.test.raw of wikitext-103-raw-v1 there (one dataset row per line), " "or set offline: false to fetch it with datasets.load_dataset (config key downloads.wikitext).",
            ),
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
            downloads=config["downloads"],
        script:
            "../scripts/download_wikitext.py"
