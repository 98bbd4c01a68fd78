"""The two readings of the paper's method, as data: everything that differs between them.

A :class:`Variant` carries the mathematical choices (dtype, Gram matrix and centering,
eigenpair order, sign rule, the authors' or the exact formulas, the language-model
script's options, baselines, sign draws) and the output names (the ``results/heads/<name>/``
folders and the ``results/table1<suffix>.csv`` suffix), so that no stage decides the variant
by its name. The KPCA functions (:mod:`kpca_repro.method.kpca`, :mod:`kpca_repro.method.equations`), the
per-head records (:mod:`kpca_repro.method.records`), the file layout (:mod:`kpca_repro.workflow.paths`)
and the rules (``workflow/rules/common.smk``, ``helpers.smk``: wildcard constraints) read it from here;
the configuration schema's enum of ``variants`` is checked against :data:`REGISTRY` by a test.

No torch here: the workflow imports this module at parse time. A third variant is one more
:class:`Variant` in :data:`REGISTRY` plus whatever new mathematics its fields name
(docs/internals.md, "Adding a variant").
"""

from __future__ import annotations

import dataclasses
import re

__all__ = ["Variant", "PAPER", "CORRECTED", "VARIANTS", "REGISTRY", "get", "from_suffix", "suffix_pattern"]


@dataclasses.dataclass(frozen=True)
class Variant:
    """One reading of the method (docs/method.md Section 2, 3: ``paper``; Section 15: ``corrected``).

    Attributes:
        name: ``"paper"`` or ``"corrected"``; also the folder of its per-head files
            (``results/heads/<name>/``, ``results/spectra/<name>/``, ``results/norms/<name>/``).
        suffix: of its user-facing outputs: ``results/table1<suffix>.csv``,
            ``results/figure2<suffix>.pdf`` (``""`` for the paper variant).
        dtype: the working precision, ``"float32"`` or ``"float64"``.
        gram: ``"exp"``: ``exp(K K^T s) / (g g^T + 1e-6)`` with plain ``exp`` and the dense
            centering ``M - O M - M O + O M O`` (docs/method.md 0.2); ``"log"``: the log-domain
            Gram matrix and centering by mean subtraction (docs/method.md 15.1).
        order: eigenpair order of the per-head records (:func:`kpca_repro.method.kpca.eigenpairs`):
            ``"abs_desc"``, ``"desc"`` or ``"asc_top"``; spectra and the gamma test always use ``"desc"``.
        fix_signs: each eigenvector's entry of largest magnitude made positive (docs/method.md 15.2).
        authors_formulas: the authors' expressions (True): ``+1e-8`` row norms, CKA
            denominators with ``+1e-10``, the lower median as RBF bandwidth, ``G 1_N A`` as
            ``(G O) @ A``, a non-finite head dropped, and the norm scripts' recipes of Figures 2
            and 5 (:mod:`kpca_repro.analysis.norms`); False: the exact formulas. Passed to the
            formula functions of :mod:`kpca_repro.method.equations` as their ``paper`` argument.
        g_eps: added to ``g`` in ``G = diag(1/(g + g_eps))`` (0 for vision; ``1e-6`` in the
            language-model script, docs/method.md 3).
        nan_cost_to_zero: no head dropped; every head goes through the assignment with NaN
            similarities replaced by 0 (``nlp_value_vectors.py`` has no try/except,
            docs/method.md 3: a non-finite head gets matched cosines 0, its other similarities
            NaN). False: the vision reference, a non-finite head dropped (all similarities NaN).
        cka_sqrt_of_product: CKA denominators ``sqrt(HSIC_xx HSIC_yy) + 1e-10`` of the
            language-model script (with ``authors_formulas``; :func:`kpca_repro.method.equations.linear_cka`).
        text: this is the variant's reading of language-model files (:meth:`reading`): the
            solver draws also give the token maximum of Table 4 (``direct_cos_max``).
        text_options: the fields that differ in that reading, field name -> value (the paper
            variant: ``nlp_value_vectors.py``'s, docs/method.md 3).
        text_padding: ``"included"`` (every padded position, Longformer read transposed as
            the reference reads it) or ``"excluded"`` (each sentence's real tokens).
        authors_threads: the Gram matrix, centering, ``eigh`` and V_KPCA per head on the CPU
            with the authors' thread count (``eigh_threads``, docs/fidelity.md).
        column_metrics: the column-wise ``|cos|`` comparisons the paper's text describes
            (``*_abs_cos_columns``, docs/method.md 15.3).
        baselines: every similarity also against a random Gaussian stand-in for V_KPCA
            (``baseline_*``, seeded per (seed, input, layer)).
        controls: the all-components control of the CKA columns, CKA with the unbiased HSIC
            estimator beside the biased one (``control_*``, ``*_cka_unbiased``), and the
            projection test of the claim itself (``projection_*``; docs/method.md 17).
        sign_draws: random eigenvector sign draws and intervals (docs/uncertainty.md).
        tables: the aggregation of Tables 1 and 4 (:mod:`kpca_repro.analysis.tables`): ``"paper"``
            (the published statistics with intervals) or ``"corrected"`` (mean ± std beside
            the random baselines).
    """

    name: str
    suffix: str
    dtype: str
    gram: str
    order: str
    fix_signs: bool
    authors_formulas: bool
    g_eps: float = 0.0
    nan_cost_to_zero: bool = False
    cka_sqrt_of_product: bool = False
    text: bool = False
    text_options: dict = dataclasses.field(default_factory=dict, hash=False, compare=False)
    text_padding: str = "excluded"
    authors_threads: bool = False
    column_metrics: bool = False
    baselines: bool = False
    controls: bool = False
    sign_draws: bool = False
    tables: str = "corrected"

    def __str__(self) -> str:
        return self.name

    @property
    def torch_dtype(self):
        """:attr:`dtype` as a ``torch.dtype`` (imports torch)."""
        import torch

        return getattr(torch, self.dtype)

    def reading(self, text: bool, causal: bool = False) -> Variant:
        """This variant as it reads language-model files (``text``: :attr:`text_options` applied,
        :attr:`text` set; docs/method.md 3) or vision files (itself). A decoder's file
        (``causal``) is read as text with padding excluded in every variant (docs/method.md 16.2)."""
        if causal:
            return dataclasses.replace(self, text=True, **self.text_options, text_padding="excluded")
        return dataclasses.replace(self, text=True, **self.text_options) if text else self

    def output(self, stem: str, ext: str) -> str:
        """A user-facing output name: ``output("results/table1", "csv")`` -> ``results/table1<suffix>.csv``."""
        return f"{stem}{self.suffix}.{ext}"

    def folder(self, kind: str) -> str:
        """The folder of this variant's intermediate files of ``kind`` (``heads``, ``spectra``, ``norms``)."""
        return f"results/{kind}/{self.name}"


PAPER = Variant(
    name="paper",
    suffix="",
    dtype="float32",
    gram="exp",
    order="abs_desc",
    fix_signs=False,
    authors_formulas=True,
    # nlp_value_vectors.py (docs/method.md 3): top-d eigenvectors in ascending order,
    # G = diag(1/(g + 1e-6)), NaN costs set to 0 before the assignment (no try/except, nothing
    # dropped), CKA denominators sqrt(xx * yy) + 1e-10.
    text_options={"order": "asc_top", "g_eps": 1e-6, "nan_cost_to_zero": True, "cka_sqrt_of_product": True},
    text_padding="included",
    authors_threads=True,
    column_metrics=False,
    baselines=False,
    sign_draws=True,
    tables="paper",
)

CORRECTED = Variant(
    name="corrected",
    suffix="_corrected",
    dtype="float64",
    gram="log",
    order="desc",
    fix_signs=True,
    authors_formulas=False,
    text_options={},
    text_padding="excluded",
    authors_threads=False,
    column_metrics=True,
    baselines=True,
    controls=True,
    sign_draws=False,
    tables="corrected",
)

#: Every variant by name, in output order.
REGISTRY: dict[str, Variant] = {v.name: v for v in (PAPER, CORRECTED)}
#: The variant names (``config["variants"]`` takes a subset).
VARIANTS: tuple[str, ...] = tuple(REGISTRY)


def get(variant: str | Variant) -> Variant:
    """The :class:`Variant` of a name (or the variant itself).

    Raises:
        ValueError: unknown name.
    """
    if isinstance(variant, Variant):
        return variant
    try:
        return REGISTRY[variant]
    except (KeyError, TypeError):
        raise ValueError(f"unknown variant {variant!r}; expected one of {VARIANTS}") from None


def from_suffix(suffix: str) -> Variant:
    """The variant whose outputs end in ``suffix`` (a rule's ``{suffix}`` wildcard)."""
    for v in REGISTRY.values():
        if v.suffix == suffix:
            return v
    raise ValueError(f"no variant has the output suffix {suffix!r}")


def suffix_pattern() -> str:
    """The ``{suffix}`` wildcard constraint: every variant's suffix (``"|_corrected"``)."""
    return "|".join(re.escape(v.suffix) for v in REGISTRY.values())
