"""How every figure looks: matplotlib's settings, the colour-blind-safe palette, a stable colour per model,
and saving as PNG and PDF. Shared by ccq_eval.analysis.figures and ccq_eval.analysis.bar_figures.

Colour-blind safe: a model's family (its name without a trailing "-ccq") owns one hue of the Okabe-Ito
palette (fixed for known architectures such as GLA and Gated DeltaNet, else from a hash of the name), so the
same model gets the same colour in every figure; the CCQ variant takes the full colour, the baseline a
lighter shade.
"""

from __future__ import annotations

import re
import zlib
from collections.abc import Iterable
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.colors
import matplotlib.pyplot as plt
import matplotlib.ticker
import numpy as np

from ccq_eval.atomic_io import write_error

STYLE = {
    "font.size": 9,
    "axes.titlesize": 10,
    "axes.labelsize": 9,
    "legend.fontsize": 8,
    "xtick.labelsize": 8,
    "ytick.labelsize": 8,
    "axes.spines.top": False,
    "axes.spines.right": False,
    "axes.grid": True,
    "grid.alpha": 0.3,
    "pdf.fonttype": 42,  # embed TrueType: editable text in the PDF
    "text.parse_math": False,  # a model or task name with $...$ is shown as written, never as TeX markup
}
# Okabe & Ito's colour-blind-safe palette (without its black): blue, orange, bluish green,
# vermillion, reddish purple, sky blue, yellow.
PALETTE = ("#0072B2", "#E69F00", "#009E73", "#D55E00", "#CC79A7", "#56B4E9", "#F0E442")
HEATMAP_CMAP = "cividis"
MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")
_CCQ_SUFFIX = re.compile(r"[-_]ccq$", re.IGNORECASE)
_N_HUES = len(PALETTE)


def model_family(model: str) -> str:
    return _CCQ_SUFFIX.sub("", model)


def is_ccq(model: str) -> bool:
    return bool(_CCQ_SUFFIX.search(model)) or "ccq" in model.lower()


# Architectures papers compare get fixed hues of PALETTE (first match wins); other names hash to one.
_KNOWN_FAMILY_HUES = (
    (re.compile(r"gdn|gated[-_ ]?delta", re.IGNORECASE), 1),  # orange
    (re.compile(r"deltanet", re.IGNORECASE), 3),  # vermillion
    (re.compile(r"gla", re.IGNORECASE), 0),  # blue
    (re.compile(r"mamba", re.IGNORECASE), 2),  # bluish green
    (re.compile(r"retnet|hgrn|rwkv", re.IGNORECASE), 4),  # reddish purple
    (re.compile(r"llama|transformer|gpt", re.IGNORECASE), 5),  # sky blue
)


def _preferred_hue(family: str) -> int:
    for pattern, hue in _KNOWN_FAMILY_HUES:
        if pattern.search(family):
            return hue
    return zlib.crc32(family.encode("utf-8")) % _N_HUES


def model_colors(models: Iterable[str]) -> dict[str, tuple[float, float, float, float]]:
    """Stable colour per model: its family's hue (fixed for known architectures, else from a
    hash of the name; linear probing on clashes, families in sorted order), full colour for
    CCQ variants, a lighter shade for baselines."""
    palette = [matplotlib.colors.to_rgb(c) for c in PALETTE]
    families = sorted({model_family(m) for m in models})
    hue_of: dict[str, int] = {}
    taken: set[int] = set()
    for family in families:
        hue = _preferred_hue(family)
        for step in range(_N_HUES):
            candidate = (hue + step) % _N_HUES
            if candidate not in taken or len(taken) >= _N_HUES:
                hue = candidate
                break
        taken.add(hue)
        hue_of[family] = hue
    colors = {}
    for model in models:
        base = np.array(palette[hue_of[model_family(model)]])
        # baseline: the family hue mixed with white, readable on white but clearly lighter
        shade = base if is_ccq(model) else 0.6 * base + 0.4
        colors[model] = (*(float(c) for c in shade), 1.0)
    return colors


def log_y_axis(ax: plt.Axes) -> None:
    """A log y axis labelled in plain numbers (perplexities)."""
    ax.set_yscale("log")
    ax.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}"))
    ax.yaxis.set_minor_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}"))


def save_figure(fig: plt.Figure, out: Path, stem: str) -> list[Path]:
    """PNG, then PDF with the layout the PNG's draw computed (the same size in inches, so the same
    positions: laying the figure out again would only cost time)."""
    paths = []
    try:
        for suffix in (".png", ".pdf"):
            path = out / f"{stem}{suffix}"
            try:
                fig.savefig(path, dpi=150 if suffix == ".png" else None)
            except OSError as exc:  # a full disk's error names no file
                raise write_error(path, exc) from exc
            fig.set_layout_engine("none")
            paths.append(path)
    finally:
        plt.close(fig)
    return paths


def safe_name(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name)
