"""The image store against a real Docker engine: an image made with `docker import` is fetched
(`docker save`), unpacked and shared by its tags; an unknown or short-id ref is not found."""

from __future__ import annotations

import io
import tarfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tangram_celery.common.config_images import ImagesConfig
from tangram_celery.sandbox.image_store import ImageNotFound, ImageSpec, ImageStore, resolve_in

REF = "tangram-test/store:v1"
ALIAS = "tangram-test/alias:v2"


def rootfs_tar() -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        for name, data, mode in [
            ("usr/bin/hello", b"#!/bin/sh\necho hi\n", 0o755),
            ("etc/motd", b"hi\n", 0o644),
        ]:
            ti = tarfile.TarInfo(name)
            ti.size, ti.mode = len(data), mode
            tf.addfile(ti, io.BytesIO(data))
        link = tarfile.TarInfo("bin")
        link.type, link.linkname = tarfile.SYMTYPE, "usr/bin"
        tf.addfile(link)
    return buf.getvalue()


@pytest.fixture
def imported(docker_engine: str) -> Iterator[Any]:
    """An image made by `docker import` (with an ENV and a WORKDIR), tagged twice."""
    import docker

    client = docker.DockerClient(base_url=docker_engine)
    repo, tag = REF.split(":")
    client.api.import_image_from_data(
        rootfs_tar(), repository=repo, tag=tag, changes=["ENV A=1", "WORKDIR /src"]
    )
    image = client.images.get(REF)
    image.tag(*ALIAS.split(":"))
    try:
        yield image
    finally:
        for ref in (REF, ALIAS):
            client.images.remove(ref, force=True)
        client.close()


def test_an_imported_docker_image_is_unpacked_once_for_its_tags(
    docker_engine: str, imported: Any, tmp_path: Path
) -> None:
    """acquire: the engine's image, unpacked; a second tag of it shares the rootfs."""
    store = ImageStore(ImagesConfig(store_dir=str(tmp_path / "store"), store_mb=64), docker_url=docker_engine)
    assert {REF, ALIAS} <= set(store.fetchable()) and store.knows(REF)
    image = store.acquire(REF)
    assert image.digest == imported.id
    assert (image.rootfs / "etc/motd").read_text() == "hi\n"
    assert resolve_in(image.rootfs, "hello", "/bin") == "/usr/bin/hello"
    assert image.spec.env.get("A") == "1" and image.spec.workdir == "/src"
    assert isinstance(image.spec, ImageSpec)
    alias = store.acquire(ALIAS)
    assert alias.rootfs == image.rootfs and store.held() == sorted([REF, ALIAS])
    store.release(REF)
    store.release(ALIAS)
    assert store.usage()["images"] == image.size_bytes


def test_an_unknown_image_or_a_short_id_is_not_found(
    docker_engine: str, imported: Any, tmp_path: Path
) -> None:
    """ImageNotFound names the ref and the engine; an image id prefix is no ref."""
    store = ImageStore(ImagesConfig(store_dir=str(tmp_path / "store")), docker_url=docker_engine)
    with pytest.raises(ImageNotFound, match=f"tangram-test/nothere:latest.*Docker engine at {docker_engine}"):
        store.acquire("tangram-test/nothere")
    short = imported.id.split(":")[1][:12]
    with pytest.raises(ImageNotFound, match=short):
        store.acquire(short)
    assert store.held() == [] and not store.knows(short)
