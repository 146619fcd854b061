"""The ``kvtier`` command."""

from __future__ import annotations

import logging

import click

from kvtier import __version__
from kvtier.cli.bench import bench
from kvtier.cli.check import check
from kvtier.cli.demo import demo
from kvtier.cli.inspect import inspect
from kvtier.cli.peer import peer
from kvtier.cli.reference import reference
from kvtier.cli.route import route
from kvtier.cli.simulate import simulate


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="kvtier")
@click.option("-v", "--verbose", count=True, help="More logging (-v info, -vv debug).")
def cli(verbose: int) -> None:
    """kvtier: tiered KV-cache offloading for LLM inference engines."""
    level = logging.WARNING - 10 * min(verbose, 2)
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")


cli.add_command(check)
cli.add_command(bench)
cli.add_command(peer)
cli.add_command(reference)
cli.add_command(demo)
cli.add_command(inspect)
cli.add_command(simulate)
cli.add_command(route)


def main() -> None:
    cli()
