"""Residency-first GPU placement for `tangram-fast` (the paper's policy ignores restores).

Under evict-on-execution a call that lands on a chunk where its service (at that DoP) is not
resident first restores the weights from host memory, which for short scoring calls costs
several times the call itself. `ClusterState.place` only looks for a resident chunk of the
action's *minimum* size; here a GPU action takes a free chunk of *any* allowed size where its
service is already resident (the fastest such), and only falls back to the minimum-size FCFS
placement when there is none. The buddy DP then re-arranges units per node as in `tangram-dp`,
except that a candidate placed on a resident chunk keeps that size (`pick_gpu_chunks` then
gives it that very chunk back).

Restore tiers (issue 38). Where a node reports a host tier (`GpuNode.host_tier`), a service
that is not resident on a free chunk may still be kept in host memory there: restoring it is a
copy, not a cold load. An action with no free resident chunk then weighs, by the learned
restore costs (`GpuNode.restore_s`, `scheduler.restore_cost`): a free chunk where its service
is host-resident (restore from host memory), the minimum-size placement (a cold load), and
waiting for a busy chunk where its service is resident, when that chunk's holder is expected
to end sooner than the cheapest restore would take (the queue's earlier waiters for it
counted). Without a host tier nothing of this runs: decisions are as before.

Tried and rejected: adding the expected restore time to the DP's options. The completion-heap
estimate of the waiting actions has no restore term, so drop-tail then over-drops (MOPD
average ACT 6.5 s against 1.4 s without it).
"""

from __future__ import annotations

from collections.abc import Sequence

from scheduler.dp import GpuBuddy, arrange
from scheduler.gpu_cache import Tier
from scheduler.model import Allocation, QueuedAction, ResourceKind
from scheduler.policies.elastic import Decision, PoolProblem, drop_tail
from scheduler.policies.fcfs_min import fcfs_prefix
from scheduler.resources import GPU_CHUNK_SIZES, ClusterState, GpuNode

Choice = tuple[float, str, tuple[int, ...]]  # (expected seconds, GPU node, chunk)
WAIT = "wait"  # `Tiers.choose`: the action waits for a busy chunk where it is resident


def resident_free_chunk(node: GpuNode, free: set[int], service: str, units: int) -> tuple[int, ...] | None:
    """A free aligned `units`-chunk of `node` where `service` is resident, if any."""
    for chunk, services in node.resident.items():
        if len(chunk) == units and service in services and free.issuperset(chunk):
            return chunk
    return None


def gpu_candidates(actions: Sequence[QueuedAction], state: ClusterState, now_s: float) -> list[Allocation]:
    """FCFS per service; each action on a resident chunk if one is free, else (with a host tier)
    the cheapest of a host restore, a cold load and waiting (`Tiers`), else at its minimum."""
    free = {n: set(g.free) for n, g in state.gpu.items()}
    tiers = Tiers(state, now_s) if any(g.host_tier for g in state.gpu.values()) else None
    out: list[Allocation] = []
    rest: list[QueuedAction] = []
    for action in actions:
        if not any(free.values()):
            break  # nothing left to place: the rest waits
        best: Choice | None = None
        for name, node in state.gpu.items():
            for units in action.cost.units.units:
                chunk = resident_free_chunk(node, free[name], action.target, units)
                if chunk is not None:
                    dur_s = action.duration_s(units)
                    if best is None or dur_s < best[0]:
                        best = (dur_s, name, chunk)
        if best is None and tiers is not None:
            choice = tiers.choose(action, free)
            if choice == WAIT:
                continue
            best = choice if isinstance(choice, tuple) else None
        if best is None:
            rest.append(action)
            continue
        _, name, chunk = best
        free[name].difference_update(chunk)
        out.append(Allocation(action.action_id, ResourceKind.GPU, name, len(chunk), chunk))
    if rest and any(free.values()):
        work = state.copy()
        for name, f in free.items():
            work.gpu[name].free = f
        out.extend(fcfs_prefix(rest, work, now_s)[0])
    order = {a.action_id: i for i, a in enumerate(actions)}
    return sorted(out, key=lambda a: order[a.action_id])


def residency_gpu_solver(problem: PoolProblem) -> Decision:
    """`tangram-dp`'s buddy DP, but a candidate placed on a resident chunk (or one where its
    service is host-resident, with a host tier) keeps that size."""
    node = problem.state.gpu[problem.key[1]]
    host = node.host_resident if node.host_tier else {}
    fixed = {
        action.action_id: alloc.units
        for action, alloc in problem.members
        if action.target in node.resident.get(alloc.unit_ids, ())
        or action.target in host.get(alloc.unit_ids, ())
    }
    op = GpuBuddy.from_counts(node.free_chunk_counts())
    return drop_tail(problem, lambda opts: arrange(op, opts), len(node.free), fixed=fixed)


class Tiers:
    """`gpu_candidates`' choice for an action with no free resident chunk, on a cluster with a
    host tier (see the module doc). Remembers, over one pass, the waiters it sent to each busy
    chunk, so that the next one counts them."""

    def __init__(self, state: ClusterState, now_s: float) -> None:
        self.state, self.now_s = state, now_s
        self.queued_s: dict[tuple[str, tuple[int, ...]], float] = {}  # waiters' seconds per chunk

    def choose(self, action: QueuedAction, free: dict[str, set[int]]) -> Choice | str | None:
        """A host-restore placement (expected seconds, node, chunk), `WAIT`, or None (the
        minimum-size placement, a cold load, as without tiers)."""
        service, sizes = action.target, [u for u in action.cost.units.units if u in GPU_CHUNK_SIZES]
        if not sizes:
            return None
        lo = min(sizes)
        host: Choice | None = None
        cold_s: float | None = None
        for name, node in self.state.gpu.items():
            f = free[name]
            for units in sizes:
                for start in range(0, node.num_gpus - units + 1, units):
                    chunk = tuple(range(start, start + units))
                    if not f.issuperset(chunk):
                        continue
                    tier = node.tier(chunk, service)
                    cost_s = node.restore_s(chunk, service) + action.duration_s(units)
                    if tier is Tier.HOST and (host is None or cost_s < host[0]):
                        host = (cost_s, name, chunk)
                    elif tier is Tier.COLD and units == lo and (cold_s is None or cost_s < cold_s):
                        cold_s = cost_s
        now_best = min((c for c in (host[0] if host else None, cold_s) if c is not None), default=None)
        if now_best is None:
            return None  # nothing fits now: it waits as before
        wait = self._wait(action, now_best)
        if wait is not None:
            self.queued_s[wait] = self.queued_s.get(wait, 0.0) + action.duration_s(len(wait[1]))
            return WAIT
        return host if host is not None and host[0] <= now_best else None

    def _wait(self, action: QueuedAction, within_s: float) -> tuple[str, tuple[int, ...]] | None:
        """A busy chunk where `action`'s service is resident that would run it sooner than
        `within_s` from now (its holders' expected ends and earlier waiters counted); None if
        none would. A holder past its expected end is not waited for (its end is unknown)."""
        state, now_s, service = self.state, self.now_s, action.target
        best: tuple[float, tuple[str, tuple[int, ...]]] | None = None
        for name, node in state.gpu.items():
            if f"gpu:{name}" in state.offline:
                continue
            for chunk, services in node.resident.items():
                if service not in services or len(chunk) not in action.cost.units.units:
                    continue
                ends = [
                    state.expected_end_s.get(aid, now_s)
                    for aid, a in state.running_in(ResourceKind.GPU, name).items()
                    if set(a.unit_ids) & set(chunk)
                ]
                if not ends or min(ends) <= now_s:
                    continue  # free (taken this pass), or a holder overran: not worth a bet
                ready_s = max(ends) + self.queued_s.get((name, chunk), 0.0)
                done_s = ready_s - now_s + action.duration_s(len(chunk))
                if done_s < within_s and (best is None or done_s < best[0]):
                    best = (done_s, (name, chunk))
        return best[1] if best is not None else None
