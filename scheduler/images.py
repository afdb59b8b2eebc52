"""A CPU node's image store: the container images it holds, within a disk budget, and what a
new one costs to fetch (issue 36).

A trajectory of a code action with an `image` runs in that image (`QueuedAction.image`).
Each CPU node that runs images keeps a store (`CpuNode.store`; None on a node that reports
none: it behaves as before images). The store holds images by reference with their sizes, the
least recently used first; it fetches one image at a time over the node's link (`mb_per_s`),
so a fetch waits behind those queued before it, and it makes room by evicting unused images,
least recently used first. An image is in use while a trajectory's sandbox on the node runs in
it (`users`) or an evicted trajectory keeps its copy-on-write layer there (`layers`): such a
trajectory's next action is cheapest on that node (no fetch, its files intact).

Everything here is plain state with pure queries (`wait_s`, `victims`); the executor changes it
(`fetch`, `arrived`, and `ClusterState` pinning and evicting trajectories).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class ImageFetch:
    """A fetch order a round emits: bring `image` (`size_mb`) onto CPU node `node`, evicting
    the unused images `evict` first (the executor's store picks them itself when None)."""

    node: str
    image: str
    size_mb: int
    evict: tuple[str, ...] | None = None


@dataclass
class ImageStore:
    """One node's images. `budget_mb` None: unbounded; `fetchable` None: any image can be
    fetched (live: the images the node's worker can reach)."""

    budget_mb: int | None = None
    mb_per_s: float = 100.0
    held: dict[str, int] = field(default_factory=dict)  # ref -> MB, least recently used first
    fetching: dict[str, tuple[int, float]] = field(default_factory=dict)  # ref -> (MB, ready at s)
    busy_until_s: float = 0.0  # when the node's link has fetched everything queued on it
    users: dict[str, str] = field(default_factory=dict)  # trajectory with a sandbox here -> its image
    layers: dict[str, str] = field(default_factory=dict)  # evicted trajectory -> image of its kept layer
    fetchable: frozenset[str] | None = None

    def copy(self) -> ImageStore:
        return ImageStore(
            self.budget_mb,
            self.mb_per_s,
            dict(self.held),
            dict(self.fetching),
            self.busy_until_s,
            dict(self.users),
            dict(self.layers),
            self.fetchable,
        )

    def has(self, ref: str) -> bool:
        """Held, or on its way."""
        return ref in self.held or ref in self.fetching

    @property
    def used_mb(self) -> int:
        return sum(self.held.values()) + sum(mb for mb, _ in self.fetching.values())

    def in_use(self) -> set[str]:
        """Images that cannot be evicted: a sandbox or a kept layer here runs in them."""
        return set(self.users.values()) | set(self.layers.values())

    def victims(self, size_mb: int, keep: frozenset[str] | set[str] = frozenset()) -> list[str] | None:
        """Unused held images (not in `keep`), least recently used first, whose eviction makes
        room for `size_mb` more; None when evicting all of them would not."""
        if self.budget_mb is None:
            return []
        short = self.used_mb + size_mb - self.budget_mb
        if short <= 0:
            return []
        busy = self.in_use()
        out: list[str] = []
        for ref, mb in self.held.items():
            if ref in busy or ref in keep:
                continue
            out.append(ref)
            short -= mb
            if short <= 0:
                return out
        return None

    def wait_s(self, ref: str, size_mb: int, now_s: float) -> float | None:
        """Seconds until `ref` is on this node if it is fetched now (0 when held); None when it
        cannot come here (not fetchable, or no room even after evicting every unused image)."""
        if ref in self.held:
            return 0.0
        on_way = self.fetching.get(ref)
        if on_way is not None:
            return max(0.0, on_way[1] - now_s)
        if self.fetchable is not None and ref not in self.fetchable:
            return None
        if self.victims(size_mb) is None:
            return None
        return max(0.0, self.busy_until_s - now_s) + size_mb / self.mb_per_s

    def fetch(self, ref: str, size_mb: int, now_s: float, evict: Iterable[str] | None = None) -> float:
        """Start fetching `ref` (after those queued on the link), evicting unused images for
        room (`evict`, or the least recently used); when it will have arrived (s). Held or on
        its way already: nothing new."""
        if ref in self.held:
            self.touch(ref)
            return now_s
        if ref in self.fetching:
            return self.fetching[ref][1]
        busy = self.in_use()
        for victim in self.victims(size_mb) or () if evict is None else evict:
            if victim not in busy:
                self.held.pop(victim, None)
        ready = max(now_s, self.busy_until_s) + size_mb / self.mb_per_s
        self.busy_until_s = ready
        self.fetching[ref] = (size_mb, ready)
        return ready

    def arrived(self, ref: str) -> None:
        """A fetch ended: the image is held (the most recently used)."""
        on_way = self.fetching.pop(ref, None)
        if on_way is not None:
            self.held[ref] = on_way[0]

    def touch(self, ref: str) -> None:
        mb = self.held.pop(ref, None)
        if mb is not None:
            self.held[ref] = mb

    def learn(self, held: dict[str, int], fetchable: frozenset[str] | None, layers: set[str]) -> None:
        """What the node's worker reports replaces what the store predicted (live); fetches
        the report does not show yet stay on their way."""
        self.held = dict(held)
        self.fetching = {r: v for r, v in self.fetching.items() if r not in held}
        self.fetchable = fetchable
        self.layers = {t: r for t, r in self.layers.items() if t in layers}
        for t in layers:
            self.layers.setdefault(t, "")


def image_wait_s(
    store: ImageStore | None, trajectory_id: str, ref: str, size_mb: int, now_s: float
) -> float | None:
    """What starting a new sandbox of `trajectory_id` in image `ref` costs on a node, in
    seconds of fetching: -1 where the trajectory's kept layer is (cheapest of all), 0 where the
    image is held, the fetch's wait otherwise; None where it cannot run. A node with no store
    costs nothing (it reports no images: as before images)."""
    if store is None:
        return 0.0
    if trajectory_id in store.layers:
        return -1.0
    return store.wait_s(ref, size_mb, now_s)


def size_mb(stores: Iterable[ImageStore | None], ref: str, given_mb: int = 0) -> int:
    """An image's size: `given_mb` when the action says it (the simulator), else what a node
    holding it reports (live: clients name images, workers measure them); 0 when unknown."""
    if given_mb:
        return given_mb
    for store in stores:
        if store is not None and ref in store.held:
            return store.held[ref]
    return 0


def image_ready(store: ImageStore | None, trajectory_id: str, ref: str) -> bool:
    """A new sandbox of `trajectory_id` in `ref` can start on the node now, with no fetch: the
    node keeps its layer or holds the image (or keeps no store: it reports no images)."""
    return store is None or trajectory_id in store.layers or ref in store.held
