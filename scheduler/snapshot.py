"""Saving and rebuilding a `ClusterState`'s bookkeeping (`ClusterState.to_dict` / `restore`).

It reads and writes only the books (`scheduler.cluster_books.ClusterBooks`, the state's base
class), so `scheduler.resources` imports it and not the other way round.

The live service rebuilds its state after a restart from what Redis holds (its dispatch
records and pin records, `scheduler.service.recovery`) in this shape, and restores it onto a
freshly built cluster.
"""

from __future__ import annotations

from typing import Any

from scheduler.cluster_books import ClusterBooks
from scheduler.model import Allocation, ResourceKind
from scheduler.pools import CpuNode, GpuNode


def snapshot(state: ClusterBooks) -> dict[str, Any]:
    """What `restore` takes: pins, reservations, running allocations and their expected ends,
    and when each pinned trajectory was last used."""
    return {
        "trajectory_node": dict(state.trajectory_node),
        "trajectory_memory_mb": {n.name: dict(n.trajectory_memory_mb) for n in state.cpu.values()},
        "running": [a.to_dict() for a in state.running.values()],
        "expected_end_s": dict(state.expected_end_s),
        "running_trajectory": dict(state.running_trajectory),
        "trajectory_used_s": dict(state.trajectory_used_s),
    }


def restore(state: ClusterBooks, d: dict[str, Any]) -> None:
    """Re-apply saved bookkeeping onto a freshly built (all-free) cluster of the same shape:
    pins first, then each running allocation (units already held are a rider's), sharers of
    time-shared cores last."""
    state.trajectory_node = dict(d.get("trajectory_node", {}))
    state.pin_epoch += 1
    for name, mem in d.get("trajectory_memory_mb", {}).items():
        if name in state.cpu:
            state.cpu[name].trajectory_memory_mb = {k: int(v) for k, v in mem.items()}
    allocs = [Allocation.from_dict(raw) for raw in d.get("running", [])]
    # sharers last: the cores they time-share are their holders' (`ClusterState.share_cores`)
    for alloc in sorted(allocs, key=lambda a: a.shares):
        pools: dict[str, CpuNode] | dict[str, GpuNode] = (
            state.cpu if alloc.kind is ResourceKind.CPU else state.gpu
        )
        node = pools.get(alloc.pool) if alloc.kind is not ResourceKind.API else None
        if alloc.shares and alloc.pool in state.cpu:
            cpu = state.cpu[alloc.pool]
            for c in alloc.unit_ids:
                cpu.sharers[c] = cpu.sharers.get(c, 0) + 1
                if c in cpu.free:  # its holder ended before the restart
                    cpu.free.discard(c)
                    cpu.vacated.add(c)
            state.shared.add(alloc.action_id)
        elif node is not None:
            if alloc.unit_ids and not node.free.issuperset(alloc.unit_ids):
                # a rider: on a GPU chunk held by its batch, or on CPU cores after another action
                node.riders[alloc.unit_ids] = node.riders.get(alloc.unit_ids, 0) + 1
                state.shared.add(alloc.action_id)
            node.free.difference_update(alloc.unit_ids)
        elif alloc.kind is ResourceKind.API and alloc.pool in state.api:
            state.api[alloc.pool].in_flight += 1
        state.running[alloc.action_id] = alloc
        state._track(alloc)
    state.expected_end_s = {k: float(v) for k, v in d.get("expected_end_s", {}).items() if k in state.running}
    for aid, tid in d.get("running_trajectory", {}).items():
        if aid in state.running:
            state._busy(aid, tid)
    state.trajectory_used_s = {
        t: float(v) for t, v in d.get("trajectory_used_s", {}).items() if t in state.trajectory_node
    }
