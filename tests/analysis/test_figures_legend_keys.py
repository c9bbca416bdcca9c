"""The line plots' legend: one key size for every model, whatever size its markers have in the panels."""

from __future__ import annotations

from ccq_eval.analysis import figures


def test_legend_keys_share_one_marker_size_and_keep_each_curves_look():
    fig, (ax,) = figures.panel_grid(1)
    for index, model in enumerate(["tiny-gdn", "tiny-gdn-ccq", "tiny-gla", "tiny-gla-ccq"]):
        ax.plot([1, 2], [0, 100], label=model, **figures._line_style(model, index, 4))
    figures._figure_legend(fig, [ax])
    (legend,) = fig.legends
    keys, curves = legend.legend_handles, ax.get_lines()
    assert {key.get_markersize() for key in keys} == {figures.LEGEND_MARKER_SIZE}
    assert len({curve.get_markersize() for curve in curves}) == 4  # the panels keep their nested sizes
    assert [(k.get_marker(), k.get_linestyle(), k.get_color(), k.get_markerfacecolor()) for k in keys] == [
        (c.get_marker(), c.get_linestyle(), c.get_color(), c.get_markerfacecolor()) for c in curves]
    assert [text.get_text() for text in legend.get_texts()] == [curve.get_label() for curve in curves]
    assert not any(curve.get_clip_on() for curve in curves)  # markers at 0 % and 100 % are drawn whole
    figures.plt.close(fig)
