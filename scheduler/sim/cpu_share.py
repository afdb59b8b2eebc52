"""Time-shared CPU node for the `static-pod` baseline: CFS modelled as processor sharing.

Every running action on the node wants `min(threads, cap)` cores. When the demands fit in the
node's cores each gets its demand; otherwise cores are water-filled (equal shares, capped at
each demand), which is what CFS does for pods with equal requests. An action's speed at `r`
cores is its true speed-up `E(r)*r` (linear between integers, `r` below one = time slicing).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from scheduler.sim.workload import SimAction, speedup


@dataclass(slots=True)
class _Job:
    action: SimAction
    demand: float
    remaining: float = 1.0  # fraction of the work left
    rate: float = 0.0  # fraction of the work per second


@dataclass
class SharedNode:
    """Processor-sharing state of one node. Times in seconds."""

    cores: float
    jobs: dict[str, _Job] = field(default_factory=dict)
    last_s: float = 0.0
    version: int = 0

    def add(self, now_s: float, action_id: str, action: SimAction, threads: int, cap: float) -> None:
        self._advance(now_s)
        self.jobs[action_id] = _Job(action, float(min(threads, cap)))
        self._rerate()

    def pop_done(self, now_s: float, eps: float = 1e-9) -> list[str]:
        """Remove and return the actions finished by `now_s`."""
        self._advance(now_s)
        done = [aid for aid, j in self.jobs.items() if j.remaining <= eps]
        for aid in done:
            del self.jobs[aid]
        if done:
            self._rerate()
        return done

    def remove(self, now_s: float, action_id: str) -> None:
        """Drop an action whose node was lost (`scheduler.sim.node_exec`): the others speed up."""
        self._advance(now_s)
        if self.jobs.pop(action_id, None) is not None:
            self._rerate()

    def next_finish_s(self) -> float | None:
        if not self.jobs:
            return None
        return self.last_s + min(j.remaining / j.rate for j in self.jobs.values())

    def _advance(self, now_s: float) -> None:
        dt = now_s - self.last_s
        if dt > 0:
            for j in self.jobs.values():
                j.remaining = max(0.0, j.remaining - j.rate * dt)
        self.last_s = max(self.last_s, now_s)

    def _rerate(self) -> None:
        self.version += 1
        jobs = list(self.jobs.values())
        total = sum(j.demand for j in jobs)
        if total <= self.cores:
            for j in jobs:
                j.rate = speedup(j.action.curve, j.demand) / j.action.t1_s
            return
        # Water-filling: smallest demands are satisfied first, the rest share equally.
        left, n = self.cores, len(jobs)
        for j in sorted(jobs, key=lambda j: j.demand):
            share = min(j.demand, left / n)
            j.rate = speedup(j.action.curve, share) / j.action.t1_s
            left -= share
            n -= 1
