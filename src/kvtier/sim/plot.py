"""Hit ratio against capacity, one line per policy plus Belady's MIN, as SVG or PNG.

Draws the report ``kvtier simulate`` builds. Needs matplotlib, the ``plot``
extra (``pip install 'kvtier[plot]'``); :func:`load_matplotlib` checks for it so
that the command can fail before it replays anything. It draws on a
:class:`matplotlib.figure.Figure` of its own, never through ``pyplot``, so it
changes no global backend or figure state of the process.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvtier.errors import MissingDependencyError

PLOT_FORMATS = (".svg", ".png")
MIN_LABEL = "Belady's MIN"


def load_matplotlib() -> Any:
    """The ``matplotlib`` module, or :class:`MissingDependencyError` naming the ``plot`` extra."""
    try:
        import matplotlib
        import matplotlib.figure
    except ImportError as exc:
        raise MissingDependencyError(exc.name or "matplotlib", "plot") from exc
    return matplotlib


def plot_format(path: Path) -> str:
    """The image format ``path`` names by its suffix (``svg`` or ``png``), or ``ValueError``."""
    suffix = path.suffix.lower()
    if suffix not in PLOT_FORMATS:
        raise ValueError(f"{str(path)!r} must end in .svg or .png (the image format)")
    return suffix[1:]


def plot_report(report: dict[str, Any], path: Path) -> None:
    """Write ``report``'s hit ratios against capacity to ``path`` (SVG or PNG).

    The x axis is the capacity as a share of the trace's distinct chunks.
    Each line carries its policy's name as its label and, in an SVG, as the
    id of its group (``policy-<name>``, ``policy-MIN``), so the file can be
    read back; text stays text in an SVG.
    """
    image_format = plot_format(path)
    matplotlib = load_matplotlib()
    cells = sorted(report["capacities"], key=lambda cell: cell["slots"])
    shares = [100 * cell["share"] for cell in cells]
    names = list(cells[0]["policies"]) if cells else []
    with matplotlib.rc_context({"svg.fonttype": "none", "svg.hashsalt": "kvtier"}):
        figure = matplotlib.figure.Figure(figsize=(7, 4.5))
        axes = figure.add_subplot()
        for name in names:
            ratios = [cell["policies"][name]["hit_ratio"] for cell in cells]
            axes.plot(shares, ratios, marker="o", label=name, gid=f"policy-{name}")
        optimum = [cell["min_hit_ratio"] for cell in cells]
        axes.plot(shares, optimum, "k--", marker="s", label=MIN_LABEL, gid="policy-MIN")
        axes.set_xlabel("primary tier capacity (% of distinct chunks)")
        axes.set_ylabel("hit ratio (leading resident chunks / all chunks)")
        axes.set_title(f"kvtier simulate {report.get('trace', '')}".strip(), fontsize=10)
        axes.set_ylim(0, 1)
        axes.grid(alpha=0.3)
        axes.legend()
        figure.tight_layout()
        figure.savefig(path, format=image_format, metadata=_metadata(image_format))


def _metadata(image_format: str) -> dict[str, Any]:
    # No creation date, so the same report always makes the same file.
    return {"Date": None} if image_format == "svg" else {}
