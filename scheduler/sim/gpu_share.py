"""A GPU group serving several calls at once (continuous batching), for `dedicated-gpu` with
`max_concurrent` above 1.

Each call has a solo time (its true duration alone on the group). With k calls running the
group's throughput is `k / (1 + (k - 1) * (1 - a))` solo calls per solo time, shared equally:
`a` (`ExecParams.batch_amortised_share`) is the part of a call that batching amortises (kernel
launches, scheduling, a prefill too short to fill the GPU). A long prefill is compute-bound and
its time grows linearly with the tokens batched (Sarathi-Serve, OSDI 2024), so `a` is small for
the 0.6 s scoring calls of the MOPD scenario; docs/simulator.md has the default and its range.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class _Call:
    solo_s: float
    remaining: float = 1.0  # fraction of the call left
    rate: float = 0.0  # fraction per second


def batch_speedup(k: int, amortised_share: float) -> float:
    """Throughput of k concurrent calls relative to one call alone."""
    return k / (1.0 + (k - 1) * (1.0 - amortised_share)) if k > 0 else 0.0


@dataclass
class BatchedGroup:
    """Processor sharing with a batching gain, for one group. Times in seconds."""

    amortised_share: float
    calls: dict[str, _Call] = field(default_factory=dict)
    last_s: float = 0.0
    version: int = 0

    def add(self, now_s: float, action_id: str, solo_s: float) -> None:
        self._advance(now_s)
        self.calls[action_id] = _Call(max(solo_s, 1e-9))
        self._rerate()

    def pop_done(self, now_s: float, eps: float = 1e-9) -> list[str]:
        """Remove and return the calls finished by `now_s`."""
        self._advance(now_s)
        done = [aid for aid, c in self.calls.items() if c.remaining <= eps]
        for aid in done:
            del self.calls[aid]
        if done:
            self._rerate()
        return done

    def remove(self, now_s: float, action_id: str) -> None:
        """Drop an action whose node was lost (`scheduler.sim.node_exec`): the others speed up."""
        self._advance(now_s)
        if self.calls.pop(action_id, None) is not None:
            self._rerate()

    def next_finish_s(self) -> float | None:
        if not self.calls:
            return None
        return self.last_s + min(c.remaining / c.rate for c in self.calls.values())

    def _advance(self, now_s: float) -> None:
        dt = now_s - self.last_s
        if dt > 0:
            for c in self.calls.values():
                c.remaining = max(0.0, c.remaining - c.rate * dt)
        self.last_s = max(self.last_s, now_s)

    def _rerate(self) -> None:
        self.version += 1
        k = len(self.calls)
        share = batch_speedup(k, self.amortised_share) / k if k else 0.0
        for c in self.calls.values():
            c.rate = share / c.solo_s
