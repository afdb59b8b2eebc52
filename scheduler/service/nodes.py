"""Nodes joining and leaving at run time: the scheduler's side of `common.node_record`.

Each pass (`NodeBook.sync`, a few times a second) reads the nodes' records and the live pools:
- a node `ready` (or `draining`) that the state does not hold, with a live worker, is added to
  the `ClusterState` as its record says (cores per NUMA group and memory, or GPUs and memory per
  GPU); a declared node whose worker registered another shape takes it while nothing is placed
  there. The round places on it from the next step.
- a `draining` node takes nothing new (`block`, before every round: it is not online and lends
  no free unit; no rider, sharer or loan goes there either), and its trajectories are released
  as soon as none of their actions runs there (`drained`): their next actions start over on
  another node, reported as a reset (an image trajectory's kept layer stays with the node).
  Its running actions finish (the worker's warm shutdown).
- a `left` node (its worker finished and exited) is gone at once (`gone`: the liveness pass
  takes it offline, which sends an action dispatched there but never taken back to the queue),
  and an undeclared one is removed from the state when nothing of it is left, its record with it.
- a node whose worker stops beating without leaving is lost, as before: liveness takes its
  pool offline and its trajectories move.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from scheduler.gpu_cache import GpuCache
from scheduler.model import ResourceKind
from scheduler.resources import ClusterState, CpuNode, GpuNode
from scheduler.restore_cost import RestoreCosts
from tangram_celery.common.metrics import SchedulerMetrics
from tangram_celery.common.node_record import NodeLoad, NodeRecord, NodeState

log = logging.getLogger("tangram.scheduler")


@dataclass
class NodeChanges:
    """What one `sync` changed: nodes added, reshaped, removed; pools draining or gone now."""

    added: list[str] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)
    draining: set[str] = field(default_factory=set)
    gone: set[str] = field(default_factory=set)

    @property
    def shape_changed(self) -> bool:
        return bool(self.added or self.removed)


class NodeBook:
    """The nodes the scheduler learned from their records (module doc); the declared ones are
    in the state from the start (`build_cluster`)."""

    def __init__(
        self,
        state: ClusterState,
        declared: set[str],
        restore_costs: RestoreCosts,
        footprint_mb: Callable[[str, int], int],
    ) -> None:
        self.state, self.declared = state, declared
        self.restore_costs, self.footprint_mb = restore_costs, footprint_mb
        self.draining: set[str] = set()  # pool keys
        self.gone: set[str] = set()  # pool keys of nodes that left
        self.joined: dict[str, str] = {}  # pool key -> worker incarnation of its record
        self.records: dict[str, NodeRecord] = {}

    def sync(self, records: Mapping[str, NodeRecord], live: set[str]) -> NodeChanges:
        """Bring the state in line with the records (`live`: pool keys with a beating worker)."""
        out = NodeChanges()
        self.records = dict(records)
        for rec in records.values():
            key = rec.pool_key
            if rec.state is NodeState.LEFT:
                if key not in self.gone:
                    log.info("node %s left", rec.name)
                self.gone.add(key)
                self.draining.discard(key)
                continue
            if rec.state is NodeState.JOINING or key not in live:
                continue
            self.gone.discard(key)
            if self._has(rec) and self.joined.get(key) != rec.worker and self._idle(rec):
                self._reshape(rec)
            if not self._has(rec):
                self._add(rec)
                out.added.append(key)
            self.joined[key] = rec.worker
            if rec.state is NodeState.DRAINING:
                if key not in self.draining:
                    log.info("node %s draining: nothing new goes there", rec.name)
                self.draining.add(key)
            else:
                self.draining.discard(key)
        for key in list(self.draining):  # a record removed by hand: the node is gone
            if key.partition(":")[2] not in records:
                self.draining.discard(key)
                self.gone.add(key)
        out.removed = self._remove_empty(records, live)
        out.draining, out.gone = set(self.draining), set(self.gone)
        return out

    def _has(self, rec: NodeRecord) -> bool:
        return rec.name in (self.state.cpu if rec.kind == "cpu" else self.state.gpu)

    def _idle(self, rec: NodeRecord) -> bool:
        """Nothing runs on the node and no trajectory is pinned there."""
        kind = ResourceKind.CPU if rec.kind == "cpu" else ResourceKind.GPU
        if any(a.kind is kind and a.pool == rec.name for a in self.state.running.values()):
            return False
        return rec.kind == "gpu" or rec.name not in self.state.trajectory_node.values()

    def _add(self, rec: NodeRecord) -> None:
        if rec.kind == "cpu":
            self.state.cpu[rec.name] = CpuNode(name=rec.name, numa=rec.numa, memory_mb=rec.memory_mb)
            log.info("node %s joined: %d cores, %d MiB", rec.name, rec.cores, rec.memory_mb)
            return
        g = GpuNode(
            name=rec.name,
            num_gpus=rec.num_gpus,
            gpu_memory_mb=rec.gpu_memory_mb,
            restore_costs=self.restore_costs,
        )
        cache = GpuCache(g.gpu_memory_mb, self.footprint_mb)
        g.resident = cache.resident
        self.state.gpu[rec.name] = g
        self.state.gpu_cache[rec.name] = cache
        log.info("node %s joined: %d GPUs of %d MiB", rec.name, rec.num_gpus, rec.gpu_memory_mb)

    def _reshape(self, rec: NodeRecord) -> None:
        """A new worker of a known, idle node registered: take its shape if it differs."""
        if rec.kind == "cpu":
            node = self.state.cpu[rec.name]
            if node.numa == rec.numa and node.memory_mb == rec.memory_mb:
                return
            del self.state.cpu[rec.name]
        else:
            g = self.state.gpu[rec.name]
            if g.num_gpus == rec.num_gpus and g.gpu_memory_mb == rec.gpu_memory_mb:
                return
            del self.state.gpu[rec.name]
            self.state.gpu_cache.pop(rec.name, None)
        log.info("node %s registered a new shape", rec.name)
        self._add(rec)

    def _remove_empty(self, records: Mapping[str, NodeRecord], live: set[str]) -> list[str]:
        """Undeclared nodes with nothing running or pinned that left, lost their record, or
        were lost (no live worker, taken offline): out of the state (a lost one that beats
        again is added back)."""
        lost = {
            r.pool_key
            for r in records.values()
            if r.state is not NodeState.LEFT and r.pool_key not in live and r.pool_key in self.state.offline
        }
        removed = []
        for key in sorted(self.gone | lost):
            kind, _, name = key.partition(":")
            if name in self.declared:
                continue
            probe = NodeRecord(name=name, kind="cpu" if kind == "cpu" else "gpu")
            if not self._has(probe) or not self._idle(probe):
                continue
            if kind == "cpu":
                del self.state.cpu[name]
            else:
                del self.state.gpu[name]
                self.state.gpu_cache.pop(name, None)
            self.state.offline.discard(key)
            self.gone.discard(key)
            self.joined.pop(key, None)
            removed.append(key)
            log.info("node %s removed", name)
        return removed

    def block(self) -> None:
        """Before a round: draining nodes take nothing new (no free unit, not online)."""
        for key in self.draining:
            kind, _, name = key.partition(":")
            if kind == "cpu":
                node = self.state.cpu.get(name)
                if node is not None:
                    node.online = False
                    node.free.clear()
            else:
                g = self.state.gpu.get(name)
                if g is not None:
                    g.free.clear()

    def drained(self) -> list[str]:
        """Trajectories pinned to draining CPU nodes with no action running: to release."""
        nodes = {k.partition(":")[2] for k in self.draining if k.startswith("cpu:")}
        if not nodes:
            return []
        running = self.state.trajectory_running
        return [t for t, n in self.state.trajectory_node.items() if n in nodes and t not in running]

    def loads(self, now_s: float) -> dict[str, NodeLoad]:
        """Each CPU/GPU node's load, for `tangram nodes` and the metrics."""
        used: dict[str, set[int]] = {}
        count: dict[str, int] = {}
        for a in self.state.running.values():
            if a.kind is ResourceKind.API:
                continue
            key = f"{a.kind}:{a.pool}"
            used.setdefault(key, set()).update(a.unit_ids)
            count[key] = count.get(key, 0) + 1
        pinned: dict[str, int] = {}
        for n in self.state.trajectory_node.values():
            pinned[n] = pinned.get(n, 0) + 1
        out: dict[str, NodeLoad] = {}
        for kind, nodes in (("cpu", self.state.cpu), ("gpu", self.state.gpu)):
            for name, node in nodes.items():
                key = f"{kind}:{name}"
                units = sum(len(g) for g in node.numa) if isinstance(node, CpuNode) else node.num_gpus
                state = (
                    "gone"
                    if key in self.gone
                    else "draining"
                    if key in self.draining
                    else "offline"
                    if key in self.state.offline
                    else "ready"
                )
                out[name] = NodeLoad(
                    kind="cpu" if kind == "cpu" else "gpu",
                    units=units,
                    in_use=len(used.get(key, ())),
                    running=count.get(key, 0),
                    pinned=pinned.get(name, 0) if kind == "cpu" else 0,
                    state=state,
                    at_s=now_s,
                )
        return out


def node_gauges(
    metrics: SchedulerMetrics, loads: Mapping[str, NodeLoad], records: Mapping[str, NodeRecord]
) -> None:
    """Nodes per kind and state (a node the state holds without a record is a declared one not
    registered yet: `ready` when it is online, as before nodes registered), and each node's
    units in use and total."""
    counts: dict[tuple[str, str], int] = {}
    for name, load in loads.items():
        rec = records.get(name)
        state = load.state
        if rec is not None and rec.state is NodeState.JOINING:
            state = "joining"
        elif state == "gone":
            state = "left"
        elif state == "offline":
            state = "lost"
        counts[(load.kind, state)] = counts.get((load.kind, state), 0) + 1
        metrics.node_units.labels(node=name, what="total").set(load.units)
        metrics.node_units.labels(node=name, what="in_use").set(load.in_use)
    for kind in ("cpu", "gpu"):
        for state in ("joining", "ready", "draining", "lost", "left"):
            metrics.nodes.labels(kind=kind, state=state).set(counts.get((kind, state), 0))
