"""PNG figures: matplotlib without a display (imported only when a figure is drawn), saved atomically, and the
one palette of the variants. The report's figures (report/plots.py) and bench-serve's use them."""

from __future__ import annotations

from pathlib import Path

COLORS = {"exact": "#444444", "identity": "#d95f02", "ridge": "#1b9e77", "fill": "#7570b3", "drop": "#e7298a",
          "mean": "#66a61e"}


def pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, path: Path) -> None:
    """Write `fig` as a PNG at `path`, atomically, and close it."""
    from ridgefill.runtime.paths import atomic_path

    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=110, bbox_inches="tight", format="png")
    pyplot().close(fig)
