"""``kvtier inspect ROOT_DIR``: what an ``fs`` tier holds, and whether it is intact."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import click
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn
from rich.table import Table

from kvtier.errors import CorruptChunkError
from kvtier.tiers.fs.io import verify_file
from kvtier.tiers.fs.layout import NAMESPACE_FILE, ChunkFile, NamespaceDir, namespace_dirs
from kvtier.units import format_bytes


@dataclass
class _Namespace:
    directory: NamespaceDir
    model: str
    chunks: list[ChunkFile] = field(default_factory=list)
    corrupt: list[tuple[ChunkFile, str]] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return sum(chunk.size for chunk in self.chunks)


def _model_of(directory: NamespaceDir) -> str:
    try:
        record = json.loads((directory.path / NAMESPACE_FILE).read_text())
        layout = record["layout"]
        return f"{layout['model_id']} {layout['dtype']} x{layout['chunk_tokens']} tokens"
    except (OSError, ValueError, KeyError, TypeError):
        return f"({NAMESPACE_FILE} missing or unreadable)"


def _when(mtime_ns: int) -> str:
    return datetime.fromtimestamp(mtime_ns / 1e9, tz=timezone.utc).strftime("%Y-%m-%d %H:%M:%SZ")


def _verify(namespaces: list[_Namespace], console: Console) -> None:
    total = sum(ns.nbytes for ns in namespaces)
    columns = (
        TextColumn("verifying"),
        BarColumn(),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
    )
    with Progress(*columns, console=console, transient=True) as progress:
        task = progress.add_task("verify", total=total)
        for ns in namespaces:
            for chunk in ns.chunks:
                try:
                    verify_file(chunk.path, ns.directory.namespace, chunk.key)
                except CorruptChunkError as exc:
                    ns.corrupt.append((chunk, str(exc)))
                except FileNotFoundError:
                    pass  # evicted while we looked
                progress.advance(task, chunk.size)


@click.command()
@click.argument("root_dir", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--verify", is_flag=True, help="Read every chunk and check its checksum.")
def inspect(root_dir: Path, verify: bool) -> None:
    """Summarise the chunks an fs tier keeps under ROOT_DIR.

    Per namespace: chunks, bytes, oldest and newest. With --verify, every
    chunk's trailer and checksum are checked; exits 1 if any chunk is corrupt.
    Reads only: corrupt files are listed, not deleted (the tier deletes them
    when it meets them).
    """
    console = Console()
    namespaces = [
        _Namespace(directory, _model_of(directory), list(directory.scan()))
        for directory in namespace_dirs(root_dir)
    ]
    if verify:
        _verify(namespaces, console)
    table = Table(title=f"kvtier inspect {root_dir}")
    for column in ("namespace", "layout", "chunks", "bytes", "oldest", "newest"):
        table.add_column(column)
    if verify:
        table.add_column("corrupt")
    for ns in namespaces:
        times = [chunk.mtime_ns for chunk in ns.chunks]
        row = [
            ns.directory.namespace.hex()[:16],
            ns.model,
            str(len(ns.chunks)),
            format_bytes(ns.nbytes),
            _when(min(times)) if times else "-",
            _when(max(times)) if times else "-",
        ]
        if verify:
            row.append(f"[red]{len(ns.corrupt)}[/red]" if ns.corrupt else "0")
        table.add_row(*row)
    console.print(table)
    chunks = sum(len(ns.chunks) for ns in namespaces)
    nbytes = sum(ns.nbytes for ns in namespaces)
    console.print(f"{len(namespaces)} namespaces, {chunks} chunks, {format_bytes(nbytes)}")
    corrupt = [item for ns in namespaces for item in ns.corrupt]
    for chunk, reason in corrupt:
        console.print(f"[red]corrupt[/red] {chunk.path}: {reason}")
    if verify:
        console.print(
            f"[red]{len(corrupt)} corrupt chunks[/red]" if corrupt else "all checksums verified"
        )
    sys.exit(1 if corrupt else 0)
