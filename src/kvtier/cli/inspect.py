"""``kvtier inspect ROOT_DIR``: what an ``fs`` tier holds, and whether it is intact."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, NoReturn

import click
from rich import box
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn
from rich.table import Table

from kvtier.errors import CorruptChunkError
from kvtier.tiers.fs.io import verify_file
from kvtier.tiers.fs.layout import (
    NAMESPACE_FILE,
    ChunkFile,
    NamespaceDir,
    OddEntry,
    TempFile,
    namespace_dirs,
)
from kvtier.tiers.fs.tier import FilesystemTierOptions
from kvtier.units import format_bytes

#: Paths listed per kind of finding before "... and N more".
_LISTED = 20


@dataclass
class _Namespace:
    directory: NamespaceDir
    model: str
    file_bytes: int | None
    #: Whether :attr:`file_bytes` is the largest a chunk file may be (a
    #: codec of varying sizes), not the size of every one.
    variable: bool = False
    chunks: list[ChunkFile] = field(default_factory=list)
    strays: list[OddEntry] = field(default_factory=list)
    temps: list[TempFile] = field(default_factory=list)
    corrupt: list[tuple[str, str]] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return sum(chunk.size for chunk in self.chunks)


def _survey(directory: NamespaceDir, abandoned_temp_s: float) -> _Namespace:
    model, file_bytes, variable = _read_record(directory)
    ns = _Namespace(directory, model, file_bytes, variable)
    for entry in directory.survey():
        if isinstance(entry, ChunkFile):
            ns.chunks.append(entry)
        elif entry.key is not None:  # a directory, FIFO, symlink... named like a chunk
            ns.corrupt.append((entry.path, f"{entry.kind}, not a regular file"))
        else:
            ns.strays.append(entry)
    ns.temps = list(directory.temp_files(abandoned_temp_s))
    return ns


def _read_record(directory: NamespaceDir) -> tuple[str, int | None, bool]:
    """The layout's description, the size of its chunk files (or the
    largest, and true, under a codec of varying sizes), from ``NAMESPACE.json``."""
    try:
        record: Any = directory.read_record()
    except FileNotFoundError:
        return f"({NAMESPACE_FILE} missing)", None, False
    except (OSError, ValueError) as exc:
        return f"({NAMESPACE_FILE} unreadable: {exc})", None, False
    try:
        layout = record["layout"]
        model = f"{layout['model_id']} {layout['dtype']} x{layout['chunk_tokens']} tokens"
    except (KeyError, TypeError, IndexError):
        model = f"({NAMESPACE_FILE} incomplete)"
    codec = record.get("codec") if isinstance(record, dict) else None
    if isinstance(codec, dict):  # chunks encoded on their way in (see docs/codecs.md)
        model += f", codec {codec.get('type')} {codec.get('params', {})}"
    try:
        chunk_file = record["chunk_file"]
        variable = "payload_bytes_max" in chunk_file
        payload = "payload_bytes_max" if variable else "payload_bytes"
        sizes = [chunk_file[name] for name in (payload, "trailer_bytes")]
    except (KeyError, TypeError, IndexError):
        return model, None, False
    # Only whole positive sizes declare one: anything else leaves each file's own size.
    if not all(type(size) is int and size > 0 for size in sizes):
        return model, None, False
    return model, sum(sizes), variable


def _when(mtime_ns: int) -> str:
    return datetime.fromtimestamp(mtime_ns / 1e9, tz=timezone.utc).strftime("%m-%d %H:%M")


def _count(number: int, noun: str) -> str:
    return f"{number} {noun}" + ("" if number == 1 else "s")


def _nothing_found(root_dir: Path) -> NoReturn:
    """Exit 1 saying that ``root_dir`` holds no fs tier data, and where some is."""
    below = sorted(
        str(child)
        for child in root_dir.iterdir()
        if child.is_dir() and not child.is_symlink() and next(namespace_dirs(child), None)
    )
    click.echo(f"no kvtier fs tier data in {root_dir}", err=True)
    if below:
        click.echo(
            "kvtier data is one level down: run kvtier inspect on the fs tier's "
            f"root_dir, e.g. kvtier inspect {below[0]}",
            err=True,
        )
    else:
        click.echo(
            "give the root_dir of an fs tier from your configuration "
            "(kvtier demo keeps its chunks in kvtier-demo/fs)",
            err=True,
        )
    sys.exit(1)


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
                    verify_file(
                        chunk.path,
                        ns.directory.namespace,
                        chunk.key,
                        ns.file_bytes,
                        variable=ns.variable,
                    )
                except CorruptChunkError as exc:
                    ns.corrupt.append((chunk.path, str(exc)))
                except FileNotFoundError:
                    pass  # evicted while we looked
                except OSError as exc:
                    ns.corrupt.append((chunk.path, f"unreadable: {exc.strerror or exc}"))
                progress.advance(task, chunk.size)


def _list(console: Console, label: str, rows: list[tuple[str, str]]) -> None:
    for path, detail in rows[:_LISTED]:
        console.print(f"{label} {escape(path)}: {escape(detail)}", soft_wrap=True)
    if len(rows) > _LISTED:
        console.print(f"{label} ... and {len(rows) - _LISTED} more")


@click.command()
@click.argument("root_dir", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--verify", is_flag=True, help="Read every chunk and check its checksum.")
@click.option(
    "--abandoned-temp-s",
    type=click.FloatRange(min=0, min_open=True),
    default=FilesystemTierOptions.model_fields["abandoned_temp_s"].default,
    show_default=True,
    help="Age after which another host's temp file counts as abandoned (as the tier's option).",
)
def inspect(root_dir: Path, verify: bool, abandoned_temp_s: float) -> None:
    """Summarise the chunks an fs tier keeps under ROOT_DIR.

    Per namespace: chunks, bytes, oldest and newest, temp files. Entries at
    chunk paths that are not regular files are listed as corrupt; temp files
    of writes that will never finish are listed with their bytes (the next
    tier start removes them). With --verify, every chunk's size, trailer and
    checksum are checked, reading no more than a chunk file's declared size.
    Exits 1 if anything is corrupt. Reads only: nothing is deleted (the tier
    deletes what it finds corrupt).
    """
    console = Console()
    if not root_dir.is_dir():  # a FIFO or device passes click's check
        raise click.BadParameter(f"{root_dir} is not a directory", param_hint="ROOT_DIR")
    try:
        directories = list(namespace_dirs(root_dir))
    except OSError as exc:
        raise click.ClickException(f"cannot read {root_dir}: {exc.strerror}") from exc
    namespaces = [_survey(directory, abandoned_temp_s) for directory in directories]
    if not namespaces:
        _nothing_found(root_dir)
    if verify:
        _verify(namespaces, console)
    table = Table(
        title=f"kvtier inspect {root_dir}",
        caption="oldest, newest: chunk modification times (UTC)",
        box=box.SIMPLE_HEAD,
        collapse_padding=True,
        pad_edge=False,
    )
    table.add_column("namespace", no_wrap=True)
    for column in ("chunks", "bytes"):
        table.add_column(column, justify="right", no_wrap=True)
    for column in ("oldest", "newest"):
        table.add_column(column, no_wrap=True)
    for column in ("temp", "corrupt"):
        table.add_column(column, justify="right", no_wrap=True)
    for ns in namespaces:
        times = [chunk.mtime_ns for chunk in ns.chunks]
        table.add_row(
            ns.directory.namespace.hex()[:8],
            str(len(ns.chunks)),
            format_bytes(ns.nbytes),
            _when(min(times)) if times else "-",
            _when(max(times)) if times else "-",
            str(len(ns.temps)),
            f"[red]{len(ns.corrupt)}[/red]" if ns.corrupt else "0",
        )
    console.print(table)
    for ns in namespaces:
        console.print(f"{ns.directory.namespace.hex()}: {escape(ns.model)}", soft_wrap=True)
    chunks = sum(len(ns.chunks) for ns in namespaces)
    nbytes = sum(ns.nbytes for ns in namespaces)
    console.print(
        f"{_count(len(namespaces), 'namespace')}, {_count(chunks, 'chunk')}, {format_bytes(nbytes)}"
    )
    corrupt = [row for ns in namespaces for row in ns.corrupt]
    _list(console, "[red]corrupt[/red]", corrupt)
    _list(console, "skipped", [(e.path, e.kind) for ns in namespaces for e in ns.strays])
    temps = [temp for ns in namespaces for temp in ns.temps]
    abandoned = [temp for temp in temps if temp.abandoned]
    in_progress = [temp for temp in temps if not temp.abandoned]
    _list(console, "abandoned temp", [(t.path, format_bytes(t.size)) for t in abandoned])
    if abandoned:
        console.print(
            f"[yellow]{len(abandoned)} abandoned temp files "
            f"({format_bytes(sum(t.size for t in abandoned))})[/yellow] of writes that will "
            "never finish: removed at the next tier start"
        )
    if in_progress:
        console.print(
            f"{len(in_progress)} temp files ({format_bytes(sum(t.size for t in in_progress))}) "
            "of writes in progress"
        )
    if corrupt:
        console.print(f"[red]{len(corrupt)} corrupt chunks[/red]")
    elif verify:
        console.print(
            f"checksums of {chunks} chunks verified; not clean: abandoned temp files above"
            if abandoned
            else "all checksums verified"
        )
    sys.exit(1 if corrupt else 0)
