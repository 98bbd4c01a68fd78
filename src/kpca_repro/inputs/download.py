"""The download rules' command (workflow/rules/resources.smk, training.smk): fetch one external input.

Run as a shell command, not a rule script: Snakemake reruns a script rule whose script is newer than
its output, and a fresh clone's scripts are newer than inputs placed by hand. ::

    python -m kpca_repro.inputs.download KIND LOG DOWNLOADS_JSON ARG OUTPUT [OUTPUT ...]

KIND: ``weights`` (ARG: the timm id), ``imagenet`` (ARG: the archive URL), ``wikitext`` (ARG: ``-``),
``fashion_mnist`` (ARG: ``-``; OUTPUT: its four files, fetched into their directory) or
``training_logs`` (ARG: the archive URL); DOWNLOADS_JSON: the ``downloads`` configuration section.
A failure ends with one line naming the path to fill by hand, exit status 1.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from types import SimpleNamespace

from kpca_repro.inputs import resources
from kpca_repro.smk import fail_cleanly, setup_logging

KINDS = ("weights", "imagenet", "wikitext", "fashion_mnist", "training_logs")


def parse_args(argv: list[str]) -> argparse.Namespace:
    """The command line (module docstring); ``--help`` prints it, a wrong one ends in argparse's usage line
    (status 2)."""
    parser = argparse.ArgumentParser(
        prog="python -m kpca_repro.inputs.download",
        description=(
            "Fetch one external input of the workflow (the download rules' command; normally run by Snakemake). "
            "A failure ends with one line naming the path to fill by hand, status 1."
        ),
    )
    parser.add_argument("kind", choices=KINDS, help="what to fetch")
    parser.add_argument("log", help="the job's log file")
    parser.add_argument(
        "downloads", help="the configuration's downloads section as JSON (retries, backoff_s, timeout_s, digests)"
    )
    parser.add_argument(
        "arg", help="weights: the timm model id; imagenet, training_logs: the archive URL; wikitext, fashion_mnist: -"
    )
    parser.add_argument("output", nargs="+", help="the output file or folder (fashion_mnist: its four files)")
    return parser.parse_args(argv)


def main(argv: list[str]) -> None:
    args = parse_args(argv)
    kind, log_path, arg, output = args.kind, args.log, args.arg, args.output[0]
    dl = json.loads(args.downloads)
    log = setup_logging(SimpleNamespace(log=[log_path]), f"download_{kind}")
    policy = resources.DownloadPolicy.from_config(dl)
    log.info("downloading %s %s -> %s", kind, arg, output)
    if kind == "weights":
        fail_cleanly(log, resources.download_timm_weights, arg, output, policy=policy, log=log)
    elif kind == "imagenet":
        hashes = {
            "archive_sha256": dl["imagenet_sample_sha256"],
            "content_sha256_expected": dl["imagenet_sample_content_sha256"],
        }
        fail_cleanly(log, resources.download_imagenet_sample, arg, output, **hashes, policy=policy, log=log)
    elif kind == "wikitext":
        from kpca_repro.inputs.text import download_wikitext

        fail_cleanly(log, download_wikitext, output, dl["wikitext"], policy=policy, log=log)
    elif kind == "fashion_mnist":
        from kpca_repro.training.data import FASHION_MNIST_FILES

        fail_cleanly(
            log,
            resources.download_fashion_mnist,
            dl["fashion_mnist_url"],
            os.path.dirname(output),
            FASHION_MNIST_FILES,
            dl["fashion_mnist_hashes"],
            policy=policy,
            log=log,
        )
    elif kind == "training_logs":
        from kpca_repro.training.logs import WANDB_FILES

        fail_cleanly(
            log, resources.download_wandb_logs, arg, output, WANDB_FILES, dl["reference_sha256"], policy=policy, log=log
        )
    log.info("done: %s", output)


if __name__ == "__main__":
    main(sys.argv[1:])
