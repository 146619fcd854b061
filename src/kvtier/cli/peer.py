"""``kvtier peer CONFIG``: run a kvtier node that serves its chunks to peers.

The node is what an engine would build (:class:`~kvtier.facade.KVCache`),
without the engine: its ``p2p`` tiers serve its primary tier until SIGINT or
SIGTERM. With ``--synthetic-chunks`` it first stores seeded random chunks, so
a fleet can be tried, tested and benchmarked with no engine at all.
"""

from __future__ import annotations

import sys
from pathlib import Path

import click
import numpy as np

from kvtier.cli.options import POSITIVE, config_argument
from kvtier.cli.probe import probe_layout
from kvtier.cli.serving import layout_option, read_layout, stop_on_signals
from kvtier.config import load_config
from kvtier.errors import KVTierError, describe_error
from kvtier.facade import KVCache
from kvtier.layout import KVLayout
from kvtier.tiers.p2p import PeerTier
from kvtier.tiers.p2p.protocol import format_address

#: Seconds between two steps of the node's manager while it serves.
_STEP_INTERVAL_S = 0.05


def synthetic_chunks(layout: KVLayout, count: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Tokens of ``count`` chunks and their bytes, both determined by ``seed``.

    Any process computes the same pair, hence the same keys and bytes.
    """
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, 2**31, count * layout.chunk_tokens, dtype=np.int64)
    data = rng.integers(0, 256, (count, layout.slot_bytes), dtype=np.uint8)
    return tokens, data


@click.command()
@config_argument
@layout_option("JSON object of the KVLayout fields of the engine whose chunks this node shares.")
@click.option(
    "--chunk-kib",
    type=POSITIVE,
    default=256,
    show_default=True,
    help="Chunk size of the synthetic layout used without --layout.",
)
@click.option(
    "--synthetic-chunks",
    "synthetic_count",
    type=click.IntRange(min=0),
    default=0,
    show_default=True,
    help="Store this many chunks of seeded random data at startup.",
)
@click.option("--seed", default=0, show_default=True, help="Seed of the synthetic chunks.")
def peer(
    config: Path, layout_path: Path | None, chunk_kib: int, synthetic_count: int, seed: int
) -> None:
    """Serve this node's chunks to its peers until SIGINT or SIGTERM.

    CONFIG must configure a p2p tier. Prints one line per peer service,
    "listening on HOST:PORT", once it accepts connections.
    """
    try:
        settings = load_config(config)
        layout = read_layout(layout_path) if layout_path else None
    except KVTierError as exc:
        click.echo(str(exc), err=True)
        sys.exit(2)
    try:
        cache = KVCache(settings, layout or probe_layout(settings.chunk_tokens, chunk_kib))
    except KVTierError as exc:
        click.echo(str(exc), err=True)
        sys.exit(2)
    except Exception as exc:  # a port in use, a backend down: the node cannot start
        click.echo(f"cannot start the node: {describe_error(exc)}", err=True)
        sys.exit(1)
    stop = stop_on_signals()
    try:
        addresses = [
            tier.address
            for tier in cache.manager.tiers
            if isinstance(tier, PeerTier) and tier.address is not None
        ]
        if not addresses:
            click.echo(f"{config}: no p2p tier with a listen address; nothing to serve", err=True)
            sys.exit(2)
        if synthetic_count:
            tokens, data = synthetic_chunks(cache.layout, synthetic_count, seed)
            stored = cache.store(tokens, data)
            click.echo(f"stored {stored} synthetic chunks (seed {seed})")
        for address in addresses:
            click.echo(f"listening on {format_address(*address)}")
        sys.stdout.flush()
        while not stop.wait(_STEP_INTERVAL_S):
            cache.step()
    finally:
        cache.close()
    click.echo("stopped")
