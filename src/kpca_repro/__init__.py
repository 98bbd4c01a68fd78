"""kpca_repro: the library behind the Snakemake pipeline reproducing arXiv:2505.07908.

Modules, by pipeline stage (docs/internals.md):

* stage 1, extraction: :mod:`kpca_repro.extraction` (forward passes, HDF5 of q, k, v, h),
  :mod:`kpca_repro.vision` (timm models and hooks), :mod:`kpca_repro.hf_capture` (Hugging
  Face attention adapters), :mod:`kpca_repro.capture` (the capture invariant),
  :mod:`kpca_repro.text` (text samples, tokenization), :mod:`kpca_repro.images` (image
  inputs and sampling);
* any attention (docs/activations.md): :mod:`kpca_repro.activations` (the activation file
  format, its validator and writer), :mod:`kpca_repro.module_capture` (the capture interface
  for any ``torch.nn.Module``), :mod:`kpca_repro.api` (``kpca_repro.analyze_heads``,
  ``kpca_repro.analyze_file``: per-head metrics in a notebook);
* stage 2, per-head records: :mod:`kpca_repro.kpca` (all KPCA mathematics),
  :mod:`kpca_repro.records` (records of an activation file), :mod:`kpca_repro.uncertainty`
  (sign draws, bootstrap);
* norms and training: :mod:`kpca_repro.projection` (J_proj, squared norms),
  :mod:`kpca_repro.norms` (per-layer norm statistics), :mod:`kpca_repro.training`
  (training runs of Figures 1 and 4), :mod:`kpca_repro.training_summary` (each run's
  setting and token count, the token-count ablation table);
* aggregation and rendering: :mod:`kpca_repro.tables`, :mod:`kpca_repro.figures`,
  :mod:`kpca_repro.comparison` (against the published numbers), :mod:`kpca_repro.report`,
  :mod:`kpca_repro.report_check` (strict report captions);
* infrastructure: :mod:`kpca_repro.threads` (thread counts, worker pool),
  :mod:`kpca_repro.h5io` (HDF5, atomic outputs), :mod:`kpca_repro.smk` (rule-script
  helpers, logging), :mod:`kpca_repro.resources` (resources directory),
  :mod:`kpca_repro.code_deps` (each rule's ``code`` input), :mod:`kpca_repro.slurm_preflight`
  (cluster checks before submission), :mod:`kpca_repro.check_cache` (passed model checks
  kept between runs), :mod:`kpca_repro.model_info` (torch-free model facts for parse time).
"""

__version__ = "0.1.0"

__all__ = ["analyze_heads", "analyze_file"]


def __getattr__(name):
    # The notebook API (kpca_repro.api), imported on first use: `import kpca_repro` (paths,
    # variant, config checks at parse time) stays free of pandas and torch, and by name, so
    # that kpca_repro.code_deps (which follows import statements) does not make api.py and the
    # KPCA engine behind it a `code` input of every rule: no rule script uses the API.
    if name in ("analyze_heads", "analyze_file"):
        import importlib

        return getattr(importlib.import_module(f"{__name__}.api"), name)
    raise AttributeError(f"module 'kpca_repro' has no attribute {name!r}")
