"""Where the image store gets images from: the node's Docker engine and operator-named OCI dirs.

Sources are configured by the operator (`sandbox.images`), never named by a client: an action
names a ref (`name:tag`), matched exactly against what the sources hold. Each source answers
cheaply which refs it has and which image (config digest) a ref is now, and opens an image for
the store to unpack.
- `DockerSource`: a local engine's tagged images; an image is read as `docker save` streams it
  (a docker-archive), into a temporary file in the store (the engine offers no random access).
- `OciDirSource`: a directory that is an OCI layout (index.json with `ref.name` annotations), and
  holds `*.tar` archives (OCI archives, or docker-archives) and sub-directories that are layouts.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol

from tangram_celery.sandbox.oci import (
    DirReader,
    ImageCorrupt,
    ImageEntry,
    ImageError,
    Reader,
    TarReader,
    docker_archive_images,
    normalize_ref,
    oci_image,
    oci_refs,
)

log = logging.getLogger(__name__)
DOCKER_RETRY_S = 30.0  # an engine that did not answer is asked again after this long
DOCKER_TIMEOUT_S = 600  # one API call: `docker save` of a large image streams for a while


class ImageSource(Protocol):
    name: str  # for messages: what was checked

    def refs(self) -> list[str]: ...
    def digest(self, ref: str) -> str | None: ...
    def fetch(
        self, ref: str, tmp_dir: Path
    ) -> contextlib.AbstractContextManager[tuple[ImageEntry, Reader]]: ...


class OciDirSource:
    """An operator's directory of OCI layouts and archives."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.name = f"OCI dir {path}"

    @contextlib.contextmanager
    def _readers(self) -> Iterator[list[Reader]]:
        readers: list[Reader] = []
        tars: list[TarReader] = []
        try:
            if (self.path / "index.json").is_file():
                readers.append(DirReader(self.path))
            try:
                children = sorted(self.path.iterdir())
            except OSError:
                children = []
            for child in children:
                if child.is_dir() and (child / "index.json").is_file():
                    readers.append(DirReader(child))
                elif child.suffix == ".tar" and child.is_file():
                    try:
                        tars.append(TarReader(child))
                    except ImageError as e:
                        log.warning("image source: skipping %s", e)
            readers.extend(tars)
            yield readers
        finally:
            for t in tars:
                t.close()

    @staticmethod
    def _entries(reader: Reader) -> dict[str, Any]:
        """ref -> an OCI descriptor, or an ImageEntry (docker-archive); {} when unreadable."""
        try:
            if reader.exists("manifest.json"):
                return dict(docker_archive_images(reader))
            if reader.exists("index.json"):
                return dict(oci_refs(reader))
        except (ImageError, OSError, ValueError, KeyError, TypeError) as e:
            log.warning("image source: skipping %s: %s", reader.where, e)
        return {}

    def refs(self) -> list[str]:
        with self._readers() as readers:
            return sorted({ref for r in readers for ref in self._entries(r)})

    def _find(self, readers: list[Reader], ref: str) -> tuple[ImageEntry, Reader] | None:
        for reader in readers:
            found = self._entries(reader).get(ref)
            if isinstance(found, ImageEntry):
                return found, reader
            if found is not None:
                return oci_image(reader, ref, found), reader
        return None

    def digest(self, ref: str) -> str | None:
        with self._readers() as readers:
            found = self._find(readers, normalize_ref(ref))
            return found[0].digest if found else None

    @contextlib.contextmanager
    def fetch(self, ref: str, tmp_dir: Path) -> Iterator[tuple[ImageEntry, Reader]]:
        with self._readers() as readers:
            found = self._find(readers, normalize_ref(ref))
            if found is None:
                raise ImageCorrupt(f"{self.name} no longer has {ref}")
            yield found


class DockerSource:
    """The node's Docker engine (tagged local images only)."""

    def __init__(self, url: str | None) -> None:
        self.url = url
        self.name = f"Docker engine at {url or os.environ.get('DOCKER_HOST') or 'the default socket'}"
        self._client: Any = None
        self._failed_at = -DOCKER_RETRY_S

    def _connect(self) -> Any:
        if self._client is not None:
            return self._client
        if time.monotonic() - self._failed_at < DOCKER_RETRY_S:
            return None
        try:
            import docker

            client = (
                docker.DockerClient(base_url=self.url, timeout=DOCKER_TIMEOUT_S)
                if self.url
                else docker.from_env(timeout=DOCKER_TIMEOUT_S)
            )
            client.ping()
        except Exception as e:
            self._failed_at = time.monotonic()
            log.warning("image source: no %s (%s); asking again in %.0f s", self.name, e, DOCKER_RETRY_S)
            return None
        self._client = client
        return client

    def _image(self, ref: str) -> Any:
        client = self._connect()
        if client is None:
            return None
        import docker.errors

        ref = normalize_ref(ref)
        try:
            image = client.images.get(ref)
        except docker.errors.ImageNotFound:
            return None
        except Exception as e:  # the engine went away: the next call reconnects
            log.warning("image source: %s: %s", self.name, e)
            self._client, self._failed_at = None, time.monotonic()
            return None
        names = image.tags if "@" not in ref else (image.attrs.get("RepoDigests") or [])
        # exact: the engine also resolves short ids and digests, which an action may not name
        return image if ref in {normalize_ref(t) for t in names} else None

    def refs(self) -> list[str]:
        client = self._connect()
        if client is None:
            return []
        try:
            return sorted({normalize_ref(t) for image in client.images.list() for t in image.tags})
        except Exception as e:
            log.warning("image source: %s: %s", self.name, e)
            return []

    def digest(self, ref: str) -> str | None:
        image = self._image(ref)
        return str(image.id) if image is not None else None

    @contextlib.contextmanager
    def fetch(self, ref: str, tmp_dir: Path) -> Iterator[tuple[ImageEntry, Reader]]:
        image = self._image(ref)
        if image is None:
            raise ImageCorrupt(f"{self.name} no longer has {ref}")
        path = tmp_dir / "docker-save.tar"
        started = time.monotonic()
        try:
            with open(path, "wb") as out:
                for chunk in image.save(chunk_size=1 << 20):
                    out.write(chunk)
        except OSError:
            raise  # the store's disk: the store says so
        except Exception as e:
            raise ImageCorrupt(f"{self.name}: saving {ref} failed: {e}") from None
        log.info(
            "image %s: saved from %s, %.0f MB in %.1f s",
            ref,
            self.name,
            path.stat().st_size / 1e6,
            time.monotonic() - started,
        )
        reader = TarReader(path)
        try:
            entry = docker_archive_images(reader, by_id=True).get(str(image.id))
            if entry is None:
                raise ImageCorrupt(f"{self.name}: the archive of {ref} does not hold image {image.id}")
            yield dataclasses.replace(entry, ref=normalize_ref(ref)), reader
        finally:
            reader.close()
            path.unlink(missing_ok=True)


def sources(docker: bool, oci_dirs: list[str], docker_url: str | None) -> list[ImageSource]:
    """The configured sources, in the order they are asked: OCI dirs, then the Docker engine."""
    out: list[ImageSource] = [OciDirSource(Path(d)) for d in oci_dirs]
    if docker:
        out.append(DockerSource(docker_url))
    return out
