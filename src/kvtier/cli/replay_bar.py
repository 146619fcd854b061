"""The progress bar a trace replay draws on stderr (stdout stays for the report)."""

from __future__ import annotations

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn


def replay_bar(shown: bool) -> Progress:
    """A transient bar of done/total steps; ``shown=False`` (``--json``) draws nothing."""
    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=Console(stderr=True),
        disable=not shown,
        transient=True,
    )
