# Reproduction pipeline for "A Reproduction Study: The Kernel PCA Interpretation of
# Self-Attention Fails Under Scrutiny" (Saritas & Yildiz, arXiv:2505.07908).
#
#   snakemake --cores 8 results/table1.csv        # Table 1, paper variant
#   snakemake --cores 8                           # everything configured (rule all)
#
# Specification of every number: docs/method.md. Mathematics: src/kpca_repro/method/kpca.py.

from pathlib import Path

from snakemake.utils import min_version

min_version("9.0")

# This repository (the Snakefile's directory), also when another workflow uses this one as a
# module (`module kpca: snakefile: ...`; tests/test_module_use.py).
REPO = Path(workflow.current_basedir)


# Defaults next to this Snakefile; `--configfile my.yaml` / `--config key=value` override them.
configfile: REPO / "config" / "config.yaml"


report: "workflow/report/workflow.rst"


# Validates the configuration against workflow/schemas/config.schema.yaml and checks it (one call); the
# pure input functions, the code hash of each rule's script, and the check before the first job.
include: "workflow/rules/common.smk"
# Values and functions several rule files share (GPU resource, variant wildcards).
include: "workflow/rules/helpers.smk"
# The `activations:` entries (a user's own activation files, docs/activations.md) and their input functions.
include: "workflow/rules/user_helpers.smk"


# `snakemake --report` fails on any docutils warning or error in a caption instead of showing
# a "System Message" in the page (workflow/report/docutils.conf: halt_level warning).
from kpca_repro.workflow import strict_docutils

strict_docutils(REPO / "workflow" / "report" / "docutils.conf")


# After the DAG is built, before the first job (Snakemake runs no onstart handler in a dry run): the
# image counts of the samples in the DAG, the missing-input block, torch's default thread count (workflow/rules/common.smk).
onstart:
    before_first_job()


include: "workflow/rules/resources.smk"
include: "workflow/rules/extract.smk"
include: "workflow/rules/activations.smk"
include: "workflow/rules/kpca.smk"
# the column metadata of the records of kpca.smk, spectra.smk and decoders.smk (a local rule of its own)
include: "workflow/rules/metadata.smk"
include: "workflow/rules/tables.smk"
include: "workflow/rules/spectra.smk"
include: "workflow/rules/norms.smk"
include: "workflow/rules/decoders.smk"
include: "workflow/rules/training.smk"
# last: the comparison with the paper of every table registered before
include: "workflow/rules/report.smk"


# Every table and figure the configuration asks for: what the rule files registered
# (default_target, kpca_repro.workflow.paths).
rule all:
    default_target: True
    input:
        all_targets(),
