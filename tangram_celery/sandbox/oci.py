"""OCI image layouts and archives, and Docker's `docker save` archives: reading and writing.

An image here is a config (its environment, working directory, user and the digests of its
uncompressed layers, `rootfs.diff_ids`) and a list of layer tars, bottom first. The image store
(`image_store.py`) reads them through a `Reader` (a directory, or a tar file read in place) and
unpacks them with `layers.py`; `write_layout` makes OCI layouts for tests and the SWE image
builder. Every blob read is checked against its digest; a mismatch is an `ImageCorrupt`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import gzip
import hashlib
import json
import os
import platform
import shutil
import tarfile
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Protocol, cast

from tangram_celery.common.errors import SandboxError

REF_NAME = "org.opencontainers.image.ref.name"
CONTAINERD_NAME = "io.containerd.image.name"  # what `docker save` of dockerd >= 25 also writes
INDEX = "application/vnd.oci.image.index.v1+json"
MANIFEST = "application/vnd.oci.image.manifest.v1+json"
CONFIG = "application/vnd.oci.image.config.v1+json"
LAYER_TAR = "application/vnd.oci.image.layer.v1.tar"
LAYER_GZIP = "application/vnd.oci.image.layer.v1.tar+gzip"
DOCKER_LIST = "application/vnd.docker.distribution.manifest.list.v2+json"
MAX_JSON_BYTES = 16 << 20  # an index, manifest or config larger than this is not an image
_CHUNK = 1 << 20


class ImageError(SandboxError):
    """An image could not be provided (the base of the image store's errors)."""


class ImageNotFound(ImageError):
    """No configured source has the image; the message names the ref and the sources checked."""


class ImageStoreFull(ImageError):
    """The store's disk budget cannot hold the image (or the reservation), even after eviction."""


class ImageCorrupt(ImageError):
    """A blob failed its digest, a layer is not a readable tar, or a member tries to escape."""


@dataclass(frozen=True)
class ImageSpec:
    """What an image's config says about the processes started in it."""

    env: dict[str, str] = dataclasses.field(default_factory=dict)
    workdir: str = ""  # "" when unset
    user: str = ""  # "" when unset (root)

    def to_json(self) -> dict[str, Any]:
        return {"env": dict(self.env), "workdir": self.workdir, "user": self.user}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> ImageSpec:
        return cls(env=dict(d.get("env") or {}), workdir=d.get("workdir", ""), user=d.get("user", ""))

    @classmethod
    def from_config(cls, cfg: dict[str, Any]) -> ImageSpec:
        """From an OCI/Docker config's `config` object (`Env` as ["K=V", ...])."""
        cfg = cfg or {}
        env: dict[str, str] = {}
        for item in cfg.get("Env") or []:
            key, _, value = str(item).partition("=")
            env[key] = value
        return cls(env=env, workdir=str(cfg.get("WorkingDir") or ""), user=str(cfg.get("User") or ""))


@dataclass(frozen=True)
class Layer:
    """One layer blob of an image: where it is in its reader, and what it must hash to."""

    name: str  # path within the reader
    diff_id: str  # sha256 of the uncompressed tar (the config's rootfs.diff_ids)
    digest: str | None = None  # sha256 of the blob as stored (compressed), when known
    size: int = 0  # blob size, bytes (0: unknown)
    media_type: str = LAYER_TAR


@dataclass(frozen=True)
class ImageEntry:
    """An image found in a reader: its id (the config's digest, as Docker shows it) and layers."""

    ref: str
    digest: str  # sha256 of the config blob: the same image from any source has the same one
    spec: ImageSpec
    layers: tuple[Layer, ...]

    @property
    def blob_bytes(self) -> int:
        return sum(la.size for la in self.layers)


def normalize_ref(ref: str) -> str:
    """`name` -> `name:latest`; a ref with a tag or a digest is kept as it is."""
    last = ref.rsplit("/", 1)[-1]
    return ref if (":" in last or "@" in ref) else f"{ref}:latest"


def sha256_file(path: Path) -> tuple[str, int]:
    h = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
            size += len(chunk)
    return f"sha256:{h.hexdigest()}", size


def blob_path(digest: str) -> str:
    algo, _, hexa = digest.partition(":")
    if algo != "sha256" or len(hexa) != 64 or any(c not in "0123456789abcdef" for c in hexa):
        raise ImageCorrupt(f"unsupported or malformed digest {digest!r}")
    return f"blobs/sha256/{hexa}"


# ---- readers: a layout directory, or a tar file (OCI archive, docker-archive) read in place


class Reader(Protocol):
    where: str

    def open(self, name: str) -> IO[bytes]: ...
    def exists(self, name: str) -> bool: ...
    def size(self, name: str) -> int: ...


def _clean_name(name: str) -> str:
    parts = [p for p in name.split("/") if p not in ("", ".")]
    if name.startswith("/") or ".." in parts or not parts:
        raise ImageCorrupt(f"bad path {name!r} in an image manifest")
    return "/".join(parts)


class DirReader:
    """An OCI layout directory."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.where = str(root)

    def open(self, name: str) -> IO[bytes]:
        # O_NOFOLLOW on the last part only: a layout is operator-provided, but its blobs must be files
        fd = os.open(self.root / _clean_name(name), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        return os.fdopen(fd, "rb")

    def exists(self, name: str) -> bool:
        return (self.root / _clean_name(name)).is_file()

    def size(self, name: str) -> int:
        return (self.root / _clean_name(name)).stat().st_size


class TarReader:
    """An uncompressed tar (OCI archive or docker-archive), read in place through its index."""

    def __init__(self, path: Path) -> None:
        self.where = str(path)
        try:
            self._tar = tarfile.open(path, "r:")  # noqa: SIM115 - closed by close()
            self._members = {
                "/".join(p for p in m.name.split("/") if p not in ("", ".")): m
                for m in self._tar.getmembers()
                if m.isfile()
            }
        except (OSError, tarfile.TarError) as e:
            raise ImageCorrupt(f"{path}: not a readable tar: {e}") from None

    def _member(self, name: str) -> tarfile.TarInfo:
        member = self._members.get(_clean_name(name))
        if member is None:
            raise FileNotFoundError(f"{self.where}: no {name}")
        return member

    def open(self, name: str) -> IO[bytes]:
        f = self._tar.extractfile(self._member(name))
        assert f is not None  # a regular file
        return f

    def exists(self, name: str) -> bool:
        return _clean_name(name) in self._members

    def size(self, name: str) -> int:
        return self._member(name).size

    def close(self) -> None:
        self._tar.close()


def read_json(reader: Reader, name: str, digest: str | None = None) -> Any:
    """A JSON file of `reader`, checked against `digest` when given."""
    try:
        with reader.open(name) as f:
            data = f.read(MAX_JSON_BYTES + 1)
    except FileNotFoundError:
        raise ImageCorrupt(f"{reader.where}: {name} is missing") from None
    if len(data) > MAX_JSON_BYTES:
        raise ImageCorrupt(f"{reader.where}: {name} is larger than {MAX_JSON_BYTES} bytes")
    if digest is not None and f"sha256:{hashlib.sha256(data).hexdigest()}" != digest:
        raise ImageCorrupt(f"{reader.where}: {name} does not match its digest {digest}")
    try:
        return json.loads(data)
    except ValueError as e:
        raise ImageCorrupt(f"{reader.where}: {name} is not JSON: {e}") from None


# ---- OCI image layouts


def _host_arch() -> str:
    m = platform.machine().lower()
    return {"x86_64": "amd64", "aarch64": "arm64", "armv7l": "arm"}.get(m, m)


def _refs_of(desc: dict[str, Any]) -> list[str]:
    ann = desc.get("annotations") or {}
    return [normalize_ref(str(ann[k])) for k in (REF_NAME, CONTAINERD_NAME) if ann.get(k)]


def oci_refs(reader: Reader) -> dict[str, dict[str, Any]]:
    """The refs an OCI layout's index.json annotates -> their descriptors (reads index.json only)."""
    index = read_json(reader, "index.json")
    out: dict[str, dict[str, Any]] = {}
    for desc in index.get("manifests") or []:
        for ref in _refs_of(desc):
            out.setdefault(ref, desc)
    return out


def _pick_manifest(reader: Reader, desc: dict[str, Any], depth: int = 0) -> dict[str, Any]:
    """The image manifest a descriptor leads to (a nested index: the host's platform, else the first)."""
    if desc.get("mediaType") not in (INDEX, DOCKER_LIST):
        return desc
    if depth > 4:
        raise ImageCorrupt(f"{reader.where}: image indexes nested too deep")
    nested = read_json(reader, blob_path(desc["digest"]), desc["digest"])
    manifests = nested.get("manifests") or []
    if not manifests:
        raise ImageCorrupt(f"{reader.where}: index {desc['digest']} lists no manifest")
    arch = _host_arch()
    ours = [m for m in manifests if (m.get("platform") or {}).get("architecture") == arch]
    return _pick_manifest(reader, (ours or manifests)[0], depth + 1)


def oci_image(reader: Reader, ref: str, desc: dict[str, Any]) -> ImageEntry:
    """The image a layout's index descriptor names: manifest and config read and digest-checked."""
    desc = _pick_manifest(reader, desc)
    manifest = read_json(reader, blob_path(desc["digest"]), desc["digest"])
    cdesc = manifest.get("config") or {}
    config = read_json(reader, blob_path(cdesc.get("digest", "")), cdesc.get("digest"))
    diff_ids = list((config.get("rootfs") or {}).get("diff_ids") or [])
    blobs = manifest.get("layers") or []
    if len(diff_ids) != len(blobs):
        raise ImageCorrupt(f"{reader.where}: {ref}: {len(blobs)} layers but {len(diff_ids)} diff_ids")
    layers = tuple(
        Layer(blob_path(b["digest"]), d, b["digest"], int(b.get("size", 0)), str(b.get("mediaType", "")))
        for b, d in zip(blobs, diff_ids, strict=True)
    )
    return ImageEntry(ref, cdesc["digest"], ImageSpec.from_config(config.get("config") or {}), layers)


# ---- docker-archive (`docker save`): manifest.json + config + layer tars


def docker_archive_images(reader: Reader, by_id: bool = False) -> dict[str, ImageEntry]:
    """Every tagged image of a `docker save` archive: ref -> entry (configs digest-checked);
    `by_id`: every image, keyed by its id (the config digest) instead."""
    out: dict[str, ImageEntry] = {}
    for item in read_json(reader, "manifest.json"):
        name = str(item["Config"])
        with reader.open(name) as f:
            digest = f"sha256:{hashlib.sha256(f.read(MAX_JSON_BYTES)).hexdigest()}"
        config = read_json(reader, name, digest)
        diff_ids = list((config.get("rootfs") or {}).get("diff_ids") or [])
        paths = list(item.get("Layers") or [])
        if len(diff_ids) != len(paths):
            raise ImageCorrupt(f"{reader.where}: {len(paths)} layers but {len(diff_ids)} diff_ids")
        layers = tuple(Layer(p, d, None, reader.size(p)) for p, d in zip(paths, diff_ids, strict=True))
        spec = ImageSpec.from_config(config.get("config") or {})
        if by_id:
            out[digest] = ImageEntry(digest, digest, spec, layers)
        for tag in [] if by_id else item.get("RepoTags") or []:
            ref = normalize_ref(str(tag))
            out[ref] = ImageEntry(ref, digest, spec, layers)
    return out


# ---- writing OCI layouts


def _write_atomic(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _put_blob(layout: Path, data: bytes) -> tuple[str, int]:
    digest = f"sha256:{hashlib.sha256(data).hexdigest()}"
    path = layout / blob_path(digest)
    if not path.exists():
        _write_atomic(path, data)
    return digest, len(data)


@contextlib.contextmanager
def _opened_tar(path: Path) -> Iterator[tuple[IO[bytes], bool]]:
    with open(path, "rb") as raw:
        gz = raw.read(2) == b"\x1f\x8b"
        raw.seek(0)
        if gz:
            with gzip.GzipFile(fileobj=raw, mode="rb") as f:
                yield cast(IO[bytes], f), True
        else:
            yield raw, False


def _put_layer(layout: Path, tar: Path) -> tuple[dict[str, Any], str]:
    """Copy a layer tar (plain or gzip) into the layout's blobs: (descriptor, diff_id)."""
    digest, size = sha256_file(tar)
    with _opened_tar(tar) as (f, gz):
        h = hashlib.sha256()
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    dest = layout / blob_path(digest)
    if not dest.exists():
        fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=".blob.")
        os.close(fd)
        shutil.copyfile(tar, tmp)
        os.replace(tmp, dest)
    desc = {"mediaType": LAYER_GZIP if gz else LAYER_TAR, "digest": digest, "size": size}
    return desc, f"sha256:{h.hexdigest()}"


def write_layout(layout_dir: Path, ref: str, layers: list[Path], spec: ImageSpec) -> str:
    """Write (or add to) an OCI image layout: `ref` names an image of `layers` (plain or gzip
    rootfs tars, bottom first) and `spec`. Returns the manifest's digest. Several refs may share
    one layout; writing a ref again replaces its entry in index.json."""
    layout_dir = Path(layout_dir)
    (layout_dir / "blobs" / "sha256").mkdir(parents=True, exist_ok=True)
    with open(layout_dir / ".lock", "a") as lock:  # writers of one layout take turns on index.json
        fcntl.flock(lock, fcntl.LOCK_EX)
        return _write_locked(layout_dir, normalize_ref(ref), layers, spec)


def _write_locked(layout_dir: Path, ref: str, layers: list[Path], spec: ImageSpec) -> str:
    descs, diff_ids = [], []
    for tar in layers:
        desc, diff_id = _put_layer(layout_dir, Path(tar))
        descs.append(desc)
        diff_ids.append(diff_id)
    cfg: dict[str, Any] = {"Env": [f"{k}={v}" for k, v in spec.env.items()]}
    if spec.workdir:
        cfg["WorkingDir"] = spec.workdir
    if spec.user:
        cfg["User"] = spec.user
    config = {
        "architecture": _host_arch(),
        "os": "linux",
        "config": cfg,
        "rootfs": {"type": "layers", "diff_ids": diff_ids},
    }
    cdigest, csize = _put_blob(layout_dir, json.dumps(config, sort_keys=True).encode())
    manifest = {
        "schemaVersion": 2,
        "mediaType": MANIFEST,
        "config": {"mediaType": CONFIG, "digest": cdigest, "size": csize},
        "layers": descs,
    }
    mdigest, msize = _put_blob(layout_dir, json.dumps(manifest, sort_keys=True).encode())
    index_path = layout_dir / "index.json"
    index: dict[str, Any] = (
        json.loads(index_path.read_text()) if index_path.exists() else {"schemaVersion": 2}
    )
    kept = [m for m in index.get("manifests") or [] if ref not in _refs_of(m)]
    kept.append({"mediaType": MANIFEST, "digest": mdigest, "size": msize, "annotations": {REF_NAME: ref}})
    index.update(mediaType=INDEX, manifests=kept)
    _write_atomic(layout_dir / "oci-layout", json.dumps({"imageLayoutVersion": "1.0.0"}).encode())
    _write_atomic(index_path, json.dumps(index, indent=1, sort_keys=True).encode())
    return mdigest
