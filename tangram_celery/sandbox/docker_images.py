"""The Docker backend's container-image sandboxes: the image is the engine's own, the
trajectory's layer is its container's writable layer (`image_layers` is the namespace side).

- A trajectory in an image runs in a long-lived container of that image (`DockerImages.container`
  gives `docker.py` what to start), its cores and quota set per exec as for every sandbox. The
  host's /usr (and /lib, /lib64 where they are directories) is mounted read-only under
  `HOST_DIR` and the runner starts on the host's python3 through the host's loader; the image's
  root stays writable where its modes allow, /tmp is a size-limited tmpfs, and the workdir (the
  image's WORKDIR, else /work) is handed to the sandbox user by the runner (`--own`).
- **Evicted** (or idle past its TTL): the container is stopped, not removed. Its writable layer,
  the trajectory's files, stays with the engine, and the next action on this node starts the
  same container again: files intact, processes gone, `sandbox_reset` false.
- **Closed**: the container is removed.
- **Fork**: `docker commit` of the container to a private image, tagged once per new trajectory,
  whose first action starts from it (the engine copies only the container's layer).
- Limits: the writable layer's size is bounded only where the engine's storage driver takes a
  size (`--storage-opt size`, overlay2 on xfs with project quotas); elsewhere a trajectory's
  writes are bounded by the host's disk. Use the namespace backend for untrusted code in images
  where that matters (its layer is a size-limited tmpfs).
"""

from __future__ import annotations

import hashlib
import logging
import threading
from pathlib import Path
from typing import Any

from tangram_celery.common.errors import SandboxError
from tangram_celery.sandbox.handle import Handle
from tangram_celery.sandbox.image_root import (
    HOST_DIR,
    WORKDIR_DEFAULT,
    interpreter_in,
    search_path,
    tools_in,
)
from tangram_celery.sandbox.oci import ImageNotFound

log = logging.getLogger(__name__)
FORK_REPO = "tangram-fork"


class ImageUnknown(ImageNotFound):
    """The engine has no image of that name (a client's bad input: the action is refused)."""


class DockerImages:
    """The image side of one Docker pool (same interface as `image_layers.ImageLayers`)."""

    def __init__(self, client: Any, label: str, hide: str = "") -> None:
        self.client = client
        self.hide = hide if ":" in hide else f"{hide}:latest"  # the host-toolchain sandboxes' image
        self.label = label  # names this worker's fork images
        self._lock = threading.Lock()
        self._kept: dict[str, tuple[Any, Path, str]] = {}  # tid -> (stopped container, state dir, image)
        self._forks: dict[str, tuple[str, str]] = {}  # new tid -> (fork image ref, image)
        self._specs: dict[str, dict[str, Any]] = {}  # image -> {"env", "workdir"}
        self._tools: dict[tuple[str, str], dict[str, Any]] = {}  # (image, language) -> extras
        self.dropped: dict[str, str] = {}

    # -- images --------------------------------------------------------------------------------
    def spec(self, image: str) -> dict[str, Any]:
        """The image's environment and workdir, from the engine (ImageUnknown when absent)."""
        with self._lock:
            got = self._specs.get(image)
        if got is not None:
            return got
        import docker

        try:
            cfg = self.client.images.get(image).attrs.get("Config") or {}
        except docker.errors.ImageNotFound:
            raise ImageUnknown(f"image {image!r} is not in this node's Docker engine") from None
        env = dict(e.split("=", 1) for e in cfg.get("Env") or [] if "=" in e)
        got = {"env": env, "workdir": cfg.get("WorkingDir") or WORKDIR_DEFAULT}
        with self._lock:
            self._specs[image] = got
        return got

    def prepare(self, h: Handle) -> None:
        """Before `h`'s container starts: its image's spec, and whether it resumes a kept one."""
        h.workdir = self.spec(str(h.image))["workdir"]

    def kept_container(self, tid: str) -> tuple[Any, Path] | None:
        """A stopped container of `tid` to start again (taken: it is the handle's now)."""
        with self._lock:
            kept = self._kept.pop(tid, None)
        return None if kept is None else (kept[0], kept[1])

    def start_image(self, h: Handle) -> str:
        """The image `h`'s new container starts from: a fork's, else the trajectory's own."""
        with self._lock:
            fork = self._forks.get(h.trajectory_id)
        if fork is not None and fork[1] == h.image:
            h.kept_files = True
            return fork[0]
        return str(h.image)

    def kept_ref(self, tid: str) -> Any:
        """`tid`'s stopped container, left where it is (None when none is kept)."""
        with self._lock:
            kept = self._kept.get(tid)
        return None if kept is None else kept[0]

    def kept_image(self, tid: str) -> str | None:
        with self._lock:
            if tid in self._kept:
                return self._kept[tid][2]
            fork = self._forks.get(tid)
            return fork[1] if fork else None

    def kept(self) -> list[str]:
        with self._lock:
            return sorted({*self._kept, *self._forks})

    # -- a sandbox's life ----------------------------------------------------------------------
    def retire(self, h: Handle) -> bool:
        """`h`'s runner is gone: True when its container was kept (stopped) for the trajectory's
        next action; otherwise the caller removes it, and a fork image of it goes too."""
        if h.keep_files and h.used and h.ref is not None:
            try:
                h.ref.stop(timeout=0)
            except Exception as e:
                self.dropped[h.trajectory_id] = f"its container could not be kept: {e}"
                return False
            with self._lock:
                self._kept[h.trajectory_id] = (h.ref, h.state_dir, str(h.image))
            return True
        if not h.keep_files:
            self._drop_fork(h.trajectory_id)
        return False

    def warm_candidates(self, n: int) -> list[str]:
        """None at start: the engine's images are not all sandbox images (they warm on use)."""
        return []

    def prefetch(self, image: str) -> None:
        """Nothing to fetch: the engine's images are already on the node (no registry)."""
        self.spec(image)  # checks it is there, and caches its spec

    def retire_kept(self, tid: str) -> None:
        """`tid` was closed while evicted: its stopped container and fork image go."""
        with self._lock:
            kept = self._kept.pop(tid, None)
        if kept is not None:
            try:
                kept[0].remove(force=True)
            except Exception as e:
                log.debug("remove kept container of %s: %s", tid, e)
        self._drop_fork(tid)

    def _drop_fork(self, tid: str) -> None:
        with self._lock:
            fork = self._forks.pop(tid, None)
        if fork is not None:
            try:
                self.client.images.remove(fork[0], noprune=False)
            except Exception as e:  # another fork's container may still use the layers
                log.debug("remove fork image %s: %s", fork[0], e)

    def fork(self, h: Handle, new_ids: list[str]) -> int:
        """Commit `h`'s container once and tag it for each new trajectory; the layer's bytes."""
        if h.ref is None or h.image is None:
            raise SandboxError("only a trajectory in a container image can be forked")
        digest = hashlib.sha256(h.trajectory_id.encode()).hexdigest()[:16]
        repo = f"{FORK_REPO}/{self.label}-{digest}"
        try:
            image = h.ref.commit(repository=repo, tag="base", pause=True)
            for tid in new_ids:
                tag = hashlib.sha256(tid.encode()).hexdigest()[:24]
                image.tag(repo, tag=tag)
                self._drop_fork(tid)
                with self._lock:
                    self._forks[tid] = (f"{repo}:{tag}", str(h.image))
            self.client.images.remove(f"{repo}:base", noprune=True)
            h.ref.reload()
        except Exception as e:
            raise SandboxError(f"cannot fork {h.trajectory_id}: {e}") from None
        return int(image.attrs.get("Size") or 0)

    def runner_extras(self, h: Handle, language: str) -> dict[str, Any]:
        """The image's tools and Python (found through the runner's root), its environment."""
        key = (str(h.image), language)
        with self._lock:
            got = self._tools.get(key)
        if got is None:
            pid = int(h.ref.attrs["State"]["Pid"] or 0)
            root = Path(f"/proc/{pid}/root")
            path = search_path(self.spec(str(h.image))["env"])
            got = {"tools": tools_in(root, language, path), "interpreter": interpreter_in(root, path)}
            with self._lock:
                self._tools[key] = got
        return {**got, "env": dict(self.spec(str(h.image))["env"]), "pythonpath": []}

    def report(self) -> dict[str, Any] | None:
        """Held images (the engine's tagged ones, with sizes) and kept trajectories."""
        try:
            held = [  # one API call (images.list() inspects every image again)
                [tag, int(img.get("Size") or 0)]
                for img in self.client.api.images()
                for tag in img.get("RepoTags") or ()
                if tag not in ("<none>:<none>", self.hide) and not tag.startswith(FORK_REPO + "/")
            ]
        except Exception as e:
            log.debug("no image report: %s", e)
            return None
        return {"held": sorted(held), "fetchable": [], "layers": self.kept()}

    def close(self) -> None:
        """The worker stops: its kept containers and fork images go (a restarted worker resets
        those trajectories)."""
        with self._lock:
            tids = sorted({*self._kept, *self._forks})
        for tid in tids:
            self.retire_kept(tid)


def host_volumes() -> dict[str, dict[str, str]]:
    """The host's system directories under `HOST_DIR`, read-only (links are not mounted: the
    runner's command names real paths, `image_root.host_python_argv`)."""
    import os

    from tangram_celery.sandbox.limits import HOST_RO_PATHS

    return {
        p: {"bind": HOST_DIR + p, "mode": "ro"}
        for p in HOST_RO_PATHS
        if os.path.isdir(p) and not os.path.islink(p)
    }
