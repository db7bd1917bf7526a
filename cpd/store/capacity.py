"""Default capacity of a ``file://`` L3 store, sized from the machine (issue 7 §8).

The embedded default store lives under ``/dev/shm`` — RAM. Without a limit it grows by about
45 KB per unique prompt token and is never evicted, so a store opened without an explicit
``capacity_bytes`` (URL query or ``--l3-capacity-bytes``) gets this default:

    capacity = clamp(FS_FRACTION * (free bytes of the store's filesystem + bytes the store
                     already holds),  FLOOR_BYTES, CAP_BYTES)
    and, when that filesystem is RAM-backed (tmpfs/ramfs), at most RAM_FRACTION * MemTotal.

Counting what the store already holds makes the figure the same for every process that
opens the store, whenever it opens it (free space shrinks as the store fills). The figures
are module constants so a test can shrink them; ``capacity_bytes=0`` means "no limit" and is
only ever an explicit choice.
"""
from __future__ import annotations

import os

FS_FRACTION = 0.5
RAM_FRACTION = 0.25
FLOOR_BYTES = 64 << 20
CAP_BYTES = 64 << 30
RAM_FS_TYPES = frozenset({"tmpfs", "ramfs"})


def default_capacity_bytes(fs_free_bytes: int, store_bytes: int, mem_total_bytes: int, ram_backed: bool,
                           *, fs_fraction: float | None = None, ram_fraction: float | None = None,
                           floor_bytes: int | None = None, cap_bytes: int | None = None) -> int:
    """The default capacity for a store on a filesystem with ``fs_free_bytes`` free that
    already holds ``store_bytes`` (pure; see the module docstring). Keyword arguments
    override the module constants."""
    fs_fraction = FS_FRACTION if fs_fraction is None else fs_fraction
    ram_fraction = RAM_FRACTION if ram_fraction is None else ram_fraction
    floor_bytes = FLOOR_BYTES if floor_bytes is None else floor_bytes
    cap_bytes = CAP_BYTES if cap_bytes is None else cap_bytes
    budget = fs_fraction * (max(0, fs_free_bytes) + max(0, store_bytes))
    if ram_backed and mem_total_bytes > 0:
        budget = min(budget, ram_fraction * mem_total_bytes)
    return int(min(max(budget, floor_bytes), cap_bytes))


def fs_type(path: str) -> str:
    """Filesystem type of the mount holding ``path`` (from ``/proc/mounts``; "" if unknown)."""
    path = os.path.realpath(path)
    best, typ = "", ""
    try:
        with open("/proc/mounts") as f:
            for line in f:
                parts = line.split()
                if len(parts) < 3:
                    continue
                mnt = parts[1].replace("\\040", " ")
                if (path == mnt or path.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best):
                    best, typ = mnt, parts[2]
    except OSError:
        return ""
    return typ


def mem_total_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


def dir_bytes(root: str) -> int:
    """Bytes of the regular files directly in ``root`` (the store's chunks and staging)."""
    total = 0
    try:
        with os.scandir(root) as it:
            for e in it:
                try:
                    if e.is_file(follow_symlinks=False):
                        total += e.stat(follow_symlinks=False).st_size
                except FileNotFoundError:
                    continue
    except OSError:
        return 0
    return total


def machine_default_capacity_bytes(root: str) -> int:
    """:func:`default_capacity_bytes` for a store directory ``root`` on this machine."""
    try:
        st = os.statvfs(root)
        free = st.f_bavail * st.f_frsize
    except OSError:
        free = 0
    return default_capacity_bytes(free, dir_bytes(root), mem_total_bytes(), fs_type(root) in RAM_FS_TYPES)
