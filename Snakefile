# Reproduction pipeline for "A Reproduction Study: The Kernel PCA Interpretation of
# Self-Attention Fails Under Scrutiny" (Saritas & Yildiz, arXiv:2505.07908).
#
#   snakemake --cores 8 results/table1.csv        # Table 1, paper variant
#   snakemake --cores 8                           # everything configured (rule all)
#
# Specification of every number: docs/method.md. Mathematics: src/kpca_repro/kpca.py.

from snakemake.utils import min_version

min_version("9.0")


# Defaults next to this Snakefile; `--configfile my.yaml` / `--config key=value` override them.
configfile: f"{workflow.basedir}/config/config.yaml"


report: "workflow/report/workflow.rst"


# Validates the configuration against workflow/schemas/config.schema.yaml, then checks it.
include: "workflow/rules/common.smk"
# Values and functions several rule files share (GPU resource, variant wildcards).
include: "workflow/rules/helpers.smk"


# `snakemake --report` fails on any docutils warning or error in a caption instead of showing
# a "System Message" in the page (workflow/report/docutils.conf: halt_level warning).
from kpca_repro.report_check import strict_docutils

strict_docutils(f"{workflow.basedir}/workflow/report/docutils.conf")


rule all:
    default_target: True
    input:
        all_targets(),


include: "workflow/rules/resources.smk"
include: "workflow/rules/extract.smk"
include: "workflow/rules/kpca.smk"
include: "workflow/rules/tables.smk"
include: "workflow/rules/spectra.smk"
include: "workflow/rules/report.smk"
include: "workflow/rules/norms.smk"
include: "workflow/rules/training.smk"
include: "workflow/rules/slurm.smk"
