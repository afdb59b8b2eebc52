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
import threading
from collections.abc import Callable

from tangram_celery.sandbox.handle import Handle
from tangram_celery.sandbox.prewarm import ReadyPool


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

    def take(self, image: str, prefer: Callable[[Handle], bool] | None = None) -> Handle | None:
        """A ready sandbox of `image`, or None (the caller starts one); the image is kept warm
        from now on."""
        if self.size <= 0 or self.images <= 0:
            return None
        old: list[ReadyPool[Handle]] = []
        with self._lock:
            if self._closed:
                return None
            pool = self._pools.get(image)
            if pool is None:
                pool = self._pools[image] = ReadyPool(
                    self.size, lambda: self._start(image), self._destroy, self._alive
                )
                pool.start()
            self._pools.move_to_end(image)
            while len(self._pools) > self.images:
                old.append(self._pools.popitem(last=False)[1])
        for p in old:  # off the taker's path: a close waits for a start under way
            threading.Thread(target=p.close, name="image-ready-close", daemon=True).start()
        return pool.take(prefer)

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
