"""A sandbox whose root is a container image: the pieces both backends share.

- **The harness's interpreter.** The runner is the host's python3, whatever the image holds (an
  image may have another Python, or none). The host's /usr, /lib and /lib64 are mounted
  read-only under `HOST_DIR`, and the runner starts through the host's own dynamic loader with
  the host's library directories (`host_python_argv`): the image's loader and libc are never
  used for it. User programs are the image's own (`tools_in`): a python program and a test
  command's pytest run on the image's Python (`RunRequest.interpreter`).
- **The trajectory's layer** (namespace backend, `Layer`): a size- and inode-limited tmpfs on
  the host holding overlayfs' upper and work directories. The image's root file system is the
  read-only lower directory, shared by every trajectory of the image on the node (one copy on
  disk and in the page cache); what the trajectory writes lands in its layer, charged to its
  sandbox's memory while it runs, within `sandbox.disk_quota_mb`. Evicting the trajectory
  spills the layer to the node's image store as one tar (`spill`), the next action loads it
  back (`load`): its files survive, its processes do not. A fork loads one spill into several
  layers: its cost is the layer's, not the image's.
"""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

from tangram_celery.common.errors import SandboxError
from tangram_celery.sandbox.image_paths import resolve_in
from tangram_celery.sandbox.languages import TOOLS
from tangram_celery.sandbox.limits import HOST_RO_PATHS, SANDBOX_PYTHON
from tangram_celery.sandbox.mounts import mount, unmount

HOST_DIR = "/opt/tangram/host"  # the host's /usr, /lib, /lib64 in an image sandbox, read-only
WORKDIR_DEFAULT = "/work"  # an image without a WORKDIR
SEARCH_DEFAULT = "/usr/local/bin:/usr/bin:/bin"
_PT_INTERP = 3


def elf_interpreter(path: str) -> str:
    """The program interpreter (dynamic loader) an ELF executable names (PT_INTERP)."""
    with open(path, "rb") as f:
        head = f.read(64)
        if head[:4] != b"\x7fELF" or head[4] != 2:
            raise SandboxError(f"{path} is not a 64-bit ELF executable")
        end = "<" if head[5] == 1 else ">"
        phoff, phentsize, phnum = (
            struct.unpack(end + "Q", head[32:40])[0],
            *struct.unpack(end + "HH", head[54:58]),
        )
        for i in range(phnum):
            f.seek(phoff + i * phentsize)
            p_type, _flags, p_offset, _va, _pa, p_filesz = struct.unpack(end + "IIQQQQ", f.read(40))
            if p_type == _PT_INTERP:
                f.seek(p_offset)
                return f.read(p_filesz).rstrip(b"\0").decode()
    raise SandboxError(f"{path} names no program interpreter (static?)")


@functools.cache
def host_python_argv() -> tuple[str, ...]:
    """The command that runs the host's python3 inside an image sandbox: its loader and its
    library directories, all under `HOST_DIR`."""
    python = os.path.realpath(SANDBOX_PYTHON)
    loader = os.path.realpath(elf_interpreter(python))  # a real path: no link need be mounted
    arch = getattr(sys.implementation, "_multiarch", "")
    dirs = [d for d in (f"/usr/lib/{arch}", f"/lib/{arch}", "/usr/lib64", "/usr/lib") if os.path.isdir(d)]
    libs = ":".join(dict.fromkeys(HOST_DIR + os.path.realpath(d) for d in dirs))
    return (HOST_DIR + loader, "--library-path", libs, HOST_DIR + python)


def host_mounts() -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """(symlinks as (target, path), read-only binds as (host source, sandbox path)) that put
    the host's system directories under `HOST_DIR` (a usr-merged host's /lib is a link)."""
    links, binds = [], []
    for p in HOST_RO_PATHS:
        if os.path.islink(p):
            links.append((os.readlink(p), HOST_DIR + p))
        elif os.path.isdir(p):
            binds.append((p, HOST_DIR + p))
    return links, binds


def search_path(env: dict[str, str]) -> str:
    """Where an image's commands are looked up: its ENV PATH (a venv's or conda's bin first),
    then the standard directories."""
    given = [d for d in env.get("PATH", "").split(":") if d.startswith("/")]
    return ":".join(dict.fromkeys([*given, *SEARCH_DEFAULT.split(":")]))


def tools_in(rootfs: Path, language: str, search: str = "") -> dict[str, str]:
    """The tools of `language` as the image has them (real paths inside it, looked up on
    `search`, `search_path`); a missing one is left out (the runner then says which)."""
    out = {}
    for tool, cmd in TOOLS[language].items():
        name = "python3" if cmd == SANDBOX_PYTHON else os.path.basename(cmd)
        found = resolve_in(rootfs, name, search or SEARCH_DEFAULT)
        if found is not None:
            out[tool] = found
    return out


def interpreter_in(rootfs: Path, search: str = "") -> str | None:
    """The image's Python (python3, else python) as the image's PATH finds it: the path of
    the name, not of what its links lead to, since a venv's python is a link and knows its venv
    by where it was started from."""
    for name in ("python3", "python"):
        for d in (search or SEARCH_DEFAULT).split(":"):
            if resolve_in(rootfs, f"{d}/{name}") is not None:
                return f"{d}/{name}"
    return None


class Layer:
    """One trajectory's copy-on-write layer: a tmpfs on the host at `path` with `upper` and
    `work` for overlayfs (see the module doc). `fresh`: nothing was loaded into it."""

    def __init__(self, path: Path, size_mb: int, inodes: int) -> None:
        self.path = path
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        mount("tangram-layer", str(path), "tmpfs", f"mode=700,size={size_mb}m,nr_inodes={inodes}")
        self.upper, self.work = path / "upper", path / "work"
        for d in (self.upper, self.work):
            d.mkdir(mode=0o755)
        self.fresh = True

    def used_bytes(self) -> int:
        st = os.statvfs(self.path)
        return (st.f_blocks - st.f_bfree) * st.f_frsize

    def spill(self, dest: Path) -> int:
        """Write the upper directory (whiteouts, xattrs and owners included) to the tar `dest`;
        its size in bytes."""
        tmp = dest.with_name(dest.name + ".part")
        _tar(["-cf", str(tmp), "-C", str(self.upper), "."])
        tmp.rename(dest)
        return dest.stat().st_size

    def load(self, src: Path) -> None:
        """Fill the (empty) upper directory from a spill."""
        _tar(["-xf", str(src), "-C", str(self.upper)])
        self.fresh = False

    def close(self) -> None:
        unmount(self.path)
        shutil.rmtree(self.path, ignore_errors=True)


def _tar(args: list[str]) -> None:
    tar = shutil.which("tar", path="/usr/bin:/bin")
    if tar is None:
        raise SandboxError("GNU tar is needed to keep trajectory layers: apt-get install tar")
    cmd = [tar, "--xattrs", "--xattrs-include=*", "--acls", "--numeric-owner", "--same-permissions", *args]
    done = subprocess.run(cmd, capture_output=True, timeout=600, check=False)
    if done.returncode != 0:
        raise SandboxError(f"tar {' '.join(args[:2])} failed: {done.stderr.decode(errors='replace')[-500:]}")


def spill_name(trajectory_id: str) -> str:
    """The file a trajectory's spilled layer is kept in (a hash: any id, one name)."""
    return hashlib.sha256(trajectory_id.encode()).hexdigest()[:40] + ".tar"
