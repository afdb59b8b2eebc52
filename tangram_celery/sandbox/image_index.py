"""The image store's bookkeeping files (`refs.json`, `state.json`) and whose process is alive.

Holds and unpacks in progress are kept per process (`pid.starttime`), so a process that dies
releases what it held: the next reader drops the entries of processes that are gone.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


def proc_token(pid: int) -> str | None:
    """`pid.starttime`: names a process, not a reused pid."""
    try:
        stat_line = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return f"{pid}.{stat_line.rpartition(')')[2].split()[19]}"


def alive(token: str) -> bool:
    pid, _, _ = token.partition(".")
    return pid.isdigit() and proc_token(int(pid)) == token


def write_json(path: Path, obj: Any) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}")
    tmp.write_text(json.dumps(obj, indent=1, sort_keys=True))
    os.replace(tmp, path)


def write_in_place(path: Path, obj: Any) -> None:
    """Overwrite a small JSON file read only under the store's lock with one write (a rename
    costs ms on some file systems; a write() is whole or not at all when its process dies),
    padded with spaces to the old length."""
    data = json.dumps(obj, sort_keys=True).encode()
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        old = os.fstat(fd).st_size
        if old > 4 * len(data) + 4096:  # shrink now and then
            os.close(fd)
            fd = -1
            write_json(path, obj)
            return
        os.pwrite(fd, data + b" " * (old - len(data)), 0)
    finally:
        if fd >= 0:
            os.close(fd)


def read_json(path: Path, default: Any) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return default


def read_metas(images: Path) -> dict[str, dict[str, Any]]:
    """Every image's meta.json: hex of its digest -> meta. A directory without one was never
    renamed in (meta.json is written first): it is not the store's, and goes."""
    out = {}
    for d in images.iterdir():
        meta = read_json(d / "meta.json", None)
        if meta is None:
            shutil.rmtree(d, ignore_errors=True)
            continue
        out[d.name] = meta
    return out


@dataclass
class StoreIndex:
    """refs.json and state.json, as read under the store lock (dead processes' entries dropped)."""

    refs: dict[str, str]
    holds: dict[str, dict[str, int]]  # process token -> digest -> count
    fetching: dict[str, dict[str, int]]  # process token -> unpack in progress -> bytes
    layers: int  # bytes reserved for trajectory layers, node-wide (they outlive a process)
    used: dict[str, float] = field(default_factory=dict)  # digest -> last acquire or release, epoch s
    gen: int = 0  # moves on whenever a meta.json changes
    dirty: bool = False
    metas: dict[str, dict[str, Any]] = field(default_factory=dict)  # hex -> meta.json

    def held_digests(self) -> set[str]:
        return {d for per in self.holds.values() for d, n in per.items() if n > 0}

    def reserved_bytes(self) -> int:
        return self.layers + sum(n for per in self.fetching.values() for n in per.values())

    def state(self) -> dict[str, Any]:
        return {
            "holds": self.holds,
            "fetching": self.fetching,
            "layers": self.layers,
            "used": self.used,
            "gen": self.gen,
        }

    def last_used(self, meta: dict[str, Any]) -> float:
        return self.used.get(meta["digest"], meta["last_used"])
