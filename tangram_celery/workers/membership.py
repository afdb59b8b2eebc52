"""A worker's node joining and leaving (`common.node_record`): which node it serves, with what
capacity, and its record through the worker's life.

- `node_name`: `--node`, else `$TANGRAM_NODE`, else the host name (a compose replica's
  container host name), made a valid node name.
- `resolve_cpu` / `resolve_gpu`: the node's capacity (`workers.capacity`: flags, then the
  config's entry of that name, then detection) and a config in which the node is declared as
  such, for the worker's own settings (sandbox sizes, slots, the reward service).
- `Membership`: registers the node (`joining`) when the worker starts, marks it `ready` when
  its Celery consumer takes messages, `draining` first thing on SIGTERM (Celery's warm
  shutdown then lets the running actions finish), and `left` once the worker is done.
"""

from __future__ import annotations

import logging
import os
import re
import socket
import time
from collections.abc import Mapping
from typing import Any

from tangram_celery.common.config import TangramConfig
from tangram_celery.common.node_record import NodeRecord, NodeState
from tangram_celery.store import Store
from tangram_celery.workers.capacity import (
    Caps,
    HostCapacity,
    as_cpu_config,
    cpu_capacity,
    detect,
    gpu_capacity,
)

log = logging.getLogger("tangram.worker")

DEFAULT_GPU_MB = 16384  # a GPU node's memory per GPU when nothing says (CPU-kind Triton)


def node_name(given: str | None, env: Mapping[str, str] | None = None, host: str | None = None) -> str:
    """The node a CPU/GPU worker serves: `given`, else `$TANGRAM_NODE`, else the host name,
    lower-cased with anything a node name may not hold turned into '-' (63 characters)."""
    environ: Mapping[str, str] = os.environ if env is None else env
    raw = given or environ.get("TANGRAM_NODE") or host or socket.gethostname()
    name = re.sub(r"[^a-z0-9_.-]", "-", raw.lower()).lstrip("-_.")[:63]
    if not name:
        raise ValueError(f"cannot make a node name of {raw!r}; give --node")
    return name


def resolve_cpu(
    cfg: TangramConfig, name: str, caps: Caps, host: HostCapacity | None = None
) -> tuple[TangramConfig, NodeRecord]:
    """CPU node `name`'s record (capacity, not yet its languages) and `cfg` with the node
    declared as it lends (replacing its entry, if any)."""
    declared = next((n for n in cfg.nodes.cpu if n.name == name), None)
    host = host if host is not None else detect()
    groups, memory = cpu_capacity(name, host, declared, caps)
    entry = as_cpu_config(name, groups, memory)
    if declared is not None and caps == Caps():
        entry = declared  # as written (its core_offset included)
    others = tuple(n for n in cfg.nodes.cpu if n.name != name)
    local = cfg.model_copy(update={"nodes": cfg.nodes.model_copy(update={"cpu": (*others, entry)})})
    record = NodeRecord(name=name, kind="cpu", declared=declared is not None, numa=groups, memory_mb=memory)
    return local, record


def resolve_gpu(
    cfg: TangramConfig, name: str, caps: Caps, host: HostCapacity | None = None
) -> tuple[TangramConfig, NodeRecord]:
    """GPU node `name`'s record and `cfg` with the node declared as it lends."""
    declared = next((n for n in cfg.nodes.gpu if n.name == name), None)
    host = host if host is not None else detect()
    need = max((m.memory_mb for m in cfg.reward_models if m.backend != "rule"), default=0)
    gpus, mb = gpu_capacity(name, host, declared, caps, max(DEFAULT_GPU_MB, need))
    if declared is not None:
        entry = declared.model_copy(update={"num_gpus": gpus, "gpu_memory_mb": mb})
    else:
        from tangram_celery.common.config import GpuNodeConfig

        entry = GpuNodeConfig(name=name, num_gpus=gpus, gpu_memory_mb=mb)
    others = tuple(n for n in cfg.nodes.gpu if n.name != name)
    local = cfg.model_copy(update={"nodes": cfg.nodes.model_copy(update={"gpu": (*others, entry)})})
    record = NodeRecord(
        name=name,
        kind="gpu",
        declared=declared is not None,
        num_gpus=gpus,
        gpu_memory_mb=mb,
        memory_mb=host.memory_mb,
    )
    return local, record


class Membership:
    """The node record of one worker incarnation, moved on through its life (module doc)."""

    def __init__(self, store: Store, record: NodeRecord, worker: str) -> None:
        self.store = store
        self.record = record.model_copy(update={"worker": worker, "host": socket.gethostname()})
        self.state = NodeState.JOINING

    def join(self, languages: list[str] | None = None) -> None:
        """Register the node (`joining`): the scheduler sees it, places nothing there yet."""
        update: dict[str, Any] = {"registered_s": time.time(), "state": NodeState.JOINING}
        if languages is not None:
            update["languages"] = tuple(languages)
        self.record = self.record.model_copy(update=update)
        self.store.register_node(self.record)
        r = self.record
        what = (
            f"{r.cores} cores in {len(r.numa)} NUMA group(s)" if r.kind == "cpu" else f"{r.num_gpus} GPU(s)"
        )
        log.info(
            "node %s joining: %s, %d MiB", r.name, what, r.memory_mb if r.kind == "cpu" else r.gpu_memory_mb
        )

    def move(self, state: NodeState) -> None:
        """Move the record to `state` (never back from draining or left)."""
        order = [NodeState.JOINING, NodeState.READY, NodeState.DRAINING, NodeState.LEFT]
        if order.index(state) <= order.index(self.state):
            return
        self.state = state
        try:
            # briefly: a worker stopping after Redis (the end of `tangram up`) must not wait for it
            at_s = time.time()
            if not self.store.set_node_state(self.record.name, self.record.worker, state, at_s, budget_s=5.0):
                log.warning(
                    "node %s: its record is another worker's now; not marked %s", self.record.name, state
                )
                return
        except Exception as e:  # Redis away: the scheduler's liveness handles the node as lost
            log.warning("node %s: could not mark it %s: %s", self.record.name, state, e)
            return
        log.info("node %s %s", self.record.name, state)

    def hook(self) -> None:
        """Follow the Celery worker: ready once it consumes, draining on its warm shutdown
        (SIGTERM, SIGINT: sent from the signal handler, before the consumer stops)."""
        from celery.signals import worker_ready, worker_shutting_down

        def ready(**_: object) -> None:
            self.move(NodeState.READY)

        def draining(**_: object) -> None:
            self.move(NodeState.DRAINING)

        worker_ready.connect(ready, weak=False)
        worker_shutting_down.connect(draining, weak=False)
        self._hooks = (ready, draining)

    def leave(self) -> None:
        """The worker is done (its running actions finished): the node is `left`."""
        self.move(NodeState.DRAINING)
        self.move(NodeState.LEFT)
