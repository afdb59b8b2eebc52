"""Where a new trajectory in a container image starts soonest (issue 36, `scheduler.images`).

One round's view for `tangram-fast`'s candidate pass (`fast_candidates`): the seconds until a
node can start a new sandbox in the action's image, the cost model being the fetch's wait
added to the expected start (the pass only places on nodes whose cores are free now). A node
where the trajectory kept its copy-on-write layer (evicted for memory) comes first, then nodes
holding the image, then those fetching it, then the rest by how long their link needs. An image
that the pass already sent to a node costs what it cost the first trajectory there (the
trajectories of one task gather where its image comes), and a fetch the pass chose delays the
fetches behind it on the same link.
"""

from __future__ import annotations

from collections.abc import Iterable

from scheduler.images import image_wait_s, size_mb
from scheduler.model import QueuedAction, ResourceKind
from scheduler.resources import ClusterState

# How long an evicted trajectory waits for cores on the node that keeps its layer before it
# starts over elsewhere (its files lost, `sandbox_reset`): a reset costs the agent its edits.
LAYER_PATIENCE_S = 60.0


class ImagePlaces:
    """The image costs of one pass's placements on `state` at `now_s`."""

    def __init__(self, state: ClusterState, now_s: float) -> None:
        self.state, self.now_s = state, now_s
        self.chosen: dict[tuple[str, str], float] = {}  # (node, image) -> its wait when first sent there
        self.link_s: dict[str, float] = {}  # node -> seconds of fetches this pass queued on its link
        self._sizes: dict[str, int] = {}

    def cost_s(self, action: QueuedAction, node: str) -> float | None:
        """Seconds of fetching before `action`'s new sandbox can start on `node` (-1: its kept
        layer is there); None where its image cannot come."""
        store = self.state.cpu[node].store
        if (
            store is not None
            and (node, action.image) in self.chosen
            and action.trajectory_id not in store.layers
        ):
            return self.chosen[(node, action.image)]
        wait = image_wait_s(store, action.trajectory_id, action.image, self.size_mb(action), self.now_s)
        if wait is not None and wait > 0 and store is not None and not store.has(action.image):
            wait += self.link_s.get(node, 0.0)
        return wait

    def order(self, action: QueuedAction, nodes: Iterable[str]) -> list[str]:
        """`nodes` (in their order of preference without images) where `action`'s image can
        come, soonest first."""
        costed = []
        for i, n in enumerate(nodes):
            c = self.cost_s(action, n)
            if c is not None:
                costed.append((c, not self._comes(action.image, n), i, n))
        costed.sort()  # at equal waits, a node the image comes to anyway: one fetch, not two
        return [n for *_, n in costed]

    def _comes(self, image: str, node: str) -> bool:
        """The image is on `node`, on its way, or sent there this pass."""
        store = self.state.cpu[node].store
        return (node, image) in self.chosen or (store is not None and store.has(image))

    def layer_node(self, trajectory_id: str) -> str | None:
        """The online node that keeps `trajectory_id`'s copy-on-write layer, if any."""
        for name, cpu in self.state.cpu.items():
            if cpu.online and cpu.store is not None and trajectory_id in cpu.store.layers:
                return name
        return None

    def size_mb(self, action: QueuedAction) -> int:
        """The size of `action`'s image (`scheduler.images.size_mb`), once per pass."""
        known = self._sizes.get(action.image)
        if known is None:
            stores = (n.store for n in self.state.cpu.values())
            known = self._sizes[action.image] = size_mb(stores, action.image, action.image_mb)
        return known

    def waits(self, action: QueuedAction, node: str) -> bool:
        """True when `action` should rather wait for cores on a node where its image (or its
        layer) is than fetch it onto `node`, the soonest node with free cores: the cores there
        are expected back (the earliest expected end of a running action) sooner than the
        fetch onto `node` ends. It waits at most as long as that fetch would take; an evicted
        trajectory waits for the node with its layer up to `LAYER_PATIENCE_S`."""
        cost = self.cost_s(action, node)
        waited_s = self.now_s - action.submitted_s
        if cost is None or cost < 0:
            return False
        if self.layer_node(action.trajectory_id) not in (None, node):
            return waited_s < max(cost, LAYER_PATIENCE_S)  # elsewhere, its files are lost
        if cost == 0 or waited_s >= cost:
            return False
        state = self.state
        for name, cpu in state.cpu.items():
            if name == node or not cpu.online or not self._comes(action.image, name):
                continue
            there = self.cost_s(action, name)
            if there is None or there >= cost:
                continue
            ends = [
                state.expected_end_s.get(aid, self.now_s)
                for g in range(len(cpu.numa))
                for aid in state.running_in(ResourceKind.CPU, name, g)
            ]
            if ends and max(min(ends) - self.now_s, there) < cost:
                return True
        return False

    def placed(self, action: QueuedAction, node: str) -> None:
        """`action`'s new sandbox goes to `node`: its image comes there (if it is not there)."""
        store = self.state.cpu[node].store
        key = (node, action.image)
        if store is None or key in self.chosen or action.trajectory_id in store.layers:
            return
        wait = self.cost_s(action, node)
        self.chosen[key] = wait if wait is not None else 0.0
        if not store.has(action.image):
            self.link_s[node] = self.link_s.get(node, 0.0) + self.size_mb(action) / store.mb_per_s
