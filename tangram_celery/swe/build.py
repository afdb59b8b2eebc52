"""The SWE task images, built here with no registry, and cached by their inputs.

1. The base: a Debian root filesystem tar made by `mmdebstrap --variant=minbase` with
   python3 and python3-pytest (about 30 s and 200 MB), cached under the key of its recipe.
2. Each task's sdist, downloaded by pip from PyPI and checked against its pinned sha256.
3. Each task's repository: the sdist unpacked with the task's bug applied, as a layer tar whose
   members live under `repo/` (world-writable: the sandbox's user may be anyone, and every
   trajectory writes to its own copy-on-write layer anyway). Deterministic: same inputs, same
   digest.
4. The images: an OCI image layout (base layer + repository layer, working directory /repo) that
   the namespace backend's image store reads, and, when an engine is given, Docker images made
   by `docker import` of the base and a three-line Dockerfile (docker_images.py).

Everything lives under `cache_dir()`: `$TANGRAM_CACHE/swe`, else `~/.cache/tangram/swe`. A
build takes a file lock there, so that a test run and a demo never build the same file at once.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from tangram_celery.common.errors import TangramError
from tangram_celery.common.pretend import pretend_missing
from tangram_celery.sandbox.oci import REF_NAME, ImageSpec, normalize_ref, write_layout
from tangram_celery.swe.docker_images import DockerTask, docker_build
from tangram_celery.swe.tasks import SweTask

Log = Callable[[str], None]

RECIPE_VERSION = 1  # bump when the way an image is made changes: every cached artifact is rebuilt
SUITE = "bookworm"
PACKAGES = ("python3", "python3-pytest")
# no device nodes in the layer (every runtime mounts its own /dev); no docs, man pages or locales
MMDEBSTRAP_OPTIONS = (
    "--variant=minbase",
    "--format=tar",
    "--skip=output/dev",
    "--dpkgopt=path-exclude=/usr/share/doc/*",
    "--dpkgopt=path-exclude=/usr/share/man/*",
    "--dpkgopt=path-exclude=/usr/share/locale/*",
    "--dpkgopt=path-exclude=/usr/share/info/*",
)
PATH_ENV = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
SPEC = ImageSpec(env={"PATH": PATH_ENV, "LANG": "C.UTF-8"}, workdir="/repo")
REPO_MTIME = 1_700_000_000  # every member of a repository layer: the same inputs give the same digest
KEYS_FILE = "tangram-swe-keys.json"  # in a layout: ref -> the key of the recipe it was built from


class SweBuildError(TangramError):
    """A SWE image could not be built; the message says which step and how to fix it."""


def cache_dir() -> Path:
    root = os.environ.get("TANGRAM_CACHE")
    return (Path(root) if root else Path.home() / ".cache" / "tangram") / "swe"


def _key(*parts: object) -> str:
    return hashlib.sha256(json.dumps([RECIPE_VERSION, *parts], sort_keys=True).encode()).hexdigest()[:16]


def _say(log: Log, msg: str) -> None:
    log(f"swe: {msg}")


@contextlib.contextmanager
def _locked(cache: Path) -> Iterator[None]:
    cache.mkdir(parents=True, exist_ok=True)
    with open(cache / ".lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def base_key(mirror: str | None = None) -> str:
    return _key("base", SUITE, PACKAGES, MMDEBSTRAP_OPTIONS, mirror or "")


def mmdebstrap_argv(out: Path, mirror: str | None = None) -> list[str]:
    exe = shutil.which("mmdebstrap")
    if exe is None or pretend_missing("mmdebstrap"):
        raise SweBuildError("mmdebstrap is not installed: apt-get install mmdebstrap")
    argv = [exe, "--quiet", *MMDEBSTRAP_OPTIONS, f"--include={','.join(PACKAGES)}", SUITE, str(out)]
    return argv + ([mirror] if mirror else [])


def base_rootfs(cache: Path, log: Log = print, mirror: str | None = None) -> Path:
    """The base root filesystem tar (built with mmdebstrap when not cached)."""
    out = cache / f"base-{SUITE}-{base_key(mirror)}.tar"
    if out.exists():
        return out
    tmp = out.with_name(f".{out.name}.{os.getpid()}")
    argv = mmdebstrap_argv(tmp, mirror)
    _say(log, f"base rootfs: mmdebstrap {SUITE} with {', '.join(PACKAGES)} (about 30 s) ...")
    t0 = time.monotonic()
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=1800, check=False)
        if proc.returncode != 0:
            tail = (proc.stderr or proc.stdout)[-1500:]
            raise SweBuildError(
                f"mmdebstrap failed (exit {proc.returncode}; is deb.debian.org reachable?):\n{tail}"
            )
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    _say(log, f"base rootfs: {out.stat().st_size >> 20} MiB in {time.monotonic() - t0:.1f} s ({out})")
    return out


def sdist(t: SweTask, cache: Path, log: Log = print) -> Path:
    """The task's sdist (downloaded by pip when not cached), checked against its sha256."""
    d = cache / "sdists"
    found = [p for p in d.glob("*.tar.gz") if _sha256(p) == t.sdist_sha256] if d.exists() else []
    if found:
        return found[0]
    d.mkdir(parents=True, exist_ok=True)
    _say(log, f"sdist: pip download {t.project}=={t.version} ...")
    with tempfile.TemporaryDirectory(dir=d) as tmp:
        argv = [sys.executable, "-m", "pip", "download", "-q", "--no-binary", ":all:", "--no-deps"]
        proc = subprocess.run(
            [*argv, "-d", tmp, f"{t.project}=={t.version}"],
            capture_output=True,
            text=True,
            timeout=600,
            check=False,
        )
        got = list(Path(tmp).glob("*.tar.gz"))
        if proc.returncode != 0 or len(got) != 1:
            raise SweBuildError(
                f"pip download {t.project}=={t.version} failed (is PyPI reachable?): {proc.stderr[-1000:]}"
            )
        if _sha256(got[0]) != t.sdist_sha256:
            raise SweBuildError(f"{got[0].name}: sha256 {_sha256(got[0])} is not the pinned {t.sdist_sha256}")
        out = d / got[0].name
        os.replace(got[0], out)
    return out


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def _sdist_members(path: Path) -> Iterator[tuple[tarfile.TarInfo, str, bytes | None]]:
    """(member, path inside the project, content of a regular file) of an sdist, top dir stripped."""
    with tarfile.open(path, "r:gz") as tf:
        for m in tf.getmembers():
            rel = m.name.split("/", 1)[1] if "/" in m.name else ""
            if not rel or not (m.isfile() or m.isdir()) or ".." in rel.split("/") or rel.startswith("/"):
                continue
            f = tf.extractfile(m) if m.isfile() else None
            yield m, rel, (f.read() if f is not None else None)


def repo_files(t: SweTask, sdist_path: Path) -> dict[str, bytes]:
    """The task's repository as the trajectory finds it: path -> content, with the bug applied."""
    files = {rel: data for _, rel, data in _sdist_members(sdist_path) if data is not None}
    if t.bug.path not in files:
        raise SweBuildError(f"{t.name}: {t.bug.path} is not in {sdist_path.name}")
    files[t.bug.path] = t.bug.apply(files[t.bug.path].decode()).encode()
    return files


def hidden_files(t: SweTask, cache: Path | None = None, log: Log = print) -> dict[str, str]:
    """The pristine files of the task's hidden tests (what the reward action sends)."""
    path = sdist(t, cache or cache_dir(), log)
    files = {rel: data for _, rel, data in _sdist_members(path) if data is not None}
    return {p: files[p].decode() for p in t.test_files}


def _tarinfo(name: str, size: int = 0, is_dir: bool = False) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type = tarfile.DIRTYPE if is_dir else tarfile.REGTYPE
    info.mode = 0o777 if is_dir else 0o666
    info.size, info.mtime, info.uid, info.gid = size, REPO_MTIME, 0, 0
    return info


def write_repo_tar(files: dict[str, bytes], out: Path, prefix: str = "repo") -> None:
    """A tar of `files` under `prefix/` (directories included), in a fixed order and metadata."""
    dirs = {prefix}
    for p in files:
        parts = p.split("/")[:-1]
        dirs.update("/".join([prefix, *parts[: i + 1]]) for i in range(len(parts)))
    with tarfile.open(out, "w", format=tarfile.PAX_FORMAT) as tf:
        for d in sorted(dirs):
            tf.addfile(_tarinfo(d, is_dir=True))
        for p in sorted(files):
            tf.addfile(_tarinfo(f"{prefix}/{p}", len(files[p])), io.BytesIO(files[p]))


def task_key(t: SweTask, base: Path) -> str:
    return _key("task", base.name, t.name, t.sdist_sha256, t.bug.path, t.bug.old, t.bug.new)


def repo_layer(t: SweTask, base: Path, cache: Path, log: Log = print) -> Path:
    """The task's repository layer tar (members under repo/), built when not cached."""
    out = cache / "layers" / f"{t.name}-{task_key(t, base)}.tar"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(f".{out.name}.{os.getpid()}")
        write_repo_tar(repo_files(t, sdist(t, cache, log)), tmp)
        os.replace(tmp, out)
    return out


def _layout_keys(layout: Path) -> dict[str, str]:
    try:
        return dict(json.loads((layout / KEYS_FILE).read_text()))
    except (OSError, ValueError):
        return {}


def _in_layout(layout: Path, ref: str) -> bool:
    """The layout's index names `ref` and its manifest blob is there."""
    try:
        index = json.loads((layout / "index.json").read_text())
    except (OSError, ValueError):
        return False
    for m in index.get("manifests") or []:
        if normalize_ref(str((m.get("annotations") or {}).get(REF_NAME, ""))) == normalize_ref(ref):
            return (layout / "blobs" / "sha256" / str(m["digest"]).partition(":")[2]).is_file()
    return False


def add_to_layout(t: SweTask, base: Path, layer: Path, layout: Path, log: Log = print) -> bool:
    """Write the task's image into the OCI layout `layout` unless it is there from the same
    inputs. True when it was written."""
    key = task_key(t, base)
    keys = _layout_keys(layout)
    if keys.get(t.image) == key and _in_layout(layout, t.image):
        return False
    t0 = time.monotonic()
    digest = write_layout(layout, t.image, [base, layer], SPEC)
    keys[t.image] = key
    (layout / KEYS_FILE).write_text(json.dumps(keys, indent=1, sort_keys=True))
    _say(log, f"{t.image}: OCI layout {layout} ({digest[:19]}) in {time.monotonic() - t0:.1f} s")
    return True


@dataclass
class Built:
    """What `build` made or found: paths, refs, and seconds per step."""

    base: Path
    layers: dict[str, Path] = field(default_factory=dict)  # task name -> repository layer
    layout: Path | None = None
    docker_images: dict[str, str] = field(default_factory=dict)  # ref -> image id
    timings_s: dict[str, float] = field(default_factory=dict)


def build(
    tasks: Iterable[SweTask],
    *,
    cache: Path | None = None,
    layout: Path | None = None,
    docker_host: str | None = None,
    mirror: str | None = None,
    log: Log = print,
) -> Built:
    """Build (or find cached) the images of `tasks`: always the base and repository layers; an
    OCI layout in `layout` (default: <cache>/oci, "" / None keeps the default); Docker images in
    the engine at `docker_host` when given."""
    cache = cache or cache_dir()
    tasks = list(tasks)
    with _locked(cache):
        t0 = time.monotonic()
        built = Built(base_rootfs(cache, log, mirror))
        built.timings_s["base"] = time.monotonic() - t0
        t1 = time.monotonic()
        built.layers = {t.name: repo_layer(t, built.base, cache, log) for t in tasks}
        built.timings_s["repos"] = time.monotonic() - t1
        t2 = time.monotonic()
        built.layout = layout or cache / "oci"
        for t in tasks:
            add_to_layout(t, built.base, built.layers[t.name], built.layout, log)
        built.timings_s["oci"] = time.monotonic() - t2
    if docker_host is not None:
        t3 = time.monotonic()
        wanted = [DockerTask(t.image, task_key(t, built.base), built.layers[t.name]) for t in tasks]
        built.docker_images = docker_build(wanted, built.base, docker_host, log)
        built.timings_s["docker"] = time.monotonic() - t3
    return built
