"""Mounts the worker makes on the host (trajectory layers), and their removal (direct syscalls)."""

from __future__ import annotations

import ctypes
import os

from tangram_celery.common.errors import SandboxError

MNT_DETACH = 2


def mount(src: str, target: str, fstype: str, data: str) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    rc = libc.mount(src.encode(), target.encode(), fstype.encode(), 2 | 4, data.encode())  # nosuid nodev
    if rc != 0:
        err = ctypes.get_errno()
        raise SandboxError(f"cannot mount {fstype} at {target}: {os.strerror(err)}")


def unmount(target: str | os.PathLike[str]) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.umount2(os.fsencode(target), MNT_DETACH)


def unmount_under(top: str | os.PathLike[str]) -> int:
    """Detach every mount at or below `top` (deepest first) so that it can be removed; how many."""
    prefix = os.path.realpath(top)
    found = []
    try:
        with open("/proc/self/mountinfo") as f:
            for line in f:
                point = line.split()[4].encode().decode("unicode_escape")
                if point == prefix or point.startswith(prefix + "/"):
                    found.append(point)
    except OSError:
        return 0
    for point in sorted(found, key=len, reverse=True):
        unmount(point)
    return len(found)
