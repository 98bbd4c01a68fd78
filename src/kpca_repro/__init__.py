"""kpca_repro: the library behind the Snakemake pipeline reproducing arXiv:2505.07908.

Modules: :mod:`kpca_repro.kpca` (all KPCA mathematics), :mod:`kpca_repro.vision`
(timm models and hooks), :mod:`kpca_repro.images` (inputs and sampling),
:mod:`kpca_repro.h5io` (activation files, atomic outputs), :mod:`kpca_repro.resources`
(resources directory), :mod:`kpca_repro.tables` (aggregation), :mod:`kpca_repro.smk`
(rule-script helpers).
"""

__version__ = "0.1.0"
