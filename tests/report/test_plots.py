"""The report's figures drawn from hand-made documents: what the legend lists is drawn and visible, and labels
do not run into a neighbouring panel."""

from pathlib import Path

import pytest

from ridgefill.report import plots
from ridgefill.report.results import Result
from test_report import loss_doc


@pytest.fixture
def loss_figure():
    figure = plots.loss_figure([Result(Path(f"loss-s{s}.json"), loss_doc(s, 256)) for s in (15, 20)])
    figure.canvas.draw()
    yield figure
    plots._pyplot().close(figure)


def test_loss_legend_entries_are_all_drawn_and_exact_is_off_the_frame(loss_figure):
    for ax in loss_figure.axes:
        handles, labels = ax.get_legend_handles_labels()
        assert sorted(labels) == ["exact (Δ = 0)", "identity", "ridge"]
        exact = handles[labels.index("exact (Δ = 0)")]
        low, high = ax.get_ylim()
        assert low < 0 < high and -low > 0.02 * (high - low)  # the zero line sits inside the panel, not on its edge
        assert exact.get_visible() and exact.get_linestyle() == "--"


def test_loss_panels_share_one_y_label_that_stays_off_the_next_panel(loss_figure):
    first, second = loss_figure.axes
    assert first.get_ylabel() and not second.get_ylabel()
    renderer = loss_figure.canvas.get_renderer()
    assert first.get_tightbbox(renderer).x1 < second.get_tightbbox(renderer).x0


def test_a_variant_drawn_only_in_a_later_group_is_in_the_legend():
    first = loss_doc(15, 256)
    del first["intervals"]["ridge"]  # no ridge bar for split 15
    figure = plots.loss_figure([Result(Path("a.json"), first), Result(Path("b.json"), loss_doc(20, 256))])
    try:
        assert sorted(figure.axes[0].get_legend_handles_labels()[1]) == ["exact (Δ = 0)", "identity", "ridge"]
    finally:
        plots._pyplot().close(figure)
