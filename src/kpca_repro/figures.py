"""Figures (matplotlib, PDF and PNG)."""

from __future__ import annotations

import os

import pandas as pd

__all__ = ["plot_gamma", "PDF_METADATA"]

#: ``savefig(..., metadata=PDF_METADATA)``: no creation date in PDFs, so identical runs give
#: identical bytes (PNG files carry no timestamp).
PDF_METADATA = {"CreationDate": None}


def plot_gamma(records: pd.DataFrame, pdf: str | os.PathLike, png: str | os.PathLike, title: str) -> pd.DataFrame:
    """Figure 3: per principal component, the mean over heads of the pairwise gamma spread.

    Rows: true and perturbed eigenvectors; columns: absolute ``|gamma_i - gamma_j|`` and
    relative spread. Line = mean over heads of the per-head pair mean; band = +/- standard
    deviation over heads (ddof 0), as the reference plots it (method.md Section 10); red
    line at 0.

    Returns:
        The plotted per-component statistics (``eigenvectors, component, measure, mean, std``).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    long = records.melt(id_vars=["eigenvectors", "component", "head", "sample_rank"], value_vars=["abs_mean", "rel_mean"], var_name="measure")
    stats = long.groupby(["eigenvectors", "measure", "component"])["value"].agg(mean="mean", std=lambda x: x.std(ddof=0)).reset_index()
    fig, axes = plt.subplots(2, 2, figsize=(10, 6.5), sharex=True, constrained_layout=True)
    labels = {"abs_mean": r"$|\gamma_i - \gamma_j|$", "rel_mean": r"$|\gamma_i - \gamma_j| / \max(|\gamma_i|, |\gamma_j|)$"}
    for r, kind in enumerate(["true", "perturbed"]):
        for c, measure in enumerate(["abs_mean", "rel_mean"]):
            ax = axes[r, c]
            s = stats[(stats["eigenvectors"] == kind) & (stats["measure"] == measure)]
            ax.plot(s["component"], s["mean"], color="C0", lw=1.2)
            ax.fill_between(s["component"], s["mean"] - s["std"], s["mean"] + s["std"], color="C0", alpha=0.25)
            ax.axhline(0, color="red", lw=0.8)
            ax.set_ylabel(labels[measure])
            ax.set_title(f"{kind} eigenvectors", fontsize=10)
            if r == 1:
                ax.set_xlabel("principal component")
    fig.suptitle(title, fontsize=11)
    fig.savefig(pdf, metadata=PDF_METADATA)
    fig.savefig(png, dpi=150)
    plt.close(fig)
    return stats
