# Bring your own activations (docs/activations.md): the `activations:` entries and the input
# function of rule user_activations. Functions only (Snakemake's linter asks for rules and
# functions in separate files); the rules are in activations.smk.

import re

from kpca_repro.workflow.paths import user_models

# checked with the rest of the configuration (kpca_repro.workflow.config_checks: check_user_config)
USER = config["activations"]
USER_BY_SLUG = {model_slug(name): name for name in USER}


def user_source(wildcards):
    """The configured file behind results/activations/<slug>/user_<i>of<S>.h5."""
    i, n = (int(x) for x in wildcards.shard.split("of"))
    return USER[USER_BY_SLUG[wildcards.model]]["files"][i]
