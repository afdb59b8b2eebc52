"""The simulator's GPU execution: loads and restores by the policy's residency, warm
restores in the background, and a chunk's batch of riders run together.

Under evict on execution a call pays by the tier its instance is found in
(`scheduler.gpu_cache.Tier`): nothing on the device, `ExecParams.restore_s` from the host tier,
`ExecParams.cold_load_s` when the node's host memory (`ClusterSpec.host_memory_mb`) no longer
holds it; `SimResult.device_hits`, `restores` and `cold_loads` count them.

A base class of `scheduler.sim.engine.Simulator` (see its module doc for the model).
"""

from __future__ import annotations

from scheduler.execution import GpuResidency
from scheduler.gpu_cache import GpuCache, GpuLoad, Tier
from scheduler.model import Allocation
from scheduler.pools import GPU_CHUNK_SIZES
from scheduler.restore_cost import RestoreCosts
from scheduler.sim.gpu_share import BatchedGroup
from scheduler.sim.running import DEFAULT_MODEL_MB, FINISH, Running, SimBase


class GpuExecution(SimBase):
    """Carrying GPU allocations, their riders and warm restores out on the simulated GPUs."""

    def _attach_host_tier(self) -> None:
        """Give every GPU node's cache its host budget and instances' host footprints. The
        policies see the tiers as live: the host-only instances as `GpuNode.host_resident`,
        `host_tier` when the budget is bounded, and the restore costs learned from what the
        simulator charges (`RestoreCosts`, one for the cluster, fed as the live scheduler
        feeds it from the workers' reports)."""
        self.restore_costs = RestoreCosts()
        for name, cache in self.caches.items():
            self._host_tier_of(name, cache)

    def _host_tier_of(self, name: str, cache: GpuCache) -> None:
        """The host tier of one GPU node's cache (a node that joins gets its own)."""
        budget_mb = self.scenario.cluster.host_memory_mb
        cache.host_memory_mb = budget_mb
        cache.host_footprint_mb = self._host_footprint_mb
        node = self.state.gpu[name]
        node.host_resident = cache.host
        node.host_tier = budget_mb is not None
        node.restore_costs = self.restore_costs
        if budget_mb is not None and self.residency is GpuResidency.CACHE:
            self._warm_host(name, cache)

    def _warm_host(self, name: str, cache: GpuCache) -> None:
        """The host tier's warm-up before the first call, as the live worker's
        (`reward_servers.placement.plan_warmup`), while the node's host budget holds it: first
        one host-only instance of each service at the smallest chunk size its footprint fits;
        then more, round robin over the services, one per service a turn, on the chunks that
        hold no instance of it yet, of each of its chunk sizes in turn, smallest first. Each
        goes to the chunk overlapping the fewest host-only instances (lowest first on a tie). A
        service stops at the first instance the budget cannot hold (the next are no smaller)."""
        gpus = self.state.gpu[name].num_gpus
        sizes_of = {
            service: [
                u
                for u in GPU_CHUNK_SIZES
                if u <= gpus and self._footprint_mb(service, u) <= cache.gpu_memory_mb
            ]
            for service in sorted(self.scenario.model_mb)
        }
        sizes_of = {s: sizes for s, sizes in sizes_of.items() if sizes}
        for service, sizes in sizes_of.items():
            _warm_one(cache, service, sizes[:1], gpus)
        todo = list(sizes_of)
        while todo:
            todo = [s for s in todo if _warm_one(cache, s, sizes_of[s], gpus)]

    def _warm(self, now: float, load: GpuLoad) -> None:
        """A warm restore: the weights are copied onto the chunk in the background (the GPUs
        stay free for other services' calls); a call of the service that lands there before the
        copy is done waits for the rest of it. From the host tier, or a cold load."""
        model_mb = self.scenario.model_mb.get(load.service, DEFAULT_MODEL_MB)
        tier = self.caches[load.pool].apply(load, now)
        self._ready_at[(load.pool, load.chunk, load.service)] = now + self._miss_s(
            load.service, tier, model_mb, len(load.chunk)
        )
        self.result.warm_restores += 1

    def _start_batch(self, now: float, lead: Running, riders: list[Allocation]) -> None:
        """A GPU allocation and its riders run as one batch on its chunk once the service is
        loaded, at the batching gain of a continuously batching server (`BatchedGroup`)."""
        group = BatchedGroup(self.params.batch_amortised_share)
        group.add(
            0.0, lead.qa.action_id, self._sim_action(lead.qa.action_id).true_duration_s(lead.alloc.units)
        )
        for alloc in riders:
            qa = self.queue.pop(alloc.action_id)
            self.state.share(alloc, qa, now)
            self.running[qa.action_id] = Running(qa, alloc, now, lead.setup_s)
            group.add(0.0, qa.action_id, self._sim_action(qa.action_id).true_duration_s(alloc.units))
        while group.calls:
            t_s = group.next_finish_s()
            assert t_s is not None
            for aid in group.pop_done(t_s):
                self._push(now + lead.setup_s + t_s, FINISH, aid)

    def _gpu_setup_s(self, now: float, alloc: Allocation, service: str, load: GpuLoad | None) -> float:
        model_mb = self.scenario.model_mb.get(service, DEFAULT_MODEL_MB)
        load_s = (
            self.params.restore_s if self.model.load_from == "memory" else self.params.cold_load_s
        )  # the cold-start baseline's checkpoint tier
        if self.residency is GpuResidency.NONE:
            self.result.cold_loads += 1
            return load_s(model_mb, alloc.units)
        cache = self.caches[alloc.pool]
        if load is None:  # not planned by the round (a policy run outside it)
            load = cache.plan(alloc.pool, alloc.unit_ids, service)
        tier = cache.apply(load, now)
        hit = load.hit
        if self.residency is GpuResidency.KEEPALIVE:
            cache.touch(alloc.unit_ids, service, float("inf"))  # in use: never expires
            self.result.unloads += len(load.victims)
            if hit:
                self.result.device_hits += 1
                return 0.0
            self.result.cold_loads += 1
            return load_s(model_mb, alloc.units)
        if hit:  # a warm restore may still be copying
            self.result.device_hits += 1
            ready_s = (
                self._ready_at.pop((alloc.pool, alloc.unit_ids, service), now) if self._ready_at else now
            )
            return max(0.0, ready_s - now)
        self._ready_at.pop((alloc.pool, alloc.unit_ids, service), None)
        return self._miss_s(service, tier, model_mb, alloc.units)

    def _miss_s(self, service: str, tier: Tier, model_mb: int, units: int) -> float:
        """What a load on a miss costs, counted by its tier: a cold load when the host tier
        does not hold the instance, else a restore from host memory."""
        if tier is Tier.COLD:
            self.result.cold_loads += 1
            load_s = self.params.cold_load_s(model_mb, units)
        else:
            self.result.restores += 1
            load_s = self.params.restore_s(model_mb, units)
        if self.learn:
            self.restore_costs.observe(service, Tier.COLD if tier is Tier.COLD else Tier.HOST, load_s)
        return load_s

    def _footprint_mb(self, service: str, units: int) -> int:
        model_mb = self.scenario.model_mb.get(service, DEFAULT_MODEL_MB)
        return self.params.footprint_mb(model_mb, units)

    def _host_footprint_mb(self, service: str, units: int) -> int:
        model_mb = self.scenario.model_mb.get(service, DEFAULT_MODEL_MB)
        return self.params.host_footprint_mb(model_mb, units)


def _warm_one(cache: GpuCache, service: str, sizes: list[int], gpus: int) -> bool:
    """Put one more host-only instance of `service` on a node of `gpus` GPUs: on a chunk of the
    first of `sizes` that has a chunk without one, the chunk overlapping the fewest host-only
    instances (lowest first on a tie); False when none is left or the host budget is full."""
    for u in sizes:
        chunks = [
            c
            for a in range(0, gpus - u + 1, u)
            if cache.tier_of(c := tuple(range(a, a + u)), service) is Tier.COLD
        ]
        if chunks:
            hosted = [c for c, ss in cache.host.items() for _ in ss]
            chunk = min(chunks, key=lambda c: (sum(bool(set(c) & set(h)) for h in hosted), c))
            return cache.warm_host(chunk, service)
    return False
