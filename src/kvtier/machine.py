"""What this machine can still give: how much memory a process may allocate
without swapping, read before a size is committed to."""

from __future__ import annotations

import os
from pathlib import Path

MEMINFO = Path("/proc/meminfo")
CGROUP = Path("/sys/fs/cgroup")
OWN_CGROUP = Path("/proc/self/cgroup")


def available_memory(
    meminfo: Path = MEMINFO,
    cgroup: Path = CGROUP,
    own: Path = OWN_CGROUP,
    *,
    less_used: bool = True,
) -> tuple[int, str] | None:
    """Bytes this process may still allocate without swapping, and where that
    was read; ``None`` when the system does not say.

    The kernel's ``MemAvailable`` (what can be had without swapping), lowered
    to what the process's cgroup (v2 or v1) still allows under its limit: a
    container's, seen at the root of its cgroup mount, or the group ``own``
    names (``/proc/self/cgroup``) where the whole hierarchy is mounted.
    ``less_used=False`` takes a cgroup's limit whole: what it uses counts its
    page cache, which the kernel gives back, so only ``MemAvailable`` can say
    how much of that is free.
    """
    found: list[tuple[int, str]] = []
    try:
        for line in meminfo.read_text().splitlines():
            name, _, value = line.partition(":")
            if name == "MemAvailable":
                found.append((int(value.split()[0]) * 1024, f"MemAvailable in {meminfo}"))
                break
    except (OSError, ValueError, IndexError):
        pass
    if not found:
        try:
            pages = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
            found.append((pages, "free physical pages (sysconf)"))
        except (ValueError, OSError, AttributeError):
            pass
    for limit_file, used_file in _cgroup_files(cgroup, own):
        try:
            limit = limit_file.read_text().strip()
            if limit != "max":  # v1 says "no limit" with a number near 2**63
                used = int(used_file.read_text()) if less_used else 0
                found.append((max(0, int(limit) - used), f"the cgroup limit in {limit_file}"))
        except (OSError, ValueError):
            pass
    return min(found) if found else None


def _cgroup_files(cgroup: Path, own: Path) -> list[tuple[Path, Path]]:
    """(limit, usage) file pairs that may bound this process: v2's and v1's,
    at the mount's root and in the process's own group, those that exist."""
    roots = [
        (cgroup, "memory.max", "memory.current"),  # v2
        (cgroup / "memory", "memory.limit_in_bytes", "memory.usage_in_bytes"),  # v1
    ]
    groups: list[Path] = []
    try:
        for line in own.read_text().splitlines():
            _, controllers, path = line.split(":", 2)
            if controllers == "":  # v2: "0::/path"
                groups.append(cgroup / path.lstrip("/"))
            elif "memory" in controllers.split(","):
                groups.append(cgroup / "memory" / path.lstrip("/"))
    except (OSError, ValueError):
        pass
    pairs = []
    for folder, limit, usage in roots:
        for place in dict.fromkeys([folder, *(g for g in groups if g.is_relative_to(folder))]):
            if (place / limit).exists():
                pairs.append((place / limit, place / usage))
    return pairs
