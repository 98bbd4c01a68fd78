"""Figures 2, 3 and 5 and the decoders' prefix profile (matplotlib, PDF and PNG)."""

from __future__ import annotations

import os

import pandas as pd

from kpca_repro.h5io import PDF_METADATA

__all__ = ["GAMMA_BAND", "plot_gamma", "plot_norms", "plot_prefix_profile"]


#: Figure 3's band: these percentiles over heads (a spread of a non-negative quantity, so the
#: band never goes below zero, unlike the reference's mean +/- std).
GAMMA_BAND = (25, 75)


def plot_gamma(records: pd.DataFrame, pdf: str | os.PathLike, png: str | os.PathLike, title: str) -> pd.DataFrame:
    """Figure 3: per principal component, the pairwise gamma spread over heads.

    Rows: true and perturbed eigenvectors; columns: absolute ``|gamma_i - gamma_j|`` and
    relative spread. Per component, over heads (of every image drawn) of the per-head pair
    mean: the median as a solid line, the 25th-75th percentile (:data:`GAMMA_BAND`, numpy's
    linear interpolation) as the band, and the mean (the reference's line, docs/method.md Section
    10) dashed; red line at 0. The reference's band, +/- standard deviation over heads,
    reaches below zero for this non-negative quantity and is not drawn; it is kept in the
    returned statistics (``std``, ddof 0).

    Returns:
        The plotted per-component statistics (``eigenvectors, measure, component, mean, std,
        median, p25, p75, n_heads``).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lo, hi = GAMMA_BAND
    long = records.melt(
        id_vars=["eigenvectors", "component", "head", "sample_rank"],
        value_vars=["abs_mean", "rel_mean"],
        var_name="measure",
    )
    stats = (
        long.groupby(["eigenvectors", "measure", "component"])["value"]
        .agg(
            mean="mean",
            std=lambda x: x.std(ddof=0),
            median="median",
            **{f"p{lo}": lambda x: x.quantile(lo / 100), f"p{hi}": lambda x: x.quantile(hi / 100)},
            n_heads="count",
        )
        .reset_index()
    )
    n_heads = int(stats["n_heads"].max()) if len(stats) else 0
    fig, axes = plt.subplots(2, 2, figsize=(10, 6.8), sharex=True, constrained_layout=True)
    labels = {
        "abs_mean": r"$|\gamma_i - \gamma_j|$",
        "rel_mean": r"$|\gamma_i - \gamma_j| / \max(|\gamma_i|, |\gamma_j|)$",
    }
    for r, kind in enumerate(["true", "perturbed"]):
        for c, measure in enumerate(["abs_mean", "rel_mean"]):
            ax = axes[r, c]
            s = stats[(stats["eigenvectors"] == kind) & (stats["measure"] == measure)]
            ax.fill_between(
                s["component"],
                s[f"p{lo}"],
                s[f"p{hi}"],
                color="C0",
                alpha=0.25,
                lw=0,
                label=f"{lo}th–{hi}th percentile over heads",
            )
            ax.plot(s["component"], s["median"], color="C0", lw=1.2, label="median over heads")
            ax.plot(s["component"], s["mean"], color="C1", lw=0.9, ls="--", label="mean over heads")
            ax.axhline(0, color="red", lw=0.8)
            ax.set_ylabel(labels[measure])
            ax.set_title(f"{kind} eigenvectors", fontsize=10)
            if r == 1:
                ax.set_xlabel("principal component")
    handles, legend_labels = axes[0, 0].get_legend_handles_labels()
    fig.legend(
        handles,
        legend_labels,
        loc="outside lower center",
        ncols=3,
        fontsize=8,
        frameon=False,
        title=f"per component, over {n_heads} heads (each: its mean over token pairs)",
        title_fontsize=8,
    )
    fig.suptitle(title, fontsize=11)
    fig.savefig(pdf, metadata=PDF_METADATA)
    fig.savefig(png, dpi=150)
    plt.close(fig)
    return stats


#: Figures 2 and 5: marker and colour per quantity (docs/method.md 8: phi blue 'o', h red 's').
NORM_STYLE = {
    "phi": ("tab:blue", "o", r"$\|\varphi(q_i)\|^2$"),
    "h": ("tab:red", "s", r"$\|h_i\|^2$"),
}


def plot_norms(
    stats: pd.DataFrame,
    pdf: str | os.PathLike,
    png: str | os.PathLike,
    title: str,
    band_label: str,
    names: dict[str, str] | None = None,
) -> None:
    """Figures 2 and 5: layer-wise ``||phi(q_i)||^2`` against ``||h_i||^2``, one panel per model.

    Per panel (in the order models first appear in ``stats``): for each quantity the median
    over the pooled (sequence, head, token) values of each layer as a line with markers
    (phi blue ``o``, h red ``s``) and a shaded band from ``band_lower`` to ``band_upper``;
    log y-axis, x = layer index, the model's short name in a box bottom-right (docs/method.md 8).

    Args:
        stats: rows of :func:`kpca_repro.analysis.norms.norm_statistics` (``model, layer, quantity,
            median, band_lower, band_upper``) for one variant.
        title: figure title (which variant, which inputs).
        band_label: what the band is, shown in the legend (e.g. ``"IQR after 95th-percentile trim"``).
        names: model id -> short name for the panels; default the id after its last ``/``.
    """
    import math
    import textwrap

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(dict.fromkeys(stats["model"]))
    ncols = min(5, len(models))
    nrows = math.ceil(len(models) / ncols)
    width = max(7.0, 3.6 * ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(width, 3.2 * nrows + 1.4), squeeze=False, constrained_layout=True)
    for ax, model in zip(axes.flat, models):
        df = stats[stats["model"] == model]
        for quantity, (color, marker, label) in NORM_STYLE.items():
            s = df[df["quantity"] == quantity].sort_values("layer")
            ax.plot(s["layer"], s["median"], color=color, marker=marker, ms=4, lw=1.2, label=f"{label} median")
            ax.fill_between(
                s["layer"],
                s["band_lower"],
                s["band_upper"],
                color=color,
                alpha=0.2,
                lw=0,
                label=f"{label} {band_label}",
            )
        ax.set_yscale("log")
        ax.set_xticks(sorted(df["layer"].unique()))
        ax.grid(alpha=0.3, which="major")
        short = (names or {}).get(model, model.split("/")[-1])
        ax.text(
            0.97,
            0.05,
            short,
            transform=ax.transAxes,
            ha="right",
            va="bottom",
            fontsize=9,
            bbox={"boxstyle": "round", "fc": "white", "ec": "0.6"},
        )
    for ax in axes.flat[len(models) :]:
        ax.set_visible(False)
    for ax in axes[-1]:
        ax.set_xlabel("layer")
    for ax in axes[:, 0]:
        ax.set_ylabel("squared norm")
    handles, labels = axes.flat[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside lower center", ncols=2 if ncols < 3 else 4, fontsize=8, frameon=False)
    fig.suptitle(textwrap.fill(title, int(width * 13)), fontsize=10)
    fig.savefig(pdf, metadata=PDF_METADATA)
    fig.savefig(png, dpi=150)
    plt.close(fig)


def plot_prefix_profile(
    profile: pd.DataFrame,
    pdf: str | os.PathLike,
    png: str | os.PathLike,
    title: str,
    names: dict[str, str] | None = None,
) -> None:
    """The decoders' prefix profile (docs/method.md 16): each metric against the prefix length.

    One panel per metric (MDC, MOC, LCKA, KCKA and, where the profile has it, the projection
    test's cosine), one line per model; x = the prefix lengths P in order, the last point ``N``
    (each row's full length) drawn at equal spacing and labelled so, since N differs between
    rows; a P that no row reaches is left out, and so are the CKA points of a P where every head
    keeps every direction (``cka_all_directions_kept``: that CKA tests only g, docs/method.md 17.1).

    Args:
        profile: rows of :func:`kpca_repro.analysis.tables.decoders_prefix_table` (``hf_id,
            prefix, n_heads, MDC, MOC, LCKA, KCKA``) of one variant.
        title: figure title (the variant and the inputs).
        names: model id -> short name for the legend; default the id after its last ``/``.
    """
    import textwrap

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    profile = profile[profile["n_heads"] > 0]  # a P longer than every row has no point
    prefixes = list(dict.fromkeys(profile["prefix"].astype(str)))
    prefixes = sorted((p for p in prefixes if p != "N"), key=int) + (["N"] if "N" in prefixes else [])
    x = {p: i for i, p in enumerate(prefixes)}
    metrics = {
        "MDC": "MDC",
        "MOC": "MOC",
        "LCKA": "LCKA",
        "KCKA": "KCKA",
        "projection_cos": "projection test: cos(ĥ, h)",
    }
    metrics = {col: label for col, label in metrics.items() if col in profile}
    fig, axes = plt.subplots(1, len(metrics), figsize=(3.3 * len(metrics), 3.6), squeeze=False, constrained_layout=True)
    for ax, (metric, label) in zip(axes.flat, metrics.items()):
        for model, df in profile.groupby("hf_id", sort=False):
            if metric in ("LCKA", "KCKA") and "cka_all_directions_kept" in df:
                df = df[~df["cka_all_directions_kept"].astype(bool)]  # CKA that tests only g (docs/method.md 17.1)
            df = df.assign(_x=df["prefix"].astype(str).map(x)).sort_values("_x")
            ax.plot(
                df["_x"], df[metric], marker="o", ms=4, lw=1.2, label=(names or {}).get(model, model.split("/")[-1])
            )
        ax.set_xticks(range(len(prefixes)), prefixes)
        ax.set_xlabel("prefix length P")
        ax.set_title(label, fontsize=10)
        ax.grid(alpha=0.3)
    handles, labels = axes.flat[0].get_legend_handles_labels()
    fig.legend(
        handles, labels, loc="outside lower center", ncols=min(4, max(1, len(labels))), fontsize=8, frameon=False
    )
    fig.suptitle(textwrap.fill(title, 150), fontsize=10)
    fig.savefig(pdf, metadata=PDF_METADATA)
    fig.savefig(png, dpi=150)
    plt.close(fig)


# --------------------------------------------------------------------------------------
# Figures 1 and 4: training curves (docs/method.md Sections 6.3 and 7)
# --------------------------------------------------------------------------------------
