"""The round's image fetches (issue 36, `scheduler.images`): the images of the round's new
sandboxes that their nodes lack, and the images of queued new trajectories fetched ahead.

Fetching ahead is a preparation step, like a warm GPU placement: an image that a waiting new
trajectory runs in, and that no node holds or fetches, is sent to the node whose link brings
it soonest (then the one with the most free cores), if that node has room for it without
evicting an image in use or wanted by the queue, and fewer than `per_node` fetches on the way.
Every order names what it evicts, so the executor's store and the plan agree.
"""

from __future__ import annotations

from collections.abc import Sequence

from scheduler.images import ImageFetch, ImageStore, size_mb
from scheduler.model import Allocation, QueuedAction, ResourceKind
from scheduler.queue import WaitingQueue
from scheduler.resources import ClusterState


def has_stores(state: ClusterState) -> bool:
    """True when some CPU node keeps an image store (else the step does nothing)."""
    return any(n.store is not None for n in state.cpu.values())


def image_fetches(
    started: Sequence[Allocation],
    queue: WaitingQueue,
    state: ClusterState,
    now_s: float,
    per_node: int = 2,
    scan: int = 512,
) -> list[ImageFetch]:
    """Fetch orders for the round: those its allocations need, then those fetched ahead for
    the first `scan` queued actions."""
    out: list[ImageFetch] = []
    sent: set[tuple[str, str]] = set()
    link_s: dict[str, float] = {}
    started_ids = set()
    for a in started:
        started_ids.add(a.action_id)
        if a.kind is not ResourceKind.CPU:
            continue
        qa = queue.action(a.action_id)
        store = state.cpu[a.pool].store if a.pool in state.cpu else None
        if not qa.image or store is None or store.has(qa.image) or (a.pool, qa.image) in sent:
            continue
        if qa.trajectory_id in state.trajectory_node or qa.trajectory_id in store.layers:
            continue
        mb = size_mb(_stores(state), qa.image, qa.image_mb)
        out.append(ImageFetch(a.pool, qa.image, mb))
        sent.add((a.pool, qa.image))
        link_s[a.pool] = link_s.get(a.pool, 0.0) + mb / store.mb_per_s
    wanted = _wanted(queue, state, started_ids, scan)
    keep = set(wanted)
    for image, need_mb in wanted.items():
        if any(s.has(image) for s in _stores(state)) or any(img == image for _, img in sent):
            continue
        best: tuple[float, int, str, tuple[str, ...]] | None = None
        for name, node in state.cpu.items():
            store = node.store
            if store is None or not node.online or len(store.fetching) >= per_node:
                continue
            if store.fetchable is not None and image not in store.fetchable:
                continue
            victims = store.victims(need_mb, keep)
            if victims is None:
                continue
            wait = max(0.0, store.busy_until_s - now_s) + link_s.get(name, 0.0) + need_mb / store.mb_per_s
            key = (wait, -len(node.free), name, tuple(victims))
            if best is None or key[:3] < best[:3]:
                best = key
        if best is not None:
            node_name = best[2]
            out.append(ImageFetch(node_name, image, need_mb, best[3]))
            sent.add((node_name, image))
            store = state.cpu[node_name].store
            assert store is not None
            link_s[node_name] = link_s.get(node_name, 0.0) + need_mb / store.mb_per_s
    return out


def _stores(state: ClusterState) -> list[ImageStore]:
    return [n.store for n in state.cpu.values() if n.store is not None and n.online]


def _wanted(
    queue: Sequence[QueuedAction], state: ClusterState, started: set[str], scan: int
) -> dict[str, int]:
    """Images of queued actions of trajectories with no sandbox (new, or evicted), FCFS, with
    their sizes (the first `scan` queued actions)."""
    wanted: dict[str, int] = {}
    pinned = state.trajectory_node
    for i, qa in enumerate(queue):
        if i >= scan:
            break
        if qa.image and qa.action_id not in started and qa.trajectory_id not in pinned:
            wanted.setdefault(qa.image, size_mb(_stores(state), qa.image, qa.image_mb))
    return wanted
