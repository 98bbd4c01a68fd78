"""Figures 1 and 4: the training curves (matplotlib, PDF and PNG)."""

from __future__ import annotations

import os
from collections.abc import Iterable

import numpy as np
import pandas as pd

from kpca_repro.h5io import PDF_METADATA

__all__ = ["TRAINING_COLOURS", "TRAINING_MODEL_NAMES", "plot_figure1", "plot_figure4"]


#: Colours of the authors' scripts: (train = light, test = dark) per model.
TRAINING_COLOURS = {"vit_tiny": ("#99CCFF", "#0066CC"), "deit_tiny": ("#FF9999", "#CC0000")}
_OTHER_COLOURS = [("#B3E6B3", "#2E8B2E"), ("#FFD699", "#CC7A00"), ("#D9B3FF", "#7A29CC")]
#: Display names of the architectures trained for Figures 1 and 4 (training.runs keys);
#: the pretrained models of the tables are named by :data:`kpca_repro.analysis.rendering.MODEL_NAMES`.
TRAINING_MODEL_NAMES = {"vit_tiny": "ViT-Tiny", "deit_tiny": "DeiT-Tiny"}


def _colours(model: str, i: int) -> tuple[str, str]:
    return TRAINING_COLOURS.get(model, _OTHER_COLOURS[i % len(_OTHER_COLOURS)])


def _keep(curves: pd.DataFrame, skip_epochs: dict[str, float]) -> pd.DataFrame:
    """Points with ``x >= skip_epochs[source]`` (the authors drop the first 10 epochs)."""
    skip = curves["source"].map(lambda s: skip_epochs.get(s, 0.0))
    return curves[curves["x"] >= skip]


#: Figure 1's rows: (metrics drawn, log y-axis). Row 0 is the authors' plot (linear y), row 1 the
#: same on a log y-axis, row 2 the medians over tokens, which the authors do not log.
FIGURE1_ROWS = (
    (("error", "h_norms_ave", "phiq_norms_ave"), False),
    (("error", "h_norms_ave", "phiq_norms_ave"), True),
    (("error_median", "h_norms_median", "phiq_norms_median"), True),
)
#: How each metric of Figure 1 is drawn: a line (``ls``) or markers (``marker``), and its legend text.
FIGURE1_STYLE = {
    "error": {"ls": "-", "label": r"line: $J_{proj}$ (mean of $|\|\varphi(q_i)\|^2 - \|h_i\|^2|$)"},
    "h_norms_ave": {"marker": "o", "size": 12, "label": r"circles: mean $\|h_i\|^2$"},
    "phiq_norms_ave": {"marker": "^", "size": 22, "label": r"triangles: mean $\|\varphi(q_i)\|^2$"},
    "error_median": {"ls": "-", "label": r"bottom row, solid: median of $|\|\varphi(q_i)\|^2 - \|h_i\|^2|$"},
    "h_norms_median": {"ls": "--", "label": r"dashed: median $\|h_i\|^2$"},
    "phiq_norms_median": {"ls": ":", "label": r"dotted: median $\|\varphi(q_i)\|^2$"},
}


def _draw_series(ax, s: pd.DataFrame, metric: str, colour: str, every: int) -> None:
    """One metric of one (model, split): the median over seeds, and its min-max band over seeds
    (invisible for a single seed). Markers are drawn on every ``every``-th point, the band on all."""
    style = FIGURE1_STYLE[metric]
    s = s.sort_values("x")
    ax.fill_between(s["x"], s["value_min"], s["value_max"], color=colour, alpha=0.18, lw=0)
    if "marker" in style:
        pts = s.iloc[::every]
        ax.scatter(pts["x"], pts["value"], marker=style["marker"], s=style["size"], color=colour, alpha=0.75)
    else:
        ax.plot(s["x"], s["value"], color=colour, lw=1.5 if metric == "error" else 1.3, ls=style["ls"])


def plot_figure1(
    curves: pd.DataFrame,
    pdf: str | os.PathLike,
    png: str | os.PathLike,
    skip_epochs: dict[str, float],
    settings: dict[str, str] | None = None,
    notes: dict[str, str] | None = None,
) -> pd.DataFrame:
    """Figure 1: J_proj of the train and test batch, with ||h||^2 (circles) and ||phi(q)||^2 (triangles).

    docs/method.md 6.3: per model, train J_proj as a light line and test as a dark line (ViT
    blue, DeiT red), ``h_norms_ave`` as circles and ``phiq_norms_ave`` as triangles on every
    k-th kept point (k = 3 for ~130 epochs; about 40 markers per series), points with
    ``x >= skip_epochs[source]``, linear y with limits ``(-0.5, ymax + 0.1 (ymax - ymin))``.
    One column per source (the authors' logs, this pipeline's runs at each scale), titled
    with the source and, from ``settings``, what it was trained on. Rows (:data:`FIGURE1_ROWS`):
    the authors' plot; the same on a log y-axis, where ``||phi(q)||^2`` is visible; and on a log
    y-axis the medians over tokens of ``|phi_i - ||h_i||^2|`` (solid), ``||h_i||^2`` (dashed) and
    ``||phi(q_i)||^2`` (dotted), which no single token dominates (a panel without them says so:
    the authors log means only, and logs written before the medians were logged lack them).

    Every curve is the median over the seeds of its ``(source, model)`` with the range over
    seeds shaded (:func:`kpca_repro.training.summary.over_seeds`; one seed: no band). One
    legend for the whole figure, below it.

    Args:
        curves: tidy frame of :func:`kpca_repro.training.logs.read_wandb_logs` /
            :func:`kpca_repro.training.logs.read_training_log` rows (one per seed).
        skip_epochs: per source, the first x kept.
        settings: per source, one line saying what it trained on
            (:func:`kpca_repro.training.summary.scale_setting`); sources without one get none.
        notes: per source, text set under its bottom panel (the claims of
            ``results/training_claims.csv``); sources without one get none.

    Returns:
        The plotted points: :data:`kpca_repro.training.summary.SEED_SUMMARY_COLUMNS` rows of the
        metrics of :data:`FIGURE1_ROWS` (``value`` the median over seeds).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from kpca_repro.training.summary import over_seeds

    settings, notes = settings or {}, notes or {}
    drawn = sorted({m for metrics, _ in FIGURE1_ROWS for m in metrics}, key=list(FIGURE1_STYLE).index)
    data = over_seeds(_keep(curves[curves["metric"].isin(drawn)], skip_epochs))
    sources = list(dict.fromkeys(data["source"]))
    wandb = set(curves.loc[curves["step"].notna(), "source"])  # W&B exports have a Step; this pipeline's logs none
    fig, axes = plt.subplots(
        len(FIGURE1_ROWS), len(sources), figsize=(5.5 * len(sources), 12.0), squeeze=False, constrained_layout=True
    )
    colours = {}  # display name -> (train, test) colour, in the order the models first appear
    for c, source in enumerate(sources):
        sd = data[data["source"] == source]
        for row, (metrics, log_y) in enumerate(FIGURE1_ROWS):
            ax = axes[row, c]
            rd = sd[sd["metric"].isin(metrics)]
            _draw_figure1_panel(ax, rd, dict.fromkeys(sd["model"]), metrics, colours)
            _scale_figure1_panel(ax, rd, log_y, from_wandb=source in wandb)
            _label_figure1_panel(ax, row, log_y, source, settings, notes)
    narrow = len(sources) <= 2  # the legend must fit the figure's width (5.5 in per column)
    fig.legend(
        handles=_figure1_legend(colours, drawn),
        loc="outside lower center",
        ncol=2 if len(sources) == 1 else 3 if narrow else 4,
        fontsize=8 if narrow else 9,
        frameon=False,
    )
    fig.savefig(pdf, metadata=PDF_METADATA)
    fig.savefig(png, dpi=150)
    plt.close(fig)
    return data.reset_index(drop=True)


def _draw_figure1_panel(
    ax, rd: pd.DataFrame, models: Iterable[str], metrics: tuple[str, ...], colours: dict[str, tuple[str, str]]
) -> None:
    """The ``metrics`` of one panel (``rd``: one source, over seeds) for each of ``models``, train
    light and test dark; a model's colour pair is added to ``colours`` (display name -> pair)
    when it first appears, even in a panel with nothing to draw, so every column agrees."""
    for model in models:
        md = rd[rd["model"] == model]
        name = TRAINING_MODEL_NAMES.get(model, model)
        pair = colours.setdefault(name, _colours(model, len(colours)))
        for split, colour in zip(("train", "test"), pair):
            s = md[md["split"] == split]
            every = max(1, round(s["epoch"].nunique() / 40))  # about 40 markers per series
            for metric in metrics:
                _draw_series(ax, s[s["metric"] == metric], metric, colour, every)


def _scale_figure1_panel(ax, rd: pd.DataFrame, log_y: bool, from_wandb: bool) -> None:
    """A log y-axis, or the authors' linear limits ``(-0.5, ymax + 0.1 (ymax - ymin))``; a panel
    without data says why (the authors' W&B logs hold means only, or an older log lacks medians)."""
    if rd.empty:
        why = (
            "the authors' logs hold means only"
            if from_wandb
            else "these logs were written before\nthe medians were logged"
        )
        ax.text(
            0.5,
            0.5,
            f"no medians over tokens:\n{why}",
            transform=ax.transAxes,
            ha="center",
            va="center",
            fontsize=9,
            color="0.35",
        )
        ax.set_xticks([])
        ax.set_yticks([])
    elif log_y:
        ax.set_yscale("log")
    else:
        v = rd[["value", "value_min", "value_max"]].to_numpy(float).ravel()
        v = v[np.isfinite(v)]
        if len(v):
            ax.set_ylim(-0.5, v.max() + 0.1 * (v.max() - v.min()))


def _label_figure1_panel(
    ax, row: int, log_y: bool, source: str, settings: dict[str, str], notes: dict[str, str]
) -> None:
    """Panel ``row`` of ``source``'s column: the source and its setting above the top row, the
    epoch axis and the source's note under the bottom row, the y-label, ticks and grid."""
    if row == 0:
        title = source if source not in settings else f"{source}\n{_wrap(settings[source])}"
        ax.set_title(title, fontsize=10)
    if row == len(FIGURE1_ROWS) - 1:
        ax.set_xlabel(
            "epoch" + (f"\n\n{notes[source]}" if source in notes else ""), fontsize=10 if source not in notes else 8
        )
    ylabel = r"$J_{proj}$ and squared norms" if row < 2 else "medians over tokens"
    ax.set_ylabel(ylabel + (" (log)" if log_y else ""), fontsize=10)
    ax.tick_params(labelsize=9)
    ax.grid(alpha=0.3)


def _figure1_legend(colours: dict[str, tuple[str, str]], drawn: list[str]) -> list:
    """The legend handles of Figure 1: one line per (model, batch), one per metric as drawn
    (:data:`FIGURE1_STYLE`), and the band over seeds."""
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    handles = [
        Line2D([], [], color=colour, lw=2.5, label=f"{name} {split}")
        for name, pair in colours.items()
        for split, colour in zip(("train batch", "test batch"), pair)
    ]
    for metric in drawn:
        style = FIGURE1_STYLE[metric]
        if "marker" in style:
            handles.append(Line2D([], [], color="0.3", ls="", marker=style["marker"], ms=5, label=style["label"]))
        else:
            handles.append(Line2D([], [], color="0.3", lw=1.5, ls=style["ls"], label=style["label"]))
    handles.append(Patch(color="0.3", alpha=0.25, lw=0, label="median over seeds; shaded: min–max over seeds"))
    return handles


def _wrap(text: str, width: int = 60) -> str:
    """``text`` on lines of at most ``width`` characters, broken after a comma or colon where possible."""
    import textwrap

    return "\n".join(textwrap.wrap(text, width))


def plot_figure4(
    curves: pd.DataFrame,
    pdf: str | os.PathLike,
    png: str | os.PathLike,
    skip_epochs: dict[str, float],
    settings: dict[str, str] | None = None,
) -> pd.DataFrame:
    """Figure 4: the relative errors ``rel_error_wrt_h`` (top) and ``rel_error_wrt_phiq`` (bottom).

    docs/method.md 7, one column per (source, model): train (blue #0066CC) and test (red #CC0000)
    points. Top: points with ``x >= skip_epochs[source]`` (the code drops the first 10 epochs
    here), y-limits [0.9, 1.1] when every point lies inside, else automatic. Bottom: every
    epoch, on a log y-axis (symlog if a value is not positive), so the values of order
    10^5-10^7 are read as they are. The authors' script instead divides them by 1e6 and
    appends "x 10^-6" to the label, which reads as values of order 10^-6.

    Each point is the median over the seeds of its ``(source, model)``, the range over seeds
    shaded (:func:`kpca_repro.training.summary.over_seeds`; one seed: no band).
    ``settings`` (per source, what it trained on) goes under each column's title.

    Returns:
        The plotted points (:data:`kpca_repro.training.summary.SEED_SUMMARY_COLUMNS`), with
        ``panel`` (``rel_h`` or ``rel_phi``) and ``plotted`` (the value as drawn: the median
        over seeds itself).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from kpca_repro.training.summary import over_seeds

    rel = over_seeds(curves[curves["metric"].isin(["rel_error_wrt_h", "rel_error_wrt_phiq"])])
    runs = list(dict.fromkeys(zip(rel["source"], rel["model"])))
    fig, axes = plt.subplots(2, len(runs), figsize=(4.5 * len(runs), 6.5), squeeze=False, constrained_layout=True)
    out = []
    for c, (source, model) in enumerate(runs):
        rd = rel[(rel["source"] == source) & (rel["model"] == model)]
        top = _keep(rd[rd["metric"] == "rel_error_wrt_h"], skip_epochs).assign(panel="rel_h")
        top["plotted"] = top["value"]
        bottom = rd[rd["metric"] == "rel_error_wrt_phiq"].assign(panel="rel_phi")
        bottom["plotted"] = bottom["value"]
        for r, (panel, label) in enumerate(
            ((top, r"rel. error w.r.t. $\|h\|^2$"), (bottom, r"rel. error w.r.t. $\|\varphi(q)\|^2$ (log scale)"))
        ):
            ax = axes[r, c]
            n_seeds = int(panel["n_seeds"].max()) if len(panel) else 0
            for split, colour in (("train", "#0066CC"), ("test", "#CC0000")):
                s = panel[panel["split"] == split].sort_values("x")
                ax.fill_between(s["x"], s["value_min"], s["value_max"], color=colour, alpha=0.2, lw=0)
                ax.plot(
                    s["x"],
                    s["plotted"],
                    "o-",
                    ms=2.5,
                    lw=0.8,
                    color=colour,
                    label=split if n_seeds <= 1 else f"{split}: median, min–max over {n_seeds} seeds",
                )
            if r == 0:
                v = panel[["value_min", "value_max"]].to_numpy(float).ravel()
                if len(v) and ((v >= 0.9) & (v <= 1.1)).all():
                    ax.set_ylim(0.9, 1.1)
                title = f"{TRAINING_MODEL_NAMES.get(model, model)}: {source}"
                ax.set_title(
                    title if source not in (settings or {}) else f"{title}\n{_wrap(settings[source], 45)}", fontsize=9
                )
            else:
                v = panel[["value", "value_min", "value_max"]].to_numpy(float).ravel()
                v = v[np.isfinite(v)]
                if len(v) and (v > 0).all():
                    ax.set_yscale("log")
                    ax.set_ylim(bottom=10 ** np.floor(np.log10(v.min())))  # a labelled decade below the data
                elif len(v):
                    positive = v[v > 0]
                    ax.set_yscale("symlog", linthresh=float(positive.min()) if len(positive) else 1.0)
                ax.set_xlabel("epoch")
            ax.set_ylabel(label)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
            out.append(panel)
    fig.savefig(pdf, metadata=PDF_METADATA)
    fig.savefig(png, dpi=150)
    plt.close(fig)
    return pd.concat(out, ignore_index=True) if out else rel.assign(panel=[], plotted=[])
