"""Paths inside an image's root filesystem, resolved on the host without leaving it."""

from __future__ import annotations

import os
import stat
from pathlib import Path


def resolve_in(rootfs: Path, command: str, search_path: str = "/usr/local/bin:/usr/bin:/bin") -> str | None:
    """The absolute path, as seen inside the image, of the executable file `command` (a name
    looked up on `search_path`, or an absolute path), symlinks followed within `rootfs`; None if
    there is none."""
    if command.startswith("/"):
        candidates = [command]
    elif "/" in command or not command:
        return None
    else:
        candidates = [f"{d.rstrip('/')}/{command}" for d in search_path.split(":") if d.startswith("/")]
    for cand in candidates:
        real = _confined(rootfs, cand)
        if real is None:
            continue
        try:
            st = os.lstat(rootfs / real.lstrip("/"))
        except OSError:
            continue
        if stat.S_ISREG(st.st_mode) and st.st_mode & 0o111:
            return real
    return None


def _confined(rootfs: Path, path: str, max_links: int = 40) -> str | None:
    """`path` resolved as if `rootfs` were `/` (an absolute link restarts at rootfs, `..` stops
    there); None when a part is missing or the links loop."""
    todo = [p for p in path.split("/") if p]
    done: list[str] = []
    links = 0
    while todo:
        part = todo.pop(0)
        if part == ".":
            continue
        if part == "..":
            if done:
                done.pop()
            continue
        host = rootfs.joinpath(*done, part)
        try:
            st = os.lstat(host)
        except OSError:
            return None
        if stat.S_ISLNK(st.st_mode):
            links += 1
            if links > max_links:
                return None
            target = os.readlink(host)
            if target.startswith("/"):
                done = []
            todo = [p for p in target.split("/") if p] + todo
        else:
            done.append(part)
    return "/" + "/".join(done)
