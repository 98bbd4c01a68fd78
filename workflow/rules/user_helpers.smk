# Bring your own activations (docs/activations.md): the `activations:` entries and the input
# function of rule user_activations. Functions only (Snakemake's linter asks for rules and
# functions in separate files); the rules are in activations.smk.

import re
import sys

from kpca_repro.activations import check_user_config
from kpca_repro.workflow.paths import user_models

USER = config["activations"]
USER_BY_SLUG = {model_slug(name): name for name in USER}
try:
    check_user_config(config)
except ValueError as exc:  # the message alone, status 1, as the other configuration errors
    print(exc, file=sys.stderr)
    sys.exit(1)


def user_source(wildcards):
    """The configured file behind results/activations/<slug>/user_<i>of<S>.h5."""
    i, n = (int(x) for x in wildcards.shard.split("of"))
    return USER[USER_BY_SLUG[wildcards.model]]["files"][i]
