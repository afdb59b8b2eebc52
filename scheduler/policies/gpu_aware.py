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
from scheduler.resources import GPU_CHUNK_SIZES, ClusterState

Choice = tuple[float, str, tuple[int, ...]]  # (expected seconds, GPU node, chunk)
WAIT = "wait"  # `Tiers.choose`: the action waits for a busy chunk where it is resident


class Residents:
    """Over one pass of `gpu_candidates`: the chunks where each service is resident, per GPU
    node, in `state.gpu` then `GpuNode.resident` order (residency does not change in a pass;
    services repeat a lot in a queue, so each is looked up once)."""

    def __init__(self, state: ClusterState) -> None:
        self.state = state
        self._of: dict[str, list[tuple[str, list[tuple[int, ...]]]]] = {}
        self._by_size: dict[str, list[tuple[str, dict[int, list[tuple[int, ...]]]]]] = {}

    def of(self, service: str) -> list[tuple[str, list[tuple[int, ...]]]]:
        """(node, chunks where `service` is resident) for each node with at least one."""
        got = self._of.get(service)
        if got is None:
            got = []
            for name, node in self.state.gpu.items():
                chunks = [c for c, services in node.resident.items() if service in services]
                if chunks:
                    got.append((name, chunks))
            self._of[service] = got
        return got

    def by_size(self, service: str) -> list[tuple[str, dict[int, list[tuple[int, ...]]]]]:
        """`of(service)` with each node's chunks grouped by size (GPUs), in the same order."""
        got = self._by_size.get(service)
        if got is None:
            got = []
            for name, chunks in self.of(service):
                sized: dict[int, list[tuple[int, ...]]] = {}
                for chunk in chunks:
                    sized.setdefault(len(chunk), []).append(chunk)
                got.append((name, sized))
            self._by_size[service] = got
        return got

    def fastest_free(self, action: QueuedAction, free: dict[str, set[int]]) -> Choice | None:
        """The free resident chunk (of any allowed size) where `action` runs fastest, the first
        of equals in node then size order, per node and size the first in residency order;
        None if there is none."""
        best: Choice | None = None
        for name, sized in self.by_size(action.target):
            f = free[name]
            if not f:
                continue
            for units in action.cost.units.units:
                for chunk in sized.get(units, ()):
                    if f.issuperset(chunk):
                        dur_s = action.duration_s(units)
                        if best is None or dur_s < best[0]:
                            best = (dur_s, name, chunk)
                        break
        return best


def gpu_candidates(actions: Sequence[QueuedAction], state: ClusterState, now_s: float) -> list[Allocation]:
    """FCFS per service; each action on a resident chunk if one is free, else (with a host tier)
    the cheapest of a host restore, a cold load and waiting (`Tiers`), else at its minimum."""
    free = {n: set(g.free) for n, g in state.gpu.items()}
    residents = Residents(state)
    tiers = Tiers(state, now_s, residents) if any(g.host_tier for g in state.gpu.values()) else None
    out: list[Allocation] = []
    rest: list[QueuedAction] = []
    for action in actions:
        if not any(free.values()):
            break  # nothing left to place: the rest waits
        best = residents.fastest_free(action, free)
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


Option = tuple[str, int, float, tuple[int, ...]]  # (GPU node, size, restore seconds, chunk)
Busy = tuple[str, tuple[int, ...], float]  # (GPU node, chunk, when its last holder ends in s)


class Tiers:
    """`gpu_candidates`' choice for an action with no free resident chunk, on a cluster with a
    host tier (see the module doc). Remembers, over one pass, the waiters it sent to each busy
    chunk, so that the next one counts them.

    What does not change in a pass is worked out once per pass, on first use: per service and
    allowed sizes the aligned chunks where a call would restore from host memory or load cold,
    with their restore costs (`options`); per service the busy chunks where it is resident,
    with their holders' last expected end (`busy`). Per action only the free sets (taken as the
    pass goes) and the waiters counted so far are looked at."""

    def __init__(self, state: ClusterState, now_s: float, residents: Residents | None = None) -> None:
        self.state, self.now_s = state, now_s
        self.residents = residents or Residents(state)
        self.queued_s: dict[tuple[str, tuple[int, ...]], float] = {}  # waiters' seconds per chunk
        self._options: dict[tuple[str, tuple[int, ...]], tuple[list[Option], list[Option]]] = {}
        self._busy: dict[str, list[Busy]] = {}

    def choose(self, action: QueuedAction, free: dict[str, set[int]]) -> Choice | str | None:
        """A host-restore placement (expected seconds, node, chunk), `WAIT`, or None (the
        minimum-size placement, a cold load, as without tiers)."""
        sizes = tuple(u for u in action.cost.units.units if u in GPU_CHUNK_SIZES)
        if not sizes:
            return None
        hosts, colds = self.options(action.target, sizes, free)
        host: Choice | None = None
        for name, units, restore_s, chunk in hosts:
            if free[name].issuperset(chunk):
                cost_s = restore_s + action.duration_s(units)
                if host is None or cost_s < host[0]:
                    host = (cost_s, name, chunk)
        cold_s: float | None = None
        for name, units, restore_s, chunk in colds:
            if free[name].issuperset(chunk):
                cost_s = restore_s + action.duration_s(units)
                if cold_s is None or cost_s < cold_s:
                    cold_s = cost_s
        if host is None and cold_s is None:
            return None  # nothing fits now: it waits as before
        now_best = min(c for c in (host[0] if host else None, cold_s) if c is not None)
        wait = self._wait(action, now_best)
        if wait is not None:
            self.queued_s[wait] = self.queued_s.get(wait, 0.0) + action.duration_s(len(wait[1]))
            return WAIT
        return host if host is not None and host[0] <= now_best else None

    def options(
        self, service: str, sizes: tuple[int, ...], free: dict[str, set[int]]
    ) -> tuple[list[Option], list[Option]]:
        """The free aligned chunks of the allowed `sizes` where a call of `service` would
        restore from host memory, and those of the smallest size where it would load cold, each
        with the restore's expected seconds, in node, size then chunk order. Built on first use
        in the pass from the `free` sets then: they only shrink as the pass places actions, so
        a chunk busy then stays busy (the caller checks the rest)."""
        key = (service, sizes)
        got = self._options.get(key)
        if got is None:
            got = ([], [])
            lo = min(sizes)
            for name, node in self.state.gpu.items():
                f = free[name]
                for units in sizes:
                    for start in range(0, node.num_gpus - units + 1, units):
                        chunk = tuple(range(start, start + units))
                        if not f.issuperset(chunk):
                            continue
                        tier = node.tier(chunk, service)
                        if tier is Tier.HOST:
                            got[0].append((name, units, node.restore_s(chunk, service), chunk))
                        elif tier is Tier.COLD and units == lo:
                            got[1].append((name, units, node.restore_s(chunk, service), chunk))
            self._options[key] = got
        return got

    def _wait(self, action: QueuedAction, within_s: float) -> tuple[str, tuple[int, ...]] | None:
        """A busy chunk where `action`'s service is resident that would run it sooner than
        `within_s` from now (its holders' expected ends and earlier waiters counted); None if
        none would. A holder past its expected end is not waited for (its end is unknown)."""
        sizes = action.cost.units.units
        best: tuple[float, tuple[str, tuple[int, ...]]] | None = None
        for name, chunk, end_s in self.busy(action.target):
            if len(chunk) not in sizes:
                continue
            ready_s = end_s + self.queued_s.get((name, chunk), 0.0)
            done_s = ready_s - self.now_s + action.duration_s(len(chunk))
            if done_s < within_s and (best is None or done_s < best[0]):
                best = (done_s, (name, chunk))
        return best[1] if best is not None else None

    def busy(self, service: str) -> list[Busy]:
        """The chunks of online nodes where `service` is resident and held by running calls
        all expected to end after now, with the last of those ends, in node then residency
        order (a chunk free at the pass's start, or with a holder past its expected end, is
        left out)."""
        got = self._busy.get(service)
        if got is None:
            state, now_s = self.state, self.now_s
            got = []
            for name, chunks in self.residents.of(service):
                if f"gpu:{name}" in state.offline:
                    continue
                running = state.running_in(ResourceKind.GPU, name)
                for chunk in chunks:
                    ends = [
                        state.expected_end_s.get(aid, now_s)
                        for aid, a in running.items()
                        if not set(a.unit_ids).isdisjoint(chunk)
                    ]
                    if ends and min(ends) > now_s:
                        got.append((name, chunk, max(ends)))
            self._busy[service] = got
        return got
