"""kpca_repro: the library behind the Snakemake pipeline reproducing arXiv:2505.07908.

One subpackage per pipeline stage (docs/internals.md); a rule's ``params.code`` is a hash of the
modules its script imports (:mod:`kpca_repro.workflow.code`):

* :mod:`kpca_repro.inputs`: downloads, the image and text samples, where models come from;
* :mod:`kpca_repro.capture`: forward passes storing q, k, v, h per head;
* :mod:`kpca_repro.method`: the kernel-PCA mathematics, its engine, the variants, per-head records;
* :mod:`kpca_repro.analysis`: tables, norms, the comparison with the paper, HTML tables;
* :mod:`kpca_repro.figures`: Figures 2, 3 and 5;
* :mod:`kpca_repro.training`: the training runs of Figures 1 and 4 and their figures;
* :mod:`kpca_repro.workflow`: what runs before any job (configuration checks, paths, code hashes).

What only the tests and ``perf/`` use (the local Hugging Face hub, the authors' per-head
transcription) is not part of the package: ``tools/kpca_tools`` (tools/README.md).

The modules at the top are shared by every stage: :mod:`kpca_repro.activations` (the activation
file: layout, reader, writer, validator, capture invariant), :mod:`kpca_repro.h5io` (atomic
outputs), :mod:`kpca_repro.smk` (rule-script helpers, logging), :mod:`kpca_repro.errors` (the base
class of every bad-input-file error), :mod:`kpca_repro.progress`,
:mod:`kpca_repro.threads` (thread counts, devices, worker pool), :mod:`kpca_repro.projection` (J_proj and squared norms,
used by the method, the norms and training).

Any attention (docs/activations.md): :mod:`kpca_repro.activations` (the activation file
format), :mod:`kpca_repro.capture.module_capture` (the capture
interface for any ``torch.nn.Module``), :mod:`kpca_repro.method.api` (``kpca_repro.analyze_heads``,
``kpca_repro.analyze_file``: per-head metrics in a notebook, of ``kpca_repro.HeadArrays`` as a
``kpca_repro.KpcaJob`` says).
"""

__version__ = "0.1.0"

__all__ = ["analyze_heads", "analyze_file", "HeadArrays", "KpcaJob"]


def __getattr__(name):
    # The notebook API (kpca_repro.method.api), imported on first use: `import kpca_repro`
    # (paths, variant, config checks at parse time) stays free of pandas and torch.
    if name in __all__:
        import importlib

        return getattr(importlib.import_module(f"{__name__}.method.api"), name)
    raise AttributeError(f"module 'kpca_repro' has no attribute {name!r}")
