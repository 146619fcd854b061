"""What the commands that serve until stopped (``kvtier peer``, ``kvtier route``) share."""

from __future__ import annotations

import json
import signal
import threading
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any, TypeVar

import click

from kvtier.cli.options import EXISTING_FILE
from kvtier.layout import KVLayout

F = TypeVar("F", bound=Callable[..., Any])


def layout_option(help: str) -> Callable[[F], F]:
    """``--layout FILE`` (a JSON object of :class:`KVLayout` fields), passed as ``layout_path``."""
    return click.option("--layout", "layout_path", type=EXISTING_FILE, help=help)


def read_layout(path: Path) -> KVLayout:
    """A :class:`KVLayout` from a JSON object of its fields."""
    try:
        fields: dict[str, Any] = json.loads(path.read_text())
        if not isinstance(fields, dict):
            raise TypeError("expected a JSON object of KVLayout fields")
        if isinstance(fields.get("extra"), dict):
            fields["extra"] = tuple(sorted(fields["extra"].items()))
        return KVLayout(**fields)
    except (OSError, ValueError, TypeError) as exc:
        raise click.BadParameter(f"{path}: {exc}", param_hint="--layout") from None


def stop_on_signals() -> threading.Event:
    """An event that SIGINT or SIGTERM sets: what a serving command waits on."""
    stop = threading.Event()

    def request_stop(signum: int, frame: FrameType | None) -> None:
        stop.set()

    signal.signal(signal.SIGINT, request_stop)
    signal.signal(signal.SIGTERM, request_stop)
    return stop
