"""Evict-on-execution, the acting half: one `ReplicaManager` per GPU node.

A batch leases a replica of its service: if the service is not on the device on the chunk, its
replica there is restored from host memory (issue 38) or, if it has none, loaded cold, after
least-recently-used idle replicas leave the GPUs whose memory budget is full (offloaded to host
memory when the node has a host tier, else unloaded). Replicas stay cached after their batches
finish. `scale()` grows a hot service across chunks and takes idle extras off the device.
Decisions come from `placement` (pure); this class only carries them out through a
`Controller` (Triton and the replicas' control sockets in production, `testing.FakeController`
in unit tests).
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
from scheduler.gpu_cache import Tier


class Controller(Protocol):
    """What the manager needs from a model server."""

    def load(self, name: str) -> None: ...
    def unload(self, name: str) -> None: ...
    def is_ready(self, name: str) -> bool: ...
    def offload(self, name: str, instances: int) -> float: ...
    def restore(self, name: str, instances: int) -> float: ...


class ReplicaManager:
    """Leases replicas to batches; loads, evicts and scales them. Thread-safe."""

    def __init__(
        self,
        controller: Controller,
        num_gpus: int,
        gpu_memory_mb: int,
        memory_mb: Mapping[str, int],
        *,
        host_memory_mb: int = 0,
        host_process_mb: int = 0,
        policy: ScalingPolicy = ScalingPolicy(),
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.controller = controller
        self.node = NodeReplicas(
            num_gpus, gpu_memory_mb, host_memory_mb=host_memory_mb, host_process_mb=host_process_mb
        )
        self.memory_mb = dict(memory_mb)  # model -> MiB per GPU of a replica
        self.policy = policy
        self.clock = clock
        # loads: cold, on demand, for a request; warm_loads: ahead of requests (`warm`);
        # host_restores: on demand, from host memory; evictions: replicas that left the device
        # (offloads: of those, kept in host memory); drops: host copies unloaded for room
        self.stats = {
            "hits": 0,
            "loads": 0,
            "warm_loads": 0,
            "host_restores": 0,
            "warm_restores": 0,
            "evictions": 0,
            "offloads": 0,
            "drops": 0,
            "load_failures": 0,
            "restore_failures": 0,
            "load_s": 0.0,
            "restore_s": 0.0,
        }
        self._cond = threading.Condition()

    # ---- leasing ------------------------------------------------------------------------------
    def acquire(
        self, model: str, dop: int, chunk: tuple[int, ...] | None = None, timeout_s: float = 60.0
    ) -> Replica:
        """A ready replica of (model, dop), on `chunk` if given, with one more request in flight.

        Raises NoCapacity after `timeout_s` if every candidate chunk is held by in-flight work,
        ModelLoadFailed if Triton cannot load (or restore) it.
        """
        return self.acquire_traced(model, dop, chunk, timeout_s)[0]

    def acquire_traced(
        self, model: str, dop: int, chunk: tuple[int, ...] | None = None, timeout_s: float = 60.0
    ) -> tuple[Replica, Tier, float]:
        """`acquire`, and what it took: the tier the replica's weights came from (DEVICE: a hit,
        HOST: restored from host memory, COLD: loaded) and the seconds that took."""
        if model not in self.memory_mb:
            raise KeyError(f"unknown reward model {model!r}")
        deadline = self.clock() + timeout_s
        with self._cond:
            while True:
                plan = plan_placement(self.node, model, dop, self.memory_mb[model], chunk)
                if plan is not None and not plan.load and not plan.restore:
                    r = self.node.replicas[plan.replica]
                    if r.state is ReplicaState.READY:
                        r.in_flight += 1
                        r.last_used_s = self.clock()
                        self.stats["hits"] += 1
                        return r, Tier.DEVICE, 0.0
                elif plan is not None:
                    break
                left = deadline - self.clock()
                if left <= 0:
                    raise NoCapacity(f"no chunk for {model} dop {dop} (chunk {chunk}) within {timeout_s} s")
                self._cond.wait(min(left, 1.0))  # woken when a load ends or a lease is released
            t0 = self.clock()
            r = self._begin_restore(plan) if plan.restore else self._begin_load(plan, model, dop)
        if plan.restore:
            self._finish_restore(plan, r)
            return r, Tier.HOST, self.clock() - t0
        self._finish_load(plan, r)
        return r, Tier.COLD, self.clock() - t0

    def release(self, replica: Replica) -> None:
        """End one lease of `replica` (the replica stays cached)."""
        with self._cond:
            replica.in_flight -= 1
            replica.last_used_s = self.clock()
            self._cond.notify_all()

    @contextmanager
    def lease(self, model: str, dop: int, chunk: tuple[int, ...] | None = None) -> Iterator[Replica]:
        """`with manager.lease(model, dop, chunk) as replica:` send the batch to `replica.name`."""
        with self.lease_traced(model, dop, chunk) as (r, _, _):
            yield r

    @contextmanager
    def lease_traced(
        self, model: str, dop: int, chunk: tuple[int, ...] | None = None
    ) -> Iterator[tuple[Replica, Tier, float]]:
        """`lease`, yielding (replica, tier, seconds) as `acquire_traced` returns them."""
        r, tier, load_s = self.acquire_traced(model, dop, chunk)
        try:
            yield r, tier, load_s
        finally:
            self.release(r)

    # ---- acting -------------------------------------------------------------------------------
    def _hand_over(self, plan: Placement) -> None:
        """Under the lock: the victims leave the device (to host memory, or entirely if dropped
        or without a host tier) and the dropped host copies go; their memory is handed on."""
        gone = ReplicaState.OFFLOADING if self.node.host_memory_mb > 0 else ReplicaState.UNLOADING
        for v in plan.victims:
            self.node.transition(v, ReplicaState.UNLOADING if v in plan.drops else gone)
        for d in plan.drops:
            if d not in plan.victims:
                self.node.transition(d, ReplicaState.UNLOADING)

    def _begin_load(self, plan: Placement, model: str, dop: int) -> Replica:
        """Under the lock: hand the victims' memory to the newcomer, which starts leased."""
        self._hand_over(plan)
        r = Replica(plan.replica, model, dop, plan.chunk, self.memory_mb[model], in_flight=1)
        r.last_used_s = self.clock()
        self.node.replicas[r.name] = r
        return r

    def _begin_restore(self, plan: Placement) -> Replica:
        """Under the lock: the host-only replica starts its way back to the device, leased."""
        self._hand_over(plan)
        r = self.node.transition(plan.replica, ReplicaState.RESTORING)
        r.in_flight += 1
        r.last_used_s = self.clock()
        return r

    def _finish_load(self, plan: Placement, r: Replica, leased: bool = True, stat: str = "loads") -> Replica:
        """Outside the lock: move the victims, load the replica; on failure drop it and re-raise."""
        t0 = self.clock()
        try:
            self._move_victims(plan)
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

    def _finish_restore(
        self, plan: Placement, r: Replica, leased: bool = True, stat: str = "host_restores"
    ) -> Replica:
        """Outside the lock: move the victims, copy the replica's weights back to the device.
        A restore that fails unloads the replica (its state is unknown) and raises
        ModelLoadFailed, retryable: the next call loads it cold."""
        t0 = self.clock()
        try:
            self._move_victims(plan)
            self.controller.restore(r.name, r.dop)
        except Exception as e:
            with self._cond:
                self.node.transition(r.name, ReplicaState.UNLOADING)
                self.stats["restore_failures"] += 1
            self._unload((r.name,))
            with self._cond:
                self._cond.notify_all()
            raise ModelLoadFailed(r.name, f"restore from host memory failed: {e}") from None
        with self._cond:
            self.node.transition(r.name, ReplicaState.READY)
            if not leased:
                r.in_flight -= 1
            self.stats[stat] += 1
            self.stats["restore_s"] += self.clock() - t0
            self._cond.notify_all()
        return r

    def _move_victims(self, plan: Placement) -> None:
        host = self.node.host_memory_mb > 0
        offload = [v for v in plan.victims if host and v not in plan.drops]
        self._unload(tuple(v for v in plan.victims if v not in offload))
        self._unload(tuple(d for d in plan.drops if d not in plan.victims), stat="drops")
        with self._cond:
            self.stats["drops"] += sum(v in plan.drops for v in plan.victims)
        for v in offload:
            self._offload(v)

    def _offload(self, name: str, counted: bool = True) -> None:
        """A replica in OFFLOADING: its weights to host memory (HOST), or, if that fails, gone;
        `counted` in `evictions` and `offloads`."""
        with self._cond:
            r = self.node.replicas[name]
        try:
            self.controller.offload(name, r.dop)
        except Exception:
            with self._cond:
                self.node.transition(name, ReplicaState.UNLOADING)
            self._unload((name,))
            return
        with self._cond:
            self.node.transition(name, ReplicaState.HOST)
            self.stats["evictions"] += counted
            self.stats["offloads"] += counted
            self._cond.notify_all()

    def _unload(self, names: tuple[str, ...], stat: str = "evictions") -> None:
        for name in names:
            try:
                self.controller.unload(name)
            finally:
                with self._cond:
                    self.node.replicas.pop(name, None)
                    self.stats[stat] += 1

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
        """Carry out one planned warm-up placement or warm order, unless requests took the
        memory since planning (warming never evicts nor drops): load the replica (and, for a
        `host` placement, offload it at once), or restore it if it is in host memory. True
        when it was loaded or restored."""
        model, dop, chunk = parse_name(placement.replica)
        assert chunk is not None
        name = placement.replica
        with self._cond:
            mem = self.memory_mb[model]
            r = self.node.replicas.get(name)
            room = all(self.node.used_mb(g) + mem <= self.node.gpu_memory_mb for g in chunk)
            host_full = bool(self.node.host_memory_mb) and (
                self.node.host_used_mb() + self.node.host_mb(mem, dop) > self.node.host_memory_mb
            )
            if not room or (r is None and host_full):
                return False
            if r is not None:
                if r.state is not ReplicaState.HOST or placement.host:
                    return False
                plan = Placement(name, chunk, load=False, restore=True)
                r = self._begin_restore(plan)
            else:
                plan = Placement(name, chunk, load=True)
                r = self._begin_load(plan, model, dop)
        if plan.restore:
            self._finish_restore(plan, r, leased=False, stat="warm_restores")
            return True
        self._finish_load(plan, r, leased=False, stat="warm_loads")
        if placement.host:
            self.retire(name, counted=False)  # into the host tier at once: the device stays free
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

    def retire(self, replica: str, counted: bool = True) -> bool:
        """Take `replica` off the device if it is idle: offloaded to host memory with a host
        tier, else unloaded (a warm instance the load outgrew, the scheduler's
        `warm_gpu.oversized`; an idle extra). True when it left the device. Not `counted`: a
        warm-up's host placement, which is no eviction (its load is in `warm_loads`)."""
        with self._cond:
            r = self.node.replicas.get(replica)
            if r is None or not r.idle:
                return False
            offload = self.node.host_memory_mb > 0
            self.node.transition(replica, ReplicaState.OFFLOADING if offload else ReplicaState.UNLOADING)
        if offload:
            self._offload(replica, counted)
        else:
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
                if self._moved(p):
                    continue  # the table moved since planning
                if p.restore:
                    started.append((p, self._begin_restore(p)))
                else:
                    started.append((p, self._begin_load(p, *parse_name(p.replica)[:2])))
            shrink = tuple(n for n in plan.shrink if n in self.node.replicas and self.node.replicas[n].idle)
        for n in shrink:
            self.retire(n)
        for p, r in started:
            try:
                if p.restore:
                    self._finish_restore(p, r, leased=False)
                else:
                    self._finish_load(p, r, leased=False)
            except ModelLoadFailed:
                pass  # growth is best effort; the failure is counted in stats
        return ScalingPlan(tuple(p for p, _ in started), shrink)

    def _moved(self, p: Placement) -> bool:
        """Under the lock: the table no longer allows planned placement `p`."""
        r = self.node.replicas.get(p.replica)
        if (r is None) == p.restore or (p.restore and r is not None and r.state is not ReplicaState.HOST):
            return True
        return any(
            self.node.replicas.get(v) is None or not self.node.replicas[v].idle for v in p.victims
        ) or any(n not in self.node.replicas for n in p.drops)

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
                "host_used_mb": self.node.host_used_mb(),
                "host_memory_mb": self.node.host_memory_mb,
                "stats": dict(self.stats),
            }

    def resident(self) -> dict[tuple[int, ...], list[str]]:
        """chunk -> ready services there, least recently used first (the scheduler's `resident` map)."""
        return self._services_in(ReplicaState.READY)

    def host_resident(self) -> dict[tuple[int, ...], list[str]]:
        """chunk -> services whose replica there is in host memory only, least recently used first."""
        return self._services_in(ReplicaState.HOST)

    def _services_in(self, state: ReplicaState) -> dict[tuple[int, ...], list[str]]:
        with self._cond:
            out: dict[tuple[int, ...], list[Replica]] = {}
            for r in self.node.replicas.values():
                if r.state is state:
                    out.setdefault(r.chunk, []).append(r)
            return {c: [r.service for r in sorted(rs, key=lambda r: r.last_used_s)] for c, rs in out.items()}
