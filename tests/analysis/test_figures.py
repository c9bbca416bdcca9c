"""Figures read by people with colour-vision deficiencies and when curves coincide: a sequential
colour-blind-safe map for accuracy, cell labels that contrast with their cell, curves that stay
visible when equal, panel titles that are names rather than task ids."""

from __future__ import annotations

from pathlib import Path

import matplotlib.colors
import pandas as pd
import pytest

from ccq_eval.analysis import figures, tables

REFERENCE = Path(__file__).resolve().parents[2] / "results" / "reference"


@pytest.fixture
def drawn(monkeypatch):
    """Figures kept open: (stem, figure) for every figure a drawing function saves."""
    kept = []
    monkeypatch.setattr(figures, "save_figure", lambda fig, out, stem: kept.append((stem, fig)) or [])
    yield kept
    for _, fig in kept:
        figures.plt.close(fig)


def _luminance(color) -> float:
    def channel(c):
        return c / 12.92 if c <= 0.03928 else ((c + 0.055) / 1.055) ** 2.4

    red, green, blue = (channel(c) for c in matplotlib.colors.to_rgb(color))
    return 0.2126 * red + 0.7152 * green + 0.0722 * blue


def _contrast(a, b) -> float:
    light, dark = sorted((_luminance(a), _luminance(b)), reverse=True)
    return (light + 0.05) / (dark + 0.05)


def _tidy_sniah(values: dict[str, float]) -> pd.DataFrame:
    rows = []
    for model, value in values.items():
        for length in (1024, 2048):
            for depth in (0.0, 50.0, 100.0):
                rows.append({"model": model, "task": "ccq_s_niah_1", "family": "s-niah", "primary": True,
                             "length": length, "depth": depth, "bucket": None, "value": value})
            rows.append({"model": model, "task": "ccq_s_niah_1", "family": "s-niah", "primary": True,
                         "length": length, "depth": None, "bucket": None, "value": value})
    return pd.DataFrame(rows)


@pytest.mark.parametrize("score", [0.0, 40.0, 100.0])
def test_heatmaps_use_a_sequential_colour_blind_safe_map_with_readable_labels(drawn, tmp_path, score):
    figures.sniah_heatmaps(_tidy_sniah({"tiny-gla": score, "tiny-gla-ccq": 100.0 - score}), tmp_path)
    [(stem, fig)] = drawn
    assert stem == "sniah_heatmap_S-NIAH-1"
    for ax in fig.axes:
        for image in ax.get_images():
            assert image.cmap.name == figures.HEATMAP_CMAP == "cividis"
            for text in ax.texts:
                cell = image.cmap(image.norm(float(text.get_text())))
                assert _contrast(cell, text.get_color()) >= 4.5, (text.get_text(), text.get_color())
                assert text.get_fontsize() >= 8


def test_equal_curves_stay_distinguishable(drawn, tmp_path):
    models = ["tiny-gdn", "tiny-gdn-ccq", "tiny-gla", "tiny-gla-ccq"]
    colors = figures.model_colors(models)
    figures.accuracy_curves(_tidy_sniah(dict.fromkeys(models, 0.0)), tmp_path, colors)
    [(_, fig)] = drawn
    lines = fig.axes[0].get_lines()
    assert len(lines) == len(models)
    looks = {(line.get_marker(), str(line.get_linestyle()), line.get_markerfacecolor() == "white")
             for line in lines}
    assert len(looks) == len(models)  # no two curves drawn alike
    sizes = [line.get_markersize() for line in lines]
    assert sizes == sorted(sizes, reverse=True) and len(set(sizes)) == len(sizes)  # nested, all visible
    assert [line.get_zorder() for line in lines] == sorted(line.get_zorder() for line in lines)


def test_model_colours_come_from_the_okabe_ito_palette():
    palette = [matplotlib.colors.to_rgb(c) for c in figures.PALETTE]
    colors = figures.model_colors(["tiny-gla", "tiny-gla-ccq", "tiny-gdn", "tiny-gdn-ccq", "other"])
    for model, rgba in colors.items():
        if figures.is_ccq(model):
            assert tuple(rgba[:3]) in palette
        else:  # the baseline: its family's hue mixed with white
            assert any(all(abs(c - (0.6 * p + 0.4)) < 1e-9 for c, p in zip(rgba[:3], hue)) for hue in palette)


def test_panel_titles_are_display_names_not_task_ids(drawn, tmp_path):
    tidy = tables.load_tidy(REFERENCE)
    figures.perplexity_curves(tidy, tmp_path, figures.model_colors(sorted(tidy["model"].unique())))
    figures.accuracy_curves(tidy, tmp_path, figures.model_colors(sorted(tidy["model"].unique())))
    titles = [ax.get_title() for _, fig in drawn for ax in fig.axes if ax.get_visible()]
    assert titles and not [t for t in titles if t.startswith("ccq_") or "_" in t]
