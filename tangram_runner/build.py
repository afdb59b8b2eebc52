"""Build directories of compiled languages, and the trajectory's cache of them (stdlib only).

A compile writes into a fresh directory in /tmp, made by the runner and lent to the sandbox user
for the compile phase only. Once the compiler has exited (no user process is alive then: user
code never runs at compile time, see `langs`), the runner takes the directory back:
owned by root, nothing in it writable by anyone else. The run phase executes from there, so
nothing user code does can change the binary that is judged.

The cache (per runner, so per trajectory sandbox) maps a key to such a directory. The key covers
everything a compile can read that user code can change: the language, the compile command
(flags and toolchain paths), and the contents of /work and /tmp (a program may include or import
any file an earlier action left there). When those trees are too large to hash cheaply, the
action is compiled without the cache. A cached directory is used only if it is still what the
runner left (a root-owned directory, not a link); anything else is a miss.
"""

from __future__ import annotations

import hashlib
import os
import stat
from collections import OrderedDict
from typing import Any

MAX_HASHED_BYTES = 16 << 20  # /work + /tmp above this: compile without the cache
MAX_ENTRIES = 4  # builds kept per trajectory (each counts against the /tmp quota)
PREFIX = ".tangram-build-"

_cache: OrderedDict[str, str] = OrderedDict()  # key -> build directory, least recently used first
_made: list[str] = []  # directories made during the current action
_held: dict[str, str] = {}  # action -> its build, kept from its compile request to its run request


def new_dir(uid: int) -> str:
    """A fresh build directory the sandbox user may write for the compile phase."""
    import tempfile  # here, not at the top: see zygote.PRELOAD

    path = tempfile.mkdtemp(prefix=PREFIX, dir="/tmp")
    _made.append(path)
    os.chown(path, uid, uid)
    return path


def seal(path: str, scratch: list[str]) -> None:
    """Take `path` back from the sandbox user after its compile: scratch removed, every entry
    owned by root and writable by root only. Links are removed, never followed."""
    for name in scratch:
        remove(os.path.join(path, name))
    for top, dirs, files in os.walk(path, topdown=True, followlinks=False):
        for name in files + dirs:
            p = os.path.join(top, name)
            st = os.lstat(p)
            if stat.S_ISLNK(st.st_mode) or not (stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode)):
                os.unlink(p)
                continue
            os.chown(p, 0, 0, follow_symlinks=False)
            os.chmod(p, stat.S_IMODE(st.st_mode) & 0o755)
    os.chown(path, 0, 0, follow_symlinks=False)
    os.chmod(path, 0o755)


def remove(path: str) -> None:
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if stat.S_ISDIR(st.st_mode):
        import shutil  # here, not at the top: see zygote.PRELOAD

        shutil.rmtree(path, ignore_errors=True)  # fd-based on Linux: never follows links
    else:
        os.unlink(path)


def key(lang: str, argv: list[str], env: dict[str, str], tops: tuple[str, ...]) -> str | None:
    """The cache key of a compile (`argv` and `env` with a placeholder for the build directory),
    or None when the trees it could read are too large to hash."""
    h = hashlib.sha256()
    h.update(repr((lang, argv, sorted(env.items()))).encode("utf-8", "surrogatepass"))
    budget = [MAX_HASHED_BYTES]
    skip = set(_cache.values())
    for top in tops:
        if not _digest_tree(h, top, skip, budget):
            return None
    return h.hexdigest()


def _digest_tree(h: Any, top: str, skip: set[str], budget: list[int]) -> bool:
    for root, dirs, files in os.walk(top, topdown=True, followlinks=False):
        dirs[:] = sorted(d for d in dirs if os.path.join(root, d) not in skip)
        for name in sorted(files) + [d for d in dirs if os.path.islink(os.path.join(root, d))]:
            p = os.path.join(root, name)
            try:
                st = os.lstat(p)
                h.update(f"{p}\0{st.st_mode:o}\0{st.st_size}\0".encode("utf-8", "surrogateescape"))
                if stat.S_ISLNK(st.st_mode):
                    h.update(os.readlink(p).encode("utf-8", "surrogateescape"))
                elif stat.S_ISREG(st.st_mode):
                    budget[0] -= st.st_size
                    if budget[0] < 0:
                        return False
                    fd = os.open(p, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
                    try:
                        while chunk := os.read(fd, 1 << 20):
                            h.update(chunk)
                    finally:
                        os.close(fd)
            except OSError:
                return False  # something odd (a FIFO raced, a file vanished): no caching
    return True


def lookup(k: str | None) -> str | None:
    """The sealed build directory cached under `k`, if it is still intact."""
    if k is None or k not in _cache:
        return None
    path = _cache[k]
    try:
        st = os.lstat(path)
    except OSError:
        st = None
    if st is None or not stat.S_ISDIR(st.st_mode) or st.st_uid != 0 or st.st_mode & 0o022:
        del _cache[k]
        return None
    _cache.move_to_end(k)
    return path


def store(k: str | None, path: str) -> None:
    """Keep sealed `path` under `k` (without a key, it is dropped after the action: `drop`)."""
    if k is None:
        return
    _cache[k] = path
    _cache.move_to_end(k)
    while len(_cache) > MAX_ENTRIES:
        _, old = _cache.popitem(last=False)
        remove(old)


def hold(action: str, path: str) -> None:
    """Keep sealed `path` past this request: the run phase of `action` comes as a request of its
    own (the host changed the sandbox's memory limit in between). One action at a time holds a
    build; one held before (its run request never came) is dropped."""
    dropped = [p for p in _held.values() if p != path]
    _held.clear()
    _held[action] = path
    _made.extend(dropped)  # removed at the end of this request unless cached


def take_held(action: str) -> str | None:
    """The build `action`'s compile request held (then removed after this request, unless
    cached), or None."""
    path = _held.pop(action, None)
    if path is not None:
        _made.append(path)
    return path


def end_action() -> None:
    """Remove the build directories of the action that ended and were not cached or held
    (failed compiles, or no key). Called once its processes are all gone."""
    kept = set(_cache.values()) | set(_held.values())
    for path in _made:
        if path not in kept:
            remove(path)
    _made.clear()
