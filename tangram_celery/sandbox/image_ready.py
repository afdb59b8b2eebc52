"""Ready sandboxes of container images, as `prewarm.ReadyPool` keeps them of the host toolchain.

A new trajectory in an image would otherwise wait for its sandbox to start (its layer mounted
or container created, the runner and zygote started: about the start of any sandbox). A node
keeps `sandbox.images.prewarm` ready sandboxes of each of the `warm_images` images its new
trajectories used last; taking one starts the next in the background. A ready sandbox holds its
image in the store and a fresh, empty layer; it is never a kept trajectory's (those resume their
own files, `image_layers`).
"""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Callable

from tangram_celery.sandbox.handle import Handle
from tangram_celery.sandbox.prewarm import ReadyPool

log = logging.getLogger(__name__)
MAX_FAILURES = 3


class ImageReady:
    """One `ReadyPool` per warm image, the least recently used image's closed first."""

    def __init__(
        self,
        size: int,
        images: int,
        start: Callable[[str], Handle],
        destroy: Callable[[Handle], None],
        alive: Callable[[Handle], bool],
    ) -> None:
        self.size, self.images = size, images
        self._start, self._destroy, self._alive = start, destroy, alive
        self._pools: collections.OrderedDict[str, ReadyPool[Handle]] = collections.OrderedDict()
        self._lock = threading.Lock()
        self._closed = False
        self._failures: dict[str, int] = {}

    def take(self, image: str, prefer: Callable[[Handle], bool] | None = None) -> Handle | None:
        """A ready sandbox of `image` if it is warm here, else None (the caller starts one)."""
        with self._lock:
            pool = None if self._closed else self._pools.get(image)
            if pool is not None:
                self._pools.move_to_end(image)
        return pool.take(prefer) if pool is not None else None

    def used(self, image: str) -> None:
        """A sandbox of `image` started for a trajectory: keep the image warm from now on (an
        image that never started one, unknown or broken, is never retried in the background)."""
        if self.size <= 0 or self.images <= 0:
            return
        old: list[ReadyPool[Handle]] = []
        with self._lock:
            if self._closed:
                return
            if image not in self._pools:
                pool = self._pools[image] = ReadyPool(
                    self.size, lambda: self._start_for(image), self._destroy, self._alive
                )
                pool.start()
            self._pools.move_to_end(image)
            while len(self._pools) > self.images:
                old.append(self._pools.popitem(last=False)[1])
        self._close_later(old)

    def _start_for(self, image: str) -> Handle:
        """A ready sandbox of `image`; after `MAX_FAILURES` failed starts in a row the image
        goes cold (its pool closes) instead of being retried forever."""
        try:
            h = self._start(image)
        except Exception:
            with self._lock:
                n = self._failures[image] = self._failures.get(image, 0) + 1
                pool = self._pools.pop(image, None) if n >= MAX_FAILURES else None
            if pool is not None:
                log.warning("image %s: %d ready sandboxes failed to start; not kept warm", image, n)
                self._close_later([pool])
            raise
        with self._lock:
            self._failures.pop(image, None)
        return h

    @staticmethod
    def _close_later(pools: list[ReadyPool[Handle]]) -> None:
        for p in pools:  # off the caller's path: a close waits for a start under way
            threading.Thread(target=p.close, name="image-ready-close", daemon=True).start()

    def warm(self) -> list[str]:
        with self._lock:
            return list(self._pools)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            pools = list(self._pools.values())
            self._pools.clear()
        for p in pools:
            p.close()
