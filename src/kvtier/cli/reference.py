"""``kvtier config-reference``: print the configuration reference as Markdown."""

from __future__ import annotations

import click

from kvtier.cli.docs_reference import config_reference


@click.command("config-reference")
def reference() -> None:
    """Print every configuration key of kvtier and of each tier, as Markdown.

    Generated from the typed option declarations, like the user guide's
    reference, and listing the tiers, policies and specs of installed packages
    (entry points) too.
    """
    click.echo(config_reference(installed=True), nl=False)
