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
copy, not a cold load. An action with no free resident chunk then waits for a busy chunk where
its service is resident when that chunk's holder is expected to end (the queue's earlier
waiters for it counted) sooner than the cheapest restore now would take: a free chunk where the
service is host-resident (a restore from host memory) or the minimum-size placement (a cold
load), each priced by the learned restore costs (`GpuNode.restore_s`, `scheduler.restore_cost`).
An action that does not wait goes to the minimum-size FCFS placement and the buddy DP, as
without tiers, whose chunk choice (`pick_gpu_chunks`) prefers a chunk that holds a host copy.
Without a host tier nothing of this runs: decisions are as before.

Tried and rejected: placing such an action at once on the cheapest host-resident chunk (any
size) instead of through the FCFS placement and the DP. In the simulated MOPD with 2 TiB of
host memory per node (`tangram-fast`, one 8-GPU node, batch 384 / 1024; 40 GPUs, batch 2048)
the average ACT was 10.3 / 50.5 / 3.12 s that way, 2.83 / 23.05 / 1.56 s with waiting alone,
and 3.61 / 23.42 / 2.60 s with the tiers hidden from the policy.

Cost. A pass may look at thousands of queued calls of a few services, most of which wait for
their busy chunk. What a pass does not change is looked up once per service (`Residents`,
`Tiers.options`, `Tiers.busy`): residency, restore costs and running calls are fixed during a
pass, and the free GPUs only shrink, so a chunk busy at the first look stays busy. Per call
only the free sets and the waiters queued so far are read. `benchmarks/gpu_tiers_round.py`
times it; `tests/unit/test_gpu_tiers_equivalence.py` holds it to the plain walk it replaced.

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
from scheduler.pools import copy_gpu
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
        self._free_by_size: dict[str, list[tuple[str, dict[int, list[tuple[int, ...]]]]]] = {}

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

    def free_by_size(
        self, service: str, free: dict[str, set[int]]
    ) -> list[tuple[str, dict[int, list[tuple[int, ...]]]]]:
        """`of(service)` less the chunks not all in `free`, each node's grouped by size (GPUs).
        Built on first use in the pass: the free sets only shrink as the pass places actions,
        so a chunk busy then stays busy (the caller checks the rest)."""
        got = self._free_by_size.get(service)
        if got is None:
            got = []
            for name, chunks in self.of(service):
                sized: dict[int, list[tuple[int, ...]]] = {}
                for chunk in chunks:
                    if free[name].issuperset(chunk):
                        sized.setdefault(len(chunk), []).append(chunk)
                if sized:
                    got.append((name, sized))
            self._free_by_size[service] = got
        return got

    def fastest_free(self, action: QueuedAction, free: dict[str, set[int]]) -> Choice | None:
        """The free resident chunk (of any allowed size) where `action` runs fastest, the first
        of equals in node then size order, per node and size the first in residency order;
        None if there is none."""
        best: Choice | None = None
        for name, sized in self.free_by_size(action.target, free):
            f = free[name]
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
    waiting for a busy resident chunk if that is sooner than a restore now (`Tiers`), else at
    its minimum."""
    free = {n: set(g.free) for n, g in state.gpu.items()}
    residents = Residents(state)
    tiers = Tiers(state, now_s, residents) if any(g.host_tier for g in state.gpu.values()) else None
    out: list[tuple[int, Allocation]] = []  # (place in `actions`, allocation)
    rest: list[tuple[int, QueuedAction]] = []
    free_gpus = sum(len(f) for f in free.values())
    for i, action in enumerate(actions):
        if not free_gpus:
            break  # nothing left to place: the rest waits
        best = residents.fastest_free(action, free)
        if best is None and tiers is not None and tiers.choose(action, free) == WAIT:
            continue  # its resident chunk frees sooner than a restore would take
        if best is None:
            rest.append((i, action))
            continue
        _, name, chunk = best
        free[name].difference_update(chunk)  # a free chunk: all its GPUs were free
        free_gpus -= len(chunk)
        out.append((i, Allocation(action.action_id, ResourceKind.GPU, name, len(chunk), chunk)))
    if rest and any(free.values()):
        # GPU calls only: the GPU nodes are all that placing them reads or changes (a full
        # copy would copy every CPU node and running allocation, a tenth of a large run)
        work = ClusterState(gpu={k: copy_gpu(g) for k, g in state.gpu.items()})
        for name, f in free.items():
            work.gpu[name].free = f
        at = {a.action_id: i for i, a in rest}
        out.extend((at[a.action_id], a) for a in fcfs_prefix([a for _, a in rest], work, now_s)[0])
    out.sort(key=lambda placed: placed[0])
    return [alloc for _, alloc in out]


def _cheapest_now(
    options: Sequence[tuple[str, int, float, tuple[int, ...]]],
    free: dict[str, set[int]],
    action: QueuedAction,
    dur_s: dict[int, float],
) -> Choice | None:
    """The option still free with the least restore + run seconds (the first of equals), as
    (seconds, node, chunk); `dur_s`: the action's seconds per size, filled in as needed."""
    best: Choice | None = None
    for name, units, restore_s, chunk in options:
        if free[name].issuperset(chunk):
            run_s = dur_s.get(units)
            if run_s is None:
                run_s = dur_s[units] = action.duration_s(units)
            cost_s = restore_s + run_s
            if best is None or cost_s < best[0]:
                best = (cost_s, name, chunk)
    return best


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
ChunkKey = tuple[str, tuple[int, ...]]  # (GPU node, chunk)
# (place in node then residency order, busy chunk's id in the pass, its last holder's end in s)
Busy = tuple[int, int, float]


class Tiers:
    """`gpu_candidates`' choice for an action with no free resident chunk, on a cluster with a
    host tier (see the module doc). Remembers, over one pass, the waiters it sent to each busy
    chunk, so that the next one counts them.

    What does not change in a pass is worked out once per pass, on first use: per service and
    allowed sizes the free aligned chunks where a call would restore from host memory or load
    cold, with their restore costs (`options`); per service the busy chunks where it is
    resident, by size, with their holders' last expected end (`busy`, from `ends` per node).
    Per action only the free sets (taken as the pass goes) and the waiters counted so far are
    looked at. Busy chunks have ids in the pass (`chunk_keys`), cheaper keys than the chunks."""

    def __init__(self, state: ClusterState, now_s: float, residents: Residents | None = None) -> None:
        self.state, self.now_s = state, now_s
        self.residents = residents or Residents(state)
        self.queued_s: dict[int, float] = {}  # waiters' seconds per busy chunk id
        self.chunk_keys: list[ChunkKey] = []  # busy chunk id -> (GPU node, chunk)
        self._chunk_ids: dict[ChunkKey, int] = {}
        self._options: dict[tuple[str, tuple[int, ...]], tuple[list[Option], list[Option]]] = {}
        self._busy: dict[str, list[tuple[int, list[Busy]]]] = {}
        self._ends: dict[str, dict[int, tuple[float, float]]] = {}

    def choose(self, action: QueuedAction, free: dict[str, set[int]]) -> Choice | str | None:
        """`WAIT`, or the best placement now: a host restore (expected seconds, node, chunk), or
        None (a cold load at the minimum size). `gpu_candidates` acts on `WAIT` only; the
        placement itself is left to the FCFS placement and the DP (see the module doc)."""
        hosts, colds = self.options(action.target, action.cost.units.units, free)
        if not hosts and not colds:
            return None  # nothing fits now (or no buddy size allowed): it waits as before
        dur_s: dict[int, float] = {}  # the action's expected seconds per size, as needed
        host = _cheapest_now(hosts, free, action, dur_s)
        cold = _cheapest_now(colds, free, action, dur_s)
        cold_s = cold[0] if cold is not None else None
        if host is None:
            if cold_s is None:
                return None  # nothing fits now: it waits as before
            now_best = cold_s
        else:
            now_best = host[0] if cold_s is None or host[0] <= cold_s else cold_s
        wait = self._wait(action, now_best, dur_s)
        if wait is not None:
            self.queued_s[wait] = self.queued_s.get(wait, 0.0) + dur_s[len(self.chunk_keys[wait][1])]
            return WAIT
        return host if host is not None and host[0] <= now_best else None

    def options(
        self, service: str, units: tuple[int, ...], free: dict[str, set[int]]
    ) -> tuple[list[Option], list[Option]]:
        """The free aligned chunks of the buddy sizes among `units` where a call of `service`
        would restore from host memory, and those of the smallest such size where it would load
        cold, each with the restore's expected seconds, in node, size then chunk order. Built
        on first use in the pass from the `free` sets then: they only shrink as the pass places
        actions, so a chunk busy then stays busy (the caller checks the rest)."""
        key = (service, units)
        got = self._options.get(key)
        if got is None:
            got = ([], [])
            sizes = [u for u in units if u in GPU_CHUNK_SIZES]
            lo = min(sizes, default=0)
            for name, node in self.state.gpu.items():
                f = free[name]
                for size in sizes:
                    for start in range(0, node.num_gpus - size + 1, size):
                        chunk = tuple(range(start, start + size))
                        if not f.issuperset(chunk):
                            continue
                        tier = node.tier(chunk, service)
                        if tier is Tier.HOST:
                            got[0].append((name, size, node.restore_s(chunk, service), chunk))
                        elif tier is Tier.COLD and size == lo:
                            got[1].append((name, size, node.restore_s(chunk, service), chunk))
            self._options[key] = got
        return got

    def _wait(self, action: QueuedAction, within_s: float, dur_s: dict[int, float]) -> int | None:
        """The id of a busy chunk where `action`'s service is resident that would run it sooner
        than `within_s` from now (its holders' expected ends and earlier waiters counted), the
        soonest, the first of equals in node then residency order; None if none would. A holder
        past its expected end is not waited for (its end is unknown). `dur_s`: the action's
        expected seconds per size, filled in as needed."""
        now_s, sizes, queued_s = self.now_s, action.cost.units.units, self.queued_s
        best_s, best_at, best_id = within_s, -1, -1
        for size, chunks in self.busy(action.target):
            if size not in sizes:
                continue
            run_s = dur_s.get(size)
            if run_s is None:
                run_s = dur_s[size] = action.duration_s(size)
            for at, cid, end_s in chunks:
                done_s = end_s + queued_s.get(cid, 0.0) - now_s + run_s
                if done_s < best_s or (done_s == best_s and at < best_at):
                    best_s, best_at, best_id = done_s, at, cid
        return best_id if best_at >= 0 else None

    def busy(self, service: str) -> list[tuple[int, list[Busy]]]:
        """Per size, the chunks of online nodes where `service` is resident and held by running
        calls all expected to end after now, with the last of those ends (a chunk free at the
        pass's start, or with a holder past its expected end, is left out)."""
        got = self._busy.get(service)
        if got is None:
            sized: dict[int, list[Busy]] = {}
            at = 0
            for name, chunks in self.residents.of(service):
                if f"gpu:{name}" in self.state.offline:
                    continue
                ends = self.ends(name)
                for chunk in chunks:
                    at += 1
                    held = [ends[g] for g in chunk if g in ends]
                    if held and min(lo for lo, _ in held) > self.now_s:
                        cid = self._chunk_id((name, chunk))
                        sized.setdefault(len(chunk), []).append((at, cid, max(hi for _, hi in held)))
            self._busy[service] = got = list(sized.items())
        return got

    def _chunk_id(self, key: ChunkKey) -> int:
        cid = self._chunk_ids.get(key)
        if cid is None:
            cid = self._chunk_ids[key] = len(self.chunk_keys)
            self.chunk_keys.append(key)
        return cid

    def ends(self, name: str) -> dict[int, tuple[float, float]]:
        """Per busy GPU of node `name`, the first and last expected end (s) of the running
        calls holding it (an unknown end counts as now)."""
        got = self._ends.get(name)
        if got is None:
            got = {}
            expected, now_s = self.state.expected_end_s, self.now_s
            for aid, alloc in self.state.running_in(ResourceKind.GPU, name).items():
                end_s = expected.get(aid, now_s)
                for g in alloc.unit_ids:
                    lo, hi = got.get(g, (end_s, end_s))
                    got[g] = (min(lo, end_s), max(hi, end_s))
            self._ends[name] = got
        return got
