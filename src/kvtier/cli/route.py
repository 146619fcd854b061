"""``kvtier route CONFIG``: serve routing scores from the cluster index over HTTP.

CONFIG is a kvtier configuration with an ``index`` section (the engines' own
will do). See :mod:`kvtier.fleet.service` for the requests it answers.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import click

from kvtier.cli.options import EXISTING_FILE, config_argument
from kvtier.cli.serving import layout_option, read_layout, stop_on_signals
from kvtier.config import load_config
from kvtier.errors import KVTierError
from kvtier.fleet.factory import build_index
from kvtier.fleet.routing import FleetIndex
from kvtier.fleet.service import RouteService
from kvtier.tiers.addresses import is_loopback

TOKEN_ENV = "KVTIER_ROUTE_TOKEN"


@click.command()
@config_argument
@layout_option("JSON object of the engines' KVLayout fields: lets requests send token ids.")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--port", default=8780, show_default=True, type=click.IntRange(0, 65535))
@click.option(
    "--token-file",
    type=EXISTING_FILE,
    help=f"File holding the bearer token requests must carry (or set {TOKEN_ENV}).",
)
@click.option(
    "--no-auth",
    is_flag=True,
    help="Accept requests without a token; only with a loopback --host.",
)
@click.option("--max-body-bytes", default=1 << 20, show_default=True, type=click.IntRange(min=64))
def route(
    config: Path,
    layout_path: Path | None,
    host: str,
    port: int,
    token_file: Path | None,
    no_auth: bool,
    max_body_bytes: int,
) -> None:
    """Answer routers: which node holds how much of a prompt, per tier.

    Prints "listening on HOST:PORT" once it accepts requests; runs until
    SIGINT or SIGTERM.
    """
    try:
        settings = load_config(config)
    except KVTierError as exc:
        click.echo(str(exc), err=True)
        sys.exit(2)
    if settings.index is None:
        click.echo(f"{config}: no 'index' section: nothing to answer from", err=True)
        sys.exit(2)
    token = _token(token_file)
    if token is None and not no_auth:
        click.echo(f"set {TOKEN_ENV} or --token-file (or --no-auth on loopback)", err=True)
        sys.exit(2)
    if token is None and not is_loopback(host):
        click.echo("--no-auth is refused on a non-loopback --host", err=True)
        sys.exit(2)
    layout = read_layout(layout_path) if layout_path else None
    fleet = FleetIndex(
        build_index(settings.index.index_class, settings.index.options),
        settings.chunk_tokens,
        layout,
    )
    service = RouteService(
        fleet, host=host, port=port, token=token, max_body_bytes=max_body_bytes
    ).start()
    stop = stop_on_signals()
    bound_host, bound_port = service.address
    click.echo(f"listening on {bound_host}:{bound_port}")
    sys.stdout.flush()
    try:
        stop.wait()
    finally:
        service.close()
        fleet.close()
    click.echo("stopped")


def _token(token_file: Path | None) -> str | None:
    if token_file is not None:
        token = token_file.read_text().strip()
        if not token:
            raise click.BadParameter(f"{token_file} is empty", param_hint="--token-file")
        return token
    return os.environ.get(TOKEN_ENV) or None
