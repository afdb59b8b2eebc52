"""The SWE task images in a Docker engine, with no registry: `docker import` of the base root
filesystem tar (with its environment and working directory /repo), then per task a two-line
Dockerfile (FROM the base, COPY the repository to /repo) built from a context made of the
task's repository layer.

An image is rebuilt only when its recipe changed: besides its ref, each is tagged with the key
of its inputs (`tangram-swe/<task>:key-<key>`), and the base with the key of its own recipe.
No LABEL or WORKDIR step: on the vfs storage driver every build step copies the whole root
filesystem.
"""

from __future__ import annotations

import hashlib
import io
import tarfile
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tangram_celery.common.errors import TangramError

BASE_REPO = "tangram-swe/base"
DOCKERFILE = "FROM {base}\nCOPY repo /repo\n"
BASE_CHANGES = [
    "ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "ENV LANG=C.UTF-8",
    "WORKDIR /repo",
]


@dataclass(frozen=True)
class DockerTask:
    """One image to have in the engine: its ref, the key of its inputs, its repository layer."""

    ref: str
    key: str
    layer: Path


def base_ref(base: Path) -> str:
    """The engine's name of a base tar `base-<suite>-<key>.tar` imported with BASE_CHANGES."""
    changes = hashlib.sha256("\n".join(BASE_CHANGES).encode()).hexdigest()[:8]
    return f"{BASE_REPO}:{base.stem.removeprefix('base-')}-{changes}"


def key_tag(key: str, base: str) -> str:
    """The tag that marks a task image built from inputs `key` on the base image `base`."""
    return "key-" + hashlib.sha256(f"{key} {base} {DOCKERFILE}".encode()).hexdigest()[:16]


def _client(docker_host: str) -> Any:
    try:
        import docker
    except ImportError:
        raise TangramError("the docker package is missing: pip install docker") from None
    return docker.DockerClient(base_url=docker_host, timeout=600)


def _image(client: Any, ref: str) -> Any | None:
    import docker.errors

    try:
        return client.images.get(ref)
    except docker.errors.ImageNotFound:
        return None


def _context(layer: Path, dockerfile: str) -> io.BytesIO:
    """A build context: the repository layer's members (repo/...) and the Dockerfile."""
    buf = io.BytesIO()
    with tarfile.open(layer, "r:") as src, tarfile.open(fileobj=buf, mode="w") as out:
        for m in src.getmembers():
            out.addfile(m, src.extractfile(m) if m.isfile() else None)
        data = dockerfile.encode()
        info = tarfile.TarInfo("Dockerfile")
        info.size = len(data)
        out.addfile(info, io.BytesIO(data))
    buf.seek(0)
    return buf


def _build_one(client: Any, t: DockerTask, base: str) -> str:
    stream = client.api.build(
        fileobj=_context(t.layer, DOCKERFILE.format(base=base)),
        custom_context=True,
        tag=t.ref,
        rm=True,
        forcerm=True,
        network_mode="none",
        decode=True,
    )
    for chunk in stream:
        if "error" in chunk:
            raise TangramError(f"docker build of {t.ref} failed: {chunk['error'].strip()}")
    image = _image(client, t.ref)
    if image is None:
        raise TangramError(f"docker build of {t.ref} finished but the engine has no such image")
    repo, _, _ = t.ref.rpartition(":")
    image.tag(repo, key_tag(t.key, base))
    return str(image.id)


def docker_build(
    tasks: Iterable[DockerTask], base: Path, docker_host: str, log: Callable[[str], None] = print
) -> dict[str, str]:
    """Have every task image in the engine at `docker_host` (imported / built only when missing
    or built from other inputs): ref -> image id."""
    client = _client(docker_host)
    try:
        bref = base_ref(base)
        if _image(client, bref) is None:
            t0 = time.monotonic()
            repo, _, tag = bref.partition(":")
            client.api.import_image_from_file(str(base), repository=repo, tag=tag, changes=BASE_CHANGES)
            if _image(client, bref) is None:
                raise TangramError(f"docker import of {base} did not make {bref}")
            log(f"swe: {bref}: docker import in {time.monotonic() - t0:.1f} s")
        out: dict[str, str] = {}
        for t in tasks:
            image, keyed = (
                _image(client, t.ref),
                _image(client, f"{t.ref.rpartition(':')[0]}:{key_tag(t.key, bref)}"),
            )
            if image is not None and keyed is not None and image.id == keyed.id:
                out[t.ref] = str(image.id)
                continue
            t0 = time.monotonic()
            out[t.ref] = _build_one(client, t, bref)
            log(f"swe: {t.ref}: docker build in {time.monotonic() - t0:.1f} s")
        return out
    finally:
        client.close()
