"""The simulator's GPU execution: loads and restores by the policy's residency, warm
restores in the background, and a chunk's batch of riders run together.

A base class of `scheduler.sim.engine.Simulator` (see its module doc for the model).
"""

from __future__ import annotations

from scheduler.execution import GpuResidency
from scheduler.gpu_cache import GpuLoad
from scheduler.model import Allocation
from scheduler.sim.gpu_share import BatchedGroup
from scheduler.sim.running import DEFAULT_MODEL_MB, FINISH, Running, SimBase


class GpuExecution(SimBase):
    """Carrying GPU allocations, their riders and warm restores out on the simulated GPUs."""

    def _warm(self, now: float, load: GpuLoad) -> None:
        """A warm restore: the weights are copied onto the chunk in the background (the GPUs
        stay free for other services' calls); a call of the service that lands there before the
        copy is done waits for the rest of it."""
        model_mb = self.scenario.model_mb.get(load.service, DEFAULT_MODEL_MB)
        self._ready_at[(load.pool, load.chunk, load.service)] = now + self.params.restore_s(
            model_mb, len(load.chunk)
        )
        self.caches[load.pool].apply(load, now)
        self.result.restores += 1
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
        cache.apply(load, now)
        hit = load.hit
        if self.residency is GpuResidency.KEEPALIVE:
            cache.touch(alloc.unit_ids, service, float("inf"))  # in use: never expires
            self.result.unloads += len(load.victims)
            if hit:
                return 0.0
            self.result.cold_loads += 1
            return load_s(model_mb, alloc.units)
        if hit:  # a warm restore may still be copying
            ready_s = (
                self._ready_at.pop((alloc.pool, alloc.unit_ids, service), now) if self._ready_at else now
            )
            return max(0.0, ready_s - now)
        self._ready_at.pop((alloc.pool, alloc.unit_ids, service), None)
        self.result.restores += 1
        return self.params.restore_s(model_mb, alloc.units)

    def _footprint_mb(self, service: str, units: int) -> int:
        model_mb = self.scenario.model_mb.get(service, DEFAULT_MODEL_MB)
        return self.params.footprint_mb(model_mb, units)
