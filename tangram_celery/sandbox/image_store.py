"""The per-node image store: image root filesystems for the namespace backend, unpacked once.

Layout under `images.store_dir` (root-only, 0700):
    lock                      flock: one process of the node changes the store at a time
    refs.json                 ref -> digest (the image id, its config's digest)
    state.json                holds and unpacks of the processes alive now (pid + start time), and
                              the bytes reserved for trajectory layers
    images/<hex>/rootfs       an unpacked image, read-only for its users (content-addressed:
    images/<hex>/meta.json    two refs of one image share it); refs, size, spec, last use
    layers/                   trajectories' spilled upper layers (the namespace backend's)
    locks/<hash>              flock per ref: one fetch of a ref at a time, node-wide
    tmp/<owner>-...           unpacks in progress; an image appears by one rename when complete

A ref is resolved against the sources once per process (a re-tagged image is fetched anew; an
unreachable source leaves the held image in use). Holds and reservations are kept per process,
so a worker that dies releases what it held. The disk budget covers images and reservations;
least-recently-used images that nobody holds are evicted to make room.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import logging
import os
import shutil
import stat
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tangram_celery.common.config_images import ImagesConfig
from tangram_celery.sandbox.image_index import (
    StoreIndex,
    alive,
    proc_token,
    read_json,
    read_metas,
    write_in_place,
    write_json,
)
from tangram_celery.sandbox.image_paths import resolve_in
from tangram_celery.sandbox.image_sources import ImageSource, sources
from tangram_celery.sandbox.image_unpack import tree_bytes, unpack_layer
from tangram_celery.sandbox.oci import (
    ImageCorrupt,
    ImageEntry,
    ImageError,
    ImageNotFound,
    ImageSpec,
    ImageStoreFull,
    Reader,
    normalize_ref,
)

__all__ = [
    "ImageCorrupt",
    "ImageError",
    "ImageNotFound",
    "ImageSpec",
    "ImageStore",
    "ImageStoreFull",
    "StoredImage",
    "resolve_in",
]
log = logging.getLogger(__name__)
MiB = 1 << 20


@dataclass(frozen=True)
class StoredImage:
    ref: str
    digest: str
    rootfs: Path
    size_bytes: int
    spec: ImageSpec


class ImageStore:
    """Image root filesystems on this node, shared by all trajectories (thread- and process-safe)."""

    def __init__(self, cfg: ImagesConfig, docker_url: str | None = None) -> None:
        self.cfg = cfg
        self.root = Path(cfg.store_dir)
        self.budget_bytes = cfg.store_mb * MiB
        self.sources: list[ImageSource] = sources(cfg.docker, cfg.oci_dirs, docker_url)
        me = proc_token(os.getpid())
        assert me is not None
        self._me = me
        self._lock = threading.RLock()
        self._ref_locks: dict[str, threading.Lock] = {}
        self._held: dict[str, list[str]] = {}  # ref -> digests this process holds under it
        self._checked: set[str] = set()  # refs resolved against the sources by this process
        self._metas_cache: dict[str, dict[str, Any]] | None = None  # as of _metas_key
        self._metas_key = (-1, -1)
        self._prepare()

    # ---- the store directory and its lock

    def _prepare(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
        st = os.lstat(self.root)
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
            raise ImageError(f"image store {self.root} must be a directory owned by uid {os.geteuid()}")
        os.chmod(self.root, 0o700)
        for sub in ("images", "layers", "locks", "tmp"):
            (self.root / sub).mkdir(mode=0o700, exist_ok=True)
        self._lock_fd = os.open(self.root / "lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        with self._locked() as ix:
            for tmp in (self.root / "tmp").iterdir():  # unpacks and evictions of dead processes
                if not alive(tmp.name.partition("-")[0]):
                    shutil.rmtree(tmp, ignore_errors=True)
            for meta in ix.metas.values():  # an image renamed in just before a crash
                for ref in meta.get("refs", []):
                    if ix.refs.setdefault(ref, meta["digest"]) == meta["digest"]:
                        ix.dirty = True
            for ref, digest in list(ix.refs.items()):
                if digest.partition(":")[2] not in ix.metas:
                    del ix.refs[ref]
                    ix.dirty = True
            if not any(t != self._me for t in (*ix.holds, *ix.fetching)):
                # the first process of the node: the layers on disk are what is reserved (a process
                # that died between reserve and unreserve leaked nothing)
                ix.layers = tree_bytes(self.root / "layers")

    @contextlib.contextmanager
    def _locked(self) -> Iterator[StoreIndex]:
        with self._lock:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX)
            try:
                state = read_json(self.root / "state.json", {})
                # meta.json files change only under this lock, and then `gen` moves on
                key = (int(state.get("gen", 0)), os.stat(self.root / "images").st_mtime_ns)
                metas = (
                    self._metas_cache
                    if key == self._metas_key and self._metas_cache is not None
                    else read_metas(self.root / "images")
                )
                ix = StoreIndex(
                    refs=read_json(self.root / "refs.json", {}),
                    holds=self._live(state.get("holds", {})),
                    fetching=self._live(state.get("fetching", {})),
                    layers=int(state.get("layers", 0)),
                    used={d: t for d, t in state.get("used", {}).items() if d.partition(":")[2] in metas},
                    metas=metas,
                    gen=key[0],
                )
                refs, before = dict(ix.refs), json.dumps(state, sort_keys=True)  # ix shares inner dicts
                yield ix
                if ix.dirty or refs != ix.refs:
                    write_json(self.root / "refs.json", ix.refs)
                if json.dumps(ix.state(), sort_keys=True) != before:
                    write_in_place(self.root / "state.json", ix.state())
                self._metas_cache = ix.metas
                self._metas_key = (ix.gen, os.stat(self.root / "images").st_mtime_ns)
            except BaseException:
                self._metas_cache = None
                raise
            finally:
                fcntl.flock(self._lock_fd, fcntl.LOCK_UN)

    def _live(self, per_process: dict[str, Any]) -> dict[str, Any]:
        return {t: v for t, v in per_process.items() if t == self._me or alive(t)}

    @contextlib.contextmanager
    def _ref_lock(self, ref: str) -> Iterator[None]:
        with self._lock:
            lock = self._ref_locks.setdefault(ref, threading.Lock())
        with lock:
            name = hashlib.sha256(ref.encode()).hexdigest()[:32]
            fd = os.open(self.root / "locks" / name, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
                yield
            finally:
                os.close(fd)

    # ---- acquire / release

    def _image_dir(self, digest: str) -> Path:
        return self.root / "images" / digest.partition(":")[2]

    def _hold(self, ix: StoreIndex, ref: str, digest: str) -> StoredImage:
        hexa = digest.partition(":")[2]
        meta = ix.metas[hexa]
        if ref not in meta["refs"]:
            meta["refs"] = sorted({*meta["refs"], ref})
            ix.gen += 1
            write_json(self._image_dir(digest) / "meta.json", meta)
        ix.used[digest] = time.time()
        ix.refs[ref] = digest
        per = ix.holds.setdefault(self._me, {})
        per[digest] = per.get(digest, 0) + 1
        self._held.setdefault(ref, []).append(digest)
        return StoredImage(
            ref,
            digest,
            self._image_dir(digest) / "rootfs",
            meta["size_bytes"],
            ImageSpec.from_json(meta["spec"]),
        )

    def _resolve(self, ref: str) -> tuple[str | None, list[str]]:
        """The image (digest) the first source that has `ref` names now, and the sources asked."""
        asked = []
        for src in self.sources:
            asked.append(src.name)
            try:
                digest = src.digest(ref)
            except (ImageError, OSError) as e:
                log.warning("image %s: %s: %s", ref, src.name, e)
                continue
            if digest is not None:
                return digest, asked
        return None, asked

    def acquire(self, ref: str) -> StoredImage:
        """The image's root filesystem, fetched and unpacked now when absent (held until release)."""
        ref = normalize_ref(ref)
        with self._ref_lock(ref):
            # resolved once per process; again when the image went (evicted by another process)
            for fresh in (False, True) if ref in self._checked else (True,):
                digest, asked = self._resolve(ref) if fresh else (None, [])
                with self._locked() as ix:
                    have = ix.refs.get(ref)
                    if have and (digest is None or digest == have) and have.partition(":")[2] in ix.metas:
                        self._checked.add(ref)
                        return self._hold(ix, ref, have)
                    if digest is not None and digest.partition(":")[2] in ix.metas:  # another ref's image
                        self._checked.add(ref)
                        return self._hold(ix, ref, digest)
            if digest is None:
                checked = ", ".join(asked) or "no sources configured"
                raise ImageNotFound(f"image {ref} not found on this node (checked: {checked})")
            image = self._fetch(ref)
            self._checked.add(ref)
            return image

    def release(self, ref: str) -> None:
        """One hold of `ref` ends; an image nobody holds may be evicted."""
        ref = normalize_ref(ref)
        with self._locked() as ix:
            digests = self._held.get(ref)
            if not digests:
                log.warning("image store: release of %s, which this process does not hold", ref)
                return
            digest = digests.pop()
            per = ix.holds.get(self._me, {})
            per[digest] = per.get(digest, 1) - 1
            if per[digest] <= 0:
                del per[digest]
            meta = ix.metas.get(digest.partition(":")[2])
            if meta is not None:
                ix.used[digest] = time.time()

    # ---- fetching

    def _fetch(self, ref: str) -> StoredImage:
        tmp = self.root / "tmp" / f"{self._me}-{uuid.uuid4().hex[:12]}"
        tmp.mkdir(mode=0o700)
        started = time.monotonic()
        try:
            for src in self.sources:
                try:
                    if src.digest(ref) is None:
                        continue
                    with src.fetch(ref, tmp) as (entry, reader):
                        return self._install(ref, entry, reader, tmp, src.name, started)
                except ImageStoreFull:
                    raise
                except ImageError as e:
                    log.error("image %s: fetch from %s failed: %s", ref, src.name, e)
                    raise
                except OSError as e:
                    log.error("image %s: fetch from %s failed: %s", ref, src.name, e)
                    if e.errno == errno.ENOSPC:
                        raise ImageStoreFull(f"image {ref}: the disk of {self.root} is full: {e}") from None
                    raise ImageCorrupt(f"image {ref}: fetch from {src.name} failed: {e}") from None
            raise ImageNotFound(f"image {ref} is no longer in any source")
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
            with self._locked() as ix:
                ix.fetching.get(self._me, {}).pop(tmp.name, None)

    def _install(
        self, ref: str, entry: ImageEntry, reader: Reader, tmp: Path, source: str, started: float
    ) -> StoredImage:
        estimate = entry.blob_bytes
        with self._locked() as ix:
            if not self._make_room(ix, estimate, ref):
                raise self._full(ix, ref, estimate)
            ix.fetching.setdefault(self._me, {})[tmp.name] = estimate
        log.info(
            "image %s: unpacking %d layer(s), %.0f MB, from %s",
            ref,
            len(entry.layers),
            estimate / 1e6,
            source,
        )
        staged = tmp / "image"
        (staged / "rootfs").mkdir(parents=True, mode=0o700)
        os.chmod(staged / "rootfs", 0o755)
        root_fd = os.open(staged / "rootfs", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            for i, layer in enumerate(entry.layers, 1):
                what = f"image {ref} layer {i}/{len(entry.layers)}"
                log.info("%s: %.0f MB", what, layer.size / 1e6)
                with reader.open(layer.name) as blob:
                    unpack_layer(
                        blob,
                        root_fd,
                        what=what,
                        diff_id=layer.diff_id,
                        digest=layer.digest,
                        media_type=layer.media_type,
                    )
        finally:
            os.close(root_fd)
        size = tree_bytes(staged / "rootfs")
        meta = {
            "refs": [ref],
            "digest": entry.digest,
            "size_bytes": size,
            "spec": entry.spec.to_json(),
            "source": source,
            "unpacked_at": time.time(),
            "last_used": time.time(),
        }
        write_json(staged / "meta.json", meta)
        with self._locked() as ix:
            ix.fetching.get(self._me, {}).pop(tmp.name, None)
            hexa = entry.digest.partition(":")[2]
            if hexa not in ix.metas:  # else another process unpacked it meanwhile (under another ref)
                if not self._make_room(ix, size, ref):
                    raise self._full(ix, ref, size)
                os.rename(staged, self._image_dir(entry.digest))
                ix.metas[hexa] = meta
                ix.gen += 1
            image = self._hold(ix, ref, entry.digest)
        log.info(
            "image %s: %s, %.0f MB, ready in %.1f s",
            ref,
            entry.digest[:19],
            size / 1e6,
            time.monotonic() - started,
        )
        return image

    # ---- the disk budget

    def _full(self, ix: StoreIndex, ref: str, nbytes: int) -> ImageStoreFull:
        used = sum(m["size_bytes"] for m in ix.metas.values())
        msg = (
            f"image store {self.root} is full: {ref} needs {nbytes / MiB:.0f} MiB; images take "
            f"{used / MiB:.0f} MiB ({len(ix.metas)} image(s), {len(ix.held_digests())} in use), "
            f"reserved {ix.reserved_bytes() / MiB:.0f} MiB, budget {self.budget_bytes / MiB:.0f} MiB "
            "(sandbox.images.store_mb)"
        )
        log.error("%s", msg)
        return ImageStoreFull(msg)

    def _make_room(self, ix: StoreIndex, nbytes: int, why: str) -> bool:
        """Evict unused images, least recently used first, until `nbytes` more fit; False (and
        nothing evicted) when they cannot."""
        if not self.budget_bytes:
            return True
        used = sum(m["size_bytes"] for m in ix.metas.values()) + ix.reserved_bytes()
        over = used + nbytes - self.budget_bytes
        if over <= 0:
            return True
        held = ix.held_digests()
        unused = sorted((m for m in ix.metas.values() if m["digest"] not in held), key=ix.last_used)
        if sum(m["size_bytes"] for m in unused) < over:
            return False
        for meta in unused:
            if over <= 0:
                break
            self._evict(ix, meta, why)
            over -= meta["size_bytes"]
        return True

    def _evict(self, ix: StoreIndex, meta: dict[str, Any], why: str) -> None:
        digest = meta["digest"]
        hexa = digest.partition(":")[2]
        gone = self.root / "tmp" / f"{self._me}-evicted-{hexa[:12]}-{uuid.uuid4().hex[:6]}"
        os.rename(self._image_dir(digest), gone)  # gone from the store at once; removed below
        del ix.metas[hexa]
        ix.gen += 1
        for ref in [r for r, d in ix.refs.items() if d == digest]:
            del ix.refs[ref]
            self._checked.discard(ref)
        log.info(
            "image store: evicted %s (%s, %.0f MB, unused since %s) to make room for %s",
            ",".join(meta["refs"]),
            digest[:19],
            meta["size_bytes"] / 1e6,
            time.strftime("%H:%M:%S", time.localtime(ix.last_used(meta))),
            why,
        )
        shutil.rmtree(gone, ignore_errors=True)

    def reserve(self, nbytes: int) -> bool:
        """Reserve disk for trajectory layers (evicting unused images if needed); False if impossible."""
        with self._locked() as ix:
            if not self._make_room(ix, nbytes, f"{nbytes / MiB:.1f} MiB of trajectory layers"):
                return False
            ix.layers += nbytes
            return True

    def unreserve(self, nbytes: int) -> None:
        with self._locked() as ix:
            ix.layers = max(0, ix.layers - nbytes)

    def usage(self) -> dict[str, int]:
        """Bytes: `images` (unpacked, and unpacks in progress), `layers` (reserved), `budget` (0: none)."""
        with self._locked() as ix:
            images = sum(m["size_bytes"] for m in ix.metas.values())
            images += sum(n for per in ix.fetching.values() for n in per.values())
            return {"images": images, "layers": ix.layers, "budget": self.budget_bytes}

    # ---- what the node has and can get

    def held(self) -> list[str]:
        """Refs whose image is unpacked on this node."""
        with self._locked() as ix:
            return sorted(r for r, d in ix.refs.items() if d.partition(":")[2] in ix.metas)

    def fetchable(self) -> list[str]:
        """Refs the configured sources can provide now."""
        return sorted({ref for src in self.sources for ref in src.refs()})

    def knows(self, ref: str) -> bool:
        ref = normalize_ref(ref)
        return ref in self.held() or self._resolve(ref)[0] is not None

    def layers_dir(self) -> Path:
        return self.root / "layers"
