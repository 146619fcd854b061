"""``kvtier simulate --plot``: hit ratio against capacity as SVG or PNG, behind the plot extra."""

from __future__ import annotations

import json
import struct
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from kvtier.cli import cli

SVG = "{http://www.w3.org/2000/svg}"
ARGS = ["--chat-seed", "3", "--limit", "400", "-p", "lru", "-p", "arc", "-p", "leaf-lru"]
CAPACITIES = ["-c", "20%", "-c", "5%", "-c", "10%"]  # out of order: the plot sorts them


def simulate(*args: str, exit_code: int = 0) -> Any:
    result = CliRunner().invoke(cli, ["simulate", *args])
    assert result.exit_code == exit_code, result.output
    return result


def plotted_points(line: ET.Element) -> list[tuple[float, float]]:
    """The vertices of the first path in a line's group (``M x y L x y ...``)."""
    path = line.find(f".//{SVG}path")
    assert path is not None
    numbers = [float(n) for n in path.attrib["d"].replace("M", " ").replace("L", " ").split()]
    return list(zip(numbers[::2], numbers[1::2], strict=True))


def test_svg_plot_has_one_line_per_policy_and_min_with_their_names(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib", reason="needs the 'plot' extra")
    target = tmp_path / "hits.svg"
    report = json.loads(simulate(*ARGS, *CAPACITIES, "--json", "--plot", str(target)).stdout)

    root = ET.parse(target).getroot()  # well-formed XML, or this raises
    assert root.tag == f"{SVG}svg"
    groups = {g.attrib["id"]: g for g in root.iter(f"{SVG}g") if "id" in g.attrib}
    texts = {"".join(t.itertext()).strip() for t in root.iter(f"{SVG}text")}
    for name in ("lru", "arc", "leaf-lru", "MIN"):
        points = plotted_points(groups[f"policy-{name}"])
        assert len(points) == 3  # one vertex per capacity
        xs = [x for x, _ in points]
        assert xs == sorted(xs) and len(set(xs)) == 3  # capacities left to right
    assert {"lru", "arc", "leaf-lru", "Belady's MIN"} <= texts  # the legend, as text
    # SVG y grows downwards: MIN, the highest ratio, sits at or above every policy.
    cells = sorted(report["capacities"], key=lambda cell: cell["slots"])
    optimum = [y for _, y in plotted_points(groups["policy-MIN"])]
    for name in ("lru", "arc", "leaf-lru"):
        ys = [y for _, y in plotted_points(groups[f"policy-{name}"])]
        assert all(y >= best - 1e-6 for y, best in zip(ys, optimum, strict=True))
        ratios = [cell["policies"][name]["hit_ratio"] for cell in cells]
        # Higher ratio, higher point: the line follows the report.
        order = sorted(range(3), key=lambda i: ratios[i])
        assert [ys[i] for i in order] == sorted(ys, reverse=True)


def test_png_plot_is_a_png_image(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib", reason="needs the 'plot' extra")
    target = tmp_path / "hits.PNG"
    table = simulate(*ARGS, *CAPACITIES, "--plot", str(target)).stdout
    assert "MIN" in table  # the table still prints
    data = target.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    width, height = struct.unpack(">II", data[16:24])
    assert width > 100 and height > 100

    from matplotlib.image import imread

    pixels = imread(target)
    assert pixels.shape[:2] == (height, width)
    assert pixels.std() > 0  # something is drawn, not a blank canvas


def test_plot_without_the_extra_fails_at_start_naming_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A None entry in sys.modules makes `import matplotlib` raise ImportError,
    # as on an install without the plot extra.
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    target = tmp_path / "hits.svg"
    result = simulate(*ARGS, "--plot", str(target), exit_code=2)
    assert "pip install 'kvtier[plot]'" in result.output
    assert "matplotlib" in result.output
    assert "Traceback" not in result.output
    assert "MIN" not in result.output  # nothing was replayed
    assert not target.exists()


@pytest.mark.parametrize(
    ("name", "message"),
    [("hits.pdf", "must end in .svg or .png"), ("no-such-dir/hits.svg", "is not a directory")],
)
def test_plot_to_a_bad_path_fails_at_start(tmp_path: Path, name: str, message: str) -> None:
    result = simulate(*ARGS, "--plot", str(tmp_path / name), exit_code=2)
    assert message in result.output and "--plot" in result.output
    assert "Traceback" not in result.output
