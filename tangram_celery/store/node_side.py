"""Node membership in the store: a worker registers its node and moves its state on (joining ->
ready -> draining -> left); the scheduler reads the records, publishes each node's load and
removes the records of nodes that left (`common.node_record`)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping

import redis

from tangram_celery.common.node_record import NodeLoad, NodeRecord, NodeState
from tangram_celery.store.base import StoreBase
from tangram_celery.store.keys import NODE_LOAD, NODES

log = logging.getLogger("tangram.store")


class NodeSide(StoreBase):
    def register_node(self, record: NodeRecord) -> None:
        """Write `record` as its node's (a new incarnation replaces the last one's)."""
        self.retrying("register node", lambda: self.r.hset(NODES, record.name, record.dump()))

    def set_node_state(
        self, name: str, worker: str, state: NodeState, at_s: float, budget_s: float | None = None
    ) -> bool:
        """Move node `name`'s record to `state` (stamping `<state>_s`), if `worker` wrote it;
        retrying for `budget_s` while Redis is away (default: the store's budget)."""

        def change(rec: NodeRecord) -> NodeRecord | None:
            if rec.worker != worker:
                return None
            return rec.model_copy(update={"state": state, f"{state}_s": at_s})

        return self.retrying("node state", lambda: self._swap_node(name, change), budget_s)

    def node_records(self) -> dict[str, NodeRecord]:
        """Every node's record; an unreadable one is logged and left out."""
        out: dict[str, NodeRecord] = {}
        for name, raw in self.r.hgetall(NODES).items():
            try:
                out[str(name)] = NodeRecord.parse(raw)
            except ValueError as e:
                log.error("ignored the unreadable record of node %s: %s", name, e)
        return out

    def drop_left_node(self, name: str, worker: str) -> bool:
        """Remove node `name`'s record (and load) if it says `left` and `worker` wrote it."""
        return self._swap_node(
            name, lambda rec: None if rec.state != NodeState.LEFT or rec.worker != worker else rec, drop=True
        )

    def _swap_node(
        self, name: str, change: Callable[[NodeRecord], NodeRecord | None], drop: bool = False
    ) -> bool:
        """Replace node `name`'s record by `change(record)` (or remove it, `drop`), atomically
        against any other writer (WATCH); False when there is none or `change` says None."""
        with self.r.pipeline() as pipe:
            while True:
                try:
                    pipe.watch(NODES)
                    raw = pipe.hget(NODES, name)
                    new = change(NodeRecord.parse(raw)) if raw else None
                    if new is None:
                        pipe.unwatch()
                        return False
                    pipe.multi()
                    if drop:
                        pipe.hdel(NODES, name)
                        pipe.hdel(NODE_LOAD, name)
                    else:
                        pipe.hset(NODES, name, new.dump())
                    pipe.execute()
                    return True
                except redis.WatchError:
                    continue

    def publish_node_load(self, loads: Mapping[str, NodeLoad], gone: list[str]) -> None:
        """The scheduler's view of each node's load (for `tangram nodes` and the metrics)."""
        pipe = self.r.pipeline(transaction=False)
        if loads:
            pipe.hset(NODE_LOAD, mapping={n: v.dump() for n, v in loads.items()})
        if gone:
            pipe.hdel(NODE_LOAD, *gone)
        pipe.execute()

    def node_loads(self) -> dict[str, NodeLoad]:
        out: dict[str, NodeLoad] = {}
        for name, raw in self.r.hgetall(NODE_LOAD).items():
            try:
                out[str(name)] = NodeLoad.parse(raw)
            except ValueError:
                continue
        return out
