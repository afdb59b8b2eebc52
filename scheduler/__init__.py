"""Tangram's scheduling core: action model, resource state, pure policies, simulator.

Nothing in this package does I/O, except `scheduler.service` (the live control loop) and
the simulator's trace files. Policies are pure functions of (queue, cluster state, now).

Imports go one way: the core modules here (model, resources, queue, execution, ...) <-
`scheduler.policies` <- `scheduler.round` (the round around a policy) <- `scheduler.sim` and
`scheduler.service` (its two executors).
"""

from scheduler.model import (
    Allocation,
    CostVector,
    Elastic,
    QueuedAction,
    ResourceKind,
)
from scheduler.resources import ApiPool, ClusterState, CpuNode, GpuNode

__all__ = [
    "Allocation",
    "ApiPool",
    "ClusterState",
    "CostVector",
    "CpuNode",
    "Elastic",
    "GpuNode",
    "QueuedAction",
    "ResourceKind",
]
