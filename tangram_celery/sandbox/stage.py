"""The host side of sandboxes: a neutral, root-only directory per deployment, node and worker.

Everything a sandbox binds from the host comes from here, not from the checkout or a temp dir,
so that `/proc/self/mountinfo` inside a sandbox names no host path worth knowing:

    <stage_dir>/                       (default /run/tangram-sandbox, root, 0711)
      <scope>/                         one deployment's node (hash of state dir + node), 0700
        <incarnation>.lock             held (flock) while that worker process lives
        <incarnation>/                 0700
          runner/   boot/   site/      copies of the runner, the launcher, pytest (read-only binds)
          root/                        mount point of the built-in launcher's new root
          s/<sandbox>/                 a sandbox's runner socket dir (bound at /run/tangram)
          logs/<sandbox>.log           launcher / bwrap output, never inside a bound directory

The scope is what a restarted worker sweeps: sandboxes (cgroups, containers) and directories
of the *same* deployment and node whose incarnation's lock is no longer held. Other deployments
on the machine have other scopes and are never touched.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import shutil
import stat
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import tangram_runner
from tangram_celery.common.errors import SandboxError
from tangram_celery.sandbox.mounts import unmount_under
from tangram_celery.sandbox.tools import copy_tools

log = logging.getLogger(__name__)

DEFAULT_STAGE_DIR = "/run/tangram-sandbox"
PACKAGE_DIR = Path(__file__).resolve().parent
RUNNER_SRC_DIR = Path(tangram_runner.__file__).resolve().parent  # copied into runner/tangram_runner
BOOT_FILES = (PACKAGE_DIR / "launcher.py", PACKAGE_DIR.parent / "common" / "lifeline.py")
SCOPE_LEN = 16


def scope_of(state_dir: str | os.PathLike[str], node: str) -> str:
    """The deployment-and-node id: same state dir and node name -> same scope, across restarts."""
    key = f"{os.path.realpath(state_dir)}\0{node}"
    return hashlib.sha256(key.encode()).hexdigest()[:SCOPE_LEN]


def private_scope() -> str:
    """A scope nobody else uses (tests, tools, preflight checks): nothing to sweep."""
    return uuid.uuid4().hex[:SCOPE_LEN]


@dataclass(frozen=True)
class SandboxScope:
    """Who owns a worker's sandboxes: `scope` (deployment + node) and this `incarnation`."""

    scope: str = field(default_factory=private_scope)
    incarnation: str = field(default_factory=lambda: uuid.uuid4().hex[:10])

    @classmethod
    def of_node(cls, state_dir: str | os.PathLike[str], node: str) -> SandboxScope:
        return cls(scope_of(state_dir, node))

    @property
    def prefix(self) -> str:
        """Prefix of this incarnation's cgroup and container names."""
        return f"{self.scope}-{self.incarnation}-"


def _secure_dir(path: Path, mode: int) -> None:
    """Create `path` (root-owned, `mode`) or check that an existing one is ours and not writable
    by anyone else: a directory someone else controls could feed code into every sandbox."""
    try:
        path.mkdir(mode=mode)
    except FileExistsError:
        pass
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o022:
        raise SandboxError(
            f"{path} must be a directory owned by uid {os.geteuid()} and writable by no one else; "
            "remove it or set sandbox.stage_dir elsewhere"
        )
    os.chmod(path, mode)


def _copy_tree(src: Path, dest: Path) -> None:
    """Copy regular files (no caches), directories 0755 and files 0644, never following links."""
    dest.mkdir(mode=0o755)
    for entry in sorted(src.iterdir()):
        if entry.name == "__pycache__" or entry.is_symlink():
            continue
        if entry.is_dir():
            _copy_tree(entry, dest / entry.name)
        elif entry.is_file():
            shutil.copyfile(entry, dest / entry.name, follow_symlinks=False)
            os.chmod(dest / entry.name, 0o644)


def reset_private_dir(path: Path) -> None:
    """Empty `path` and make it owner-only again before a sandbox (re)starts on it: an earlier
    sandbox on the same directory may have changed its owner, mode or contents. `path` itself
    sits in a root-only directory of ours, so it cannot have been swapped for a link."""
    for entry in os.scandir(path):
        if entry.is_dir(follow_symlinks=False):
            shutil.rmtree(entry.path, ignore_errors=True)
        else:
            os.unlink(entry.path)
    os.chown(path, os.geteuid(), os.getegid())
    os.chmod(path, 0o700)


class Stage:
    """One worker incarnation's directory tree (see the module docstring)."""

    def __init__(self, base: str | os.PathLike[str], who: SandboxScope) -> None:
        self.who = who
        self.base = Path(base)
        self.scope_dir = self.base / who.scope
        self.dir = self.scope_dir / who.incarnation
        self.base.mkdir(parents=True, exist_ok=True)
        _secure_dir(self.base, 0o711)
        _secure_dir(self.scope_dir, 0o700)
        # locked under a hidden name first, so that no sweep ever sees it unlocked
        tmp_lock = self.scope_dir / f".{who.incarnation}.lock"
        self._lock_fd = os.open(
            tmp_lock, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600
        )
        fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        tmp_lock.rename(self.scope_dir / f"{who.incarnation}.lock")
        _secure_dir(self.dir, 0o700)
        self.runner = self.dir / "runner"
        self.boot = self.dir / "boot"
        self.site = self.dir / "site"
        self.root = self.dir / "root"
        self.sandboxes = self.dir / "s"
        self.logs = self.dir / "logs"
        for d in (self.sandboxes, self.logs, self.root):
            d.mkdir(mode=0o700, exist_ok=True)
        if not self.runner.exists():
            self.runner.mkdir(mode=0o755)
            _copy_tree(RUNNER_SRC_DIR, self.runner / RUNNER_SRC_DIR.name)
        if not self.boot.exists():
            self.boot.mkdir(mode=0o755)
            for f in BOOT_FILES:
                shutil.copyfile(f, self.boot / f.name)
                os.chmod(self.boot / f.name, 0o644)

    @property
    def launcher(self) -> Path:
        return self.boot / "launcher.py"

    def stage_tools(self) -> Path | None:
        """The test tools (pytest ...) for sandboxes, copied in once; None when unavailable."""
        if not self.site.exists() and not copy_tools(self.site):
            return None
        return self.site

    def log_path(self, name: str) -> Path:
        return self.logs / f"{name}.log"

    # -- previous incarnations --------------------------------------------------------------
    def alive(self, incarnation: str) -> bool:
        """Is the worker process of `incarnation` (same scope) still running (holds its lock)?"""
        if incarnation == self.who.incarnation:
            return True
        try:
            fd = os.open(self.scope_dir / f"{incarnation}.lock", os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        finally:
            os.close(fd)
        return False

    def stale_incarnations(self) -> list[str]:
        """Incarnations of this scope whose worker is gone (their directories are left)."""
        out = []
        for p in self.scope_dir.iterdir():
            if p.name.startswith("."):
                continue  # an incarnation still taking its lock
            inc = p.name.removesuffix(".lock")
            if inc not in out and inc != self.who.incarnation and not self.alive(inc):
                out.append(inc)
        return sorted(out)

    def remove_incarnation(self, incarnation: str) -> None:
        """Remove a dead incarnation's directories (after its sandboxes are gone)."""
        unmount_under(self.scope_dir / incarnation)  # its trajectories' layers (tmpfs)
        shutil.rmtree(self.scope_dir / incarnation, ignore_errors=True)
        (self.scope_dir / f"{incarnation}.lock").unlink(missing_ok=True)

    def close(self) -> None:
        """Remove this incarnation's tree and release its lock (idempotent)."""
        if self._lock_fd < 0:
            return
        unmount_under(self.dir)
        shutil.rmtree(self.dir, ignore_errors=True)
        (self.scope_dir / f"{self.who.incarnation}.lock").unlink(missing_ok=True)
        os.close(self._lock_fd)
        self._lock_fd = -1
        try:
            self.scope_dir.rmdir()  # last one out
        except OSError:
            pass
