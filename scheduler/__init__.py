"""Tangram's scheduling core: action model, resource state, pure policies, simulator.

Nothing in this package does I/O, except `scheduler.service` (the live control loop) and
the simulator's trace files. Policies are pure functions of (queue, cluster state, now).
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
