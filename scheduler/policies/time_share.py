"""Bounded time sharing under saturation: short rigid CPU actions beside a running action.

With exclusive cores, a short action that finds every core held waits until one frees up,
behind actions that may run for minutes. Pods under CFS start it at once on time-shared cores,
which approximates shortest-first for sizes nobody knows. Time sharing every core is what the
exclusive model avoids (a test suite on 32 cores slowed by whatever lands beside it), so the
sharing here is bounded:

- **Who shares**: a waiting CPU action that is rigid (one unit count) and short: its kind was
  measured (`DurationEstimator.observed_s`, no prior) to take at most `max_action_s` at that
  count, as CPU riders measure it (`scheduler.policies.cpu_batch`); a kind never measured never
  shares. Its trajectory has no action running or starting this round (one action per
  sandbox).
- **Where**: on cores of one running exclusive CPU action (its host), on its trajectory's node
  (a new trajectory: the node with the most free memory that has room), at most `per_core`
  sharers per core (the oversubscription cap), only where it gets at least `min_share` of each
  core, and while the host's sharers take at most `max_holder_loss` of its cores' worth in all.
  Among hosts, the one where it gets the most (the widest: the last core of a wide action is
  worth little to it, since its speed-up E(m) m grows ever slower), then the one expected to
  run longest. Riders' batches and cores whose holder ended do not host.
- **Weights**: the host's sandbox keeps the default CPU weight, the sharer's gets `weight`
  times it (cgroup `cpu.weight` / `cpu.shares` of the whole sandbox, which CFS spreads over the
  cores each one runs on): on a shared core the sharer gets
  `(weight / its cores) / (that + 1 / the holder's cores + other sharers')` (`core_share`). So
  a narrow host keeps most of its core and a wide one, which loses little by it, lends most of
  one; `max_holder_loss` bounds how many cores' worth a host gives in all. The simulator runs
  them by the same rule; the CPU worker writes the sharer's weight and restores it after.
- **Memory**: as any CPU action, a sharer pins its trajectory and reserves its memory,
  evicting idle trajectories when short (`scheduler.eviction`).

FCFS: a sharer takes no free core, so the actions waiting for cores (the head of the queue)
keep every core that frees up; a core whose holder ends while sharers run is free when they
end, and takes no new sharer meanwhile. The head waits at most one short sharer longer, per
core it needs, plus what sharing slows the holders. Among sharers FCFS holds: a node where one
finds no room is closed to later ones this round, and one that lacks memory holds back later
sharers of new trajectories.

Pure: reads the queue and the state, changes neither; `scheduler.round` calls it after the
policy and the riders, the simulator and the live service carry the sharers out
(`ClusterState.share_cores`, `ExecutionModel.time_share`).
"""

from __future__ import annotations

import functools
import heapq
from collections.abc import Iterable
from dataclasses import dataclass, field

from scheduler.eviction import Evictions
from scheduler.execution import TimeShareSpec
from scheduler.images import image_ready
from scheduler.model import Allocation, QueuedAction, ResourceKind
from scheduler.policies.cpu_batch import Observed
from scheduler.queue import WaitingQueue
from scheduler.resources import ClusterState


def core_share(mine: float, holder: float, others: Iterable[float] = ()) -> float:
    """The share of one core a tenant gets under CFS when all want it whole: its per-core
    weight `mine` over the sum with the holder's (`holder`; 0 once the holder ended) and the
    other sharers' (each a sandbox's weight over the cores it runs on; the host's weight is 1)."""
    return mine / (mine + holder + sum(others))


@dataclass(slots=True, eq=False)
class _Host:
    alloc: Allocation
    per_core: float  # the holder's weight per core (1 / its cores)
    end_s: float
    load: dict[int, list[float]] = field(default_factory=dict)  # core -> sharers' per-core weights
    lost: float = 0.0  # cores' worth its sharers take

    def copy(self) -> _Host:
        return _Host(
            self.alloc, self.per_core, self.end_s, {c: list(w) for c, w in self.load.items()}, self.lost
        )

    def has_room(self, spec: TimeShareSpec) -> bool:
        """Could a one-core sharer still join (a core below `per_core`, budget for one more)?"""
        budget = spec.max_holder_loss * self.alloc.units - self.lost
        if budget < core_share(spec.weight, self.per_core) - 1e-9:
            return False
        return any(len(self.load.get(c, ())) < spec.per_core for c in self.alloc.unit_ids)

    def loss(self, core: int, extra: float = 0.0) -> float:
        """What the holder loses of `core` with its sharers (and one more of weight `extra`)."""
        others = self.load.get(core, ())
        if not others and not extra:
            return 0.0
        return 1.0 - core_share(self.per_core, 0.0, [*others, extra] if extra else others)


@functools.lru_cache(maxsize=64)
def narrowest_host(spec: TimeShareSpec, most: int = 1 << 16) -> int:
    """The fewest cores a host needs: a one-core sharer gets at least `min_share` of its core
    and takes at most `max_holder_loss` of the host's cores' worth (both grow with the host's
    cores); `most` + 1 when none does up to `most`."""
    m = 1
    while m <= most:
        top = core_share(spec.weight, 1.0 / m)
        if top >= spec.min_share and top <= spec.max_holder_loss * m + 1e-9:
            return m
        m += 1
    return most + 1


HostCache = dict[str, tuple[int, list[_Host]]]
"""CPU node -> (its `CpuNode.version`, its hosts as of then): kept by the caller across rounds,
so a round looks at the running allocations of a node only when they changed."""


def time_sharers(
    started: Iterable[Allocation],
    order: Iterable[QueuedAction],
    queue: WaitingQueue,
    state: ClusterState,
    spec: TimeShareSpec,
    observed: Observed,
    now_s: float,
    cache: HostCache | None = None,
) -> list[Allocation]:
    """This round's sharers (`Allocation.shares`), in FCFS order (see the module doc).
    `started`: the round's allocations and riders (applied before the sharers); `order`: the
    waiting queue in the order the round considered it; `cache`: the hosts found by earlier
    rounds (filled in here)."""
    planner = _Planner(state, queue, spec, observed, now_s, {} if cache is None else cache)
    if not planner.open:
        return []
    for a in started:
        planner.starting(a)
    out: list[Allocation] = []
    short: dict[tuple[str, int], bool] = {}
    cpu = ResourceKind.CPU
    open_nodes, busy, running, pins = (
        planner.open,
        planner.busy,
        state.trajectory_running,
        state.trajectory_node,
    )
    for qa in _walk(order, queue, state, open_nodes):
        if not open_nodes:
            break
        cost = qa.cost
        if cost.key is not cpu or len(cost.units.units) != 1:
            continue
        tid = qa.trajectory_id
        if tid in busy or tid in running:
            continue  # it waits for its sandbox (or starts this round)
        if cost.sandbox and pins.get(tid, "") not in open_nodes and tid in pins:
            continue  # its node has no room left
        units = cost.units.units[0]
        key = (qa.kind, units)
        ok = short.get(key)
        if ok is None:
            d = observed(qa, units)
            ok = short[key] = d is not None and d <= spec.max_action_s
        if not ok:
            continue  # it waits for cores of its own, which sharers never take
        sharer = planner.place(qa, units)
        if sharer is not None:
            out.append(sharer)
    return out


def _walk(
    order: Iterable[QueuedAction], queue: WaitingQueue, state: ClusterState, nodes: set[str], most: int = 4
) -> Iterable[QueuedAction]:
    """The waiting actions to consider, in the order of `order`. With the queue itself (one
    job), only those that could share: with at most `most` nodes where a host has room, the
    CPU actions pinned to those nodes and the unpinned ones (`WaitingQueue.routes`), merged in
    FCFS order; else its rigid CPU actions (`WaitingQueue.rigid_cpu`). With thousands waiting a
    walk over the whole queue was most of a round, and most of them could not share."""
    if order is not queue:
        return order
    if len(nodes) > most:
        return queue.rigid_cpu()
    routes = queue.routes(state)
    lists = [routes.on_node[n].values() for n in sorted(nodes) if n in routes.on_node]
    if routes.unpinned:
        lists.append(routes.unpinned.values())
    if len(lists) <= 1:
        return lists[0] if lists else ()
    return heapq.merge(*lists, key=lambda a: queue.position(a.action_id))


class _Planner:
    """The round's view for placing sharers: hosts per node (built when a node is first
    looked at), memory per node, trajectories starting, what eviction may still take."""

    def __init__(
        self,
        state: ClusterState,
        queue: WaitingQueue,
        spec: TimeShareSpec,
        observed: Observed,
        now_s: float,
        cache: HostCache,
    ) -> None:
        self.state = state
        self.queue = queue
        self.spec = spec
        self.now_s = now_s
        self._cache = cache
        # nodes where a sharer may find room: online (offline ones are not), and not known to
        # have every host full
        self.open = {
            n
            for n, node in state.cpu.items()
            if node.online and (n not in cache or cache[n][1] or cache[n][0] != node.version)
        }
        self.started: set[str] = set()
        self.busy: set[str] = set()  # trajectories with an action starting this round
        self.mem_used: dict[str, int] = {}  # node -> memory reserved by the round so far
        self.drained: set[str] = set()  # nodes where the round evicted: no memory left this round
        self.no_memory = False  # a new trajectory's sharer lacked memory: later new ones wait
        self._hosts: dict[str, list[_Host]] = {}
        self.narrowest = narrowest_host(spec)
        self._mem_free: dict[str, int] = {}
        self._evictions: Evictions | None = None
        self._victims: set[str] = set()

    def starting(self, a: Allocation) -> None:
        """Count one of the round's allocations (or riders): its trajectory, memory, victims."""
        self.started.add(a.action_id)
        qa = self.queue.get(a.action_id)
        if qa is None:
            return
        self.busy.add(qa.trajectory_id)
        if a.kind is not ResourceKind.CPU:
            return
        if a.evict:
            self.drained.add(a.pool)  # an eviction's surplus is free from the next round on
            self._victims.update(a.evict)
        extra = self.state.memory_extra_mb(qa)
        if extra:
            self.mem_used[a.pool] = self.mem_used.get(a.pool, 0) + extra

    def place(self, qa: QueuedAction, units: int) -> Allocation | None:
        """A sharer allocation for `qa` at `units` cores, or None (closing nodes as FCFS asks)."""
        state = self.state
        pinned = state.trajectory_node.get(qa.trajectory_id) if qa.cost.sandbox else None
        if pinned is not None:
            nodes = [pinned] if pinned in self.open else []
        else:
            if self.no_memory and qa.cost.sandbox:
                return None
            nodes = sorted(self.open, key=lambda n: (-self.memory_free_mb(n), n))
            if qa.image and qa.cost.sandbox:  # a sharer starts at once: not behind a fetch
                nodes = [n for n in nodes if image_ready(state.cpu[n].store, qa.trajectory_id, qa.image)]
        lacked_memory = False
        for node in nodes:
            pick = self._best(node, units)
            if pick is None:
                self.open.discard(node)  # no room: no later sharer overtakes it here
                continue
            evict = self._memory(qa, node)
            if evict is None:
                lacked_memory = True
                continue
            host, cores, _ = pick
            hosts = self._hosts[node]
            i = hosts.index(host)
            hosts[i] = host = host.copy()  # the cached one stays as the state has it
            mine = self.spec.weight / units
            for c in cores:
                before = host.loss(c)
                host.load.setdefault(c, []).append(mine)
                host.lost += host.loss(c) - before
            extra = state.memory_extra_mb(qa)
            if extra:
                self.mem_used[node] = self.mem_used.get(node, 0) + extra
            if evict:
                self._victims.update(evict)
                self.drained.add(node)
            self.started.add(qa.action_id)
            self.busy.add(qa.trajectory_id)
            return Allocation(qa.action_id, ResourceKind.CPU, node, units, cores, evict, shares=True)
        if lacked_memory and pinned is None:
            self.no_memory = True
        return None

    def memory_free_mb(self, node: str) -> int:
        if node in self.drained:
            return 0
        free = self._mem_free.get(node)
        if free is None:  # a sum over the node's trajectories: once per round
            free = self._mem_free[node] = self.state.cpu[node].memory_free_mb
        return free - self.mem_used.get(node, 0)

    def _memory(self, qa: QueuedAction, node: str) -> tuple[str, ...] | None:
        """The idle trajectories to evict on `node` for `qa`'s memory (() when it fits), or None."""
        extra = self.state.memory_extra_mb(qa)
        short_mb = extra - self.memory_free_mb(node)
        if extra <= 0 or short_mb <= 0:
            return ()
        if node in self.drained:
            return None  # what the round's eviction freed beyond its need is not free yet
        if self._evictions is None:
            self._evictions = Evictions(self.state, self.queue)
            self._evictions.take(tuple(self._victims))
        victims = self._evictions.victims(node, short_mb)
        if victims is not None:
            self._evictions.take(victims)
        return victims

    def _best(self, node: str, units: int) -> tuple[_Host, tuple[int, ...], float] | None:
        """The host on `node` where a sharer of `units` cores gets the most of each (and its
        cores), at least `min_share`; None when no host has room."""
        hosts = self._hosts.get(node)
        if hosts is None:
            version = self.state.cpu[node].version
            hit = self._cache.get(node)
            if hit is None or hit[0] != version:
                hit = self._cache[node] = (version, self._find_hosts(node))
            hosts = self._hosts[node] = list(hit[1])  # a host is copied when a sharer joins it
        spec = self.spec
        mine = spec.weight / units
        best: tuple[_Host, tuple[int, ...], float] | None = None
        full: list[_Host] = []
        for h in hosts:
            top = core_share(mine, h.per_core)  # on a core of h with no sharer yet
            if top < spec.min_share or (best is not None and top <= best[2]):
                break  # hosts are ordered narrowest share last: none further does better
            # a sharer takes at least `top` of a core from its host (of k cores, k times the
            # top of one core or more)
            budget = spec.max_holder_loss * h.alloc.units - h.lost
            if budget < top * units - 1e-9:
                if budget < core_share(spec.weight, h.per_core) - 1e-9:
                    full.append(h)  # not even a one-core sharer fits
                continue
            load = h.load
            if spec.per_core == 1:
                room = [c for c in h.alloc.unit_ids if c not in load]
            else:
                room = [c for c in h.alloc.unit_ids if len(load.get(c, ())) < spec.per_core]
                room.sort(key=lambda c: sum(load.get(c, ())))
            if len(room) < units:
                if not room:
                    full.append(h)
                continue
            cores = tuple(sorted(room[:units]))
            share = min(core_share(mine, h.per_core, h.load.get(c, ())) for c in cores)
            if share < spec.min_share or (best is not None and share <= best[2]):
                continue
            if sum(h.loss(c, mine) - h.loss(c) for c in cores) <= budget + 1e-9:
                best = (h, cores, share)
        if full:
            cached = self._cache[node][1]
            for h in full:
                hosts.remove(h)
                if h in cached:  # as the state has it: full until the node changes
                    cached.remove(h)
        return best

    def _find_hosts(self, node: str) -> list[_Host]:
        """The running exclusive allocations of `node` that may host sharers, the widest (the
        one where a sharer gets most) first, then the one expected to run longest."""
        state, spec = self.state, self.spec
        cpu = state.cpu[node]
        narrowest = self.narrowest
        hosts: list[_Host] = []
        sharers: list[Allocation] = []
        for g in range(len(cpu.numa)):
            for aid, a in state.running_in(ResourceKind.CPU, node, g).items():
                if a.shares:
                    sharers.append(a)
                elif a.units >= narrowest and aid not in state.shared and not cpu.riders.get(a.unit_ids):
                    end_s = state.expected_end_s.get(aid, self.now_s)
                    hosts.append(_Host(a, 1.0 / a.units, end_s))
        if sharers:
            by_core = {c: h for h in hosts for c in h.alloc.unit_ids}
            for s in sharers:
                for c in s.unit_ids:
                    h = by_core.get(c)
                    if h is not None:
                        h.load.setdefault(c, []).append(spec.weight / s.units)
            for h in hosts:
                h.lost = sum(h.loss(c) for c in h.load)
            hosts = [h for h in hosts if h.has_room(spec)]
        hosts.sort(key=lambda h: (h.per_core, -h.end_s))
        return hosts


def oversubscribed(state: ClusterState, spec: TimeShareSpec) -> list[str]:
    """Violations of the sharing bounds (empty when they hold): a core with more than
    `per_core` sharers, a sharer on a free core, or a vacated core with no sharer left."""
    out = []
    for name, node in state.cpu.items():
        for c, n in node.sharers.items():
            if n > spec.per_core:
                out.append(f"core {c} of {name} has {n} sharers (at most {spec.per_core})")
            if c in node.free:
                out.append(f"core {c} of {name} is free while {n} sharer(s) run on it")
        for c in node.vacated:
            if c not in node.sharers:
                out.append(f"core {c} of {name} is held for sharers but none runs on it")
    return out
