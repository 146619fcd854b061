"""Option and argument types shared by the commands."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import click


class Seconds(click.FloatRange):
    """A positive number of seconds: ``inf`` waits forever, ``nan`` and ``0`` are refused."""

    name = "seconds"

    def __init__(self) -> None:
        super().__init__(min=0, min_open=True)

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        seconds = super().convert(value, param, ctx)
        if math.isnan(seconds):
            self.fail(f"{value!r} is not a number of seconds", param, ctx)
        return seconds


#: Counts and sizes that must be at least one.
POSITIVE = click.IntRange(min=1)

#: A file that must exist when the command starts.
EXISTING_FILE = click.Path(exists=True, dir_okay=False, path_type=Path)

#: The kvtier configuration file a command runs on.
config_argument = click.argument("config", type=EXISTING_FILE)
