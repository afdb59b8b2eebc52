"""A pool's container-image sandboxes: the node's image store, the trajectories' layers, and
what a kept layer means for the next action (see `image_root` for the mechanism).

A trajectory's first action names its image; the store (`image_store.ImageStore`) holds the
image's root file system once per node. On the namespace backend each trajectory gets a
`Layer`. When the trajectory goes:

- **evicted** (the scheduler needs its memory) or idle past `sandbox.idle_ttl_s`: its layer is
  spilled to the store's layer directory, within the store's disk budget, and its next action
  on this node loads it back: its files are intact and the result's `sandbox_reset` is false
  (`ExecResult.kept_files`). Processes are not kept. When the budget cannot hold the layer it
  is dropped, and the next action says so.
- **closed** by its caller: its layer and any spill are deleted.

A fork (`fork`) writes one spill of the trajectory's layer for each new trajectory id: each
then starts from a copy of its files (hard links to one tar: a fork costs the layer, once).
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any

from tangram_celery.common.config import SandboxConfig
from tangram_celery.common.errors import SandboxError
from tangram_celery.sandbox.handle import Handle
from tangram_celery.sandbox.image_root import (
    WORKDIR_DEFAULT,
    Layer,
    host_python_argv,
    interpreter_in,
    search_path,
    spill_name,
    tools_in,
)

log = logging.getLogger(__name__)


class ImageLayers:
    """The image side of one pool (one worker's node)."""

    def __init__(self, cfg: SandboxConfig, mounts_dir: Path, docker_url: str | None = None) -> None:
        self.cfg = cfg
        self.mounts_dir = mounts_dir  # the live layers' tmpfs mounts (the worker's stage)
        self._docker_url = docker_url
        self._store: Any = None
        self._lock = threading.Lock()
        self.dropped: dict[str, str] = {}  # trajectory -> why its kept layer was dropped
        self._tools: dict[tuple[str, str], dict[str, Any]] = {}  # (image digest, language) -> found

    @property
    def store(self) -> Any:
        """The node's image store, opened on first use (a node that never sees an image never
        creates one)."""
        with self._lock:
            if self._store is None:
                from tangram_celery.sandbox.image_store import ImageStore

                self._store = ImageStore(self.cfg.images, self._docker_url)
            return self._store

    # -- the spilled layers --------------------------------------------------------------------
    def _spill_path(self, tid: str) -> Path:
        """Where `tid`'s kept layer is (the store's layer directory; no store is opened)."""
        return Path(self.cfg.images.store_dir) / "layers" / spill_name(tid)

    def kept_image(self, tid: str) -> str | None:
        """The image of `tid`'s kept layer on this node, if one is kept."""
        meta = self._spill_path(tid).with_suffix(".json")
        try:
            return str(json.loads(meta.read_text())["image"])
        except (OSError, ValueError, KeyError):
            return None

    def kept(self) -> list[str]:
        """The trajectories whose layers this node keeps (for the worker's report)."""
        out = []
        for meta in Path(self.store.layers_dir()).glob("*.json"):
            try:
                out.append(str(json.loads(meta.read_text())["trajectory"]))
            except (OSError, ValueError, KeyError):
                continue
        return out

    def _forget_spill(self, tid: str) -> None:
        path = self._spill_path(tid)
        meta = path.with_suffix(".json")
        try:
            size = int(json.loads(meta.read_text()).get("bytes", 0))
        except (OSError, ValueError):
            size = 0
        for p in (path, meta):
            p.unlink(missing_ok=True)
        if size:
            self.store.unreserve(size)

    def _write_spill(self, tid: str, image: str, layer: Layer) -> int:
        """Spill `layer` for `tid`; its size, or 0 when the store had no room (dropped)."""
        self._forget_spill(tid)
        need = max(layer.used_bytes(), 1)
        if not self.store.reserve(need):
            self.dropped[tid] = f"its files ({need >> 20} MiB) did not fit the node's image store"
            log.warning("layer of %s dropped: %s", tid, self.dropped[tid])
            return 0
        path = self._spill_path(tid)
        try:
            size = layer.spill(path)
        except SandboxError as e:
            self.store.unreserve(need)
            self.dropped[tid] = f"its files could not be kept: {e}"
            log.warning("layer of %s dropped: %s", tid, e)
            return 0
        if size != need:  # the budget holds what is on disk
            self.store.unreserve(need)
            self.store.reserve(size)
        meta = {"trajectory": tid, "image": image, "bytes": size, "at": time.time()}
        path.with_suffix(".json").write_text(json.dumps(meta))
        return size

    # -- a sandbox's life ----------------------------------------------------------------------
    def prepare(self, h: Handle) -> None:
        """Before `h`'s sandbox starts: its image from the store, its layer mounted, and the
        trajectory's kept layer loaded into it when there is one."""
        if h.stored is None:
            h.stored = self.store.acquire(h.image)
            h.workdir = h.stored.spec.workdir or WORKDIR_DEFAULT
        if h.layer is not None:  # a sandbox that died: its layer (files) is still here
            return
        layer = Layer(self.mounts_dir / h.state_dir.name, self.cfg.disk_quota_mb, self.cfg.inodes_limit)
        try:
            spill = self._spill_path(h.trajectory_id)
            if spill.exists() and self.kept_image(h.trajectory_id) == h.image:
                t0 = time.monotonic()
                layer.load(spill)
                h.kept_files = True
                log.info("%s: kept layer loaded in %.3f s", h.trajectory_id, time.monotonic() - t0)
            self._forget_spill(h.trajectory_id)
        except BaseException:
            layer.close()
            raise
        h.layer = layer

    def retire(self, h: Handle) -> None:
        """`h`'s sandbox is gone (its processes dead): keep its layer (`h.keep_files`) or delete
        it, then give the image back to the store."""
        layer, h.layer = h.layer, None
        if layer is not None:
            try:
                if h.keep_files and h.image and h.used:
                    self._write_spill(h.trajectory_id, h.image, layer)
                elif not h.keep_files:
                    self._forget_spill(h.trajectory_id)
            finally:
                layer.close()
        if h.stored is not None:
            self.store.release(h.image)
            h.stored = None

    def report(self) -> dict[str, Any] | None:
        """{"held": [[ref, bytes], ...], "fetchable": [ref, ...], "layers": [trajectory, ...]},
        or None when the store cannot be opened here."""
        try:
            store = self.store
            sizes: dict[str, int] = getattr(store, "sizes", dict)()  # ref -> bytes, where the store says
            held = [[ref, int(sizes.get(ref, 0))] for ref in store.held()]
            return {"held": held, "fetchable": sorted(store.fetchable()), "layers": sorted(self.kept())}
        except Exception as e:
            log.debug("no image report: %s", e)
            return None

    def warm_candidates(self, n: int) -> list[str]:
        """The images to keep warm when the worker starts: those the store holds, at most `n`
        (none when the node has no store yet: none is created for it)."""
        if n <= 0 or not Path(self.cfg.images.store_dir).is_dir():
            return []
        try:
            return list(self.store.held())[-n:]
        except Exception as e:
            log.warning("cannot list the image store's images: %s", e)
            return []

    def prefetch(self, image: str) -> None:
        """Unpack `image` into the store now (held only while it unpacks: evictable after)."""
        t0 = time.monotonic()
        self.store.acquire(image)
        self.store.release(image)
        log.info("image %s fetched ahead in %.1f s", image, time.monotonic() - t0)

    def retire_kept(self, tid: str) -> None:
        """`tid` was closed while evicted: its kept layer goes."""
        self._forget_spill(tid)

    def fork(self, h: Handle, new_ids: list[str]) -> int:
        """A kept layer of `h`'s current files for each trajectory in `new_ids` (each starts from
        them on this node); the bytes written once."""
        if h.layer is None or h.image is None:
            raise SandboxError("only a trajectory in a container image can be forked")
        first = new_ids[0]
        size = self._write_spill(first, h.image, h.layer)
        if not size:
            raise SandboxError(f"cannot fork {h.trajectory_id}: {self.dropped.pop(first, 'no room')}")
        src = self._spill_path(first)
        for tid in new_ids[1:]:
            self._forget_spill(tid)
            os.link(src, self._spill_path(tid))  # one copy on disk, counted once
            meta = {"trajectory": tid, "image": h.image, "bytes": 0, "at": time.time()}
            self._spill_path(tid).with_suffix(".json").write_text(json.dumps(meta))
        return size

    def runner_extras(self, h: Handle, language: str) -> dict[str, Any]:
        """What a request to `h`'s runner adds in an image: the image's tools and Python, its
        environment (a caller's variables still win), no host tools on the path."""
        key = (str(h.stored.digest), language)  # an image's files never change: found once
        with self._lock:
            found = self._tools.get(key)
        if found is None:
            rootfs, path = Path(h.stored.rootfs), search_path(h.stored.spec.env)
            found = {"tools": tools_in(rootfs, language, path), "interpreter": interpreter_in(rootfs, path)}
            with self._lock:
                self._tools[key] = found
        return {**found, "env": dict(h.stored.spec.env), "pythonpath": []}

    @staticmethod
    def runner_env() -> dict[str, str]:
        """The runner's own environment in an image sandbox (how it starts itself again)."""
        from tangram_runner.boot import PYTHON_ENV

        return {"PATH": "/usr/bin:/bin", PYTHON_ENV: json.dumps(list(host_python_argv()))}
