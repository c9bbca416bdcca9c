"""Figures of `ccq-eval inspect`, drawn from its tables (reads, spectra, positions); no torch.

- needle_share: needle share of the read at the answer position vs needle depth, one panel per
  model, one colour per length; solid = CCQ on, dashed = CCQ off, dotted grey = the needle's share
  of the tokens. The value drawn is the best-reading head's: the largest share over layers and
  heads (taken separately for on and off), averaged over samples.
- needle_share_layers: per layer, the largest share over its heads (mean over prompts), on vs off.
- needle_share_length (two lengths or more): the best head's share vs length, models overlaid.
- lambda_<model>: histograms of lambda_t over the sampled positions, one panel per layer, one
  colour per head (models with a trained gate only: a baseline's lambda is one constant).
- lambda_positions_<model>: lambda_t along the prompt (longest length, middle depth), needle shaded.
- sigma_spectrum: Sigma's eigenvalues at the answer position (mean over heads and prompts, longest
  length, drawn down to 1e-8: rounding leaves the null space of a low-rank Sigma there), one line
  per layer; sigma_rank: its effective rank (tr Sigma)^2 / tr Sigma^2 along the
  prompt, one line per layer (and per length, lighter for shorter ones).
- query_move: ||q~ - r|| / ||r|| over the sampled positions, per layer (boxes).
- top_direction_energy: per layer (mean over heads and prompts), how much the needle's unit keys and
  the other tokens' lie along Sigma's top-16 eigen-directions at the answer position (mean squared
  projection): the analysis the CCQ paper gives (docs/operator.md). A needle off those directions is what a
  contraction along them leaves readable.
- mechanism_figure (`inspect --mechanism-figure PATH`, not in draw_all): one small PNG for a README, the
  needle share per layer with CCQ's read against the plain read r (lambda = 0), one panel per model.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import pandas as pd

from ccq_eval.analysis.figure_style import STYLE, model_colors, safe_name, save_figure
from ccq_eval.analysis.figures import length_ticks, panel_grid

ON, OFF = "-", (0, (4, 2))


def _layer_colors(layers) -> dict:
    layers = sorted(set(layers))
    cmap = plt.get_cmap("viridis")
    return {layer: cmap(i / max(len(layers) - 1, 1) * 0.9) for i, layer in enumerate(layers)}


def _best_head(reads: pd.DataFrame, by: list[str]) -> pd.DataFrame:
    """Per prompt the largest share over layers and heads, then the mean over samples, per `by`."""
    prompt = ["model", "length", "depth", "sample"]
    best = reads.groupby(prompt)[["needle_share_on", "needle_share_off", "needle_token_fraction"]].max().reset_index()
    return best.groupby(by)[["needle_share_on", "needle_share_off", "needle_token_fraction"]].mean().reset_index()


def _per_model(models: list[str], out: Path, stem: str, xlabel: str, ylabel: str, draw, legend: bool = True):
    """One panel per model, drawn by draw(ax, model); shared labels, legend in the first panel."""
    with plt.rc_context(STYLE):
        fig, axes = panel_grid(len(models))
        for ax, model in zip(axes, models):
            draw(ax, model)
            ax.set_title(model)
            ax.set_xlabel(xlabel)
        axes[0].set_ylabel(ylabel)
        if legend:
            handles, labels = axes[0].get_legend_handles_labels()
            fig.legend(handles, labels, loc="outside lower center", ncol=min(len(labels), 5), frameon=False)
        return save_figure(fig, out, stem)


def _on_off(ax, x, on, off, color, label: str = "") -> None:
    """CCQ on solid with filled markers, off dashed with hollow ones."""
    ax.plot(x, on, linestyle=ON, marker="o", color=color, label=f"{label}CCQ on")
    ax.plot(x, off, linestyle=OFF, marker="o", markerfacecolor="white", color=color, label=f"{label}CCQ off")


def needle_share(reads: pd.DataFrame, out: Path) -> list[Path]:
    lengths = sorted(reads["length"].unique())
    best = _best_head(reads, ["model", "length", "depth"])
    cmap = plt.get_cmap("viridis")
    shade = {length: cmap(0.15 + 0.7 * i / max(len(lengths) - 1, 1)) for i, length in enumerate(lengths)}

    def draw(ax, model):
        for length in lengths:
            rows = best[(best["model"] == model) & (best["length"] == length)].sort_values("depth")
            label = f"{length // 1024}K " if length % 1024 == 0 else f"{length} "
            _on_off(ax, rows["depth"], rows["needle_share_on"], rows["needle_share_off"], shade[length], label)
            ax.plot(rows["depth"], rows["needle_token_fraction"], linestyle=":", color="0.6",
                    label="needle tokens / all tokens" if length == lengths[-1] else None)
        ax.set_ylim(bottom=0)

    return _per_model(list(dict.fromkeys(reads["model"])), out, "needle_share", "needle depth (%)",
                      "needle share of the read (best head)", draw)


def needle_share_layers(reads: pd.DataFrame, out: Path) -> list[Path]:
    models = list(dict.fromkeys(reads["model"]))
    colors = model_colors(models)
    per_layer = (reads.groupby(["model", "length", "depth", "sample", "layer"])[["needle_share_on", "needle_share_off"]]
                 .max().groupby(["model", "layer"]).mean().reset_index())

    def draw(ax, model):
        rows = per_layer[per_layer["model"] == model]
        _on_off(ax, rows["layer"], rows["needle_share_on"], rows["needle_share_off"], colors[model])
        ax.set_xticks(sorted(rows["layer"].unique()))

    return _per_model(models, out, "needle_share_layers", "layer", "needle share (best head of the layer)", draw)


def needle_share_length(reads: pd.DataFrame, out: Path) -> list[Path]:
    if reads["length"].nunique() < 2:
        return []
    models = list(dict.fromkeys(reads["model"]))
    colors = model_colors(models)
    best = _best_head(reads, ["model", "length"])
    with plt.rc_context(STYLE):
        fig, axes = panel_grid(1, width=4.2, height=3.0)
        ax = axes[0]
        for model in models:
            rows = best[best["model"] == model].sort_values("length")
            _on_off(ax, rows["length"], rows["needle_share_on"], rows["needle_share_off"], colors[model], f"{model} ")
        length_ticks(ax, best["length"])
        ax.set_xlabel("context length (tokens)")
        ax.set_ylabel("needle share (best head, mean over depths)")
        ax.legend(frameon=False)
        return save_figure(fig, out, "needle_share_length")


def lambda_histograms(positions: pd.DataFrame, reads: pd.DataFrame, out: Path) -> list[Path]:
    paths = []
    gated = reads.loc[reads["lambda_source"] == "gate", "model"].unique()
    for model in gated:
        rows = positions[positions["model"] == model]
        layers = sorted(rows["layer"].unique())
        with plt.rc_context(STYLE):
            fig, axes = panel_grid(len(layers), width=2.6, height=2.2, max_cols=6)
            for ax, layer in zip(axes, layers):
                for head, group in rows[rows["layer"] == layer].groupby("head"):
                    ax.hist(group["lambda"], bins=30, alpha=0.6, label=f"head {head}")
                ax.set_title(f"layer {layer}")
                ax.set_xlabel("lambda_t")
            axes[0].set_ylabel("positions")
            axes[0].legend(frameon=False)
            fig.suptitle(f"{model}: the gate lambda_t")
            paths += save_figure(fig, out, f"lambda_{safe_name(model)}")
    return paths


def _middle_prompt(rows: pd.DataFrame) -> pd.DataFrame:
    """The longest length's middle depth (first sample)."""
    longest = rows[rows["length"] == rows["length"].max()]
    depths = sorted(longest["depth"].unique())
    chosen = longest[(longest["depth"] == depths[len(depths) // 2]) & (longest["sample"] == longest["sample"].min())]
    return chosen


def lambda_positions(positions: pd.DataFrame, reads: pd.DataFrame, out: Path) -> list[Path]:
    paths = []
    for model in reads.loc[reads["lambda_source"] == "gate", "model"].unique():
        rows = _middle_prompt(positions[positions["model"] == model])
        needle = _middle_prompt(reads[reads["model"] == model]).iloc[0]
        layers = sorted(rows["layer"].unique())
        with plt.rc_context(STYLE):
            fig, axes = panel_grid(len(layers), width=2.8, height=2.2, max_cols=6)
            for ax, layer in zip(axes, layers):
                for head, group in rows[rows["layer"] == layer].groupby("head"):
                    ax.plot(group["position"], group["lambda"], linewidth=1.0, label=f"head {head}")
                ax.axvspan(needle["needle_start"], needle["needle_end"], color="0.85", zorder=0)
                ax.set_title(f"layer {layer}")
                ax.set_xlabel("position")
            axes[0].set_ylabel("lambda_t")
            axes[0].legend(frameon=False)
            fig.suptitle(f"{model}: lambda_t along the prompt ({needle['length']} tokens, depth {needle['depth']:g}%; "
                         "needle shaded)")
            paths += save_figure(fig, out, f"lambda_positions_{safe_name(model)}")
    return paths


def sigma_spectrum(spectra: pd.DataFrame, out: Path) -> list[Path]:
    longest = spectra[spectra["length"] == spectra.groupby("model")["length"].transform("max")]
    mean = longest.groupby(["model", "layer", "rank"])["eigenvalue"].mean().reset_index()
    colors = _layer_colors(mean["layer"])

    def draw(ax, model):
        for layer, rows in mean[mean["model"] == model].groupby("layer"):
            ax.plot(rows["rank"], rows["eigenvalue"].clip(lower=1e-8), color=colors[layer], label=f"layer {layer}")
        ax.set_yscale("log")

    return _per_model(list(dict.fromkeys(spectra["model"])), out, "sigma_spectrum", "eigenvalue rank",
                      "eigenvalue of Sigma at the answer", draw)


def sigma_rank(positions: pd.DataFrame, out: Path) -> list[Path]:
    mean = positions.groupby(["model", "length", "layer", "position"])["sigma_eff_rank"].mean().reset_index()
    colors = _layer_colors(mean["layer"])

    def draw(ax, model):
        rows = mean[mean["model"] == model]
        lengths = sorted(rows["length"].unique())
        for index, length in enumerate(lengths):
            for layer, group in rows[rows["length"] == length].groupby("layer"):
                ax.plot(group["position"], group["sigma_eff_rank"], color=colors[layer],
                        alpha=0.35 + 0.65 * (index + 1) / len(lengths),
                        label=f"layer {layer}" if index == len(lengths) - 1 else None)

    return _per_model(list(dict.fromkeys(positions["model"])), out, "sigma_rank", "position",
                      "effective rank of Sigma_t", draw)


def query_move(positions: pd.DataFrame, out: Path) -> list[Path]:
    def draw(ax, model):
        rows = positions[positions["model"] == model]
        layers = sorted(rows["layer"].unique())
        ax.boxplot([rows.loc[rows["layer"] == layer, "q_move"] for layer in layers], positions=layers,
                   showfliers=False)

    return _per_model(list(dict.fromkeys(positions["model"])), out, "query_move", "layer", "||q~ - r|| / ||r||",
                      draw, legend=False)


def top_direction_energy(reads: pd.DataFrame, out: Path) -> list[Path]:
    models = list(dict.fromkeys(reads["model"]))
    colors = model_colors(models)
    per_layer = reads.groupby(["model", "layer"])[["needle_top_energy", "haystack_top_energy"]].mean().reset_index()

    def draw(ax, model):
        rows = per_layer[per_layer["model"] == model].sort_values("layer")
        ax.plot(rows["layer"], rows["needle_top_energy"], marker="o", color=colors[model], label="needle keys")
        ax.plot(rows["layer"], rows["haystack_top_energy"], linestyle=OFF, marker="s", color="0.5",
                label="other keys")
        ax.set_xticks(sorted(rows["layer"].unique()))
        ax.set_ylim(bottom=0)

    return _per_model(models, out, "top_direction_energy", "layer",
                      "keys' energy on Sigma's top 16", draw)


def _read_labels(rows: pd.DataFrame) -> tuple[str, str]:
    """Legend labels of a model's two reads: the plain read r is lambda = 0; CCQ's read is the trained gate
    or, for a baseline, the constant lambda inspect computed it with."""
    if (rows["lambda_source"] == "gate").all():
        return "CCQ read (trained gate)", "read with r (CCQ off)"
    lambdas = sorted(rows["lambda_answer"].round(6).unique())
    return f"CCQ read, lambda = {'/'.join(f'{lam:g}' for lam in lambdas)}", "plain read (lambda = 0)"


def mechanism_figure(reads: pd.DataFrame, path: Path) -> Path:
    """The needle share of the read at the answer position per layer (best head of the layer, mean over
    prompts; whiskers: the prompts' range), CCQ's read against the plain one on the same weights and
    state, one panel per model, with the needle's share of the tokens for scale and the relative change
    written at each layer whose plain read takes at least 1% from the needle. Writes one PNG."""
    models = list(dict.fromkeys(reads["model"]))
    per_prompt = (reads.groupby(["model", "length", "depth", "sample", "layer"])
                  [["needle_share_on", "needle_share_off", "needle_token_fraction"]].max().reset_index())
    lengths = sorted(reads["length"].unique())
    grid = (f"S-NIAH prompts of {', '.join(f'{n // 1024}K' if n % 1024 == 0 else str(n) for n in lengths)} "
            f"tokens, {reads.groupby(['length', 'depth', 'sample']).ngroups} prompts")
    with plt.rc_context(STYLE):
        fig, axes = panel_grid(len(models), width=3.4, height=2.5, min_width=4.0)
        for ax, model in zip(axes, models):
            rows = per_prompt[per_prompt["model"] == model]
            on_label, off_label = _read_labels(reads[reads["model"] == model])
            stats = rows.groupby("layer")[["needle_share_on", "needle_share_off", "needle_token_fraction"]].agg(
                ["mean", "min", "max"])
            layers = stats.index.to_numpy()
            for column, label, style, face in (("needle_share_off", off_label, OFF, "white"),
                                               ("needle_share_on", on_label, ON, None)):
                mean = stats[(column, "mean")]
                spread = [mean - stats[(column, "min")], stats[(column, "max")] - mean]
                ax.errorbar(layers, mean, yerr=spread, linestyle=style, marker="o", markerfacecolor=face,
                            color="#0072B2" if column.endswith("on") else "#7f7f7f", capsize=2, label=label)
            ax.plot(layers, stats[("needle_token_fraction", "mean")], linestyle=":", color="0.6",
                    label="needle tokens / all tokens")
            for layer in layers:  # the relative change where the plain read takes a visible share
                on, off = stats.loc[layer, ("needle_share_on", "mean")], stats.loc[layer, ("needle_share_off", "mean")]
                if off >= 0.01:
                    ax.annotate(f"{on / off - 1:+.1%}", (layer, max(on, off)), textcoords="offset points",
                                xytext=(-6, 8), ha="right", fontsize=8, color="#0072B2")
            ax.set_xticks(layers)
            ax.set_ylim(bottom=0)
            ax.set_title(model)
            ax.set_xlabel("layer")
        axes[0].set_ylabel("needle share of the read\nat the answer (best head)")
        handles, labels = axes[0].get_legend_handles_labels()
        fig.legend(handles, labels, loc="outside lower center", ncol=2, frameon=False)
        fig.suptitle(grid, fontsize=8)
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=110)
        plt.close(fig)
    return path


def draw_all(reads: pd.DataFrame, spectra: pd.DataFrame, positions: pd.DataFrame, out: Path) -> list[Path]:
    """Every figure above into `out`; returns the files written."""
    out.mkdir(parents=True, exist_ok=True)
    return [*needle_share(reads, out), *needle_share_layers(reads, out), *needle_share_length(reads, out),
            *lambda_histograms(positions, reads, out), *lambda_positions(positions, reads, out),
            *sigma_spectrum(spectra, out), *sigma_rank(positions, out), *query_move(positions, out),
            *top_direction_energy(reads, out)]
