"""Evict-on-execution, the acting half: one `ReplicaManager` per GPU node.

A batch leases a replica of its service: if the service is not resident on the chunk it is loaded
there, evicting least-recently-used idle replicas when the GPUs' memory budget is full. Replicas
stay cached after their batches finish. `scale()` grows a hot service across chunks and unloads
idle extras. Decisions come from `placement` (pure); this class only carries them out through a
`Controller` (Triton in production, `testing.FakeController` in unit tests).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any, Protocol

from reward_servers.errors import ModelLoadFailed, NoCapacity
from reward_servers.naming import parse_name
from reward_servers.placement import (
    NodeReplicas,
    Placement,
    Replica,
    ReplicaState,
    ScalingPlan,
    ScalingPolicy,
    plan_placement,
    plan_scaling,
    plan_warmup,
)


class Controller(Protocol):
    """What the manager needs from a model server."""

    def load(self, name: str) -> None: ...
    def unload(self, name: str) -> None: ...
    def is_ready(self, name: str) -> bool: ...


class ReplicaManager:
    """Leases replicas to batches; loads, evicts and scales them. Thread-safe."""

    def __init__(
        self,
        controller: Controller,
        num_gpus: int,
        gpu_memory_mb: int,
        memory_mb: Mapping[str, int],
        *,
        policy: ScalingPolicy = ScalingPolicy(),
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.controller = controller
        self.node = NodeReplicas(num_gpus, gpu_memory_mb)
        self.memory_mb = dict(memory_mb)  # model -> MiB per GPU of a replica
        self.policy = policy
        self.clock = clock
        # loads: on demand, for a request (restores); warm_loads: ahead of requests (`warm`)
        self.stats = {
            "hits": 0,
            "loads": 0,
            "warm_loads": 0,
            "evictions": 0,
            "load_failures": 0,
            "load_s": 0.0,
        }
        self._cond = threading.Condition()

    # ---- leasing ------------------------------------------------------------------------------
    def acquire(
        self, model: str, dop: int, chunk: tuple[int, ...] | None = None, timeout_s: float = 60.0
    ) -> Replica:
        """A ready replica of (model, dop), on `chunk` if given, with one more request in flight.

        Raises NoCapacity after `timeout_s` if every candidate chunk is held by in-flight work,
        ModelLoadFailed if Triton cannot load it.
        """
        if model not in self.memory_mb:
            raise KeyError(f"unknown reward model {model!r}")
        deadline = self.clock() + timeout_s
        with self._cond:
            while True:
                plan = plan_placement(self.node, model, dop, self.memory_mb[model], chunk)
                if plan is not None and not plan.load:
                    r = self.node.replicas[plan.replica]
                    if r.state is ReplicaState.READY:
                        r.in_flight += 1
                        r.last_used_s = self.clock()
                        self.stats["hits"] += 1
                        return r
                elif plan is not None:
                    break
                left = deadline - self.clock()
                if left <= 0:
                    raise NoCapacity(f"no chunk for {model} dop {dop} (chunk {chunk}) within {timeout_s} s")
                self._cond.wait(min(left, 1.0))  # woken when a load ends or a lease is released
            new = self._begin_load(plan, model, dop)
        return self._finish_load(plan, new)

    def release(self, replica: Replica) -> None:
        """End one lease of `replica` (the replica stays cached)."""
        with self._cond:
            replica.in_flight -= 1
            replica.last_used_s = self.clock()
            self._cond.notify_all()

    @contextmanager
    def lease(self, model: str, dop: int, chunk: tuple[int, ...] | None = None) -> Iterator[Replica]:
        """`with manager.lease(model, dop, chunk) as replica:` send the batch to `replica.name`."""
        r = self.acquire(model, dop, chunk)
        try:
            yield r
        finally:
            self.release(r)

    # ---- acting -------------------------------------------------------------------------------
    def _begin_load(self, plan: Placement, model: str, dop: int) -> Replica:
        """Under the lock: hand the victims' memory to the newcomer, which starts leased."""
        for v in plan.victims:
            self.node.transition(v, ReplicaState.UNLOADING)
        r = Replica(plan.replica, model, dop, plan.chunk, self.memory_mb[model], in_flight=1)
        r.last_used_s = self.clock()
        self.node.replicas[r.name] = r
        return r

    def _finish_load(self, plan: Placement, r: Replica, leased: bool = True, stat: str = "loads") -> Replica:
        """Outside the lock: unload victims, load the replica; on failure drop it and re-raise."""
        t0 = self.clock()
        try:
            self._unload(plan.victims)
            self.controller.load(r.name)
        except Exception:
            with self._cond:
                self.node.replicas.pop(r.name, None)
                self.stats["load_failures"] += 1
                self._cond.notify_all()
            raise
        with self._cond:
            self.node.transition(r.name, ReplicaState.READY)
            if not leased:
                r.in_flight -= 1
            self.stats[stat] += 1
            self.stats["load_s"] += self.clock() - t0
            self._cond.notify_all()
        return r

    def _unload(self, names: tuple[str, ...]) -> None:
        for name in names:
            try:
                self.controller.unload(name)
            finally:
                with self._cond:
                    self.node.replicas.pop(name, None)
                    self.stats["evictions"] += 1

    def preload(self, model: str, dop: int, chunk: tuple[int, ...] | None = None) -> Replica:
        """Make (model, dop) resident (on `chunk` if given) without leasing it."""
        r = self.acquire(model, dop, chunk)
        self.release(r)
        return r

    def plan_warm(self, services: list[tuple[str, int]]) -> tuple[Placement, ...]:
        """Where `warm` should load (model, dop) services ahead of requests (`plan_warmup`)."""
        with self._cond:
            return plan_warmup(self.node, [(m, d, self.memory_mb[m]) for m, d in services])

    def warm(self, placement: Placement) -> bool:
        """Load one planned warm-up replica, unless it is there already or requests took the
        memory since planning (warming never evicts). True when it was loaded."""
        model, dop, chunk = parse_name(placement.replica)
        assert chunk is not None
        with self._cond:
            mem = self.memory_mb[model]
            if placement.replica in self.node.replicas or any(
                self.node.used_mb(g) + mem > self.node.gpu_memory_mb for g in chunk
            ):
                return False
            plan = Placement(placement.replica, chunk, load=True)
            new = self._begin_load(plan, model, dop)
        self._finish_load(plan, new, leased=False, stat="warm_loads")
        return True

    def wait_loaded(self, replica: str, timeout_s: float = 120.0) -> bool:
        """Wait while `replica` is loading (a warm-up or a call's restore); True once ready."""
        deadline = self.clock() + timeout_s
        with self._cond:
            while True:
                r = self.node.replicas.get(replica)
                if r is None or r.state is ReplicaState.UNLOADING:
                    return False
                if r.state is ReplicaState.READY:
                    return True
                left = deadline - self.clock()
                if left <= 0:
                    return False
                self._cond.wait(min(left, 1.0))

    def retire(self, replica: str) -> bool:
        """Unload `replica` if it is idle (a warm instance the load outgrew; the scheduler's
        `warm_gpu.oversized`). True when it was unloaded."""
        with self._cond:
            r = self.node.replicas.get(replica)
            if r is None or not r.idle:
                return False
            self.node.transition(replica, ReplicaState.UNLOADING)
        self._unload((replica,))
        with self._cond:
            self._cond.notify_all()
        return True

    def scale(self, demand: Mapping[tuple[str, int], int]) -> ScalingPlan:
        """Apply one autoscaling round for `demand` ((model, dop) -> queued requests)."""
        with self._cond:
            plan = plan_scaling(self.node, demand, self.memory_mb, self.clock(), self.policy)
            started = []
            for p in plan.grow:
                if p.replica in self.node.replicas or any(
                    self.node.replicas.get(v) is None or not self.node.replicas[v].idle for v in p.victims
                ):
                    continue  # the table moved since planning
                started.append((p, self._begin_load(p, *parse_name(p.replica)[:2])))
            shrink = tuple(n for n in plan.shrink if n in self.node.replicas and self.node.replicas[n].idle)
            for n in shrink:
                self.node.transition(n, ReplicaState.UNLOADING)
        self._unload(shrink)
        for p, r in started:
            try:
                self._finish_load(p, r, leased=False)
            except ModelLoadFailed:
                pass  # growth is best effort; the failure is counted in stats
        return ScalingPlan(tuple(p for p, _ in started), shrink)

    def adopt(self, names: list[str]) -> list[str]:
        """Register replicas already loaded in Triton (e.g. preloaded by deploy); returns those kept.

        A name this node cannot hold (unknown model, no memory left) is not adopted.
        """
        kept = []
        with self._cond:
            for name in sorted(names):
                try:
                    model, dop, chunk = parse_name(name)
                except ValueError:
                    continue
                if model not in self.memory_mb or chunk is None or name in self.node.replicas:
                    continue
                mem = self.memory_mb[model]
                if any(self.node.used_mb(g) + mem > self.node.gpu_memory_mb for g in chunk):
                    continue
                r = Replica(name, model, dop, chunk, mem, ReplicaState.READY, last_used_s=self.clock())
                self.node.replicas[name] = r
                kept.append(name)
        return kept

    def reset(self) -> None:
        """Forget every replica (after a server restart nothing is resident)."""
        with self._cond:
            self.node.replicas.clear()
            self._cond.notify_all()

    def snapshot(self) -> dict[str, Any]:
        """Replica table, per-GPU memory use (MiB) and counters, for status and benchmarks."""
        with self._cond:
            return {
                "replicas": [
                    {"name": r.name, "state": str(r.state), "chunk": list(r.chunk), "in_flight": r.in_flight}
                    for r in sorted(self.node.replicas.values(), key=lambda r: r.name)
                ],
                "gpu_used_mb": [self.node.used_mb(g) for g in range(self.node.num_gpus)],
                "stats": dict(self.stats),
            }

    def resident(self) -> dict[tuple[int, ...], list[str]]:
        """chunk -> ready services there, least recently used first (the scheduler's `resident` map)."""
        with self._cond:
            out: dict[tuple[int, ...], list[Replica]] = {}
            for r in self.node.replicas.values():
                if r.state is ReplicaState.READY:
                    out.setdefault(r.chunk, []).append(r)
            return {c: [r.service for r in sorted(rs, key=lambda r: r.last_used_s)] for c, rs in out.items()}
