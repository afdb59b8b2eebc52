"""Nodes joining and leaving during a simulated run (issue 39), as a trace states them.

A `NodeEvent` says that at `at_s` a node joins (a new one, or one that left coming back), is
drained (no new placements; its running actions finish; trajectories pinned there move with a
fresh sandbox), or is lost (its running actions are retried elsewhere, its sandboxes are gone).
`scheduler.sim.node_exec` carries them out; a workload trace keeps them in its header.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from scheduler.model import ResourceKind


class NodeChange(StrEnum):
    JOIN = "join"
    DRAIN = "drain"
    LOSE = "lose"


@dataclass(frozen=True, slots=True)
class NodeEvent:
    """`node` (a CPU or GPU node, by `kind`) joins, drains or is lost at `at_s` (simulated s).

    A node that joins with a name the cluster does not have is new: it has `cores` cores in
    `numa_groups` groups and `memory_mb` (CPU) or `gpus` GPUs (GPU); 0: the cluster's shape."""

    at_s: float
    change: NodeChange
    node: str
    kind: ResourceKind = ResourceKind.CPU
    cores: int = 0
    numa_groups: int = 0
    memory_mb: int = 0
    gpus: int = 0

    @property
    def pool(self) -> str:
        """The pool's name as `ClusterState.offline` spells it ("cpu:<node>", "gpu:<node>")."""
        return f"{self.kind}:{self.node}"

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"at_s": self.at_s, "change": str(self.change), "node": self.node}
        if self.kind is not ResourceKind.CPU:
            out["kind"] = str(self.kind)
        for key in ("cores", "numa_groups", "memory_mb", "gpus"):
            if getattr(self, key):
                out[key] = getattr(self, key)
        return out

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> NodeEvent:
        kind = ResourceKind(str(d.get("kind", "cpu")))
        if kind not in (ResourceKind.CPU, ResourceKind.GPU):
            raise ValueError(f"node event for {d.get('node')!r}: kind must be cpu or gpu, not {kind}")
        return cls(
            at_s=float(d["at_s"]),
            change=NodeChange(str(d["change"])),
            node=str(d["node"]),
            kind=kind,
            cores=int(d.get("cores", 0)),
            numa_groups=int(d.get("numa_groups", 0)),
            memory_mb=int(d.get("memory_mb", 0)),
            gpus=int(d.get("gpus", 0)),
        )


def spot_events(
    cpu_nodes: int,
    spot_nodes: int,
    lost_at_s: float,
    every_s: float,
    down_s: float,
    drain_nodes: int,
    drain_at_s: float,
    join_nodes: int,
    join_at_s: float,
) -> list[NodeEvent]:
    """A cluster of `cpu_nodes` ("cpu0".."cpuN-1") whose last `spot_nodes` are spot nodes, lost
    one every `every_s` from `lost_at_s` and each back `down_s` later; the `drain_nodes`
    before them drained for maintenance at `drain_at_s` and back `down_s` later; and
    `join_nodes` new nodes ("cpuN"...) joining at `join_at_s` (an autoscaler). By time."""
    out: list[NodeEvent] = []
    for k in range(spot_nodes):
        name, t = f"cpu{cpu_nodes - 1 - k}", lost_at_s + k * every_s
        out += [NodeEvent(t, NodeChange.LOSE, name), NodeEvent(t + down_s, NodeChange.JOIN, name)]
    for k in range(drain_nodes):
        name = f"cpu{cpu_nodes - 1 - spot_nodes - k}"
        out += [
            NodeEvent(drain_at_s, NodeChange.DRAIN, name),
            NodeEvent(drain_at_s + down_s, NodeChange.JOIN, name),
        ]
    out += [NodeEvent(join_at_s, NodeChange.JOIN, f"cpu{cpu_nodes + k}") for k in range(join_nodes)]
    return sorted(out, key=lambda e: e.at_s)
