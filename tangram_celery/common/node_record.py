"""A node's membership record (`tangram:nodes`, node name -> `NodeRecord`): worker -> scheduler,
`tangram nodes`, metrics.

A worker writes its node's record when it starts (`joining`), once its Celery consumer takes
messages (`ready`), when it gets SIGTERM (`draining`: no new work goes there) and after its
last running action finished (`left`). The scheduler adds a node it does not know from the next
pass after it is `ready`, stops placing on a `draining` one, and removes a `left` one. `lost` is
never written: it is a node whose record says it serves (joining, ready, draining) while none of
its workers beats (`view_state`). The capacity is what the worker detected on its host, capped
by the operator (`tangram worker --cores/--cpuset/--memory-mb/--gpus/--gpu-memory-mb`) and by
the config's `nodes:` entry of the same name, when there is one (`workers.capacity`).

The scheduler also publishes each node's load (`tangram:node_load`, node -> `NodeLoad`) with
its periodic pass, for `tangram nodes` and the metrics.
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import StrEnum
from typing import Literal

from pydantic import Field

from tangram_celery.common.records import _Record


class NodeState(StrEnum):
    JOINING = "joining"
    READY = "ready"
    DRAINING = "draining"
    LEFT = "left"
    LOST = "lost"  # derived by readers (`view_state`), never written


SERVING = (NodeState.JOINING, NodeState.READY, NodeState.DRAINING)


class NodeRecord(_Record):
    """One node as its worker registered it.

    `numa`: the host core ids the node lends, per NUMA group (CPU nodes); `memory_mb`: memory for
    sandboxes; `languages`: what its sandboxes run; `num_gpus` / `gpu_memory_mb` (per GPU): GPU
    nodes; `declared`: the config has a `nodes:` entry of this name; `worker`: the incarnation
    that wrote it (only it moves the state on); times are epoch seconds of the worker's clock."""

    name: str
    kind: Literal["cpu", "gpu"]
    state: NodeState = NodeState.JOINING
    worker: str = ""
    host: str = ""
    declared: bool = False
    numa: tuple[tuple[int, ...], ...] = ()
    memory_mb: int = Field(0, ge=0)
    languages: tuple[str, ...] = ()
    num_gpus: int = Field(0, ge=0)
    gpu_memory_mb: int = Field(0, ge=0)
    registered_s: float = 0.0
    ready_s: float | None = None
    draining_s: float | None = None
    left_s: float | None = None

    @property
    def cores(self) -> int:
        return sum(len(g) for g in self.numa)

    @property
    def pool_key(self) -> str:
        return f"{self.kind}:{self.name}"

    @property
    def units(self) -> int:
        """Cores of a CPU node, GPUs of a GPU node."""
        return self.cores if self.kind == "cpu" else self.num_gpus


class NodeLoad(_Record):
    """A node's load as the scheduler sees it (`tangram:node_load`): its `kind`, units in use of `units`
    (cores or GPUs), actions running there, trajectories pinned there, and the state it has
    for the node (`draining`, `offline` or `ready`) at `at_s` (the scheduler's clock)."""

    kind: Literal["cpu", "gpu"] = "cpu"
    units: int = Field(0, ge=0)
    in_use: int = Field(0, ge=0)
    running: int = Field(0, ge=0)
    pinned: int = Field(0, ge=0)
    state: str = "ready"
    at_s: float = 0.0


def view_state(record: NodeRecord, live_pools: set[str]) -> NodeState:
    """The state to show: the record's, or `lost` when it says it serves and no worker of its
    pool beats (`live_pools`: pool keys of the live workers)."""
    if record.state in SERVING and record.pool_key not in live_pools:
        return NodeState.LOST
    return record.state


def live_pools(
    server_now_s: float, workers: Mapping[str, tuple[float, str]], dead_after_s: float
) -> set[str]:
    """Pool keys with a worker that beat within `dead_after_s` (`Store.workers()`'s answer)."""
    return {p for t, p in workers.values() if server_now_s - t <= dead_after_s}
