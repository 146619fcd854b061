"""Which filesystem a path is on, and which filesystems several hosts may
mount: the shared ``max_bytes`` bound spans the processes of one host only."""

from __future__ import annotations

import os

#: Filesystems that may be mounted by several hosts, where SQLite's WAL (and
#: so the shared bound) cannot span the processes of different hosts.
NETWORK_FILESYSTEMS = frozenset(
    {"nfs", "nfs4", "cifs", "smb3", "smbfs", "ceph", "glusterfs", "lustre", "gpfs", "9p"}
)


def filesystem_type(path: str) -> str | None:
    """The type of the filesystem ``path`` is on (Linux), or ``None``."""
    target = os.path.realpath(path)
    best, fstype = "", None
    try:
        with open("/proc/self/mountinfo") as mounts:
            for line in mounts:
                # id parent major:minor root mountpoint options [optional...] - type source
                fields = line.split()
                mountpoint = fields[4].replace("\\040", " ")
                inside = target == mountpoint or target.startswith(mountpoint.rstrip("/") + "/")
                if inside and len(mountpoint) >= len(best):
                    best, fstype = mountpoint, fields[fields.index("-") + 1]
    except (OSError, ValueError, IndexError):
        return None
    return fstype
